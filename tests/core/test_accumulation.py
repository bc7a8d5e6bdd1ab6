"""Gradient accumulation: equals one large-batch step; one reduction per step at stages 0-1;
an accumulator that stays sharded at stages 2-3."""


import dataclasses

import jax
import numpy as np
import pytest

import zerojax
from zerojax.runtime.memory import collective_bytes, measure
from tests import helpers, prec_helpers as ph


@pytest.fixture(scope="module")
def compiled():
  """The compiled accumulation steps (served from JAX's cache: the runs compiled them)."""
  b = ph.data(1)[0]
  return {s: ph.accumulation_run(s).step.lower(ph.accumulation_run(s).state, b).compile()
          for s in range(4)}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_equals_large_batch_step(stage):
  run, ref = ph.accumulation_run(stage), ph.accumulation_reference()
  np.testing.assert_allclose([m["loss"] for m in run.metrics],
                             [m["loss"] for m in ref.metrics], rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
               run.params, ref.params)


def _psi(stage):
  return sum(lp.nbytes for lp in ph.accumulation_run(stage).plan.leaves)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_accumulation_one_gradient_reduction_per_step_stage01(stage, compiled):
  # A reduction per micro-batch would move ACCUM x the gradient; one reduction moves it once:
  # stage 0 all-reduces (2 psi in the paper's count), stage 1 reduce-scatters it to the
  # sharded optimizer (psi) and all-gathers the updated parameters (psi).
  coll, psi = collective_bytes(compiled[stage].as_text()), _psi(stage)
  reduced = coll["all-reduce"] / 2 + coll["reduce-scatter"]
  assert 0.95 * psi <= reduced <= 1.1 * psi, (coll, psi)
  assert sum(coll.values()) <= 2 * psi * 1.1, (coll, psi)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_accumulation_reduce_scatters_each_micro_batch_stage23(stage, compiled):
  # The sharded leaves' gradients are reduce-scattered in every micro-batch's backward pass
  # (all but the token embedding's: XLA all-to-alls its activation cotangent instead, 16 KiB
  # rather than a 64 KB reduce-scatter, and scatter-adds into the local shard). At stage 3 this
  # is the per-use schedule's property (gather='explicit'); by default XLA's partitioner picks
  # how a sharded weight meets its activations (held to hand-written FSDP in test_patterns).
  if stage == 3:
    run = ph.accumulation_run(3, "explicit")
    coll = collective_bytes(run.step.lower(run.state, ph.data(1)[0]).compile().as_text())
    plan = run.plan
  else:
    coll, plan = collective_bytes(compiled[stage].as_text()), ph.accumulation_run(stage).plan
  sharded = sum(lp.nbytes for lp in plan.leaves if lp.is_sharded)
  emb = sum(lp.nbytes for lp in plan.leaves if lp.path == "wte/embedding")
  assert coll["reduce-scatter"] >= 0.95 * ph.ACCUM * (sharded - emb), (coll, sharded)
  assert coll["all-reduce"] < 0.05 * sharded, coll  # no full-gradient all-reduce


def _loop_shapes(hlo):
  """Shapes carried by every ``while`` loop of the compiled (per-device) HLO."""
  return " ".join(l.split(" while(")[0] for l in hlo.splitlines() if " while(" in l)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_memory_accumulator_layout(stage, compiled):
  # The biggest sharded leaf, blocks/fc/kernel (2, 64, 256). Per device, the accumulation
  # loop carries at stages 0-1 the unreduced gradient of this device's rows, f32[1,2,64,256]
  # (a leading data-parallel axis of 8, sharded); at stages 2-3 only the reduce-scattered
  # 1/8 shard f32[2,64,32]: no full gradient in the loop.
  lp = max(ph.accumulation_run(stage).plan.leaves, key=lambda lp: lp.nbytes)
  shard = list(lp.shape)
  shard[list(lp.sharded).index("fsdp")] //= 8
  fmt = lambda s: "f32[" + ",".join(map(str, s)) + "]"
  loops = _loop_shapes(compiled[stage].as_text())
  assert (fmt((1,) + lp.shape) in loops) == (stage <= 1), (lp.path, lp.shape)
  if stage >= 2:
    assert fmt(shard) in loops


@pytest.mark.slow
def test_accumulation_memory_analysis_stage2_saves_gradient(compiled):
  # Stage 1 and 2 differ only in the gradient's layout: the stage-2 step needs at least
  # (1 - 1/8) of a full fp32 gradient less temporary memory.
  t1, t2 = measure(compiled[1]).temp, measure(compiled[2]).temp
  psi = _psi(2)
  assert t1 - t2 >= 0.8 * psi, (t1, t2, psi)


def test_accumulation_plain_value_and_grad_is_refused():
  # The FSDP failure mode: accumulation configured, but the step never accumulates.
  zc = zerojax.ZeroConfig(stage=2, gather=zerojax.Gather(persistence_threshold=helpers.THRESHOLD),
                          batch=zerojax.Batch(micro_per_device=1, accumulation_steps=2))
  x = ph.data(1)[0]
  state, plan = ph.abstract_state_and_plan(zc)
  step = zerojax.zero_step(plan)(ph.plain_step)
  with pytest.raises(zerojax.ConfigError, match="zerojax.value_and_grad"):
    step.lower(state, x)


def test_accumulation_outside_a_step_is_jax_value_and_grad():
  f = lambda p, x: (p * x).sum()
  p, x = np.float32(2.0), np.arange(3, dtype=np.float32)
  assert zerojax.value_and_grad(f)(p, x) == jax.value_and_grad(f)(p, x)


def _one_step(stage, grad_of):
  """One step at ``stage`` with ``ACCUM`` micro-batches, its gradient formed by
  ``grad_of(lf, state)(params, batch)``: ``(loss, grads, new params)``."""
  zc = zerojax.ZeroConfig(stage=stage, gather=zerojax.Gather(
      persistence_threshold=helpers.THRESHOLD), batch=zerojax.Batch(
          micro_per_device=1, accumulation_steps=ph.ACCUM))
  b = ph.data(1)[0]
  state, plan = zerojax.create_train_state(ph.GPT(ph.CFG), ph.sgd(), jax.random.key(0),
                                           jax.numpy.asarray(b["x"]), config=zc)

  def step(state, batch):
    def lf(params, b):
      return ph.loss_fn(state.apply_fn({"params": params}, b["x"]), b["y"])
    loss, grads = grad_of(lf, state, plan)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss, "grads": grads}

  new, m = zerojax.zero_step(plan)(step)(state, b)
  return float(m["loss"]), jax.tree.map(np.asarray, m["grads"]), jax.tree.map(
      np.asarray, new.params)


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_accumulate_is_the_step_s_value_and_grad_made_explicit(stage):
  # The same step, its settings passed (zerojax.accumulate) or read from the step
  # (zerojax.value_and_grad): the same program, so the same bits.
  implicit = _one_step(stage, lambda lf, state, plan: zerojax.value_and_grad(lf))
  explicit = _one_step(stage, lambda lf, state, plan: zerojax.accumulate(lf, plan))
  assert implicit[0] == explicit[0]
  for a, b in zip(jax.tree.leaves(implicit[1:]), jax.tree.leaves(explicit[1:])):
    np.testing.assert_array_equal(a, b)


def test_accumulate_in_a_hand_written_jit_equals_the_large_batch_gradient():
  # No zerojax step: a plain jax.jit over the plan's shardings, accumulation explicit.
  zc = zerojax.ZeroConfig(stage=2, gather=zerojax.Gather(
      persistence_threshold=helpers.THRESHOLD), batch=zerojax.Batch(
          micro_per_device=1, accumulation_steps=ph.ACCUM))
  b = {k: v for k, v in ph.data(1)[0].items() if k != "mult"}
  model = ph.GPT(ph.CFG)
  state, plan = zerojax.create_train_state(model, ph.sgd(), jax.random.key(0),
                                           jax.numpy.asarray(b["x"]), config=zc)
  lf = lambda p, b: ph.loss_fn(model.apply({"params": p}, b["x"]), b["y"])
  jitted = jax.jit(lambda p, b: zerojax.accumulate(lf, plan)(p, b),
                   in_shardings=(plan.params, plan.batch(b)),
                   out_shardings=(plan.replicated, plan.grads))
  lowered = jitted.lower(state.params, b)
  assert " while(" in lowered.compile().as_text()  # the micro-batches are a loop
  loss, grads = jitted(state.params, b)
  ref_loss, ref = jax.jit(jax.value_and_grad(lf))(state.params, b)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  jax.tree.map(lambda a, r: np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-6), grads, ref)
  # The accumulator's layout is the plan's: the gradient comes out sharded.
  assert all(g.sharding.is_equivalent_to(s, g.ndim) for g, s in
             zip(jax.tree.leaves(grads), jax.tree.leaves(plan.grads)))


@pytest.mark.parametrize("kw, match", [
    (dict(plan="not a plan"), r"plan=str is invalid: the run's zerojax.ShardingPlan"),
    (dict(steps=0), r"steps=0 is invalid: a positive int"),
    (dict(steps=2.0), r"steps=2.0 is invalid: a positive int"),
])
def test_accumulate_refuses_bad_arguments_in_one_line(kw, match):
  zc = zerojax.ZeroConfig(stage=2, gather=zerojax.Gather(persistence_threshold=helpers.THRESHOLD))
  _, plan = ph.abstract_state_and_plan(zc)
  args = {"plan": plan, **kw}
  with pytest.raises(TypeError, match=match):
    zerojax.accumulate(lambda p, x: x.sum(), args.pop("plan"), **args)


def test_accumulate_rows_that_do_not_split_are_named():
  zc = zerojax.ZeroConfig(stage=2, gather=zerojax.Gather(persistence_threshold=helpers.THRESHOLD))
  _, plan = ph.abstract_state_and_plan(zc)
  f = zerojax.accumulate(lambda p, x: (p * x).mean(), plan, steps=3)
  with pytest.raises(zerojax.ConfigError, match="gradient_accumulation_steps=3"):
    jax.eval_shape(f, jax.numpy.float32(1.0), jax.numpy.zeros((16, 4)))


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_accumulate_nnx_is_the_step_s_value_and_grad_made_explicit(stage):
  from flax import nnx
  from zerojax.models import nnx_gpt
  cfg = dataclasses.replace(helpers.TINY, scan=False)
  zc = zerojax.ZeroConfig(stage=stage, gather=zerojax.Gather(
      persistence_threshold=helpers.THRESHOLD), batch=zerojax.Batch(
          micro_per_device=1, accumulation_steps=ph.ACCUM))
  b = helpers.batches(cfg, 1)[0]

  def run(grad_of):
    model, opt, plan = zerojax.create_nnx(lambda: nnx_gpt(cfg, nnx.Rngs(0)), helpers.make_tx(),
                                          config=zc)

    def step(model, opt, batch):
      lf = lambda m, b: ph.loss_fn(m(b["x"]), b["y"])
      loss, grads = grad_of(lf, plan)(model, batch)
      opt.update(model, grads)
      return {"loss": loss}

    loss = float(zerojax.zero_step(plan)(step)(model, opt, b)["loss"])
    return loss, jax.tree.map(np.asarray, nnx.state(model, nnx.Param))

  implicit = run(lambda lf, plan: zerojax.value_and_grad(lf))
  explicit = run(lambda lf, plan: zerojax.accumulate(lf, plan))
  assert implicit[0] == explicit[0]
  for a, c in zip(jax.tree.leaves(implicit[1]), jax.tree.leaves(explicit[1])):
    np.testing.assert_array_equal(a, c)
