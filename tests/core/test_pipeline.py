"""Scanned layers one ahead (`zerojax.core.pipeline`): the row-parallel check it rests on, the
same training as one device on 8 CPU devices, when it steps aside, and the schedule XLA:GPU
compiles for it."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import zerojax
from tests.model_patterns import (FULL, SMALL, batches, max_diff, reference_losses, target_zero,
                                  zero_runner)
from zerojax.core import formulation
from zerojax.core.batchwise import NotRowwise, row_axes
from zerojax.core.pipeline import LAYERS_SCOPE
from zerojax import _compat
from zerojax.runtime import memory

try:
  from tests.aot.test_gpu_aot import needs_gpu_compiler
except ImportError:  # pragma: no cover
  needs_gpu_compiler = pytest.mark.skip(reason="no GPU compiler")

S = jax.ShapeDtypeStruct
X = S((4, 8, 16), jnp.float32)  # rows, tokens, features
W = {"q": S((16, 2, 8), jnp.float32)}


# -- which layers compute each row on their own ----------------------------------------------


def _block(x, w):
  """Attention, an RMS norm, rotary-style positions, a reshape of tokens and a broadcast."""
  q = jnp.einsum("btd,dhk->bthk", x, w["q"])
  p = jax.nn.softmax(jnp.einsum("bthk,bshk->bhts", q, q), axis=-1)
  o = jnp.einsum("bhts,bshk->bthk", p, q).reshape(x.shape[0], x.shape[1], -1)
  n = x * jax.lax.rsqrt(jnp.mean(x ** 2, -1, keepdims=True) + 1e-6)
  pos = jnp.sin(jnp.arange(x.shape[1], dtype=jnp.float32))[None, :, None]
  flat = (o + n).reshape(-1, x.shape[-1]) @ w["q"].reshape(16, 16)
  return o + n + pos + jnp.zeros_like(x) + flat.reshape(x.shape), jnp.sum(w["q"])


def test_row_axes_of_a_transformer_block():
  axes, jaxpr = row_axes(_block, (X, W), (True, False))
  assert axes == [0, None]  # the activation keeps its rows; the weight sum is the same anywhere
  assert jaxpr.jaxpr.eqns


@needs_gpu_compiler  # tracing cuDNN's attention needs the CUDA plugin's cuDNN
def test_row_axes_of_cudnn_attention():
  """cuDNN's fused attention (the 8B and 70B benchmarks' kernel) keeps each row's own."""
  q = S((4, 128, 2, 64), jnp.bfloat16)
  attend = lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True,
                                                  implementation="cudnn")
  axes, _ = row_axes(attend, (q,), (True,))
  assert axes == [0]


@pytest.mark.parametrize("fn, where", [
    (lambda x, w: jnp.mean(x, 0), "reduce_sum reduces over the batch rows"),
    (lambda x, w: x - jnp.mean(x), "reduce_sum reduces over the batch rows"),
    (lambda x, w: jnp.einsum("btd,bte->de", x, x), "dot_general contracts the batch rows"),
    (lambda x, w: x * jax.random.uniform(jax.random.key(0), x.shape), "random_bits"),
    (lambda x, w: x * jnp.arange(x.shape[0])[:, None, None], "iota"),
    (lambda x, w: x.reshape(4, -1), "reshape"),
    (lambda x, w: jnp.cumsum(x, 0), "cumsum accumulates along the batch rows"),
    (lambda x, w: x[1:], "slice of the batch rows"),
    (lambda x, w: jnp.roll(x, 1, 0), "slice of the batch rows"),
    (lambda x, w: x / x.shape[0], "a number that depends on the batch size"),
    (lambda x, w: jax.lax.with_sharding_constraint(x, jax.sharding.SingleDeviceSharding(
        jax.devices()[0])), "sharding_constraint reads batch rows"),
])
def test_row_axes_rejects_what_mixes_rows(fn, where):
  with pytest.raises(NotRowwise, match=where):
    row_axes(fn, (X, W), (True, False))


# -- the same training as one device -----------------------------------------------------------


def _trained(pattern, size, steps=3, **kw):
  r = zero_runner(pattern, size, 3, **kw)
  return [r.step(b) for b in batches(size, pattern, steps)], r


PER_USE_ONE_AHEAD = dict(gather="explicit", max_live_layers=2)


@pytest.mark.parametrize("pattern, layers, kw", [
    ("a", 4, {}),  # nn.scan(nn.remat(Block)): layers before and after the backward loop
    pytest.param("a", 8, {}, marks=pytest.mark.slow),  # deeper: the full suite only
    ("b", 2, {"param_persistence_threshold": 0}),  # nn.scan(Block): biases sharded too
    ("a", 3, {"mesh_axes": ("replica", "fsdp"), "mesh_shape": (2, 4)}),  # HSDP
    ("a", 4, {"gradient_accumulation_steps": 2}),  # inside the micro-batch scan
])
def test_one_ahead_trains_as_one_device(pattern, layers, kw):
  size = dataclasses.replace(SMALL, layers=layers)
  ref, ref_params = reference_losses(pattern, size, 3)
  losses, r = _trained(pattern, size, **PER_USE_ONE_AHEAD, **kw)
  assert max(abs(a - b) for a, b in zip(losses, ref)) < 2e-6, (losses, ref)
  assert max_diff(r.params(), ref_params) < 3e-6
  assert "one ahead" in r.layers, r.layers


def test_one_ahead_in_bf16_matches_gathering_per_layer():
  """bf16 compute, gradients reduced in float32: one SGD step one ahead moves every parameter
  as the step gathering each layer in its own iteration does (max_live_layers=1), to within
  the rounding of bf16 partial gradients (a bf16 step is 1/128 of the value)."""
  import numpy as np
  import optax
  from tests.model_patterns import linen_models, loss_of
  model, b = linen_models(SMALL)["a"], batches(SMALL, "a", 1)[0]
  moved, said, losses = {}, {}, {}
  for live in (1, 2):
    config = zerojax.ZeroConfig(stage=3,
                                precision=zerojax.Precision(compute="bfloat16", reduce="float32"),
                                gather=zerojax.Gather(max_live_layers=live))
    state, plan = zerojax.create_train_state(model, optax.sgd(1.0), jax.random.key(0),
                                             jnp.asarray(b["x"]), config=config)
    before = jax.device_get(state.params)

    @zerojax.zero_step(plan)
    def step(state, batch):
      loss, g = zerojax.value_and_grad(lambda p, bt: loss_of(
          "a", state.apply_fn({"params": p}, bt["x"]), bt["y"]))(state.params, batch)
      return state.apply_gradients(grads=g), {"loss": loss}

    after, m = step(state, b)
    moved[live] = jax.tree.map(lambda x, y: np.asarray(x) - np.asarray(y), before,
                               jax.device_get(after.params))
    said[live], losses[live] = next(iter(step.layers.values()), None), float(m["loss"])
  assert "one ahead" in said[2] and said[1] is None, said
  assert losses[1] == losses[2]
  for a, c in zip(jax.tree.leaves(moved[1]), jax.tree.leaves(moved[2])):
    assert np.abs(a - c).max() <= np.abs(a).max() / 64


def test_one_ahead_trains_an_nnx_stack(monkeypatch):
  """NNX's nnx.scan over nnx.remat blocks, gathered per use (the default on GPU, forced on
  CPU here)."""
  monkeypatch.setattr(formulation, "_per_use_by_default", lambda *a: True)
  ref, ref_params = reference_losses("f", SMALL, 3)
  losses, r = _trained("f", SMALL, max_live_layers=2)
  assert "one ahead" in r.layers, r.layers
  assert max(abs(a - b) for a, b in zip(losses, ref)) < 2e-6
  assert max_diff(r.params(), ref_params) < 3e-6


def test_a_layer_that_mixes_rows_runs_as_written_and_says_why():
  """A scanned layer that normalises over the batch (each device would see only its rows)
  keeps the per-layer gathers, says why, and still trains as one device."""
  import flax.linen as nn
  import optax

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      h = nn.Dense(64)(x)
      return x + nn.Dense(32)(h - h.mean(0)), None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.scan(nn.remat(Block), variable_axes={"params": 0},
                     split_rngs={"params": True}, length=3)()(x, None)[0]

  config = zerojax.ZeroConfig.from_flat(dict(stage=3, **PER_USE_ONE_AHEAD))
  x = jax.random.normal(jax.random.key(1), (16, 32))
  state, plan = zerojax.create_train_state(Net(), optax.sgd(0.1), jax.random.key(0), x,
                                           config=config)

  @zerojax.zero_step(plan)
  def step(state, x):
    loss, g = jax.value_and_grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(
        state.params)
    return state.apply_gradients(grads=g), {"loss": loss}

  params0 = jax.device_get(state.params)
  _, m = step(state, x)
  said = next(iter(step.layers.values()))
  assert "not one ahead" in said and "reduce_sum reduces over the batch rows" in said, said
  want = jnp.mean(Net().apply({"params": params0}, x) ** 2)
  assert abs(float(m["loss"]) - float(want)) < 1e-6


def test_a_layer_that_saves_residuals_keeps_its_policy():
  """remat='auto' leaves a layer's own saving policy (here: matmul outputs) in force, which
  running it one ahead (re-run whole) would not."""
  import flax.linen as nn
  import optax

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return x + nn.Dense(32)(nn.Dense(64)(x)), None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      block = nn.remat(Block, policy=jax.checkpoint_policies.dots_saveable)
      return nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=3)()(x, None)[0]

  x = jnp.ones((16, 32))
  for remat, ahead in (("auto", False), ("full", True)):
    config = zerojax.ZeroConfig.from_flat(dict(stage=3, remat=remat, **PER_USE_ONE_AHEAD))
    state, plan = zerojax.create_train_state(Net(), optax.sgd(0.1), jax.random.key(0), x,
                                             config=config)
    grad = lambda s, x: jax.grad(lambda p: jnp.mean(s.apply_fn({"params": p}, x)))(s.params)
    step = zerojax.zero_step(plan)(lambda s, x: (s, {"g": jax.tree.leaves(grad(s, x))[0]}))
    step.lower(state, x)
    said = next(iter(step.layers.values()))
    assert ("one ahead" in said and "not one ahead" not in said) == ahead, said
    if not ahead:
      assert "jax.checkpoint_policies.dots_saveable" in said, said


# -- the setting --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_max_live_layers_names_what_it_allows(bad):
  with pytest.raises(zerojax.ConfigError, match=r"max_live_layers.*integer >= 1, or null"):
    zerojax.ZeroConfig(stage=3, gather=zerojax.Gather(max_live_layers=bad))


def _plan(devices, **kw):
  config = zerojax.ZeroConfig.from_flat(dict(stage=3, **kw))
  return zerojax.ShardingPlan.create(config, zerojax.make_mesh(config, devices=list(devices)),
                                     {"w": jax.ShapeDtypeStruct((4, 64, 64), "float32")})


def test_max_live_layers_default_follows_the_compiler(h100, v5e):
  """None: one ahead on XLA:GPU; one layer on XLA:CPU (nothing runs beside a collective) and
  on XLA:TPU (ICI all-gather pipelining, and its flat gathers became all-reduces)."""
  cases = [(jax.devices(), {}, 1, False), (jax.devices(), {"max_live_layers": 2}, 2, True),
           (h100, {}, 2, True), (h100, {"max_live_layers": 1}, 1, False),
           (h100, {"remat": "dots"}, 2, False), (h100, {"quantize_weights": "int8"}, 2, False),
           (h100, {"mesh_axes": ("fsdp", "tensor"), "mesh_shape": (4, 2)}, 2, False)]
  if v5e is not None:
    cases += [(v5e, {}, 1, False), (v5e, {"max_live_layers": 2}, 2, False)]
  for devices, kw, live, ahead in cases:
    plan = _plan(devices, **kw)
    assert (plan.live_layers, plan.pipeline is not None) == (live, ahead), (kw, plan.backend.name)


# -- XLA:GPU ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def h100():
  from zerojax.runtime import gpu
  try:
    return list(gpu.gpu_topology("h100:8").devices)
  except ImportError as e:
    pytest.skip(str(e))


@pytest.fixture(scope="module")
def v5e():
  try:
    return list(memory.tpu_topology("v5e:2x4").devices)
  except Exception:  # no libtpu: the TPU cases are left out
    return None


@needs_gpu_compiler
def test_the_forward_loop_carries_its_gathered_layer_without_a_copy(h100):
  """The forward loop (the one that gathers and reduces nothing) runs two layers an iteration:
  no gathered layer is copied into the loop state, as a loop of one layer an iteration must
  (there, two copies of a layer's weights per layer)."""
  import re
  compiled, plan, _ = target_zero("a", FULL, 3, h100)
  assert plan.pipeline is not None
  comps, runs = memory._parse_hlo(compiled.as_text())
  loops = [name for name, lines in comps.items()
           if runs.get(name, 0) > 1 and any(" all-gather-start(" in l for l in lines)
           and not any("reduce-scatter" in l for l in lines)]
  assert len(loops) == 1, loops
  assert runs[loops[0]] == FULL.layers // 2  # two layers an iteration
  body = "\n".join(comps[loops[0]])
  gathered = set(re.findall(r"f32\[\d+,\d+\]", "".join(
      re.findall(r"= \((.*?)\) all-gather-done\(", body))))
  assert {"f32[512,2048]", "f32[2048,512]"} <= gathered, gathered
  copied = re.findall(r"= (\S+?)(?:\{[\d,]*\})? copy\(", body)
  assert not gathered & set(copied), copied
  assert len(re.findall(r" all-gather-start\(", body)) == 2  # one gather per layer


@needs_gpu_compiler
@pytest.mark.parametrize("pattern", ["a", "f"])
def test_gpu_default_overlaps_scanned_layers_at_textbook_volume(h100, pattern):
  """The default stage 3 (only ``stage`` set) on the conformance patterns' scanned layers
  (12 layers): at least 90% of the layers' all-gather and reduce-scatter bytes with a matmul
  between start and done, weights and gradients only, within 1.1x the textbook volume. With
  max_live_layers=1 each layer gathers in its own iteration, and under half the bytes have a
  matmul beside them."""
  compiled, plan, _ = target_zero(pattern, FULL, 3, h100)
  assert plan.pipeline is not None and plan.live_layers == 2
  text = compiled.as_text()
  gathers, scatters = [memory.collective_schedule(text, k, LAYERS_SCOPE)
                       for k in ("all-gather", "reduce-scatter")]
  assert gathers.matmul_share >= 0.9, gathers.matmul_share
  if _compat.xla_gpu_options({"xla_gpu_enable_analytical_latency_estimator": True}):
    assert scatters.matmul_share >= 0.9, scatters.matmul_share
  else:
    # Without the analytical latency estimator (it aborts XLA:GPU from jaxlib 0.11 on), the
    # scheduler closes each layer's reduce-scatter before the matmuls (BENCHMARKS.md, "JAX
    # releases"); it stays asynchronous, with other computation beside it.
    assert scatters.total > 0 and memory.collective_schedule(
        text, "reduce-scatter").overlapped_share == 1.0
  assert memory.collective_schedule(text, "all-gather").matmul_share >= 0.9
  assert memory.activation_collectives(text, plan) == {}
  total = memory.measure(compiled).collective_total
  assert total <= 1.1 * memory.textbook_bytes(plan), total / memory.textbook_bytes(plan)

  own, plan1, _ = target_zero(pattern, FULL, 3, h100, max_live_layers=1)
  assert plan1.pipeline is None
  assert memory.collective_schedule(own.as_text(), "all-gather", LAYERS_SCOPE).total == 0
  assert memory.collective_schedule(own.as_text(), "all-gather").matmul_share < 0.5


def test_one_ahead_differentiates_what_the_layers_close_over():
  """A value computed outside the scan and handed to every layer (``nn.broadcast``: a
  parameter of the outer model) reaches each layer per device; its gradient sums every
  layer's and every device's share."""
  import flax.linen as nn
  import numpy as np
  import optax

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, scale):
      return x + nn.Dense(32)(nn.gelu(nn.Dense(64)(x * scale))), None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      scale = self.param("scale", nn.initializers.ones, (32,))
      scan = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=nn.broadcast, length=3)
      return scan()(x, scale)[0]

  x = jax.random.normal(jax.random.key(1), (16, 32))
  moved, said = {}, {}
  for live in (1, 2):
    config = zerojax.ZeroConfig(stage=3, gather=zerojax.Gather(
        "explicit", max_live_layers=live, persistence_threshold=0))
    state, plan = zerojax.create_train_state(Net(), optax.sgd(0.5), jax.random.key(0), x,
                                             config=config)
    before = jax.device_get(state.params)

    @zerojax.zero_step(plan)
    def step(state, x):
      g = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(state.params)
      return state.apply_gradients(grads=g), {}

    after, _ = step(state, x)
    moved[live] = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), before,
                               jax.device_get(after.params))
    said[live] = next(iter(step.layers.values()), None)
  assert "one ahead" in said[2] and said[1] is None, said
  assert np.abs(moved[2]["scale"]).max() > 0
  for a, b in zip(jax.tree.leaves(moved[1]), jax.tree.leaves(moved[2])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_layers_own_checkpoint_runs_inline_unless_it_holds_its_own_vjp():
  # The one-ahead backward pass re-runs each layer whole: a checkpoint of the layer's own runs
  # as plain code inside it, except around a function with its own VJP (a fused attention
  # kernel), whose residuals the checkpoint held for less (the 8B row of BENCHMARKS.md).
  from zerojax.core import pipeline

  @jax.custom_vjp
  def fused(x):
    return jnp.sin(x)
  fused.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))

  def remat_eqn(body):
    eqns = jax.make_jaxpr(jax.checkpoint(body))(jnp.ones(3)).jaxpr.eqns
    assert eqns[0].primitive.name in _compat.REMAT_PRIMITIVE_NAMES
    return eqns[0]

  plain = remat_eqn(lambda x: jnp.tanh(x) * 2)
  x = jnp.arange(3.0)
  out = pipeline._inline_remat(plain, [x])
  assert out is not None and jnp.allclose(out[0], jnp.tanh(x) * 2)
  names = [e.primitive.name for e in jax.make_jaxpr(
      lambda x: pipeline._inline_remat(plain, [x]))(x).jaxpr.eqns]
  assert not set(names) & _compat.REMAT_PRIMITIVE_NAMES, names  # no checkpoint left
  assert pipeline._inline_remat(remat_eqn(lambda x: fused(x) * 2), [x]) is None
  other = jax.make_jaxpr(jnp.sin)(x).jaxpr.eqns[0]
  assert pipeline._inline_remat(other, [x]) is None


def test_one_ahead_waits_for_the_gradients_made_after_the_layers(monkeypatch):
  """A language model's layers run one ahead only once the gradients of what runs after them
  (its final norm and head) are made, so the logits' cotangent is freed before the layers'
  backward pass; the training is the same as gathering each layer in its own iteration."""
  import optax
  from zerojax.core.context import MadeGrads
  from zerojax.models import GPT, GPTConfig
  cfg = GPTConfig(vocab_size=512, seq_len=16, num_layers=3, num_heads=2, d_model=32)
  rng = jax.random.key(1)
  tokens = jax.random.randint(rng, (8, cfg.seq_len + 1), 0, cfg.vocab_size)
  waited: list = []
  take = MadeGrads.take

  def recorded(self):
    out = take(self)
    waited.append([g.shape for g in out])
    return out

  monkeypatch.setattr(MadeGrads, "take", recorded)
  losses, said = {}, {}
  for live in (1, 2):
    config = zerojax.ZeroConfig(stage=3, gather=zerojax.Gather(
        mode="explicit", max_live_layers=live, persistence_threshold=0))
    state, plan = zerojax.create_train_state(GPT(cfg), optax.adam(1e-2), jax.random.key(0),
                                             tokens[:, :-1], config=config)

    step = zerojax.zero_step(plan)(memory.lm_train_step)
    losses[live] = []
    for _ in range(3):
      state, m = step(state, {"x": tokens[:, :-1], "y": tokens[:, 1:]})
      losses[live].append(float(m["loss"]))
    said[live] = next(iter(step.layers.values()), None)
  assert "one ahead" in said[2] and said[1] is None, said
  assert max(abs(a - b) for a, b in zip(losses[1], losses[2])) < 2e-6, losses
  # The one scan waited for the head's kernel and bias and the final norm's scale and bias.
  assert sorted(waited[-1]) == sorted([(cfg.d_model, cfg.vocab_size), (cfg.vocab_size,),
                                       (cfg.d_model,), (cfg.d_model,)]), waited
