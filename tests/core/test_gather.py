"""`zerojax.core.gather`: ordering data dependencies and the stage-3 per-layer custom VJP."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import _compat
from zerojax.core import backend, gather


def test_after_is_exact_identity():
  w = jnp.asarray([1.5, -2.0, 3e-38, 0.0], jnp.float32)
  for token in (jnp.float32(7.0), jnp.float32(-1e30), jnp.ones((2, 3)), None):
    np.testing.assert_array_equal(np.asarray(gather.after(w, token)), np.asarray(w))


def test_after_an_array_orders_by_a_barrier_in_the_forward_pass_only():
  # An array token (XLA:GPU, XLA:TPU) costs no computation: a barrier over (w, token), and
  # the gradient passes through unbarriered.
  w, x = jnp.arange(4.0), jnp.ones((2, 3))
  fwd = str(jax.make_jaxpr(gather.after)(w, x))
  assert "optimization_barrier" in fwd and "reduce_sum" not in fwd
  grad = jax.grad(lambda w: jnp.sum(gather.after(w, x) ** 2))
  np.testing.assert_array_equal(np.asarray(grad(w)), np.asarray(2 * w))
  assert "optimization_barrier" not in str(jax.make_jaxpr(jax.vjp(gather.after, w, x)[1])(w))


def test_the_plan_waits_by_a_barrier_except_on_cpu():
  # XLA:CPU removes barriers before it schedules; XLA:GPU and XLA:TPU keep them.
  state, plan = zerojax.create_train_state(Net(), optax.sgd(0.1), jax.random.key(0),
                                       jnp.ones((16, 64)), config=zerojax.ZeroConfig(stage=3))
  assert plan.backend is backend.CPU and plan.backend.waits_by_barrier is False
  for platform, barrier in (("gpu", True), ("tpu", True), ("cpu", False)):
    on = backend.for_platform(platform)
    assert on.waits_by_barrier is barrier
    # ... and so the whole-model checkpoint needs no CSE barrier of its own there.
    assert on.model_checkpoint_prevents_cse is not barrier
    # A block's first gathers in a loop of nn.remat blocks wait for nothing on XLA:GPU only
    # (XLA:TPU held more temp with them, for no more overlap).
    assert on.prefetches_across_checkpoints is (platform == "gpu")
  for on, barrier in ((plan, False), (dataclasses.replace(plan, backend=backend.GPU), True)):
    boxed = gather.box_params(state.params, on)
    assert {b.barrier for b in jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(
        x, gather.ZeroParam))} == {barrier}


def test_token_is_the_array_with_a_barrier_else_a_finite_scalar():
  x = jnp.asarray([jnp.inf, 1.0])
  t = gather.token_of({"x": x}, barrier=False)
  assert t.shape == () and np.isfinite(np.asarray(t))
  t = gather.token_of({"ids": jnp.asarray([1]), "x": x}, barrier=True)
  np.testing.assert_array_equal(np.asarray(t), np.asarray(x))
  for barrier in (False, True):  # integers only: no token
    assert gather.token_of({"ids": jnp.asarray([1, 2])}, barrier) is None


class NoisyDense(nn.Module):
  """A leaf layer that owns parameters and draws random numbers (dropout on its kernel)."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    k = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 64))
    k = nn.Dropout(0.5, deterministic=not train)(k)
    return x @ k


class Net(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(64, name="inp")(x)
    x = NoisyDense(name="noisy")(jnp.tanh(x), train)
    return nn.LayerNorm(name="ln")(x)[..., :8]


def _losses(stage, steps=3):
  tx = optax.sgd(0.1)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 64)), jnp.float32)
  state, plan = zerojax.create_train_state(Net(), tx, jax.random.key(0), x,
                                           config=zerojax.ZeroConfig(stage=stage))

  @zerojax.zero_step(plan)
  def step(state, batch):
    def lf(params):
      key = jax.random.fold_in(jax.random.key(0), state.step)
      out = state.apply_fn({"params": params}, batch["x"], rngs={"dropout": key})
      return jnp.mean((out - 1.0) ** 2)
    loss, grads = jax.value_and_grad(lf)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  out = []
  for _ in range(steps):
    state, m = step(state, {"x": x})
    out.append(float(m["loss"]))
  return out


def test_stage3_layers_with_rngs_and_plain_layers_match_stage0():
  # `inp` and `ln` run as per-layer custom VJPs; `noisy` draws random numbers and runs as is.
  np.testing.assert_allclose(_losses(3), _losses(0), rtol=1e-5)


def test_scan_remat_does_not_reach_other_threads():
  """zerojax's scan hook acts only in the thread (and context) tracing a step: a scan traced
  by another thread at the same moment gets JAX's own scan, untouched."""
  import threading
  from zerojax._compat import REMAT_PRIMITIVE_NAMES, jaxpr_has_primitive
  from zerojax.core.remat import ScanRemat, scanned_layers

  def traced_scan():
    body = lambda c, x: (c + jnp.sin(x), None)
    return jax.make_jaxpr(lambda xs: jax.lax.scan(body, 0.0, xs))(jnp.ones(4))

  inside, done, seen = threading.Event(), threading.Event(), {}

  def step_thread():
    with scanned_layers(ScanRemat(jax.checkpoint_policies.nothing_saveable, False)):
      seen["step"] = jaxpr_has_primitive(traced_scan(), REMAT_PRIMITIVE_NAMES)
      inside.set()
      done.wait(30)  # still inside the step's trace while the other thread traces

  t = threading.Thread(target=step_thread)
  t.start()
  assert inside.wait(30)
  seen["other"] = jaxpr_has_primitive(traced_scan(), REMAT_PRIMITIVE_NAMES)
  done.set()
  t.join(30)
  assert seen == {"step": True, "other": False}


def test_nnx_layers_regather_exactly_and_a_layer_that_sows_runs_as_written():
  # `regather_nnx_layers` turns each NNX module that owns only boxed params into one layer's
  # custom VJP (as linen modules through `regather_layers`); one that writes state (``sow``)
  # while it computes runs as written, so its intermediates are kept.
  from flax import nnx
  from zerojax.core import grad as grad_mod
  from zerojax.core.gather import box_params
  from zerojax.core.regather import regather_nnx_layers

  class SowLinear(nnx.Linear):
    def __call__(self, x):
      y = super().__call__(x)
      self.sow(nnx.Intermediate, "y", y)
      return y

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(128, 128, rngs=rngs)
      self.b = SowLinear(128, 128, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  model, _, plan = zerojax.create_nnx(lambda: Net(nnx.Rngs(0)), optax.sgd(0.1),
                                      config=zerojax.ZeroConfig(stage=3))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 128)), jnp.float32)

  def loss(params, layers):
    boxed = grad_mod._in_plan_order(params, plan, lambda p: box_params(p, plan))
    m = nnx.merge(graphdef, boxed, rest)
    if layers:
      regather_nnx_layers(m)
    out = m(x)
    return jnp.sum(out ** 2), nnx.state(m, nnx.Intermediate)

  (want, _), g_want = jax.value_and_grad(loss, has_aux=True)(params, False)
  (got, sown), g_got = jax.value_and_grad(loss, has_aux=True)(params, True)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert [p for p, _ in nnx.to_flat_state(sown)] == [("b", "y")]
  count = lambda layers: str(jax.make_jaxpr(lambda p: loss(p, layers)[0])(params)).count(
      "custom_vjp_call")
  assert count(True) == count(False) + 1  # `a` computes as one layer; `b` as written


class _LoopBlock(nn.Module):  # a gated MLP: its two input projections read the same input
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    gate, up = (nn.Dense(256, use_bias=False)(h) for _ in range(2))
    return x + nn.Dense(64)(jax.nn.gelu(gate) * up)


class _Loop(nn.Module):
  remat: bool

  @nn.compact
  def __call__(self, x):
    block = nn.remat(_LoopBlock) if self.remat else _LoopBlock
    for _ in range(3):
      x = block()(x)
    return nn.Dense(8)(x)


def _loop_losses(stage, own_remat, steps=3, **config_kw):
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 64)), jnp.float32)
  config = zerojax.ZeroConfig.from_flat(dict(stage=stage, param_persistence_threshold=0,
                                             **config_kw))
  state, plan = zerojax.create_train_state(_Loop(own_remat), optax.adam(1e-2),
                                           jax.random.key(0), x, config=config)

  @zerojax.zero_step(plan)
  def step(state, x):
    loss, g = jax.value_and_grad(
        lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(state.params)
    return state.apply_gradients(grads=g), {"loss": loss}

  _REMATS[0] = _remats(step.jitted(state, x), state, x)
  _REMATS[1] = next(iter(step.remat.values()))
  out = []
  for _ in range(steps):
    state, m = step(state, x)
    out.append(float(m["loss"]))
  return out, plan.backend.prefetches_next_layer


_REMATS = [0, ""]  # the last helper's step: checkpoints differentiated (`_remats`), remat


def _remats(jitted, *args) -> int:
  """Checkpoints differentiated in the step's jaxpr (one per checkpointed call)."""
  return str(jitted.trace(*args).jaxpr).count("remat2[")


@pytest.mark.parametrize("prefetch, remat", [  # the mixed cases in the full suite only
    (False, False), pytest.param(False, True, marks=pytest.mark.slow),
    pytest.param(True, False, marks=pytest.mark.slow), (True, True)])
def test_unscanned_layers_train_exactly(monkeypatch, remat, prefetch):
  # With `prefetching` (the default on XLA:GPU and XLA:TPU, forced here on XLA:CPU), a
  # layer's forward gathers wait for the previous matmul layer's input (siblings, the gated
  # MLP's two input projections, for the input the first of them waited for) and its backward
  # re-gathers for the next one's output cotangent; in the model's own `nn.remat` blocks,
  # layers are no custom VJPs and the block's re-run gathers for its backward pass
  # (`inside_checkpoints`). Only the order and the number of gathers change: three steps'
  # losses match stage 0's.
  want, _ = _loop_losses(0, remat)
  monkeypatch.setitem(backend.BACKENDS, "cpu",
                      dataclasses.replace(backend.CPU, prefetches_next_layer=prefetch))
  got, on = _loop_losses(3, remat)
  assert on == prefetch
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_repeated_blocks_are_the_shallowest_repeated_modules():
  # Where remat='full'/'dots'/'offload' checkpoints a model without scans: each block, found
  # as the shallowest modules one parent calls two or more of, of one class.
  from zerojax.core.blocks import recording, repeated_blocks

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8)(nn.Dense(16)(x))

  class Layers(nn.Module):  # a Hugging Face-style collection one level down
    @nn.compact
    def __call__(self, x):
      for i in range(3):
        x = Mlp(name=str(i))(x)
      return x

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(Layers(name="layers")(nn.Dense(8)(x)))

  for model, want in ((Model(), {("layers", "0"), ("layers", "1"), ("layers", "2")}),
                      (_Loop(False), {("_LoopBlock_0",), ("_LoopBlock_1",), ("_LoopBlock_2",)}),
                      (nn.Dense(4), set())):
    x = jnp.ones((2, 64))
    params = model.init(jax.random.key(0), x)
    with recording() as calls:
      model.apply(params, x)
    assert repeated_blocks(calls) == want, (model, calls)


def test_remat_applied_says_where_remat_acted():
  # What `zerojax compile` prints and ZeroStep.remat holds, for each kind of model.
  from zerojax.core.formulation import Formulation, remat_applied
  cfg = lambda r: zerojax.ZeroConfig(stage=3, remat=r)
  scanned, flat = Formulation(True, True), Formulation(True, False)
  blocks = Formulation(True, False, blocks=frozenset({("Block_2",), ("Block_10",),
                                                      ("Block_0",)}))
  assert remat_applied(cfg("auto"), scanned) == (
      "remat='auto': inside each scanned layer the model does not rematerialise itself")
  assert remat_applied(cfg("dots"), scanned) == "remat='dots': inside each scanned layer"
  assert remat_applied(cfg("none"), scanned) == "remat='none': scanned layers as written"
  assert remat_applied(cfg("full"), blocks) == (
      "remat='full': on each of 3 blocks (Block_0 ... Block_10)")
  assert remat_applied(cfg("full"), flat).startswith("remat='full': around the whole model")
  assert remat_applied(cfg("auto"), flat) == (
      "remat='auto': no scanned layers; the model's own checkpoints, if any, as written")
  assert remat_applied(cfg("full"), None) == (
      "remat='full': the model was not traced for its formulation; any scanned layers run "
      "with it inside each layer")


@pytest.mark.parametrize("remat", [pytest.param("full", marks=pytest.mark.slow), "dots"])
def test_named_remat_checkpoints_each_block_and_trains_exactly(remat):
  # remat='full'/'dots' on a model without scans goes on each block, not around the whole
  # model (which re-ran the whole forward pass and kept all of it: the memory of no remat,
  # and one more gather of every weight). Stage 3 gathers per use here (forced); stage 2 by
  # the compiler. Three steps' losses match stage 0's.
  want, _ = _loop_losses(0, False)
  # One checkpoint per block (three; with 'auto' none at stage 2). At stage 3 zerojax's own
  # covers what runs between them (`keeping_nested`): the head after them, re-run in its
  # backward pass (what runs before the first block, input casts, has nothing to re-run).
  for stage, kw, remats in ((3, {"gather": "explicit"}, 4), (2, {}, 3)):
    got, _ = _loop_losses(stage, False, remat=remat, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert _REMATS[0] == remats, (stage, _REMATS[0])
    assert _REMATS[1] == (f"remat={remat!r}: on each of 3 blocks "
                          "(_LoopBlock_0 ... _LoopBlock_2)"), _REMATS[1]


class _DropoutBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dropout(0.5, deterministic=False)(nn.Dense(64)(x))


class _DropoutLoop(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = _DropoutBlock()(x)
    return x


class _TaggedBlock(nn.Module):  # returns a Python value beside its array
  @nn.compact
  def __call__(self, x, scale):
    return x + scale * nn.Dense(64)(jnp.tanh(x)), "tag"


class _TaggedLoop(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x, tag = _TaggedBlock()(x, 0.5)
      assert tag == "tag"
    return x


def test_named_remat_blocks_return_python_values_beside_arrays():
  # Only arrays leave a checkpoint: a block's other outputs are put back in place, and its
  # Python arguments stay Python values.
  import contextlib
  from zerojax.core.blocks import checkpointed_blocks, recording, repeated_blocks
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 64)), jnp.float32)
  model = _TaggedLoop()
  params = model.init(jax.random.key(0), x)
  with recording() as calls:
    model.apply(params, x)
  paths = repeated_blocks(calls)
  assert len(paths) == 3

  def loss(p, blocks):
    with (checkpointed_blocks(paths, jax.checkpoint_policies.nothing_saveable) if blocks
          else contextlib.nullcontext()):
      return jnp.sum(model.apply(p, x) ** 2)

  (want, g_want), (got, g_got) = (jax.value_and_grad(loss)(params, b) for b in (False, True))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert _remats(jax.jit(jax.grad(lambda p: loss(p, True))), params) == 3


def test_named_remat_blocks_draw_from_the_model_s_rng_streams():
  # A block with dropout is checkpointed too, with a key drawn from its 'dropout' stream (it
  # used to run as written); its masks are the same at every stage.
  import warnings
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 64)), jnp.float32)

  def losses(stage):
    config = zerojax.ZeroConfig(stage=stage, gather=zerojax.Gather(persistence_threshold=0),
                                remat="full")
    state, plan = zerojax.create_train_state(_DropoutLoop(), optax.adam(1e-2),
                                             jax.random.key(0), x, config=config)

    @zerojax.zero_step(plan)
    def step(state, x, key):
      loss, g = jax.value_and_grad(lambda p: jnp.mean(state.apply_fn(
          {"params": p}, x, rngs={"dropout": key}) ** 2))(state.params)
      return state.apply_gradients(grads=g), {"loss": loss}

    key = jax.random.key(1)
    remats = _remats(step.jitted(state, x, key), state, x, key)
    out = []
    for i in range(3):
      state, m = step(state, x, jax.random.fold_in(key, i))
      out.append(float(m["loss"]))
    return out, remats

  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no block left as written
    (want, remats0), (got, remats2) = losses(0), losses(2)
  assert remats0 == remats2 == 3
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("jitted", [False, True])
def test_a_models_own_checkpoints_keep_their_policy_inside_the_whole_model_one(capsys, jitted):
  # JAX applies the outermost checkpoint's policy inside nested ones: under one whole-model
  # checkpoint (save all but gathered weights) a model's own remat blocks saved every
  # activation. `keeping_nested` makes them save what they would at top level (their inputs),
  # without computing anything more (the backward pass re-runs each block once, as the model
  # asks), and still never a gathered weight; also where a block is a jitted function.
  import re
  from jax.ad_checkpoint import checkpoint_name, print_saved_residuals
  from zerojax.core.remat import keeping_nested, save_all_but_gathered

  def block(x, w):
    w = checkpoint_name(w * 1.0, gather.GATHERED)
    return jnp.cos(jnp.sin(x @ w)) @ w.T

  def model(x, w, nested):
    for _ in range(3):
      b = jax.checkpoint(block) if nested else block
      x = (jax.jit(b) if jitted else b)(x, w)
    return jnp.sum(x ** 2)

  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.float32)
  w = jnp.asarray(np.random.default_rng(1).normal(size=(16, 64)) * 0.1, jnp.float32)
  jax_outer = lambda nested: jax.checkpoint(lambda x, w: model(x, w, nested),
                                            policy=save_all_but_gathered)
  outer = lambda nested: keeping_nested(lambda x, w: model(x, w, nested),
                                        save_all_but_gathered)

  def shapes(f):  # JAX prints what a function saves for its backward pass, one per line
    capsys.readouterr()
    print_saved_residuals(f, x, w)
    return sorted(tuple(int(d) for d in m.split(",") if d)
                  for m in re.findall(r"^\w+\[([\d,]*)\]", capsys.readouterr().out, re.M))

  top = lambda x, w: model(x, w, True)
  # JAX's own rule: the outermost policy, inside the blocks too.
  assert (8, 64) in shapes(jax_outer(True))
  # x, w, the two later blocks' inputs and the loss's 2x: what the model alone saves.
  assert shapes(outer(True)) == shapes(top) == [(8, 16)] * 4 + [(16, 64)]
  assert (8, 64) in shapes(outer(False))  # without nested checkpoints: save all but w
  assert shapes(outer(False)) == shapes(jax_outer(False))
  flops = lambda f: jax.jit(jax.grad(f, argnums=(0, 1))).lower(
      x, w).compile().cost_analysis()["flops"]
  assert flops(outer(True)) <= flops(top) * 1.01  # each block re-run once, as asked
  for a, b in zip(jax.grad(outer(True), argnums=(0, 1))(x, w),
                  jax.grad(top, argnums=(0, 1))(x, w)):
    # (jitted blocks: XLA:CPU on jax 0.12 fuses them apart, rounding within 1e-5)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5 if jitted else 1e-6)


def _nnx_loop_losses(stage, steps=3, own_remat=True, **config_kw):
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.a, self.b = nnx.Linear(64, 256, rngs=rngs), nnx.Linear(256, 64, rngs=rngs)

    def __call__(self, x):
      return x + self.b(jax.nn.gelu(self.a(x)))

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([Block(rngs) for _ in range(3)])

    def __call__(self, x):
      for b in self.blocks:
        x = nnx.remat(lambda b, x: b(x))(b, x) if own_remat else b(x)
      return x

  config = zerojax.ZeroConfig.from_flat(dict(stage=stage, param_persistence_threshold=0,
                                             **config_kw))
  model, opt, plan = zerojax.create_nnx(lambda: Net(nnx.Rngs(0)), optax.adam(1e-2),
                                        config=config)

  @zerojax.zero_step(plan)
  def step(model, optimizer, x):
    loss, grads = zerojax.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x)
    optimizer.update(model, grads)
    return {"loss": loss}

  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 64)), jnp.float32)
  _REMATS[0] = _remats(step.jitted(model, opt, x), nnx.state((model, opt)), x)
  _REMATS[1] = next(iter(step.remat.values()))
  return [float(step(model, opt, x)["loss"]) for _ in range(steps)]


def test_nnx_remat_blocks_train_exactly():
  # NNX's own checkpoints (nnx.remat) in a Python loop keep their policy at stage 3, and
  # their layers gather as written there (`inside_checkpoints`): stage 0's losses.
  np.testing.assert_allclose(_nnx_loop_losses(3), _nnx_loop_losses(0), rtol=1e-5)


def test_named_remat_checkpoints_each_nnx_block_and_trains_exactly():
  # remat='full' on an nnx.List of blocks goes on each block (nnx.remat), found in the model's
  # module graph (per use on XLA:GPU: test_gpu_aot). Stage 0's losses.
  from flax import nnx
  from zerojax.core.blocks import nnx_blocks
  want = _nnx_loop_losses(0, own_remat=False)
  for stage in (2, 3):
    np.testing.assert_allclose(_nnx_loop_losses(stage, own_remat=False, remat="full"), want,
                               rtol=1e-5)
    assert _REMATS[0] == 3, (stage, _REMATS[0])  # one per block
    assert _REMATS[1] == "remat='full': on each of 3 blocks (blocks/0 ... blocks/2)"

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.inp, self.out = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)
      self.blocks = nnx.List([nnx.Sequential(nnx.Linear(8, 8, rngs=rngs)) for _ in range(2)])

  assert nnx_blocks(Net(nnx.Rngs(0))) == {("blocks", 0), ("blocks", 1)}
