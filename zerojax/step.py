"""The train-step decorator and sharded state creation.

``@zero_step(plan)`` turns a plain ``train_step(state, batch) -> (state, metrics)`` into a jitted
step whose input/output shardings come from the plan, whose state buffers are donated, and whose
batch is split over every data-parallel axis. Inside, ``state.apply_fn`` is wrapped so every
parameter is gathered just in time and its gradient leaves the backward pass in the stage's
layout (see `zerojax.gather`). The user's code is unchanged.

For Flax NNX the same decorator takes ``train_step(model, optimizer, batch) -> metrics`` that
updates ``model``/``optimizer`` in place, as under ``nnx.jit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.core import meta
from flax.training import train_state as ts

from zerojax import context, memory, offload
from zerojax.config import ConfigError, ZeroConfig
from zerojax.gather import box_params, regather_layers, remat_policy, remat_scan_bodies
from zerojax.mesh import make_mesh
from zerojax.plan import ShardingPlan
from zerojax.grad import accumulation_steps, check_batch
from zerojax.train_state import ZeroTrainState

PyTree = Any


def wrap_apply_fn(apply_fn: Callable, plan: ShardingPlan) -> Callable:
  """``apply_fn`` with ZeRO gathering (and the stage's remat policy) around the model."""
  policy = remat_policy(plan.config)
  treedef = jax.tree.structure(plan.params)
  warned = []
  has_scan: list[bool] = []  # decided on the first trace

  @functools.wraps(apply_fn)
  def apply(variables, *args, **kwargs):
    params = variables.get("params") if hasattr(variables, "get") else None
    if params is None or jax.tree.structure(params) != treedef:
      if not warned:
        warned.append(True)
        warnings.warn("zerojax: apply_fn was called with variables whose 'params' do not match "
                      "the plan's tree; parameters are not gathered per layer for this call")
      return apply_fn(variables, *args, **kwargs)

    def run(params):
      boxed = dict(variables)
      boxed["params"] = box_params(params, plan)
      return apply_fn(boxed, *args, **kwargs)

    # The policy must act inside every scanned layer: remat around a scan recomputes all of
    # its residuals in one extra pass and stacks them, which would bring back every layer's
    # gathered weights at once. A whole-model checkpoint on top would even override the
    # per-layer policy (measured: its residuals are saved again), so it is used only for models
    # without scans, where it is the only place the policy can act.
    live = plan.config.max_live_layers
    if not has_scan:
      seen: list = []
      with remat_scan_bodies(policy, live, seen):
        jax.eval_shape(run, params)  # a trace only: does the model scan its layers?
      has_scan.append(bool(seen))
    # Stage 3 without scans: nothing orders the layers' gathers but data dependencies, so each
    # layer gathers after its input and re-gathers after its output's cotangent
    # (`regather_layers`). A scan's loop already runs one layer at a time; there the extra
    # custom_vjp would only add a gather per layer under a recomputing remat policy (measured:
    # all-gather 2.5Ψ instead of 1.86Ψ with remat='full').
    layers = (nn.intercept_methods(regather_layers)
              if plan.config.stage == 3 and not has_scan[0] else contextlib.nullcontext())
    with remat_scan_bodies(policy, live), layers:
      return run(params) if has_scan[0] else jax.checkpoint(run, policy=policy)(params)

  return apply


def compiler_options(plan: ShardingPlan) -> dict[str, str] | None:
  """XLA options the stage needs on this backend.

  At stages 2-3 each layer's gradient must be reduce-scattered as soon as it exists. XLA's
  CPU backend merges all gradient all-reduces of an unscanned model into one combined op,
  which keeps every layer's full gradient alive until the end of the backward pass (GPU
  backends bound this with ``--xla_gpu_*_combine_threshold_bytes``, DeepSpeed's
  ``reduce_bucket_size``). There is no threshold on CPU, so the combiner is turned off. At
  stage 1 it would merge the once-per-step reduction of every leaf into one op whose output
  (full size: XLA:CPU lowers reduce-scatter as all-reduce) coexists with the local gradient,
  which measured 2G of temporaries instead of G.
  """
  platform = next(iter(plan.mesh.devices.flat)).platform
  if plan.config.stage >= 1 and platform == "cpu":
    return {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
  return None


class ZeroStep:
  """A jitted ZeRO train step; create it with `zero_step`."""

  def __init__(self, fn: Callable, plan: ShardingPlan, donate: bool = True):
    functools.update_wrapper(self, fn)
    self.fn, self.plan, self.donate = fn, plan, donate
    self._jitted: dict[Any, Any] = {}
    self._last_dispatch: float | None = None
    self.last_step_time = math.nan  # see __call__

  # -- linen / TrainState ---------------------------------------------------------------------

  def _linen(self, state, batch):
    plan = self.plan
    key = (jax.tree.structure(state), _shapes_key(batch))
    if key not in self._jitted:
      orig = state.apply_fn
      _check_state_features(plan, state)
      check_batch(plan, batch)

      orig_tx = getattr(state, "tx", None)

      def step(state, batch):
        changes = {"apply_fn": wrap_apply_fn(orig, plan)}
        if orig_tx is not None:
          changes["tx"] = offload.wrap_tx(orig_tx, plan)
        state = state.replace(**changes)
        with _step_context(plan, state) as ctx:
          new_state, metrics = self.fn(state, batch)
        _check_features_used(ctx)
        if not isinstance(new_state, type(state)):
          raise TypeError(f"train_step must return (state, metrics); got {type(new_state)}")
        if isinstance(new_state, ZeroTrainState) and isinstance(metrics, dict):
          metrics = {**new_state.step_metrics(), **metrics}
        restore = {"apply_fn": orig} if orig_tx is None else {"apply_fn": orig, "tx": orig_tx}
        return new_state.replace(**restore), metrics

      state_sh = plan.state(state)
      self._jitted[key] = jax.jit(
          step, in_shardings=(state_sh, plan.batch(batch)),
          out_shardings=(state_sh, plan.replicated),
          donate_argnums=(0,) if self.donate else (),
          compiler_options=compiler_options(plan))
    return self._jitted[key]

  # -- NNX ------------------------------------------------------------------------------------

  def _nnx(self, model, optimizer, batch):
    from flax import nnx
    graphdef, state = nnx.split((model, optimizer))
    key = (graphdef, _shapes_key(batch))
    if key not in self._jitted:
      plan = self.plan
      state_sh = nnx_state_shardings(plan, state)

      _check_state_features(plan, None)
      check_batch(plan, batch)

      def step(state, batch):
        m, o = nnx.merge(graphdef, state)
        with _step_context(plan, None) as ctx:
          metrics = self.fn(m, o, batch)
        _check_features_used(ctx)
        return nnx.state((m, o)), metrics

      self._jitted[key] = jax.jit(
          step, in_shardings=(state_sh, plan.batch(batch)),
          out_shardings=(state_sh, plan.replicated),
          donate_argnums=(0,) if self.donate else (),
          compiler_options=compiler_options(plan))
    return self._jitted[key], state

  def __call__(self, *args):
    """Runs one step. Metrics gain host-side ``step_time`` and ``tokens_per_sec``.

    Both come from dispatch times, not from device timers, so the hot path never waits for the
    device: ``step_time`` is the wall time between the returns of the previous and of this
    call. JAX dispatch is asynchronous, so this interval measures the device's step time once
    the loop is device-bound (the steady state of any training loop that reads a metric or
    feeds data); it is ``nan`` for the first call and for any call that compiled.
    ``tokens_per_sec`` is the batch's tokens (rows × sequence length of the first batch leaf
    with two or more dimensions, rows otherwise) divided by ``step_time``.
    """
    n = len(self._jitted)
    if len(args) == 3:  # NNX: (model, optimizer, batch)
      from flax import nnx
      f, state = self._nnx(*args)
      if len(self._jitted) != n:
        _check_step_memory(self.plan, f, state, args[2])
      new_state, metrics = f(state, args[2])
      nnx.update((args[0], args[1]), new_state)
      return self._host_metrics(metrics, args[2], compiled=len(self._jitted) != n)
    state, batch = args
    f = self._linen(state, batch)
    if len(self._jitted) != n:  # first call with these shapes: check memory before it allocates
      _check_step_memory(self.plan, f, state, batch, params=state.params,
                         tx=getattr(state, "tx", None), opt_state=getattr(state, "opt_state", None))
    new_state, metrics = f(state, batch)
    return new_state, self._host_metrics(metrics, batch, compiled=len(self._jitted) != n)

  def _host_metrics(self, metrics, batch, compiled):
    now = time.perf_counter()
    last, self._last_dispatch = self._last_dispatch, now
    dt = math.nan if (compiled or last is None) else now - last
    self.last_step_time = dt
    if not isinstance(metrics, dict):
      return metrics
    metrics = dict(metrics)
    metrics.setdefault("step_time", dt)
    metrics.setdefault("tokens_per_sec", _tokens(batch) / dt if dt == dt and dt > 0 else math.nan)
    return metrics

  def lower(self, *args):
    """Lowers the step for ``args`` (arrays or ShapeDtypeStructs), e.g. to inspect memory."""
    if len(args) == 3:
      f, state = self._nnx(*args)
      return f.lower(state, args[2])
    state, batch = args
    return self._linen(state, batch).lower(state, batch)


def zero_step(plan: ShardingPlan, *, donate: bool = True) -> Callable[[Callable], ZeroStep]:
  """Decorates a plain train step with the ZeRO stage of ``plan``.

  Example::

    @zerojax.zero_step(plan)
    def train_step(state, batch):
      def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}

  Args:
    plan: the `ShardingPlan`; its shardings become the step's in/out shardings.
    donate: donate the state's buffers to the step (it is updated in place).
  """
  if not isinstance(plan, ShardingPlan):
    raise TypeError(f"zero_step(plan) needs a zerojax.ShardingPlan, got {type(plan).__name__}")
  accumulation_steps(plan.config, plan.data_parallel_size)  # inconsistent batch sizes fail here
  return lambda fn: ZeroStep(fn, plan, donate)


# -- what the traced step knows (issue 7: accumulation, loss scaling, metrics) ------------------


def _step_context(plan: ShardingPlan, state: Any):
  """The `zerojax.context` of one trace: plan, accumulation steps, the input's loss scale."""
  scale = None
  if isinstance(state, ZeroTrainState) and state.settings.scaling:
    scale = state.loss_scale
  return context.active(context.StepContext(
      plan, accumulation_steps(plan.config, plan.data_parallel_size), scale))


def _check_state_features(plan: ShardingPlan, state: Any) -> None:
  """Clipping and loss scaling live in `ZeroTrainState`; refuse a state that would ignore them."""
  cfg = plan.config
  wanted = [f"{k}={getattr(cfg, k)!r}" for k in ("gradient_clipping", "loss_scale")
            if getattr(cfg, k) is not None]
  if wanted and not isinstance(state, ZeroTrainState):
    kind = "an NNX step" if state is None else f"a {type(state).__name__}"
    raise ConfigError(f"{', '.join(wanted)} needs a zerojax.ZeroTrainState (create it with "
                      f"zerojax.create_train_state); {kind} would silently ignore it")


def _check_features_used(ctx: context.StepContext) -> None:
  if ctx.grad_calls:
    return
  cfg = ctx.plan.config
  if ctx.accumulation_steps > 1 or ctx.loss_scale is not None:
    raise ConfigError(
        f"gradient_accumulation_steps={ctx.accumulation_steps}, loss_scale={cfg.loss_scale!r}: "
        "the train step must compute its gradient with zerojax.value_and_grad(loss_fn)"
        "(params, batch) (a drop-in for jax.value_and_grad; linen TrainState steps), else "
        "the accumulation/loss scaling would silently not happen")


def _tokens(batch: Any) -> int:
  shapes = [np.shape(x) for x in jax.tree.leaves(batch) if np.ndim(x) >= 1]
  for s in shapes:
    if len(s) >= 2:
      return s[0] * s[1]
  return shapes[0][0] if shapes else 0


# -- memory check before the first step (issue 15 item 7) ---------------------------------------


def _check_step_memory(plan: ShardingPlan, jitted: Any, *args: Any, **suggest: Any) -> None:
  """Compiles the step ahead of its first call and compares its peak per device with the
  devices' memory limit (`zerojax.memory.check_fits`), so a step that cannot fit fails with
  the numbers and a suggestion instead of ``RESOURCE_EXHAUSTED``. Backends that report no
  limit (CPU) skip it: nothing is compiled twice there."""
  devices = list(plan.mesh.devices.flat)
  if memory.bytes_limit(devices) is None:
    return
  compiled = jitted.lower(*args).compile()  # the call after it reuses JAX's compilation cache
  memory.check_fits(compiled, devices, config=plan.config, **suggest)


# -- state creation -----------------------------------------------------------------------------


def create_train_state(model: Any, tx: Any, rng: jax.Array, *init_args: Any,
                       config: ZeroConfig, mesh: jax.sharding.Mesh | None = None,
                       state_cls: type | None = None, **init_kwargs: Any
                       ) -> tuple[ts.TrainState, ShardingPlan]:
  """Initialises a linen model's train state directly in its sharded layout.

  The init function is jitted with the plan's output shardings, so each device only ever
  computes and holds its own shards: the full parameters never exist on one device (the
  equivalent of ``deepspeed.zero.Init``).

  ``state_cls`` defaults to `zerojax.ZeroTrainState` (gradient clipping, loss scaling and step
  metrics from ``config``); a `ZeroTrainState` subclass gets ``config=config`` at creation.
  Inconsistent batch sizes in ``config`` fail here, before any device work.

  Returns:
    ``(state, plan)``.
  """
  make_state, plan, abstract = state_initializer(model, tx, rng, *init_args, config=config,
                                                 mesh=mesh, state_cls=state_cls, **init_kwargs)
  # A state too big for the devices fails here, named, not as RESOURCE_EXHAUSTED in the init.
  memory.check_state_fits(plan, params=getattr(abstract, "params", None), tx=tx)
  state = jax.jit(make_state, out_shardings=plan.state(abstract))(rng, *init_args)
  return state, plan


def state_initializer(model: Any, tx: Any, rng: jax.Array, *init_args: Any,
                      config: ZeroConfig, mesh: jax.sharding.Mesh | None = None,
                      state_cls: type | None = None, **init_kwargs: Any):
  """``(make_state, plan, abstract_state)``: the pieces `create_train_state` and a checkpoint
  restore target (`zerojax.checkpoint.abstract_train_state`) share. Nothing is allocated."""
  mesh = make_mesh(config) if mesh is None else mesh
  pdtype = jnp.dtype(config.param_dtype)
  state_cls = ZeroTrainState if state_cls is None else state_cls
  extra = {"config": config} if issubclass(state_cls, ZeroTrainState) else {}

  def init_params(rng, *args):
    variables = model.init(rng, *args, **init_kwargs)
    return variables["params"]

  boxed = jax.eval_shape(init_params, rng, *init_args)
  plan = ShardingPlan.create(config, mesh, _cast_shapes(boxed, pdtype), tx)
  accumulation_steps(config, plan.data_parallel_size)  # inconsistent batch sizes fail here

  def make_state(rng, *args):
    params = _cast(meta.unbox(init_params(rng, *args)), pdtype)
    return state_cls.create(apply_fn=model.apply, params=params, tx=tx, **extra)

  return make_state, plan, jax.eval_shape(make_state, rng, *init_args)


def create_nnx(model_fn: Callable[[], Any], tx: Any, *, config: ZeroConfig,
               mesh: jax.sharding.Mesh | None = None, wrt: Any = None):
  """Builds an NNX ``(model, optimizer)`` directly in its sharded layout.

  Args:
    model_fn: a no-argument function returning the ``nnx.Module`` (it is traced, not run
      eagerly, so the full parameters never materialise on one device).
    tx: the optax transformation.

  Returns:
    ``(model, optimizer, plan)``.
  """
  from flax import nnx
  mesh = make_mesh(config) if mesh is None else mesh
  wrt = nnx.Param if wrt is None else wrt

  def build():
    model = model_fn()
    return model, nnx.Optimizer(model, tx, wrt=wrt)

  with jax.set_mesh(mesh):  # lets nnx.with_partitioning metadata resolve its mesh
    abs_model, abs_opt = nnx.eval_shape(build)
  params = nnx.state(abs_model, wrt)
  plan = ShardingPlan.create(config, mesh, params, opt_state=_nnx_values(abs_opt.opt_state))
  graphdef, abs_state = nnx.split((abs_model, abs_opt))
  shardings = nnx_state_shardings(plan, abs_state)

  @functools.partial(jax.jit, out_shardings=shardings)
  def init():
    return nnx.state(build())

  with jax.set_mesh(mesh):
    model, optimizer = nnx.merge(graphdef, init())
  return model, optimizer, plan


def nnx_state_shardings(plan: ShardingPlan, state: Any) -> Any:
  """Shardings for ``nnx.state((model, optimizer))``: params and optimizer state from the
  plan (matched by path), everything else (step counters, RNG state) replicated."""
  from zerojax.plan import _key_tuple
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  p_flat = jax.tree.leaves(plan.params)
  o_flat = jax.tree.leaves(plan.opt_state) if plan.opt_state is not None else []
  p_paths = [lp.path.split("/") for lp in plan.leaves]
  o_paths = [o[0].split("/") for o in plan.opt_leaves]
  out = []
  for kp, x in flat:
    keys = list(_key_tuple(kp))
    sh = None
    if keys[:1] == ["0"]:  # the model
      sh = _match(keys[1:], p_paths, p_flat)
    elif keys[:1] == ["1"] and "opt_state" in keys:
      sh = _match(keys[keys.index("opt_state") + 1:], o_paths, o_flat)
    out.append(sh if sh is not None else plan.replicated)
  return jax.tree_util.tree_unflatten(treedef, out)


def _match(keys, paths, shardings):
  keys = [k for k in keys if k != "value"]
  for p, s in zip(paths, shardings):
    if [k for k in p if k != "value"] == keys:
      return s
  return None


def _nnx_values(tree):
  from flax import nnx
  return jax.tree.map(lambda x: x.get_value() if isinstance(x, nnx.Variable) else x, tree,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def _cast(tree, dtype):
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _cast_shapes(tree, dtype):
  def one(x):
    if isinstance(x, meta.AxisMetadata):
      return x.replace_boxed(one(x.unbox()))
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jax.ShapeDtypeStruct(x.shape, dtype)
    return x
  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))


def _shapes_key(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)
