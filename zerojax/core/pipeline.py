"""Scanned layers one ahead: each layer's weights are gathered while the layer before it
computes, and each layer's gradient is reduce-scattered while the layer after it (in the
backward pass) computes. This is the ZeRO-3 schedule with a prefetch of one layer
(``max_live_layers=2``, DeepSpeed's ``stage3_prefetch_bucket_size``).

Left to XLA, a scanned layer's backward re-gathers and last reduce-scatter have nothing to run
beside (docs/design.md, "Scanned layers one ahead"). Here zerojax writes the scan's VJP itself,
per device inside ``jax.shard_map`` with its own collectives:

* forward, layer i runs beside the gather of layer i+1 (in the compute dtype), two layers an
  iteration; each layer keeps only its input for the backward pass, as ``nn.remat`` does;
* backward, iteration i re-runs layer i from its input (gathered the iteration before),
  re-gathers layer i-1, and reduce-scatters layer i+1's gradient, kept from the iteration
  before in the compute (or ``reduce_dtype``) dtype.

A layer's weights are gathered, and its gradients reduced, one collective per weight, each
into a buffer of its own; `OneAhead` gives the sizes the compiler may combine them up to. The
backward pass starts once the gradients of what runs after the layers (a head) are made
(`_waits_for_made_grads`).

Each iteration's two collectives depend on nothing the iteration computes, so the scheduler
can issue them beside its matmuls. The backward iteration's gather waits for its reduce-scatter,
and tells the compiler its ring time (`Pipeline.link_bandwidth`), so that the scheduler shares
the iteration's matmuls between the two rather than spending them all on the gather.

Running per device is only right for a layer that computes each batch row on its own;
`zerojax.core.batchwise` checks that from the layer's trace, and a scan that fails it (or has
settings this does not cover) runs as written, with the reason recorded (`Declined`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax.extend.core import ClosedJaxpr

from zerojax._compat import (ORIGINAL_SCAN, REMAT_PRIMITIVE_NAMES, collective_time, eval_jaxpr,
                             jaxpr_has_primitive, subjaxprs)
from zerojax.core.batchwise import NotRowwise, row_axes
from zerojax.core.context import tracing
from zerojax.core.gather import ZeroParam, after, token_of

__all__ = ["Pipeline", "Declined", "OneAhead", "pipelined_scan", "LAYERS_SCOPE", "NOT_LAYERS",
           "describe"]

# Name scope of the scanned layers' collectives (in the HLO's op_name metadata): the
# schedule of these alone is what the pipeline sets.
LAYERS_SCOPE = "zerojax_layers"


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """How a plan runs scanned layers one ahead (`zerojax.core.plan.ShardingPlan.pipeline`).

  Attributes:
    mesh: the plan's mesh.
    rows: the mesh axes the batch rows are split over (the plan's data axes).
    fsdp: the axis parameters are sharded over.
    reduce_dtype: the dtype gradients are reduce-scattered in (None: the compute dtype).
    own_policies: a layer whose own ``jax.checkpoint`` policy saves residuals keeps it
      (``remat='auto'``), so it is not run one ahead, which re-runs each layer whole.
    link_bandwidth: bytes/s of the slowest link an ``fsdp`` group spans
      (`zerojax.core.backend.Backend.link_bandwidth`): the backward pass's gathers tell the
      compiler their ring time at it, so that its scheduler leaves the rest of the iteration to
      the reduce-scatter before them. None: not told.
  """

  mesh: Any
  rows: tuple[str, ...]
  fsdp: str = "fsdp"
  reduce_dtype: Any = None
  own_policies: bool = True
  link_bandwidth: float | None = None

  @property
  def shards(self) -> int:
    """The size of the ``fsdp`` axis: the shards of each parameter."""
    return int(self.mesh.shape[self.fsdp])

  @property
  def row_shards(self) -> int:
    """The devices the batch rows are split over: the product of the ``rows`` axes' sizes."""
    return math.prod(int(self.mesh.shape[a]) for a in self.rows)


class Declined(NamedTuple):
  """A scan that runs as written, and why it could not run one ahead.

  Attributes:
    reason: why, as `describe` reports it (`NOT_LAYERS` for a scan of no sharded parameters).
  """
  reason: str


# The reason for a scan that holds no sharded parameters: not a stack of layers.
NOT_LAYERS = "no sharded parameters are scanned"


def describe(asked: str, outcomes: list) -> str | None:
  """What became of a step's scanned layers, as `zerojax compile` and ``ZeroStep.layers`` say it.

  Args:
    asked: the setting that asked for layers one ahead, e.g. ``"max_live_layers=2"``.
    outcomes: per scan, its `Declined` reason or, for a scan run one ahead, its `OneAhead`.

  Returns:
    One line, or ``None`` where the step scanned no layers.
  """
  reasons = [o for o in outcomes if o != NOT_LAYERS]
  if not reasons:
    return None
  if all(isinstance(o, OneAhead) for o in reasons):
    return (f"scanned layers one ahead ({asked}): each layer's gather beside the layer "
            "before it, each gradient's reduce-scatter beside the layer after it")
  why = "; ".join(dict.fromkeys(o for o in reasons if isinstance(o, str)))
  return (f"scanned layers gathered in their own iteration, not one ahead as {asked} asks: "
          f"{why}")


# -- which scans: parameters in boxes, rows in the carry --------------------------------------


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """A boxed parameter of the scanned layers: sharded (``dim``: the per-layer axis it is
  sharded on) or whole (``dim`` None), in the ``dtype`` the layer computes in."""
  pos: int
  dim: int | None
  dtype: Any


def _is_box(x: Any) -> bool:
  return isinstance(x, ZeroParam)


def _spec_axes(s: Any) -> tuple:
  return s if isinstance(s, tuple) else (s,) if s is not None else ()


def _stacked_spec(box: ZeroParam, spec: tuple) -> tuple:
  """``spec`` (one of the box's layouts) for its stacked value: Flax's ``nn.scan`` hands the
  body boxes whose layouts are one layer's (the layer axis removed), NNX's the stack's."""
  return (None,) * (jnp.ndim(box.value) - len(spec)) + tuple(spec)


def _leaf(pos: int, box: ZeroParam, pl: Pipeline) -> _Leaf | str:
  v = box.value
  if box.manual is not None or box.offloaded or box.lookup:
    return "a parameter gathered by ZeRO++, fetched from the host or looked up as a table"
  if not jnp.issubdtype(v.dtype, jnp.floating):
    return "a parameter that is not floating-point"
  dtype = jnp.dtype(box.compute_dtype or v.dtype)
  rest, compute, grad = (_stacked_spec(box, s) for s in (box.at_rest, box.compute, box.grad))
  if rest == compute:
    if any(s is not None for s in rest):
      return f"a parameter laid out as {rest} in compute"
    return _Leaf(pos, None, dtype)
  named = [(d, _spec_axes(s)) for d, s in enumerate(rest) if s is not None]
  if (len(named) != 1 or named[0][1] != (pl.fsdp,) or named[0][0] == 0
      or grad != rest or any(s is not None for s in compute)):
    return (f"a parameter laid out as {rest} at rest, {compute} in compute and {grad} as a "
            f"gradient (one axis other than the layer axis on {pl.fsdp!r} is supported)")
  return _Leaf(pos, named[0][0] - 1, dtype)


# -- a layer's collectives --------------------------------------------------------------------


class OneAhead(NamedTuple):
  """A scan whose layers ran one ahead, and what its largest layer's collectives move per device.

  The compiler options combine a layer's per-weight collectives into one of each kind up to
  these sizes (`zerojax.core.backend.Backend.options`).

  Attributes:
    gathered: bytes of the layer's gathered weights.
    reduced: bytes of this device's share of the layer's reduced gradient.
  """
  gathered: int
  reduced: int


def _gather(shards: list[jax.Array], leaves: list[_Leaf], axis: str,
            bandwidth: float | None = None) -> list[jax.Array]:
  """One layer's weights from this device's shards, in the compute dtype: an all-gather per
  weight, each into a buffer of its own, which the layer's matmuls read as they are. With a
  ``bandwidth`` (bytes/s), the compiler is told the layer's ring time (`_compat.collective_time`):
  the time of all its gathers, which it combines into one."""
  with jax.named_scope(LAYERS_SCOPE):
    cast = [s.astype(lf.dtype) for s, lf in zip(shards, leaves)]
    told: Any = contextlib.nullcontext()
    if bandwidth:
      n = jax.lax.axis_size(axis)
      gathered = sum(x.size * x.dtype.itemsize for x in cast) * n
      told = collective_time((n - 1) / n * gathered / bandwidth)
    with told:
      return [jax.lax.all_gather(x, axis, axis=lf.dim, tiled=True)
              for x, lf in zip(cast, leaves)]


def _reduce(grads: list[jax.Array], leaves: list[_Leaf], axis: str,
            reduce_dtype: Any) -> list[jax.Array]:
  """This device's shard of the sum over devices of one layer's gradients: a reduce-scatter
  per gradient, in ``reduce_dtype`` if set."""
  cast = lambda g: g.astype(reduce_dtype) if reduce_dtype is not None else g
  with jax.named_scope(LAYERS_SCOPE):
    return [jax.lax.psum_scatter(cast(g), axis, scatter_dimension=lf.dim, tiled=True)
            for g, lf in zip(grads, leaves)]


def _layer_bytes(flat: list, sharded: list[_Leaf], pl: Pipeline) -> OneAhead:
  """What one layer's all-gather and reduce-scatter move per device (``flat``: the stacked
  boxes of the scan's inputs)."""
  sizes = [(math.prod(jnp.shape(flat[lf.pos].value)[1:]), lf.dtype) for lf in sharded]
  reduced = lambda dt: jnp.dtype(pl.reduce_dtype if pl.reduce_dtype is not None else dt)
  return OneAhead(sum(n * jnp.dtype(dt).itemsize for n, dt in sizes),
                  sum(n // pl.shards * reduced(dt).itemsize for n, dt in sizes))


# -- the scan ----------------------------------------------------------------------------------


def pipelined_scan(pl: Pipeline, f: Callable, init: Any, xs: Any, length: int | None,
                   **kwargs: Any) -> tuple[Any, OneAhead] | Declined:
  """``jax.lax.scan`` with the layers one ahead (module doc), where they can be.

  Args:
    pl: the plan's `Pipeline`.
    f: the scan body, ``f(carry, x) -> (carry, y)``; it must not itself be routed through
      zerojax's scan hook (the caller strips it).
    init: the initial carry (rows of the batch).
    xs: the scanned inputs, the layers' parameters boxed (`zerojax.core.gather.ZeroParam`).
    length: the number of layers, or None to take it from ``xs``.
    **kwargs: ``jax.lax.scan``'s other arguments.

  Returns:
    ``(jax.lax.scan(f, init, xs, length, **kwargs), OneAhead(...))``, or `Declined` with the
    reason the layers cannot run one ahead (nothing was emitted then).
  """
  if kwargs.get("reverse") or kwargs.get("_split_transpose"):
    return Declined("a reversed scan")
  flat, treedef = jax.tree.flatten(xs, is_leaf=_is_box)
  leaves: list[_Leaf] = []
  for pos, x in enumerate(flat):
    if _is_box(x):
      lf = _leaf(pos, x, pl)
      if isinstance(lf, str):
        return Declined(lf)
      leaves.append(lf)
  sharded = [lf for lf in leaves if lf.dim is not None]
  whole = [lf for lf in leaves if lf.dim is None]
  if not sharded:
    return Declined(NOT_LAYERS)
  boxes = {lf.pos for lf in leaves}
  rest_pos = [p for p, x in enumerate(flat) if p not in boxes and x is not None]
  n_layers = length if length is not None else int(jnp.shape(flat[sharded[0].pos].value)[0])
  if n_layers < 2:
    return Declined(f"a scan of {n_layers} layer(s)")
  carry_leaves, carry_def = jax.tree.flatten(init)
  rows = pl.row_shards
  for c in carry_leaves:
    if not isinstance(c, jax.Array) or jnp.ndim(c) == 0 or jnp.shape(c)[0] % rows:
      return Declined(f"a carry of shape {jnp.shape(c)} is not rows of a batch split over "
                      f"{rows} devices")
  if any(not isinstance(flat[p], jax.Array) for p in rest_pos):
    return Declined("a scanned input that is not an array")

  ys_defs: list = []  # the structure of the layer's per-layer outputs

  def layer(weights, wholes, carry, rest):
    vals = list(flat)
    for lf, w in zip(sharded, weights):
      vals[lf.pos] = w
    for lf, w in zip(whole, wholes):
      vals[lf.pos] = w
    for p, r in zip(rest_pos, rest):
      vals[p] = r
    c, y = f(jax.tree.unflatten(carry_def, carry), jax.tree.unflatten(treedef, vals))
    ys_defs.append(jax.tree.structure(y))
    return jax.tree.leaves(c), jax.tree.leaves(y)

  sds = jax.ShapeDtypeStruct
  one = lambda x, dtype=None: sds(jnp.shape(x)[1:], dtype or x.dtype)
  local = ([one(flat[lf.pos].value, lf.dtype) for lf in sharded],
           [one(flat[lf.pos].value, lf.dtype) for lf in whole],
           [sds((jnp.shape(c)[0] // rows,) + jnp.shape(c)[1:], c.dtype) for c in carry_leaves],
           [one(flat[p]) for p in rest_pos])
  try:
    axes, jaxpr = row_axes(layer, local, (False, False, True, False))
  except NotRowwise as e:
    return Declined(f"the layer does not compute each batch row on its own ({e})")
  except Exception as e:  # it traces at the whole batch's shapes only (a size written in)
    return Declined(f"the layer does not trace on one device's rows ({type(e).__name__}: {e})")
  saving = _saving_policies(jaxpr) if pl.own_policies else []
  if saving:
    return Declined(f"the layer's own checkpoint saves residuals (policy {saving[0]}), which "
                    "re-running each layer whole would not; remat='full' re-runs it whole")
  n_carry = len(carry_leaves)
  if axes[:n_carry] != [0] * n_carry or [(o.shape, o.dtype) for o in jaxpr.out_avals[:n_carry]
                                         ] != [(c.shape, c.dtype) for c in local[2]]:
    return Declined("the layer's carry does not keep its rows and shape")
  y_axes = axes[n_carry:]
  if any(a not in (0, None) for a in y_axes):
    return Declined("a per-layer output whose rows are not its leading axis")

  consts = list(jaxpr.consts)  # closed-over values (outer tracers): inputs of the shard_map
  # Only traced float values can carry a gradient; a constant (a table built with numpy) cannot.
  traced = [k for k, c in enumerate(consts) if isinstance(c, jax.core.Tracer) and _inexact(c)]

  def converted(*args):
    outs = eval_jaxpr(ClosedJaxpr(jaxpr.jaxpr, args[4:]), jax.tree.leaves(args[:4]),
                      _inline_remat)
    return outs[:n_carry], outs[n_carry:]

  run = _scan_fn(converted, sharded, pl, n_layers, traced, jaxpr.out_avals[n_carry:])
  row_spec = P(pl.rows)
  in_specs = ([P()] * len(consts),
              [P(*_stacked_spec(flat[lf.pos], flat[lf.pos].at_rest)) for lf in sharded],
              [P()] * len(whole),
              [row_spec] * n_carry,
              [P()] * len(rest_pos))
  out_specs = ([row_spec] * n_carry,
               [P(None, pl.rows) if a == 0 else P() for a in y_axes])
  args = (list(consts), [flat[lf.pos].value for lf in sharded],
          [flat[lf.pos].value.astype(lf.dtype) for lf in whole], carry_leaves,
          [flat[p] for p in rest_pos])
  try:
    c, y = jax.shard_map(run, mesh=pl.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)
  except Exception as e:  # e.g. under a transformation shard_map refuses; nothing was emitted
    return Declined(f"JAX could not run it per device ({type(e).__name__}: {e})")
  out = jax.tree.unflatten(carry_def, _waits_for_made_grads(c)), jax.tree.unflatten(ys_defs[0], y)
  return out, _layer_bytes(flat, sharded, pl)


# Primitives of a function with its own VJP (a fused attention kernel's, say), which keeps
# its own residuals.
_CUSTOM_VJP = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})


def _inline_remat(eqn: Any, invals: list) -> list | None:
  """A checkpoint of the layer's own, as plain code: the backward pass re-runs each layer
  whole already (`_scan_fn`), and differentiating that re-run through the checkpoint holds
  more at once. Except around a function with its own VJP, where the checkpoint held less
  (BENCHMARKS.md, "Layers one ahead without their own checkpoints")."""
  if eqn.primitive.name not in REMAT_PRIMITIVE_NAMES:
    return None
  inner = eqn.params["jaxpr"]
  if jaxpr_has_primitive(inner, _CUSTOM_VJP):
    return None
  closed = inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, [])
  return eval_jaxpr(closed, invals, _inline_remat)


def _policy_name(policy: Any) -> str:
  """A checkpoint policy by its public name (``jax.checkpoint_policies.dots_saveable``), which
  holds across releases where the objects' own names and reprs do not."""
  for name, value in vars(jax.checkpoint_policies).items():
    if value is policy and not name.startswith("_"):
      return f"jax.checkpoint_policies.{name}"
  return getattr(policy, "__name__", repr(policy))


def _saving_policies(jaxpr: Any) -> list[str]:
  """Names of the ``jax.checkpoint`` policies in ``jaxpr`` that save residuals."""
  out = []
  for eqn in jaxpr.jaxpr.eqns if hasattr(jaxpr, "jaxpr") else jaxpr.eqns:
    if eqn.primitive.name in REMAT_PRIMITIVE_NAMES:
      policy = eqn.params.get("policy")
      if policy is not None and policy is not jax.checkpoint_policies.nothing_saveable:
        out.append(_policy_name(policy))
    for sub in subjaxprs(eqn.params):
      out += _saving_policies(sub)
  return out


def _inexact(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


@jax.custom_vjp
def _waits_for_made_grads(carry: Any) -> Any:
  """Identity whose cotangent is computed only once every gradient recorded so far in this
  trace (`zerojax.core.context.MadeGrads`) is: the layers' backward pass then starts after the
  gradients of what ran after them (a head's, a final norm's), so the cotangents those are made
  from (the logits') are freed first. XLA would otherwise make them last and keep the logits'
  cotangent through the whole loop (BENCHMARKS.md, "Gradients made after the layers")."""
  return carry


def _waits_bwd(_, ct):
  made = tracing().made_grads
  grads = made.take() if made is not None else []
  if grads:
    token = token_of([jnp.stack([token_of(g, False) for g in grads])], False)
    ct = jax.tree.map(lambda c: after(c, token) if _inexact(c) else c, ct)
  return (ct,)


_waits_for_made_grads.defvjp(lambda carry: (carry, None), _waits_bwd)


def _index(xs: list[jax.Array], i: Any) -> list[jax.Array]:
  return [jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False) for x in xs]


def _scan_fn(layer: Callable, sharded: list[_Leaf], pl: Pipeline, n: int,
             fk: list[int], y_avals: list) -> Callable:
  """The per-device scan with its VJP (module doc): ``run(consts, shards, wholes, carry, rest)
  -> (carry, ys)``, ``layer(weights, wholes, carry, rest, *consts) -> (carry, ys)``; ``fk``:
  the consts to differentiate; ``y_avals``: one device's per-layer outputs of a layer.

  Forward, iteration k runs layers 2k and 2k+1, each beside the gather of the layer after it;
  layer 2k+2's gather starts once layer 2k has run, into its buffer, so the loop carries the
  gathered layer with no copy (a loop of one layer an iteration copies it into the loop state
  each time). The last layer is gathered again, for the backward pass, which starts with it.
  Backward, layer n-1 runs before the loop; iteration i reduce-scatters layer i+1's gradient,
  re-gathers layer i-1 once that reduce-scatter is done (so the two take turns beside the
  layer's matmuls rather than one waiting for the other at its end), and runs layer i; layer
  0 runs after the loop. So each layer is gathered once in each pass and reduced once, ZeRO-3's
  count (why the first and last layers run outside the loop: docs/design.md, "Scanned layers
  one ahead").
  """
  axis = pl.fsdp
  # Only the backward iteration's gather is timed: it shares the iteration's matmuls with a
  # reduce-scatter; a forward iteration's gather has them to itself.
  gather_slice = lambda sl: _gather(sl, sharded, axis, pl.link_bandwidth)
  gather = lambda shards, i: _gather(_index(shards, i), sharded, axis)
  reduce = lambda g: _reduce(g, sharded, axis, pl.reduce_dtype)
  call = lambda consts, w, wh, c, r: layer(w, wh, c, r, *consts)
  # Layer j's values written in place into stacks of every layer's.
  put = lambda stacks, xs, j: [jax.lax.dynamic_update_index_in_dim(a, x.astype(a.dtype), j, 0)
                               for a, x in zip(stacks, xs)]

  def forward(consts, shards, wholes, carry, rest):
    run = lambda w, i, c: call(consts, w, _index(wholes, i), c, _index(rest, i))
    first = gather(shards, 0)
    saved0 = [jnp.zeros((n,) + jnp.shape(x), x.dtype) for x in carry]
    ys0 = [jnp.zeros((n,) + y.shape, y.dtype) for y in y_avals]

    def pair(state, k):
      """Layers 2k and 2k+1, each beside the other's gather."""
      c, wa, saved, ys = state
      i = 2 * k
      wb = gather(shards, i + 1)
      c1, y1 = run(wa, i, c)
      # Layer 2k+2's gather starts once layer 2k has run, so it can fill layer 2k's buffer.
      sl, c1 = jax.lax.optimization_barrier((_index(shards, jnp.minimum(i + 2, n - 1)), c1))
      wa = _gather(sl, sharded, axis)
      c2, y2 = run(wb, i + 1, c1)
      saved = put(put(saved, c, i), c1, i + 1)
      ys = put(put(ys, y1, i), y2, i + 1)
      return (c2, wa, saved, ys), None

    (c, last, saved, ys), _ = ORIGINAL_SCAN(pair, (carry, first, saved0, ys0),
                                            jnp.arange(n // 2))
    if n % 2:  # the last layer, gathered by the last pair, runs beside its gather again
      w, last = last, gather(shards, n - 1)
      saved = put(saved, c, n - 1)
      c, y = run(w, n - 1, c)
      ys = put(ys, y, n - 1)
    return (c, ys), (saved, last)

  @jax.custom_vjp
  def run(consts, shards, wholes, carry, rest):
    return forward(consts, shards, wholes, carry, rest)[0]

  def run_fwd(consts, shards, wholes, carry, rest):
    out, (saved, last) = forward(consts, shards, wholes, carry, rest)
    return out, (consts, shards, wholes, rest, saved, last)

  def run_bwd(res, cts):
    consts, shards, wholes, rest, saved, last = res
    ct_carry, ct_ys = cts
    # The backward pass's gathers wait for the cotangent: not hoisted into the forward pass,
    # and never merged with the forward pass's gathers.
    shards, ct_carry = jax.lax.optimization_barrier((shards, ct_carry))
    fr = [k for k, x in enumerate(rest) if _inexact(x)]  # differentiable scanned inputs

    def grads(i, w, dc):
      """Layer i re-run from its saved input: cotangents of (float consts, weights, whole
      weights, carry, float scanned inputs)."""
      r_i = _index(rest, i)

      def of(kf, w, wh, c, rf):
        k, r = list(consts), list(r_i)
        for j, v in zip(fk, kf):
          k[j] = v
        for j, v in zip(fr, rf):
          r[j] = v
        return call(k, w, wh, c, r)
      _, vjp = jax.vjp(of, [consts[k] for k in fk], w, _index(wholes, i), _index(saved, i),
                       [r_i[k] for k in fr])
      return vjp((dc, _index(ct_ys, i)))

    def step(state, i, below):
      """Layer i's iteration: reduce-scatter the pending gradient (layer i+1's) into its place
      in ``acc``, gather the weights of layer ``below`` once that is done, re-run layer i.
      Returns ``(state, (whole-weight and scanned-input cotangents of layer i))``."""
      dc, w, pending, dk, acc = state
      red = reduce(pending)
      sl, red = jax.lax.optimization_barrier((_index(shards, below), red))
      ahead = gather_slice(sl)
      dki, dwi, dwh, dc, dr = grads(i, w, dc)
      # Written in place: the loop's outputs are the gradient, with no copy to put them in
      # layer order.
      acc = put(acc, red, i + 1)
      return (dc, ahead, dwi, jax.tree.map(jnp.add, dk, dki), acc), (dwh, dr)

    # Reversed loops (layer i in iteration n-1-i) stack their outputs in layer order.
    loop = lambda body, init, lo, hi: ORIGINAL_SCAN(body, init, jnp.arange(lo, hi), reverse=True)
    acc0 = [jnp.zeros_like(x) for x in shards]
    # Layer n-1 before the loop, layer 0 after it: nothing moved twice.
    one = lambda xs: [x[None] for x in xs]
    dk, pending, dwh_top, dc, dr_top = grads(n - 1, last, ct_carry)
    state = (dc, gather(shards, n - 2), pending, dk, acc0)
    outs: tuple = ()
    if n > 2:  # layers n-2 .. 1, reducing n-1 .. 2
      state, outs = loop(lambda st, i: step(st, i, i - 1), state, 1, n - 1)
    dc, w0, pending, dk, acc = state
    acc = put(acc, reduce(pending), 1)
    dk0, dw0, dwh0, dc, dr0 = grads(0, w0, dc)
    dk = jax.tree.map(jnp.add, dk, dk0)
    dshards = put(acc, reduce(dw0), 0)
    other_parts = [(one(dwh0), one(dr0))] + ([outs] if n > 2 else []) + [
        (one(dwh_top), one(dr_top))]
    cat = lambda parts: [jnp.concatenate(p) for p in zip(*parts)]
    dwholes = [g.astype(x.dtype) for g, x in zip(cat([p[0] for p in other_parts]), wholes)]
    dconsts: list[Any] = [None] * len(consts)
    for k, g in zip(fk, dk):
      dconsts[k] = g
    drest: list[Any] = [None] * len(rest)
    for k, g in zip(fr, cat([p[1] for p in other_parts])):
      drest[k] = g
    return dconsts, dshards, dwholes, dc, drest

  run.defvjp(run_fwd, run_bwd)
  return run
