"""The train-step decorator.

``@zero_step(plan)`` turns a plain ``train_step(state, batch) -> (state, metrics)`` into a jitted
step whose input/output shardings come from the plan, whose state buffers are donated, and whose
batch is split over every data-parallel axis. Inside, ``state.apply_fn`` runs as the chosen
formulation says (`zerojax.core.apply`) and the optimizer receives gradients laid out as
the stage says (`zerojax.core.layout`). The user's code is unchanged.

For Flax NNX the same decorator takes ``train_step(model, optimizer, batch) -> metrics`` that
updates ``model``/``optimizer`` in place, as under ``nnx.jit``.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from typing import Any, Callable

import jax
import numpy as np

from flax import nnx

from zerojax.core import agreement, budget, context, layout, offload
from zerojax.core.config import ConfigError
from zerojax.core.dtypes import check_compute_dtype, compute_dtype_of, with_compute_dtype
from zerojax.core.formulation import remat_applied
from zerojax.core.apply import ModelApply, linen_applies, per_use_reason
from zerojax.core.grad import check_batch
from zerojax.core.pipeline import OneAhead, describe
from zerojax.core.plan import ShardingPlan
from zerojax.core.remat import scan_remat, scanned_layers
from zerojax.core.train_state import StepSettings, ZeroTrainState, skip_nonfinite

__all__ = ["ZeroStep", "zero_step"]


class ZeroStep:
  """A jitted ZeRO train step; create it with `zero_step`.

  One path compiles and runs every kind of step; what differs between a state step
  (``step(state, batch)``: linen ``TrainState``, a plain pytree model) and an NNX step
  (``step(model, optimizer, batch)``) is the `_StateStep` or `_NnxStep` its arguments select:
  how they become the one pytree the jitted function takes, and how its result reaches the
  caller.

  Attributes:
    fn: the user's train step.
    plan: the `ShardingPlan` whose shardings the step uses.
    donate: whether the state's buffers are donated to the step.
    formulation: per compiled variant, how it gathers parameters: ``'compiler'`` (XLA's
      partitioner) or ``'per use'`` (zerojax's gathers where each layer reads them).
    remat: per compiled variant, where ``config.remat`` acted.
    layers: per compiled variant that scanned layers, whether they ran one ahead, or why not.
    last_step_time: the ``step_time`` of the last call, in seconds (``nan`` after a compile).
  """

  def __init__(self, fn: Callable, plan: ShardingPlan, donate: bool = True):
    functools.update_wrapper(self, fn)
    self.fn, self.plan, self.donate = fn, plan, donate
    self._jitted: dict[Any, Any] = {}
    # How each compiled variant gathers parameters: "compiler" (XLA's partitioner) or
    # "per use" (zerojax's gather boxes); see `zerojax.core.formulation`.
    self.formulation: dict[Any, str] = {}
    # Where each variant's ``config.remat`` acted (`zerojax.core.formulation.remat_applied`).
    self.remat: dict[Any, str] = {}
    # Whether each variant's scanned layers ran one ahead, or why not
    # (`zerojax.core.pipeline.describe`; absent where the step scanned no layers).
    self.layers: dict[Any, str] = {}
    self._last_dispatch: float | None = None
    self.last_step_time = math.nan  # see __call__

  def _variant(self, args: tuple) -> tuple["_StateStep | _NnxStep", Any, Any, tuple, bool]:
    """``(kind, jitted, batch, rest, compiled)`` for a call's arguments: the step kind they
    select, the jitted function for their shapes (traced now where it is new) and whether it
    was new."""
    kind, batch, rest = _kind(self.plan, args)
    key = kind.key(batch, rest)
    new = key not in self._jitted
    if new:
      kind.check(batch)
      contexts: list = []  # the trace's step context
      body = kind.body(self.fn, contexts)
      self._jitted[key] = self._traced_jit(body, kind.shardings(),
                                           (kind.state, batch, *rest), contexts)
      self.formulation[key], self.remat[key] = kind.formulation(contexts)
      self._describe_layers(key, contexts)
    return kind, self._jitted[key], batch, rest, new

  def _describe_layers(self, key, contexts):
    plan = self.plan
    live = plan.config.max_live_layers
    asked = (f"max_live_layers={live}" if live is not None else
             f"max_live_layers=None: {plan.live_layers} on {plan.backend.name.upper()}")
    said = describe(asked, contexts[-1].scans) if contexts else None
    if said is not None:
      self.layers[key] = said

  def _jit(self, step, state_sh, batch, rest, options):
    plan = self.plan
    return jax.jit(step, in_shardings=(state_sh, plan.batch(batch), *_replicated(plan, rest)),
                   out_shardings=(state_sh, plan.replicated),
                   donate_argnums=(0,) if self.donate else (), compiler_options=options)

  def _traced_jit(self, step, state_sh, args, contexts):
    """``step`` jitted for ``args = (state, batch, *rest)`` and traced once (the trace is
    cached for the first call; it fills ``contexts`` and checks the compute dtype), with the
    compiler options its model needs (`ShardingPlan.compiler_options_for`). Where they are not
    the ones the plan expected it is jitted again: traced once more, compiled once."""
    plan = self.plan
    state, batch, *rest = args
    jit = functools.partial(self._jit, step, state_sh, batch, tuple(rest))
    jitted = jit(plan.compiler_options)
    traced = jitted.trace(*args)
    if compute_dtype_of(plan.config) is not None:
      check_compute_dtype(plan.config, traced)
    ctx = contexts[-1]
    ahead = [o for o in ctx.scans if isinstance(o, OneAhead)]
    options = plan.compiler_options_for(
        ctx.layers_ahead, OneAhead(*map(max, zip(*ahead))) if ahead else None,
        ctx.layers_in_checkpoints, ctx.rows_ahead)
    return jitted if options == plan.compiler_options else jit(options)

  def __call__(self, *args):
    """Runs one step. Metrics gain host-side ``step_time`` and ``tokens_per_sec``.

    Both come from dispatch times, not from device timers, so the hot path never waits for the
    device: ``step_time`` is the wall time between the returns of the previous and of this
    call. JAX dispatch is asynchronous, so this interval measures the device's step time once
    the loop is device-bound (the steady state of any training loop that reads a metric or
    feeds data); it is ``nan`` for the first call and for any call that compiled.
    ``tokens_per_sec`` is the batch's tokens (rows × sequence length of the first batch leaf
    with two or more dimensions, rows otherwise) divided by ``step_time``.

    Arguments after the batch (an RNG key, a step number) are passed through replicated.

    Args:
      *args: ``(state, batch, *rest)``, or for Flax NNX ``(model, optimizer, batch, *rest)``.

    Returns:
      ``(new_state, metrics)`` for a state; for NNX, ``metrics`` (``model`` and ``optimizer``
      are updated in place).

    Raises:
      TypeError: too few arguments, or the train step did not return ``(state, metrics)``.
      ConfigError: the state or step cannot honour the config (clipping or loss scaling
        without a `ZeroTrainState`, per-use gathering the step never reaches, accumulation or
        loss scaling without `zerojax.value_and_grad`, an NNX optimizer without loss-scaling
        state).
      DeviceMemoryError: on a backend that reports a memory limit, the compiled step does not
        fit in it.
    """
    kind, f, batch, rest, compiled = self._variant(args)
    if compiled:  # first call with these shapes: check memory before it allocates
      _check_step_memory(self.plan, f, kind.state, batch, *rest, **kind.memory_hints())
    new_state, metrics = f(kind.state, batch, *rest)
    return kind.result(new_state, self._host_metrics(metrics, batch, compiled=compiled))

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

  def jitted(self, *args) -> Any:
    """The ``jax.jit`` function this step runs for ``args`` (e.g. for ``jax.export`` or ``.trace``).

    Args:
      *args: the step's arguments, as for a call.

    Returns:
      The jitted function, called as ``f(state, batch, *rest)``; for NNX as
      ``f(nnx.state((model, optimizer)), batch, *rest)``.

    Raises:
      TypeError: too few arguments.
      ConfigError: the state or step cannot honour the config (as for a call).
    """
    return self._variant(args)[1]

  def lower(self, *args):
    """Lowers the step for ``args`` (arrays or ShapeDtypeStructs), e.g. to inspect memory.

    Args:
      *args: the step's arguments, as for a call.

    Returns:
      The ``jax.stages.Lowered`` step.

    Raises:
      TypeError: too few arguments.
      ConfigError: the state or step cannot honour the config (as for a call).
    """
    kind, f, batch, rest, _ = self._variant(args)
    return f.lower(kind.state, batch, *rest)


def _kind(plan: ShardingPlan, args: tuple) -> tuple["_StateStep | _NnxStep", Any, tuple]:
  """The step kind of a call's arguments, its batch and the arguments after it: an
  ``nnx.Module`` first means ``(model, optimizer, batch, *rest)``; anything else
  ``(state, batch, *rest)``."""
  if args and isinstance(args[0], nnx.Module):
    if len(args) < 3:
      raise TypeError("an NNX zerojax step is called as step(model, optimizer, batch, ...); "
                      f"got {len(args)} arguments")
    return _NnxStep(plan, *args[:2]), args[2], tuple(args[3:])
  if len(args) < 2:
    raise TypeError("a zerojax step is called as step(state, batch, ...) (or, for Flax NNX, "
                    f"step(model, optimizer, batch, ...)); got {len(args)} argument(s)")
  return _StateStep(plan, args[0]), args[1], tuple(args[2:])


class _StateStep:
  """A step on a state pytree (linen ``TrainState``, `ZeroTrainState`, a plain pytree model):
  ``fn(state, batch, *rest) -> (state, metrics)``. The model runs as the plan's formulation
  says through ``state.apply_fn`` (`ModelApply`), and the optimizer receives the gradient laid
  out as the stage says."""

  def __init__(self, plan: ShardingPlan, state: Any):
    self.plan, self.state = plan, state
    self._model: ModelApply | None = None
    self._applied: list = []  # the trace's `linen_applies`: models the step applies itself

  def key(self, batch: Any, rest: tuple) -> tuple:
    return ("state", jax.tree.structure(self.state), _shapes_key(batch), _shapes_key(rest))

  def shardings(self) -> Any:
    return self.plan.state(self.state)

  def check(self, batch: Any) -> None:
    _check_state_features(self.plan, self.state)
    check_batch(self.plan, batch)
    _check_processes_agree(self.plan, getattr(self.state, "tx", None), self.state)

  def body(self, fn: Callable, contexts: list) -> Callable:
    plan, orig = self.plan, self.state.apply_fn
    orig_tx = getattr(self.state, "tx", None)
    model = self._model = ModelApply(orig, plan)  # decides the formulation on its first trace
    tx = None if orig_tx is None else offload.wrap_tx(orig_tx, plan, layout.prepare(plan))
    applied = self._applied

    def step(state, batch, *rest):
      changes = {"apply_fn": model} if tx is None else {"apply_fn": model, "tx": tx}
      state = state.replace(**changes)
      with _step_context(plan, state) as ctx, scanned_layers(scan_remat(
          plan.config, plan.gathers_per_use, plan.pipeline)) as ctx.scans, linen_applies(
              plan) as others:
        new_state, metrics = fn(state, batch, *rest)
      applied.append(others)
      contexts.append(ctx)
      _check_features_used(ctx)
      if not isinstance(new_state, type(state)):
        raise TypeError(f"train_step must return (state, metrics); got {type(new_state)}")
      if isinstance(new_state, ZeroTrainState) and isinstance(metrics, dict):
        metrics = {**new_state.step_metrics(), **metrics}
      restore = {"apply_fn": orig} if orig_tx is None else {"apply_fn": orig, "tx": orig_tx}
      return new_state.replace(**restore), metrics

    return step

  def formulation(self, contexts: list) -> tuple[str, str]:
    """How the traced step gathered parameters, and where the config's remat acted."""
    plan = self.plan
    chosen = self._model.formulation or (
        self._applied[-1].formulation if self._applied else None)
    per_use = plan.gathers_per_use if chosen is None else chosen.per_use
    return "per use" if per_use else "compiler", remat_applied(plan.config, chosen)

  def memory_hints(self) -> dict[str, Any]:
    s = self.state
    return {"params": s.params, "tx": getattr(s, "tx", None),
            "opt_state": getattr(s, "opt_state", None)}

  def result(self, new_state: Any, metrics: Any) -> tuple[Any, Any]:
    return new_state, metrics


class _NnxStep:
  """A Flax NNX step, ``fn(model, optimizer, batch, *rest) -> metrics``, updating ``model``
  and ``optimizer`` in place as under ``nnx.jit``: traced on their ``nnx.state`` and merged
  inside."""

  def __init__(self, plan: ShardingPlan, model: Any, optimizer: Any):
    self.plan, self.pair = plan, (model, optimizer)
    self.graphdef, self.state = nnx.split(self.pair)
    # What the step merges: the same graph with the config's compute dtype on every layer
    # that leaves its own unset, decided once here; the user's modules are left as they are.
    self.step_graphdef = nnx.split(with_compute_dtype(self.pair, compute_dtype_of(plan.config)))[0]

  def key(self, batch: Any, rest: tuple) -> tuple:
    return ("nnx", self.graphdef, _shapes_key(batch), _shapes_key(rest))

  def shardings(self) -> Any:
    return self.plan.nnx_state(self.state)

  def check(self, batch: Any) -> None:
    plan, optimizer = self.plan, self.pair[1]
    if plan.config.loss_scale is not None and not hasattr(optimizer, "loss_scaling"):
      raise ConfigError(
          f"loss_scale={plan.config.loss_scale.scale!r}: an NNX optimizer keeps the fp16 loss "
          "scale in optimizer.loss_scaling, which zerojax.create_nnx adds; build the "
          "(model, optimizer) pair with zerojax.create_nnx(..., config=config)")
    check_batch(plan, batch)
    _check_processes_agree(plan, getattr(optimizer, "tx", None), None)
    if plan.gathers_per_use and not plan.config.offload_params:  # host params: fetched whole
      raise ConfigError(
          f"{per_use_reason(plan)} needs per-use gathering, which zerojax does through a "
          "linen model's state.apply_fn; an NNX step cannot honour it. Use a linen model, or "
          "drop the setting")

  def body(self, fn: Callable, contexts: list) -> Callable:
    plan, graphdef = self.plan, self.step_graphdef
    cfg = plan.config
    scaling = cfg.loss_scale is not None
    # Host-resident NNX parameters come to the device (as the plan shards them) when the
    # step starts and go back when it ends; a linen model fetches each layer's just in time.
    params_host = plan.params_on_host

    def step(state, batch, *rest):
      m, o = nnx.merge(graphdef, state)
      if params_host:
        nnx.update(m, offload.put_like(nnx.state(m, nnx.Param), offload.on_device(plan.params)))
      finite: list = []
      tx = skip_nonfinite(o.tx, finite) if scaling else o.tx
      o.tx = offload.wrap_tx(tx, plan, layout.prepare(plan, clip=cfg.gradient_clipping),
                             params_fetched=params_host)
      scale = o.loss_scaling.scale[...] if scaling else None
      with _step_context(plan, None, scale) as ctx, scanned_layers(
          scan_remat(cfg, False, plan.pipeline)) as ctx.scans:
        metrics = fn(m, o, batch, *rest)
      contexts.append(ctx)
      _check_features_used(ctx)
      if scaling:
        if len(finite) != 1:
          raise ConfigError(
              f"loss_scale={cfg.loss_scale.scale!r}: the NNX step must call "
              f"optimizer.update(model, grads) exactly once (it called it {len(finite)} "
              "times), so that an overflowing step can be skipped")
        o.loss_scaling.update(finite[0], StepSettings.from_config(cfg))
        if isinstance(metrics, dict):
          metrics = {**o.loss_scaling.metrics(), **metrics}
      return nnx.state((m, o)), metrics

    return step

  def formulation(self, contexts: list) -> tuple[str, str]:
    """How the traced step gathered parameters, and where the config's remat acted."""
    ctx = contexts[-1]
    return _nnx_formulation(self.plan, ctx), remat_applied(self.plan.config, ctx.formulation)

  def memory_hints(self) -> dict[str, Any]:
    return {}

  def result(self, new_state: Any, metrics: Any) -> Any:
    nnx.update(self.pair, new_state)
    return metrics


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

  Returns:
    A decorator that turns ``train_step`` into a `ZeroStep`; with a plan whose optimizer state
    is on NVMe (``plan.nvme``), into the `zerojax.runtime.nvme.NvmeOptimizer.step` of it: the
    `ZeroStep` on the devices, then the streamed host update.

  Raises:
    TypeError: ``plan`` is not a `ShardingPlan`.
    ConfigError: the config's batch sizes are inconsistent.
  """
  if not isinstance(plan, ShardingPlan):
    raise TypeError(f"zero_step(plan) needs a zerojax.ShardingPlan, got {type(plan).__name__}")
  plan.accumulation_steps  # inconsistent batch sizes fail here
  if plan.nvme is not None:  # the optimizer state in files: its host update follows each step
    return lambda fn: plan.nvme.step(fn, donate=donate)
  return lambda fn: ZeroStep(fn, plan, donate)


def _step_context(plan: ShardingPlan, state: Any, scale: Any = None):
  """The `zerojax.core.context` of one trace: plan, accumulation steps, the input's loss scale
  (from a `ZeroTrainState`, or ``scale`` for an NNX step)."""
  if isinstance(state, ZeroTrainState) and state.settings.scaling:
    scale = state.loss_scale
  return context.active(context.StepContext(
      plan, plan.accumulation_steps, scale,
      linen=state is not None))


def _check_processes_agree(plan: ShardingPlan, tx: Any, state: Any) -> None:
  """Multi-process runs: every process must have the same config, plan and optimizer before
  the first compile (a mismatch would hang in a collective or diverge silently)."""
  if jax.process_count() > 1:
    agreement.check_agreement(plan.config, plan, tx=tx,
                              state=state if hasattr(state, "opt_state") else None)


def _check_state_features(plan: ShardingPlan, state: Any) -> None:
  """Clipping and loss scaling live in `ZeroTrainState`; refuse a state that would ignore them."""
  cfg = plan.config
  flat = cfg.to_flat()
  wanted = [f"{k}={flat[k]!r}" for k in ("gradient_clipping", "loss_scale")
            if flat[k] is not None]
  if wanted and not isinstance(state, ZeroTrainState):
    kind = "an NNX step" if state is None else f"a {type(state).__name__}"
    raise ConfigError(f"{', '.join(wanted)} needs a zerojax.ZeroTrainState (create it with "
                      f"zerojax.create_train_state); {kind} would silently ignore it")


def _check_features_used(ctx: context.StepContext) -> None:
  plan = ctx.plan
  if plan.gathers_per_use and ctx.apply_calls == 0 and ctx.linen:
    # The model never ran through state.apply_fn, so nothing gathered per use: host-resident
    # parameters would reach XLA in host memory, a reduce_dtype would silently not apply.
    raise ConfigError(
        f"{per_use_reason(plan)} acts where the model reads its parameters, which zerojax "
        "sees only when the model is called through state.apply_fn({'params': params}, ...) "
        "inside the step; this step never called it. Call the model as "
        "state.apply_fn(...), or drop the setting")
  if ctx.grad_calls:
    return
  cfg = ctx.plan.config
  if ctx.accumulation_steps > 1 or ctx.loss_scale is not None:
    raise ConfigError(
        f"gradient_accumulation_steps={ctx.accumulation_steps}, loss_scale={cfg.to_flat()['loss_scale']!r}: "
        "the train step must compute its gradient with zerojax.value_and_grad(loss_fn)"
        "(params, batch) (a drop-in for jax.value_and_grad; linen TrainState steps), else "
        "the accumulation/loss scaling would silently not happen")


def _nnx_formulation(plan: ShardingPlan, ctx: context.StepContext) -> str:
  """The formulation an NNX step's trace used: per use where `zerojax.value_and_grad` boxed
  the model's parameters. Where the plan asks for it but the step differentiated otherwise
  (``nnx.value_and_grad``), XLA's partitioner places the gathers, and the user is told."""
  if ctx.boxed_calls:
    return "per use"
  if plan.formulation(None, linen=False).per_use:
    warnings.warn(
        f"zerojax: on {plan.backend.name.upper()} stage 3 gathers an NNX model's parameters where "
        "its layers read them only when the step differentiates with "
        "zerojax.value_and_grad(loss_fn)(model, ...); this step did not, so XLA's partitioner "
        "places the gathers and may move activations instead of weights", stacklevel=2)
  return "compiler"


def _replicated(plan: ShardingPlan, tree: Any) -> Any:
  return jax.tree.map(lambda _: plan.replicated, tree)


def _tokens(batch: Any) -> int:
  shapes = [np.shape(x) for x in jax.tree.leaves(batch) if np.ndim(x) >= 1]
  for s in shapes:
    if len(s) >= 2:
      return s[0] * s[1]
  return shapes[0][0] if shapes else 0


def _check_step_memory(plan: ShardingPlan, jitted: Any, *args: Any, **suggest: Any) -> None:
  """Compiles the step ahead of its first call and compares its peak per device with the
  devices' memory limit (`zerojax.core.budget.check_fits`), so a step that cannot fit fails with
  the numbers and a suggestion instead of ``RESOURCE_EXHAUSTED``. Backends that report no
  limit (CPU) skip it: nothing is compiled twice there."""
  devices = list(plan.mesh.devices.flat)
  if budget.bytes_limit(devices) is None:
    return
  compiled = jitted.lower(*args).compile()  # the call after it reuses JAX's compilation cache
  budget.check_fits(compiled, devices, config=plan.config, **suggest)


def _shapes_key(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)
