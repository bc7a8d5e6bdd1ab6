"""Conformance: ZeRO on the models people write, against hand-written JAX FSDP.

``python benchmarks/patterns.py`` compiles and runs, on 8 simulated CPU devices and at the
*default* `ZeroConfig` (only ``stage`` set), one training step of each model-writing pattern:

* ``a``  linen ``nn.scan(nn.remat(Block))`` (MaxText style)
* ``b``  linen ``nn.scan(Block)`` without remat
* ``c``  linen blocks in a Python loop (HF style, unscanned)
* ``d1`` a tied LM head read through ``self.variables[...]["embedding"].T``
* ``d2`` a tied LM head through ``nn.Embed.attend``
* ``e``  Flax NNX, blocks in an ``nnx.List``
* ``f``  Flax NNX, stacked layers (``nnx.vmap`` init, ``nnx.scan`` over ``nnx.remat`` blocks)
* ``g``  a plain pytree: a params dict and a pure function, no Flax
* ``h``  a linen model called inside the step without ``state.apply_fn`` (a closure)

For each pattern the baseline is what someone would write by hand: params and Adam state
sharded on their largest divisible dimension through ``jax.jit`` in/out shardings, the batch
sharded, the pattern's own remat, nothing else. Per pattern and stage the table gives, per
device, XLA's temp and peak bytes, collective bytes from the compiled HLO, the largest loss
and final-parameter difference to an unsharded (one-device) run, and the median step time
relative to the baseline, timed alternately in one run.

``--size small`` runs the tests' sizes; the tests (``tests/test_patterns.py``) import the
patterns from here.

``--target h100:8`` (or a TPU slice such as ``v5e:2x4``) compiles the same steps ahead of time
for that accelerator compiler from abstract state (nothing runs) and gives, per pattern and
stage: temp, peak, collective bytes against the textbook ZeRO volume, the share of all-gather
and reduce-scatter bytes with a matmul between start and done, collectives that move
activations, and the compile time; against the hand-written baseline and a MaxText-style one
(weights sharded on their ``d_model`` dimension, activations constrained to batch-on-fsdp).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


# -- the models, written the usual ways -------------------------------------------------------


def _linen_models(size: Size):
  import flax.linen as nn
  import jax.numpy as jnp

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


def _nnx_model(size: Size, pattern: str, rngs):
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


def _pytree_init(size: Size, key):
  """Plain JAX: a dict of stacked layer weights, no Flax anywhere."""
  import jax
  import jax.numpy as jnp
  k1, k2 = jax.random.split(key)
  L, D, F = size.layers, size.d_model, size.d_ff
  return {"w_up": jax.random.normal(k1, (L, D, F)) * D ** -0.5, "b_up": jnp.zeros((L, F)),
          "w_down": jax.random.normal(k2, (L, F, D)) * F ** -0.5, "b_down": jnp.zeros((L, D)),
          "scale": jnp.ones((L, D))}


def _pytree_apply(params, x):
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


def zero_runner(pattern: str, size: Size, stage: int, mesh=None, **config_kw) -> Runner:
  """zerojax at ``ZeroConfig(stage=stage, **config_kw)``, the step written as without it."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import zerojax
  config = zerojax.ZeroConfig(stage=stage, **config_kw)
  data = batches(size, pattern, 1)
  x0 = jnp.asarray(data[0]["x"])
  tx = make_tx()
  if pattern in ("e", "f"):
    from flax import nnx
    model, opt, plan = zerojax.create_nnx(lambda: _nnx_model(size, pattern, nnx.Rngs(0)), tx,
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
    params = lambda: jax.tree.map(np.asarray, nnx.state(model, nnx.Param))

    def run(batch):
      new, metrics = compiled(nnx.split((model, opt))[1], batch)
      nnx.update((model, opt), new)
      return float(metrics["loss"])
  else:
    if pattern == "g":
      from zerojax.core.plan import ShardingPlan
      mesh = zerojax.make_mesh(config) if mesh is None else mesh
      init = _pytree_init(size, jax.random.key(0))
      plan = ShardingPlan.create(config, mesh, init, tx)
      state = zerojax.ZeroTrainState.create(apply_fn=_pytree_apply, params=init, tx=tx,
                                            config=config)
      state = jax.device_put(state, plan.state(state))
      apply = lambda state, p, x: state.apply_fn(p, x)
    else:
      model = _linen_models(size)[pattern]
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
    box = [state]
    params = lambda: jax.tree.map(np.asarray, box[0].params)

    def run(batch):
      box[0], metrics = compiled(box[0], batch)
      return float(metrics["loss"])
  return Runner(compiled, run, params, plan, formulation)


def pytree_compiled(size: Size, stage: int, devices) -> Any:
  """Pattern g's zerojax step at ``ZeroConfig(stage=stage)``, compiled ahead of time over
  ``devices`` (e.g. a TPU topology's, `zerojax.runtime.memory.tpu_topology`) from abstract state:
  nothing is allocated, so it runs on a machine without those devices."""
  import jax
  import zerojax
  from zerojax.core.plan import ShardingPlan
  config = zerojax.ZeroConfig(stage=stage)
  mesh = zerojax.make_mesh(config, devices=list(devices))
  tx = make_tx()
  init = jax.eval_shape(lambda: _pytree_init(size, jax.random.key(0)))
  plan = ShardingPlan.create(config, mesh, init, tx)
  state = jax.eval_shape(lambda p: zerojax.ZeroTrainState.create(
      apply_fn=_pytree_apply, params=p, tx=tx, config=config), init)
  abstract = lambda tree, sh: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
  state = abstract(state, plan.state(state)).replace(apply_fn=_pytree_apply)
  data = batches(size, "g", 1)[0]
  batch = abstract(data, plan.batch(data))

  def train_step(state, batch):
    def lf(p, batch):
      return loss_of("g", state.apply_fn(p, batch["x"]), batch["y"])
    loss, grads = zerojax.value_and_grad(lf)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}

  return zerojax.zero_step(plan)(train_step).lower(state, batch).compile(), plan


# -- ahead of time, for an accelerator compiler (--target) -----------------------------------------


def _abstract(tree, shardings):
  import jax
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def target_zero(pattern: str, size: Size, stage: int, devices) -> tuple[Any, Any, float]:
  """``(compiled, plan, seconds)``: zerojax's step at ``ZeroConfig(stage=stage)`` compiled for
  ``devices`` (a topology's) from abstract state."""
  import jax
  import zerojax
  from zerojax.core.step import abstract_nnx
  from zerojax.runtime.checkpoint import abstract_train_state
  if pattern == "g":
    t0 = time.perf_counter()
    compiled, plan = pytree_compiled(size, stage, devices)
    return compiled, plan, time.perf_counter() - t0
  config = zerojax.ZeroConfig(stage=stage)
  mesh = zerojax.make_mesh(config, devices=list(devices))
  data = batches(size, pattern, 1)[0]
  tx = make_tx()
  t0 = time.perf_counter()
  if pattern in ("e", "f"):
    from flax import nnx
    model, opt, plan = abstract_nnx(lambda: _nnx_model(size, pattern, nnx.Rngs(0)), tx,
                                    config=config, mesh=mesh)

    def nnx_step(model, optimizer, batch):
      def lf(model, batch):
        return loss_of(pattern, model(batch["x"]), batch["y"])
      loss, grads = zerojax.value_and_grad(lf)(model, batch)
      optimizer.update(model, grads)
      return {"loss": loss}
    batch = _abstract(data, plan.batch(data))
    compiled = zerojax.zero_step(plan)(nnx_step).lower(model, opt, batch).compile()
    return compiled, plan, time.perf_counter() - t0
  model = _linen_models(size)[pattern]
  x0 = jax.ShapeDtypeStruct(data["x"].shape, data["x"].dtype)
  state, plan = abstract_train_state(model, tx, jax.random.key(0), x0, config=config, mesh=mesh)
  apply = ((lambda state, p, x: model.apply({"params": p}, x)) if pattern == "h"
           else (lambda state, p, x: state.apply_fn({"params": p}, x)))

  def train_step(state, batch):
    def lf(p, batch):
      return loss_of(pattern, apply(state, p, batch["x"]), batch["y"])
    loss, grads = zerojax.value_and_grad(lf)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}
  batch = _abstract(data, plan.batch(data))
  compiled = zerojax.zero_step(plan)(train_step).lower(state, batch).compile()
  return compiled, plan, time.perf_counter() - t0


def target_baseline(pattern: str, size: Size, devices, style: str = "hand"
                    ) -> tuple[Any, float]:
  """``(compiled, seconds)``: the hand-written (``'hand'``) or MaxText-style (``'maxtext'``:
  weights sharded on their ``d_model`` dimension, the batch dimension of every input and of
  the model's output constrained to ``fsdp``) FSDP step compiled for ``devices``."""
  import jax
  import numpy as np
  import optax
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
  n = len(devices)
  mesh = Mesh(np.asarray(devices), ("fsdp",), axis_types=(AxisType.Auto,))

  def spec(shape):
    if style == "maxtext":
      for d in range(len(shape) - 1, -1, -1):
        if shape[d] == size.d_model and size.d_model % n == 0:
          return P(*[("fsdp" if i == d else None) for i in range(len(shape))])
    return _fsdp_spec(shape, n)
  shard = lambda tree: jax.tree.map(lambda x: NamedSharding(mesh, spec(np.shape(x))), tree)
  data = batches(size, pattern, 1)[0]
  batch_sh = NamedSharding(mesh, P("fsdp"))
  on_batch = lambda y: (jax.lax.with_sharding_constraint(
      y, NamedSharding(mesh, P("fsdp", *([None] * (y.ndim - 1))))) if style == "maxtext" else y)
  tx = make_tx()
  key = jax.random.key(0)
  if pattern in ("e", "f"):
    from flax import nnx
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: (lambda m: (m, nnx.Optimizer(m, tx, wrt=nnx.Param)))(
            _nnx_model(size, pattern, nnx.Rngs(0)))))
    state_sh = shard(state)

    def step(state, batch):
      m, o = nnx.merge(graphdef, state)
      loss, grads = nnx.value_and_grad(
          lambda m: loss_of(pattern, on_batch(m(batch["x"])), batch["y"]))(m)
      o.update(m, grads)
      return nnx.state((m, o)), loss
  else:
    if pattern == "g":
      p0 = jax.eval_shape(lambda: _pytree_init(size, key))
      apply = _pytree_apply
    else:
      model = _linen_models(size)[pattern]
      p0 = jax.eval_shape(model.init, key, jax.ShapeDtypeStruct(data["x"].shape,
                                                                data["x"].dtype))["params"]
      apply = lambda p, x: model.apply({"params": p}, x)
    state = (p0, jax.eval_shape(tx.init, p0))
    state_sh = shard(state)

    def step(state, batch):
      p, o = state
      loss, g = jax.value_and_grad(lambda p: loss_of(
          pattern, on_batch(apply(p, batch["x"])), batch["y"]))(p)
      u, o = tx.update(g, o, p)
      return (optax.apply_updates(p, u), o), loss
  f = jax.jit(step, in_shardings=(state_sh, batch_sh),
              out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=(0,))
  t0 = time.perf_counter()
  compiled = f.lower(_abstract(state, state_sh),
                     _abstract(data, jax.tree.map(lambda _: batch_sh, data))).compile()
  return compiled, time.perf_counter() - t0


def target_table(target: str, size: Size, pats, stages=(3,)) -> str:
  """The conformance table compiled for an accelerator (``--target``)."""
  from zerojax.runtime import gpu, memory
  devices = list((gpu.gpu_topology(target) if gpu.is_gpu_topology(target)
                  else memory.tpu_topology(target)).devices)
  mib = lambda b: f"{b / 2**20:.1f}"
  head = ("| pattern | step | temp MiB | peak MiB | collectives MiB | × textbook | "
          "all-gather / reduce-scatter with a matmul | activation collectives MiB | compile s |")
  lines = [head, "|" + "---|" * 9]
  for pat in pats:
    rows = []
    plan3 = None
    for stage in stages:
      compiled, plan, secs = target_zero(pat, size, stage, devices)
      plan3 = plan3 or plan
      rows.append((f"zerojax stage {stage}", compiled, plan, secs))
    for style in ("hand", "maxtext"):
      compiled, secs = target_baseline(pat, size, devices, style)
      rows.append((f"{style}-written FSDP" if style == "hand" else "MaxText-style FSDP",
                   compiled, None, secs))
    for name, compiled, plan, secs in rows:
      text, m = compiled.as_text(), memory.measure(compiled)
      book = memory.textbook_bytes(plan or plan3)
      ag = memory.collective_schedule(text, "all-gather")
      rs = memory.collective_schedule(text, "reduce-scatter")
      act = sum(memory.activation_collectives(text, plan or plan3).values())
      lines.append(f"| {pat} {DESCRIPTIONS[pat]} | {name} | {mib(m.temp)} | {mib(m.peak)} | "
                   f"{mib(m.collective_total)} | {m.collective_total / book:.2f} | "
                   f"{ag.matmul_share:.0%} / {rs.matmul_share:.0%} | {mib(act)} | {secs:.1f} |")
      print(lines[-1], flush=True)
  return "\n".join(lines)


def _fsdp_spec(shape, n):
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
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
  devices = jax.devices() if devices is None else devices
  n = len(devices)
  mesh = Mesh(np.asarray(devices), ("fsdp",), axis_types=(AxisType.Auto,))
  shard = lambda tree: jax.tree.map(
      lambda x: NamedSharding(mesh, _fsdp_spec(np.shape(x), n)), tree)
  data = batches(size, pattern, 1)
  batch_sh = NamedSharding(mesh, P("fsdp"))
  tx = make_tx()
  if pattern in ("e", "f"):
    from flax import nnx
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: (lambda m: (m, nnx.Optimizer(m, tx, wrt=nnx.Param)))(
            _nnx_model(size, pattern, nnx.Rngs(0)))))
    state_sh = shard(state)

    @nnx.jit
    def init():
      m = _nnx_model(size, pattern, nnx.Rngs(0))
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
    if pattern == "g":
      p0 = _pytree_init(size, jax.random.key(0))
      apply = _pytree_apply
    else:
      model = _linen_models(size)[pattern]
      p0 = model.init(jax.random.key(0), jnp.asarray(data[0]["x"]))["params"]
      apply = lambda p, x: model.apply({"params": p}, x)
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


def reference_losses(pattern: str, size: Size, steps: int) -> tuple[list[float], Any]:
  """The same training on one device, no sharding at all: losses and final params."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  dev = jax.devices()[0]
  data = batches(size, pattern, steps)
  tx = make_tx()
  with jax.default_device(dev):
    if pattern in ("e", "f"):
      from flax import nnx
      model = _nnx_model(size, pattern, nnx.Rngs(0))
      opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

      @nnx.jit
      def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(
            lambda m: loss_of(pattern, m(batch["x"]), batch["y"]))(model)
        opt.update(model, grads)
        return loss
      losses = [float(step(model, opt, jax.device_put(b, dev))) for b in data]
      return losses, jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    if pattern == "g":
      p = _pytree_init(size, jax.random.key(0))
      apply = _pytree_apply
    else:
      model = _linen_models(size)[pattern]
      p = model.init(jax.random.key(0), jnp.asarray(data[0]["x"]))["params"]
      apply = lambda p, x: model.apply({"params": p}, x)
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


# -- the benchmark ----------------------------------------------------------------------------


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", choices=("full", "small"), default="full")
  p.add_argument("--patterns", default=",".join(PATTERNS),
                 help=f"comma-separated subset of {','.join(PATTERNS)}")
  p.add_argument("--steps", type=int, default=6, help="timed steps per variant (alternating)")
  p.add_argument("--target", default=None,
                 help="compile ahead of time for this accelerator instead of running on CPU: "
                 "a GPU pod (h100:8) or TPU slice (v5e:2x4)")
  p.add_argument("--stages", default="3", help="with --target: comma-separated stages")
  args = p.parse_args(argv)
  pats = [x.strip() for x in args.patterns.split(",") if x.strip()]
  bad = [x for x in pats if x not in PATTERNS]
  if bad:
    p.error(f"--patterns: unknown {bad}; allowed are {', '.join(PATTERNS)}")
  if args.steps < 2:
    p.error(f"--steps={args.steps} is invalid: needs an integer >= 2 (the first is warm-up)")
  size = FULL if args.size == "full" else SMALL
  if args.target:
    import os
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    stages = tuple(int(x) for x in args.stages.split(","))
    print(f"size {size}; compiled for {args.target}", flush=True)
    print(target_table(args.target, size, pats, stages))
    return 0
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  from zerojax.runtime.memory import measure
  mib = lambda b: f"{b / 2**20:.1f}"
  print(f"size {size}; 8 simulated CPU devices; {jax.__version__=}", flush=True)
  header = ("| pattern | stage | temp MiB | × baseline | peak MiB | collectives MiB | "
            "Δloss | Δparams | time × baseline |")
  lines = [header, "|" + "---|" * 9]
  for pat in pats:
    t0 = time.time()
    variants: dict[str, Runner] = {"baseline": baseline_runner(pat, size)}
    for stage in range(4):
      variants[f"stage {stage}"] = zero_runner(pat, size, stage)
    g_bytes = sum(lp.nbytes for lp in variants["stage 3"].plan.leaves)
    ref_losses, ref_params = reference_losses(pat, size, args.steps)
    data = batches(size, pat, args.steps)
    times = {k: [] for k in variants}
    losses = {k: [] for k in variants}
    for b in data:  # alternate: one step of every variant per round
      for k, r in variants.items():
        s = time.perf_counter()
        losses[k].append(r.step(b))
        times[k].append(time.perf_counter() - s)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    base = measure(variants["baseline"].compiled)
    for k, r in variants.items():
      m = measure(r.compiled)
      dl = max(abs(x - y) for x, y in zip(losses[k], ref_losses))
      dp = max_diff(r.params(), ref_params)
      lines.append(
          f"| {pat} {DESCRIPTIONS[pat]} | {k.replace('stage ', '')} | {mib(m.temp)} | "
          f"{m.temp / base.temp:.2f} | {mib(m.peak)} | {mib(m.collective_total)} | "
          f"{dl:.1e} | {dp:.1e} | {med[k] / med['baseline']:.2f} |")
      print(lines[-1], flush=True)
    s1, s2 = measure(variants["stage 1"].compiled), measure(variants["stage 2"].compiled)
    print(f"  {pat}: G = {mib(g_bytes)} MiB; stage-2 temp {mib(s2.temp)} <= stage-1 temp "
          f"{mib(s1.temp)} - 0.75·G·7/8 = {mib(s1.temp - 0.75 * g_bytes * 7 / 8)}: "
          f"{s2.temp <= s1.temp - 0.75 * g_bytes * 7 / 8}; {time.time() - t0:.0f} s", flush=True)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
