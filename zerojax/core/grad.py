"""`zerojax.value_and_grad`: gradient accumulation and loss scaling inside a plain train step.

Use it where a Flax step calls ``jax.value_and_grad``::

  loss, grads = zerojax.value_and_grad(loss_fn)(state.params, batch)

Outside a zerojax step it *is* ``jax.value_and_grad``. Inside one (see `zerojax.core.context`) it

* splits every argument after the parameters along its leading (batch) axis into
  ``gradient_accumulation_steps`` micro-batches, runs them with ``jax.lax.scan`` and returns the
  mean loss and the mean gradient, accumulated in float32: the same numbers as one large-batch
  step (``fun`` must return a *mean* over the batch's rows, as DeepSpeed also assumes);
* multiplies the loss by the state's loss scale (fp16 loss scaling) before differentiating, and
  divides the gradient by it afterwards, in float32. The returned loss and gradient are
  unscaled; non-finite values survive the division, so `ZeroTrainState.apply_gradients` sees an
  overflow and skips the step.

At stage 1 the gradient is formed as the ZeRO paper's and DeepSpeed's stage 1 form it, even
without accumulation: each device's *local* gradient (full size) is built through the backward
pass and reduced once, after it, straight into the optimizer's shards
(`ShardingPlan.grads_reduced`: one reduce-scatter of Ψ, then Ψ of all-gather for the updated
parameters: the paper's 2Ψ). This needs the batch as an argument of ``fun``; a loss that closes
over its batch is differentiated by ``jax.value_and_grad`` and XLA picks where to reduce.

Each device keeps its own rows of every micro-batch: micro-batch ``i`` holds rows
``i*m .. (i+1)*m - 1`` of every device's local block of ``m * accumulation`` rows, so splitting
moves no data.

Communication per optimizer step:

* stages 2-3: each micro-batch's gradient is reduce-scattered inside its backward pass by the
  per-layer gather boxes (`zerojax.core.gather`); the float32 accumulator is laid out as
  ``plan.grads`` (sharded), so no device ever holds a full gradient.
* stages 0-1: a reduction per micro-batch would multiply the all-reduce volume by the number of
  micro-batches. Instead the micro-batch loss is ``jax.vmap``-ed over the data-parallel groups
  (``spmd_axis_name`` = the data axes): each device computes the gradient of its own rows, the
  accumulator has a leading data-parallel axis that is sharded over the data axes (one
  gradient-sized buffer per device, as any stage 0-1 accumulator), and the only reduction is a
  sum over that axis after the last micro-batch, in ``reduce_dtype`` (by default the compute
  dtype, the gradient's dtype where each use makes it, as stages 2-3 reduce it; the
  accumulator itself is float32). The loss of each device's rows is then averaged over
  devices, which equals the batch mean for a mean loss. A loss that couples rows across
  devices (batch statistics) sees per-device batches at stages 0-1.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from flax import nnx
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.core import context
from zerojax._compat import ORIGINAL_SCAN
from zerojax.core.formulation import needs_trace
from zerojax.core.gather import ZeroParam, after, box_params
from zerojax.core.plan import ShardingPlan
from zerojax.core.config import ConfigError
from zerojax.core.dtypes import compute_dtype_of, reduce_dtype_of
from zerojax.core.regather import prefetching, regather_nnx_layers
from zerojax.core.blocks import checkpoint_nnx_blocks, nnx_blocks
from zerojax.core.remat import block_policy, checkpoint_model

__all__ = ["F32", "check_batch", "value_and_grad", "accumulate"]

PyTree = Any
F32 = jnp.float32


def check_batch(plan: Any, batch: PyTree) -> None:
  """Checks the global batch of a step against the config's batch sizes (at trace time).

  Args:
    plan: the step's `ShardingPlan`.
    batch: the global batch (its first leaf with a dimension gives the row count).

  Raises:
    ConfigError: the rows differ from ``train_batch_size``, or do not split into
      ``gradient_accumulation_steps`` micro-batches over the data-parallel size.
  """
  cfg, dp = plan.config, plan.data_parallel_size
  rows = [np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x) >= 1]
  if not rows:
    return
  b = rows[0]
  if plan.batch_sizes is not None:
    t, m, g = plan.batch_sizes
    if b != t:
      raise ConfigError(
          f"the step's batch has {b} rows but the config says train_batch_size={t} "
          f"(micro_batch_per_device={m} × gradient_accumulation_steps={g} × data-parallel "
          f"size={dp}); feed global batches of {t} rows")
    return
  g = cfg.gradient_accumulation_steps or 1
  if b % (g * dp):
    raise ConfigError(
        f"the step's batch has {b} rows (train_batch_size={b}), which does not split into "
        f"gradient_accumulation_steps={g} micro-batches over data-parallel size={dp} "
        f"(micro_batch_per_device={b / (g * dp):g} is not an integer)")


def value_and_grad(fun: Callable, argnums: int = 0, has_aux: bool = False, *,
                   loss_scale: Any = None, wrt: Any = None) -> Callable:
  """Drop-in for ``jax.value_and_grad`` with ZeRO gradient accumulation and loss scaling.

  Inside a zerojax step it is `accumulate` with the step's plan, its accumulation steps and
  the input state's loss scale; outside one, ``jax.value_and_grad`` (with ``loss_scale``
  applied where given).

  Args:
    fun: ``fun(params, *batch_args) -> loss`` (or ``(loss, aux)`` with ``has_aux``); the loss
      must be a mean over the rows of ``batch_args``.
    argnums: must be 0 (the parameters) when accumulating or scaling.
    has_aux: as in ``jax.value_and_grad``. With accumulation, each floating ``aux`` leaf is
      averaged over micro-batches (and over data-parallel groups at stages 0-1); other leaves
      come from the last micro-batch. Use ``aux`` for per-batch metrics.
    loss_scale: a loss scale to use instead of the step's (e.g. outside a zerojax step).
    wrt: for an NNX model, the variables to differentiate (an ``nnx`` filter, e.g.
      ``nnx.LoRAParam`` for LoRA adapters: the other parameters are constants of the step,
      still gathered where they are used); ``None``: every ``nnx.Param``.

  Returns:
    ``f(params, *batch_args) -> (loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``),
    loss and grads unscaled.

  Raises:
    ValueError: (when ``f`` is called) ``wrt`` is given for a non-NNX argument, or
      ``argnums`` is not 0 where the gradient is accumulated or scaled, or for an NNX model.
    ConfigError: (when ``f`` is called) a batch leaf's rows do not split into the
      accumulation steps over the data-parallel size, or an NNX model's parameters do not
      match the plan's.
  """

  def wrapped(params, *args):
    ctx = context.current()
    scale = loss_scale if loss_scale is not None else (ctx.loss_scale if ctx else None)
    plan, steps = (ctx.plan, ctx.accumulation_steps) if ctx is not None else (None, 1)
    return _Accumulation(plan, steps, scale, ctx)(fun, argnums, has_aux, wrt)(params, *args)

  return wrapped


def accumulate(fun: Callable, plan: ShardingPlan, *, steps: int | None = None,
               has_aux: bool = False, loss_scale: Any = None, wrt: Any = None) -> Callable:
  """``jax.value_and_grad`` of ``fun`` over micro-batches of its batch, laid out by ``plan``.

  The explicit form of what `value_and_grad` does inside a zerojax step, usable in any
  jitted step (a hand-written ``jax.jit`` with the plan's shardings as well as `zero_step`).
  Every argument after the parameters is split along its leading (row) axis into ``steps``
  micro-batches, each device keeping its own rows, and scanned; the mean loss and the mean
  gradient are returned, accumulated in float32: the numbers of one large-batch step.

  * Stages 2-3: each micro-batch's gradient is reduced into an accumulator laid out as
    ``plan.grads`` (sharded) as it is made.
  * Stages 0-1: each device accumulates the gradient of its own rows and the step reduces
    once, after the last micro-batch, into ``plan.grads_reduced``.

  Args:
    fun: ``fun(params, *batch_args) -> loss`` (or ``(loss, aux)`` with ``has_aux``), the loss
      a mean over the rows of ``batch_args``; ``params`` may be an NNX model (its
      ``nnx.Param`` state, or ``wrt``, is differentiated).
    plan: the run's `zerojax.ShardingPlan`.
    steps: micro-batches per call; None: ``plan.accumulation_steps`` (from the config's
      `zerojax.Batch`).
    has_aux: as in ``jax.value_and_grad``; floating ``aux`` leaves are averaged over
      micro-batches, others come from the last one.
    loss_scale: an fp16 loss scale (e.g. ``state.loss_scale``) the loss is multiplied by
      before differentiating and the gradient divided by after, in float32; None: none.
    wrt: for an NNX model, the variables to differentiate (an ``nnx`` filter).

  Returns:
    ``f(params, *batch_args) -> (loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``),
    loss and grads unscaled.

  Raises:
    TypeError: ``plan`` is not a `zerojax.ShardingPlan`, or ``steps`` is not a positive int.
    ConfigError: (when ``f`` is called) a batch leaf's rows do not split into ``steps``
      micro-batches over the plan's data-parallel size.
  """
  if not isinstance(plan, ShardingPlan):
    raise TypeError(f"zerojax.accumulate: plan={type(plan).__name__} is invalid: the run's "
                    "zerojax.ShardingPlan (from zerojax.create_train_state or create_nnx)")
  if steps is None:
    steps = plan.accumulation_steps
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise TypeError(f"zerojax.accumulate: steps={steps!r} is invalid: a positive int (the "
                    "micro-batches per call), or None for the plan's")
  acc = _Accumulation(plan, steps, loss_scale, context.current())
  return acc(fun, 0, has_aux, wrt)


@dataclasses.dataclass(frozen=True)
class _Accumulation:
  """How a gradient is formed: over ``steps`` micro-batches laid out by ``plan`` (None: as
  ``jax.value_and_grad`` forms it), with the fp16 loss ``scale``. ``ctx``: the zerojax step
  being traced, if any, which records the call and how the NNX model was gathered."""
  plan: Any
  steps: int
  scale: Any
  ctx: Any

  def __call__(self, fun: Callable, argnums: int, has_aux: bool, wrt: Any) -> Callable:
    plain = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
    plan, steps, scale = self.plan, self.steps, self.scale

    def f(params, *args):
      if isinstance(params, nnx.Module):
        return self._nnx(fun, argnums, has_aux, wrt)(params, *args)
      if wrt is not None:
        raise ValueError("zerojax.value_and_grad(wrt=...) selects variables of an NNX model; "
                         f"argument 0 is a {type(params).__name__}")
      if self.ctx is not None:
        self.ctx.grad_calls += 1
      # Stage 1 reduces once, after the backward pass; that needs the rows to split per device.
      local = plan is not None and plan.local_grads and bool(args)
      if steps == 1 and scale is None and not local:
        return plain(params, *args)
      if argnums != 0:
        raise ValueError("zerojax.value_and_grad accumulates/scales the gradient of argument 0 "
                         f"(the parameters); got argnums={argnums}")
      scaled = _scaled(fun, has_aux, scale)
      if steps == 1 and not local:
        (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(params, *args)
        grads = jax.tree.map(lambda g: (g.astype(F32) / scale).astype(g.dtype), grads)
      else:
        loss, aux, grads = _accumulate(scaled, params, args, steps, plan, scale)
      return ((loss, aux) if has_aux else loss), grads

    return f

  def _nnx(self, fun, argnums, has_aux, wrt=None):
    """The gradient of ``fun(model, *batch)`` for a Flax NNX model: of its ``nnx.Param``
    state, or of the ``wrt`` variables among them (an ``nnx.State``, as
    ``nnx.value_and_grad`` returns it), through the same accumulation, loss scaling and
    stage-1 local-gradient paths as a linen step. Other state the model writes (RNG counters,
    batch statistics) is written back to ``model``."""
    if argnums != 0:
      raise ValueError("zerojax.value_and_grad differentiates argument 0 (the NNX model); got "
                       f"argnums={argnums}")
    plan, ctx = self.plan, self.ctx

    def run(model, *args):
      if wrt is None:
        graphdef, diff, rest = nnx.split(model, nnx.Param, ...)
        whole = lambda d: d
      else:
        # Only ``wrt`` is differentiated (LoRA: the adapters); the frozen parameters are
        # constants of the step, merged back so that the model and the per-use gathers see
        # the whole parameter tree in the plan's order.
        graphdef, diff, frozen, rest = nnx.split(model, wrt, nnx.Param, ...)
        whole = lambda d: nnx.merge_state(d, frozen)

      def f(diff, *args, per_use=False, layers=False, tables=frozenset(), blocks=frozenset(),
            policy=None):
        params = whole(diff)
        if per_use or tables:  # at stage 2 only lookup tables are boxed
          params = _in_plan_order(params, plan, lambda p: box_params(
              p, plan, tables, only_lookups=not per_use))
        m = nnx.merge(graphdef, params, rest)
        if blocks:  # config.remat on each block (`zerojax.core.blocks`)
          checkpoint_nnx_blocks(m, blocks, policy)
        if layers:  # as a linen model without scans (`zerojax.core.apply`)
          regather_nnx_layers(m)
        with prefetching(layers and plan.backend.prefetches_next_layer,
                         plan.backend.prefetches_across_checkpoints):
          out = fun(m, *args)
        loss, aux = out if has_aux else (out, None)
        return loss, (aux, nnx.state(m, nnx.Not(nnx.Param)))

      chosen = plan.formulation(None, linen=False) if plan is not None else None
      if chosen is not None and needs_trace(plan, chosen):
        # Traced once more to see whether the model scans its layers and which parameters it
        # looks rows up in: the formulation as `zerojax.core.apply` reads it for linen models.
        named = block_policy(plan.config) is not None
        chosen = plan.formulation(jax.make_jaxpr(f)(diff, *args), linen=False,
                                  blocks=nnx_blocks(model) if named else frozenset())
        f = functools.partial(f, per_use=chosen.per_use, layers=chosen.layers,
                              tables=chosen.tables, blocks=chosen.blocks,
                              policy=chosen.block_policy)
        if ctx is not None:
          ctx.boxed_calls += chosen.per_use
          ctx.formulation = chosen
        if chosen.checkpoint is not None:  # per use, or config.remat (see `remat_policy`)
          f = checkpoint_model(f, plan, chosen.checkpoint, chosen.layers)

      (loss, (aux, new_rest)), grads = self(f, 0, True, None)(diff, *args)
      nnx.update(model, new_rest)
      return ((loss, aux) if has_aux else loss), grads

    return run


def _in_plan_order(params: Any, plan: Any, fn: Callable[[Any], Any]) -> Any:
  """An NNX model's ``nnx.Param`` state with ``fn`` applied to its values laid out as the
  plan's parameter tree: per use, `box_params` puts each value in a `ZeroParam` box, so a layer
  reading ``self.kernel[...]`` gathers it there, in the compute dtype, and its gradient is
  reduce-scattered as that use's backward pass makes it (at stage 2, a lookup table's alone)."""
  leaves, treedef = jax.tree.flatten(params)
  if _like(params, plan.params) is None:
    raise ConfigError("zerojax.value_and_grad: the NNX model's nnx.Param state does not match "
                      "the plan's parameter tree; build the model with zerojax.create_nnx")
  out = fn(jax.tree.unflatten(jax.tree.structure(plan.params), leaves))
  return jax.tree.unflatten(treedef, jax.tree.leaves(
      out, is_leaf=lambda x: isinstance(x, ZeroParam)))


def _like(params, shardings):
  """The plan's ``shardings`` in the structure of ``params`` (an NNX ``State`` or a linen dict
  alike), or ``None`` when ``params`` is not the plan's parameter tree."""
  leaves, specs = jax.tree.leaves(params), jax.tree.leaves(shardings)
  if len(leaves) != len(specs) or any(len(s.spec) > jnp.ndim(x) for x, s in zip(leaves, specs)):
    return None
  return jax.tree.unflatten(jax.tree.structure(params), specs)


def _scaled(fun, has_aux, scale):
  """``fun`` returning ``(loss * scale in f32, (loss, aux))``."""
  def f(params, *args):
    out = fun(params, *args)
    loss, aux = out if has_aux else (out, None)
    s = loss.astype(F32)
    return (s * scale if scale is not None else s), (loss, aux)
  return f


def _accumulate(scaled, params, args, steps, plan, scale):
  """``(mean loss, mean aux, gradient)`` over ``steps`` micro-batches of ``args``: each device's
  local gradient reduced once (`ShardingPlan.local_grads`, or stage 0), or each micro-batch's
  gradient reduced to its layout as it is made (stages 2-3)."""
  grads_sh = _like(params, plan.grads)
  per_device = not plan.config.shards_grads and grads_sh is not None
  xs = _micro_batches(args, steps, plan, per_device)
  vg = jax.value_and_grad(scaled, has_aux=True)
  if per_device:
    return _accumulate_local(vg, params, xs, len(args), steps, plan, scale, grads_sh)
  return _accumulate_reduced(vg, params, xs, steps, scale, grads_sh)


def _micro_batches(args, steps, plan, per_device):
  """``args`` with a leading micro-batch dimension, each device's rows kept local (and, for a
  per-device gradient, the data-parallel dimension kept apart)."""
  dp, axes, mesh = plan.data_parallel_size, plan.data_axes, plan.mesh

  def split(x):
    x = jnp.asarray(x)
    if x.ndim == 0:
      return jnp.broadcast_to(x, (steps,) + ((dp,) if per_device else ()))
    b = x.shape[0]
    if b % (steps * dp):
      raise ConfigError(f"a batch leaf has {b} rows, which does not split into "
                        f"gradient_accumulation_steps={steps} micro-batches over data-parallel "
                        f"size={dp}")
    m = b // (steps * dp)
    # Rows are laid out device-major (P(data) on dim 0); keep each device's rows local.
    x = x.reshape((dp, steps, m) + x.shape[1:]).swapaxes(0, 1)  # [steps, dp, m, ...]
    if not per_device:
      x = x.reshape((steps, dp * m) + x.shape[3:])
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, axes)))

  return jax.tree.map(split, args)


def _accumulate_local(vg, params, xs, nargs, steps, plan, scale, grads_sh):
  """Each device accumulates the float32 gradient of its own rows (data axes on a new leading
  dimension); the step's one reduction sums them into ``plan.grads_reduced``."""
  dp, axes, mesh = plan.data_parallel_size, plan.data_axes, plan.mesh
  reduced_sh = _like(params, plan.grads_reduced)
  # Reduced in the gradient's dtype where each use makes it (the compute dtype), as stages 2-3
  # reduce it, unless the config names one: the textbook 2 psi of stages 1-2 counts it so.
  # The accumulator stays float32 between micro-batches.
  reduce_dtype = reduce_dtype_of(plan.config) or compute_dtype_of(plan.config)

  def lead(s, nd):  # the gradient layout with the data axes on a new leading dimension
    spec = tuple(s.spec) + (None,) * (nd - len(tuple(s.spec)))
    return NamedSharding(mesh, P(axes, *spec))

  acc_sh = jax.tree.map(lambda s, p: lead(s, jnp.ndim(p)), grads_sh, params)
  grad_of_rows = jax.vmap(lambda p, *b: vg(p, *b), in_axes=(None,) + (0,) * nargs,
                          spmd_axis_name=axes)

  def local(mb, dtype=F32):
    """Each device's gradient of its own rows of ``mb`` in ``dtype``, its loss and aux."""
    (_, (loss, aux)), g = grad_of_rows(params, *mb)
    g = jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x.astype(dtype), s),
                     g, acc_sh)
    return g, (jnp.mean(loss.astype(F32)), _mean_aux(aux, 0))

  if steps == 1:  # no accumulator: reduce the local gradient itself (one buffer, not two)
    acc, outs = local(jax.tree.map(lambda x: x[0], xs), reduce_dtype or F32)
    losses, auxs = jax.tree.map(lambda x: jnp.asarray(x)[None], outs)
    # Stage 1 reduces once the backward pass is over, as the paper's P_os: every leaf's
    # reduction waits for a scalar of the whole local gradient. Without it XLA reduces each
    # leaf as soon as it exists in models without scans, and stage 1 quietly becomes a
    # stage 2 with a replicated gradient layout.
    token = _token_of_all(acc)
    acc = jax.tree.map(lambda a: after(a, token), acc)
  else:
    def body(acc, mb):
      g, outs = local(mb)
      acc = jax.tree.map(lambda a, x, s: jax.lax.with_sharding_constraint(a + x, s),
                         acc, g, acc_sh)
      return acc, outs

    acc0 = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(
        jnp.zeros((dp,) + jnp.shape(p), F32), s), params, acc_sh)
    acc, (losses, auxs) = ORIGINAL_SCAN(body, acc0, xs)

  def reduce(a, p, s):
    # The step's one gradient reduction: a sum over the sharded data-parallel axis.
    a = a.astype(reduce_dtype) if reduce_dtype is not None else a
    total = jax.lax.reduce(a, np.array(0, a.dtype), jax.lax.add, (0,))
    total = jax.lax.with_sharding_constraint(total, s)
    return _finish(total.astype(F32), steps * dp, scale, p.dtype)

  grads = jax.tree.map(reduce, acc, params, reduced_sh)
  return jnp.mean(losses), _mean_aux(auxs, 0), grads


def _accumulate_reduced(vg, params, xs, steps, scale, grads_sh):
  """A float32 accumulator in the gradient's layout: each micro-batch's gradient is reduced
  (reduce-scattered at stages 2-3) as it is made, then added."""
  constrain = (lambda t: jax.tree.map(jax.lax.with_sharding_constraint, t, grads_sh)) \
      if grads_sh is not None else (lambda t: t)
  acc0 = constrain(jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), F32), params))

  def body(acc, mb):
    (_, (loss, aux)), g = vg(params, *mb)
    acc = constrain(jax.tree.map(lambda a, x: a + x.astype(F32), acc, g))
    return acc, (loss.astype(F32), aux)

  acc, (losses, auxs) = ORIGINAL_SCAN(body, acc0, xs)
  grads = jax.tree.map(lambda a, p: _finish(a, steps, scale, p.dtype), acc, params)
  return jnp.mean(losses), _mean_aux(auxs, 0), grads


def _token_of_all(tree):
  """A finite float32 scalar that exists only once every float leaf of ``tree`` does."""
  parts = [jnp.sum(x.astype(F32)) for x in jax.tree.leaves(tree)
           if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not parts:
    return None
  t = jnp.sum(jnp.stack(parts))
  return jax.lax.stop_gradient(jnp.where(jnp.isfinite(t), t, 0.0))


def _finish(total, n, scale, dtype):
  """Mean over ``n`` micro-gradients, unscaled, in the parameter's dtype."""
  g = total / n
  if scale is not None:
    g = g / scale
  return g.astype(dtype)


def _mean_aux(aux, axis):
  def one(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return jnp.mean(x, axis=axis)
    return jnp.take(x, -1, axis=axis)
  return jax.tree.map(one, aux)
