"""Conformance: ZeRO on the models people write, against hand-written JAX FSDP.

``python benchmarks/patterns.py`` compiles and runs, on 8 simulated CPU devices and at the
*default* `ZeroConfig` (only ``stage`` set), one training step of each model-writing pattern:

* ``a``  linen ``nn.scan(nn.remat(Block))`` (MaxText style)
* ``b``  linen ``nn.scan(Block)`` without remat
* ``c``  linen blocks in a Python loop (HF style, unscanned)
* ``d1`` a tied LM head read through ``self.variables[...]["embedding"].T``
* ``d2`` a tied LM head through ``nn.Embed.attend``
* ``e``  Flax NNX, blocks in an ``nnx.List``
* ``f``  Flax NNX, stacked layers (``nnx.vmap`` init, ``nnx.scan`` over ``nnx.remat`` blocks)
* ``g``  a plain pytree: a params dict and a pure function, no Flax
* ``h``  a linen model called inside the step without ``state.apply_fn`` (a closure)

For each pattern the baseline is what someone would write by hand: params and Adam state
sharded on their largest divisible dimension through ``jax.jit`` in/out shardings, the batch
sharded, the pattern's own remat, nothing else. Per pattern and stage the table gives, per
device, XLA's temp and peak bytes, collective bytes from the compiled HLO, the largest loss
and final-parameter difference to an unsharded (one-device) run, and the median step time
relative to the baseline, timed alternately in one run.

``--size small`` runs the tests' sizes. ``--size wide`` (with ``--target`` only) has 16x the
weights and 4x the rows, so that a TPU compile's temp is HBM the step holds rather than what
XLA:TPU's memory-space assignment left outside VMEM. The patterns and their runners are
defined in ``tests/model_patterns.py``, shared with the tests (``tests/core/test_patterns.py``).

``--target h100:8`` (or a TPU slice such as ``v5e:2x4``) compiles the same steps ahead of time
for that accelerator compiler from abstract state (nothing runs) and gives, per pattern and
stage: temp, peak, collective bytes against the textbook ZeRO volume, the share of all-gather
and reduce-scatter bytes with a matmul between start and done, the predicted step time and the
part of it compute waits on collectives (`zerojax.runtime.step_time`, from the compiled
schedule and the target's published rates), collectives that move activations, and the compile
time; against the hand-written baseline and a MaxText-style one
(weights sharded on their ``d_model`` dimension, activations constrained to batch-on-fsdp).

``--zeropp`` compiles, instead, the stage-3 default against ZeRO++ (``quantize_weights`` and
``quantize_gradients`` at ``int8``) on the patterns where ZeRO++ applies (a linen model
called through ``state.apply_fn``: a, b, c, d1, d2), at fp32 and at bf16 compute, for
``--target`` or, without it, for 8 CPU devices: collective bytes, their ratio to the
default's and to the textbook volume, temp and activation collectives.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The patterns, their sizes and runners are shared with the tests (tests/core/test_patterns.py).
from tests.model_patterns import (  # noqa: E402
    DESCRIPTIONS, FULL, PATTERNS, SMALL, WIDE, Runner, Size, abstract, baseline_runner, batches,
    fsdp_spec, linen_models, loss_of, make_tx, max_diff, nnx_model, pytree_apply, pytree_init,
    reference_losses, target_zero, timed_compile, zero_runner)

# -- ahead of time, for an accelerator compiler (--target) -----------------------------------------


def target_baseline(pattern: str, size: Size, devices, style: str = "hand"
                    ) -> tuple[Any, float]:
  """``(compiled, seconds)``: the hand-written (``'hand'``) or MaxText-style (``'maxtext'``:
  weights sharded on their ``d_model`` dimension, the batch dimension of every input and of
  the model's output constrained to ``fsdp``) FSDP step compiled for ``devices``."""
  import jax
  import numpy as np
  import optax
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
  n = len(devices)
  mesh = Mesh(np.asarray(devices), ("fsdp",), axis_types=(AxisType.Auto,))

  def spec(shape):
    if style == "maxtext":
      for d in range(len(shape) - 1, -1, -1):
        if shape[d] == size.d_model and size.d_model % n == 0:
          return P(*[("fsdp" if i == d else None) for i in range(len(shape))])
    return fsdp_spec(shape, n)
  shard = lambda tree: jax.tree.map(lambda x: NamedSharding(mesh, spec(np.shape(x))), tree)
  data = batches(size, pattern, 1)[0]
  batch_sh = NamedSharding(mesh, P("fsdp"))
  on_batch = lambda y: (jax.lax.with_sharding_constraint(
      y, NamedSharding(mesh, P("fsdp", *([None] * (y.ndim - 1))))) if style == "maxtext" else y)
  tx = make_tx()
  key = jax.random.key(0)
  if pattern in ("e", "f"):
    from flax import nnx
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: (lambda m: (m, nnx.Optimizer(m, tx, wrt=nnx.Param)))(
            nnx_model(size, pattern, nnx.Rngs(0)))))
    state_sh = shard(state)

    def step(state, batch):
      m, o = nnx.merge(graphdef, state)
      loss, grads = nnx.value_and_grad(
          lambda m: loss_of(pattern, on_batch(m(batch["x"])), batch["y"]))(m)
      o.update(m, grads)
      return nnx.state((m, o)), loss
  else:
    if pattern == "g":
      p0 = jax.eval_shape(lambda: pytree_init(size, key))
      apply = pytree_apply
    else:
      model = linen_models(size)[pattern]
      p0 = jax.eval_shape(model.init, key, jax.ShapeDtypeStruct(data["x"].shape,
                                                                data["x"].dtype))["params"]
      apply = lambda p, x: model.apply({"params": p}, x)
    state = (p0, jax.eval_shape(tx.init, p0))
    state_sh = shard(state)

    def step(state, batch):
      p, o = state
      loss, g = jax.value_and_grad(lambda p: loss_of(
          pattern, on_batch(apply(p, batch["x"])), batch["y"]))(p)
      u, o = tx.update(g, o, p)
      return (optax.apply_updates(p, u), o), loss
  f = jax.jit(step, in_shardings=(state_sh, batch_sh),
              out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=(0,))
  args = abstract(state, state_sh), abstract(data, jax.tree.map(lambda _: batch_sh, data))
  return timed_compile(lambda: f.lower(*args).compile())


def target_devices(target: str | None) -> list:
  """The devices of a GPU pod (``h100:8``) or TPU slice (``v5e:2x4``), or JAX's own (CPU)."""
  import jax
  from zerojax.runtime import gpu, memory
  if target is None:
    return jax.devices()
  return list((gpu.gpu_topology(target) if gpu.is_gpu_topology(target)
               else memory.tpu_topology(target)).devices)


def target_table(target: str, size: Size, pats, stages=(3,)) -> str:
  """The conformance table compiled for an accelerator (``--target``)."""
  from zerojax.runtime import memory, step_time
  devices = target_devices(target)
  rates = step_time.device_rates(target)
  mib = lambda b: f"{b / 2**20:.1f}"
  head = ("| pattern | step | temp MiB | peak MiB | collectives MiB | × textbook | "
          "all-gather / reduce-scatter with a matmul | predicted step ms / exposed "
          "communication ms | activation collectives MiB | compile s |")
  lines = [head, "|" + "---|" * 10]
  for pat in pats:
    rows = []
    for stage in sorted(stages):  # the baselines shard as the highest stage: its textbook
      compiled, plan, secs = target_zero(pat, size, stage, devices)
      rows.append((f"zerojax stage {stage}", compiled, plan, secs))
    top = plan
    for style in ("hand", "maxtext"):
      compiled, secs = target_baseline(pat, size, devices, style)
      rows.append((f"{style}-written FSDP" if style == "hand" else "MaxText-style FSDP",
                   compiled, None, secs))
    for name, compiled, plan, secs in rows:
      text, m = compiled.as_text(), memory.measure(compiled)
      book = memory.textbook_bytes(plan or top)
      ag = memory.collective_schedule(text, "all-gather")
      rs = memory.collective_schedule(text, "reduce-scatter")
      act = sum(memory.activation_collectives(text, plan or top).values())
      # What the overlap shares stand for: the time compute waits on collectives, from the
      # compiled schedule (zerojax.runtime.step_time).
      st = step_time.predict_step_time(text, rates, num_devices=len(devices))
      lines.append(f"| {pat} {DESCRIPTIONS[pat]} | {name} | {mib(m.temp)} | {mib(m.peak)} | "
                   f"{mib(m.collective_total)} | {m.collective_total / book:.2f} | "
                   f"{ag.matmul_share:.0%} / {rs.matmul_share:.0%} | "
                   f"{st.seconds * 1e3:.3f} / {st.exposed_comm_seconds * 1e3:.3f} | "
                   f"{mib(act)} | {secs:.1f} |")
      print(lines[-1], flush=True)
  return "\n".join(lines)


ZEROPP_PATTERNS = ("a", "b", "c", "d1", "d2")  # ZeRO++ needs state.apply_fn (linen)


def zeropp_table(target: str | None, size: Size, pats) -> str:
  """ZeRO++ int8 weights and gradients against the stage-3 default, same compute dtype."""
  from zerojax.runtime import memory
  devices = target_devices(target)
  mib = lambda b: f"{b / 2**20:.1f}"
  int8 = dict(quantize_weights="int8", quantize_gradients="int8")
  head = ("| pattern | compute dtype | step | collectives MiB | × default | × textbook | "
          "temp MiB | activation collectives MiB |")
  lines = [head, "|" + "---|" * 8]
  for pat in pats:
    for cd in (None, "bfloat16"):
      default = None
      for name, kw in (("stage 3 (default)", {}), ("int8 weights + gradients", int8)):
        dtype = {"compute_dtype": cd} if cd else {}
        compiled, plan, _ = target_zero(pat, size, 3, devices, **dtype, **kw)
        text, m = compiled.as_text(), memory.measure(compiled)
        default = default or m.collective_total
        act = sum(memory.activation_collectives(text, plan).values())
        lines.append(f"| {pat} {DESCRIPTIONS[pat]} | {cd or 'float32'} | {name} | "
                     f"{mib(m.collective_total)} | {m.collective_total / default:.2f} | "
                     f"{m.collective_total / memory.textbook_bytes(plan):.2f} | {mib(m.temp)} | "
                     f"{mib(act)} |")
        print(lines[-1], flush=True)
  return "\n".join(lines)


# -- the benchmark ----------------------------------------------------------------------------


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", choices=("full", "small", "wide"), default="full",
                 help="wide: 16x the weights and 4x the rows of full, with --target only")
  p.add_argument("--patterns", default=None,
                 help=f"comma-separated subset of {','.join(PATTERNS)} (all; with --zeropp, "
                 f"of {','.join(ZEROPP_PATTERNS)})")
  p.add_argument("--steps", type=int, default=6, help="timed steps per variant (alternating)")
  p.add_argument("--target", default=None,
                 help="compile ahead of time for this accelerator instead of running on CPU: "
                 "a GPU pod (h100:8) or TPU slice (v5e:2x4)")
  p.add_argument("--stages", default="3", help="with --target: comma-separated stages")
  p.add_argument("--zeropp", action="store_true",
                 help="ZeRO++ int8 against the stage-3 default (patterns a, b, c, d1, d2)")
  args = p.parse_args(argv)
  allowed = ZEROPP_PATTERNS if args.zeropp else PATTERNS
  pats = ([x.strip() for x in args.patterns.split(",") if x.strip()] if args.patterns
          else list(allowed))
  bad = [x for x in pats if x not in allowed]
  if bad:
    p.error(f"--patterns: unknown {bad}; allowed are {', '.join(allowed)}"
            + (" (ZeRO++ needs a linen model called through state.apply_fn)"
               if args.zeropp else ""))
  if args.steps < 2:
    p.error(f"--steps={args.steps} is invalid: needs an integer >= 2 (the first is warm-up)")
  if args.size == "wide" and not args.target:
    p.error("--size=wide is invalid without --target: it is sized for an accelerator compile "
            "(a step per variant on 8 CPU devices would take minutes); pass --target")
  size = {"full": FULL, "small": SMALL, "wide": WIDE}[args.size]
  if args.zeropp:
    import os
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    if not args.target:
      jax.config.update("jax_num_cpu_devices", 8)
    print(f"size {size}; compiled for {args.target or '8 CPU devices'}", flush=True)
    print(zeropp_table(args.target, size, pats))
    return 0
  if args.target:
    import os
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    stages = tuple(int(x) for x in args.stages.split(","))
    print(f"size {size}; compiled for {args.target}", flush=True)
    print(target_table(args.target, size, pats, stages))
    return 0
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  from zerojax.runtime.memory import measure
  mib = lambda b: f"{b / 2**20:.1f}"
  print(f"size {size}; 8 simulated CPU devices; {jax.__version__=}", flush=True)
  header = ("| pattern | stage | temp MiB | × baseline | peak MiB | collectives MiB | "
            "Δloss | Δparams | time × baseline |")
  lines = [header, "|" + "---|" * 9]
  for pat in pats:
    t0 = time.time()
    variants: dict[str, Runner] = {"baseline": baseline_runner(pat, size)}
    for stage in range(4):
      variants[f"stage {stage}"] = zero_runner(pat, size, stage)
    g_bytes = sum(lp.nbytes for lp in variants["stage 3"].plan.leaves)
    ref_losses, ref_params = reference_losses(pat, size, args.steps)
    data = batches(size, pat, args.steps)
    times = {k: [] for k in variants}
    losses = {k: [] for k in variants}
    for b in data:  # alternate: one step of every variant per round
      for k, r in variants.items():
        s = time.perf_counter()
        losses[k].append(r.step(b))
        times[k].append(time.perf_counter() - s)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    base = measure(variants["baseline"].compiled)
    for k, r in variants.items():
      m = measure(r.compiled)
      dl = max(abs(x - y) for x, y in zip(losses[k], ref_losses))
      dp = max_diff(r.params(), ref_params)
      lines.append(
          f"| {pat} {DESCRIPTIONS[pat]} | {k.replace('stage ', '')} | {mib(m.temp)} | "
          f"{m.temp / base.temp:.2f} | {mib(m.peak)} | {mib(m.collective_total)} | "
          f"{dl:.1e} | {dp:.1e} | {med[k] / med['baseline']:.2f} |")
      print(lines[-1], flush=True)
    s1, s2 = measure(variants["stage 1"].compiled), measure(variants["stage 2"].compiled)
    print(f"  {pat}: G = {mib(g_bytes)} MiB; stage-2 temp {mib(s2.temp)} <= stage-1 temp "
          f"{mib(s1.temp)} - 0.75·G·7/8 = {mib(s1.temp - 0.75 * g_bytes * 7 / 8)}: "
          f"{s2.temp <= s1.temp - 0.75 * g_bytes * 7 / 8}; {time.time() - t0:.0f} s", flush=True)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
