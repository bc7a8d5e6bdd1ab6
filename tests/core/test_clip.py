"""Gradient clipping by global norm over sharded gradients: the norm equals the unsharded norm
(every element counted once, DeepSpeed #7718) and the update equals optax's unsharded clip."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax
from tests import prec_helpers as ph


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_grad_norm_equals_unsharded_norm(stage):
  # The runs accumulate 2 micro-batches with gradient_clipping=1.0; the reference is one
  # device, the whole batch, plain jax.value_and_grad and optax.tree.norm.
  run, ref = ph.accumulation_run(stage), ph.accumulation_reference()
  norms, ref_norms = [m["grad_norm"] for m in run.metrics], [m["grad_norm"] for m in ref.metrics]
  assert min(ref_norms) > ph.CLIP  # clipping was active on every step
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_clip_update_equals_optax_clip_chain(stage):
  # Same parameters as one device running optax.chain(clip_by_global_norm(1.0), adamw).
  run, ref = ph.accumulation_run(stage), ph.accumulation_reference()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
               run.params, ref.params)


def test_clip_sharded_norm_counts_replicated_and_sharded_leaves_once():
  # A tree with a sharded leaf, a replicated leaf and a scalar, laid out on the 8-device mesh
  # as stage 3 would; apply_gradients with SGD(lr=1) exposes the clipped gradient exactly.
  mesh = zerojax.make_mesh(zerojax.ZeroConfig())
  rng = np.random.default_rng(0)
  grads = {"w": rng.normal(size=(16, 8)).astype(np.float32),
           "b": rng.normal(size=(3,)).astype(np.float32), "s": np.float32(2.0)}
  params = jax.tree.map(np.zeros_like, grads)
  specs = {"w": P("fsdp"), "b": P(), "s": P()}
  put = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, specs)
  state = zerojax.ZeroTrainState.create(
      apply_fn=None, params=put(params), tx=optax.sgd(1.0),
      config=zerojax.ZeroConfig(gradient_clipping=1.0))
  new = jax.jit(lambda st, g: st.apply_gradients(grads=g))(state, put(grads))
  want = np.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(grads)))
  np.testing.assert_allclose(float(new.grad_norm), want, rtol=1e-6)
  clipped, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  jax.tree.map(lambda p, c: np.testing.assert_allclose(np.asarray(p), -np.asarray(c), rtol=1e-6),
               new.params, clipped)
  assert new.params["w"].sharding.spec == P("fsdp")
