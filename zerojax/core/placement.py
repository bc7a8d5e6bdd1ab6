"""Existing parameters into a plan's shards, leaf by leaf (`place`): each device receives only
its shard, read once per process. `zerojax.core.create.create_train_state` starts from such a
tree (or a lazy source with ``load(plan)``, e.g. `zerojax.runtime.weights.safetensors_source`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from zerojax.core.leaves import path_str, unbox

__all__ = ["WeightsError", "make_array", "place"]


class WeightsError(ValueError):
  """Weights do not match the parameters they are loaded into (names the leaf and tensor)."""


def make_array(read: Callable[[tuple], np.ndarray], shape, dtype, sharding) -> jax.Array:
  """``make_array_from_callback`` reading each distinct shard once per process.

  Args:
    read: ``read(index) -> np.ndarray``, the values at ``index`` (a tuple of slices).
    shape: the global shape.
    dtype: the array's dtype.
    sharding: the array's sharding; a host memory kind builds each shard on the device and
      then moves it.

  Returns:
    The global ``jax.Array``.
  """
  cache: dict[Any, np.ndarray] = {}

  def cb(index):
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key not in cache:
      cache[key] = read(index)
    return cache[key]

  mk = getattr(sharding, "memory_kind", None)
  if mk is not None and mk != "device":
    # Build each shard in device memory, then move it: one shard-sized transient per leaf.
    dev = sharding.with_memory_kind("device")
    x = jax.make_array_from_callback(tuple(shape), dev, cb, dtype=dtype)
    x = jax.device_put(x, sharding)
  else:
    x = jax.make_array_from_callback(tuple(shape), sharding, cb, dtype=dtype)
  cache.clear()
  return x


def place(params: Any, plan: Any) -> Any:
  """Puts existing parameters into ``plan.params``' layout, leaf by leaf.

  Each device receives only its shard. ``jax.ShapeDtypeStruct`` leaves stay placeholders (to be
  initialised from the model).

  Args:
    params: a pytree of numpy or jax arrays shaped like the model's parameters, or a lazy
      source with ``load(plan)``.
    plan: the `ShardingPlan` whose ``params`` shardings the leaves take.

  Returns:
    A tree shaped as ``plan.params`` of placed ``jax.Array`` (and ``jax.ShapeDtypeStruct``
    placeholders).

  Raises:
    WeightsError: the tree's structure differs from the plan's, or a leaf has another shape or
      dtype (the message names the leaf and both shapes).
  """
  if hasattr(params, "load") and callable(params.load):
    params = params.load(plan)  # checked below like any tree (its arrays are already placed)
  params = unbox(params)
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  by_path = {path_str(kp): x for kp, x in flat}
  want = {lp.path for lp in plan.leaves}
  missing = sorted(want - set(by_path))
  extra = sorted(set(by_path) - want)
  if missing or extra:
    raise WeightsError(f"params do not match the model's parameters: missing leaves "
                       f"{missing[:8]}, extra leaves {extra[:8]}")
  out, problems = [], []
  for lp, sh in zip(plan.leaves, jax.tree.leaves(plan.params)):
    x = by_path[lp.path]
    shape, dtype = tuple(np.shape(x)), np.dtype(x.dtype)
    if shape != tuple(lp.shape):
      problems.append(f"leaf {lp.path!r} has shape {shape}, the model needs {tuple(lp.shape)}")
    elif dtype != np.dtype(lp.dtype):
      problems.append(f"leaf {lp.path!r} has dtype {dtype.name}, the model needs "
                      f"{np.dtype(lp.dtype).name}")
    if problems:
      continue
    if isinstance(x, jax.ShapeDtypeStruct):
      out.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sh))
    elif isinstance(x, jax.Array):
      out.append(jax.device_put(x, sh))
    else:
      a = np.asarray(x)
      out.append(make_array(lambda idx, a=a: np.asarray(a[idx]), shape, dtype, sh))
  if problems:
    raise WeightsError(f"params do not match the model ({len(problems)} leaves differ): "
                       + "; ".join(problems[:6]))
  return jax.tree.unflatten(jax.tree.structure(plan.params), out)


# -- writing -------------------------------------------------------------------------------------
