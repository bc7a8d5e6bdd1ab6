"""``compute_dtype`` acts on the user's own model: linen, NNX and plain pytrees that set no dtype.

XLA:CPU computes bf16 matmuls in f32 after compiling, so on CPU the program zerojax hands XLA
(the lowered step) is what is checked; tests/aot/test_gpu_aot.py checks XLA:GPU's compiled dots
and all-gathers.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from flax import nnx

import zerojax

DOT = re.compile(r"stablehlo\.dot_general .*?: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)")


class MLP(nn.Module):  # no dtype anywhere, as models are usually written
  @nn.compact
  def __call__(self, x):
    return nn.Dense(16)(nn.relu(nn.Dense(64)(x)))


def _dots(text):
  return DOT.findall(text)


@pytest.mark.parametrize("stage", [1, 3])
def test_linen_model_computes_in_bf16(stage):
  cfg = zerojax.ZeroConfig(stage=stage, precision=zerojax.Precision(compute="bfloat16"),
                           gather=zerojax.Gather(persistence_threshold=0))
  x = jnp.ones((16, 32))
  state, plan = zerojax.create_train_state(MLP(), optax.adam(1e-3), jax.random.key(0), x,
                                           config=cfg)
  out_dtype = []

  @zerojax.zero_step(plan)
  def step(state, batch):
    def lf(p):
      out = state.apply_fn({"params": p}, batch)
      out_dtype.append(out.dtype)
      return jnp.mean(out.astype(jnp.float32) ** 2)
    g = jax.grad(lf)(state.params)
    return state.apply_gradients(grads=g), {}

  dots = _dots(step.lower(state, x).as_text())
  assert dots and set(dots) == {("bf16", "bf16")}, dots
  assert out_dtype[0] == jnp.bfloat16
  new, _ = step(state, x)
  # master weights stay float32
  assert {p.dtype for p in jax.tree.leaves(new.params)} == {jnp.dtype(jnp.float32)}


def test_pytree_model_computes_in_bf16():
  from flax import struct
  from flax.training import train_state

  def apply_fn(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]

  params = {"w1": jnp.ones((32, 64)) * 0.1, "w2": jnp.ones((64, 8)) * 0.1}
  cfg = zerojax.ZeroConfig(stage=3, precision=zerojax.Precision(compute="bfloat16"),
                           gather=zerojax.Gather(persistence_threshold=0))
  mesh = zerojax.make_mesh(cfg)
  tx = optax.sgd(0.1)
  plan = zerojax.ShardingPlan.create(cfg, mesh, params, tx)

  class State(train_state.TrainState):
    apply_fn: callable = struct.field(pytree_node=False)

  state = jax.device_put(State.create(apply_fn=apply_fn, params=params, tx=tx),
                         plan.state(State.create(apply_fn=apply_fn, params=params, tx=tx)))

  @zerojax.zero_step(plan)
  def step(state, x):
    g = jax.grad(lambda p: jnp.mean(state.apply_fn(p, x).astype(jnp.float32) ** 2))(state.params)
    return state.apply_gradients(grads=g), {}

  x = jnp.ones((16, 32))
  dots = _dots(step.lower(state, x).as_text())
  assert dots and set(dots) == {("bf16", "bf16")}, dots


def test_nnx_model_computes_in_bf16():
  cfg = zerojax.ZeroConfig(stage=3, precision=zerojax.Precision(compute="bfloat16"),
                           gather=zerojax.Gather(persistence_threshold=0))

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(32, 64, rngs=rngs)  # dtype left None
      self.b = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
      return self.b(nnx.relu(self.a(x)))

  model, opt, plan = zerojax.create_nnx(lambda: Net(nnx.Rngs(0)), optax.adam(1e-3), config=cfg)

  @zerojax.zero_step(plan)
  def step(model, opt, x):
    loss, g = nnx.value_and_grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
    opt.update(model, g)
    return {"loss": loss}

  x = jnp.ones((16, 32))
  dots = _dots(step.lower(model, opt, x).as_text())
  assert dots and set(dots) == {("bf16", "bf16")}, dots
  step(model, opt, x)
  assert model.a.dtype is None  # the user's module is unchanged
  assert model.a.kernel[...].dtype == jnp.float32


def test_a_model_that_keeps_float32_everywhere_is_refused():
  class F32(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, dtype=jnp.float32)(x)  # the model insists on float32

  cfg = zerojax.ZeroConfig(stage=2, precision=zerojax.Precision(compute="bfloat16"))
  x = jnp.ones((16, 32))
  state, plan = zerojax.create_train_state(F32(), optax.sgd(0.1), jax.random.key(0), x,
                                           config=cfg)

  @zerojax.zero_step(plan)
  def step(state, batch):
    g = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, batch) ** 2))(state.params)
    return state.apply_gradients(grads=g), {}

  with pytest.raises(zerojax.ConfigError, match=r"precision.compute='bfloat16': 2 of the step's 2 matrix"):
    step(state, x)


def test_zeropp_backward_regather_in_the_compute_dtype():
  """qwZ's full-precision backward re-gather (``quantize_weights_backward=False``) moves the
  compute dtype, as the forward computed: a scanned model that sets no dtype trains (it failed
  with a float32/bfloat16 cotangent mismatch when the re-gather kept the master weights'
  float32)."""

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return x + nn.Dense(32)(nn.relu(nn.Dense(64)(x))), None

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(32)(x)
      x, _ = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                     split_rngs={"params": True}, length=2)()(x, None)
      return x

  cfg = zerojax.ZeroConfig(stage=3, precision=zerojax.Precision(compute="bfloat16"),
                           gather=zerojax.Gather(persistence_threshold=0),
                           quantize=zerojax.Quantize(weights="int8", weights_backward=False))
  x = jnp.ones((16, 32))
  state, plan = zerojax.create_train_state(Scanned(), optax.adam(1e-3), jax.random.key(0), x,
                                           config=cfg)

  @zerojax.zero_step(plan)
  def step(state, batch):
    g = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, batch).astype(jnp.float32)
                                    ** 2))(state.params)
    return state.apply_gradients(grads=g), {}

  new, _ = step(state, x)
  assert all(jnp.isfinite(p).all() for p in jax.tree.leaves(new.params))


def test_nnx_embed_left_unset_looks_up_in_bf16():
  # nnx.Embed stores an unset dtype as its table's (float32), which started the residual
  # stream in float32 whatever compute_dtype said.
  cfg = zerojax.ZeroConfig(stage=2, precision=zerojax.Precision(compute="bfloat16"))

  class LM(nnx.Module):
    def __init__(self, rngs):
      self.wte = nnx.Embed(64, 32, rngs=rngs)  # dtype left unset
      self.wpe = nnx.Embed(8, 32, dtype=jnp.float16, rngs=rngs)  # the user's own choice
      self.out = nnx.Linear(32, 64, rngs=rngs)

    def __call__(self, t):
      return self.out(self.wte(t) + self.wpe(jnp.arange(t.shape[1])).astype(jnp.bfloat16))

  model, opt, plan = zerojax.create_nnx(lambda: LM(nnx.Rngs(0)), optax.adam(1e-3), config=cfg)

  @zerojax.zero_step(plan)
  def step(model, opt, t):
    loss, g = zerojax.value_and_grad(lambda m, t: jnp.mean(m(t).astype(jnp.float32) ** 2))(
        model, t)
    opt.update(model, g)
    return {"loss": loss}

  t = jnp.zeros((16, 8), jnp.int32)
  tables = re.findall(r'"stablehlo.gather"\(.*?: \(tensor<(\d+)x32x(\w+)>', step.lower(
      model, opt, t).as_text())
  assert sorted(tables) == [("64", "bf16"), ("8", "f16")], tables
  step(model, opt, t)
  assert model.wte.dtype == jnp.float32  # the user's module is unchanged


def test_with_compute_dtype_sets_unset_layers_on_a_copy():
  from zerojax.core.dtypes import with_compute_dtype

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.wte = nnx.Embed(64, 32, rngs=rngs)  # dtype stored as the table's (float32)
      self.a = nnx.Linear(32, 32, rngs=rngs)  # dtype None
      self.b = nnx.Linear(32, 8, dtype=jnp.float16, rngs=rngs)  # the user's own choice

  net = Net(nnx.Rngs(0))
  run = with_compute_dtype(net, jnp.bfloat16)
  assert (run.wte.dtype, run.a.dtype, run.b.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float16)
  assert (net.wte.dtype, net.a.dtype, net.b.dtype) == (jnp.float32, None, jnp.float16)
  assert run.a.kernel[...] is net.a.kernel[...]  # the same arrays, not copies
  assert with_compute_dtype(net, None) is net
