"""Memory checked before it runs out: a compiled step (or a train state) bigger than the
devices' ``bytes_limit`` fails with the numbers and a suggestion, before anything is allocated.
CPU reports no limit, so the tests inject one."""

import jax
import numpy as np
import jax.numpy as jnp
import pytest

import zerojax
from zerojax.core import budget
from zerojax.models import GPT
from tests import helpers


class _FakeDevice:
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    if isinstance(self.stats, Exception):
      raise self.stats
    return self.stats


def test_bytes_limit_reads_memory_stats():
  assert budget.bytes_limit(jax.devices()) is None  # CPU: no stats, nothing is checked
  devs = [_FakeDevice({"bytes_limit": 1000, "bytes_in_use": 5}), _FakeDevice({"bytes_limit": 800})]
  assert budget.bytes_limit(devs) == 800
  assert budget.bytes_limit([_FakeDevice(None), _FakeDevice(RuntimeError("no stats"))]) is None


@pytest.fixture(scope="module")
def stage0():
  b = helpers.batches(helpers.TINY, 1, batch=8)[0]
  zc = zerojax.ZeroConfig(stage=0, gather=zerojax.Gather(persistence_threshold=helpers.THRESHOLD))
  state, plan = zerojax.create_train_state(GPT(helpers.TINY), helpers.make_tx(),
                                           jax.random.key(0), jnp.asarray(b["x"]), config=zc)
  step = zerojax.zero_step(plan)(helpers.train_step)
  peak, _ = budget.compiled_peak(step.lower(state, b).compile())
  return state, plan, b, peak


_mib = budget._mib  # the message's unit format


def test_step_over_the_limit_fails_before_it_runs(stage0, monkeypatch):
  state, plan, b, peak = stage0
  est = {s: budget.estimate(state.params, helpers.make_tx(), config=plan.config.replace(stage=s),
                            num_devices=8).total for s in range(4)}
  # Between stage 0's peak and its peak with stage 3's model state instead of stage 0's.
  limit = peak - (est[0] - est[3]) // 2
  monkeypatch.setattr(budget, "bytes_limit", lambda devices: limit)
  step = zerojax.zero_step(plan)(helpers.train_step)  # a fresh step: compiles on first call
  with pytest.raises(budget.DeviceMemoryError) as e:
    step(state, b)
  msg = str(e.value)
  assert f"the compiled step needs {_mib(peak)} per device" in msg
  assert f"more than the {_mib(limit)} the device has" in msg
  assert "RESOURCE_EXHAUSTED" in msg
  # the suggestion: the first stage whose model state brings the peak under the limit
  first = next(s for s in (1, 2, 3) if peak - est[0] + est[s] <= limit)
  assert f"stage {first} would need about {_mib(peak - est[0] + est[first])} per device" in msg
  assert f"set stage={first}" in msg
  # nothing ran: the donated state is intact
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))
  # with the limit at the peak the same step runs
  monkeypatch.setattr(budget, "bytes_limit", lambda devices: peak)
  step2 = zerojax.zero_step(plan)(helpers.train_step)
  _, m = step2(jax.tree.map(jnp.copy, state), b)
  assert jnp.isfinite(m["loss"])


@pytest.mark.slow
def test_nothing_fits_says_so(stage0):
  state, plan, b, peak = stage0
  compiled = zerojax.zero_step(plan)(helpers.train_step).lower(state, b).compile()
  with pytest.raises(budget.DeviceMemoryError, match="Even stage 3 \\+ offload_optimizer \\+ "
                     "offload_params would need about .* use more devices"):
    budget.check_fits(compiled, jax.devices(), limit=1024, config=plan.config,
                      params=state.params, tx=helpers.make_tx())
  assert budget.check_fits(compiled, jax.devices(), limit=peak) == peak
  assert budget.check_fits(compiled, jax.devices()) is None  # CPU: no limit, no check


def test_create_train_state_too_big_fails_early(monkeypatch):
  b = helpers.batches(helpers.TINY, 1, batch=8)[0]
  zc = zerojax.ZeroConfig(stage=0, gather=zerojax.Gather(persistence_threshold=helpers.THRESHOLD))
  plan = zerojax.ShardingPlan.create(
      zc, zerojax.make_mesh(zc),
      jax.eval_shape(lambda: GPT(helpers.TINY).init(jax.random.key(0), b["x"])["params"]),
      helpers.make_tx())
  bpd = plan.bytes_per_device()
  need = bpd["params"] + bpd["opt_state"]
  monkeypatch.setattr(budget, "bytes_limit", lambda devices: need - 1)
  before = len(jax.live_arrays())
  with pytest.raises(budget.DeviceMemoryError) as e:
    zerojax.create_train_state(GPT(helpers.TINY), helpers.make_tx(), jax.random.key(0),
                               jnp.asarray(b["x"]), config=zc)
  msg = str(e.value)
  assert f"the train state needs {_mib(need)} per device" in msg
  assert f"parameters {_mib(bpd['params'])} + optimizer state {_mib(bpd['opt_state'])}" in msg
  assert "set stage=" in msg
  assert len(jax.live_arrays()) <= before + 2  # nothing of the state was created


@pytest.mark.slow
def test_nnx_step_over_the_limit_fails_before_it_runs(monkeypatch):
  import dataclasses
  from flax import nnx
  from zerojax.models import loss_fn, nnx_gpt
  cfg = dataclasses.replace(helpers.TINY, scan=False)
  zc = zerojax.ZeroConfig(stage=1, gather=zerojax.Gather(persistence_threshold=helpers.THRESHOLD))
  model, opt, plan = zerojax.create_nnx(lambda: nnx_gpt(cfg, nnx.Rngs(0)), helpers.make_tx(),
                                        config=zc)

  def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: loss_fn(m(batch["x"]), batch["y"]))(model)
    optimizer.update(model, grads)
    return {"loss": loss}

  monkeypatch.setattr(budget, "bytes_limit", lambda devices: 4096)
  before = jax.tree.map(lambda x: x.copy(), nnx.state(model, nnx.Param))
  with pytest.raises(budget.DeviceMemoryError, match="more than the 4.0 KiB the device has"):
    zerojax.zero_step(plan)(train_step)(model, opt, helpers.batches(cfg, 1)[0])
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), before,
               nnx.state(model, nnx.Param))
