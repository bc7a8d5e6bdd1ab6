"""`zerojax.master_weights`: bf16 parameters, a float32 master copy in the optimizer state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import helpers
from zerojax.models import GPT


def test_master_weights_moves_parameters_to_their_rounded_master_values():
  params = {"w": jnp.asarray(np.linspace(-1, 1, 64).reshape(8, 8), jnp.bfloat16)}
  tx = zerojax.master_weights(optax.adam(1e-3))
  state = tx.init(params)
  assert state.master["w"].dtype == jnp.float32
  assert np.array_equal(np.asarray(state.master["w"]), np.asarray(params["w"], np.float32))
  grads = {"w": jnp.full((8, 8), 0.5, jnp.bfloat16)}
  for _ in range(5):
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert params["w"].dtype == jnp.bfloat16
  # Each bf16 parameter is its master value rounded once; the master is float32 Adam's.
  assert np.array_equal(np.asarray(params["w"]), np.asarray(state.master["w"].astype(jnp.bfloat16)))
  ref_state = optax.adam(1e-3).init({"w": jnp.asarray(np.linspace(-1, 1, 64).reshape(8, 8),
                                                     jnp.float32)})
  ref = {"w": jnp.asarray(np.asarray(np.linspace(-1, 1, 64).reshape(8, 8), jnp.bfloat16),
                          jnp.float32)}
  for _ in range(5):
    u, ref_state = optax.adam(1e-3).update({"w": jnp.full((8, 8), 0.5)}, ref_state, ref)
    ref = optax.apply_updates(ref, u)
  assert np.array_equal(np.asarray(state.master["w"]), np.asarray(ref["w"]))


def test_master_weights_errors_name_the_problem():
  with pytest.raises(ValueError, match="master_weights\\(dtype='int32'\\).*floating"):
    zerojax.master_weights(optax.sgd(1.0), dtype="int32")
  tx = zerojax.master_weights(optax.sgd(1.0))
  state = tx.init({"w": jnp.zeros(3, jnp.bfloat16)})
  with pytest.raises(ValueError, match="needs the parameters"):
    tx.update({"w": jnp.zeros(3, jnp.bfloat16)}, state)


@pytest.mark.slow
def test_master_weights_shard_with_the_optimizer_state_at_every_stage():
  """bf16 parameters and a float32 master copy: the master is optimizer state, so stages 1-3
  shard it (2 + 2 + 12 bytes per parameter with Adam, ZeRO's accounting)."""
  cfg = helpers.TINY
  data = helpers.batches(cfg, 3)
  for stage in (1, 3):
    zc = zerojax.ZeroConfig(stage=stage,
                            precision=zerojax.Precision(param="bfloat16", compute="bfloat16"),
                            gather=zerojax.Gather(persistence_threshold=helpers.THRESHOLD))
    state, plan = zerojax.create_train_state(
        GPT(cfg), zerojax.master_weights(helpers.make_tx()), jax.random.key(0),
        jnp.asarray(data[0]["x"]), config=zc)
    step = zerojax.zero_step(plan)(helpers.train_step)
    losses = []
    for b in data:
      state, m = step(state, b)
      losses.append(float(m["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    master = jax.tree.leaves(state.opt_state.master)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in master} == {jnp.dtype(jnp.float32)}
    big = [x for x in master if x.size >= 8 * helpers.THRESHOLD]
    assert big and all(x.addressable_shards[0].data.size * 8 == x.size for x in big)
