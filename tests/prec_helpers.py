"""Runs shared by the issue-7 tests (accumulation, clipping, precision, loss scaling, metrics).

Every run is cached for the whole session (``functools.cache``), so each configuration is
compiled once however many test files read it. The references are unsharded: one device, a
plain ``jax.jit``, plain ``jax.value_and_grad`` and, for clipping, the optax transformation
an unsharded user would chain in front of the optimizer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import zerojax
from zerojax.models import GPT, loss_fn  # noqa: F401
from tests import helpers

CFG = helpers.TINY
ACCUM = 2  # micro-batches per step: batch 16 = 1 row/device x 2 micro-batches x 8 devices
CLIP = 1.0  # below every step's gradient norm (~1.2-1.3): clipping is active on every step
ACC_STEPS = 4
LR = 1e-3


def adamw():
  # inject_hyperparams exposes the learning rate to the step metrics.
  return optax.inject_hyperparams(optax.adamw)(learning_rate=LR, eps=1e-6, weight_decay=0.1)


def sgd():
  # Updates proportional to the gradient: low-precision parity is judged on update directions
  # without Adam's normalisation amplifying rounding noise of near-zero gradients.
  return optax.sgd(0.5, momentum=0.9)


def plain_step(state, batch):
  def lf(params):
    return loss_fn(state.apply_fn({"params": params}, batch["x"]), batch["y"]) * batch["mult"]
  loss, grads = jax.value_and_grad(lf)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss, "grad_norm": optax.tree.norm(grads)}


def zero_train_step(state, batch):
  """The user's step with zerojax: only ``value_and_grad`` differs from `plain_step`."""
  def lf(params, b):
    return loss_fn(state.apply_fn({"params": params}, b["x"]), b["y"]) * b["mult"]
  loss, grads = zerojax.value_and_grad(lf)(state.params, batch)
  return state.apply_gradients(grads=grads), {"loss": loss}


def data(n, mults=None):
  out = helpers.batches(CFG, n)
  mults = mults or [1.0] * n
  return [dict(b, mult=np.float32(m)) for b, m in zip(out, mults)]


def _params0(model, x):
  # jitted: an eager init dispatches (and compiles) op by op, which costs more than the step.
  return jax.jit(lambda k, x: model.init(k, x)["params"])(jax.random.key(0), jnp.asarray(x))


def abstract_state_and_plan(zc, state_cls=None, tx=None):
  """A plan and the *shapes* of a train state: enough to trace (and refuse) a step cheaply."""
  model, tx = GPT(CFG), tx or sgd()
  x = jnp.zeros((16, CFG.seq_len), jnp.int32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), x)["params"])
  plan = zerojax.ShardingPlan.create(zc, zerojax.make_mesh(zc), shapes, tx)
  state_cls = state_cls or zerojax.ZeroTrainState
  kw = {"config": zc} if issubclass(state_cls, zerojax.ZeroTrainState) else {}
  state = jax.eval_shape(lambda: state_cls.create(
      apply_fn=model.apply, params=jax.tree.map(jnp.zeros_like, shapes), tx=tx, **kw))
  return state, plan


@dataclasses.dataclass
class Result:
  metrics: list  # per step: dict of floats
  params: object  # numpy tree after the last step
  params0: object = None  # numpy tree before the first step
  state: object = None
  plan: object = None
  step: object = None
  opt_state: list = None  # numpy opt_state after each step (when asked)
  params_each: list = None  # numpy params after each step (when asked)


def _np(tree):
  return jax.tree.map(np.asarray, tree)


@functools.cache
def accumulation_reference() -> Result:
  """One device, the whole 16-row batch per step, clip-by-global-norm chained before AdamW."""
  dev = jax.devices()[0]
  model, batches = GPT(CFG), data(ACC_STEPS)
  with jax.default_device(dev):
    tx = optax.chain(optax.clip_by_global_norm(CLIP), adamw())
    state = train_state.TrainState.create(apply_fn=model.apply,
                                          params=_params0(model, batches[0]["x"]), tx=tx)
    step, ms = jax.jit(plain_step), []
    for b in batches:
      state, m = step(state, jax.device_put(b, dev))
      ms.append({k: float(v) for k, v in m.items()})
  return Result(ms, _np(state.params))


@functools.cache
def accumulation_run(stage: int, gather: str = "auto") -> Result:
  """8 devices, ``ACCUM`` micro-batches per step, ``gradient_clipping=CLIP``."""
  model, batches = GPT(CFG), data(ACC_STEPS)
  zc = zerojax.ZeroConfig(stage=stage, gather=zerojax.Gather(
      gather, persistence_threshold=helpers.THRESHOLD), batch=zerojax.Batch(
          micro_per_device=1, accumulation_steps=ACCUM), gradient_clipping=CLIP)
  state, plan = zerojax.create_train_state(model, adamw(), jax.random.key(0),
                                           jnp.asarray(batches[0]["x"]), config=zc)
  step, ms = zerojax.zero_step(plan)(zero_train_step), []
  for b in batches:
    state, m = step(state, b)
    ms.append({k: float(v) for k, v in m.items()})
  return Result(ms, _np(state.params), state=state, plan=plan, step=step)


# -- low precision ------------------------------------------------------------------------------

BF16 = dataclasses.replace(CFG, dtype=jnp.bfloat16)  # Flax dtype=bf16, param_dtype=float32
FP16 = dataclasses.replace(CFG, dtype=jnp.float16)
LP_STEPS = 3
# Loss scaling: steps 3 and 4 overflow in fp16 (the loss is multiplied by 1e6, so the scaled
# activation cotangents exceed fp16's 65504).
LS_MULTS = [1.0, 1.0, 1e6, 1e6, 1.0]
LS_CONFIG = dict(loss_scale=0, initial_scale_power=8, loss_scale_window=2, hysteresis=2,
                 min_loss_scale=1.0)


def _low_precision_reference(cfg, mults, config=None) -> Result:
  """One device, the same low-precision model; loss scaling via the same `ZeroTrainState`
  (``zerojax.value_and_grad`` with an explicit scale is plain ``jax.value_and_grad`` here)."""
  dev = jax.devices()[0]
  model, batches = GPT(cfg), data(len(mults), mults)
  with jax.default_device(dev):
    p0 = _params0(model, batches[0]["x"])
    if config is None:
      state = train_state.TrainState.create(apply_fn=model.apply, params=p0, tx=sgd())
      fn = plain_step
    else:
      state = zerojax.ZeroTrainState.create(apply_fn=model.apply, params=p0, tx=sgd(),
                                            config=config)

      def fn(state, batch):
        def lf(params):
          logits = state.apply_fn({"params": params}, batch["x"])
          return loss_fn(logits, batch["y"]) * batch["mult"]
        loss, grads = zerojax.value_and_grad(lf, loss_scale=state.loss_scale)(state.params)
        state = state.apply_gradients(grads=grads)
        return state, {"loss": loss, **state.step_metrics()}
    step, ms, each = jax.jit(fn), [], []
    for b in batches:
      state, m = step(state, jax.device_put(b, dev))
      ms.append({k: float(v) for k, v in m.items()})
      each.append(_np(state.params))
  return Result(ms, _np(state.params), _np(p0), params_each=each)


def _low_precision_run(cfg, stage, mults, **config_kw) -> Result:
  model, batches = GPT(cfg), data(len(mults), mults)
  zc = zerojax.ZeroConfig.from_flat(dict(
      stage=stage, param_persistence_threshold=helpers.THRESHOLD,
      compute_dtype=jnp.dtype(cfg.dtype or jnp.float32).name, **config_kw))
  state, plan = zerojax.create_train_state(model, sgd(), jax.random.key(0),
                                           jnp.asarray(batches[0]["x"]), config=zc)
  p0 = _np(state.params)
  step, ms, opts, each = zerojax.zero_step(plan)(zero_train_step), [], [], []
  for b in batches:
    state, m = step(state, b)
    ms.append({k: float(v) for k, v in m.items()})
    opts.append(_np(state.opt_state))
    each.append(_np(state.params))
  return Result(ms, _np(state.params), p0, state, plan, step, opts, each)


@functools.cache
def bf16_reference() -> Result:
  return _low_precision_reference(BF16, [1.0] * LP_STEPS)


@functools.cache
def bf16_run() -> Result:
  """Stage 2, bf16 compute, fp32 master params and optimizer state, bf16 gradient reduction."""
  return _low_precision_run(BF16, 2, [1.0] * LP_STEPS, reduce_dtype="bfloat16")


@functools.cache
def fp16_reference() -> Result:
  zc = zerojax.ZeroConfig.from_flat(dict(stage=0, **LS_CONFIG))
  return _low_precision_reference(FP16, LS_MULTS, zc)


@functools.cache
def fp16_run() -> Result:
  """Stage 3, fp16 compute, fp16 gradient reduction, dynamic loss scaling."""
  return _low_precision_run(FP16, 3, LS_MULTS, reduce_dtype="float16", **LS_CONFIG)


def relative_update_error(run: Result, ref: Result, i: int | None = None) -> float:
  """``|Δrun - Δref| / |Δref|`` of the parameter change from the start (after step ``i``)."""
  a = run.params if i is None else run.params_each[i]
  b = ref.params if i is None else ref.params_each[i]
  da = jax.tree.leaves(jax.tree.map(lambda x, y: x - y, a, run.params0))
  db = jax.tree.leaves(jax.tree.map(lambda x, y: x - y, b, ref.params0))
  num = sum(float(np.sum((x - y) ** 2)) for x, y in zip(da, db))
  den = sum(float(np.sum(y ** 2)) for y in db)
  return (num / den) ** 0.5
