"""Master weights in the optimizer state: low-precision parameters, a full-precision update.

ZeRO's memory accounting (2 + 2 + 12 bytes per parameter with mixed-precision Adam) assumes
that the model holds its parameters in the compute dtype and that the float32 master copy is
part of the optimizer state, sharded with it (stages 1-3) and, with
`NvmeOffload`, kept on disk with it (ZeRO-Infinity). `master_weights` is that as
an optax transformation: it wraps any transformation, which then runs on the master copy.

Example::

  config = zerojax.ZeroConfig(
      stage=3, precision=zerojax.Precision(param="bfloat16", compute="bfloat16"))
  tx = zerojax.master_weights(optax.adamw(1e-4))       # float32 master, mu and nu
  state, plan = zerojax.create_train_state(model, tx, rng, x, config=config)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["MasterWeightsState", "master_weights"]


class MasterWeightsState(NamedTuple):
  """The optimizer state of `master_weights`.

  Attributes:
    master: the parameters in the master dtype.
    inner_state: the wrapped transformation's state, made for ``master``.
  """
  master: Any
  inner_state: Any


def master_weights(inner: optax.GradientTransformation,
                   dtype: Any = jnp.float32) -> optax.GradientTransformation:
  """``inner`` run on a master copy of the parameters in ``dtype``.

  The gradient is cast to ``dtype``, ``inner`` updates the master copy, and the update
  returned moves each parameter to its master value rounded to the parameter's dtype
  (``optax.apply_updates`` adds it in ``dtype`` and rounds once). The update is elementwise
  wherever ``inner``'s is, so it streams through ``offload_optimizer='nvme'``.

  Args:
    inner: the optax transformation to run in full precision (e.g. ``optax.adamw(1e-4)``).
    dtype: the master dtype, a floating dtype (default float32).

  Returns:
    An ``optax.GradientTransformation`` whose state is a `MasterWeightsState` and whose
    ``update(updates, state, params)`` needs ``params``.

  Raises:
    ValueError: ``dtype`` is not a floating dtype, or ``update`` is called without params.
  """
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"master_weights(dtype={dtype.name!r}): the master dtype must be a "
                     "floating dtype such as 'float32'")

  def init(params):
    master = jax.tree.map(lambda p: jnp.asarray(p).astype(dtype), params)
    return MasterWeightsState(master, inner.init(master))

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("master_weights needs the parameters: call update(grads, state, "
                       "params); it moves each parameter to its master value")
    grads = jax.tree.map(lambda g: g.astype(dtype), updates)
    steps, inner_state = inner.update(grads, state.inner_state, state.master)
    master = optax.apply_updates(state.master, steps)
    # In ``dtype``, so that p + (m - p) rounds to the parameter's dtype once.
    moves = jax.tree.map(lambda m, p: m - p.astype(dtype), master, params)
    return moves, MasterWeightsState(master, inner_state)

  return optax.GradientTransformation(init, update)
