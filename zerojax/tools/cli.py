"""The ``zerojax`` command line: train, finetune, plan, estimate, compile, config, export.

Run ``zerojax COMMAND --help`` for each command. ``python -m zerojax.tools.cli`` is the same
program.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import math
import os
import re
import sys
import textwrap
from typing import Any, Sequence

from zerojax import __version__
from zerojax.core.config import ConfigError, HostOffload
from zerojax.core.launch_env import DistributedInitError
from zerojax.tools import launch
from zerojax.tools.config_file import load_config
from zerojax.tools.options import OUTPUT_PACKAGES, TrainOptions

__all__ = ["parse_bytes", "parse_count", "build_parser", "main"]

PROG = "zerojax"

# Exit statuses, the same for every command (README, "Command line"): 0 done; 1 a negative
# answer (estimate/compile: nothing fits, the step does not fit; train: no step ran) or an
# unexpected error (a Python traceback); 2 the input is wrong (an argument, a missing or
# invalid file, a bad config value), as argparse exits for a bad argument.
EXIT_OK, EXIT_NO, EXIT_INPUT = 0, 1, 2
DEBUG_HELP = ("show the Python traceback of an input error (a bad value, file, checkpoint, "
              "nvme_path) instead of its one-line message")

EPILOG_OVERRIDES = """\
overrides are key=value pairs (values parsed as YAML: 2, 1e-3, true, [2,4], null):
  * ZeroConfig fields, e.g. stage=2 mesh_shape=[2,4] mesh_axes=[replica,fsdp] remat=full
  * training options, bare or as train.KEY, e.g. steps=100 lr=1e-3 model=tiny out_dir=runs/a
"""


# -- byte and count parsing -------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_COUNTS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_bytes(text: str) -> float:
  """A byte size as the command line writes it.

  Args:
    text: e.g. ``'16GB'`` (16e9), ``'80GiB'`` (80 * 2**30) or ``'1.5e10'``.

  Returns:
    The bytes.

  Raises:
    argparse.ArgumentTypeError: ``text`` is not a byte size.
  """
  m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-zA-Z]*)\s*", str(text))
  if not m or m.group(2).lower() not in _UNITS:
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a byte size; use e.g. 16GB, 80GiB, 512MiB or 1.6e10")
  return float(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_count(text: str) -> float:
  """A parameter count as the command line writes it.

  Args:
    text: e.g. ``'7.5e9'``, ``'7.5B'`` or ``'89M'``.

  Returns:
    The count.

  Raises:
    argparse.ArgumentTypeError: ``text`` is not a parameter count.
  """
  m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-zA-Z]?)\s*", str(text))
  if not m or m.group(2).lower() not in _COUNTS:
    raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count; use e.g. 7.5e9, "
                                     "7.5B or 89M")
  return float(m.group(1)) * _COUNTS[m.group(2).lower()]


# -- commands ---------------------------------------------------------------------------------
# The commands import JAX-backed modules inside their bodies (marked "lazy: JAX"): `zerojax
# --help`, `zerojax config` and argument errors then start in a fraction of a second.


def _join_process_group() -> None:
  """Joins the process group of the launcher that started this command (``zerojax launch``,
  srun, torchrun, the ``JAX_COORDINATOR_*`` variables), before anything touches a device;
  alone, nothing happens. First of all: a process whose input is wrong then stops its peers
  (the peer watch) instead of leaving them waiting for it to join."""
  from zerojax.core import distributed  # lazy: JAX
  distributed.initialize()


def cmd_train(args) -> int:
  """``zerojax train``: trains the GPT example from a config plus overrides.

  Args:
    args: the parsed command line.

  Returns:
    The exit status (1 where no step ran).
  """
  _join_process_group()
  loaded = load_config(args.config, args.overrides)
  from zerojax.tools import train as zt  # lazy: JAX
  opts = TrainOptions(**loaded.train)
  if args.no_progress:
    opts.progress = False
  if args.no_resume:
    opts.resume = False
  if args.overwrite:
    opts.overwrite = True
  zt.setup_cpu_devices(opts.cpu_devices)
  notes = [f"DeepSpeed {n}" for n in loaded.notes]
  if loaded.xla_flags:
    notes.append(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
  result = zt.train(loaded.config, opts, xla_notes=notes)
  return 0 if result.history else 1


def cmd_finetune(args) -> int:
  """``zerojax finetune``: fine-tunes a model (`zerojax.tools.finetune.run`).

  Args:
    args: the parsed command line.

  Returns:
    The exit status.
  """
  _join_process_group()
  from zerojax.tools import finetune  # lazy: JAX
  return finetune.run(args)


def _shapes_only() -> None:
  """For work on shapes alone (``plan``; ``estimate`` without a compiled step): JAX gets only
  its CPU backend, so no accelerator plugin (libtpu, CUDA) is started, or prints its start-up
  warnings, for a command that uses no device. A ``JAX_PLATFORMS`` the user set, or a backend
  already started, is left as it is."""
  import jax  # lazy: JAX
  from zerojax._compat import backends_initialized  # lazy: JAX
  if os.environ.get("JAX_PLATFORMS") or backends_initialized():
    return
  jax.config.update("jax_platforms", "cpu")


def cmd_plan(args) -> int:
  """``zerojax plan``: prints the sharding table for a model and config.

  Args:
    args: the parsed command line.

  Returns:
    The exit status.
  """
  loaded = load_config(args.config, args.overrides, apply_xla_flags=False,
                       for_training=False)
  from zerojax.tools import estimate, train as zt  # lazy: JAX
  model_name = args.model or loaded.train.get("model", "small")
  n = args.devices
  _shapes_only()
  zt.setup_cpu_devices(n)
  plan, psi = estimate.abstract_plan(model_name, loaded.config, n)
  print(f"model {model_name}: {psi:,} parameters, planned for {n} devices "
        "(no devices are used)")
  print(plan.table())
  if (nothing := zt.nothing_sharded_note(plan)) is not None:
    print(nothing)
  for note in loaded.notes:
    print(f"DeepSpeed {note}")
  return 0


def cmd_estimate(args) -> int:
  """``zerojax estimate``: prints the model-state memory per device at each stage.

  Args:
    args: the parsed command line.

  Returns:
    The exit status.
  """
  if (args.params is None) == (args.model is None):
    raise ConfigError("estimate needs exactly one of --params N (the ZeRO paper's assumptions) "
                      "or --model PRESET (real shapes and dtypes)")
  from zerojax.tools import estimate  # lazy: JAX
  n = args.devices
  config = None
  if args.params is not None:
    psi = args.params
    options = estimate.paper_options(psi, n, args.k)
    title = (f"ZeRO model-state memory per device: Ψ = {psi:.3g} parameters, N = {n} devices, "
             f"mixed-precision Adam (2Ψ fp16 params + 2Ψ fp16 grads + {args.k}Ψ optimizer "
             "state; the paper's Figure 1)")
  else:
    config = load_config(args.config, args.overrides, apply_xla_flags=False,
                         for_training=False).config
    options, psi, title = _model_options(args, config)
  shown = options if (args.fit is not None or args.offload) else options[:4]
  fit, extra_flags, compile_note = _fit(args, options, config)
  if args.json:
    _print_json(args, shown, psi, fit, extra_flags)
  else:
    print(estimate.format_table(shown, title))
    print("(model states only: activations, temporaries and framework overhead come on top)")
  rc = 0
  if fit is not None and not args.json:
    rc = _print_fit(args, options, fit, extra_flags, compile_note)
  elif fit is not None:
    rc = 0 if fit[0] else 1
  if args.plot:
    n = args.devices
    path = estimate.plot_options(shown, args.plot, title if len(title) < 100 else
                                 title[:title.index(",") + 1] + f" N={n}", args.fit)
    print(f"wrote {path}")
  return rc


def _model_options(args, config) -> tuple[list, int, str]:
  """``estimate --model``: the options of a preset's real tree, its size and the title."""
  from zerojax.tools import estimate, train as zt  # lazy: JAX
  n = args.devices
  if args.fit is not None and not args.no_compile:
    zt.setup_cpu_devices(n)  # the compiled peak needs the devices (simulated on CPU)
  else:
    _shapes_only()
  options, psi = estimate.preset_options(args.model, config, n)
  from zerojax.core import backend  # lazy: JAX
  t = backend.CPU.persistence_threshold(config)  # the estimate's devices are simulated CPUs
  kept = (f"leaves below param_persistence_threshold={t:,} elements or with no dimension "
          f"divisible by {n} stay replicated" if t else
          f"every leaf with a dimension divisible by {n} is sharded (the others stay "
          "replicated)")
  title = (f"model-state memory per device: {args.model} ({psi:,} parameters, "
           f"param_dtype {config.param_dtype}, optax.adamw), {n} devices; {kept}")
  return options, psi, title


def _fit(args, options, config) -> tuple[tuple | None, str, str | None]:
  """``--fit``: ``((best, why, compiled peaks) or None, extra overrides, compile note)``."""
  from zerojax.tools import estimate  # lazy: JAX
  if args.fit is None:
    return None, "", None
  if args.model is None:  # the paper's assumptions: no model
    return (*estimate.recommend(options, args.fit), {}), "", None
  compile_note = _compile_note(args, args.devices)
  if compile_note is not None:
    return (*estimate.recommend(options, args.fit), {}), "", compile_note
  per_use: dict[str, int] = {}  # options whose peak is gather='explicit''s (and auto's)
  fit = estimate.recommend_compiled(options, args.fit, _compiled_peak(args, config, per_use))
  extra_flags = " gather=explicit" if fit[0] is not None and fit[0].name in per_use else ""
  return fit, extra_flags, None


def _compiled_peak(args, config, per_use: dict[str, int]):
  """``option -> peak`` of the compiled step (`recommend_compiled`); records in ``per_use``
  the options whose lower peak is zerojax's per-use gathering."""
  from zerojax.tools import estimate  # lazy: JAX
  batch = args.batch or args.devices

  def peak(o):
    offload = (HostOffload(o.offload_optimizer, o.offload_params)
               if o.offload_optimizer or o.offload_params else None)
    cfg = config.replace(stage=o.stage, offload=offload)
    p = estimate.step_peak(args.model, cfg, batch, args.seq)
    if not _partitioner_gathers(cfg):
      return p
    # zerojax's own per-use gathers may need less than XLA:CPU's partitioner: the lower one is
    # kept (docs/design.md, "zerojax estimate --fit").
    q = estimate.step_peak(args.model, cfg.replace(gather="explicit"), batch, args.seq)
    if q >= p:
      return p, f"gather=explicit would need {estimate.fmt_bytes(q)}"
    per_use[o.name] = p
    return q, f"gather=explicit; with gather=auto, XLA's partitioner: {estimate.fmt_bytes(p)}"
  return peak


def _print_json(args, shown, psi, fit, extra_flags) -> None:
  out = {"devices": args.devices, "params": psi,
         "options": [{**dataclasses.asdict(o), "device": o.device} for o in shown]}
  if fit is not None:
    best, why, peaks = fit
    out["fit"] = {"budget": args.fit, "recommendation": best.name if best else None,
                  "why": why, "compiled_peak": peaks,
                  "gather": "explicit" if extra_flags else None}
  print(json.dumps(out, indent=1))


def _print_fit(args, options, fit, extra_flags, compile_note) -> int:
  """The ``--fit`` verdict under the table; the exit status (1: nothing fits)."""
  from zerojax.tools.estimate import fmt_bytes  # lazy: JAX
  best, why, peaks = fit
  n = args.devices
  if compile_note:
    print(compile_note)
  elif args.model is not None:
    from zerojax.tools.estimate import model_seq_len  # lazy: JAX
    seq = model_seq_len(args.model, args.seq)  # a GPT preset's, or an HF model's
    print(f"compiled peaks: the real training step (AdamW) for a batch of {args.batch or n} "
          f"rows x {seq} tokens over {n} devices, compiled only")
  print(f"\n--fit {fmt_bytes(args.fit)} per device, lowest communication first:")
  for w in why:
    print(f"  {w}")
  if best is None and peaks:
    print("nothing fits: every option whose model state fits compiles to a step that does "
          "not; use a smaller --batch, remat=full, more devices or a smaller model")
    return 1
  if best is None:
    full = options[-1]
    need = math.ceil(n * full.device / args.fit) if args.fit > 0 else float("inf")
    print(f"nothing fits: even {full.name} keeps {fmt_bytes(full.device)} per device; use more "
          f"devices (about {need}) or a smaller model")
    return 1
  # the overrides to type (config construction: the option's stage number as a ZeroConfig key)
  flags = f"stage={best.stage}" + (" offload_optimizer=true" if best.offload_optimizer
                                    else "") + (" offload_params=true"
                                                if best.offload_params else "")
  flags += extra_flags
  print(f"recommendation: {best.name}{' with' + extra_flags if extra_flags else ''} "
        f"(communication {best.comm}); zerojax overrides: {flags}")
  return 0


def cmd_compile(args) -> int:
  """``zerojax compile``: compiles the step for a TPU or GPU pod and reports whether it fits.

  Args:
    args: the parsed command line.

  Returns:
    The exit status.
  """
  loaded = load_config(args.config, args.overrides, apply_xla_flags=False,
                       for_training=False)
  from zerojax.tools import estimate  # lazy: JAX
  # An ahead-of-time compile runs nothing here: the CPU stays the default backend, so no
  # accelerator runtime starts (or prints its start-up errors) on a machine without one.
  _shapes_only()
  try:
    rows, reading = _global_batch(args, loaded.config)
    r = estimate.compile_for_topology(loaded.config, args.model, (rows, args.seq),
                                      args.topology, memory_fraction=args.memory_fraction)
  except ImportError as e:
    print(f"{PROG} compile: error: {e}", file=sys.stderr)
    return 2
  print(f"model {args.model}, global batch {rows} x {args.seq} tokens, {args.topology}"
        + (f" ({reading})" if reading else ""))
  platform = "gpu" if args.topology.split(":")[0] in _gpu_names() else "tpu"
  if (note := estimate.attention_note(estimate.preset_model(args.model, loaded.config,
                                                            args.seq, platform))):
    print(note)
  print(r.table())
  for note in loaded.notes:
    print(f"DeepSpeed {note}")
  return 2 if r.compiler_failed else (0 if r.fits else 1)


def _global_batch(args, config) -> tuple[int, str | None]:
  """The global rows `compile` compiles, and how ``--batch``/``--batch-per-device`` read.

  ``--batch`` is the global batch, as in ``zerojax train``. A ``--batch`` smaller than the
  data-parallel device count cannot be a global batch of a data-parallel step, so it is read
  as rows per device, the way DeepSpeed's ``train_micro_batch_size_per_gpu`` and the Trainer's
  ``per_device_train_batch_size`` count, and the header says so.
  """
  from zerojax.core.mesh import mesh_shape  # lazy: JAX
  from zerojax.runtime import memory
  given = [f for f, v in (("--batch", args.batch), ("--batch-per-device", args.batch_per_device))
           if v is not None]
  if len(given) != 1:
    raise ConfigError(f"compile: give exactly one of --batch (global rows) and "
                      f"--batch-per-device (rows per data-parallel device); got "
                      f"{' and '.join(given) or 'neither'}")
  value = args.batch if args.batch is not None else args.batch_per_device
  if args.seq < 1 or value < 1:
    raise ConfigError(f"{given[0]} {value} --seq {args.seq}: both must be >= 1")
  n = memory.topology_size(args.topology)
  shape = dict(zip(config.mesh_axes, mesh_shape(config.mesh_shape, config.mesh_axes, n)))
  dp = math.prod(shape.get(a, 1) for a in ("replica", "fsdp"))
  if args.batch_per_device is not None:
    return args.batch_per_device * dp, (f"{args.batch_per_device} rows per device x {dp} "
                                        "data-parallel devices")
  if args.batch % dp == 0:
    return args.batch, None
  if args.batch < dp:
    return args.batch * dp, (f"--batch {args.batch} read as rows per device: {args.batch} "
                             f"rows cannot be split over {dp} data-parallel devices; "
                             f"--batch-per-device {args.batch} says so")
  raise ConfigError(f"--batch {args.batch}: the global batch must be a multiple of the {dp} "
                    f"data-parallel devices of {args.topology}, e.g. --batch "
                    f"{args.batch // dp * dp} or {-(-args.batch // dp) * dp}; or give "
                    "--batch-per-device")


def _gpu_names() -> tuple[str, ...]:
  from zerojax.runtime import gpu  # lazy: JAX
  return tuple(gpu.GPUS)


def _partitioner_gathers(config) -> bool:
  """Whether a stage-3 step under ``config`` leaves its gathers to XLA's partitioner on this
  machine: ``gather='auto'`` on CPU devices, without a per-use feature (offloaded parameters,
  ``reduce_dtype``, ZeRO++). On accelerators ``'auto'`` gathers per use at stage 3 already."""
  if not config.shards_params or config.gather.mode != "auto" or config.per_use_settings:
    return False
  import jax  # lazy: JAX
  from zerojax.core import backend
  return not backend.for_platform(jax.devices()[0].platform).per_use_at(config)


def _compile_note(args, n: int) -> str | None:
  """Why `--fit` uses the model-state estimate alone, or None when it compiles the step."""
  if args.no_compile:
    return "(--no-compile: model-state estimate only; activations and temporaries come on top)"
  import jax  # lazy: JAX
  if jax.device_count() != n:
    return (f"(the compiled peak needs {n} devices, this machine has {jax.device_count()} "
            f"{jax.devices()[0].platform} devices: model-state estimate only; activations "
            "and temporaries come on top)")
  return None


def cmd_config(args) -> int:
  """``zerojax config``: prints what a (DeepSpeed) config maps to, as JSON.

  Args:
    args: the parsed command line.

  Returns:
    The exit status.
  """
  loaded = load_config(args.config, args.overrides, apply_xla_flags=False,
                       for_training=False)
  print(json.dumps({"zerojax": loaded.config.to_dict(), "train": loaded.train}, indent=1,
                   default=str))
  if loaded.xla_flags:
    print("XLA flags (added to XLA_FLAGS by `zerojax train`):")
    for f in loaded.xla_flags:
      print(f"  {f}")
  if loaded.notes:
    print("DeepSpeed keys:")
    for n in loaded.notes:
      print(f"  {n}")
  lines = []
  if loaded.config.quantized:
    from zerojax.core.zeropp import explain  # lazy: JAX, for ZeRO++ configs only
    lines = explain(loaded.config)
  if lines:
    print("ZeRO++ (quantised collectives):")
    for line in lines:
      print(f"  {line}")
  return 0


# -- errors -----------------------------------------------------------------------------------

DEBUG_ENV = "ZEROJAX_DEBUG"
# OSErrors the user fixes on their machine (space, permissions, a read-only disk), not zerojax.
_USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


def _debug_flag(argv: list[str]) -> tuple[list[str], bool]:
  """``argv`` without ``--debug`` (accepted anywhere before a ``--``, for every command), and
  whether tracebacks are wanted (``--debug``, or ``ZEROJAX_DEBUG=1``, which `--debug` sets
  for the processes a command starts, e.g. `zerojax launch`'s)."""
  end = argv.index("--") if "--" in argv else len(argv)
  debug = "--debug" in argv[:end]
  if debug:
    argv = [a for a in argv[:end] if a != "--debug"] + argv[end:]
    os.environ[DEBUG_ENV] = "1"
  return argv, debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _user_errors() -> tuple[type, ...]:
  """The exception classes that are input the user can fix: one line and exit 2 (a
  traceback only with ``--debug``). Classes of modules not loaded yet cannot have been
  raised, so they are looked up, not imported (the CLI starts without JAX)."""
  classes: list[type] = [ConfigError, KeyError, ValueError, OSError]
  for module, names in (("zerojax.runtime.checkpoint", ("CheckpointError",)),
                        ("zerojax.runtime.nvme_store", ("NvmeError",)),
                        ("zerojax.runtime.extras", ("MissingPackageError",))):
    m = sys.modules.get(module)
    if m is not None:
      classes += [getattr(m, n) for n in names]
  return tuple(classes)


def _is_user_error(e: BaseException) -> bool:
  """Of `_user_errors`' classes, an `OSError` is the user's only when a file is missing or
  the machine refuses a write (`_USER_ERRNOS`); any other stays a traceback."""
  return (not isinstance(e, OSError) or isinstance(e, FileNotFoundError)
          or e.errno in _USER_ERRNOS)


def _one_line_message(e: BaseException) -> str:
  msg = e.args[0] if isinstance(e, KeyError) and e.args else e
  return " ".join(str(msg).splitlines())


def cmd_export(argv: list[str]) -> int:
  """``zerojax export``: writes a checkpoint's parameters out (`zerojax.tools.export`).

  Args:
    argv: the arguments after ``export``, which its own parser reads.

  Returns:
    The exit status.
  """
  from zerojax.tools import export  # lazy: JAX
  rc = int(export.main(argv, prog=f"{PROG} export") or 0)
  # export.main answers a missing, damaged or mismatched checkpoint (the input) with 1; every
  # zerojax command exits 2 for an input error, as argparse does for a bad argument.
  return EXIT_INPUT if rc == 1 else rc


# -- parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
  """The ``zerojax`` parser.

  Returns:
    The parser, one subcommand per job (``export`` and ``launch`` parse their own arguments).
  """
  fmt = argparse.RawDescriptionHelpFormatter
  p = argparse.ArgumentParser(
      prog=PROG, formatter_class=fmt,
      description="zerojax: ZeRO stages 0-3 for JAX as sharding plans over a device mesh.",
      epilog="examples:\n"
             "  zerojax train configs/zero3.json steps=50 model=tiny\n"
             "  zerojax train configs/ds_zero3_offload.json      # a DeepSpeed ds_config.json\n"
             "  zerojax finetune MODEL_DIR --data train.jsonl --lora 16 steps=200\n"
             "  zerojax plan configs/zero2.json --model gpt-89m --devices 64\n"
             "  zerojax estimate --params 7.5e9 --devices 64     # the ZeRO paper's Figure 1\n"
             "  zerojax estimate --params 7.5e9 --devices 64 --fit 16GB --plot mem.png\n"
             "  zerojax compile configs/zero3.json --model gpt-7.5b --batch 64 --seq 1024 "
             "--topology v5e:8x8\n"
             "  zerojax config configs/ds_zero2.json             # what a DeepSpeed config maps to\n"
             "  zerojax export --help\n\n"
             "run `zerojax COMMAND --help` for a command's options.\n\n"
             "exit status: 0 done; 1 a negative answer (estimate --fit, compile: it does not "
             "fit) or an\nunexpected error; 2 bad input (an argument, a missing or invalid file "
             "or value).")
  p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
  p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
  sub = p.add_subparsers(dest="command", metavar="COMMAND")

  _add_train(sub, fmt)
  _add_finetune(sub, fmt)
  _add_plan(sub, fmt)
  _add_estimate(sub, fmt)
  _add_compile(sub, fmt)
  _add_config(sub, fmt)
  sub.add_parser("export", add_help=False, help="write consolidated weights from a checkpoint "
                 "(see `zerojax export --help`)")
  sub.add_parser("launch", add_help=False, help="run a script as N local processes "
                 "(multi-host on one machine; see `zerojax launch --help`)")
  for name, sp in sub.choices.items():  # `zerojax COMMAND ... --debug` (main strips it)
    if name not in ("export", "launch"):  # those two parse their own arguments
      sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                      help=DEBUG_HELP)
  return p


def _add_train(sub: Any, fmt: type) -> None:
  t = sub.add_parser(
      "train", formatter_class=fmt, help="train the GPT example from a config plus overrides",
      description=_wrap(
          "Train the byte-level GPT example with a zerojax or DeepSpeed config.",
          "Shows a progress bar (loss, tokens/s, ETA) and writes metrics.jsonl, TensorBoard "
          "event files, loss.png and run.json to out_dir. On multi-host runs only process 0 "
          "prints and writes. Without an accelerator it simulates cpu_devices (default 8) CPU "
          "devices."),
      epilog=EPILOG_OVERRIDES + "\n" + _train_options_help() + "\nexamples:\n"
             "  zerojax train configs/zero3.json steps=20 model=tiny\n"
             "  zerojax train configs/ds_zero3_offload.json lr=1e-3 "
             "out_dir=runs/offload")
  t.add_argument("config", nargs="?", help="zerojax (.json/.yaml) or DeepSpeed (.json) config; "
                 "default: ZeroConfig() (stage 3)")
  t.add_argument("overrides", nargs="*", metavar="key=value", help="config/option overrides")
  t.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
  t.add_argument("--no-resume", action="store_true",
                 help="start a new run at step 1 instead of resuming the latest checkpoint in "
                      "checkpoint_dir (a previous run's metrics.jsonl is moved aside)")
  t.add_argument("--overwrite", action="store_true",
                 help="delete the previous run's files in out_dir and its checkpoints in "
                      "checkpoint_dir, then start a new run")
  t.set_defaults(func=cmd_train)


def _add_finetune(sub: Any, fmt: type) -> None:
  f = sub.add_parser(
      "finetune", formatter_class=fmt,
      help="fine-tune a Hugging Face checkpoint on local data, then export it",
      description=_wrap(
          "Fine-tune a Hugging Face Llama, Qwen2, Qwen3 or Mistral checkpoint directory on a "
          "local data file, with the directory's own tokenizer and chat template, then export "
          "the result as a Hugging Face model directory (OUT_DIR/hf: the base config, "
          "generation config and tokenizer carried over, LoRA adapters merged).",
          "Data: JSONL with {\"text\": ...}, chat {\"messages\": [{\"role\", "
          "\"content\"}, ...]} or ShareGPT {\"conversations\": [{\"from\", \"value\"}, ...]} "
          "per line, Parquet with a text, messages or conversations column, or plain "
          "text (documents separated by a blank line). Documents are packed into seq_len rows "
          "that keep them apart in attention (--packing pad: one per row); chat data trains "
          "on the assistant's tokens only.",
          "The run is `zerojax train`'s loop: progress bar, metrics.jsonl, TensorBoard, "
          "checkpoints in out_dir/ckpt every checkpoint_every steps; run the same command "
          "again to resume exactly. CONFIG may be a DeepSpeed ds_config.json from an HF "
          "Trainer run: its \"auto\" values take this command's settings, else the "
          "Trainer's defaults."),
      epilog=EPILOG_OVERRIDES + "\nfine-tuning defaults (where neither the command nor the "
             "config sets them):\n  steps=100 batch=8 seq_len=512 lr=1e-5 (2e-4 with --lora) "
             "weight_decay=0.0\n  out_dir=runs/finetune checkpoint_every=50 "
             "checkpoint_dir=OUT_DIR/ckpt\n\nexamples:\n"
             "  zerojax finetune ~/models/Qwen2.5-0.5B --data train.jsonl steps=200 lr=2e-5\n"
             "  zerojax finetune ~/models/Llama-3.2-1B --data chat.jsonl --eval-data "
             "eval.jsonl --lora 16 configs/zero3.json\n"
             "  zerojax finetune ~/models/Mistral-7B --data docs.parquet ds_config.json "
             "batch=64 lr=1e-5")
  f.add_argument("model_dir", help="Hugging Face checkpoint directory (config.json, "
                 "safetensors, tokenizer), or a Hub id such as Qwen/Qwen2.5-0.5B (the local "
                 "cache, downloaded first if missing; HF_HUB_OFFLINE=1: the cache only)")
  f.add_argument("config", nargs="?", help="zerojax (.json/.yaml) or DeepSpeed (.json) config; "
                 "default: ZeroConfig() (stage 3)")
  f.add_argument("overrides", nargs="*", metavar="key=value", help="config/option overrides")
  f.add_argument("--data", default=None, metavar="FILE", help="training data (.jsonl, "
                 ".parquet, .txt)")
  f.add_argument("--eval-data", default=None, metavar="FILE",
                 help="evaluation data: eval_loss and eval_ppl every --eval-every steps")
  f.add_argument("--eval-every", type=int, default=50, metavar="N",
                 help="steps between evaluations (default 50; also the first and last step)")
  f.add_argument("--packing", choices=("pack", "pad"), default="pack",
                 help="pack documents into rows (default) or one document per padded row")
  f.add_argument("--lora", type=int, default=0, metavar="RANK",
                 help="train LoRA adapters of this rank only (default 0: full fine-tuning)")
  f.add_argument("--lora-alpha", type=float, default=16.0)
  f.add_argument("--lora-targets", default="q_proj,v_proj",
                 help="projections LoRA adapts (default q_proj,v_proj)")
  f.add_argument("--no-remat", action="store_true", help="keep activations (no recompute)")
  f.add_argument("--export-dir", default=None, help="Hugging Face export (default OUT_DIR/hf)")
  f.add_argument("--no-export", action="store_true", help="no Hugging Face export at the end")
  f.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
  f.add_argument("--no-resume", action="store_true", help="start a new run at step 1")
  f.add_argument("--overwrite", action="store_true",
                 help="delete the previous run's files and checkpoints, then start anew")
  f.set_defaults(func=cmd_finetune)


def _add_plan(sub: Any, fmt: type) -> None:
  pl = sub.add_parser(
      "plan", formatter_class=fmt, help="print the sharding table for a model and config",
      description=_wrap(
          "Print the sharding plan (path, shape, spec, bytes per device, why a leaf is or is "
          "not sharded) of a GPT preset under a config, for any device count. Nothing is "
          "trained and no devices are needed: the plan is made on an abstract mesh."),
      epilog=EPILOG_OVERRIDES + "\nexample:\n  zerojax plan configs/zero3.json --model gpt-89m "
             "--devices 64 param_persistence_threshold=0")
  pl.add_argument("config", nargs="?", help="zerojax or DeepSpeed config (default: stage 3)")
  pl.add_argument("overrides", nargs="*", metavar="key=value", help="ZeroConfig overrides")
  pl.add_argument("--model", default=None, help="GPT preset: tiny, small, gpt-89m (default: the "
                  "config's train.model, else small)")
  pl.add_argument("--devices", type=int, default=8, help="devices to plan for (default 8)")
  pl.set_defaults(func=cmd_plan)


def _add_estimate(sub: Any, fmt: type) -> None:
  e = sub.add_parser(
      "estimate", formatter_class=fmt, help="model-state memory per device at each stage",
      description=_wrap(
          "Model-state memory (parameters, gradients, optimizer state) per device at each ZeRO "
          "stage.",
          "--params N uses the ZeRO paper's assumptions (mixed-precision Adam: 2+2+K bytes per "
          "parameter, K=12); --params 7.5e9 --devices 64 reproduces the paper's Figure 1 "
          "(120 / 31.4 / 16.6 / 1.9 GB). --model PRESET plans a real model's leaves with their "
          "dtypes and optax.adamw state (zerojax.memory.estimate). GB = 1e9 bytes, as in the "
          "paper."),
      epilog="examples:\n  zerojax estimate --params 7.5e9 --devices 64\n"
             "  zerojax estimate --params 7.5B --devices 64 --fit 16GB\n"
             "  zerojax estimate --model gpt-89m --devices 8 --fit 500MB --plot mem.png\n"
             "  zerojax estimate --model gpt-89m --devices 8 configs/zero3_hsdp.yaml\n\n"
             "--fit picks the lowest-communication option that fits the budget, in the order\n"
             "stage 0 < 1 < 2 (2Ψ each) < 3 (3Ψ) < 3 + offload_optimizer < + offload_params.\n"
             "With --model an option must also fit by the compiled peak of the real training\n"
             "step (--batch rows of --seq tokens; compiled only, nothing is allocated).\n"
             "It exits with status 1 when nothing fits.")
  e.add_argument("config", nargs="?", help="config for --model (dtypes, mesh, threshold)")
  e.add_argument("overrides", nargs="*", metavar="key=value", help="ZeroConfig overrides")
  e.add_argument("--params", type=parse_count, default=None, metavar="N",
                 help="parameter count, e.g. 7.5e9 or 7.5B (the paper's assumptions)")
  e.add_argument("--model", default=None, help="GPT preset instead: tiny, small, gpt-89m")
  e.add_argument("--devices", type=int, default=64, help="data-parallel devices (default 64)")
  e.add_argument("--k", type=int, default=12,
                 help="optimizer bytes per parameter for --params (default 12: fp32 Adam "
                 "master weights, momentum, variance)")
  e.add_argument("--fit", type=parse_bytes, default=None, metavar="BYTES",
                 help="per-device budget, e.g. 16GB or 80GiB: recommend a stage (and offload)")
  e.add_argument("--offload", action="store_true", help="also show the offload options")
  e.add_argument("--batch", type=int, default=None, metavar="ROWS",
                 help="with --model --fit: global batch rows of the compiled step (default: "
                 "one row per device)")
  e.add_argument("--seq", type=int, default=None, metavar="TOKENS",
                 help="with --model --fit: tokens per row (default: the preset's seq_len)")
  e.add_argument("--no-compile", action="store_true",
                 help="with --model --fit: judge by the model-state estimate only")
  e.add_argument("--plot", nargs="?", const="zerojax_estimate.png", default=None,
                 metavar="PNG", help="draw the bars to PNG (default zerojax_estimate.png)")
  e.add_argument("--json", action="store_true", help="machine-readable output")
  e.set_defaults(func=cmd_estimate)


def _add_compile(sub: Any, fmt: type) -> None:
  cp = sub.add_parser(
      "compile", formatter_class=fmt, help="will it fit? compile the step for a TPU or GPU pod",
      description=_wrap(
          "Compile the real train step (stage, offload and remat from the config) ahead of "
          "time for a TPU or GPU topology, on this machine: no accelerator is needed and "
          "nothing is allocated. Prints per device the HBM arguments, outputs, temp and peak, "
          "the host (pinned_host) bytes, whether it fits, the collective bytes per step against "
          "the textbook ZeRO volume, collectives that move activations, the share of "
          "all-gather and reduce-scatter bytes overlapped with computation, and the compile "
          "time. TPUs need libtpu (pip install \"zerojax[tpu]\"); XLA:TPU refuses a step that "
          "does not fit. GPUs need JAX's CUDA plugin (pip install \"zerojax[cuda13]\", or [cuda12]); XLA:GPU "
          "compiles a step that does not fit, so the verdict compares the peak with the share "
          "of device memory the JAX GPU client allocates (--memory-fraction, default "
          "XLA_PYTHON_CLIENT_MEM_FRACTION or 0.75).",
          "Exit status: 0 fits, 1 does not fit (the compiler refused it or its peak exceeds "
          "the usable HBM), 2 bad input."),
      epilog=EPILOG_OVERRIDES + "\nexamples:\n"
             "  zerojax compile configs/zero3.json --model gpt-7.5b --batch 64 --seq 1024 "
             "--topology v5e:8x8\n"
             "  zerojax compile configs/ds_zero3_offload.json --model gpt-7.5b --batch 64 "
             "--seq 1024 --topology v5e:8x8 compute_dtype=bfloat16 remat=full\n\n"
             "  zerojax compile configs/zero3.json --model gpt-7.5b --batch 16 --seq 2048 "
             "--topology h100:8 compute_dtype=bfloat16\n\n"
             "topologies: " + ", ".join(("v5e:2x4", "v5e:8x8", "v5p:4x4x4", "v5p:8x8x8",
                                         "v4:2x2x1", "v6e:4x4", "h100:8", "h100:2x8",
                                         "a100-80g:8", "h200:8", "b200:8")) + ", ...")
  cp.add_argument("config", nargs="?", help="zerojax or DeepSpeed config (default: stage 3)")
  cp.add_argument("overrides", nargs="*", metavar="key=value", help="ZeroConfig overrides")
  cp.add_argument("--model", default="small", help="GPT preset: tiny, small, gpt-89m, gpt-7.5b, "
                  "gpt-70b (default small)")
  cp.add_argument("--batch", type=int, default=None,
                  help="global batch (rows per step); one smaller than the data-parallel "
                  "device count is read as rows per device")
  cp.add_argument("--batch-per-device", type=int, default=None, metavar="ROWS",
                  help="rows per data-parallel device (DeepSpeed's "
                  "train_micro_batch_size_per_gpu), instead of --batch")
  cp.add_argument("--seq", type=int, required=True, help="tokens per row")
  cp.add_argument("--topology", required=True,
                  help="TPU slice (v5e:8x8, v5p:4x4x4, ...) or GPU pod: h100:8 (one host), "
                  "h100:2x8 (hosts x GPUs), a100-80g:8, h200:8, b200:8")
  cp.add_argument("--memory-fraction", type=float, default=None,
                  help="GPU: share of device memory the JAX client allocates (default "
                  "XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75)")
  cp.set_defaults(func=cmd_compile)


def _add_config(sub: Any, fmt: type) -> None:
  c = sub.add_parser(
      "config", formatter_class=fmt, help="show what a (DeepSpeed) config maps to",
      description=_wrap(
          "Print the resolved ZeroConfig and training options of a config file; for a "
          "DeepSpeed ds_config.json also the XLA flags its keys become and a one-line note per "
          "key."), epilog=EPILOG_OVERRIDES)
  c.add_argument("config", help="zerojax or DeepSpeed config file")
  c.add_argument("overrides", nargs="*", metavar="key=value", help="overrides")
  c.set_defaults(func=cmd_config)


def _wrap(*paragraphs: str) -> str:
  return "\n\n".join(textwrap.fill(p, 79) for p in paragraphs)


def _train_options_help() -> str:
  parts = [f"{f.name}={f.default}" for f in dataclasses.fields(TrainOptions)
           if f.name != "scheduler"]
  auto = ", ".join(f"{f} ({m})" for f, (m, _) in OUTPUT_PACKAGES.items())
  return "training options and defaults:\n" + textwrap.fill(
      " ".join(parts), 79, initial_indent="  ", subsequent_indent="  ") + "\n" + textwrap.fill(
      f"None for {auto}: on when that package is installed", 79, initial_indent="  ",
      subsequent_indent="  ") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
  """The ``zerojax`` command.

  Input the user can fix (a bad config or file, a full disk, processes that disagree) is one
  line on stderr, not a traceback, unless ``--debug`` or ``ZEROJAX_DEBUG=1``.

  Args:
    argv: the arguments after the program name; None: ``sys.argv[1:]``.

  Returns:
    The exit status: the command's, ``EXIT_INPUT`` for input the user can fix, 2 without a
    command.
  """
  argv, debug = _debug_flag(list(sys.argv[1:] if argv is None else argv))
  if argv and argv[0] == "export":  # its own parser lives in zerojax.tools.export
    return cmd_export(argv[1:])
  if argv and argv[0] == "launch":  # its own parser lives in zerojax.tools.launch
    return int(launch.main(argv[1:]) or 0)
  parser = build_parser()
  # key=value overrides may follow options (`train cfg.json --no-progress steps=5`): argparse
  # leaves those as extras.
  args, extra = parser.parse_known_args(argv)
  bad = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
  if bad:
    parser.error(f"unrecognized arguments: {' '.join(bad)}")
  if extra:
    args.overrides = list(args.overrides) + extra
  if not getattr(args, "command", None):
    parser.print_help()
    return 2
  cfg = getattr(args, "config", None)
  if cfg and "=" in cfg and not os.path.exists(cfg):  # `zerojax train steps=5`: no config file
    args.overrides.insert(0, cfg)
    args.config = None
  try:
    return int(args.func(args) or 0)
  except _user_errors() as e:
    if debug or not _is_user_error(e):
      raise
    print(f"{PROG} {args.command}: error: {_one_line_message(e)}", file=sys.stderr)
    _end_process_group(e)
    return EXIT_INPUT
  except RuntimeError as e:  # the process group's errors; anything else is a bug: traceback
    if debug or not _is_process_group_error(e):
      raise
    print(f"{PROG} {args.command}: error: {_one_line(e)}", file=sys.stderr)
    _end_process_group(e)
    return EXIT_INPUT


def _is_process_group_error(e: BaseException) -> bool:
  """The run's processes could not start together or disagree: input the user can fix."""
  agreement = sys.modules.get("zerojax.core.agreement")  # loaded where it can be raised
  return isinstance(e, DistributedInitError) or (
      agreement is not None and isinstance(e, agreement.ProcessMismatchError))


def _one_line(e: BaseException) -> str:
  """A process-group error on one line: a `ProcessMismatchError` as its fields and values."""
  fields = getattr(e, "fields", None)
  if not fields:
    return " ".join(str(e).split())
  shown = "; ".join(f"{k} (" + ", ".join(f"process {i}: {v!r}" for i, v in enumerate(vals))
                    + ")" for k, vals in list(fields.items())[:4])
  more = f"; and {len(fields) - 4} more" if len(fields) > 4 else ""
  n = len(next(iter(fields.values())))
  return (f"the {n} processes of this run disagree on {len(fields)} setting(s), so none "
          f"starts: {shown}{more}; start every process with the same command, config and "
          "files")


def _end_process_group(e: BaseException) -> None:
  """In a multi-process run, ends this process now (exit 2) after its one-line error: its
  peers are told (the peer watch) and, for an error every process raises, process 0 waits
  for the others to print theirs; JAX's shutdown barrier, which waits for every process,
  is skipped."""
  distributed = sys.modules.get("zerojax.core.distributed")
  if distributed is None or not distributed.info().is_multiprocess:
    return
  from zerojax.core import agreement, peers  # lazy: JAX
  info = distributed.info()
  watch = peers.current()
  if watch is not None:
    watch.failed()
  if isinstance(e, agreement.ProcessMismatchError) or getattr(e, "on_every_process", False):
    agreement.wait_for_peers_to_report(info.process_id, info.num_processes)
  elif watch is not None:
    watch.wait_for_others_to_leave()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(EXIT_INPUT)


if __name__ == "__main__":
  sys.exit(main())
