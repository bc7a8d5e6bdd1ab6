"""Row reads: a pure-function model that reads stacked parameters one layer at a time
(``params["w"][i]`` in a Python loop) gets each row's gradient reduced where it is made.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Var, get_opaque_trace_state
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax._compat import (bind_dot_general, eval_jaxpr, jaxpr_has_primitive, source_line,
                             var_uses)
from zerojax.core import context
from zerojax.core.gather import GATHERED, after, gather, token_of
from zerojax.core.leaves import path_str
from zerojax.core.remat import checkpoint_model

__all__ = ["per_layer_reads"]


def _row_read(eqn: Any, index: dict[Any, int]) -> tuple[int, int] | None:
  """``(leaf, i)`` when ``eqn`` reads a whole row ``leaf[i]`` of a parameter (a unit ``slice``
  along axis 0, full along the others), else None."""
  k = index.get(eqn.invars[0]) if eqn.primitive.name == "slice" else None
  if k is None:
    return None
  start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
  shape, strides = eqn.invars[0].aval.shape, eqn.params.get("strides")
  if (limit[0] - start[0] == 1 and tuple(start[1:]) == (0,) * (len(shape) - 1)
      and tuple(limit[1:]) == tuple(shape[1:]) and (strides is None or set(strides) <= {1})):
    return k, start[0]
  return None


def per_layer_reads(apply_fn: Callable, plan: Any,
                    chosen: Callable[[Any], None] | None = None) -> Callable:
  """A pure-function model whose stacked parameters are read a row at a time, with each row's
  gradient reduced where it is made.

  The model is traced once and each ``w[i]`` of a leaf read that way at least twice is threaded
  from read to read (`_read_row`), so each row's cotangent is put in the gradient's layout as it
  is made and added into one gradient in place, not summed from zero-padded full-size
  cotangents at the end of the backward pass. A row that only feeds one matmul
  (``x @ params["w"][i]``) is sliced only once the matmul's other operand exists, is not kept,
  and is sliced again once the matmul's output cotangent exists (`_row_dot`); at stage 3 the
  partitioner then gathers one row, not the whole stack. Every other equation runs as written,
  so values are unchanged.

  Per use (`ShardingPlan.formulation`: stage 3 on TPU and GPU) every matmul that reads a
  sharded parameter, or a row of one, gathers it there and re-gathers it in the backward pass,
  as linen models' boxes do (`zerojax.core.gather`). A lookup into a table
  (``params["wte"][tokens]``, `zerojax.core.formulation.lookup_tables`) has that use's gradient
  summed whole before it is sharded, at stages 2-3, and per use gathers the table for it. The
  model runs under the formulation's checkpoint (`Formulation.checkpoint`), as a linen model
  without scans does. Why: docs/design.md, "Row reads".

  Args:
    apply_fn: the model, ``apply_fn(params, ...)``, reading rows as ``params["w"][i]`` in a
      Python loop.
    plan: the run's `zerojax.ShardingPlan`.
    chosen: called with the model's `zerojax.core.formulation.Formulation` once it is traced.

  Returns:
    A function with ``apply_fn``'s signature and values; ``apply_fn`` itself at stage 1
    without a checkpoint, which reduces the gradient once after the backward pass.
  """
  treedef = jax.tree.structure(plan.params)
  names = tuple(path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(plan.params)[0])
  per_leaf = list(zip(jax.tree.leaves(plan.params), jax.tree.leaves(plan.grads),
                      jax.tree.leaves(plan.params_gathered)))  # rest, grad, compute

  # At stage 1 the gradient is reduced once, after the backward pass: no row is threaded.
  if plan.local_grads and plan.formulation(None, linen=False).checkpoint is None:
    return apply_fn

  @functools.wraps(apply_fn)
  def apply(params, *args, **kwargs):
    leaves = jax.tree.leaves(params)
    flat, argdef = jax.tree.flatten((args, kwargs))
    dyn = [isinstance(x, (jax.Array, np.ndarray)) for x in flat]

    def model(ps, arrays):
      it = iter(arrays)
      a, kw = jax.tree.unflatten(argdef, [next(it) if d else x for x, d in zip(flat, dyn)])
      return apply_fn(jax.tree.unflatten(treedef, ps), *a, **kw)

    spec = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
    arrays = [x for x, d in zip(flat, dyn) if d]
    closed, out_shape = jax.make_jaxpr(model, return_shape=True)(
        [spec(x) for x in leaves], [spec(x) for x in arrays])
    index = {v: k for k, v in enumerate(closed.jaxpr.invars[:len(leaves)])}
    split = set() if plan.local_grads else _rows_to_split(closed.jaxpr, index, leaves, per_leaf)
    formulation = plan.formulation(closed, linen=False)
    if chosen is not None:
      chosen(formulation)
    if not split and not formulation.per_use and not formulation.tables:
      run = model
    else:
      rewrite = _Rewrite(leaves, per_leaf, index, split,
                         _rows_into_matmuls(closed.jaxpr, index, split), formulation.per_use,
                         plan.backend.waits_by_barrier,
                         formulation.per_use and plan.backend.prefetches_next_layer, formulation.tables,
                         names, formulation.per_use and plan.backend.orders_last_row_gradient,
                         plan.backend.reads_rows_per_device)
      run = lambda ls, arrs: jax.tree.unflatten(jax.tree.structure(out_shape), eval_jaxpr(
          closed, [*ls, *arrs], rewrite))
    if formulation.checkpoint is not None:  # as a linen model without scans
      run = checkpoint_model(run, plan, formulation.checkpoint, False)
    return run(leaves, arrays)

  return apply


_DEFERRED = object()  # stands for a row whose matmul `_row_dot` reads it itself


def _rows_to_split(jaxpr: Any, index: dict[Any, int], leaves: list, per_leaf: list) -> set[int]:
  """The leaves read a whole row at a time, at two rows or more, whose rows are laid out as
  the leaf is: those `per_layer_reads` threads from read to read."""
  rows: dict[int, set[int]] = {}
  for eqn in jaxpr.eqns:
    if (read := _row_read(eqn, index)) is not None:
      rows.setdefault(read[0], set()).add(read[1])
  return {k for k, r in rows.items()
          if len(r) >= 2 and _rows_stay_whole(per_leaf[k][:2], jnp.ndim(leaves[k]))}


@dataclasses.dataclass
class _Rewrite:
  """`eval_jaxpr`'s rewrite for `per_layer_reads`: row reads threaded, row matmuls through
  `_row_dot`, and per use every matmul of a sharded parameter gathered."""
  leaves: list
  per_leaf: list  # (rest, grad, compute) shardings per leaf
  index: dict
  split: set
  matmul: "_RowMatmuls"
  per_use: bool
  barrier: bool  # `Backend.waits_by_barrier`
  # `Backend.prefetches_next_layer`: a row matmul's gather waits for the operand of the
  # row matmul before it (``previous``), not its own, so it can run beside that matmul. The
  # step then compiles with the options for rows ahead
  # (`zerojax.core.backend.Backend.rows_ahead_options`).
  prefetch: bool = False
  tables: frozenset = frozenset()  # leaves summed whole (per use: gathered) where looked up in
  names: tuple = ()  # the leaves' paths, for warnings
  orders: bool = False  # `Backend.orders_last_row_gradient` (only under ``per_use``)
  per_device: bool = False  # `Backend.reads_rows_per_device`
  previous: Any = None
  link: Any = None  # the last row matmul's `_Link`, under ``prefetch``
  carried: dict = dataclasses.field(default_factory=dict)  # leaf -> stack the next row reads

  def __post_init__(self):
    self.lookups = _Lookups(self.tables, self.per_leaf, dict(self.index), self.names)

  def __call__(self, eqn: Any, invals: list) -> list | None:
    if eqn in self.matmul.deferred:  # the row's slice and squeeze: made by `_row_dot` instead
      return [_DEFERRED]
    if eqn in self.matmul.dots:
      k, i, pos = self.matmul.dots[eqn]
      rest, grad, compute = (_bare(s) for s in self.per_leaf[k])
      use = (_Gather.of(rest, compute, grad, self.barrier, self.per_device)
             if self.per_use else None)
      other = invals[1 - pos]
      wait = self.previous if self.prefetch and self.previous is not None else other
      link = (None, None)
      if self.prefetch and use is not None:
        if (ctx := context.current()) is not None:
          w = self.leaves[k]
          ctx.rows_ahead = max(ctx.rows_ahead, int(np.prod(w.shape[1:])) * w.dtype.itemsize)
        link = (self.link, _Link())
        self.link = link[1]
      self.previous = other
      first = k not in self.carried
      out, self.carried[k] = _row_dot(
          self.carried.get(k, self.leaves[k]), other, wait, i, pos, _Dot.of(eqn), grad,
          first, use, link, first and self.orders and use.gathers)
      return [out]
    if self.per_use and eqn.primitive.name == "dot_general":
      return _gathered_dot(eqn, invals, self.index, self.per_leaf)
    if self.tables and (looked_up := self.lookups(eqn, invals)) is not None:
      return looked_up
    read = _row_read(eqn, self.index)
    if read is None or read[0] not in self.split:
      return None  # other reads of the leaf (w[i, :4], the whole stack) run as written
    k, i = read
    row, self.carried[k] = _read_row(self.carried.get(k, invals[0]), i,
                                     _bare(self.per_leaf[k][1]))
    return [row]


_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
# Equations whose output is their operand's values in its layout: a lookup into the output is
# one into the table (`compute_dtype` casts).
_SAME_LAYOUT = frozenset({"convert_element_type", "copy", "copy_p"})
_RESHAPED = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
                       "slice", "dynamic_slice"})


@dataclasses.dataclass
class _Lookups:
  """Every spelling of a row lookup into a table, for `_Rewrite`: a ``gather`` of the table
  or of a cast of it (``params["wte"][ids]``, ``lax.gather``), also inside the ``jit`` that
  ``jnp.take`` and ``jnp.take_along_axis`` wrap around theirs. A ``one_hot @ table`` is a
  matmul, gathered per use like any. A lookup into a reshaped or sliced table is left to XLA,
  with a warning naming its source line: its gradient may then move the looked-up rows."""
  tables: frozenset
  per_leaf: list
  leaf_of: dict  # var -> the table leaf whose values (in its layout) it holds
  names: tuple
  reshaped: dict = dataclasses.field(default_factory=dict)  # var -> table leaf, other layout

  def __call__(self, eqn: Any, invals: list) -> list | None:
    name = eqn.primitive.name
    leaves = [self.leaf_of.get(v) if isinstance(v, Var) else None for v in eqn.invars]
    if name == "gather":
      if leaves[0] in self.tables:
        return _gathered_lookup(eqn, invals, self.per_leaf[leaves[0]])
      if isinstance(eqn.invars[0], Var) and eqn.invars[0] in self.reshaped:
        k = self.reshaped[eqn.invars[0]]
        name_ = self.names[k] if k < len(self.names) else f"leaf {k}"
        warnings.warn(
            f"zerojax: the lookup at {source_line(eqn)} reads parameter {name_!r} through a "
            "reshape or slice, so its gradient is left to XLA's partitioner, which may move "
            "the looked-up rows (activations) between devices; look rows up in the table as "
            "it is (table[ids], jnp.take(table, ids, axis=0))", stacklevel=2)
      return None
    hit = [k for k in leaves if k in self.tables]
    if not hit:
      for v, out in zip(eqn.invars[:1], eqn.outvars[:1]):
        if name in _RESHAPED and isinstance(v, Var) and v in self.reshaped:
          self.reshaped[out] = self.reshaped[v]
      return None
    if name in _SAME_LAYOUT:
      self.leaf_of[eqn.outvars[0]] = hit[0]
    elif name in _RESHAPED and leaves[0] in self.tables:
      self.reshaped[eqn.outvars[0]] = leaves[0]
    elif name in _CALLS and "jaxpr" in eqn.params and jaxpr_has_primitive(
        eqn.params["jaxpr"], frozenset({"gather"})):
      inner = eqn.params["jaxpr"]  # inlined, so the lookup inside is seen
      sub = _Lookups(self.tables, self.per_leaf, {
          v: k for v, k in zip(inner.jaxpr.invars, leaves) if k is not None}, self.names,
          {v: self.reshaped[o] for v, o in zip(inner.jaxpr.invars, eqn.invars)
           if isinstance(o, Var) and o in self.reshaped})
      return eval_jaxpr(inner, invals, sub)
    return None


@dataclasses.dataclass(frozen=True)
class _RowMatmuls:
  """The row reads that feed exactly one matmul: ``deferred`` holds their slice and squeeze
  equations, ``dots`` maps each such matmul to ``(leaf, row, operand position)``."""
  deferred: frozenset
  dots: dict


def _rows_into_matmuls(jaxpr: Any, index: dict[Any, int], split: set[int]) -> _RowMatmuls:
  """Finds ``dot_general(x, squeeze(w[i:i+1]))`` (either operand) where the row is used by
  nothing else, for the leaves in ``split``."""
  uses = var_uses(jaxpr)
  deferred, dots = set(), {}
  for eqn in jaxpr.eqns:
    read = _row_read(eqn, index)
    if read is None or read[0] not in split:
      continue
    (sq, _), *more = uses.get(eqn.outvars[0], [(None, -1)])
    if (more or sq is None or sq.primitive.name != "squeeze"
        or tuple(sq.params["dimensions"]) != (0,)):
      continue
    (dot, pos), *more = uses.get(sq.outvars[0], [(None, -1)])
    if (more or dot is None or dot.primitive.name != "dot_general" or dot in dots
        or dot.invars[0] is dot.invars[1]):
      continue
    deferred.update((eqn, sq))
    dots[dot] = (*read, pos)
  return _RowMatmuls(frozenset(deferred), dots)


@dataclasses.dataclass(frozen=True)
class _Dot:
  """A ``dot_general`` equation's parameters, hashable (a static argument of `_row_dot`)."""
  params: tuple

  @classmethod
  def of(cls, eqn: Any) -> "_Dot":
    return cls(tuple(sorted(eqn.params.items())))

  def __call__(self, row: jax.Array, other: jax.Array, pos: int) -> jax.Array:
    a, b = (other, row) if pos == 1 else (row, other)
    return bind_dot_general(a, b, dict(self.params))


def _row(w: jax.Array, i: int, operand: jax.Array, gathered: Any, grad: NamedSharding
         ) -> jax.Array:
  """``w[i]``, sliced only once ``operand`` (an array the caller is about to use it with)
  exists: the index waits for ``operand`` (`after`), which orders one scalar rather than a
  pass over the row. A row gathered per use waits as the plan says (``gathered.barrier``, or
  on each device, `_row_per_device`); one read where it is (stage 2) always waits for a summed
  scalar (docs/design.md, "Row reads")."""
  if gathered is not None and gathered.per_device and gathered.gathers:
    row = _row_per_device(w, i, operand, gathered.rest)
    if row is not None:
      return row
  barrier = gathered is not None and gathered.barrier
  i = after(jnp.asarray(i, jnp.int32), token_of(operand, barrier))
  return jax.lax.dynamic_index_in_dim(w, i, axis=0, keepdims=False)


def _row_per_device(w: jax.Array, i: int, operand: jax.Array, rest: NamedSharding
                    ) -> jax.Array | None:
  """``w[i]`` in the row's layout ``rest``, each device slicing its shard once its own part
  of ``operand`` exists: the index is ``i`` plus zero times (a finite copy of) that device's
  first element of it. The compiler cannot fold that index, and no value crosses devices
  when ``operand`` is split on its leading dimension. None where ``operand`` offers no such
  element (not floating point, or its leading dimension does not split over the devices)."""
  mesh, n = rest.mesh, rest.mesh.size
  if not jnp.issubdtype(operand.dtype, jnp.inexact) or operand.ndim == 0 or (
      operand.shape[0] % n):
    return None
  # One element of each device's part of the rows.
  firsts = jax.lax.stop_gradient(operand.reshape(n, -1)[:, 0])

  def local(shard, first):
    t = first[0].astype(jnp.float32)
    zero = (jnp.where(jnp.isfinite(t), t, 0.0) * 0).astype(jnp.int32)
    return jax.lax.dynamic_index_in_dim(shard, i + zero, axis=0, keepdims=False)

  return jax.shard_map(local, mesh=mesh, in_specs=(P(None, *rest.spec), P(mesh.axis_names)),
                       out_specs=rest.spec, check_vma=False)(w, firsts)


class _Link:
  """Between a row matmul and the one after it (under prefetch): the later one's output
  cotangent, set when its backward pass begins, which the earlier one's re-gather waits for,
  so that it runs beside the later one's backward matmuls. Identity-hashed: a static argument
  of `_row_dot`."""

  def __init__(self):
    self.cotangent, self.trace = None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9, 10))
def _row_dot(w: jax.Array, other: jax.Array, wait: jax.Array, i: int, pos: int, dot: _Dot,
             grad: NamedSharding, first: bool, gathered: "_Gather | None",
             link: tuple = (None, None), last: bool = False) -> tuple[jax.Array, jax.Array]:
  """``(dot(w[i], other), w)``: a matmul with a row of ``w``, and ``w`` to read the next row
  from (threaded as in `_read_row`; ``first``: no read of ``w`` came before). The row is
  sliced after ``wait`` exists (``other``, or the previous row matmul's operand: see
  `_Rewrite.prefetch`) and not saved: the backward pass slices it again after the output's
  cotangent exists (under prefetch, the next row matmul's: ``link``, a pair of `_Link`). Per use (``gathered``), the row is gathered for the matmul, both
  times, and only its shard is ever saved.

  Except the first read's row, which is saved, so that every read of ``w`` is ordered before
  its update by data dependency (docs/design.md, "Row reads"). With ``last``
  (`zerojax.core.backend.Backend.orders_last_row_gradient`; that first read, the backward
  pass's last row matmul of ``w``), the backward pass makes the row's cotangent before the
  other operand's.
  """
  use = gathered or (lambda r: r)
  return dot(use(_row(w, i, wait, gathered, grad)), other, pos), w


def _row_dot_fwd(w, other, wait, i, pos, dot, grad, first, gathered, link, last):
  row = _row(w, i, wait, gathered, grad)
  use = gathered or (lambda r: r)
  return (dot(use(row), other, pos), w), (w, other, row if first else None)


def _row_dot_bwd(i, pos, dot, grad, first, gathered, link, last, res, cts):
  w, other, saved = res
  ct_out, ct_w = cts
  earlier, mine = link
  trace = get_opaque_trace_state()
  if earlier is not None:  # the row matmul before this one re-gathers once this cotangent is
    earlier.cotangent, earlier.trace = ct_out, trace
  wait = mine.cotangent if mine is not None and mine.trace == trace else ct_out
  row = saved if first else _row(w, i, wait, gathered, grad)
  row = gathered(row) if gathered is not None else row
  _, vjp_row = jax.vjp(lambda r: dot(r, other, pos), row)
  ct_row, = vjp_row(ct_out)
  if last:
    # The other operand's cotangent is made only once the row's exists, so that the row's
    # reduce-scatter has that matmul to run beside (left free, XLA:GPU may make the first
    # layer's row gradients last, beside nothing). Later rows are left free: so ordered,
    # XLA:GPU waited for each reduce-scatter at once.
    ct_out, _ = jax.lax.optimization_barrier((ct_out, ct_row))
  _, vjp_other = jax.vjp(lambda o: dot(row, o, pos), other)
  ct_other, = vjp_other(ct_out)
  return _add_row(ct_w, ct_row, i, grad), ct_other, None


_row_dot.defvjp(_row_dot_fwd, _row_dot_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _read_row(w: jax.Array, i: int, grad: NamedSharding) -> tuple[jax.Array, jax.Array]:
  """``(w[i:i+1], w)``: a row of ``w``, and ``w`` itself to read the next row from.

  Threading ``w`` through every read chains the reads' backward passes: each adds its row's
  cotangent into the stacked gradient carried back from the later reads, in place, as the
  row's cotangent is made (autodiff's own rule would give every read a zero-padded
  full-size cotangent and sum them at the end). The row's cotangent is first put in the
  gradient's layout ``grad``: reduce-scattered where it is made.
  """
  return jax.lax.slice_in_dim(w, i, i + 1, axis=0), w


def _read_row_fwd(w, i, grad):
  return _read_row(w, i, grad), None


def _read_row_bwd(i, grad, _, cts):
  ct_row, ct_w = cts
  return (_add_row(ct_w, ct_row[0], i, grad),)


_read_row.defvjp(_read_row_fwd, _read_row_bwd)


def _add_row(ct_w: jax.Array, ct_row: jax.Array, i: int, grad: NamedSharding) -> jax.Array:
  """``ct_w`` with ``ct_row`` added into row ``i`` in place, after putting ``ct_row`` in the
  gradient's layout ``grad`` (reduce-scattered where it is made)."""
  ct_w = jax.lax.with_sharding_constraint(ct_w, grad)
  ct_row = jax.lax.with_sharding_constraint(ct_row, _of_row(grad))[None]
  old = jax.lax.dynamic_slice_in_dim(ct_w, i, 1, axis=0)
  ct_w = jax.lax.dynamic_update_slice_in_dim(ct_w, old + ct_row.astype(ct_w.dtype), i, axis=0)
  return jax.lax.with_sharding_constraint(ct_w, grad)


@dataclasses.dataclass(frozen=True)
class _Gather:
  """A parameter's (or, through `of`, a row's) layouts at rest, in compute and as a gradient:
  its per-use gather (hashable, a static argument of `_row_dot`)."""
  rest: NamedSharding
  compute: NamedSharding
  grad: NamedSharding
  barrier: bool = False  # how a row read for it waits (`Backend.waits_by_barrier`)
  per_device: bool = False  # or on each device (`Backend.reads_rows_per_device`)

  @classmethod
  def of(cls, rest: NamedSharding, compute: NamedSharding, grad: NamedSharding,
         barrier: bool, per_device: bool = False) -> "_Gather":
    return cls(_of_row(rest), _of_row(compute), _of_row(grad), barrier, per_device)

  @property
  def gathers(self) -> bool:
    """Whether the row moves (stage 3); else it is read where it is (stage 2)."""
    return self.rest != self.compute

  def __call__(self, row: jax.Array) -> jax.Array:
    if not self.gathers:
      return row
    return checkpoint_name(gather(row, self.rest, self.compute, self.grad, None), GATHERED)


def _gathered_dot(eqn: Any, invals: list, index: dict[Any, int], per_leaf: list) -> list:
  """A matmul that reads a whole sharded parameter, with the parameter gathered for it (and
  re-gathered for its backward pass where a remat policy drops `GATHERED` values)."""
  ins = list(invals)
  for pos, v in enumerate(eqn.invars[:2]):
    k = index.get(v)
    if k is None:
      continue
    rest, grad, compute = (_bare(s) for s in per_leaf[k])
    ins[pos] = _Gather(rest, compute, grad)(ins[pos])
  return [bind_dot_general(*ins, eqn.params)]


def _gathered_lookup(eqn: Any, invals: list, layouts: tuple) -> list:
  """A lookup into a table (its ``gather``) whose gradient is sharded: the table is gathered
  for it (stage 3) and this use's gradient summed whole before it is sharded, as a linen
  table's box does, so no device moves the batch's activations (docs/design.md, "Row
  reads")."""
  rest, grad, compute = (_bare(s) for s in layouts)
  table = checkpoint_name(gather(invals[0], rest, compute, grad, None, True), GATHERED)
  return [eqn.primitive.bind(table, *invals[1:], **eqn.params)]


def _of_row(s: NamedSharding) -> NamedSharding:
  """The layout of a row ``w[i]`` of a leaf laid out as ``s``."""
  return NamedSharding(s.mesh, P(*tuple(s.spec)[1:]))


def _rows_stay_whole(shardings: tuple, ndim: int) -> bool:
  """Whether a row ``w[i]`` of a leaf is laid out as the leaf is (axis 0 never sharded)."""
  return ndim >= 2 and all(
      not tuple(s.spec) or tuple(s.spec)[0] is None for s in shardings)


def _bare(s: NamedSharding) -> NamedSharding:
  """``s`` on the device (offload is not handled per row)."""
  return NamedSharding(s.mesh, s.spec)
