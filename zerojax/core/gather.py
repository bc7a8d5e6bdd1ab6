"""Per-use gathering: a sharded parameter reaches the layer that reads it, and its gradient
leaves in the stage's layout.

Each parameter is wrapped in a `ZeroParam` box that Flax unboxes exactly where a layer reads
it, applying `gather`: an identity with a custom VJP. Forward, it moves the at-rest layout to
the compute layout (an all-gather at stage 3, in the compute dtype); backward, it puts the
cotangent of that one use in the gradient's layout (a reduce-scatter), in ``reduce_dtype``.
The gathered value is named `GATHERED`, so the remat policies never save it for the backward
pass (`zerojax.core.remat`). Which models are boxed is decided in `zerojax.core.formulation`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from flax.core import meta
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.core.context import tracing
from zerojax.core.dtypes import compute_dtype_of, reduce_dtype_of
from zerojax.core.memory_kinds import HOST

__all__ = ["GATHERED", "zerojax_gather", "gather", "fetch",
           "after", "token_of", "ZeroParam", "box_params"]


GATHERED = "zerojax_gathered"


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def zerojax_gather(w: jax.Array, at_rest: NamedSharding, compute: NamedSharding,
                   grad: NamedSharding, reduce_dtype: Any, whole: bool = False) -> jax.Array:
  """Identity that moves ``w`` from its at-rest to its compute layout; see module doc.
  ``whole``: the gradient is summed whole (in the compute layout) before it is sharded, so
  a table's lookups are scatter-added per device (`zerojax.core.formulation.lookup_tables`)."""
  if at_rest == compute:
    # Nothing to gather (stages 0-2). Returning ``w`` itself, not a constrained copy, lets a
    # scan forward the layer's slice of the stacked parameter as its residual instead of
    # saving a second, stacked copy of every weight.
    return w
  w = jax.lax.with_sharding_constraint(w, at_rest)
  return jax.lax.with_sharding_constraint(w, compute)


gather = zerojax_gather


def _gather_fwd(w, at_rest, compute, grad, reduce_dtype, whole):
  return zerojax_gather(w, at_rest, compute, grad, reduce_dtype, whole), None


def _gather_bwd(at_rest, compute, grad, reduce_dtype, whole, _, ct):
  made = tracing().made_grads
  if made is not None:
    made.add(jax.lax.stop_gradient(ct))
  dtype = ct.dtype
  if reduce_dtype is not None:
    ct = ct.astype(reduce_dtype)
  if whole:
    ct = jax.lax.with_sharding_constraint(ct, compute)
  ct = jax.lax.with_sharding_constraint(ct, grad)
  return (ct.astype(dtype),)


zerojax_gather.defvjp(_gather_fwd, _gather_bwd)


def fetch(w: jax.Array, device: NamedSharding) -> jax.Array:
  """Host -> device copy of an offloaded shard (its gradient goes back to host memory)."""
  return jax.device_put(w, device)


def after(w: jax.Array, token: jax.Array | None) -> jax.Array:
  """``w``, computed only once ``token`` (from `token_of`) is, with the same value.

  A scalar token orders by a data dependency, ``w + 0 * token``: the sum is ``w`` bit for bit
  (the token is finite) except that ``-0.0`` becomes ``+0.0``. An array token orders by an
  optimization barrier over ``(w, token)``, which computes nothing; its gradient passes
  through unbarriered, so the backward pass is free to combine and reorder as before.
  """
  if token is None:
    return w
  if jnp.ndim(token) == 0:
    return w + (token * 0).astype(w.dtype)
  return _behind(w, token)


@jax.custom_vjp
def _behind(w: jax.Array, token: jax.Array) -> jax.Array:
  return jax.lax.optimization_barrier((w, token))[0]


_behind.defvjp(lambda w, token: (_behind(w, token), None), lambda _, ct: (ct, None))


def token_of(tree: Any, barrier: bool) -> jax.Array | None:
  """What work ordered after ``tree`` (by `after`) waits for; None if it holds no float array.

  With ``barrier`` (`Backend.waits_by_barrier`), the first float array itself, which
  `after` orders by an optimization barrier. Else a finite float32 scalar of that array (a sum:
  one pass over it, and an all-reduce of the scalar when the array is sharded).
  """
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact):
      if barrier:
        return jax.lax.stop_gradient(x)
      t = jnp.sum(x.astype(jnp.float32))
      return jax.lax.stop_gradient(jnp.where(jnp.isfinite(t), t, 0.0))
  return None


class ZeroParam(struct.PyTreeNode, meta.AxisMetadata):
  """A parameter with the layouts it has at rest, in compute and as a gradient."""

  value: Any
  mesh: Any = struct.field(pytree_node=False)
  at_rest: tuple = struct.field(pytree_node=False)
  compute: tuple = struct.field(pytree_node=False)
  grad: tuple = struct.field(pytree_node=False)
  reduce_dtype: Any = struct.field(pytree_node=False, default=None)
  offloaded: bool = struct.field(pytree_node=False, default=False)
  # Inside the quantised formulation's shard_map: zerojax's own collectives (`ManualGather`).
  manual: Any = struct.field(pytree_node=False, default=None)
  # Cast before the gather, so the all-gather moves the compute dtype (ZeRO's bf16 gathers).
  compute_dtype: Any = struct.field(pytree_node=False, default=None)
  # A table the model looks rows up in: its gradient is summed whole before it is sharded.
  lookup: bool = struct.field(pytree_node=False, default=False)
  # How a layer re-gathering it waits for its input (`Backend.waits_by_barrier`).
  barrier: bool = struct.field(pytree_node=False, default=False)

  def unbox(self) -> jax.Array:
    if self.manual is not None:
      return self.manual(self)
    v = self.value
    if not isinstance(v, jax.Array) or not jnp.issubdtype(v.dtype, jnp.inexact):
      return v
    ns = lambda s: NamedSharding(self.mesh, P(*_of_rank(s, jnp.ndim(v))))
    if self.offloaded:  # this layer's shard comes from pinned_host just before use
      # (of the value's rank: inside a scan over layers the box holds one layer's slice)
      v = fetch(v, NamedSharding(self.mesh, P(*_of_rank(self.at_rest, jnp.ndim(v))),
                                 memory_kind="device"))
    if self.compute_dtype is not None and jnp.issubdtype(v.dtype, jnp.floating):
      v = v.astype(self.compute_dtype)
    if self.at_rest != self.compute:
      v = after(v, tracing().wait_for)
    out = gather(v, ns(self.at_rest), ns(self.compute), ns(self.grad), self.reduce_dtype,
                 self.lookup)
    return checkpoint_name(out, GATHERED)

  def replace_boxed(self, val: Any) -> "ZeroParam":
    return self.replace(value=val)

  # User code may read a parameter through ``self.variables`` (e.g. a tied LM head as
  # ``variables["params"]["wte"]["embedding"].T``) and so meet the box itself: it then acts as
  # the gathered array, so the box never leaks into the model's arithmetic.
  def __jax_array__(self) -> jax.Array:
    return self.unbox()

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") or name in {f.name for f in dataclasses.fields(self)}:
      raise AttributeError(name)
    return getattr(self.unbox(), name)

  def __getitem__(self, idx: Any) -> jax.Array:
    return self.unbox()[idx]

  # A gather keeps the global shape, so shape questions (``if self.scale``, ``len``) need none.
  @property
  def shape(self) -> tuple:
    return jnp.shape(self.value)

  def __len__(self) -> int:
    return len(self.value)

  def __matmul__(self, other: Any) -> jax.Array:
    return self.unbox() @ other

  def __rmatmul__(self, other: Any) -> jax.Array:
    return other @ self.unbox()

  def add_axis(self, index: int, params: dict[Any, Any]) -> "ZeroParam":
    ins = lambda s: s[:index] + (None,) + s[index:]
    return self.replace(at_rest=ins(self.at_rest), compute=ins(self.compute), grad=ins(self.grad))

  def remove_axis(self, index: int, params: dict[Any, Any]) -> "ZeroParam":
    rm = lambda s: s[:index] + s[index + 1:]
    return self.replace(at_rest=rm(self.at_rest), compute=rm(self.compute), grad=rm(self.grad))


def _of_rank(spec: tuple, ndim: int) -> tuple:
  """``spec`` for a value of ``ndim`` dimensions. NNX's ``nnx.scan`` slices a box's value along
  its leading (layer) axis without telling the box, so a leading unsharded axis is dropped."""
  extra = len(spec) - ndim
  if extra <= 0:
    return spec
  if any(s is not None for s in spec[:extra]):
    raise ValueError(f"zerojax: a parameter laid out as {spec} was sliced to {ndim} "
                     "dimensions along a sharded axis; shard the layer axis of a scanned "
                     "stack with nothing (ZeroConfig's plan never does)")
  return spec[extra:]


def box_params(params: Any, plan: Any, lookups: frozenset[int] = frozenset(),
               only_lookups: bool = False) -> Any:
  """Wraps every parameter leaf in a `ZeroParam` carrying the plan's layouts; ``lookups``: the
  leaves (in tree order) that are lookup tables (`zerojax.core.formulation.lookup_tables`).

  ``only_lookups``: box the tables alone, for a plan whose parameters are not gathered per use
  (stage 2). Their boxes move nothing, but sum each use's gradient whole before it is
  sharded, so the partitioner does not all-gather the batch's cotangent rows to scatter-add
  them into each device's shard. Per use, not per table: a tied head's matmul gradient, added
  to the lookup's scatter-add before the sum, became the scatter's operand and XLA all-reduced
  it."""
  cfg = plan.config
  reduce_dtype = reduce_dtype_of(cfg)
  compute_dtype = compute_dtype_of(cfg)
  spec = lambda s, nd: tuple(s) + (None,) * (nd - len(tuple(s)))

  def one(x, at_rest, compute, grad, lookup):
    nd = jnp.ndim(x)
    return ZeroParam(x, plan.mesh, spec(at_rest.spec, nd), spec(compute.spec, nd),
                     spec(grad.spec, nd), reduce_dtype,
                     offloaded=at_rest.memory_kind == HOST, compute_dtype=compute_dtype,
                     lookup=lookup, barrier=plan.backend.waits_by_barrier)

  leaves, treedef = jax.tree.flatten(params)
  tables = jax.tree.unflatten(treedef, [i in lookups for i in range(len(leaves))])
  box = lambda x, *rest: one(x, *rest) if rest[-1] or not only_lookups else x
  return jax.tree.map(box, params, plan.params, plan.params_gathered, plan.grads, tables)
