"""`ZeroTrainState`: a Flax ``TrainState`` with gradient clipping, fp16 loss scaling and metrics.

``apply_gradients(grads=...)`` takes the (unscaled) gradient that `zerojax.value_and_grad`
returns and, in this order:

1. computes the global L2 norm of the gradient (``optax.tree.norm``). Inside a zerojax step the
   gradient is laid out as ``plan.grads`` (sharded at stages 2-3); XLA sums each device's partial
   sum of squares, so the norm is the unsharded norm, with every element counted once;
2. checks that every element is finite (unless ``nonfinite_grads='ignore'``);
3. clips by global norm with ``optax.clip_by_global_norm`` (the same function an unsharded optax
   chain would use) when ``gradient_clipping`` is set;
4. applies the optimizer (``TrainState.apply_gradients``);
5. keeps the old ``params`` and ``opt_state`` (a select: bit-identical) if the gradient is not
   finite and counts the skipped step (``nonfinite_grads`` ``'skip'`` or ``'halt'``, and always
   with loss scaling). With loss scaling it also updates the dynamic scale:
   ``hysteresis`` consecutive overflows halve it (never below ``min_loss_scale``; after that each
   further consecutive overflow halves it again), ``loss_scale_window`` consecutive good steps
   double it, a good step resets the hysteresis. ``step`` counts every call, skipped or not
   (as DeepSpeed's global step); the optimizer's own counters do not move on a skipped step.

Everything is array arithmetic in the jitted step: no host synchronisation. `step_metrics`
returns the step's grad norm, loss scale, skipped-step count, whether it overflowed and, when the
optimizer is wrapped in ``optax.inject_hyperparams``, the learning rate it used; `zero_step`
adds these to the step's metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from zerojax.core import context
from zerojax.core.config import ZeroConfig
from zerojax.core.memory_kinds import on_device

__all__ = ["StepSettings", "ZeroTrainState", "update_scale", "learning_rate", "skip_nonfinite",
           "nnx_loss_scaling"]


@dataclasses.dataclass(frozen=True)
class StepSettings:
  """The config fields `ZeroTrainState` acts on (static: part of the compiled step).

  Attributes:
    loss_scale: ``None`` for no loss scaling, 0 for dynamic loss scaling, a positive number
      for a static loss scale.
    loss_scale_window: consecutive good steps after which a dynamic scale doubles.
    hysteresis: consecutive overflows before a dynamic scale halves.
    min_loss_scale: the floor of a dynamic scale.
    gradient_clipping: the global-norm clipping threshold, or ``None`` for no clipping.
    nonfinite: ``ZeroConfig.nonfinite_policy``: ``'halt'``, ``'skip'`` or ``'ignore'``.
  """

  loss_scale: float | None = None  # None off, 0 dynamic, > 0 static
  loss_scale_window: int = 1000
  hysteresis: int = 2
  min_loss_scale: float = 1.0
  gradient_clipping: float | None = None
  nonfinite: str = "halt"  # ZeroConfig.nonfinite_policy

  @classmethod
  def from_config(cls, config: ZeroConfig) -> "StepSettings":
    """The settings that ``config`` asks for.

    Args:
      config: the zerojax configuration.

    Returns:
      A `StepSettings` with ``config``'s loss-scaling, clipping and non-finite policy fields.
    """
    return cls(config.to_flat()["loss_scale"], config.loss_scale_window, config.hysteresis,
               config.min_loss_scale, config.gradient_clipping, config.nonfinite_policy)

  @property
  def checks_finite(self) -> bool:
    """Whether the step reports a non-finite gradient (``overflow``)."""
    return self.scaling or self.nonfinite != "ignore"

  @property
  def skips(self) -> bool:
    """Whether a step with a non-finite gradient keeps the old state (a select on the device,
    which holds the old and the new optimizer state at once)."""
    return self.scaling or self.nonfinite == "skip"

  @property
  def scaling(self) -> bool:
    """Whether loss scaling (static or dynamic) is on."""
    return self.loss_scale is not None

  @property
  def dynamic(self) -> bool:
    """Whether the loss scale is dynamic."""
    return self.loss_scale == 0


class ZeroTrainState(train_state.TrainState):
  """``TrainState`` plus loss-scaling state, clipping and per-step metrics.

  The fields it adds to ``TrainState`` are replicated scalars (``settings`` excepted).

  Attributes:
    loss_scale: the current loss scale (1.0 without loss scaling).
    good_steps: consecutive non-overflowing steps since the scale last changed or overflowed.
    hysteresis_left: overflows still tolerated before the scale halves.
    skipped_steps: steps skipped because the gradient overflowed (was not finite).
    overflow: whether the last step's gradient was not finite (and the step was skipped).
    grad_norm: global norm of the last step's gradient (unscaled, before clipping).
    settings: the static `StepSettings`.
  """

  loss_scale: jax.Array = None
  good_steps: jax.Array = None
  hysteresis_left: jax.Array = None
  skipped_steps: jax.Array = None
  overflow: jax.Array = None
  grad_norm: jax.Array = None
  settings: StepSettings = struct.field(pytree_node=False, default=StepSettings())

  @classmethod
  def create(cls, *, apply_fn, params, tx, config: ZeroConfig | None = None,
             settings: StepSettings | None = None, **kwargs) -> "ZeroTrainState":
    """Like ``TrainState.create``; ``config`` (or ``settings``) sets clipping and scaling.

    Args:
      apply_fn: the model's apply function.
      params: the parameters.
      tx: the optax transformation.
      config: the configuration whose clipping, loss-scaling and non-finite fields apply; its
        ``initial_scale_power`` sets the first dynamic loss scale (default 2**16).
      settings: the `StepSettings` to use instead of ``config``'s.
      **kwargs: further fields, passed to ``TrainState.create``.

    Returns:
      A `ZeroTrainState` at step 0 with the initial loss scale and zeroed counters.
    """
    if settings is None:
      settings = StepSettings.from_config(config) if config is not None else StepSettings()
    if not settings.scaling:
      scale = 1.0
    elif settings.dynamic:
      scale = 2.0 ** (config.initial_scale_power if config is not None else 16)
    else:
      scale = float(settings.loss_scale)
    return super().create(
        apply_fn=apply_fn, params=params, tx=tx, settings=settings,
        loss_scale=jnp.asarray(scale, jnp.float32),
        good_steps=jnp.zeros((), jnp.int32),
        hysteresis_left=jnp.asarray(settings.hysteresis, jnp.int32),
        skipped_steps=jnp.zeros((), jnp.int32),
        overflow=jnp.zeros((), bool),
        grad_norm=jnp.zeros((), jnp.float32), **kwargs)

  def apply_gradients(self, *, grads, **kwargs) -> "ZeroTrainState":
    """One optimizer step: norm, finiteness check, clipping, update, loss-scale update.

    The order and the skip rules are those of this module's docstring; everything runs on the
    device, with no host synchronisation.

    Args:
      grads: the unscaled gradient, shaped as ``params``.
      **kwargs: further fields to replace, passed to ``TrainState.apply_gradients``.

    Returns:
      The next state; on a skipped step, its ``params`` and ``opt_state`` are the old ones.
    """
    s = self.settings
    grads = _grads_on_device(grads)
    norm = optax.tree.norm(grads).astype(jnp.float32)
    if s.skips:  # on the gradient as computed: clipping could turn inf into 0
      finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    elif s.checks_finite:
      # 'halt' only reports: the global norm it computes anyway is NaN/inf whenever an element
      # is (a per-leaf check costs temporaries that hand-written FSDP does not have).
      finite = jnp.isfinite(norm)
    if s.gradient_clipping is not None:
      grads, _ = optax.clip_by_global_norm(s.gradient_clipping).update(grads, optax.EmptyState())
    new = super().apply_gradients(grads=grads, **kwargs)
    if not s.checks_finite:
      return new.replace(grad_norm=norm)
    if not s.skips:  # 'halt': report only; the loop stops (no second copy of the state)
      return new.replace(grad_norm=norm, overflow=jnp.logical_not(finite))
    keep = lambda n, o: jnp.where(finite, n, o)
    scale, good, hyst = update_scale(self.loss_scale, self.good_steps, self.hysteresis_left,
                                     finite, s)  # unchanged without dynamic loss scaling
    return new.replace(
        params=jax.tree.map(keep, new.params, self.params),
        opt_state=jax.tree.map(keep, new.opt_state, self.opt_state),
        loss_scale=scale, good_steps=good, hysteresis_left=hyst,
        skipped_steps=self.skipped_steps + jnp.where(finite, 0, 1).astype(jnp.int32),
        overflow=jnp.logical_not(finite), grad_norm=norm)

  def step_metrics(self) -> dict[str, jax.Array]:
    """The last step's metrics.

    Returns:
      A dict with ``grad_norm``, ``loss_scale``, ``skipped_steps``, ``overflow`` and, if the
      optimizer exposes it through ``optax.inject_hyperparams``, ``learning_rate``.
    """
    out = {"grad_norm": self.grad_norm, "loss_scale": self.loss_scale,
           "skipped_steps": self.skipped_steps, "overflow": self.overflow}
    lr = learning_rate(self.opt_state)
    if lr is not None:
      out["learning_rate"] = lr
    return out


def update_scale(scale, good_steps, hysteresis_left, finite, settings: StepSettings):
  """The next ``(scale, good_steps, hysteresis_left)`` of (dynamic) loss scaling.

  Args:
    scale: the current loss scale.
    good_steps: consecutive good steps so far.
    hysteresis_left: overflows still tolerated before the scale halves.
    finite: whether this step's gradient was finite (a boolean scalar).
    settings: the `StepSettings`; without dynamic scaling the inputs come back unchanged.

  Returns:
    ``(scale, good_steps, hysteresis_left)`` after this step, as float32, int32 and int32
    arrays.
  """
  if not settings.dynamic:
    return scale, good_steps, hysteresis_left
  overflow = jnp.logical_not(finite)
  halve = overflow & (hysteresis_left <= 1)
  grow = finite & (good_steps + 1 >= settings.loss_scale_window)
  new_scale = jnp.where(halve, jnp.maximum(scale / 2, settings.min_loss_scale),
                        jnp.where(grow, scale * 2, scale))
  new_good = jnp.where(finite & ~grow, good_steps + 1, 0).astype(jnp.int32)
  new_hyst = jnp.where(overflow, jnp.maximum(hysteresis_left - 1, 1),
                       settings.hysteresis).astype(jnp.int32)
  return new_scale.astype(jnp.float32), new_good, new_hyst


def learning_rate(opt_state: Any) -> jax.Array | None:
  """The ``learning_rate`` of the first ``optax.inject_hyperparams`` state in ``opt_state``.

  Args:
    opt_state: an optax optimizer state.

  Returns:
    The learning rate as an array, or ``None`` when no ``inject_hyperparams`` state in
    ``opt_state`` has one.
  """
  kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
  for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds)):
    if isinstance(x, kinds) and "learning_rate" in x.hyperparams:
      return jnp.asarray(x.hyperparams["learning_rate"])
  return None


def _grads_on_device(grads):
  """Gradients of host-offloaded parameters arrive typed as host memory; the norm, clipping and
  update read them on the device (in the plan's gradient layout)."""
  ctx = context.current()
  if ctx is None or not ctx.plan.config.offload_params:
    return grads
  return jax.device_put(grads, on_device(ctx.plan.grads))


def skip_nonfinite(tx: optax.GradientTransformation, finite_out: list
                   ) -> optax.GradientTransformation:
  """``tx`` whose update is a no-op when the gradient has a non-finite element.

  On such a step the update is zero and the optimizer state the old one (a select:
  bit-identical).

  Args:
    tx: the optax transformation to wrap.
    finite_out: a list to which each ``update`` call appends the step's finiteness flag, for
      the caller (NNX loss scaling) to act on.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``tx``'s ``init``.
  """

  def update(grads, state, params=None, **kw):
    finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    updates, new_state = tx.update(grads, state, params, **kw)
    finite_out.append(finite)
    updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
    new_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_state, state)
    return updates, new_state

  return optax.GradientTransformationExtraArgs(tx.init, update)


def _nnx_loss_scaling_types():

  class LossScaleState(nnx.Variable):
    """fp16 loss-scaling counters of an NNX optimizer (replicated, never trained)."""

  class NnxLossScaling(nnx.Module):
    """fp16 loss scaling for an NNX ``(model, optimizer)``: the counters `ZeroTrainState` keeps
    for linen, held by the optimizer that `zerojax.create_nnx` builds (``optimizer.loss_scaling``)
    and updated by the step after the optimizer's update."""

    def __init__(self, config: ZeroConfig):
      s = StepSettings.from_config(config)
      scale = 2.0 ** config.initial_scale_power if s.dynamic else float(s.loss_scale)
      self.scale = LossScaleState(jnp.asarray(scale, jnp.float32))
      self.good_steps = LossScaleState(jnp.zeros((), jnp.int32))
      self.hysteresis_left = LossScaleState(jnp.asarray(s.hysteresis, jnp.int32))
      self.skipped_steps = LossScaleState(jnp.zeros((), jnp.int32))
      self.overflow = LossScaleState(jnp.zeros((), bool))

    def update(self, finite: jax.Array, settings: StepSettings) -> None:
      scale, good, hyst = update_scale(self.scale[...], self.good_steps[...],
                                       self.hysteresis_left[...], finite, settings)
      self.scale[...], self.good_steps[...], self.hysteresis_left[...] = scale, good, hyst
      self.skipped_steps[...] = self.skipped_steps[...] + jnp.where(finite, 0, 1).astype(
          jnp.int32)
      self.overflow[...] = jnp.logical_not(finite)

    def metrics(self) -> dict[str, jax.Array]:
      return {"loss_scale": self.scale[...], "skipped_steps": self.skipped_steps[...],
              "overflow": self.overflow[...]}

  return LossScaleState, NnxLossScaling


def nnx_loss_scaling(config: ZeroConfig) -> Any:
  """The loss-scaling state `zerojax.create_nnx` attaches to an NNX optimizer.

  Args:
    config: the configuration whose loss-scaling fields apply (``loss_scale`` must be set).

  Returns:
    An ``nnx.Module`` holding the loss scale, good-step, hysteresis, skipped-step and overflow
    counters, with ``update(finite, settings)`` and ``metrics()``.
  """
  return _nnx_loss_scaling_types()[1](config)
