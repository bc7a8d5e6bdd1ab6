"""ZeRO++ qwZ / qgZ: collective bytes by dtype, loss curves and step time against the unquantised run.

Run as ``python benchmarks/zeropp.py`` (8 simulated CPU devices). Two parts:

1. **Bytes** on the memory benchmark's model (`benchmarks/memory.py`: GPT, 16 scanned layers,
   d_model 512, vocab 8192, fp32 AdamW, remat 'full', stage 3): the step is compiled with and
   without quantisation and the compiled HLO's collectives are counted by dtype
   (`zerojax.runtime.memory.collective_bytes_by_dtype`). The forward all-gather is what runs under
   `zerojax.core.zeropp.GATHER_SCOPE`, the gradient reduction what runs under `REDUCE_SCOPE`; each
   is compared with its bf16 size (2 bytes per gathered or reduced element, from the plan).
   Step times alternate between the variants in one run.
2. **Loss** over ``--steps`` (200) steps of the bundled-corpus GPT (`zerojax.tools.train`, preset
   ``tiny``), unquantised and quantised, on one plot; the final loss (mean of the last 10
   steps) must be within 1% of the unquantised run's (int4 weights are shown, not held to it).

CPU timings say little about network savings (simulated devices share one memory): the bytes
are the headline. Writes a section of BENCHMARKS.md (``--write-to`` another file) and
``benchmarks/zeropp.png``.

``--tpu v5e:4x4`` compiles the bytes part ahead of time for a TPU slice; ``--gpu h100:8``
compiles the accelerator-schedule issue's 219.7M Llama (`benchmarks/decoder.py`, global batch
16 x 1024, bf16 compute) for a GPU pod with XLA:GPU and compares ZeRO++'s total collective
bytes with the default stage 3's (the issue's target: at most 0.55x). Neither runs anything.

With ``quantize_weights`` the backward pass re-gathers each layer's weights quantised too (the
default, ``quantize_weights_backward=None``); the rows "full-precision backward" set
``quantize_weights_backward=False``.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {  # name -> ZeroConfig overrides (stage 3, remat 'full')
    "stage 3 (default)": {},
    "stage 3, gather='explicit'": {"gather": "explicit"},
    "qwZ int8": {"quantize_weights": "int8"},
    "qgZ int8": {"quantize_gradients": "int8"},
    "qwZ + qgZ int8": {"quantize_weights": "int8", "quantize_gradients": "int8"},
    "qwZ + qgZ int8, full-precision backward": {"quantize_weights": "int8",
                                                 "quantize_gradients": "int8",
                                                 "quantize_weights_backward": False},
    "qwZ int8 + qgZ int4 (ZeRO++'s choice)": {"quantize_weights": "int8",
                                               "quantize_gradients": "int4"},
    "qwZ + qgZ int4": {"quantize_weights": "int4", "quantize_gradients": "int4"},
}
CURVES = ("stage 3 (default)", "qwZ + qgZ int8", "qwZ int8 + qgZ int4 (ZeRO++'s choice)",
          "qwZ + qgZ int4")
# int4 weights are shown, not held to the 1% bound: measured +3.5 to +4.8% after 200 steps
# (block sizes 32-256), as against +0.4% for int4 gradients with int8 weights.
UNCHECKED = ("qwZ + qgZ int4",)
# --gpu: the issue's comparison, stage 3 at bf16 compute (name -> ZeroConfig overrides).
GPU_VARIANTS = {
    "stage 3 (default)": {},
    "qwZ + qgZ int8": {"quantize_weights": "int8", "quantize_gradients": "int8"},
    "qwZ + qgZ int8, full-precision backward": {"quantize_weights": "int8",
                                                 "quantize_gradients": "int8",
                                                 "quantize_weights_backward": False},
}
GPU_TARGET = 0.55  # the issue's bound on ZeRO++'s total collective bytes against the default's


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--d-model", type=int, default=512)
  p.add_argument("--vocab", type=int, default=8192)
  p.add_argument("--seq", type=int, default=64)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--timed", type=int, default=3, help="timed steps per variant and round")
  p.add_argument("--rounds", type=int, default=2, help="alternating timing rounds")
  p.add_argument("--steps", type=int, default=200, help="training steps for the loss curves")
  p.add_argument("--tpu", metavar="TOPOLOGY", help="compile the bytes part ahead of time for "
                 "this TPU slice (e.g. v5e:4x4; needs the tpu extra) and skip timing and "
                 "training")
  p.add_argument("--gpu", metavar="TOPOLOGY", help="compile the issue's 219.7M Llama ahead of "
                 "time for this GPU pod (e.g. h100:8; needs the gpu extra): total collective "
                 "bytes against the default stage 3's")
  p.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md/PNG")
  p.add_argument("--write-to", metavar="PATH", default=str(ROOT / "BENCHMARKS.md"),
                 help="the markdown file whose section is written (default BENCHMARKS.md)")
  args = p.parse_args(argv)
  if args.tpu and args.gpu:
    p.error("--tpu and --gpu are separate runs: give one")
  for name in ("layers", "d_model", "vocab", "seq", "batch", "timed", "rounds", "steps"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: needs >= 1")
  return args


def bytes_part(args):
  import jax
  import numpy as np
  import optax
  import zerojax
  from zerojax.core.zeropp import GATHER_SCOPE, REDUCE_SCOPE
  from zerojax.runtime.memory import collective_bytes_by_dtype, compile_for_topology, lm_train_step
  from zerojax.models import GPT, GPTConfig

  cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, num_layers=args.layers,
                  num_heads=8, d_model=args.d_model)
  model, tx = GPT(cfg), optax.adamw(1e-4)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), dtype=np.int32)
  batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  rows, steps = {}, {}
  for name, kw in VARIANTS.items():
    zc = zerojax.ZeroConfig.from_flat(dict(stage=3, remat="full", **kw))
    if args.tpu:  # ahead of time for a TPU slice: bytes only, nothing runs
      r = compile_for_topology(zc, model, (args.batch, cfg.seq_len), args.tpu, tx=tx)
      if r.compiled is None:
        raise SystemExit(f"{name}: the TPU compiler failed: {r.error}")
      compiled, plan, step = r.compiled, r.plan, None
    else:
      state, plan = zerojax.create_train_state(model, tx, jax.random.key(0), batch["x"],
                                               config=zc)
      step = zerojax.zero_step(plan)(lm_train_step)
      compiled = step.lower(state, batch).compile()
    text = compiled.as_text()
    n = math.prod(plan.mesh.devices.shape)
    gathered = sum(math.prod(lp.shape) for lp in plan.leaves if lp.is_sharded)
    reduced = sum(math.prod(lp.shape) for lp, g in zip(plan.leaves, jax.tree.leaves(plan.grads))
                  if lp.trainable and "fsdp" in jax.tree.leaves(tuple(g.spec)))
    fwd = collective_bytes_by_dtype(text, GATHER_SCOPE)
    red = collective_bytes_by_dtype(text, REDUCE_SCOPE)
    rows[name] = dict(
        all=collective_bytes_by_dtype(text), temp=compiled.memory_analysis().temp_size_in_bytes,
        fwd={dt: b for (k, dt), b in fwd.items() if k == "all-gather"},
        red={dt: b for (k, dt), b in red.items() if k in ("all-to-all", "reduce-scatter")},
        fwd_bf16=2 * gathered, red_bf16=2 * reduced, formulation=None, time=math.nan,
        weights=zc.quantize_weights, quantized_backward=zc.quantizes_backward)
    if step is None:
      rows[name]["formulation"] = r.formulation
      print(f"{name}: compiled for {args.tpu} ({n} chips) in {r.compile_seconds:.0f} s",
            flush=True)
      continue
    state, m = step(state, batch)  # warm-up
    jax.block_until_ready(m)
    rows[name]["formulation"] = next(iter(step.formulation.values()))
    steps[name] = [step, state, []]
    print(f"{name}: compiled ({n} devices)", flush=True)
  for _ in range(args.rounds):  # alternate, so drift on a shared machine hits every variant
    for name, s in steps.items():
      step, state, times = s
      for _ in range(args.timed):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
      s[1] = state
  for name, (_, _, times) in steps.items():
    rows[name]["time"] = statistics.median(times)
  desc = (f"GPT, {cfg.num_layers} scanned layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}, "
          f"seq {cfg.seq_len}, batch {args.batch}, fp32 AdamW, stage 3, remat='full'"
          + (f", compiled ahead of time for TPU {args.tpu}" if args.tpu else ""))
  return rows, desc


def loss_part(args, out_png):
  import numpy as np
  import zerojax
  from zerojax.tools.train import TrainOptions, train
  curves = {}
  for name in CURVES:
    zc = zerojax.ZeroConfig.from_flat(dict(stage=3, **VARIANTS[name]))
    with tempfile.TemporaryDirectory() as d:
      opts = TrainOptions(model="tiny", steps=args.steps, out_dir=d, progress=False,
                          tensorboard=False, plot=False, log_every=10)
      res = train(zc, opts)
    losses = [h["loss"] for h in res.history]
    curves[name] = dict(losses=losses, final=float(np.mean(losses[-10:])))
    print(f"{name}: final loss {curves[name]['final']:.4f}", flush=True)
  if out_png is not None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, c in curves.items():
      ax.plot(range(1, len(c["losses"]) + 1), c["losses"], label=name, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("ZeRO++ on the bundled-corpus GPT (tiny), 8 simulated devices")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
  return curves


def bytes_table(rows, timed: bool) -> str:
  mib = lambda b: f"{b / 2**20:,.2f}"
  base = rows["stage 3 (default)"]
  cols = ("variant | formulation | forward all-gather MiB (s8 + f32) | vs its bf16 size | "
          "gradient reduction MiB (s8 + f32) | vs its bf16 size | all collectives MiB (vs default) | "
          "temp MiB"
          + (" | step time vs default" if timed else ""))
  lines = [f"| {cols} |", "|" + "---|" * (cols.count("|") + 1)]
  for name, r in rows.items():
    fwd, red = sum(r["fwd"].values()), sum(r["red"].values())
    # Only a quantised forward with a full-precision re-gather (quantize_weights_backward=False)
    # tells the forward gather apart in the HLO; with a quantised re-gather (the default) the
    # rematerialised forward has the same name scope, so the column holds both.
    quant_fwd = "s8" in r["fwd"] and not r["quantized_backward"]
    quant_red = "s8" in r["red"]
    split = f"({mib(r['fwd'].get('s8', 0))} + {mib(r['fwd'].get('f32', 0))})"
    lines.append(
        f"| {name} | {r['formulation']} | "
        + (f"{mib(fwd)} {split} | **{fwd / r['fwd_bf16']:.3f}×** | " if quant_fwd else
           f"{mib(fwd)} {split}, forward + re-gather | - | " if "s8" in r["fwd"] else
           (f"{mib(fwd)} (forward + re-gather) | - | " if fwd else "XLA's | - | "))
        + (f"{mib(red)} ({mib(r['red'].get('s8', 0))} + {mib(r['red'].get('f32', 0))}) | "
           f"**{red / r['red_bf16']:.3f}×** | " if quant_red else
           (f"{mib(red)} (f32) | {red / r['red_bf16']:.2f}× | " if red else "XLA's | - | "))
        + f"{mib(sum(r['all'].values()))} ({sum(r['all'].values()) / sum(base['all'].values()):.2f}×)"
        f" | {mib(r['temp'])} |"
        + (f" {r['time'] / base['time']:.2f}× |" if timed else ""))
  return "\n".join(lines)


def _full_precision_gathers(r) -> float:
  """All-gather bytes beyond the quantised values and their float32 scales (one per
  block of 256): 0 when every weight gather, the backward re-gather included, is quantised."""
  gathers = {dt: b for (k, dt), b in r["all"].items() if k == "all-gather"}
  values = gathers.get("s8", 0) * (2 if r["weights"] == "int4" else 1)  # int4: two per byte
  return sum(gathers.values()) - gathers.get("s8", 0) - 1.01 * values * 4 / 256


def bytes_checks(rows) -> list[tuple[str, bool]]:
  checks = []
  for name, r in rows.items():
    if "s8" in r["fwd"] and not r["quantized_backward"] and r["weights"] == "int8":
      checks.append((f"{name}: forward all-gather <= 0.55x bf16",
                     sum(r["fwd"].values()) / r["fwd_bf16"] <= 0.55))
    if r["quantized_backward"]:
      checks.append((f"{name}: no full-precision weight all-gather (backward re-gather "
                     "quantised)", _full_precision_gathers(r) <= 0))
    if "s8" in r["red"] and "int8" in name:
      checks.append((f"{name}: gradient reduction <= 0.55x bf16",
                     sum(r["red"].values()) / r["red_bf16"] <= 0.55))
  return checks


def write_section(marker: str, section: str, path) -> None:
  md = pathlib.Path(path)
  text = md.read_text() if md.exists() else ""
  start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
  section = f"{start}\n{section}\n{end}"
  if start in text:
    a, b = text.index(start), text.index(end)
    text = text[:a] + section + text[b + len(end):]
  else:
    text = text.rstrip() + "\n\n" + section + "\n"
  md.write_text(text)


def _results(checks) -> str:
  return "\n".join(f"- {'PASS' if ok else 'FAIL'}: {what}" for what, ok in checks)


def tpu_report(args, rows, desc) -> int:
  import jax
  table = bytes_table(rows, timed=False)
  checks = bytes_checks(rows)
  return _report(args, "zeropp-tpu", (
      f"### ZeRO++ on the TPU compiler ({args.tpu})\n\n`python benchmarks/zeropp.py --tpu "
      f"{args.tpu}` (jax {jax.__version__}, libtpu ahead-of-time compilation on a CPU machine, "
      f"nothing runs; {desc}):"), table, checks)


def _report(args, section: str, heading: str, table: str, checks) -> int:
  """Prints ``table`` and ``checks``, writes them under ``heading`` into ``section`` unless
  ``--no-write``; the exit status says whether every check passed."""
  print(table)
  for what, ok in checks:
    print(f"{'PASS' if ok else 'FAIL'}  {what}")
  if not args.no_write:
    write_section(section, f"{heading}\n\n{table}\n\n{_results(checks)}", args.write_to)
  return 0 if all(ok for _, ok in checks) else 1


def gpu_part(args):
  """The issue's Llama compiled for ``args.gpu`` per `GPU_VARIANTS`: collective bytes by kind
  and dtype (paper convention, `zerojax.runtime.memory`), temp and the compile time."""
  import zerojax
  from benchmarks.decoder import ISSUE_LLAMA, Decoder, num_params, zerojax_step
  from zerojax.runtime.memory import collective_bytes_by_dtype, compile_for_topology
  rows = {}
  for name, kw in GPU_VARIANTS.items():
    zc = zerojax.ZeroConfig.from_flat(dict(stage=3, compute_dtype="bfloat16", **kw))
    r = compile_for_topology(zc, Decoder(ISSUE_LLAMA), (16, 1024), args.gpu,
                             train_step=zerojax_step)
    if r.compiled is None:
      raise SystemExit(f"{name}: XLA:GPU failed: {r.error}")
    by = collective_bytes_by_dtype(r.compiled.as_text())
    rows[name] = dict(by=by, total=r.measured.collective_total, temp=r.measured.temp,
                      formulation=r.formulation, seconds=r.compile_seconds)
    print(f"{name}: compiled for {args.gpu} in {r.compile_seconds:.0f} s, collectives "
          f"{r.measured.collective_total / 2**20:.1f} MiB", flush=True)
  c = ISSUE_LLAMA
  desc = (f"the accelerator-schedule issue's Llama ({num_params(c) / 1e6:.1f}M: {c.layers} "
          f"layers, d_model {c.d_model}, {c.heads} heads, SwiGLU {c.ffn}, vocab {c.vocab}, "
          "global batch 16 x 1024), fp32 params, compute_dtype='bfloat16', AdamW, stage 3")
  return rows, desc


def gpu_report(args, rows, desc) -> int:
  import jax
  mib = lambda b: f"{b / 2**20:,.1f}"
  base = rows["stage 3 (default)"]["total"]
  kinds = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce")
  head = ("| variant | formulation | " + " | ".join(f"{k} MiB by dtype" for k in kinds)
          + " | all collectives MiB | vs default | temp MiB | compile s |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for name, r in rows.items():
    cells = []
    for k in kinds:
      parts = {dt: b for (kk, dt), b in r["by"].items() if kk == k and b}
      cells.append(", ".join(f"{dt} {mib(b)}" for dt, b in sorted(parts.items())) or "-")
    lines.append(f"| {name} | {r['formulation']} | " + " | ".join(cells)
                 + f" | {mib(r['total'])} | **{r['total'] / base:.2f}×** | {mib(r['temp'])} | "
                 f"{r['seconds']:.0f} |")
  table = "\n".join(lines)
  checks = [(f"qwZ + qgZ int8 (default backward): all collectives <= {GPU_TARGET}x the default's",
             rows["qwZ + qgZ int8"]["total"] <= GPU_TARGET * base)]
  return _report(args, "zeropp-gpu", (
      f"### ZeRO++ on XLA:GPU ({args.gpu})\n\n`python benchmarks/zeropp.py --gpu {args.gpu}` "
      f"(jax {jax.__version__}, XLA:GPU ahead-of-time compilation on a CPU machine, nothing "
      f"runs; {desc}; per device per step, paper convention):"), table, checks)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.gpu:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows, desc = gpu_part(args)
    return gpu_report(args, rows, desc)
  os.environ.setdefault("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
  import jax
  rows, desc = bytes_part(args)
  if args.tpu:
    return tpu_report(args, rows, desc)
  png = None if args.no_write else ROOT / "benchmarks" / "zeropp.png"
  curves = loss_part(args, png)
  table = bytes_table(rows, timed=True)
  ref = curves["stage 3 (default)"]["final"]
  clines = ["| run | final loss (mean of last 10 steps) | vs unquantised |", "|---|---|---|"]
  for name, c in curves.items():
    clines.append(f"| {name} | {c['final']:.4f} | {100 * (c['final'] / ref - 1):+.2f}%"
                  + (" (int4 weights: not held to 1%)" if name in UNCHECKED else "") + " |")
  ctable = "\n".join(clines)
  machine = (f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, jax "
             f"{jax.__version__}, {jax.device_count()} simulated {jax.devices()[0].platform} "
             "devices")
  print(table)
  print(ctable)
  checks = bytes_checks(rows)
  for name, c in curves.items():
    if name not in UNCHECKED:
      checks.append((f"{name}: final loss within 1% of unquantised",
                     abs(c["final"] / ref - 1) <= 0.01))
  for what, ok in checks:
    print(f"{'PASS' if ok else 'FAIL'}  {what}")
  if not args.no_write:
    write_section("zeropp", (
        "## ZeRO++: quantised weight gather (qwZ) and gradient reduction (qgZ)\n\n"
        f"`python benchmarks/zeropp.py` on {machine}.\n\n**Bytes** ({desc}; per device per "
        "step from the compiled HLO; forward all-gather = collectives under "
        "`zerojax.core.zeropp.GATHER_SCOPE`, gradient reduction = under `REDUCE_SCOPE`, bf16 size = 2 "
        "bytes per gathered / reduced element; int8 values plus one float32 scale per 256):"
        f"\n\n{table}\n\n**Loss** over {args.steps} steps of the bundled-corpus GPT (`tiny`, "
        f"stage 3, default training options):\n\n{ctable}\n\n"
        "![ZeRO++ loss curves](benchmarks/zeropp.png)\n\n" + _results(checks)
        + "\n\nStep times on simulated CPU devices measure the extra quantise/dequantise work, "
        "not the network: the devices share one memory, so moving fewer bytes saves nothing "
        "here. The bytes are the headline; on a real interconnect they are what the step "
        "waits for. With `quantize_weights` the backward pass re-gathers each layer's weights "
        "quantised too (`quantize_weights_backward=None`, the default, as DeepSpeed's qwZ "
        "quantises every parameter all-gather); the \"full-precision backward\" row keeps that "
        "re-gather in full precision (`quantize_weights_backward=False`). The TPU compiler's "
        "view of the same collectives follows."), args.write_to)
  return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
  sys.exit(main())
