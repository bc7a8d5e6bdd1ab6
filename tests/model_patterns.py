"""The model-writing patterns of the conformance tests and benchmark, and their runners.

Nine ways people write a model (``PATTERNS``, described in ``DESCRIPTIONS``), at two sizes
(``SMALL`` for the tests, ``FULL`` for the benchmark), each trained by zerojax at a default
`ZeroConfig` (`zero_runner`), by hand-written JAX FSDP (`baseline_runner`: jit in/out shardings
only) and unsharded on one device (`reference_losses`). ``tests/core/test_patterns.py`` asserts
ZeRO's guarantees on them; ``benchmarks/patterns.py`` tabulates them.

JAX is imported inside the functions, so that a script importing this module can still set
the device count before the backend starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

PATTERNS = ("a", "b", "c", "d1", "d2", "e", "f", "g", "h")
DESCRIPTIONS = {
    "a": "nn.scan(nn.remat(Block))", "b": "nn.scan(Block), no remat",
    "c": "Python loop of linen blocks", "d1": "tied head via self.variables",
    "d2": "tied head via Embed.attend", "e": "NNX, nnx.List of blocks",
    "f": "NNX, nnx.vmap + nnx.scan(nnx.remat)", "g": "plain pytree + pure function",
    "h": "linen, called without state.apply_fn",
}


@dataclasses.dataclass(frozen=True)
class Size:
  layers: int
  d_model: int
  d_ff: int
  rows: int  # rows per step (the batch)
  vocab: int  # LM patterns (d1, d2)
  seq: int  # LM patterns: tokens per row

  @property
  def lm_rows(self) -> int:
    return max(8, self.rows // self.seq)


FULL = Size(layers=12, d_model=512, d_ff=2048, rows=1024, vocab=8192, seq=32)
SMALL = Size(layers=4, d_model=128, d_ff=512, rows=64, vocab=512, seq=8)
# For accelerator compiles only: a TPU v5e's 128 MiB of VMEM holds FULL's whole step, so its
# HBM temp there measures where memory-space assignment put things, not what the step holds.
WIDE = Size(layers=12, d_model=2048, d_ff=8192, rows=4096, vocab=8192, seq=32)


# -- the models, written the usual ways -------------------------------------------------------


def linen_models(size: Size):
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
      h = nn.Dense(size.d_ff)(nn.LayerNorm()(x))
      return x + nn.Dense(size.d_model)(nn.gelu(h)), None

  class Scanned(nn.Module):
    remat: bool = True

    @nn.compact
    def __call__(self, x):
      block = nn.remat(Block) if self.remat else Block
      x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=size.layers)()(x, None)
      return x

  class Loop(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(size.layers):
        x, _ = Block()(x)
      return x

  class TiedLM(nn.Module):
    via_variables: bool = True

    @nn.compact
    def __call__(self, tokens):
      embed = nn.Embed(size.vocab, size.d_model, name="wte")
      x = embed(tokens)
      for _ in range(size.layers):
        x, _ = Block()(x)
      x = nn.LayerNorm()(x)
      if self.via_variables:  # as a well-known GPT-2 port ties its head
        return x @ self.variables["params"]["wte"]["embedding"].T
      return embed.attend(x)

  return {"a": Scanned(True), "b": Scanned(False), "c": Loop(), "d1": TiedLM(True),
          "d2": TiedLM(False), "h": Scanned(True)}


def nnx_model(size: Size, pattern: str, rngs):
  import jax
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.norm = nnx.LayerNorm(size.d_model, rngs=rngs)
      self.up = nnx.Linear(size.d_model, size.d_ff, rngs=rngs)
      self.down = nnx.Linear(size.d_ff, size.d_model, rngs=rngs)

    def __call__(self, x):
      return x + self.down(nnx.gelu(self.up(self.norm(x))))

  class Listed(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([Block(rngs) for _ in range(size.layers)])

    def __call__(self, x):
      for b in self.blocks:
        x = b(x)
      return x

  class Stacked(nnx.Module):
    def __init__(self, rngs):
      @nnx.split_rngs(splits=size.layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return Block(rngs)
      self.blocks = make(rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
      @nnx.remat
      def body(block, x):
        return block(x)
      return body(self.blocks, x)

  del jax
  return Listed(rngs) if pattern == "e" else Stacked(rngs)


def pytree_init(size: Size, key):
  """Plain JAX: a dict of stacked layer weights, no Flax anywhere."""
  import jax
  import jax.numpy as jnp
  k1, k2 = jax.random.split(key)
  L, D, F = size.layers, size.d_model, size.d_ff
  return {"w_up": jax.random.normal(k1, (L, D, F)) * D ** -0.5, "b_up": jnp.zeros((L, F)),
          "w_down": jax.random.normal(k2, (L, F, D)) * F ** -0.5, "b_down": jnp.zeros((L, D)),
          "scale": jnp.ones((L, D))}


def pytree_apply(params, x):
  import jax
  import jax.numpy as jnp
  for i in range(params["w_up"].shape[0]):  # a Python loop, as hand-written JAX often is
    h = x * params["scale"][i] / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    h = jax.nn.gelu(h @ params["w_up"][i] + params["b_up"][i])
    x = x + h @ params["w_down"][i] + params["b_down"][i]
  return x


def is_lm(pattern: str) -> bool:
  return pattern in ("d1", "d2")


def batches(size: Size, pattern: str, n: int, seed: int = 1) -> list[dict]:
  import numpy as np
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    if is_lm(pattern):
      t = rng.integers(0, size.vocab, (size.lm_rows, size.seq + 1), dtype=np.int32)
      out.append({"x": t[:, :-1], "y": t[:, 1:]})
    else:
      out.append({"x": rng.standard_normal((size.rows, size.d_model), np.float32),
                  "y": rng.standard_normal((size.rows, size.d_model), np.float32)})
  return out


def loss_of(pattern: str, out, y):
  import jax.numpy as jnp
  import optax
  if is_lm(pattern):
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
  return jnp.mean((out - y) ** 2)


def make_tx():
  import optax
  # Adam divides by sqrt(v): on elements whose gradient is near zero, fp32 reduction-order noise
  # (different for any two device layouts) becomes an lr-sized update. eps bounds that to
  # lr * noise / eps, so a 1e-5 parity bound tests zerojax, not the order of sums (the tied-head
  # LM measured 1.1e-5 after two steps at eps 1e-6, at every stage alike).
  return optax.adamw(1e-3, eps=1e-5, weight_decay=0.1)


# -- one pattern: zerojax, the hand-written baseline and the unsharded reference ------------------


@dataclasses.dataclass
class Runner:
  """A compiled step and its live arguments: ``run()`` does one step and returns the loss."""

  compiled: Any
  step: Callable[[], float]
  params: Callable[[], Any]  # the current parameters as a numpy tree
  plan: Any = None  # zerojax's ShardingPlan (None for the baseline)
  formulation: str = "compiler"  # zerojax's: "per use" or "compiler" (`ZeroStep.formulation`)
  layers: str | None = None  # zerojax's scanned layers (`ZeroStep.layers`; None: none said)


def zero_runner(pattern: str, size: Size, stage: int, mesh=None, **config_kw) -> Runner:
  """zerojax at ``ZeroConfig(stage=stage, **config_kw)``, the step written as without it."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import zerojax
  config = zerojax.ZeroConfig.from_flat(dict(stage=stage, **config_kw))
  data = batches(size, pattern, 1)
  x0 = jnp.asarray(data[0]["x"])
  tx = make_tx()
  if pattern in ("e", "f"):
    from flax import nnx
    model, opt, plan = zerojax.create_nnx(lambda: nnx_model(size, pattern, nnx.Rngs(0)), tx,
                                          config=config, mesh=mesh)

    def train_step(model, optimizer, batch):
      def lf(model, batch):
        return loss_of(pattern, model(batch["x"]), batch["y"])
      loss, grads = zerojax.value_and_grad(lf)(model, batch)  # nnx.value_and_grad, + ZeRO-1
      optimizer.update(model, grads)
      return {"loss": loss}

    zstep = zerojax.zero_step(plan)(train_step)
    compiled = zstep.lower(model, opt, data[0]).compile()
    formulation = next(iter(zstep.formulation.values()), "compiler")
    layers = next(iter(zstep.layers.values()), None)
    params = lambda: jax.tree.map(np.asarray, nnx.state(model, nnx.Param))

    def run(batch):
      new, metrics = compiled(nnx.split((model, opt))[1], batch)
      nnx.update((model, opt), new)
      return float(metrics["loss"])
  else:
    if pattern == "g":
      from zerojax.core.plan import ShardingPlan
      mesh = zerojax.make_mesh(config) if mesh is None else mesh
      init = pytree_init(size, jax.random.key(0))
      plan = ShardingPlan.create(config, mesh, init, tx)
      state = zerojax.ZeroTrainState.create(apply_fn=pytree_apply, params=init, tx=tx,
                                            config=config)
      state = jax.device_put(state, plan.state(state))
      apply = lambda state, p, x: state.apply_fn(p, x)
    else:
      model = linen_models(size)[pattern]
      state, plan = zerojax.create_train_state(model, tx, jax.random.key(0), x0,
                                               config=config, mesh=mesh)
      if pattern == "h":  # the model object itself, not the state's apply_fn
        apply = lambda state, p, x: model.apply({"params": p}, x)
      else:
        apply = lambda state, p, x: state.apply_fn({"params": p}, x)

    def train_step(state, batch):
      def lf(p, batch):
        return loss_of(pattern, apply(state, p, batch["x"]), batch["y"])
      # jax.value_and_grad, except that stage 1 holds the local gradient until one reduction
      loss, grads = zerojax.value_and_grad(lf)(state.params, batch)
      return state.apply_gradients(grads=grads), {"loss": loss}

    zstep = zerojax.zero_step(plan)(train_step)
    compiled = zstep.lower(state, data[0]).compile()
    formulation = next(iter(zstep.formulation.values()), "compiler")
    layers = next(iter(zstep.layers.values()), None)
    box = [state]
    params = lambda: jax.tree.map(np.asarray, box[0].params)

    def run(batch):
      box[0], metrics = compiled(box[0], batch)
      return float(metrics["loss"])
  return Runner(compiled, run, params, plan, formulation, layers)


def pytree_compiled(size: Size, stage: int, devices) -> Any:
  """Pattern g's zerojax step at ``ZeroConfig(stage=stage)``, compiled ahead of time over
  ``devices`` (e.g. a TPU topology's, `zerojax.runtime.memory.tpu_topology`) from abstract state:
  nothing is allocated, so it runs on a machine without those devices."""
  step, state, batch, plan = pytree_step(size, stage, devices)
  return step.lower(state, batch).compile(), plan


def pytree_step(size: Size, stage: int, devices, **config_kw) -> tuple[Any, Any, Any, Any]:
  """``(step, state, batch, plan)``: pattern g's zerojax step over ``devices`` at
  ``ZeroConfig(stage=stage, **config_kw)`` and the abstract state and batch to lower it with."""
  import jax
  import zerojax
  from zerojax.core.plan import ShardingPlan
  config = zerojax.ZeroConfig.from_flat(dict(stage=stage, **config_kw))
  mesh = zerojax.make_mesh(config, devices=list(devices))
  tx = make_tx()
  init = jax.eval_shape(lambda: pytree_init(size, jax.random.key(0)))
  plan = ShardingPlan.create(config, mesh, init, tx)
  state = jax.eval_shape(lambda p: zerojax.ZeroTrainState.create(
      apply_fn=pytree_apply, params=p, tx=tx, config=config), init)
  state = abstract(state, plan.state(state)).replace(apply_fn=pytree_apply)
  data = batches(size, "g", 1)[0]
  batch = abstract(data, plan.batch(data))

  def train_step(state, batch):
    def lf(p, batch):
      return loss_of("g", state.apply_fn(p, batch["x"]), batch["y"])
    loss, grads = zerojax.value_and_grad(lf)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}

  return zerojax.zero_step(plan)(train_step), state, batch, plan


def timed_compile(compile_: Callable[[], Any]) -> tuple[Any, float]:
  """``(compile_(), seconds)``; the baselines' compile times are taken the same way: tracing,
  lowering and XLA's compile of a step whose abstract state and shardings already exist."""
  import time
  t0 = time.perf_counter()
  out = compile_()
  return out, time.perf_counter() - t0


def abstract(tree: Any, shardings: Any) -> Any:
  """``tree`` as ``jax.ShapeDtypeStruct``s carrying ``shardings`` (to compile from)."""
  import jax
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def target_zero(pattern: str, size: Size, stage: int, devices, **config_kw
                ) -> tuple[Any, Any, float]:
  """``(compiled, plan, seconds)``: zerojax's step for ``pattern`` at
  ``ZeroConfig(stage=stage, **config_kw)``, compiled ahead of time for ``devices`` (a TPU or
  GPU topology's, or CPU devices) from abstract state. The seconds are the step's
  (`timed_compile`), not the plan's."""
  import jax
  import zerojax
  from zerojax.core.create import abstract_nnx
  from zerojax.checkpoint import abstract_train_state
  if pattern == "g":
    step, state, batch, plan = pytree_step(size, stage, devices, **config_kw)
    compiled, secs = timed_compile(lambda: step.lower(state, batch).compile())
    return compiled, plan, secs
  config = zerojax.ZeroConfig.from_flat(dict(stage=stage, **config_kw))
  mesh = zerojax.make_mesh(config, devices=list(devices))
  data = batches(size, pattern, 1)[0]
  tx = make_tx()
  if pattern in ("e", "f"):
    from flax import nnx
    model, opt, plan = abstract_nnx(lambda: nnx_model(size, pattern, nnx.Rngs(0)), tx,
                                    config=config, mesh=mesh)

    def nnx_step(model, optimizer, batch):
      def lf(model, batch):
        return loss_of(pattern, model(batch["x"]), batch["y"])
      loss, grads = zerojax.value_and_grad(lf)(model, batch)
      optimizer.update(model, grads)
      return {"loss": loss}
    batch = abstract(data, plan.batch(data))
    step = zerojax.zero_step(plan)(nnx_step)
    compiled, secs = timed_compile(lambda: step.lower(model, opt, batch).compile())
    return compiled, plan, secs
  model = linen_models(size)[pattern]
  x0 = jax.ShapeDtypeStruct(data["x"].shape, data["x"].dtype)
  state, plan = abstract_train_state(model, tx, jax.random.key(0), x0, config=config, mesh=mesh)
  apply = ((lambda state, p, x: model.apply({"params": p}, x)) if pattern == "h"
           else (lambda state, p, x: state.apply_fn({"params": p}, x)))

  def train_step(state, batch):
    def lf(p, batch):
      return loss_of(pattern, apply(state, p, batch["x"]), batch["y"])
    loss, grads = zerojax.value_and_grad(lf)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}
  batch = abstract(data, plan.batch(data))
  step = zerojax.zero_step(plan)(train_step)
  compiled, secs = timed_compile(lambda: step.lower(state, batch).compile())
  return compiled, plan, secs


def check_weights_move(pattern: str, devices) -> None:
  """Compiles ``pattern``'s default stage-3 step (small size) for ``devices`` (a TPU or GPU
  topology's) and checks that its collectives move no activations, at most 1.1× the textbook
  ZeRO-3 volume, and that ordering the gathers added no scalar all-reduce to the loss's."""
  from zerojax.runtime import memory
  compiled, plan, _ = target_zero(pattern, SMALL, 3, devices)
  assert memory.activation_collectives(compiled.as_text(), plan) == {}
  assert memory.measure(compiled).collective_total <= 1.1 * memory.textbook_bytes(plan)
  assert scalar_all_reduces(compiled.as_text()) <= 1


def one_ahead_and_not(pattern: str, size: Size, devices, monkeypatch
                      ) -> tuple[tuple[float, int], tuple[float, int]]:
  """``((share, temp) with layers gathered one matmul layer ahead, the same without)``:
  ``pattern``'s default stage-3 step compiled for ``devices`` twice, the second time with
  `Backend.prefetches_next_layer` off (``monkeypatch`` keeps it off for the rest of the
  test). ``share``: all-gather bytes with a matmul between start and done."""
  import dataclasses
  from zerojax.core import backend
  from zerojax.runtime import memory

  def compile_(expect: bool) -> tuple[float, int]:
    compiled, plan, _ = target_zero(pattern, size, 3, devices)
    assert plan.backend.prefetches_next_layer == expect
    share = memory.collective_schedule(compiled.as_text(), "all-gather").matmul_share
    return share, memory.measure(compiled).temp

  ahead = compile_(True)
  off = dataclasses.replace(backend.for_platform(devices[0].platform), prefetches_next_layer=False)
  monkeypatch.setitem(backend.BACKENDS, off.name, off)
  return ahead, compile_(False)


def scalar_all_reduces(hlo_text: str) -> int:
  """How many all-reduce ops of at most two float32 scalars a compiled program has. A step at
  stage 3 needs one (the loss's mean); an ordering token summed over a sharded activation
  added one per layer read (14 in pattern g's small step on XLA:TPU, 24 in c's on XLA:GPU,
  before gathers were ordered by barriers there). Gradients XLA:TPU all-reduces are larger."""
  from zerojax.runtime import memory
  return sum(kind == "all-reduce" and size <= 8 for kind, _, size in memory.reductions(hlo_text))


def fsdp_spec(shape, n):
  """The hand-written rule: shard the largest dimension that divides by the device count."""
  from jax.sharding import PartitionSpec as P
  best = None
  for d, s in enumerate(shape):
    if s % n == 0 and (best is None or s >= shape[best]):
      best = d
  if best is None:
    return P()
  spec = [None] * len(shape)
  spec[best] = "fsdp"
  return P(*spec)


def baseline_runner(pattern: str, size: Size, devices=None) -> Runner:
  """Hand-written JAX FSDP: jit in/out shardings on params, optimizer state and batch."""
  import jax
  import numpy as np
  import optax
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
  devices = jax.devices() if devices is None else devices
  n = len(devices)
  mesh = Mesh(np.asarray(devices), ("fsdp",), axis_types=(AxisType.Auto,))
  shard = lambda tree: jax.tree.map(
      lambda x: NamedSharding(mesh, fsdp_spec(np.shape(x), n)), tree)
  data = batches(size, pattern, 1)
  batch_sh = NamedSharding(mesh, P("fsdp"))
  tx = make_tx()
  if pattern in ("e", "f"):
    from flax import nnx
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: (lambda m: (m, nnx.Optimizer(m, tx, wrt=nnx.Param)))(
            nnx_model(size, pattern, nnx.Rngs(0)))))
    state_sh = shard(state)

    @nnx.jit
    def init():
      m = nnx_model(size, pattern, nnx.Rngs(0))
      return nnx.state((m, nnx.Optimizer(m, tx, wrt=nnx.Param)))
    live = [jax.device_put(init(), state_sh)]

    def step(state, batch):
      m, o = nnx.merge(graphdef, state)
      loss, grads = nnx.value_and_grad(
          lambda m: loss_of(pattern, m(batch["x"]), batch["y"]))(m)
      o.update(m, grads)
      return nnx.state((m, o)), loss

    f = jax.jit(step, in_shardings=(state_sh, batch_sh),
                out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=(0,))
    params = lambda: jax.tree.map(np.asarray, nnx.state(nnx.merge(graphdef, live[0])[0],
                                                        nnx.Param))
  else:
    p0, apply = pure_model(pattern, size, data[0]["x"])
    o0 = tx.init(p0)
    state_sh = (shard(p0), shard(o0))
    live = [jax.device_put((p0, o0), state_sh)]

    def step(state, batch):
      p, o = state
      loss, g = jax.value_and_grad(lambda p: loss_of(pattern, apply(p, batch["x"]),
                                                     batch["y"]))(p)
      u, o = tx.update(g, o, p)
      return (optax.apply_updates(p, u), o), loss

    f = jax.jit(step, in_shardings=(state_sh, batch_sh),
                out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=(0,))
    params = lambda: jax.tree.map(np.asarray, live[0][0])
  compiled = f.lower(live[0], data[0]).compile()

  def run(batch):
    live[0], loss = f(live[0], batch)
    return float(loss)
  return Runner(compiled, run, params)


def pure_model(pattern: str, size: Size, x: Any) -> tuple[Any, Any]:
  """``(params, apply(params, x))`` of a linen or plain pytree pattern, initialised from key 0."""
  import jax
  import jax.numpy as jnp
  if pattern == "g":
    return pytree_init(size, jax.random.key(0)), pytree_apply
  model = linen_models(size)[pattern]
  params = model.init(jax.random.key(0), jnp.asarray(x))["params"]
  return params, lambda p, x: model.apply({"params": p}, x)


def reference_losses(pattern: str, size: Size, steps: int) -> tuple[list[float], Any]:
  """The same training on one device, no sharding at all: losses and final params."""
  import jax
  import numpy as np
  import optax
  dev = jax.devices()[0]
  data = batches(size, pattern, steps)
  tx = make_tx()
  with jax.default_device(dev):
    if pattern in ("e", "f"):
      from flax import nnx
      model = nnx_model(size, pattern, nnx.Rngs(0))
      opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

      @nnx.jit
      def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(
            lambda m: loss_of(pattern, m(batch["x"]), batch["y"]))(model)
        opt.update(model, grads)
        return loss
      losses = [float(step(model, opt, jax.device_put(b, dev))) for b in data]
      return losses, jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    p, apply = pure_model(pattern, size, data[0]["x"])
    o = tx.init(p)

    @jax.jit
    def step(p, o, batch):
      loss, g = jax.value_and_grad(lambda p: loss_of(pattern, apply(p, batch["x"]),
                                                     batch["y"]))(p)
      u, o = tx.update(g, o, p)
      return optax.apply_updates(p, u), o, loss
    losses = []
    for b in data:
      p, o, loss = step(p, o, jax.device_put(b, dev))
      losses.append(float(loss))
  return losses, jax.tree.map(np.asarray, p)


def max_diff(a: Any, b: Any) -> float:
  import jax
  import numpy as np
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb), (len(la), len(lb))
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(la, lb))


# -- language models written as NNX modules and as pure functions ----------------------------

# A vocabulary large next to a device's rows (8192 tokens, 16 x 256 tokens a step): left to
# itself, XLA's partitioner computes the embedding's gradient in each device's shard from
# all-gathered cotangent rows and token ids (activations), at stages 2 and 3 on TPU and GPU.
LOOKUP_LM = dict(vocab=8192, seq=256, rows=16, d_model=256, layers=2)


def lookup_rows(spelling: str, table: Any, ids: Any) -> Any:
  """``table``'s rows at ``ids``, spelled as ``spelling`` (one of `LOOKUPS`): every way JAX
  spells a row lookup, as a pure function may write it."""
  import jax
  import jax.numpy as jnp
  if spelling == "index":
    return table[ids]
  if spelling == "take":
    return jnp.take(table, ids, axis=0)
  if spelling == "take_along_axis":
    rows = jnp.take_along_axis(table, ids.reshape(-1, 1), axis=0)
    return rows.reshape(*ids.shape, table.shape[1])
  if spelling == "lax_gather":
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(ids.ndim,), collapsed_slice_dims=(0,),
                                          start_index_map=(0,))
    return jax.lax.gather(table, ids[..., None], dims, (1, table.shape[1]),
                          mode="promise_in_bounds")
  if spelling == "one_hot":
    return jax.nn.one_hot(ids, table.shape[0], dtype=table.dtype) @ table
  raise ValueError(spelling)


LOOKUPS = ("index", "take", "take_along_axis", "lax_gather", "one_hot")


def lookup_lm_compiled(kind: str, stage: int, devices, lookup: str = "index"
                       ) -> tuple[Any, Any]:
  """``(compiled, plan)``: a language model written as ``kind`` (``"nnx"``: zerojax's NNX GPT,
  ``"pure"``: a plain function of a parameter dict that looks its table up, spelled as
  ``lookup`` (`lookup_rows`; ``"index"``: ``wte[tokens]``)) at ``ZeroConfig(stage=stage,
  compute_dtype="bfloat16")``, compiled ahead of time for ``devices`` (a TPU or GPU
  topology's) from abstract state."""
  import jax
  import jax.numpy as jnp
  import optax
  import zerojax
  from zerojax.core.plan import ShardingPlan
  V, T, B = LOOKUP_LM["vocab"], LOOKUP_LM["seq"], LOOKUP_LM["rows"]
  D, L = LOOKUP_LM["d_model"], LOOKUP_LM["layers"]
  config = zerojax.ZeroConfig(stage=stage, precision=zerojax.Precision(compute="bfloat16"),
                              gather=zerojax.Gather(persistence_threshold=0))
  mesh = zerojax.make_mesh(config, devices=list(devices))
  tx = optax.adamw(1e-4)
  lm_loss = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), y).mean()
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
  batch = {"x": tokens, "y": tokens}
  if kind == "nnx":
    from flax import nnx
    from zerojax.core.create import abstract_nnx
    from zerojax.models import GPTConfig
    from zerojax.models.gpt import nnx_gpt
    cfg = GPTConfig(vocab_size=V, seq_len=T, num_layers=L, num_heads=4, d_model=D)
    model, opt, plan = abstract_nnx(lambda: nnx_gpt(cfg, nnx.Rngs(0)), tx, config=config,
                                    mesh=mesh)

    def nnx_step(model, optimizer, batch):
      loss, grads = zerojax.value_and_grad(lambda m, b: lm_loss(m(b["x"]), b["y"]))(model,
                                                                                     batch)
      optimizer.update(model, grads)
      return {"loss": loss}
    step = zerojax.zero_step(plan)(nnx_step)
    return step.lower(model, opt, abstract(batch, plan.batch(batch))).compile(), plan

  def init(key):
    k = jax.random.split(key, 4)
    return {"wte": jax.random.normal(k[0], (V, D)) * 0.02,
            "w_up": jax.random.normal(k[1], (L, D, 4 * D)) * D ** -0.5,
            "w_down": jax.random.normal(k[2], (L, 4 * D, D)) * (4 * D) ** -0.5,
            "head": jax.random.normal(k[3], (D, V)) * D ** -0.5}

  def apply(params, tokens):
    x = lookup_rows(lookup, params["wte"], tokens)
    for i in range(L):
      x = x + jax.nn.gelu(x @ params["w_up"][i]) @ params["w_down"][i]
    return x @ params["head"]

  shapes = jax.eval_shape(init, jax.random.key(0))
  plan = ShardingPlan.create(config, mesh, shapes, tx)
  state = jax.eval_shape(lambda p: zerojax.ZeroTrainState.create(
      apply_fn=apply, params=p, tx=tx, config=config), shapes)
  state = abstract(state, plan.state(state)).replace(apply_fn=apply)

  def train_step(state, batch):
    loss, grads = zerojax.value_and_grad(
        lambda p, b: lm_loss(state.apply_fn(p, b["x"]), b["y"]))(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}
  step = zerojax.zero_step(plan)(train_step)
  return step.lower(state, abstract(batch, plan.batch(batch))).compile(), plan


def check_lookups_move_weights(kind: str, stage: int, devices, lookup: str = "index") -> None:
  """`lookup_lm_compiled`'s step moves no activations, at most 1.1x the textbook volume."""
  from zerojax.runtime import memory
  compiled, plan = lookup_lm_compiled(kind, stage, devices, lookup)
  hlo = compiled.as_text()
  assert memory.activation_collectives(hlo, plan) == {}, memory.activation_collectives(hlo, plan)
  assert memory.measure(compiled).collective_total <= 1.1 * memory.textbook_bytes(plan)
