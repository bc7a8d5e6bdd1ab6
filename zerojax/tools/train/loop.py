"""A reusable training loop for the GPT example: progress bar, metrics files and loss curve.

`train` runs ``ZeroConfig`` + `TrainOptions` end to end and leaves in ``out_dir``:

* ``metrics.jsonl``: one JSON object per optimizer step (``step``, ``loss``, ``grad_norm``,
  ``lr``, ``tokens_per_sec``, ``elapsed_sec``, and ``loss_scale`` under fp16); the timings are
  the step's own (`StepClock`: from the step's completion on the device), and the first step's
  ``tokens_per_sec`` is ``null`` (it carries compilation and warm-up);
* ``tb/<run id>/events.out.tfevents.*``: the same scalars as TensorBoard event files
  (``train/loss``, ...), one run directory per training run, written by ``tensorboardX`` (no
  TensorFlow needed; ``tensorboard --logdir out_dir`` reads them);
* ``loss.png``: the loss curve, drawn at the end;
* ``run.json``: the run id, the resolved `ZeroConfig` and `TrainOptions`.

With ``offload_optimizer='nvme'`` (ZeRO-Infinity, `zerojax.runtime.nvme`) the optimizer state
lives in files under ``nvme_path``: a new run writes them afresh, each step streams them through
the host update, each checkpoint snapshots them beside the orbax one
(``<checkpoint_dir>/nvme-<step>``), a resumed run restores them from its checkpoint, and
``metrics.jsonl`` gains ``nvme_read_mb_s``, ``nvme_write_mb_s``, ``nvme_update_s``,
``nvme_wait_s`` and ``nvme_wall_s`` (the step's host part).

With a ``checkpoint_dir`` that holds checkpoints, the same command resumes the run exactly
(`TrainOptions.resume`): ``metrics.jsonl`` and the TensorBoard run are continued. Two runs are
never mixed in one ``out_dir``: a previous run without a checkpoint is refused unless
``resume=False`` (``--no-resume``: its ``metrics.jsonl`` is moved aside) or
``overwrite=True`` (``--overwrite``: its files and checkpoints are deleted).

On multi-host runs only process 0 prints, shows the progress bar and writes files; every
process runs the same loop. The progress bar (tqdm) shows loss, tokens/s and the ETA.

The loop honours the config's batch sizes (``train = micro x accumulation x data parallel``),
``gradient_clipping`` and fp16 loss scaling through the step's own machinery
(`zerojax.value_and_grad` splits each global batch into micro-batches with one gradient
reduction per step; `zerojax.ZeroTrainState` clips, scales and skips overflowing steps on the
device). Metrics are fetched from the device only every ``log_every`` steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from zerojax import create_train_state, make_mesh, zero_step
from zerojax._compat import backends_initialized
from zerojax.core import distributed
from zerojax.core.config import ConfigError, ZeroConfig
from zerojax.models import GPT, PRESETS
from zerojax.runtime import memory, nvme
from zerojax.runtime.checkpoint import Checkpointer, resume_with_fallback
from zerojax.runtime.create import abstract_train_state
from zerojax.runtime.data import VOCAB_SIZE, TextBatches, load_bytes
from zerojax.tools.options import (DEFAULT_CORPUS, NonFiniteGradientsError, TrainOptions,
                                   resolve_outputs)
from zerojax.tools.train.metrics import (MetricsWriter, StepClock, device_memory, format_eta,
                                         is_main_process, log, log_line, peak_flops, plot_loss,
                                         read_jsonl, require, throughput)
from zerojax.tools.train.schedules import depends_on_steps, make_optimizer, make_schedule
from zerojax.tools.train.params_io import load_weights, save_weights
from zerojax.tools.train.processes import check_processes_agree, claim_out_dir

__all__ = ["setup_cpu_devices", "nothing_sharded_note", "Hook", "WriteMetrics", "ProgressBar",
           "SaveCheckpoints", "TrainResult", "Task", "resolve_config", "train"]


def setup_cpu_devices(n: int) -> None:
  """Simulates ``n`` CPU devices if JAX has not started yet and none were asked for.

  Only the CPU backend reads the setting, so it is harmless on accelerators.

  Args:
    n: the number of CPU devices.
  """
  if backends_initialized():
    return
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  jax.config.update("jax_num_cpu_devices", n)


def nothing_sharded_note(plan: Any) -> str | None:
  """Why a stage >= 1 plan shards no parameter leaf over ``fsdp`` (``None`` if it shards one).

  Such a run is plain data parallelism whatever its stage says; the line names the cause
  (leaves below ``param_persistence_threshold``, no dimension divisible by the ``fsdp`` size,
  an ``fsdp`` axis of size 1) and what to change.

  Args:
    plan: the run's `ShardingPlan`.

  Returns:
    One line naming the cause and the fix, or ``None`` when the plan shards a leaf (or its
    stage is 0).
  """
  if not plan.config.shards_opt_state or not plan.leaves or any(
      lp.is_sharded for lp in plan.leaves):
    return None
  counts: dict[str, int] = {}
  for lp in plan.leaves:
    counts[lp.reason] = counts.get(lp.reason, 0) + 1
  f, t = plan.mesh.shape.get("fsdp", 1), plan.backend.persistence_threshold(plan.config)
  largest = max(math.prod(lp.shape) for lp in plan.leaves)
  why = {"threshold": f"below param_persistence_threshold={t:,} elements (largest leaf: "
                      f"{largest:,})",
         "indivisible": f"with no dimension divisible by the fsdp size {f}",
         "fsdp=1": "on an fsdp axis of size 1"}
  parts = [f"{n} {why.get(r, f'replicated by {r}')}" for r, n in sorted(counts.items())]
  fixes = []
  if "threshold" in counts:
    fixes.append(f"param_persistence_threshold below {largest:,} or a larger model")
  if "fsdp=1" in counts:
    fixes.append("more devices on the fsdp axis")
  return (f"note: {plan.config.label} shards nothing here: all {len(plan.leaves)} "
          f"parameter leaves stay replicated ({'; '.join(parts)}), so this run is plain data "
          "parallelism" + (f"; for ZeRO sharding use {' or '.join(fixes)}" if fixes else ""))


# Options that may change when a run is resumed; any other difference is another run.
_RESUMABLE_CHANGES = {"steps", "log_every", "progress", "show_plan", "plot", "save_weights",
                      "checkpoint_every", "cpu_devices", "resume", "overwrite", "tensorboard"}


@dataclasses.dataclass
class _RunDirs:
  run_id: str
  tb_dir: str
  resume_step: int | None  # the checkpoint step to resume from
  notes: list[str]
  lengths: list[tuple[int, int]]  # (step, steps): the run's length from each resume on


def _previous_run(out_dir: str) -> tuple[dict | None, list[dict]]:
  run_json = os.path.join(out_dir, "run.json")
  run = None
  if os.path.isfile(run_json):
    try:
      with open(run_json) as f:
        run = json.load(f)
    except ValueError:
      run = None
  metrics = os.path.join(out_dir, "metrics.jsonl")
  records = read_jsonl(metrics) if os.path.isfile(metrics) else []
  return run, records


def _this_run(opts: TrainOptions, config: ZeroConfig) -> dict[str, Any]:
  """What ``run.json`` records of this run, as JSON values: ``{'config': ..., 'options': ...}``.
  Read once; a previous run's ``run.json`` is compared with it."""
  return json.loads(json.dumps({"config": config.to_flat(),
                                "options": dataclasses.asdict(opts)}))


def _prepare_run(opts: TrainOptions, this: dict[str, Any]) -> _RunDirs:
  """Decides whether this run resumes, starts beside a previous one or overwrites it, and
  arranges ``out_dir`` and ``checkpoint_dir`` for it (process 0 moves or deletes files; every
  process decides from the same files before anything changes). ``this`` is `_this_run`."""
  out_dir, ckdir = opts.out_dir, opts.checkpoint_dir
  latest = None
  if ckdir and os.path.isdir(ckdir):
    with Checkpointer(ckdir, read_only=True) as ck:
      latest = ck.latest_step()
  run, records = _previous_run(out_dir)
  notes: list[str] = []
  if jax.process_count() > 1:  # nobody changes a file before every process has read them
    multihost_utils.sync_global_devices("zerojax.tools.train: run directories read")

  if opts.overwrite:
    if is_main_process():
      _delete_previous(out_dir, ckdir, run)
    notes.append(f"--overwrite: deleted the previous run's files in {out_dir!r}"
                 + (f" and its checkpoints in {ckdir!r}" if ckdir else ""))
    run, records, latest = None, [], None
  elif opts.resume and latest is not None:
    notes += _resume_notes(opts, this, run, latest)
    run_id = (run or {}).get("run_id") or _new_run_id()
    notes.append(f"resuming from checkpoint step {latest} in {ckdir!r} (run {run_id}; "
                 "--no-resume or --overwrite for a new run)")
    lengths = _run_lengths(run, opts, latest)
    return _RunDirs(run_id, os.path.join(out_dir, "tb", run_id), latest, notes, lengths)
  elif latest is not None:  # --no-resume with checkpoints: the new run's would mix with them
    raise ConfigError(
        f"checkpoint_dir {ckdir!r} holds checkpoints of a previous run (latest step {latest}); "
        "--no-resume (resume=false) would mix this run's checkpoints with them. Resume it "
        "(drop --no-resume), delete it with --overwrite (overwrite=true), or choose another "
        "checkpoint_dir")
  elif records:
    notes.append(_move_metrics_aside(opts, run, records, this))
  run_id, n = _new_run_id(), 1
  base = run_id
  while os.path.exists(os.path.join(out_dir, "tb", run_id)) or (
      run is not None and run.get("run_id") == run_id):  # two runs within a second
    run_id, n = f"{base}-{n}", n + 1
  return _RunDirs(run_id, os.path.join(out_dir, "tb", run_id), None, notes, [(0, opts.steps)])


def _run_lengths(run: dict | None, opts: TrainOptions, at: int) -> list[tuple[int, int]]:
  """The run's lengths, ``(step, steps)`` oldest first, with this resume's when ``steps``
  changed (`zerojax.tools.train.schedules.run_schedule` shapes the schedule from them)."""
  run = run or {}
  lengths = [tuple(x) for x in run.get("lengths") or ()] or [
      (0, run.get("options", {}).get("steps", opts.steps))]
  if lengths[-1][1] != opts.steps:
    lengths.append((at, opts.steps))
  return lengths


def _length_note(opts: TrainOptions, dirs: _RunDirs, sched: Any) -> str | None:
  """What a change of ``steps`` on this resume does to the learning-rate schedule."""
  (_, old), (at, new) = dirs.lengths[-2:] if len(dirs.lengths) > 1 else ((0, 0), (None, 0))
  if at is None or at != dirs.resume_step:
    return None
  if not depends_on_steps(opts):
    return (f"steps {old} -> {new} on resume at step {at}: the learning-rate schedule does not "
            "depend on the run's length, so it goes on unchanged")
  fresh = make_schedule(opts, new)
  # sched(k) is the rate of step k + 1 (the optimizer's count before it)
  return (f"steps {old} -> {new} on resume at step {at}: the learning rate goes on from "
          f"{float(sched(at)):.4g} (step {at + 1}) along the rest of the {old}-step curve, "
          f"stretched to end at step {new} ({float(sched(new - 1)):.4g}); it does not jump to "
          f"the {new}-step curve ({float(fresh(at)):.4g} at step {at + 1})"
          + (" (the old run had ended: the rate stays at its curve's final value)" if at >= old
             else ""))


def _resume_notes(opts: TrainOptions, this: dict[str, Any], run: dict | None,
                  latest: int) -> list[str]:
  """Refuses to resume a run with other training options; notes a changed `ZeroConfig` (the
  checkpoint restores into the new plan)."""
  if run is None:
    return []
  old, new = run.get("options", {}), this["options"]
  diff = sorted(k for k in set(old) | set(new)
                if k not in _RESUMABLE_CHANGES and old.get(k) != new.get(k))
  if diff:
    what = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff[:6])
    raise ConfigError(
        f"checkpoint_dir {opts.checkpoint_dir!r} holds a run (latest step {latest}) with other "
        f"training options than this one ({what}); resuming it would mix two runs. Pass "
        "--no-resume (resume=false) with another checkpoint_dir to start a new run, or "
        "--overwrite (overwrite=true) to delete the old one first")
  old_cfg, new_cfg = run.get("config") or {}, this["config"]
  changed = sorted(k for k in set(old_cfg) | set(new_cfg) if old_cfg.get(k) != new_cfg.get(k))
  old_opt, new_opt = old_cfg.get("offload_optimizer"), new_cfg.get("offload_optimizer")
  if "offload_optimizer" in changed and "nvme" in (old_opt, new_opt):
    # An NVMe checkpoint keeps the optimizer state in files beside it, an in-memory one inside.
    raise ConfigError(
        f"ZeroConfig.offload_optimizer={new_opt!r} cannot resume checkpoint step {latest} in "
        f"{opts.checkpoint_dir!r}, saved with offload_optimizer={old_opt!r}: the optimizer "
        f"state is kept {'in files beside it' if old_opt == 'nvme' else 'inside it'}. Resume "
        f"with offload_optimizer={old_opt!r}, or start a new run (--overwrite, or --no-resume "
        "with another checkpoint_dir)")
  if not changed:  # e.g. another stage or mesh: the checkpoint restores into the new plan
    return []
  return ["resuming with a changed ZeroConfig: " + ", ".join(
      f"{k}: {old_cfg.get(k)!r} -> {new_cfg.get(k)!r}" for k in changed)]


def _move_metrics_aside(opts: TrainOptions, run: dict | None, records: list[dict],
                        this: dict[str, Any]) -> str:
  """A previous run's metrics without a checkpoint: refused when resuming, else moved aside
  (``--no-resume``); returns the note saying where. The same command stopped before its first
  checkpoint (killed, or failed) is not another run: it starts again from step 1."""
  out_dir, ckdir = opts.out_dir, opts.checkpoint_dir
  again = bool(ckdir) and run is not None and all(
      run.get(k) == this[k] for k in ("options", "config"))
  if opts.resume and not again:
    steps = f"steps {records[0].get('step')}..{records[-1].get('step')}"
    raise ConfigError(
        f"out_dir {opts.out_dir!r} holds the metrics of a previous run ({steps}"
        + (f", run {run['run_id']}" if run and run.get("run_id") else "")
        + ") and there is no checkpoint to resume it from"
        + (f" in checkpoint_dir {ckdir!r}" if ckdir else " (checkpoint_dir is not set)")
        + "; pass --no-resume (resume=false) to start a new run beside it, or --overwrite "
        "(overwrite=true) to delete it first")
  old_id = (run or {}).get("run_id") or time.strftime(
      "%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(os.path.join(out_dir, "metrics.jsonl"))))
  moved = os.path.join(out_dir, f"metrics.{old_id}.jsonl")
  if is_main_process():
    os.replace(os.path.join(out_dir, "metrics.jsonl"), moved)
  if opts.resume:
    return (f"run {old_id} stopped at step {records[-1].get('step')}, before its first "
            f"checkpoint: starting it again from step 1 (its metrics were moved to {moved!r})")
  return f"--no-resume: the previous run's metrics were moved to {moved!r}"


def _new_run_id() -> str:
  return time.strftime("%Y%m%d-%H%M%S")


def _delete_previous(out_dir: str, ckdir: str | None, run: dict | None) -> None:
  if os.path.isdir(out_dir):
    for name in os.listdir(out_dir):
      path = os.path.join(out_dir, name)
      ours = name in ("metrics.jsonl", "run.json", "loss.png", "weights.npz") or (
          name.startswith("events.out.tfevents.")) or (
          name.startswith("metrics.") and name.endswith(".jsonl"))  # moved-aside runs
      if ours and os.path.isfile(path):
        os.remove(path)
    shutil.rmtree(os.path.join(out_dir, "tb"), ignore_errors=True)
  if ckdir and os.path.isdir(ckdir):
    for name in os.listdir(ckdir):  # only numbered steps and their NVMe snapshots (nvme-<step>)
      if name.split(".")[0].removeprefix("nvme-").isdigit():
        path = os.path.join(ckdir, name)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


class Hook:
  """What the loop calls besides the step: progress, metrics and checkpointing are hooks.

  ``after_step(step, state, flush)`` runs after each step is dispatched (``flush()`` fetches
  the metrics of the steps still on the device and hands them to every hook first);
  ``on_records(records, previous_step)`` receives the records fetched since
  ``previous_step``; ``close()`` runs once at the end, also after an error. Subclass it and
  override what you need; the defaults do nothing.
  """

  def after_step(self, step: int, state: Any, flush: Callable[[], None]) -> None:
    """Runs after a step is dispatched, before its metrics are fetched.

    Args:
      step: the step just dispatched.
      state: the train state after it.
      flush: fetches the metrics of the steps still on the device and hands them to every
        hook's `on_records` first.
    """

  def on_records(self, records: list[dict], previous_step: int) -> None:
    """Receives the records fetched since the last call.

    Args:
      records: one per step, oldest first, as ``metrics.jsonl`` holds them.
      previous_step: the last step of the previous call's records (the run's first step
        minus one at first).
    """

  def close(self) -> None:
    pass


class WriteMetrics(Hook):
  """``metrics.jsonl`` and the TensorBoard run (`MetricsWriter`).

  Args:
    writer: the run's `MetricsWriter`.
  """

  def __init__(self, writer: MetricsWriter):
    self.writer = writer

  def on_records(self, records: list[dict], previous_step: int) -> None:
    """Writes each record (`Hook.on_records`), then flushes the files.

    Args:
      records: as `Hook.on_records`.
      previous_step: as `Hook.on_records`.
    """
    for rec in records:
      self.writer.write(rec)
    self.writer.flush()

  def close(self) -> None:
    self.writer.close()


class ProgressBar(Hook):
  """A tqdm bar with the latest loss and the run's tokens/s so far (`throughput`: the tokens
  of every step after this run's first over the time since the first finished; the final line
  prints the same number). Without ``tokens_per_step``, tokens/s is the latest step's own.
  Its ETA is the steps left at the pace since the run's first step finished: compilation is
  not in it (tqdm's own ETA would count it).

  Args:
    total: the run's last step.
    initial: the step it starts from (a resumed run's).
    tokens_per_step: tokens in one step's global batch.

  Raises:
    MissingPackageError: ``tqdm`` is not installed.
  """

  def __init__(self, total: int, initial: int, tokens_per_step: float | None = None):
    tqdm = require("tqdm.auto", "the progress bar (progress=false goes without)").tqdm
    self.bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                    dynamic_ncols=True, file=sys.stdout,
                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
    self.total = total
    self.tokens_per_step = tokens_per_step
    self.first: dict | None = None  # this run's first record (it carries compilation)

  def write(self, line: str) -> None:
    """Prints a log line above the bar.

    Args:
      line: the text.
    """
    self.bar.write(line, file=sys.stdout)

  def on_records(self, records: list[dict], previous_step: int) -> None:
    """Moves the bar to the last record's step, with its loss and throughput.

    Args:
      records: as `Hook.on_records`.
      previous_step: as `Hook.on_records`.
    """
    last = records[-1]
    self.first = self.first or records[0]
    tps = (last["tokens_per_sec"] if self.tokens_per_step is None else
           throughput([self.first, last], self.tokens_per_step))
    evals = [r for r in records if r.get("eval_loss") is not None]
    if evals:
      self.eval_loss = evals[-1]["eval_loss"]
    extra = {} if getattr(self, "eval_loss", None) is None else {
        "eval_loss": f"{self.eval_loss:.4f}"}
    if last.get("nvme_read_mb_s") is not None:  # offload_optimizer='nvme': the stream's rates
      extra["nvme_MB_s"] = f"r{last['nvme_read_mb_s']:,.0f}/w{last['nvme_write_mb_s'] or 0:,.0f}"
    eta = "-"
    if last is not self.first and last.get("elapsed_sec") is not None and (
        self.first.get("elapsed_sec") is not None) and last["step"] > self.first["step"]:
      per_step = (last["elapsed_sec"] - self.first["elapsed_sec"]) / (
          last["step"] - self.first["step"])
      eta = format_eta(per_step * (self.total - last["step"]))
    self.bar.set_postfix(loss=f"{last['loss'] or float('nan'):.4f}", **extra,
                         tok_s="-" if tps is None else f"{tps:,.0f}", eta=eta, refresh=False)
    self.bar.update(last["step"] - previous_step)

  def close(self) -> None:
    self.bar.close()


class LogLines(Hook):
  """One log line every ``log_every`` steps (and at the run's first and last), whatever the
  progress bar does: step, loss, tokens/s (as the bar's), MFU (``6 x parameters`` FLOPs per
  token over the devices' peak, `peak_flops`), the devices' live memory where the backend
  reports it, and the compiled step's per-device peak where it was measured (``show_plan``).
  """

  def __init__(self, total: int, log_every: int, tokens_per_step: float, num_params: int,
               devices: list, compiled_peak: Callable[[], int | None],
               write: Callable[[str], None] = log):
    self.total, self.log_every, self.tokens_per_step = total, log_every, tokens_per_step
    self.flops_per_token = 6.0 * num_params  # forward + backward of a dense model
    self.devices, self.compiled_peak, self.write = devices, compiled_peak, write
    peak = peak_flops(devices[0]) if devices else None
    self.peak = None if peak is None else peak * len(devices)
    self.first: dict | None = None

  def on_records(self, records: list[dict], previous_step: int) -> None:
    for rec in records:
      first = self.first is None
      self.first = self.first or rec
      if not (first or rec["step"] % self.log_every == 0 or rec["step"] == self.total):
        continue
      tps = throughput([self.first, rec], self.tokens_per_step)
      mfu = None if tps is None or self.peak is None else tps * self.flops_per_token / self.peak
      self.write(log_line(rec, self.total, tps, mfu, device_memory(self.devices),
                          self.compiled_peak()))


class SaveCheckpoints(Hook):
  """An asynchronous checkpoint every ``every`` steps and at the last step; with ``optimizer``
  (an NVMe run's `zerojax.runtime.nvme.NvmeOptimizer`) a synchronous one through its
  ``save_checkpoint``, which snapshots the optimizer-state files beside it.

  Args:
    checkpointer: the `zerojax.checkpoint.Checkpointer`.
    every: steps between checkpoints; ``None`` saves only at the last step.
    last: the run's last step.
    rng: the run's random key, saved with the state.
    data: returns the data loader's position, saved with the state.
    item: what to save of the state (default the state itself).
    model: the model description saved beside the state.
    optimizer: an NVMe run's `zerojax.runtime.nvme.NvmeOptimizer`.
  """

  def __init__(self, checkpointer: Any, every: int | None, last: int, rng: Any,
               data: Callable[[], dict], item: Callable[[Any], Any] | None = None,
               model: dict | None = None, optimizer: Any = None):
    self.checkpointer, self.every, self.last, self.rng, self.data = (
        checkpointer, every, last, rng, data)
    self.item, self.model, self.optimizer = item or (lambda state: state), model, optimizer

  def after_step(self, step: int, state: Any, flush: Callable[[], None]) -> None:
    """Saves a checkpoint at every ``every``-th step and at the last, after flushing the
    metrics before it.

    Args:
      step: as `Hook.after_step`.
      state: as `Hook.after_step`.
      flush: as `Hook.after_step`.
    """
    if step == self.last or (self.every and step % self.every == 0):
      # Metrics up to a checkpoint are on disk before it exists: a resumed run's
      # metrics.jsonl then has every step.
      flush()
      kw = dict(rng=self.rng, data=self.data(), model=self.model)
      if self.optimizer is not None:  # the files, then orbax's commit; waits for both
        self.optimizer.save_checkpoint(self.checkpointer, self.item(state), **kw)
      else:
        self.checkpointer.save(step, self.item(state), **kw)  # async

  def close(self) -> None:
    self.checkpointer.close()  # waits for the pending save


@dataclasses.dataclass
class TrainResult:
  """What `train` returns.

  Attributes:
    state: the final train state.
    plan: the run's `ShardingPlan`.
    history: the per-step metric records, as ``metrics.jsonl`` holds them.
    out_dir: the run's output directory.
    files: the files written, by kind (e.g. ``'metrics'``, ``'plot'``).
  """

  state: Any
  plan: Any
  history: list[dict]
  out_dir: str
  files: dict[str, str]


@dataclasses.dataclass
class Task:
  """What the loop trains and on which data; `train`'s default is the GPT preset on a byte
  corpus, `zerojax.tools.finetune` brings a Hugging Face checkpoint and its data.

  Attributes:
    name: the model's name in the log and the plot title.
    seq_len: tokens per row.
    setup: ``(config, mesh, tx, rng, resume_step) -> (state, plan, start, data_step)``: a new
      state (``resume_step`` None) or the checkpoint's, with its step and data position.
    make_step: ``plan -> step``, ``step(state, batch) -> (state, metrics)``; metrics hold
      ``loss``, ``grad_norm`` and ``overflow`` (a non-finite step), as device scalars.
    batches: ``(plan, rows, data_step) -> iterator`` of global batches with a ``step``
      attribute (its position, saved with each checkpoint).
    num_params: ``state -> int``.
    save_item: ``state -> what a checkpoint holds`` (default: the state).
    checkpoint_model: the model record a checkpoint keeps (`Checkpointer.save`'s ``model``).
    evaluate: ``state -> {"eval_loss": device scalar}`` or None; run every ``eval_every``
      steps (and at the first and last step); the records get ``eval_loss`` and ``eval_ppl``.
    eval_every: steps between evaluations (0: only at the last step).
    measure: compile the step once to print the per-device memory under ``show_plan``.
    nvme: ``setup`` and ``make_step`` keep the optimizer state on NVMe when the config says
      ``offload_optimizer='nvme'``; the loop refuses such a config for a task without.
    agreement: ``{field: value}`` every process of a multi-process run must share beyond the
      config and the options (model files, data files), compared before step 1.
  """

  name: str
  seq_len: int
  setup: Callable[..., tuple[Any, Any, int, int]]
  make_step: Callable[[Any], Callable[[Any, Any], tuple[Any, dict]]]
  batches: Callable[[Any, int, int], Any]
  num_params: Callable[[Any], int]
  save_item: Callable[[Any], Any] | None = None
  checkpoint_model: dict | None = None
  evaluate: Callable[[Any], dict] | None = None
  eval_every: int = 0
  measure: bool = False
  nvme: bool = False
  agreement: dict[str, Any] | None = None


def _gpt_task(opts: TrainOptions, config: ZeroConfig) -> Task:
  """The GPT preset ``opts.model`` on the byte corpus ``opts.corpus``; or a Hugging Face
  model's architecture (a preset of `zerojax.models.hf_presets`, a model directory, its
  config.json or a Hub id), from its init, on the same bytes."""
  if opts.model not in PRESETS:
    model, mcfg = _hf_model(opts, config)
  else:
    mcfg = dataclasses.replace(PRESETS[opts.model], vocab_size=VOCAB_SIZE,
                               dtype=jnp.dtype(config.compute_dtype))
    if opts.seq_len:
      mcfg = dataclasses.replace(mcfg, seq_len=opts.seq_len)
    model = GPT(mcfg)
  corpus = opts.corpus or os.fspath(DEFAULT_CORPUS)
  if not os.path.isfile(corpus):
    raise ConfigError(f"TrainOptions.corpus={corpus!r} is not a file; pass corpus=PATH to a text "
                      f"file (the bundled corpus is {DEFAULT_CORPUS})")
  if opts.init_from and not os.path.exists(opts.init_from):
    raise ConfigError(f"TrainOptions.init_from={opts.init_from!r} does not exist; pass a .npz "
                      "of consolidated weights (save_weights=true writes one) or a checkpoint "
                      "directory")
  tokens = load_bytes(corpus)
  sample = jnp.zeros((1, mcfg.seq_len), jnp.int32)  # shapes for init; the plan sets the batch

  def setup(config, mesh, tx, rng, resume_step):
    if resume_step is None:  # a new run writes NVMe optimizer-state files afresh
      state, plan = create_train_state(model, tx, rng, sample, config=config, mesh=mesh,
                                       overwrite=config.optimizer_on_nvme)
      if opts.init_from:
        state = state.replace(params=load_weights(opts.init_from, state.params, plan.params))
      return state, plan, 0, 0
    try:  # read straight into the plan's layout: nothing is initialised
      state, plan = abstract_train_state(model, tx, rng, sample, config=config, mesh=mesh)
      with Checkpointer(opts.checkpoint_dir, read_only=True) as ck:
        state, extras = ck.restore(state, plan, step=resume_step)
    except nvme.NvmeStateError as e:
      raise _nvme_resume_error(opts, config, resume_step, e) from e
    start = int(extras.step)
    if int(state.step) != start:
      raise ConfigError(f"checkpoint {opts.checkpoint_dir!r} step {start} holds a state at "
                        f"optimizer step {int(state.step)}; it was not written by this loop")
    return state, plan, start, int((extras.data or {}).get("batches_step", start))

  def batches(plan, rows, data_step):
    sh = plan.batch({"x": jax.ShapeDtypeStruct((rows, mcfg.seq_len), jnp.int32)})["x"]
    return TextBatches(tokens, rows, mcfg.seq_len, seed=opts.seed, sharding=sh, step=data_step)

  def make_step(plan):
    return zero_step(plan)(memory.lm_train_step)  # with NVMe, then the host update

  task = Task(opts.model, mcfg.seq_len, setup, make_step, batches,
              lambda state: memory.num_params(state.params), measure=True, nvme=True)
  return task


def _hf_model(opts: TrainOptions, config: ZeroConfig) -> tuple[Any, Any]:
  """``(LinenLlama, config with seq_len)`` of a Hugging Face model named by ``opts.model``."""
  from zerojax.tools import estimate  # late: estimate imports this package
  try:
    d = estimate.hf_model_config(opts.model)
  except ConfigError as e:
    raise ConfigError(f"TrainOptions.model={opts.model!r} is invalid: {e}") from None
  from zerojax.models.hf_presets import LinenLlama
  cfg = estimate._hf_llama_config(d, config, opts.model, jax.devices()[0].platform)
  if cfg.vocab_size < VOCAB_SIZE:
    raise ConfigError(f"TrainOptions.model={opts.model!r}: its vocab_size {cfg.vocab_size} is "
                      f"below the byte corpus's {VOCAB_SIZE} ids")
  seq = opts.seq_len or estimate.model_seq_len(opts.model)
  if seq > cfg.max_position_embeddings:
    raise ConfigError(f"seq_len={seq} is invalid for {opts.model!r}: at most its "
                      f"max_position_embeddings={cfg.max_position_embeddings}")
  return LinenLlama(cfg), estimate._HFShape(cfg, seq)


def _nvme_resume_error(opts: TrainOptions, config: ZeroConfig, step: int,
                       e: Exception) -> ConfigError:
  return ConfigError(
      f"checkpoint step {step} in checkpoint_dir {opts.checkpoint_dir!r} cannot resume with "
      f"offload_optimizer='nvme', nvme_path={config.nvme_path!r}: {e}. The optimizer-state "
      "files are laid out for the model, stage and mesh the run was saved with: resume with "
      "that config (run.json in out_dir), or start a new run (--overwrite)")


def resolve_config(config: ZeroConfig, opts: TrainOptions) -> ZeroConfig:
  """The run's final config, decided before the mesh exists.

  Args:
    config: the configuration as loaded.
    opts: the training options.

  Returns:
    ``config`` with ``opts.batch`` rows per step where it sets no batch size.
  """
  if (config.train_batch_size, config.micro_batch_per_device) == (None, None):
    return config.replace(batch=dataclasses.replace(config.batch, global_size=opts.batch))
  return config


def train(config: ZeroConfig, opts: TrainOptions | None = None, *,
          xla_notes: Iterable[str] = (), hooks: Iterable[Hook] = (),
          task: Task | None = None) -> TrainResult:
  """Trains the GPT preset ``opts.model`` on ``opts.corpus`` with ZeRO ``config``, or
  ``task``'s model on its data (`Task`).

  Args:
    config: the ZeRO configuration.
    opts: the training options; default ``TrainOptions()``.
    xla_notes: lines about XLA settings to print in the run's header.
    hooks: `Hook` objects run after the loop's own (metrics files, progress bar,
      checkpoints).
    task: the model and data to train instead of the GPT preset on ``opts.corpus``.

  Returns:
    A `TrainResult` with the final state, the plan, the per-step metrics and the files written.

  Raises:
    TypeError: a hook is not a `Hook`.
    MissingPackageError: ``opts`` asks for an output whose package is not installed
      (`zerojax.tools.options.resolve_outputs`).
    ConfigError: the options or config are invalid for the run, or a resumed run's options
      differ from the checkpoint's.
  """
  # The outputs are decided, and a missing package named, before anything else starts.
  opts, output_notes = resolve_outputs(opts or TrainOptions())
  user_hooks = list(hooks)
  for i, h in enumerate(user_hooks):
    if not isinstance(h, Hook):
      raise TypeError(f"train: hooks[{i}]={h!r} is not a zerojax.tools.train.Hook; subclass it and "
                      "override after_step, on_records or close")
  # Started by a launcher (zerojax launch, srun, torchrun): join its process group before
  # anything touches a device. Alone: nothing happens.
  distributed.initialize()
  setup_cpu_devices(opts.cpu_devices)
  config = resolve_config(config, opts)
  check_processes_agree(config, opts, task.agreement if task is not None else None)
  with claim_out_dir(opts.out_dir):
    return _train(config, opts, [*xla_notes, *output_notes], user_hooks, task)


def _train(config: ZeroConfig, opts: TrainOptions, xla_notes: Iterable[str],
           user_hooks: list[Hook], task: Task | None) -> TrainResult:
  """`train` once the processes agree and ``out_dir`` is this run's."""
  mesh = make_mesh(config)
  task = task or _gpt_task(opts, config)
  if config.optimizer_on_nvme and not task.nvme:
    raise ConfigError(
        f"ZeroConfig.offload_optimizer='nvme' is not supported by the {task.name!r} task: it "
        "keeps its optimizer state in memory (zerojax train's GPT task streams it from "
        "nvme_path); use offload_optimizer=true (pinned host memory) or false here")
  this = _this_run(opts, config)
  dirs = _prepare_run(opts, this)
  tx, sched = make_optimizer(opts, dirs.lengths)
  note = _length_note(opts, dirs, sched)
  if note:
    dirs.notes.append(note)
  rng = jax.random.key(opts.seed)
  if dirs.resume_step is None:
    state, plan, start, data_step = task.setup(config, mesh, tx, rng, None)
  else:  # a damaged checkpoint is moved aside, a warning names it, the one before it resumes
    first = dirs.resume_step
    (state, plan, start, data_step), dirs.resume_step = resume_with_fallback(
        opts.checkpoint_dir, first, lambda step: task.setup(config, mesh, tx, rng, step))
    if dirs.resume_step != first:
      dirs.notes.append(f"checkpoint step {first} cannot be read back (moved aside): resumed "
                        f"from step {dirs.resume_step} instead")
  # From here on the plan carries the config: everything below reads it there.
  _log_start(plan, task, state, list(xla_notes) + dirs.notes)
  train_step = task.make_step(plan)
  batches = task.batches(plan, plan.batch_sizes[0], data_step)
  compiled_peak = None
  if opts.show_plan:
    compiled_peak = _show_plan(plan, task, train_step, state, batches, data_step)
  writer = MetricsWriter(opts.out_dir, tensorboard=opts.tensorboard, tb_dir=dirs.tb_dir,
                         resume_after=dirs.resume_step)
  if is_main_process():
    _write_run_json(opts, this, dirs)
  hooks = [WriteMetrics(writer)]
  tokens_per_step = plan.batch_sizes[0] * task.seq_len
  bar = None
  if opts.progress and is_main_process():
    bar = ProgressBar(opts.steps, start, tokens_per_step)
    hooks.append(bar)
  if is_main_process():
    hooks.append(LogLines(opts.steps, opts.log_every, tokens_per_step, task.num_params(state),
                          list(plan.mesh.devices.flat), lambda: compiled_peak,
                          bar.write if bar is not None else log))
  records = _Records(plan.config, sched, tokens_per_step, writer.previous, start, hooks)
  ckpt = None
  try:
    if opts.checkpoint_dir:
      ckpt = Checkpointer(opts.checkpoint_dir, config=plan.config)
      hooks.append(SaveCheckpoints(ckpt, opts.checkpoint_every, opts.steps, rng,
                                   lambda: {"batches_step": batches.step}, task.save_item,
                                   task.checkpoint_model, optimizer=plan.nvme))
    hooks += user_hooks
    state = _run_steps(opts, task, state, start, train_step, batches, records, hooks, ckpt)
  finally:  # also on an error: what was written stays consistent and is closed
    records.clock.close()
    for h in hooks:
      h.close()  # the checkpoint hook waits for the pending save
  files = _finish(opts, plan, task, state, records, writer, ckpt, tokens_per_step)
  return TrainResult(state, plan, records.history, opts.out_dir, files)


def _log_start(plan: Any, task: Task, state: Any, notes: list[str]) -> None:
  """The run's first lines: devices, mesh and stage; the model and its batch; the notes."""
  config, mesh = plan.config, plan.mesh
  total, micro, accum = plan.batch_sizes  # rows per optimizer step, split into micro-batches
  log(f"zerojax: {jax.device_count()} x {jax.devices()[0].platform} devices, "
      f"{jax.process_count()} process(es), mesh {dict(mesh.shape)}, {config.label}")
  log(f"model {task.name}: {task.num_params(state):,} parameters; batch "
      f"{total} rows x {task.seq_len} tokens = {micro} per device x {accum} accumulation x "
      f"{plan.data_parallel_size} data parallel")
  for n in notes:
    log(n)
  if (note := nothing_sharded_note(plan)) is not None:
    log(note)
  if (opt := plan.nvme) is not None:  # its policy: plan.config is the device part's
    log(f"optimizer state on NVMe: {opt.state_bytes / 2**20:,.1f} MiB per process in "
        f"{len(opt.bounds)} chunk(s) of <= {opt.offload.chunk_size:,} parameters under "
        f"{opt.directory!r}, streamed through {opt.offload.buffer_count} buffers")


def _show_plan(plan: Any, task: Task, train_step: Any, state: Any, batches: Any,
               data_step: int) -> int | None:
  """The sharding table, and the per-device memory XLA measures for the compiled step (its
  first batch is put back); returns that peak (None where the task does not measure)."""
  log(plan.table())
  if task.measure:
    device_step = getattr(train_step, "device_step", train_step)  # NVMe: the device part's
    m = memory.measure(device_step.lower(state, next(batches)).compile())
    batches.step = data_step
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    log(f"per-device memory (XLA): arguments {mib(m.argument)}, temp {mib(m.temp)}, "
        f"peak {mib(m.peak)}; collectives/step {mib(m.collective_total)}")
    return int(m.peak)
  return None


def _write_run_json(opts: TrainOptions, this: dict[str, Any], dirs: _RunDirs) -> None:
  run_json = os.path.join(opts.out_dir, "run.json")
  resumes = []
  if dirs.resume_step is not None and os.path.isfile(run_json):
    with open(run_json) as f:
      resumes = json.load(f).get("resumed_from", [])
    resumes.append(dirs.resume_step)
  with open(run_json, "w") as f:
    json.dump({"run_id": dirs.run_id, **this, "resumed_from": resumes,
               "lengths": dirs.lengths}, f, indent=1)


def _run_steps(opts: TrainOptions, task: Task, state: Any, start: int, train_step: Any,
               batches: Any, records: _Records, hooks: list[Hook], ckpt: Any) -> Any:
  """Steps ``start + 1 .. opts.steps``; metrics are fetched every ``log_every`` steps (and
  after every step under ``nonfinite_grads='halt'``, which stops at a non-finite one)."""
  halt = records.policy == "halt"
  last_drain = time.perf_counter()
  for step in range(start + 1, opts.steps + 1):
    state, m = train_step(state, next(batches))  # no host sync: metrics are fetched in drain()
    if task.evaluate is not None and (step == opts.steps or step == 1 or (
        task.eval_every and step % task.eval_every == 0)):
      m = {**m, **task.evaluate(state)}
    records.add(step, m)
    if halt and bool(jax.device_get(m["overflow"])):  # the one per-step sync 'halt' costs
      records.drain()
      _halt(step, records.history[-1], ckpt)
    for h in hooks:
      h.after_step(step, state, records.drain)
    # Also every REFRESH_SEC whatever log_every is (DeepSpeed configs carry
    # steps_per_print: 2000): the bar and metrics.jsonl keep moving; one host sync per
    # REFRESH_SEC costs the pipeline nothing measurable.
    if (step % opts.log_every == 0 or step == opts.steps or step == start + 1
        or time.perf_counter() - last_drain >= REFRESH_SEC):
      records.drain()
      last_drain = time.perf_counter()
  records.drain()
  return state


REFRESH_SEC = 2.0  # the longest the progress bar and metrics go without an update


class _Records:
  """The metrics of dispatched steps, fetched from the device only when `drain` is called (the
  loop never waits for it), as records for the history and the hooks."""

  def __init__(self, config: ZeroConfig, sched: Callable, tokens_per_step: int,
               previous: list[dict], start: int, hooks: list[Hook]):
    self.sched, self.tokens_per_step, self.hooks = sched, tokens_per_step, hooks
    self.history: list[dict] = list(previous)
    self.pending: list[tuple[int, Any]] = []
    self.scaling = config.loss_scale is not None
    self.policy = config.nonfinite_policy
    self.warned_skip = False
    self.t_start = time.perf_counter()
    self.clock = StepClock()  # per-step completion times; the loop never waits for the device
    self.last_fetched = start

  def add(self, step: int, m: dict) -> None:
    self.pending.append((step, m))
    self.clock.add(step, m["loss"])

  def drain(self) -> None:
    """Fetches the pending metrics and hands their records to every hook."""
    if not self.pending:
      return
    fetched = jax.device_get([m for _, m in self.pending])
    for (step, _), m in zip(self.pending, fetched):
      self.history.append(self._record(step, m))
    new = self.history[len(self.history) - len(self.pending):]
    self.pending.clear()
    for h in self.hooks:
      h.on_records(new, self.last_fetched)
    self.last_fetched = self.history[-1]["step"]

  def _record(self, step: int, m: dict) -> dict:
    finite = lambda v: v if math.isfinite(v) else None  # JSON has no NaN/inf
    dt = self.clock.step_time(step)  # None for the run's first step (compilation, warm-up)
    rec = {"step": step, "loss": finite(float(np.mean(m["loss"]))),
           "grad_norm": finite(float(np.mean(m["grad_norm"]))),
           "lr": float(self.sched(step - 1)),
           "tokens_per_sec": None if not dt else round(self.tokens_per_step / dt, 1),
           "elapsed_sec": round(self.clock.done(step) - self.t_start, 6)}
    if self.scaling:
      rec["loss_scale"] = float(m["loss_scale"])
    if self.policy == "skip":
      rec["skipped_steps"] = int(m["skipped_steps"])
    for k in nvme.METRICS:  # offload_optimizer='nvme': the step's host part
      if k in m:
        rec[k] = finite(round(float(m[k]), 3))
    if "eval_loss" in m:
      ev = float(m["eval_loss"])
      rec["eval_loss"] = finite(ev)
      rec["eval_ppl"] = finite(math.exp(min(ev, 700.0))) if math.isfinite(ev) else None
    if not self.scaling and self.policy == "skip" and bool(m["overflow"]) and (
        not self.warned_skip):
      # fp16 overflows are routine while the loss scale settles; a NaN without loss scaling
      # is not, and must not go unnoticed.
      self.warned_skip = True
      log(f"zerojax: WARNING: step {step}: the gradient is not finite (loss "
          f"{float(np.mean(m['loss'])):g}, grad_norm {float(np.mean(m['grad_norm'])):g}); the "
          "step was skipped: params and optimizer state are unchanged "
          "(nonfinite_grads='skip'). Further skipped steps are counted in "
          "skipped_steps (metrics.jsonl); nonfinite_grads='halt' stops the run instead.")
    return rec


def _finish(opts: TrainOptions, plan: Any, task: Task, state: Any, records: _Records,
            writer: MetricsWriter, ckpt: Any, tokens_per_step: int) -> dict[str, str]:
  """Writes the weights and the loss plot, logs the summary; returns the files written."""
  out_dir, history = opts.out_dir, records.history
  files = {"metrics": writer.jsonl_path, "run": os.path.join(out_dir, "run.json")}
  if opts.save_weights and hasattr(state, "params"):
    files["weights"] = save_weights(os.path.join(out_dir, "weights.npz"), state.params)
  if writer.tb is not None:
    files["tensorboard"] = writer.tb.path
  if ckpt is not None:
    files["checkpoint"] = opts.checkpoint_dir
  if opts.plot and is_main_process() and history:
    files["loss_png"] = plot_loss(history, os.path.join(out_dir, "loss.png"),
                                  f"{task.name}, {plan.config.label}, {jax.device_count()} devices")
  if history:
    first, last = history[0], history[-1]
    nan = float("nan")
    # This process's steps only: a resumed run's earlier records have their own clock.
    tps = throughput(history[len(writer.previous):], tokens_per_step)
    speed = (f"{tps:,.0f} tokens/s after the first step" if tps is not None else
             "1 step: no throughput (compilation)")
    log(f"done: {opts.steps} steps, loss {first['loss'] or nan:.4f} -> {last['loss'] or nan:.4f}, "
        f"{speed}"
        + (f", {history[-1].get('skipped_steps', 0)} "
           f"{'overflow' if records.scaling else 'non-finite'} step(s) skipped"
           if history[-1].get("skipped_steps") else ""))
    if plan.nvme is not None:
      log(f"nvme optimizer state, this run's updates: {plan.nvme.total.summary()}")
    log("wrote " + ", ".join(files.values()))
  return files


def _num(v: float | None) -> str:
  return "nan or inf" if v is None else f"{v:g}"  # records hold None for non-finite values


def _halt(step: int, rec: Mapping[str, Any], ckpt: Any) -> None:
  """Stops the loop at a non-finite step (``nonfinite_grads='halt'``), naming the last
  checkpoint that holds finite state (the caller's ``finally`` closes the writers)."""
  where = None
  if ckpt is not None:
    ckpt.wait()
    steps = [s for s in ckpt.all_steps() if s < step]
    where = ckpt.step_dir(max(steps)) if steps else None
  resume = (f"the last good checkpoint is {where!r}" if where else
            "no checkpoint was saved before it" + ("" if ckpt is not None else
                                                   " (checkpoint_dir is not set)"))
  raise NonFiniteGradientsError(
      f"step {step}: the gradient is not finite (loss {_num(rec.get('loss'))}, grad_norm "
      f"{_num(rec.get('grad_norm'))}); nonfinite_grads='halt' stops the run here (its update "
      f"made the parameters non-finite); {resume}. Lower the learning rate, enable "
      "gradient_clipping, or check the data; nonfinite_grads='skip' skips such steps instead",
      step, where)
