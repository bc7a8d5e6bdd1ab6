"""Gradient layout: the optimizer receives each gradient laid out as the stage says.

`shard_gradients` is a stateless optax transformation that puts every gradient in the plan's
reduced layout (`ShardingPlan.grads_reduced`). XLA's partitioner then reduce-scatters each
layer's gradient where the backward pass produces it (stages 2-3), or once per optimizer step
(stage 1), instead of choosing a layout of its own, for any model and however the gradient was
computed. `prepare` chains it with clipping; `apply_before` runs a stateless transformation
ahead of an optimizer without changing the optimizer's state.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from zerojax.core.plan import ShardingPlan

__all__ = ["shard_gradients", "prepare", "prepared", "apply_before"]


def shard_gradients(plan: ShardingPlan) -> optax.GradientTransformation:
  """Lays gradients out as ``plan.grads_reduced``; a no-op when every use's backward already
  did (`ShardingPlan.gathers_per_use`) or the tree is not the plan's parameter tree."""

  def update(updates, state, params=None):
    del params
    if plan.gathers_per_use:
      return updates, state
    return _constrain_like(updates, plan.grads_reduced), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def prepare(plan: ShardingPlan, clip: float | None = None) -> optax.GradientTransformation:
  """What happens to a step's gradient before the optimizer: `shard_gradients`, then
  ``optax.clip_by_global_norm(clip)`` when ``clip`` is set (an NNX step's
  ``gradient_clipping``; linen states clip in `zerojax.ZeroTrainState.apply_gradients`)."""
  if clip is None:
    return shard_gradients(plan)
  return optax.chain(shard_gradients(plan), optax.clip_by_global_norm(clip))


def prepared(pre: optax.GradientTransformation, grads: Any, params: Any = None) -> Any:
  """``grads`` after the stateless transformation ``pre`` (e.g. `prepare`)."""
  return pre.update(grads, pre.init(params), params)[0]


def apply_before(pre: optax.GradientTransformation,
                 tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``tx`` with the stateless ``pre`` applied to its updates first. Unlike ``optax.chain``
  the state is ``tx``'s own, so a state made by ``tx.init`` works unchanged."""

  def update(updates, state, params=None, **extra):
    return tx.update(prepared(pre, updates, params), state, params, **extra)

  return optax.GradientTransformationExtraArgs(tx.init, update)


def _constrain_like(tree: Any, shardings: Any) -> Any:
  """``tree`` constrained leaf by leaf to ``shardings`` where it is the plan's parameter tree
  (same number of leaves, same shapes; an NNX ``State`` or a plain dict alike), else as is."""
  leaves, treedef = jax.tree.flatten(tree)
  specs = jax.tree.leaves(shardings)
  if len(leaves) != len(specs) or not all(
      hasattr(x, "shape") and len(s.spec) <= len(x.shape) for x, s in zip(leaves, specs)):
    return tree
  return jax.tree.unflatten(treedef, [jax.lax.with_sharding_constraint(x, s)
                                      for x, s in zip(leaves, specs)])
