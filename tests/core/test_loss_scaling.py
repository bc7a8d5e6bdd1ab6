"""fp16 dynamic loss scaling: the scale rule, skipped overflowing steps (params and optimizer
state bit-identical), parity with an unsharded fp16 run, and the step metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training import train_state

import zerojax
from zerojax.core.train_state import StepSettings, update_scale
from tests import helpers, prec_helpers as ph


def _run_rule(overflows, **kw):
  s = StepSettings(**{"loss_scale": 0, **kw})
  scale, good, hyst = jnp.float32(1024.0), jnp.int32(0), jnp.int32(s.hysteresis)
  out = []
  for o in overflows:
    scale, good, hyst = update_scale(scale, good, hyst, jnp.asarray(not o), s)
    out.append(float(scale))
  return out


def test_loss_scaling_rule_growth_hysteresis_floor():
  # Doubles after `window` consecutive good steps.
  assert _run_rule([0, 0, 0, 0, 0], loss_scale_window=2) == [1024, 2048, 2048, 4096, 4096]
  # Halves only on the `hysteresis`-th consecutive overflow, then on every further one; a good
  # step restores the tolerance.
  assert _run_rule([1, 1, 1, 0, 1, 1], hysteresis=2) == [1024, 512, 256, 256, 256, 128]
  # An overflow resets the growth count.
  assert _run_rule([0, 1, 0, 0], loss_scale_window=2, hysteresis=1) == [1024, 512, 512, 1024]
  # Never below min_loss_scale.
  assert _run_rule([1] * 5, hysteresis=1, min_loss_scale=256.0) == [512, 256, 256, 256, 256]
  # A static scale never moves.
  assert _run_rule([1, 0, 0], loss_scale=128.0) == [1024, 1024, 1024]


@pytest.mark.slow
def test_loss_scaling_forced_overflow_skips_step_bitwise():
  run = ph.fp16_run()
  overflow = [m["overflow"] for m in run.metrics]
  assert overflow == [0, 0, 1, 1, 0]  # the loss x 1e6 steps overflow fp16
  # initial 2**8; grows after 2 good steps; 1st overflow uses up the hysteresis (2), the 2nd
  # halves; a good step keeps it.
  assert [m["loss_scale"] for m in run.metrics] == [256, 512, 512, 256, 256]
  assert [m["skipped_steps"] for m in run.metrics] == [0, 0, 1, 2, 2]
  for i in (2, 3):  # skipped: params and optimizer state untouched, bit for bit
    jax.tree.map(np.testing.assert_array_equal, run.params_each[i], run.params_each[1])
    jax.tree.map(np.testing.assert_array_equal, run.opt_state[i], run.opt_state[1])
  # and the good steps around them did move the parameters
  assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(run.params_each[4]),
                                            jax.tree.leaves(run.params_each[3])))
  assert int(run.state.skipped_steps) == 2 and int(run.state.step) == 5


@pytest.mark.slow
def test_loss_scaling_fp16_matches_unsharded_fp16():
  run, ref = ph.fp16_run(), ph.fp16_reference()
  for k in ("overflow", "loss_scale", "skipped_steps"):
    assert [m[k] for m in run.metrics] == [m[k] for m in ref.metrics], k
  good = [i for i, m in enumerate(ref.metrics) if not m["overflow"]]
  np.testing.assert_allclose([run.metrics[i]["loss"] for i in good],
                             [ref.metrics[i]["loss"] for i in good], rtol=2e-3)
  np.testing.assert_allclose([run.metrics[i]["grad_norm"] for i in good],
                             [ref.metrics[i]["grad_norm"] for i in good], rtol=1e-2)
  # fp16 compute and an fp16 gradient reduction over 8 devices vs one device
  assert ph.relative_update_error(run, ref) < 2e-2


@pytest.mark.slow
def test_loss_scaling_master_params_fp32_and_metrics_without_host_sync():
  run = ph.fp16_run()
  assert {x.dtype for x in jax.tree.leaves(run.state.params)} == {jnp.dtype("float32")}
  b = ph.data(1)[0]
  # The hot path: no device-to-host transfer at all while dispatching a step.
  with jax.transfer_guard_device_to_host("disallow"):
    run.state, m = run.step(run.state, b)
  for k in ("loss", "grad_norm", "loss_scale", "skipped_steps", "overflow"):
    assert isinstance(m[k], jax.Array) and m[k].shape == (), k
  assert isinstance(m["step_time"], float) and m["step_time"] > 0
  assert m["tokens_per_sec"] == pytest.approx(16 * 32 / m["step_time"])
  assert run.step.last_step_time == m["step_time"]


@pytest.mark.slow
def test_loss_scaling_learning_rate_metric():
  m = ph.accumulation_run(1).metrics
  assert [x["learning_rate"] for x in m] == pytest.approx([ph.LR] * len(m))
  assert np.isnan(m[0]["step_time"]) and all(x["step_time"] > 0 for x in m[1:])


def test_loss_scaling_needs_zero_train_state():
  zc = zerojax.ZeroConfig(stage=3, gather=zerojax.Gather(persistence_threshold=helpers.THRESHOLD),
                          loss_scale=0)
  x = ph.data(1)[0]
  state, plan = ph.abstract_state_and_plan(zc, state_cls=train_state.TrainState)
  with pytest.raises(zerojax.ConfigError, match="loss_scale=0 needs a zerojax.ZeroTrainState"):
    zerojax.zero_step(plan)(ph.zero_train_step).lower(state, x)
