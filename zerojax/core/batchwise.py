"""Whether a layer computes each batch row on its own, so that it may run per device on its
rows (`zerojax.core.pipeline`) and give what XLA's partitioner would give.

A function is *row-parallel* in some of its inputs when every output either holds rows (one
axis along which each device's slice of the output depends only on the same device's rows of
those inputs) or is the same on every device. Per device, a reduction over rows, a matmul
contracting them, an iota or random draw along them, or a reshape that moves them would each
compute something else than the whole batch does, with no error. `row_axes` reads the answer
from two traces of the function: at the given shapes, and with every row input's leading
dimension doubled. The two jaxprs must match equation by equation, with the same numbers and
constants (``x / x.shape[0]`` would divide by one device's rows); a value's row axis is the
one axis whose size doubled, and each equation is checked against what its primitive does
along that axis. A primitive this module does not know may not read rows.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend.core import Literal

__all__ = ["row_axes", "NotRowwise"]


class NotRowwise(Exception):
  """The function mixes batch rows (the message says where)."""


# Each output element from the same element of each operand (operands of one shape).
_ELEMENTWISE = frozenset("""
  abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp clz complex conj
  convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor
  ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul name ne neg
  nextafter not or population_count pow real reduce_precision rem round rsqrt select_n
  shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient
  sub tan tanh xor
""".split())
_REDUCE = frozenset("""reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or
  reduce_xor argmax argmin""".split())
_CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())
# Fused kernels over batch-leading operands (cuDNN's attention: layouts BTNH and BNTH), each
# row's outputs from the same row's inputs unless they draw random numbers (dropout).
_BATCH_LEADING = frozenset({"dot_product_attention_fwd_wrapper"})
# Calls of a jaxpr whose inputs and outputs are the equation's own (the primal, for custom
# derivatives: a custom rule differentiates what the primal computes).
_CALLS = frozenset("""pjit jit closed_call core_call remat checkpoint remat2 custom_jvp_call
  custom_vjp_call custom_vjp_call_jaxpr""".split())


def row_axes(fn: Callable, args: Sequence[Any], rows: Sequence[bool]
             ) -> tuple[list[int | None], Any]:
  """The row axis of each output leaf of ``fn(*args)`` (``None``: the same on every device),
  where ``rows[i]`` says whether every leaf of ``args[i]`` holds batch rows on its leading
  axis (the others are the same on every device), and the jaxpr of ``fn`` at ``args``.
  ``args`` are shapes (``jax.ShapeDtypeStruct``) or arrays. Raises `NotRowwise` where ``fn``
  mixes rows."""
  twice = [jax.tree.map(lambda a: _doubled(a), a) if r else a for a, r in zip(args, rows)]
  j1 = jax.make_jaxpr(fn)(*args)
  j2 = jax.make_jaxpr(fn)(*twice)
  axes = [0 if r else None for a, r in zip(args, rows) for _ in jax.tree.leaves(a)]
  return _walk(j1.jaxpr, j2.jaxpr, axes), j1


def _doubled(a: Any) -> jax.ShapeDtypeStruct:
  shape = tuple(a.shape)
  if not shape:
    raise NotRowwise("a row input is a scalar")
  return jax.ShapeDtypeStruct((2 * shape[0],) + shape[1:], a.dtype)


def _shape(v: Any) -> tuple[int, ...]:
  return tuple(getattr(v.aval, "shape", ()))


def _axis_of(s1: tuple, s2: tuple, where: str) -> int | None:
  """The axis that doubled from ``s1`` to ``s2`` (None if none changed)."""
  if len(s1) != len(s2):
    raise NotRowwise(f"{where}: its rank depends on the batch size")
  changed = [d for d, (a, b) in enumerate(zip(s1, s2)) if a != b]
  if not changed:
    return None
  if len(changed) > 1 or s2[changed[0]] != 2 * s1[changed[0]]:
    raise NotRowwise(f"{where}: shape {s1} scales with the batch on several axes")
  return changed[0]


def _walk(j1: Any, j2: Any, in_axes: list[int | None]) -> list[int | None]:
  """Propagates row axes through two traces of one function (see module doc)."""
  if len(j1.eqns) != len(j2.eqns):
    raise NotRowwise("its computation depends on the batch size")
  env: dict[Any, int | None] = {}
  read = lambda v: None if isinstance(v, Literal) else env.get(v)
  for v1, v2, ax in zip(j1.invars, j2.invars, in_axes):
    env[v1] = _checked(ax, _axis_of(_shape(v1), _shape(v2), "an input"), "an input")
  for v1, v2 in zip(j1.constvars, j2.constvars):
    if _shape(v1) != _shape(v2):
      raise NotRowwise(f"a constant of shape {_shape(v1)} depends on the batch size")
    env[v1] = None
  for e1, e2 in zip(j1.eqns, j2.eqns):
    name = e1.primitive.name
    if name != e2.primitive.name:
      raise NotRowwise("its computation depends on the batch size")
    for a, b in zip(e1.invars, e2.invars):  # a number computed from the batch size
      if isinstance(a, Literal) and not np.array_equal(a.val, getattr(b, "val", None)):
        raise NotRowwise(f"{name} uses a number that depends on the batch size ({a.val})")
    ins = [read(v) for v in e1.invars]
    outs = _rule(name, e1, e2, ins)
    for o1, o2, ax in zip(e1.outvars, e2.outvars, outs):
      env[o1] = _checked(ax, _axis_of(_shape(o1), _shape(o2), name), name)
  return [read(v) for v in j1.outvars]


def _checked(expected: int | None, seen: int | None, where: str) -> int | None:
  if expected != seen:
    raise NotRowwise(f"{where}: rows expected on axis {expected}, the batch scales axis {seen}")
  return expected


def _rule(name: str, e1: Any, e2: Any, ins: list[int | None]) -> list[int | None]:
  """Row axes of an equation's outputs from its inputs'; raises where rows would mix."""
  p = e1.params
  rowed = [a for a in ins if a is not None]
  n_out = len(e1.outvars)
  if not rowed:
    return [_unrowed(name, e1, e2, k) for k in range(n_out)]
  if name in _ELEMENTWISE or name == "optimization_barrier":
    if name == "optimization_barrier":
      return ins
    if len(set(rowed)) > 1:
      raise NotRowwise(f"{name} combines rows on different axes")
    return [rowed[0]] * n_out
  (d,) = set(rowed) if len(set(rowed)) == 1 else (None,)
  if name == "dot_general":
    return [_dot(p, ins, len(_shape(e1.invars[0])))]
  if name in _REDUCE:
    if d in p["axes"]:
      raise NotRowwise(f"{name} reduces over the batch rows")
    return [d - sum(a < d for a in p["axes"])] * n_out
  if name in _CUMULATIVE:
    if p["axis"] == d:
      raise NotRowwise(f"{name} accumulates along the batch rows")
    return [d]
  if name == "transpose":
    return [list(p["permutation"]).index(ins[0])]
  if name == "broadcast_in_dim":
    return [p["broadcast_dimensions"][ins[0]]]
  if name == "reshape":
    if ins[0] != 0:
      raise NotRowwise("reshape of a value whose rows are not its leading axis")
    return [0]  # the doubled axis of the output is checked to be the leading one
  if name == "squeeze":
    if d in p["dimensions"]:
      raise NotRowwise("squeeze of the batch axis")
    return [d - sum(a < d for a in p["dimensions"])]
  if name in ("concatenate", "split"):
    axis = p["dimension"] if name == "concatenate" else p["axis"]
    if d is None or axis == d or len(rowed) != len(ins):
      raise NotRowwise(f"{name} along or across the batch rows")
    return [d] * n_out
  if name == "pad":
    if d is None or ins[1] is not None or tuple(p["padding_config"][d]) != (0, 0, 0):
      raise NotRowwise("pad along the batch rows")
    return [d]
  if name == "slice":
    s = _shape(e1.invars[0])
    stride = (p["strides"] or [1] * len(s))[d]
    if (p["start_indices"][d], p["limit_indices"][d], stride) != (0, s[d], 1):
      raise NotRowwise("slice of the batch rows")
    return [d]
  if name == "dynamic_slice":
    if ins[0] is None or any(a is not None for a in ins[1:]):
      raise NotRowwise("dynamic_slice indexed by batch rows")
    if p["slice_sizes"][ins[0]] != _shape(e1.invars[0])[ins[0]]:
      raise NotRowwise("dynamic_slice of the batch rows")
    return [ins[0]]
  if name == "dynamic_update_slice":
    if ins[0] is None or ins[1] != ins[0] or any(a is not None for a in ins[2:]):
      raise NotRowwise("dynamic_update_slice across the batch rows")
    return [ins[0]]
  if name in ("rev", "sort", "top_k"):
    along = (p["dimensions"] if name == "rev" else
             (p["dimension"],) if name == "sort" else (len(_shape(e1.invars[0])) - 1,))
    if d is None or d in along or len(rowed) != len(ins):
      raise NotRowwise(f"{name} along the batch rows")
    return [d] * n_out
  if name in _CALLS:
    return _call(e1, e2, ins)
  if name in _BATCH_LEADING:
    if d != 0 or p.get("dropout_rate", 0.0):
      raise NotRowwise(f"{name} with rows on axis {d} or with dropout")
    return [0] * n_out
  if name == "cond":
    if ins[0] is not None:
      raise NotRowwise("cond whose branch depends on batch rows")
    outs = [_walk(b1.jaxpr, b2.jaxpr, ins[1:])
            for b1, b2 in zip(p["branches"], e2.params["branches"])]
    if any(o != outs[0] for o in outs):
      raise NotRowwise("cond branches put rows on different axes")
    return outs[0]
  if name == "scan":
    return _scan(e1, e2, ins)
  raise NotRowwise(f"{name} reads batch rows (zerojax does not know what it does with them)")


def _unrowed(name: str, e1: Any, e2: Any, k: int) -> int | None:
  """An output computed from values that are the same on every device: the same everywhere,
  or (broadcast, iota along another axis) constant along the axis that scales with rows."""
  d = _axis_of(_shape(e1.outvars[k]), _shape(e2.outvars[k]), name)
  if d is None:
    return None
  p = e1.params
  if name == "broadcast_in_dim" or (name == "iota" and p["dimension"] != d):
    return d
  if name in _CALLS:
    return _call(e1, e2, [None] * len(e1.invars))[k]
  raise NotRowwise(f"{name} makes a batch-sized value that differs along the rows")


def _dot(p: dict, ins: list[int | None], lhs_rank: int) -> int:
  """Output axes: batch dimensions, then the lhs's free axes, then the rhs's."""
  (lc, rc), (lb, rb) = p["dimension_numbers"]
  la, ra = ins
  if la is not None and ra is not None:
    if la in lb and ra in rb and list(lb).index(la) == list(rb).index(ra):
      return list(lb).index(la)
    raise NotRowwise("dot_general contracts the batch rows")
  if la is not None:
    if la in lc or la in lb:
      raise NotRowwise("dot_general contracts the batch rows")
    return len(lb) + sum(1 for a in range(la) if a not in lc and a not in lb)
  if ra in rc or ra in rb:
    raise NotRowwise("dot_general contracts the batch rows")
  lhs_free = lhs_rank - len(lc) - len(lb)
  return len(rb) + lhs_free + sum(1 for a in range(ra) if a not in rc and a not in rb)


def _sub(params: dict, n_in: int) -> Any:
  """The jaxpr an equation calls with its own operands."""
  for v in params.values():
    inner = getattr(v, "jaxpr", v)
    if hasattr(inner, "eqns") and len(inner.invars) == n_in:
      return inner
  raise NotRowwise("a call whose body zerojax cannot read")


def _call(e1: Any, e2: Any, ins: list[int | None]) -> list[int | None]:
  n = len(e1.invars)
  outs = _walk(_sub(e1.params, n), _sub(e2.params, n), ins)
  return outs[:len(e1.outvars)]


def _scan(e1: Any, e2: Any, ins: list[int | None]) -> list[int | None]:
  p = e1.params
  nc, nk = p["num_consts"], p["num_carry"]
  consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
  if any(a == 0 for a in xs):
    raise NotRowwise("scan over the batch rows")
  body = [None if a is None else a - 1 for a in xs]
  outs = _walk(p["jaxpr"].jaxpr, e2.params["jaxpr"].jaxpr, consts + carry + body)
  if outs[:nk] != carry:
    raise NotRowwise("a scan's carry moves its rows")
  return carry + [None if a is None else a + 1 for a in outs[nk:]]
