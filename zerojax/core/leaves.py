"""The leaf rule: which dimension of each parameter leaf, and of each optimizer-state leaf that
mirrors one, is sharded over ``fsdp``.

A leaf's largest dimension that divides evenly by the ``fsdp`` axis size is sharded (ties go to
the later dimension, which keeps a scanned layer axis whole); on XLA:GPU at stage 3 a leaf of
three or more dimensions (a scanned layer's kernel) shards the first such dimension at least a
quarter the largest's size (`_sharded_dim`). A leaf under ``param_persistence_threshold``
elements, or with no divisible dimension, stays replicated and says why (`LeafPlan.reason`).
User rules and Flax partitioning metadata fix dimensions first.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.core.config import ConfigError, ZeroConfig

__all__ = ["LeafPlan", "LeafRule", "plan_leaf", "opt_param_index", "plan_opt_state",
           "metadata_specs", "unbox", "flatten", "path_str", "as_shape", "axes_of", "shard_bytes"]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """The plan of one parameter leaf.

  Attributes:
    path: the leaf's ``/``-joined path.
    shape: its shape.
    dtype: its dtype.
    sharded: the at-rest layout (a ``PartitionSpec``) when this kind of state is sharded.
    gathered: the compute layout: ``fsdp`` removed, tensor axes kept.
    reason: why the leaf is (not) sharded: ``'sharded'``, ``'threshold'``,
      ``'indivisible'``, ``'rule'``, ...
    trainable: ``False`` for a frozen leaf (no gradient, no optimizer state, still sharded).
  """

  path: str
  shape: tuple[int, ...]
  dtype: Any
  sharded: P  # at-rest layout when this kind of state is sharded
  gathered: P  # compute layout: fsdp removed, tensor axes kept
  reason: str  # why the leaf is (not) sharded: sharded | threshold | indivisible | rule | ...
  trainable: bool = True  # False: frozen (no gradient, no optimizer state), still sharded

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * np.dtype(self.dtype).itemsize

  @property
  def is_sharded(self) -> bool:
    return "fsdp" in axes_of(self.sharded)


class LeafRule(NamedTuple):
  """What the plan decides once for every leaf (`zerojax.core.plan.ShardingPlan.create`).

  Attributes:
    threshold: a leaf of fewer elements stays whole
      (`zerojax.core.backend.Backend.persistence_threshold`).
    shard_leading: a leaf of three or more dimensions shards its first large dimension
      (`_sharded_dim`), for the backend's scanned layers at stage 3.
  """
  threshold: int
  shard_leading: bool


def plan_leaf(config: ZeroConfig, mesh: Mesh, path: str, x: Any,
              meta_spec: tuple | None, rule: LeafRule) -> LeafPlan:
  shape, dtype = tuple(x.shape), x.dtype
  base, reason = None, None
  for regex, spec in config.rules:
    if re.search(regex, path):
      base, reason = _check_spec(spec, shape, mesh, f"rule {regex!r}", path), "rule"
      break
  if base is None and meta_spec is not None:
    base, reason = _check_spec(meta_spec, shape, mesh, "partitioning metadata", path), "metadata"
  base = list(base) if base is not None else [None] * len(shape)
  base += [None] * (len(shape) - len(base))
  gathered = P(*[_drop_fsdp(a) for a in base])
  if "fsdp" in axes_of(P(*base)):  # user put fsdp somewhere: respect it
    return LeafPlan(path, shape, dtype, P(*base), gathered, reason)
  f = mesh.shape.get("fsdp", 1)
  size = math.prod(shape)
  if f == 1:
    return LeafPlan(path, shape, dtype, gathered, gathered, reason or "fsdp=1")
  if size < rule.threshold:
    return LeafPlan(path, shape, dtype, gathered, gathered, "threshold")
  stacked = len(shape) >= 3 and rule.shard_leading
  best = _sharded_dim(shape, base, f, leading=stacked)
  if best is None:
    return LeafPlan(path, shape, dtype, gathered, gathered, "indivisible")
  spec = list(base)
  spec[best] = "fsdp"
  return LeafPlan(path, shape, dtype, P(*spec), gathered, reason or "sharded")


def _sharded_dim(shape: tuple[int, ...], base: list, f: int, leading: bool) -> int | None:
  """The dimension the leaf rule shards: of those free and divisible by ``f``, the largest
  (ties to the later one), or with ``leading`` the first at least a quarter the size of the
  largest.

  ``leading`` is for leaves of three or more dimensions at stage 3 on XLA:GPU, such as scanned
  layers' stacked kernels. A layer of one sharded on its first dimension past the layer axis
  is gathered as its devices' rows one after another, its own layout: the scanned layers'
  gathers and reduce-scatters (`zerojax.core.pipeline`) then need no transpose of a weight or
  of a gradient. The quarter keeps a layer axis (a few dozen layers of
  weights a few thousand wide) whole. Two-dimensional kernels (unscanned layers, gathered one
  by one) keep the largest dimension: their schedules had fewer reduce-scatters beside a
  matmul on their first (BENCHMARKS.md)."""
  free = [d for d in range(len(shape)) if base[d] is None and shape[d] % f == 0]
  if not free:
    return None
  if leading:
    largest = max(shape[d] for d in free)
    return next(d for d in free if 4 * shape[d] >= largest)
  return max(free, key=lambda d: (shape[d], d))


def opt_param_index(tx: Any, opt_state: PyTree, params: PyTree,
                     leaves: tuple[LeafPlan, ...]) -> tuple[int | None, ...]:
  """Per optimizer-state leaf, the index of the parameter leaf it mirrors, or ``None``.

  ``optax.tree_map_params`` says which state leaves are parameter-shaped, from the
  transformation itself; where it cannot (no ``tx``, or a state it does not recognise, such as
  ``optax.masked``'s), a leaf whose key path ends with a parameter's path is taken. Either way
  the shapes must agree: factored statistics (Adafactor's row and column factors) are
  parameter-structured but not parameter-shaped, and get a plan of their own.
  """
  flat = jax.tree_util.tree_flatten_with_path(opt_state)[0]
  found: list[int | None] | None = None
  if tx is not None:
    try:
      idx = jax.tree.unflatten(jax.tree.structure(params), list(range(len(leaves))))
      mapped = optax.tree_map_params(tx, lambda _, i: i, opt_state, idx,
                                     transform_non_params=lambda _: -1)
      got = jax.tree.leaves(mapped)
      if len(got) == len(flat):
        found = [None if i == -1 else i for i in got]
    except Exception:  # noqa: BLE001 - a state optax cannot map: match by path below
      found = None
  if found is None:
    by_keys = {_key_tuple(kp): i for i, (kp, _) in
               enumerate(jax.tree_util.tree_flatten_with_path(params)[0])}
    found = []
    for kp, x in flat:
      keys = _key_tuple(kp)
      found.append(next((by_keys[keys[j:]] for j in range(len(keys))
                         if keys[j:] in by_keys
                         and leaves[by_keys[keys[j:]]].shape == tuple(np.shape(x))), None))
  return tuple(i if i is not None and leaves[i].shape == tuple(np.shape(x)) else None
               for i, (_, x) in zip(found, flat))


def plan_opt_state(config, mesh, opt_state, leaves, opt_param, kind, rule):
  """Optimizer-state shardings: mirror a parameter's plan where the leaf mirrors a parameter."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
  specs, infos = [], []
  for (kp, x), i in zip(flat, opt_param):
    shape, dtype = tuple(np.shape(x)), getattr(x, "dtype", np.dtype(type(x)))
    lp = leaves[i] if i is not None else None
    if lp is None:
      lp = plan_leaf(config, mesh, path_str(kp), jax.ShapeDtypeStruct(shape, dtype), None,
                     rule)
    spec = lp.sharded if config.shards_opt_state else lp.gathered
    specs.append(NamedSharding(mesh, spec, memory_kind=kind))
    infos.append((path_str(kp), shape, dtype, spec))
  return jax.tree_util.tree_unflatten(treedef, specs), tuple(infos)


def _is_boxed(x: Any) -> bool:
  if isinstance(x, meta.AxisMetadata):
    return True
  try:
    return isinstance(x, nnx.Variable)
  except ImportError:  # pragma: no cover
    return False


def metadata_specs(tree: PyTree, mesh: Mesh) -> dict[str, tuple]:
  """Per-dimension mesh axes from Flax boxes (linen ``Partitioned``, NNX ``out_sharding``).

  Names that are not mesh axes (logical names without rules) count as unconstrained.
  """
  out = {}
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_boxed)
  for kp, x in flat:
    names = None
    if isinstance(x, meta.AxisMetadata):
      names = getattr(x, "names", None)
    elif _is_boxed(x):
      names = x.get_metadata("out_sharding", None) if hasattr(x, "get_metadata") else None
    if names is None:
      continue
    keep = lambda a: a if (a in mesh.axis_names) else (
        tuple(b for b in a if b in mesh.axis_names) or None if isinstance(a, tuple) else None)
    out[path_str(kp)] = tuple(keep(a) for a in names)
  return out


def unbox(tree: PyTree) -> PyTree:
  tree = meta.unbox(tree)
  try:
    return jax.tree.map(lambda x: x.get_value() if isinstance(x, nnx.Variable) else x, tree,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))
  except ImportError:  # pragma: no cover
    return tree


def flatten(tree):
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [path_str(kp) for kp, _ in flat], [x for _, x in flat], treedef


def _key_tuple(kp) -> tuple:
  return tuple(_key_name(k) for k in kp)


def _key_name(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def path_str(kp) -> str:
  """A key path as the plan names leaves: ``"blocks/fc/kernel"``."""
  return jax.tree_util.keystr(tuple(kp), simple=True, separator="/")


def as_shape(x):
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") else x


def axes_of(spec: P) -> tuple[str, ...]:
  out = []
  for a in spec:
    if a is None:
      continue
    out.extend(a if isinstance(a, tuple) else (a,))
  return tuple(out)


def _drop_fsdp(a):
  if a == "fsdp":
    return None
  if isinstance(a, tuple):
    rest = tuple(b for b in a if b != "fsdp")
    return rest if len(rest) > 1 else (rest[0] if rest else None)
  return a


def _check_spec(spec, shape, mesh, origin, path) -> tuple:
  spec = tuple(spec)
  if len(spec) > len(shape):
    raise ConfigError(f"{origin} gives {path!r} the spec {spec}, which has more entries than "
                      f"the leaf's {len(shape)} dimensions (shape {shape})")
  for d, a in enumerate(spec):
    axes = a if isinstance(a, tuple) else ((a,) if a is not None else ())
    for b in axes:
      if b not in mesh.axis_names:
        raise ConfigError(f"{origin} gives {path!r} the spec {spec}: axis {b!r} is not a mesh "
                          f"axis; mesh axes are {mesh.axis_names}")
    n = math.prod(mesh.shape[b] for b in axes)
    if shape[d] % n:
      raise ConfigError(f"{origin} gives {path!r} (shape {shape}) the spec {spec}: dimension "
                        f"{d} of size {shape[d]} does not divide by {n}")
  return spec


def shard_bytes(shape, dtype, spec: P, mesh: Mesh) -> int:
  n = math.prod(shape) * np.dtype(dtype).itemsize
  return n // math.prod(mesh.shape.get(a, 1) for a in axes_of(spec)) if n else 0
