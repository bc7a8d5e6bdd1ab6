"""AOT-compiles a stage-3 step for N simulated CPU devices and prints measured vs estimated
per-device bytes as JSON (run by tests/core/test_scale.py in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``). Nothing is allocated: the state and
the batch are abstract (``jax.ShapeDtypeStruct`` with the plan's shardings).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
  n = int(sys.argv[1])
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax.training import train_state

  import zerojax
  import zerojax.runtime.memory as zm
  from tests import helpers
  from zerojax.models import GPT, GPTConfig

  assert jax.device_count() == n, (jax.device_count(), n)
  cfg = GPTConfig(vocab_size=256, seq_len=64, num_layers=2, num_heads=4, d_model=128)
  model = GPT(cfg)
  tx = optax.adamw(1e-3)
  batch = n  # one row per device
  x = jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32)
  zc = zerojax.ZeroConfig(stage=3, gather=zerojax.Gather(persistence_threshold=0))
  mesh = zerojax.make_mesh(zc)

  params = jax.eval_shape(lambda: model.init(jax.random.key(0), x)["params"])
  plan = zerojax.ShardingPlan.create(zc, mesh, params, tx)
  abstract = jax.eval_shape(lambda: train_state.TrainState.create(
      apply_fn=model.apply, params=jax.tree.map(jnp.zeros_like, params), tx=tx))
  state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                       abstract, plan.state(abstract))
  bsh = plan.batch({"x": x, "y": x})
  b = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=bsh[k]) for k in ("x", "y")}
  step = zerojax.zero_step(plan)(helpers.train_step)
  compiled = step.lower(state, b).compile()
  m = zm.measure(compiled)
  est = zm.estimate(params, tx, config=zc, mesh=mesh)
  batch_bytes = 2 * batch * cfg.seq_len * 4 // n
  other = 4  # the step counter (int32, replicated)
  print("RESULT " + json.dumps({
      "devices": n, "num_params": int(sum(np.prod(l.shape) for l in jax.tree.leaves(params))),
      "argument": m.argument, "output": m.output, "alias": m.alias, "temp": m.temp,
      "peak": m.peak, "collectives": m.collectives,
      "est_params": est.params, "est_grads": est.grads, "est_opt_state": est.opt_state,
      "est_persistent": est.persistent, "est_total": est.total, "batch_bytes": batch_bytes,
      "other": other, "paper_stage3_fp32": zm.paper_bytes(
          sum(np.prod(l.shape) for l in jax.tree.leaves(params)), 3, n, k=8) * 2,
  }), flush=True)


if __name__ == "__main__":
  main()
