"""ZeRO on XLA:GPU, compiled ahead of time for GPU pods from a CPU machine.

Run as ``python benchmarks/gpu_aot.py [--only issue,loops,lookups,titan,scale,hosts]``; needs
``pip install -e ".[gpu]"`` (JAX's CUDA plugin), no GPU. Every number is what XLA:GPU reports
for the real step compiled for the named pod with abstract state (nothing allocated):
``memory_analysis()`` per device, collective bytes, the collective schedule and activation
collectives from ``as_text()`` (`zerojax.runtime.memory`). The fit verdict is zerojax's:
XLA:GPU compiles steps that do not fit.

Sections (markdown tables on stdout):
  issue  the accelerator-schedule issue's 219.7M Llama on h100:8: zerojax stages 1-3 against
         hand-written FSDP and MaxText-style FSDP (``--issue-target v5e:2x4``: the same on
         XLA:TPU, with libtpu)
  loops  the same Llama with its layers as a Python loop, plain and of nn.remat blocks, at
         stage 3 against both baselines (``--issue-target`` as for issue)
  lookups  an NNX GPT and a pure-function LM, vocabulary 8192, at stages 2-3 (the tests'
         `tests/model_patterns.py` `lookup_lm_compiled`; ``--issue-target`` as for issue)
  titan  torchtitan's row: a Llama-3-8B-shaped decoder, local batch 2 x 8192, h100:8
  scale  a 70B-class decoder at stage 3 on h100:8x8 (64 GPUs)
  hosts  h100:2x8: HSDP (replica across hosts, fsdp within) against flat FSDP over 16 GPUs
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTIONS = ("issue", "loops", "lookups", "titan", "scale", "hosts")
TITAN_GIB = 82.4  # torchtitan's Llama 3.1 8B FSDP peak on 8 x H100 (docs/performance.md)
GiB, MiB = 2**30, 2**20


def _row(name, r=None, *, measured=None, text=None, plan=None, seconds=None, usable=None):
  """One table row from a `TopologyCompile` (zerojax) or a measured baseline."""
  from zerojax.runtime import memory
  if r is not None:
    measured, text, plan, seconds = r.measured, r.compiled.as_text(), r.plan, r.compile_seconds
    usable = r.hbm_available
  ag, rs = memory.collective_schedule(text, "all-gather"), memory.collective_schedule(
      text, "reduce-scatter")
  act = sum(memory.activation_collectives(text, plan).values())
  book = memory.textbook_bytes(plan)
  return {"name": name, "temp": measured.temp, "peak": measured.peak,
          "args": measured.argument, "coll": measured.collective_total,
          "ag": measured.collectives["all-gather"],
          "rs": measured.collectives["reduce-scatter"] + measured.collectives["all-reduce"],
          "book": book, "ag_async": ag.overlapped_share, "ag_mm": ag.matmul_share,
          "rs_mm": rs.matmul_share, "act": act, "seconds": seconds,
          "fits": measured.peak <= usable if usable else None,
          "host": getattr(r, "host_argument", 0) if r is not None else 0}


def _table(rows, book_label="textbook"):
  head = ("| step | temp GiB | peak GiB | HBM args GiB | host args GiB | collectives GiB | "
          f"x {book_label} | all-gather async / with matmul | reduce-scatter with matmul | "
          "activation collectives MiB | compile s | fits |")
  out = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    out.append(
        f"| {r['name']} | {r['temp'] / GiB:.2f} | {r['peak'] / GiB:.2f} | {r['args'] / GiB:.2f} | "
        f"{r['host'] / GiB:.2f} | {r['coll'] / GiB:.2f} | {r['coll'] / r['book']:.2f} | "
        f"{r['ag_async']:.0%} / {r['ag_mm']:.0%} | {r['rs_mm']:.0%} | {r['act'] / MiB:.1f} | "
        f"{r['seconds']:.0f} | {'yes' if r['fits'] else 'no'} |")
  return "\n".join(out)


def _devices(topology):
  from zerojax.runtime import gpu, memory
  return list(gpu.gpu_topology(topology).devices if gpu.is_gpu_topology(topology)
              else memory.tpu_topology(topology).devices)


def _baseline(cfg, topology, batch, style, stage3_plan, usable):
  import jax
  from benchmarks.decoder import baseline_step
  from jax.sharding import Mesh
  import numpy as np
  from zerojax.runtime import memory
  mesh = Mesh(np.array(_devices(topology)), ("fsdp",))
  jitted, (p, o), b = baseline_step(cfg, mesh, batch, style)
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = jitted.lower(p, o, b).compile()
  return _row(f"{style}-written FSDP" if style == "hand" else "MaxText-style FSDP",
              measured=memory.measure(compiled), text=compiled.as_text(), plan=stage3_plan,
              seconds=time.perf_counter() - t0, usable=usable)


def _zerojax(cfg, topology, batch, **config):
  import zerojax
  from benchmarks.decoder import Decoder, zerojax_step
  from zerojax.runtime import memory, step_time
  zc = zerojax.ZeroConfig.from_flat(dict(compute_dtype="bfloat16", **config))
  return memory.compile_for_topology(zc, Decoder(cfg), batch, topology, train_step=zerojax_step,
                                     predictor=step_time.predict_compiled)


def section_issue(args):
  from benchmarks.decoder import ISSUE_LLAMA
  topo, batch = args.issue_target, (16, 1024)
  runs = {}
  for s in (3, 2, 1):
    runs[s] = _zerojax(ISSUE_LLAMA, topo, batch, stage=s)
    print(runs[s].table(), flush=True)
  plan3 = runs[3].plan
  rows = [_baseline(ISSUE_LLAMA, topo, batch, "hand", plan3, runs[3].hbm_available),
          _baseline(ISSUE_LLAMA, topo, batch, "maxtext", plan3, runs[3].hbm_available)]
  rows += [_row(f"zerojax stage {s} ({runs[s].formulation})", runs[s]) for s in (1, 2, 3)]
  print(f"\n### The issue's Llama (219.7M) on {topo}, global batch 16 x 1024, bf16 compute\n")
  print(_table(rows))


def section_loops(args):
  from benchmarks.decoder import ISSUE_LLAMA
  topo, batch = args.issue_target, (16, 1024)
  for layout, what in (("loop", "a Python loop of blocks"),
                       ("loop_remat", "a Python loop of nn.remat blocks")):
    cfg = dataclasses.replace(ISSUE_LLAMA, layout=layout)
    z = _zerojax(cfg, topo, batch, stage=3)
    rows = [_baseline(cfg, topo, batch, "hand", z.plan, z.hbm_available),
            _baseline(cfg, topo, batch, "maxtext", z.plan, z.hbm_available),
            _row(f"zerojax stage 3 ({z.formulation})", z)]
    print(f"\n### The issue's Llama as {what} on {topo}, global batch 16 x 1024, bf16 compute\n")
    print(_table(rows), flush=True)


def section_lookups(args):
  from tests.model_patterns import LOOKUP_LM, LOOKUPS, lookup_lm_compiled
  from zerojax.runtime import memory
  devices = _devices(args.issue_target)
  lm = LOOKUP_LM
  print(f"\n### Lookup tables of NNX and pure-function models on {args.issue_target}: vocabulary "
        f"{lm['vocab']}, {lm['layers']} layers, d_model {lm['d_model']}, batch {lm['rows']} x "
        f"{lm['seq']}, bf16 compute\n")
  print("| model, stage | temp MiB | collectives MiB | x textbook | all-gather / reduce-scatter "
        "with matmul | activation collectives | compile s |\n|---|---|---|---|---|---|---|")
  for kind, lookup in [("nnx", "index")] + [("pure", lk) for lk in LOOKUPS]:
    for stage in (2, 3):
      t0 = time.perf_counter()
      compiled, plan = lookup_lm_compiled(kind, stage, devices, lookup)
      model = kind if kind == "nnx" else f"pure, {lookup}"
      r = _row("", measured=memory.measure(compiled), text=compiled.as_text(), plan=plan,
               seconds=time.perf_counter() - t0)
      act = memory.activation_collectives(compiled.as_text(), plan)
      named = ", ".join(f"{kind_} {shape} {v / MiB:.1f} MiB" for (kind_, shape, _), v in
                        act.items() if v >= MiB / 10) or "none"
      print(f"| {model}, {stage} | {r['temp'] / MiB:.1f} | {r['coll'] / MiB:.1f} | "
            f"{r['coll'] / r['book']:.2f} | {r['ag_mm']:.0%} / {r['rs_mm']:.0%} | {named} | "
            f"{r['seconds']:.0f} |", flush=True)


def section_titan(args):
  from benchmarks.decoder import LLAMA3_8B
  cfg = dataclasses.replace(LLAMA3_8B, attention="cudnn")
  topo, batch = "h100:8", (16, 8192)
  rows, est = [], {}
  plan3 = None
  # No offload rows: JAX 0.10.2's compile-only GPU devices have no host memory space.
  for name, kw in (("stage 3", dict(stage=3)), ("stage 2", dict(stage=2)),
                   ("stage 1", dict(stage=1))):
    if args.quick and name != "stage 3":
      continue
    r = _zerojax(cfg, topo, batch, **kw)
    plan3 = plan3 or r.plan
    est[name] = (r.estimate.persistent, r.persistent, r.measured.peak, r.hbm_available)
    rows.append(_row(f"zerojax {name}", r))
    print(r.table(), flush=True)
  rows.insert(0, _baseline(cfg, topo, batch, "hand", plan3, est["stage 3"][3]))
  print("\n### torchtitan's row: Llama-3-8B-shaped, h100:8, local batch 2 x 8192, bf16, AdamW\n")
  print(_table(rows))
  print("\n| option | estimate (params + opt) GiB | compiled persistent GiB | difference | "
        f"peak GiB | vs torchtitan {TITAN_GIB} GiB |\n|---|---|---|---|---|---|")
  for name, (e, p, peak, _) in est.items():
    print(f"| {name} | {e / GiB:.2f} | {p / GiB:.2f} | {(p - e) / e:+.2%} | {peak / GiB:.2f} | "
          f"{peak / GiB / TITAN_GIB:.2f}x |")


def section_scale(args):
  from benchmarks.decoder import LLAMA2_70B
  cfg = dataclasses.replace(LLAMA2_70B, attention="cudnn")
  rows = []
  for name, kw in (("stage 3", {}),):
    r = _zerojax(cfg, "h100:8x8", (64, 4096), stage=3, **kw)
    print(r.table(), flush=True)
    rows.append(_row(f"zerojax {name}", r))
  print("\n### 70B-class decoder on h100:8x8 (64 GPUs), global batch 64 x 4096\n")
  print(_table(rows))


def section_hosts(args):
  from benchmarks.decoder import ISSUE_LLAMA
  rows = []
  for name, kw in (("flat FSDP over 16", dict(mesh_axes=("fsdp",), mesh_shape=(-1,))),
                   ("HSDP 2 x 8", dict(mesh_axes=("replica", "fsdp"), mesh_shape=(2, 8)))):
    r = _zerojax(ISSUE_LLAMA, "h100:2x8", (32, 1024), stage=3, **kw)
    text = r.compiled.as_text()
    cross = _cross_host_bytes(text, r.plan)
    row = _row(f"zerojax stage 3, {name}", r)
    row["name"] += f"; {cross / GiB:.2f} GiB in collectives spanning hosts"
    rows.append(row)
  print("\n### Two hosts, h100:2x8, the issue's Llama, global batch 32 x 1024\n")
  print(_table(rows))


def _cross_host_bytes(text, plan):
  """Bytes (paper convention) of collectives whose device groups span more than one host."""
  from zerojax.runtime import memory
  procs = [d.process_index for d in plan.mesh.devices.flat]
  comps, mult = memory._parse_hlo(text)
  total = 0
  for name, lines in comps.items():
    for line in lines:
      m = memory._OP.search(line)
      if not m or not mult.get(name):
        continue
      groups = memory.replica_groups(line) or [frozenset(range(len(procs)))]
      if any(len({procs[i] for i in g}) > 1 for g in groups):
        total += mult[name] * sum(memory._paper_bytes(m.group(2), bool(m.group(3)), m.group(1),
                                                      line).values())
  return total


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--only", default=",".join(SECTIONS))
  p.add_argument("--quick", action="store_true", help="titan: stage 3 and the baseline only")
  p.add_argument("--issue-target", default="h100:8", choices=("h100:8", "v5e:2x4"),
                 help="issue: the pod to compile for")
  args = p.parse_args(argv)
  for s in [s.strip() for s in args.only.split(",") if s.strip()]:
    if s not in SECTIONS:
      p.error(f"--only {s!r} is invalid: sections are {', '.join(SECTIONS)}")
    t0 = time.perf_counter()
    globals()[f"section_{s}"](args)
    print(f"\n({s}: {time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
