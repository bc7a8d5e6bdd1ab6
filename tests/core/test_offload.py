"""Host offload through memory kinds: parity, placement, HLO transfers, reporting, errors."""

import dataclasses
import re
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from zerojax.core import memory_kinds
from tests import helpers

VARIANTS = {
    "opt1": dict(stage=1, offload_optimizer=True),
    "opt2": dict(stage=2, offload_optimizer=True),
    "opt3": dict(stage=3, offload_optimizer=True),
    "params3": dict(stage=3, offload_optimizer=True, offload_params=True),
    "host_update2": dict(stage=2, offload_optimizer=True, optimizer_on_host=True),
}


@pytest.fixture(scope="module")
def offload_runs():
  return {k: helpers.zero_run(helpers.TINY, **kw) for k, kw in VARIANTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_offload_parity_with_device_run(name, offload_runs, zero_runs):
  run = offload_runs[name]
  ref = zero_runs[VARIANTS[name]["stage"]]
  np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
               run.params, ref.params)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_offload_state_rests_in_pinned_host(name, offload_runs):
  st = offload_runs[name].state
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(st.opt_state)}
  assert kinds == {"pinned_host"}
  pkinds = {x.sharding.memory_kind for x in jax.tree.leaves(st.params)}
  assert pkinds == ({"pinned_host"} if VARIANTS[name].get("offload_params") else {"device"})
  # still sharded as the stage says
  mu = st.opt_state[0].mu["blocks"]["fc"]["kernel"]
  assert "fsdp" in tuple(mu.sharding.spec)


def _scan_bodies_with_fetch(jaxpr):
  """Count scan bodies (recursively) that move a value to device memory."""
  found = 0
  for eqn in jaxpr.eqns:
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      if eqn.primitive.name == "scan" and any(
          e.primitive.name == "device_put" and
          any(getattr(d, "memory_kind", None) == "device" for d in e.params["devices"])
          for e in helpers.all_eqns(sub)):
        found += 1
      found += _scan_bodies_with_fetch(sub)
  return found


@pytest.mark.slow
@pytest.mark.parametrize("name", ["opt2", "params3"])
def test_offload_hlo_has_host_transfers(name, offload_runs):
  run = offload_runs[name]
  batch = helpers.batches(helpers.TINY, 1)[0]
  jitted = run.step.jitted(run.state, batch)
  # On CPU host and device memory are the same RAM, so XLA:CPU drops the copies and only the
  # entry layouts keep the host memory space S(5). Lowering the same step for TPU shows the
  # transfers XLA will run there: annotate_device_placement custom calls.
  compiled = jitted.lower(run.state, batch).compile().as_text()
  assert "S(5)" in compiled.split("\n", 1)[0]
  mlir = jax.export.export(jitted, platforms=["tpu"])(run.state, batch).mlir_module()
  places = re.findall(r'_xla_buffer_placement = "(\w+)"', mlir)
  n_opt = len(jax.tree.leaves(run.state.opt_state))
  assert places.count("pinned_host") >= n_opt  # the new optimizer state goes back to host
  assert places.count("device") >= n_opt  # ... after coming to the device for the update
  if name == "params3":
    # Each scanned layer's shard is fetched inside the layer's body (forward and backward),
    # not all at once before the loop.
    assert _scan_bodies_with_fetch(jitted.trace(run.state, batch).jaxpr.jaxpr) >= 2


@pytest.mark.slow
def test_offload_device_bytes_drop_by_offloaded_bytes(offload_runs, zero_runs):
  dev = zero_runs[3].plan.bytes_per_device()
  off = offload_runs["params3"].plan.bytes_per_device()
  assert off["opt_state"] == 0 and off["opt_state_host"] == dev["opt_state"]
  assert off["params"] == 0 and off["params_host"] == dev["params"]
  table = offload_runs["params3"].plan.table()
  assert "(host)" in table and "opt_state_host" in table


@pytest.mark.slow
def test_offload_remat_policy_offloads_named_activations():
  run = helpers.zero_run(helpers.TINY, 2, steps=3, remat="offload",
                         remat_offload_names=("mlp_hidden",))
  ref = helpers.reference_run(helpers.TINY, steps=3)
  np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-5, atol=1e-5)
  batch = helpers.batches(helpers.TINY, 1)[0]
  jitted = run.step.jitted(run.state, batch)
  # No state is offloaded here: every host placement is a residual going to pinned_host.
  mlir = jax.export.export(jitted, platforms=["tpu"])(run.state, batch).mlir_module()
  assert re.findall(r'_xla_buffer_placement = "(\w+)"', mlir).count("pinned_host") > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "dots"])
def test_offload_remat_policies_keep_parity(policy):
  run = helpers.zero_run(helpers.TINY, 3, steps=3, remat=policy)
  ref = helpers.reference_run(helpers.TINY, steps=3)
  np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["nnx", "pure"])
def test_remat_offload_reaches_nnx_and_pure_models_without_scans(kind):
  # config.remat checkpointed only linen models without scans: an NNX list of blocks or a pure
  # function ran as written, and remat="offload" silently offloaded nothing.
  import optax
  from flax import nnx
  from jax.ad_checkpoint import checkpoint_name
  from zerojax.core.plan import ShardingPlan
  cfg = zerojax.ZeroConfig(stage=2, remat=zerojax.Remat("offload", offload_names=("hidden",)))
  tx, x = optax.adam(1e-3), jnp.ones((16, 32))
  if kind == "nnx":
    class Block(nnx.Module):
      def __init__(self, rngs):
        self.up, self.down = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 32, rngs=rngs)

      def __call__(self, x):
        return x + self.down(checkpoint_name(jnp.tanh(self.up(x)), "hidden"))

    class Net(nnx.Module):
      def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])

      def __call__(self, x):
        for b in self.blocks:
          x = b(x)
        return x

    model, opt, plan = zerojax.create_nnx(lambda: Net(nnx.Rngs(0)), tx, config=cfg)

    @zerojax.zero_step(plan)
    def step(model, opt, x):
      loss, g = zerojax.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x)
      opt.update(model, g)
      return {"loss": loss}
    args = (model, opt, x)
  else:
    def apply(p, x):
      for i in range(2):
        x = x + checkpoint_name(jnp.tanh(x @ p["up"][i]), "hidden") @ p["down"][i]
      return x

    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"up": jax.random.normal(k1, (2, 32, 64)) * 0.1,
              "down": jax.random.normal(k2, (2, 64, 32)) * 0.1}
    plan = ShardingPlan.create(cfg, zerojax.make_mesh(cfg), params, tx)
    state = zerojax.ZeroTrainState.create(apply_fn=apply, params=params, tx=tx, config=cfg)
    state = jax.device_put(state, plan.state(state))

    @zerojax.zero_step(plan)
    def step(state, x):
      loss, g = zerojax.value_and_grad(lambda p, x: jnp.mean(state.apply_fn(p, x) ** 2))(
          state.params, x)
      return state.apply_gradients(grads=g), {"loss": loss}
    args = (state, x)
  jitted = step.jitted(*args)
  assert next(iter(step.remat.values())) == (
      "remat='offload': on each of 2 blocks (blocks/0 ... blocks/1)" if kind == "nnx" else
      "remat='offload': around the whole model, which saves little (no modules repeat, or it "
      "is a pure function)")
  if kind == "nnx":  # the jitted NNX step takes the split state
    args = (nnx.split((model, opt))[1], x)
  mlir = jax.export.export(jitted, platforms=["tpu"])(*args).mlir_module()
  assert re.findall(r'_xla_buffer_placement = "(\w+)"', mlir).count("pinned_host") > 0


def test_offload_missing_pinned_host_errors_or_falls_back(monkeypatch):
  monkeypatch.setattr(memory_kinds, "supported_memory_kinds", lambda mesh: frozenset({"device"}))
  cfg = zerojax.ZeroConfig(stage=2, offload=zerojax.HostOffload())
  with pytest.raises(zerojax.ConfigError, match="no 'pinned_host' memory"):
    zerojax.ShardingPlan.create(cfg, zerojax.make_mesh(cfg), {"w": jnp.zeros((64, 64))},
                                tx=helpers.make_tx())
  cfg = cfg.replace(offload=dataclasses.replace(cfg.offload, fallback="warn"))
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    plan = zerojax.ShardingPlan.create(cfg, zerojax.make_mesh(cfg), {"w": jnp.zeros((64, 64))},
                                       tx=helpers.make_tx())
  assert any("falls back" in str(x.message) or "keeping the state on device" in str(x.message)
             for x in w)
  assert "pinned_host" not in {s.memory_kind for s in jax.tree.leaves(plan.opt_state)}


def test_offload_detects_cpu_memory_kinds():
  cfg = zerojax.ZeroConfig(stage=1)
  assert "pinned_host" in memory_kinds.supported_memory_kinds(zerojax.make_mesh(cfg))


@pytest.mark.parametrize("kw, match", [
    (dict(stage=0, offload_optimizer=True), "needs stage >= 1"),
    (dict(stage=2, offload_params=True), "needs stage 3"),
    (dict(stage=2, optimizer_on_host=True), "needs offload_optimizer"),
])
def test_offload_with_wrong_stage_says_why(kw, match):
  with pytest.raises(zerojax.ConfigError, match=match):
    zerojax.ZeroConfig.from_flat(kw)
