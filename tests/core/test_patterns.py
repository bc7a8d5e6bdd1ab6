"""ZeRO's guarantees on the models people write (small versions of `benchmarks/patterns.py`).

Every pattern runs at the *default* config (only ``stage`` set), against a hand-written JAX
FSDP baseline (jit in/out shardings only) compiled for the same model. Asserted from XLA's
memory analysis (deterministic) and two training steps against an unsharded run:

* stage-3 temp <= the baseline's temp (plus the few bytes of leaves the plan leaves replicated
  on purpose);
* stage-2 temp <= stage-1 temp - 0.75·G·7/8 (stage 1 holds its local gradient until one
  reduction after the backward pass, stage 2 never holds the full gradient);
* losses and final parameters within 1e-5 of one device, stages 0-3.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as nn

import zerojax
from tests import model_patterns as pt
from zerojax.core import backend
from zerojax.runtime.memory import measure

pytestmark = pytest.mark.slow

SIZE = pt.SMALL
STEPS = 2
TOL = 1e-5


@pytest.fixture(scope="module", params=pt.PATTERNS)
def pattern(request):
  """Baseline, stages 0-3 and the unsharded reference of one pattern, each run STEPS steps."""
  pat = request.param
  runners = {"baseline": pt.baseline_runner(pat, SIZE)}
  for stage in range(4):
    runners[stage] = pt.zero_runner(pat, SIZE, stage)
  data = pt.batches(SIZE, pat, STEPS)
  losses = {k: [r.step(b) for b in data] for k, r in runners.items()}
  ref_losses, ref_params = pt.reference_losses(pat, SIZE, STEPS)
  mem = {k: measure(r.compiled) for k, r in runners.items()}
  g = sum(lp.nbytes for lp in runners[3].plan.leaves)
  return dict(name=pat, runners=runners, losses=losses, mem=mem, g=g, ref_losses=ref_losses,
              ref_params=ref_params)


# Rows per step where the per-use formulation is compared with the baseline. At SIZE's 64 rows a
# layer's activations are a small fraction of its weights, so the baseline, whose partitioner
# all-gathers those activations instead, holds less than the one gathered layer per use holds
# (pattern c: 0.79 MB against 0.46 MB); from a batch of 512 rows up, per use holds less
# (2.50 MB against 4.28 MB).
PER_USE_ROWS = 512


def test_patterns_stage3_temp_at_most_hand_written_fsdp(pattern):
  m3, base = pattern["mem"][3], pattern["mem"]["baseline"]
  if pattern["runners"][3].formulation == "per use":  # unscanned linen without remat
    size = dataclasses.replace(SIZE, rows=PER_USE_ROWS)
    runner = pt.zero_runner(pattern["name"], size, 3)
    m3, base = measure(runner.compiled), measure(pt.baseline_runner(pattern["name"], size).compiled)
  # The baseline shards every leaf; zerojax keeps leaves under param_persistence_threshold
  # replicated on purpose (DeepSpeed's default: a collective per bias is not worth it), whose
  # gradients are then whole. That is the only allowance: at the benchmark's size it is below
  # 1% and stage 3 is at or under the baseline outright (BENCHMARKS.md).
  replicated = sum(pattern["runners"][3].plan.unsharded_bytes().values())
  assert m3.temp <= base.temp + replicated, (pattern["name"], m3.temp, base.temp, replicated)


def test_patterns_stage2_below_stage1_by_gradient(pattern):
  m1, m2, g = pattern["mem"][1], pattern["mem"][2], pattern["g"]
  assert m1.temp >= g  # stage 1 holds each device's local gradient (the paper's P_os)
  assert m2.temp <= m1.temp - 0.75 * g * 7 / 8, (pattern["name"], m1.temp, m2.temp, g)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_patterns_parity_with_one_device(pattern, stage):
  np.testing.assert_allclose(pattern["losses"][stage], pattern["ref_losses"], rtol=TOL,
                             atol=TOL)
  got = jax.tree.leaves(pattern["runners"][stage].params())
  want = jax.tree.leaves(pattern["ref_params"])
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)


def test_patterns_persistent_bytes_shrink_by_stage(pattern):
  # Arguments are the resting state: stage 3 holds about 1/8 of stage 0's.
  m0, m3 = pattern["mem"][0], pattern["mem"][3]
  assert m3.argument <= 0.2 * m0.argument


# -- temp does not grow with depth (gathered layers are released) ---------------------------------


class _Mlp(nn.Module):
  depth: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):  # Dense with a bias under the persistence threshold
      x = x + nn.Dense(512)(nn.relu(nn.Dense(512)(x)))
    return x


def _mlp_temp(depth: int, **kw) -> int:
  cfg = zerojax.ZeroConfig.from_flat(dict(stage=3, **kw))
  x = jnp.ones((64, 512))
  state, plan = zerojax.create_train_state(_Mlp(depth), optax.adam(1e-3), jax.random.key(0), x,
                                           config=cfg)
  if backend.CPU.persistence_threshold(cfg):
    assert any(lp.reason == "threshold" for lp in plan.leaves)  # the biases stay replicated

  def step(state, batch):
    loss, g = jax.value_and_grad(
        lambda p: jnp.mean(state.apply_fn({"params": p}, batch["x"]) ** 2))(state.params)
    return state.apply_gradients(grads=g), {"loss": loss}
  return measure(zerojax.zero_step(plan)(step).lower(state, {"x": x}).compile()).temp


@pytest.mark.parametrize("gather", ["auto", "explicit"])
@pytest.mark.parametrize("threshold", [None, 4096])
def test_stage3_temp_does_not_grow_with_depth_at_default_threshold(gather, threshold):
  """At the default threshold, and at 4096, where every bias stays replicated (the default under
  gather='explicit'): a module's replicated leaves do not switch its per-layer gathering off."""
  layer = 2 * 512 * 512 * 4  # one block's weights, gathered
  kw = dict(gather=gather, param_persistence_threshold=threshold)
  t4, t8 = _mlp_temp(4, **kw), _mlp_temp(8, **kw)
  # Four more blocks may add their activations (8 rows per device) but not their weights.
  assert t8 - t4 < 0.5 * layer, (t4, t8)


# -- a plain pytree reading one layer of a stacked weight at a time ------------------------------


def test_pytree_stacked_rows_reach_the_bound_at_depth():
  """Pattern g at 12 layers, where it used to fail: autodiff makes every ``w[i]`` a zero-padded
  full-size cotangent and XLA kept all of them for one sum (stage 2 held more than the
  gradient). Each row's gradient is now reduce-scattered where it is made and added in place."""
  size = dataclasses.replace(SIZE, layers=12)
  mem = {s: measure(pt.zero_runner("g", size, s).compiled) for s in (1, 2, 3)}
  g = sum(lp.nbytes for lp in pt.zero_runner("g", size, 0).plan.leaves)
  base = measure(pt.baseline_runner("g", size).compiled)
  assert mem[1].temp >= g
  assert mem[2].temp <= mem[1].temp - 0.75 * g * 7 / 8, (mem[1].temp, mem[2].temp, g)
  # Stage 3 gathers one row where it is read; the baseline's w[i] gathers the whole stack.
  assert mem[3].temp <= base.temp, (mem[3].temp, base.temp)
  assert mem[3].temp < 0.5 * g, (mem[3].temp, g)


def test_pytree_rows_read_by_a_model_keep_its_values():
  """The rewrite touches only whole-row ``w[i]`` reads: a model that also reads the whole stack
  and part of a row, indexes a row twice and takes a non-array argument computes exactly what
  it computes unwrapped."""
  from zerojax.core.rows import per_layer_reads
  mesh = zerojax.make_mesh(zerojax.ZeroConfig(stage=2))
  params = {"w": jax.random.normal(jax.random.key(0), (3, 8, 8)), "b": jnp.ones((8,))}
  plan = zerojax.ShardingPlan.create(zerojax.ZeroConfig(stage=2), mesh, params, optax.sgd(0.1))

  def model(p, x, *, scale):
    for i in range(3):
      x = jnp.tanh(x @ p["w"][i] + p["w"][i][0] + p["b"])
    return scale * x.sum() + p["w"].sum() + p["w"][1, :4].sum()  # a part of a row, as written

  x = jnp.ones((4, 8))
  f = lambda p: model(p, x, scale=2.0)
  wrapped = lambda p: per_layer_reads(model, plan)(p, x, scale=2.0)
  np.testing.assert_allclose(wrapped(params), f(params), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(jax.grad(wrapped)(params)), jax.tree.leaves(jax.grad(f)(params))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  def stacked_pads(fn):  # zero-padded cotangents of the whole stack
    return sum(e.primitive.name == "pad" and e.outvars[0].aval.shape == (3, 8, 8)
               for e in jax.make_jaxpr(jax.grad(fn))(params).jaxpr.eqns)
  # Rows' cotangents are added in place into one stacked gradient, not zero-padded and summed.
  # Two reads of each of 3 rows, and the part of a row (run as written, its own pad).
  assert stacked_pads(f) == 7 and stacked_pads(wrapped) == 1


def test_pytree_rows_feeding_matmuls_keep_values_either_side():
  """Rows read only by a matmul are sliced by `_row_dot` itself, on either side of the matmul
  and with any contraction: values and gradients equal the unwrapped model's."""
  from zerojax.core.rows import per_layer_reads
  mesh = zerojax.make_mesh(zerojax.ZeroConfig(stage=2))
  params = {"u": jax.random.normal(jax.random.key(0), (3, 8, 8)),
            "v": jax.random.normal(jax.random.key(1), (3, 8, 16))}
  plan = zerojax.ShardingPlan.create(zerojax.ZeroConfig(stage=2), mesh, params, optax.sgd(0.1))

  def model(p, x):
    for i in range(3):
      x = jnp.tanh(p["u"][i] @ x.T).T  # the row on the left
      x = jnp.einsum("bd,de->be", x, p["v"][i])[:, :8]  # on the right, through einsum
    return (x ** 2).sum()

  x = jax.random.normal(jax.random.key(2), (4, 8))
  wrapped = per_layer_reads(model, plan)
  np.testing.assert_allclose(wrapped(params, x), model(params, x), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(jax.grad(wrapped)(params, x)),
                  jax.tree.leaves(jax.grad(model)(params, x))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # No row feeding a matmul is a plain slice any more: each is read inside `_row_dot`.
  rows = [e for e in jax.make_jaxpr(wrapped)(params, x).jaxpr.eqns
          if e.primitive.name == "slice" and e.outvars[0].aval.ndim == 3]
  assert not rows, rows


def test_pytree_stage2_bound_at_the_benchmark_size():
  """Pattern g at the benchmark's size (25.2M parameters, 1024 rows): XLA:CPU issued all 24
  row copies of ``w[i]`` at the start of the step and kept them for the backward pass, as much
  as the gradient, so stage 2 missed its bound there (149.5 MiB against 129.0) while the small
  test size passed. Rows that feed a matmul are now sliced where used and again in the
  backward pass."""
  size = pt.FULL
  compiled = {s: pt.zero_runner("g", size, s).compiled for s in (1, 2)}
  mem = {s: measure(c) for s, c in compiled.items()}
  g = sum(lp.nbytes for lp in pt.zero_runner("g", size, 0).plan.leaves)
  assert mem[1].temp >= g
  assert mem[2].temp <= mem[1].temp - 0.75 * g * 7 / 8, (mem[1].temp, mem[2].temp, g)
  # The donated stacked weights are updated in place: every read of them precedes their
  # update by data dependency, so XLA copies none of them to keep the old value alive.
  # A copy of an entry parameter (fusions' own parameters are named param_N.M).
  stacked = re.compile(r"= f32\[12,(512,2048|2048,512)\]\S* copy\(%param\.\d+\)")
  assert not stacked.search(compiled[2].as_text())


# -- how the step is called -----------------------------------------------------------------------


class _Dropout(nn.Module):
  @nn.compact
  def __call__(self, x, *, key):
    x = nn.Dense(64)(x)
    return nn.Dropout(0.5, deterministic=False)(x, rng=key)


def test_linen_step_with_a_third_argument_is_not_taken_for_nnx():
  cfg = zerojax.ZeroConfig(stage=3, gather=zerojax.Gather(persistence_threshold=1))
  x = jnp.ones((16, 64))
  model = _Dropout()
  state, plan = zerojax.create_train_state(model, optax.sgd(0.1), jax.random.key(0), x,
                                           config=cfg, key=jax.random.key(1))

  def step(state, batch, rng):
    loss, g = jax.value_and_grad(lambda p: jnp.mean(
        state.apply_fn({"params": p}, batch["x"], key=rng) ** 2))(state.params)
    return state.apply_gradients(grads=g), {"loss": loss}

  zstep = zerojax.zero_step(plan)(step)
  state1, m1 = zstep(state, {"x": x}, jax.random.key(2))
  _, m2 = zstep(state1, {"x": x}, jax.random.key(3))
  assert np.isfinite(float(m1["loss"])) and float(m1["loss"]) != float(m2["loss"])


def test_per_use_setting_through_model_apply_or_refused_at_trace_time():
  model = pt.linen_models(SIZE)["a"]
  x = jnp.ones((SIZE.rows, SIZE.d_model))
  cfg = zerojax.ZeroConfig(stage=3, precision=zerojax.Precision(reduce="bfloat16"))
  state, plan = zerojax.create_train_state(model, optax.adam(1e-3), jax.random.key(0), x,
                                           config=cfg)

  def step(state, batch):  # the model object, not state.apply_fn: routed to the same boxes
    loss, g = jax.value_and_grad(
        lambda p: jnp.mean(model.apply({"params": p}, batch["x"]) ** 2))(state.params)
    return state.apply_gradients(grads=g), {"loss": loss}

  routed = zerojax.zero_step(plan)(step)
  text = routed.lower(state, {"x": x}).as_text()
  assert set(routed.formulation.values()) == {"per use"}
  assert "bf16" in text  # the reductions move reduce_dtype

  def bypass(state, batch):  # no linen apply at all: nothing can gather per use
    loss, g = jax.value_and_grad(
        lambda p: jnp.mean(jax.tree.leaves(p)[0] ** 2))(state.params)
    return state.apply_gradients(grads=g), {"loss": loss}

  with pytest.raises(zerojax.ConfigError, match=r"precision.reduce='bfloat16'.*state\.apply_fn"):
    zerojax.zero_step(plan)(bypass).lower(state, {"x": x})


def test_tied_head_through_variables_with_explicit_gathering():
  """With per-use boxes a model that reads ``self.variables[...]`` gets the array, not the box."""
  model = pt.linen_models(SIZE)["d1"]
  data = pt.batches(SIZE, "d1", 2)
  ref, _ = pt.reference_losses("d1", SIZE, 2)
  cfg = zerojax.ZeroConfig(stage=3, gather="explicit")
  state, plan = zerojax.create_train_state(model, pt.make_tx(), jax.random.key(0),
                                           jnp.asarray(data[0]["x"]), config=cfg)

  def step(state, batch):
    loss, g = jax.value_and_grad(lambda p: pt.loss_of(
        "d1", state.apply_fn({"params": p}, batch["x"]), batch["y"]))(state.params)
    return state.apply_gradients(grads=g), {"loss": loss}

  zstep = zerojax.zero_step(plan)(step)
  losses = []
  for b in data:
    state, m = zstep(state, b)
    losses.append(float(m["loss"]))
  np.testing.assert_allclose(losses, ref, rtol=TOL, atol=TOL)


# -- NNX is first-class: accumulation, clipping, offload, loss scaling --------------------------


def _nnx_setup(stage, **kw):
  """An NNX (model, optimizer) from `create_nnx` and the README's step over it."""
  from flax import nnx
  cfg = zerojax.ZeroConfig.from_flat(dict(stage=stage, **kw))
  model, opt, plan = zerojax.create_nnx(lambda: pt.nnx_model(SIZE, "e", nnx.Rngs(0)),
                                        pt.make_tx(), config=cfg)

  @zerojax.zero_step(plan)
  def step(model, optimizer, batch):
    loss, grads = zerojax.value_and_grad(
        lambda m, b: pt.loss_of("e", m(b["x"]), b["y"]))(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss}

  return model, opt, step, plan


def _nnx_run(stage, steps=2, **kw):
  model, opt, step, plan = _nnx_setup(stage, **kw)
  losses = [float(step(model, opt, b)["loss"]) for b in pt.batches(SIZE, "e", steps)]
  return losses, model, opt, plan


def _nnx_reference(tx, steps=2):
  from flax import nnx
  model = pt.nnx_model(SIZE, "e", nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, b):
    loss, g = nnx.value_and_grad(lambda m: pt.loss_of("e", m(b["x"]), b["y"]))(model)
    opt.update(model, g)
    return loss
  return [float(step(model, opt, b)) for b in pt.batches(SIZE, "e", steps)], model


@pytest.mark.parametrize("stage", [1, 3])
def test_nnx_accumulation_and_clipping_match_one_device(stage):
  from flax import nnx
  losses, model, _, _ = _nnx_run(stage, gradient_accumulation_steps=2, gradient_clipping=0.05)
  ref, ref_model = _nnx_reference(optax.chain(optax.clip_by_global_norm(0.05), pt.make_tx()))
  np.testing.assert_allclose(losses, ref, rtol=TOL, atol=TOL)
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(ref_model, nnx.Param))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("what", ["offload_optimizer", "offload_params"])
def test_nnx_offload_rests_on_host_and_matches(what):
  from flax import nnx
  losses, model, opt, _ = _nnx_run(3, **{what: True})
  ref, _ = _nnx_reference(pt.make_tx())
  np.testing.assert_allclose(losses, ref, rtol=TOL, atol=TOL)
  rest = nnx.state(opt, nnx.OptState) if what == "offload_optimizer" else nnx.state(model,
                                                                                     nnx.Param)
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(rest) if np.ndim(x) > 0}
  assert kinds == {"pinned_host"}


@pytest.mark.parametrize("stage", [1, 3])
def test_nnx_dynamic_loss_scaling_skips_overflow_and_matches(stage):
  from flax import nnx
  losses, model, opt, _ = _nnx_run(stage, loss_scale=0, initial_scale_power=4)
  ref, ref_model = _nnx_reference(pt.make_tx())
  np.testing.assert_allclose(losses, ref, rtol=TOL, atol=TOL)  # scaled and unscaled exactly
  assert float(opt.loss_scaling.scale[...]) == 2.0 ** 4
  # An overflowing step (inf in the batch) is skipped: params and optimizer state unchanged.
  model, opt, step, _ = _nnx_setup(stage, loss_scale=0, initial_scale_power=4, hysteresis=1)

  # (nnx.Optimizer.step counts every call, as DeepSpeed's global step and ZeroTrainState.step)
  snapshot = lambda: [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))
                      + jax.tree.leaves(opt.opt_state)]
  before = snapshot()
  bad = dict(pt.batches(SIZE, "e", 1)[0])
  bad["x"] = np.full_like(bad["x"], np.inf)
  m = step(model, opt, bad)
  assert bool(m["overflow"]) and int(m["skipped_steps"]) == 1
  assert float(m["loss_scale"]) == 2.0 ** 3  # halved (hysteresis 1)
  after = snapshot()
  assert len(before) == len(after) > 0
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, b)


def test_nnx_loss_scaling_needs_create_nnx():
  from flax import nnx
  cfg = zerojax.ZeroConfig(stage=3, loss_scale=0)
  _, _, plan = zerojax.create_nnx(lambda: pt.nnx_model(SIZE, "e", nnx.Rngs(0)), pt.make_tx(),
                                  config=cfg)
  model = pt.nnx_model(SIZE, "e", nnx.Rngs(0))
  opt = nnx.Optimizer(model, pt.make_tx(), wrt=nnx.Param)
  step = zerojax.zero_step(plan)(lambda m, o, b: {})
  with pytest.raises(zerojax.ConfigError, match="create_nnx"):
    step(model, opt, pt.batches(SIZE, "e", 1)[0])


@pytest.mark.parametrize("setting, named", [
    (dict(offload_params=True), "offload.params=True"),
    (dict(quantize_weights="int8"), "quantize.weights='int8'")])
def test_pytree_model_under_a_setting_it_cannot_use_fails_in_one_line(setting, named):
  # Host-resident parameters met the model's device arrays inside JAX ("memory_space of all
  # inputs passed to `mul` must be the same"); now the setting is named before that.
  with pytest.raises(zerojax.ConfigError, match=r"^" + re.escape(named) + r" .*a plain pytree "
                     r"model cannot use it") as e:
    pt.zero_runner("g", pt.SMALL, 3, **setting)
  assert "\n" not in str(e.value)
