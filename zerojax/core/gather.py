"""How a sharded parameter reaches the layer that reads it, and its gradient leaves.

Two formulations, chosen per model by `zerojax.core.step.wrap_apply_fn` (see `ZeroConfig.gather`):

* **The compiler's** (default for scanned layers, layers the user rematerialises, NNX and plain
  pytrees). The step's inputs, outputs and gradients carry the plan's shardings and XLA's
  partitioner (GSPMD) inserts the gathers and reduce-scatters where each weight is used, exactly
  as hand-written JAX FSDP does; nothing inside the model is touched, so it holds for any model
  however it is written or called. Inside a scan the loop runs one layer at a time; a scanned
  layer the user did not rematerialise is wrapped in ``jax.checkpoint`` (`ScanRemat`, through a
  per-thread ``jax.lax.scan`` dispatcher) so no layer keeps what was gathered for it.
* **Per use** (linen ``apply_fn``): each parameter is wrapped in a `ZeroParam` box that Flax
  unboxes exactly where a layer reads it, applying `gather`, an identity with a custom VJP:
  forward, at-rest layout -> compute layout (all-gather at stage 3); backward, the cotangent
  of that one use -> the stage's gradient layout (reduce-scatter), in ``reduce_dtype``. At stage
  3 the gathered value is named `GATHERED` and never saved for the backward pass. Models
  without scans also run each parameter-owning module through `regather_layers`, a
  ``custom_vjp`` that gathers after the module's input exists and re-gathers after its output's
  cotangent exists (data dependencies no scheduler can reorder), so only the computing layer's
  weights are gathered in either pass. This is what an unscanned model without remat needs
  (otherwise every layer's gathered weights live until the backward pass), and what
  ``offload_params`` (per-layer fetch from host) and ``reduce_dtype`` act through.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import threading
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors
from flax import linen as nn
from flax import struct
from flax.core import meta
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax._compat import (ORIGINAL_SCAN, REMAT_PRIMITIVE_NAMES, eval_jaxpr,
                             jaxpr_has_primitive, name_p, sharding_constraint_p)
from zerojax.core.plan import HOST

__all__ = ["GATHERED", "GATHER_SCOPE", "REGATHER_SCOPE", "REDUCE_SCOPE", "zerojax_gather", "gather", "fetch", "after", "ZeroParam",
           "ManualGather", "recompute_in_backward", "compute_dtype_of", "to_compute", "regather_layers", "box_params", "per_layer_reads", "save_all_but_gathered",
           "ScanRemat", "scan_remat", "remat_policy", "scanned_layers"]

GATHERED = "zerojax_gathered"


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def zerojax_gather(w: jax.Array, at_rest: NamedSharding, compute: NamedSharding,
                   grad: NamedSharding, reduce_dtype: Any) -> jax.Array:
  """Identity that moves ``w`` from its at-rest to its compute layout; see module doc."""
  if at_rest == compute:
    # Nothing to gather (stages 0-2). Returning ``w`` itself, not a constrained copy, lets a
    # scan forward the layer's slice of the stacked parameter as its residual instead of
    # saving a second, stacked copy of every weight.
    return w
  w = jax.lax.with_sharding_constraint(w, at_rest)
  return jax.lax.with_sharding_constraint(w, compute)


gather = zerojax_gather


def _gather_fwd(w, at_rest, compute, grad, reduce_dtype):
  return zerojax_gather(w, at_rest, compute, grad, reduce_dtype), None


def _gather_bwd(at_rest, compute, grad, reduce_dtype, _, ct):
  dtype = ct.dtype
  if reduce_dtype is not None:
    ct = ct.astype(reduce_dtype)
  ct = jax.lax.with_sharding_constraint(ct, grad)
  return (ct.astype(dtype),)


zerojax_gather.defvjp(_gather_fwd, _gather_bwd)


def fetch(w: jax.Array, device: NamedSharding) -> jax.Array:
  """Host -> device copy of an offloaded shard (its gradient goes back to host memory)."""
  return jax.device_put(w, device)


# The scalar a layer's gathers must wait for (see `regather_layers`); None outside one.
_AFTER: contextvars.ContextVar[Any] = contextvars.ContextVar("zerojax_after", default=None)
# Set while a layer runs inside `regather_layers`, so its own module call is not wrapped again.
_IN_LAYER: contextvars.ContextVar[bool] = contextvars.ContextVar("zerojax_in_layer", default=False)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def after(w: jax.Array, token: jax.Array | None) -> jax.Array:
  """``w``, computed only once ``token`` is: ``w + 0 * token`` (same value, exactly).

  A data dependency is the one ordering XLA must respect; ``token`` is a finite scalar (see
  `_token_of`), so the sum is ``w`` bit for bit except that ``-0.0`` becomes ``+0.0``.
  """
  if token is None:
    return w
  if jnp.ndim(token) != 0:  # a non-scalar would broadcast into w and change its shape
    raise ValueError(f"after: token must be a scalar, got shape {jnp.shape(token)}")
  return w + (token * 0).astype(w.dtype)


def _token_of(tree: Any) -> jax.Array | None:
  """A finite float32 scalar that exists only once the first float array in ``tree`` does."""
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact):
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

  def unbox(self) -> jax.Array:
    if self.manual is not None:
      return self.manual(self)
    v = self.value
    if not isinstance(v, jax.Array) or not jnp.issubdtype(v.dtype, jnp.inexact):
      return v
    ns = lambda s: NamedSharding(self.mesh, P(*s))
    if self.offloaded:  # this layer's shard comes from pinned_host just before use
      v = fetch(v, NamedSharding(self.mesh, P(*self.at_rest), memory_kind="device"))
    if self.compute_dtype is not None and jnp.issubdtype(v.dtype, jnp.floating):
      v = v.astype(self.compute_dtype)
    if self.at_rest != self.compute:
      v = after(v, _AFTER.get())
    out = gather(v, ns(self.at_rest), ns(self.compute), ns(self.grad), self.reduce_dtype)
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


# Set while a layer's backward pass re-runs it (`regather_layers`, `recompute_in_backward`): the
# quantised formulation's re-gather then moves full-precision weights unless
# ``quantize_weights_backward``.
_BACKWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("zerojax_backward",
                                                                 default=False)


def _fsdp_dim(spec: tuple, axis: str) -> int | None:
  for d, s in enumerate(spec):
    if s == axis or (isinstance(s, tuple) and axis in s):
      return d
  return None


# Name scopes of `ManualGather`'s collectives (in the HLO's op_name metadata).
GATHER_SCOPE, REGATHER_SCOPE, REDUCE_SCOPE = "zerojax_gather", "zerojax_regather", "zerojax_reduce"


@dataclasses.dataclass(frozen=True)
class ManualGather:
  """How a `ZeroParam` reaches its layer inside ``jax.shard_map`` (the quantised formulation,
  `zerojax.core.zeropp`), where each device computes on its own batch shard and every collective
  is written out. By the box's layouts:

  * sharded at rest (stage 3): all-gather over ``axis`` (qwZ: quantised), and its gradient
    reduce-scattered back to the shard (qgZ: quantised all-to-all, summed in float32);
  * replicated at rest, sharded gradient (stage 2; stage-3 leaves under the persistence
    threshold): the box holds ``(weight, sink)``, the sink being the gradient's shard; the
    gradient is reduce-scattered into the sink (qgZ: quantised);
  * replicated gradient: used as it is; ``shard_map`` sums its gradient over the devices.
  """

  axis: str = "fsdp"
  weights: str | None = None
  weights_backward: bool = False
  gradients: str | None = None
  block_size: int = 256
  compute_dtype: Any = None  # what a quantised gather dequantises to (None: the param's)

  def __call__(self, box: "ZeroParam") -> jax.Array:
    rest_dim = _fsdp_dim(box.at_rest, self.axis)
    grad_dim = _fsdp_dim(box.grad, self.axis)
    if rest_dim is not None and _fsdp_dim(box.compute, self.axis) is None:
      if grad_dim != rest_dim:
        raise ValueError(f"zerojax: a parameter sharded at rest as {box.at_rest} needs its "
                         f"gradient sharded on the same dimension, not {box.grad}")
      backward = _BACKWARD.get()
      quantize = self.weights if (self.weights_backward or not backward) else None
      v = after(box.value, _AFTER.get())
      if quantize is None:  # full precision is the compute dtype, as the forward pass computed
        v = to_compute(v, self.compute_dtype or box.compute_dtype)
      # Named so that HLO metadata tells the forward gather from the backward re-gather.
      with jax.named_scope(REGATHER_SCOPE if backward else GATHER_SCOPE):
        out = _manual_gather(v, self, rest_dim, quantize, box.reduce_dtype,
                             jnp.dtype(v.dtype))
      return checkpoint_name(out, GATHERED)
    if isinstance(box.value, tuple):
      w, sink = box.value
      cd = self.compute_dtype or box.compute_dtype
      return _into_sink(to_compute(w, cd), sink, self, grad_dim, box.reduce_dtype)
    return to_compute(box.value, self.compute_dtype or box.compute_dtype)

  def reduce(self, ct: jax.Array, dim: int, reduce_dtype: Any) -> jax.Array:
    """This device's shard of the sum of every device's ``ct``."""
    from zerojax.core import quantize as q
    dtype = ct.dtype
    with jax.named_scope(REDUCE_SCOPE):
      if self.gradients is not None:
        return q.reduce_scatter(ct, self.axis, dim, self.gradients, self.block_size, dtype)
      if reduce_dtype is not None:
        ct = ct.astype(reduce_dtype)
      return jax.lax.psum_scatter(ct, self.axis, scatter_dimension=dim,
                                  tiled=True).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _manual_gather(w, how: ManualGather, dim: int, quantize: str | None, reduce_dtype,
                   dtype: Any):
  """All-gather of ``w`` (of ``dtype``) along ``dim``: in full precision, or quantised and
  dequantised straight to ``how.compute_dtype`` (no full-size copy in ``dtype``)."""
  if quantize is None:
    return jax.lax.all_gather(w, how.axis, axis=dim, tiled=True)
  from zerojax.core import quantize as q
  return q.all_gather(w, how.axis, dim, quantize, how.block_size, how.compute_dtype or dtype)


def _manual_gather_fwd(w, how, dim, quantize, reduce_dtype, dtype):
  return _manual_gather(w, how, dim, quantize, reduce_dtype, dtype), None


def _manual_gather_bwd(how, dim, quantize, reduce_dtype, dtype, _, ct):
  # The gradient is reduced in the parameter's dtype (or reduce_dtype), whatever the compute
  # dtype the weight was dequantised to.
  return (how.reduce(ct.astype(dtype), dim, reduce_dtype).astype(dtype),)


_manual_gather.defvjp(_manual_gather_fwd, _manual_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _into_sink(w, sink, how: ManualGather, dim: int, reduce_dtype):
  return w


def _into_sink_fwd(w, sink, how, dim, reduce_dtype):
  return w, None


def _into_sink_bwd(how, dim, reduce_dtype, _, ct):
  return None, how.reduce(ct, dim, reduce_dtype)


_into_sink.defvjp(_into_sink_fwd, _into_sink_bwd)


def recompute_in_backward(f: Callable) -> Callable:
  """``f`` (a scan body ``(carry, x) -> (carry, y)``) keeping only its inputs for the backward
  pass, which re-runs it as traced with `_BACKWARD` set (so a quantised formulation may
  re-gather in full precision); as ``jax.checkpoint`` with ``nothing_saveable``, but with the
  re-run marked."""

  def g(carry, x):
    # Both versions are traced here, where f's closed-over values are in scope; the backward
    # one is only evaluated in the backward pass.
    # (closure_convert caches its trace by function: each trace gets a function of its own)
    forward, consts = jax.closure_convert(lambda c, a: f(c, a), carry, x)
    with _setting(_BACKWARD, True):
      backward, bconsts = jax.closure_convert(lambda c, a: f(c, a), carry, x)

    @jax.custom_vjp
    def body(carry, x, consts, bconsts):
      return forward(carry, x, *consts)

    def body_fwd(carry, x, consts, bconsts):
      return forward(carry, x, *consts), (carry, x, consts, bconsts)

    def body_bwd(res, ct):
      carry, x, consts, bconsts = res
      _, vjp = jax.vjp(lambda c, a, k: backward(c, a, *k), carry, x, bconsts)
      dc, dx, dk = vjp(ct)
      return dc, dx, [None] * len(consts), dk

    body.defvjp(body_fwd, body_bwd)
    return body(carry, x, list(consts), list(bconsts))

  return g


def regather_layers(next_fun: Callable, args: tuple, kwargs: dict,
                    context: nn.module.InterceptorContext) -> Any:
  """Flax method interceptor: each module that owns stage-3 parameters computes as one layer.

  Use as ``with nn.intercept_methods(regather_layers): model.apply(...)`` with `ZeroParam`-boxed
  parameters (the step does this). A module qualifies when every variable it owns directly is
  a `ZeroParam` and at least one is gathered for compute (``params`` only, no submodules with parameters, no other
  collections, not mutable); others run unchanged and their children are looked at in turn.
  Leaves left replicated (under ``param_persistence_threshold``: biases, norm scales) do not
  disqualify a module; they pass through as they are (issue: a ``Dense`` with a replicated bias
  used to be skipped, so every layer's gathered kernel stayed alive).
  A qualifying call becomes a ``custom_vjp`` over the module's shards and array arguments:

  * forward: gather the shards after the first float argument exists, run the module;
    residuals are the shards and the arguments, never the gathered weights;
  * backward: gather again after the output cotangent exists, and differentiate the module
    (its gradient is reduce-scattered by `gather`'s own backward).

  So at most the weights of the layer that is computing are gathered, in both passes, for any
  schedule. The module's forward is recomputed in the backward pass, but XLA drops what the
  backward does not read (a ``Dense`` only re-gathers its kernel).
  """
  module, method = context.module, context.method_name
  if (_IN_LAYER.get() or method == "setup" or (method.startswith("_") and method != "__call__")
      or module.scope is None or module.scope.mutable):
    return next_fun(*args, **kwargs)
  variables = module.variables
  params = variables.get("params", {})
  if (set(variables) != {"params"} or not params
      or not all(isinstance(b, ZeroParam) for b in params.values())
      or not any(b.at_rest != b.compute for b in params.values())):
    return next_fun(*args, **kwargs)

  names, boxes = list(params), list(params.values())
  leaves, treedef = jax.tree.flatten((args, kwargs))
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
  unbound = module.clone(parent=None)

  def run(shards, arrays, token):
    it = iter(arrays)
    a, kw = jax.tree.unflatten(treedef, [next(it) if isa else x for x, isa in
                                         zip(leaves, is_array)])
    boxed = {n: b.replace(value=v) for n, b, v in zip(names, boxes, shards)}
    with _setting(_IN_LAYER, True), _setting(_AFTER, token):
      return unbound.apply({"params": boxed}, *a, method=method, **kw)

  @jax.custom_vjp
  def layer(shards, arrays):
    return run(shards, arrays, _token_of(arrays))

  def layer_fwd(shards, arrays):
    return run(shards, arrays, _token_of(arrays)), (shards, arrays)

  def layer_bwd(res, ct):
    shards, arrays = res
    token = _token_of(ct)
    with _setting(_BACKWARD, True):
      _, vjp = jax.vjp(lambda s, a: run(s, a, token), shards, arrays)
      return vjp(ct)

  layer.defvjp(layer_fwd, layer_bwd)
  arrays = [x for x, isa in zip(leaves, is_array) if isa]
  try:
    return layer([b.value for b in boxes], arrays)
  except (flax_errors.InvalidRngError, flax_errors.ScopeCollectionNotFound):
    # The module draws random numbers or writes a collection: run it as it is.
    return next_fun(*args, **kwargs)


def compute_dtype_of(cfg: Any) -> Any:
  """The dtype parameters and floating inputs are cast to where the model reads them, or None
  when the config computes in the parameters' own dtype."""
  cd = jnp.dtype(cfg.compute_dtype)
  return None if cd == jnp.dtype(cfg.param_dtype) else cd


def to_compute(tree: Any, dtype: Any) -> Any:
  """``tree`` with its floating arrays cast to ``dtype`` (None: unchanged). The cast's
  transpose brings each gradient back to its parameter's dtype (the master weights')."""
  if dtype is None:
    return tree

  def one(x):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
      return jnp.asarray(x).astype(dtype)
    return x
  return jax.tree.map(one, tree)


def box_params(params: Any, plan: Any) -> Any:
  """Wraps every parameter leaf in a `ZeroParam` carrying the plan's layouts."""
  cfg = plan.config
  reduce_dtype = jnp.dtype(cfg.reduce_dtype) if cfg.reduce_dtype else None
  compute_dtype = compute_dtype_of(cfg)
  spec = lambda s, nd: tuple(s) + (None,) * (nd - len(tuple(s)))

  def one(x, at_rest, compute, grad):
    nd = jnp.ndim(x)
    return ZeroParam(x, plan.mesh, spec(at_rest.spec, nd), spec(compute.spec, nd),
                     spec(grad.spec, nd), reduce_dtype,
                     offloaded=at_rest.memory_kind == HOST, compute_dtype=compute_dtype)

  return jax.tree.map(one, params, plan.params, plan.params_gathered, plan.grads)


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


def per_layer_reads(apply_fn: Callable, plan: Any) -> Callable:
  """A pure-function model ``apply_fn(params, ...)`` whose stacked parameters are read one
  layer at a time (``params["w"][i]`` in a Python loop), with each row's gradient reduced where
  it is made (``apply_fn`` itself at stage 1, which reduces once after the backward pass).

  Autodiff turns every ``w[i]`` into a zero-padded full-size cotangent and sums them at the end
  of the backward pass; XLA keeps all the padded copies for one fused sum (the 12-layer MLP of
  `benchmarks/patterns.py`: 1158 MiB of temp at stage 0, 169 MiB at stage 2 for a 96 MiB
  gradient). Here the model is traced once and each ``w[i]`` of a leaf read that way at least
  twice is threaded from read to read (`_read_row`), so the backward pass puts each row's
  cotangent in the gradient's layout as it is made (all-reduce at stage 0, reduce-scatter at
  2-3) and adds it into one gradient in place.

  A row that only feeds one matmul (``x @ params["w"][i]``, the usual case) goes further
  (`_row_dot`): a slice of a stacked array is a copy, and XLA:CPU issued all 24 row copies of
  that MLP at the start of the step and kept them for the backward pass (96 MiB, as much as
  the gradient). There the row is sliced only once the matmul's other operand exists, is not
  kept, and is sliced again in the backward pass once the matmul's output cotangent exists.
  At stage 3 XLA's partitioner then gathers one row where it is read, not the whole stack
  (hand-written FSDP's ``w[i]`` gathers every layer). Every other equation runs as written, so
  values are unchanged.
  """
  cfg = plan.config
  treedef = jax.tree.structure(plan.params)
  per_leaf = list(zip(jax.tree.leaves(plan.params), jax.tree.leaves(plan.grads)))  # rest, grad

  if cfg.stage == 1:  # the gradient is reduced once, after the backward pass
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
    rows: dict[int, set[int]] = {}
    for eqn in closed.jaxpr.eqns:
      if (read := _row_read(eqn, index)) is not None:
        rows.setdefault(read[0], set()).add(read[1])
    split = {k for k, r in rows.items()
             if len(r) >= 2 and _rows_stay_whole(per_leaf[k], jnp.ndim(leaves[k]))}
    if not split:
      return apply_fn(params, *args, **kwargs)
    matmul = _rows_into_matmuls(closed.jaxpr, index, split)
    carried: dict[int, jax.Array] = {}  # leaf -> the stacked value the next row is read from

    def rewrite(eqn, invals):
      if eqn in matmul.deferred:  # the row's slice and squeeze: made by `_row_dot` instead
        return [_DEFERRED]
      if eqn in matmul.dots:
        k, i, pos = matmul.dots[eqn]
        other = invals[1 - pos]
        out, carried[k] = _row_dot(carried.get(k, leaves[k]), other, i, pos, _Dot.of(eqn),
                                   _bare(per_leaf[k][1]), k not in carried)
        return [out]
      read = _row_read(eqn, index)
      if read is None or read[0] not in split:
        return None  # other reads of the leaf (w[i, :4], the whole stack) run as written
      k, i = read
      row, carried[k] = _read_row(carried.get(k, invals[0]), i, _bare(per_leaf[k][1]))
      return [row]

    outs = eval_jaxpr(closed, [*leaves, *arrays], rewrite)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return apply


_DEFERRED = object()  # stands for a row whose matmul `_row_dot` reads it itself


@dataclasses.dataclass(frozen=True)
class _RowMatmuls:
  """The row reads that feed exactly one matmul: ``deferred`` holds their slice and squeeze
  equations, ``dots`` maps each such matmul to ``(leaf, row, operand position)``."""
  deferred: frozenset
  dots: dict


def _rows_into_matmuls(jaxpr: Any, index: dict[Any, int], split: set[int]) -> _RowMatmuls:
  """Finds ``dot_general(x, squeeze(w[i:i+1]))`` (either operand) where the row is used by
  nothing else, for the leaves in ``split``."""
  from jax.extend.core import Var
  uses: dict[Any, list[tuple[Any, int]]] = {}
  for eqn in jaxpr.eqns:
    for pos, v in enumerate(eqn.invars):
      if isinstance(v, Var):
        uses.setdefault(v, []).append((eqn, pos))
  for v in jaxpr.outvars:
    if isinstance(v, Var):
      uses.setdefault(v, []).append((None, -1))
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
    return jax.lax.dot_general_p.bind(a, b, **dict(self.params))


def _row(w: jax.Array, i: int, token_of: jax.Array) -> jax.Array:
  """``w[i]``, sliced only once ``token_of`` (an array the caller is about to use it with)
  exists: the index is ``i + 0 * token`` (exactly ``i``; the token is finite, `_token_of`), a
  data dependency that costs one scalar rather than a pass over the row as `after` would."""
  t = _token_of(token_of)
  i = i if t is None else i + (t * 0).astype(jnp.int32)
  return jax.lax.dynamic_index_in_dim(w, i, axis=0, keepdims=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _row_dot(w: jax.Array, other: jax.Array, i: int, pos: int, dot: _Dot,
             grad: NamedSharding, first: bool) -> tuple[jax.Array, jax.Array]:
  """``(dot(w[i], other), w)``: a matmul with a row of ``w``, and ``w`` to read the next row
  from (threaded as in `_read_row`; ``first``: no read of ``w`` came before). The row is
  sliced after ``other`` exists and not saved: the backward pass slices it again after the
  output's cotangent exists.

  Except the first read's row, which is saved: its re-slice would feed only the cotangent of
  ``other``, which the update of ``w`` need not wait for, so XLA:CPU kept the donated ``w``
  alive past its update by copying the whole stack (96 MiB on pattern g). Saving one row per
  leaf instead leaves every read of ``w`` ordered before its update by data dependency.
  (Ordering that re-slice through a token instead cost XLA:TPU 46 MiB of temp there.)
  """
  return dot(_row(w, i, other), other, pos), w


def _row_dot_fwd(w, other, i, pos, dot, grad, first):
  row = _row(w, i, other)
  return (dot(row, other, pos), w), (w, other, row if first else None)


def _row_dot_bwd(i, pos, dot, grad, first, res, cts):
  w, other, saved = res
  ct_out, ct_w = cts
  row = saved if first else _row(w, i, ct_out)
  _, vjp = jax.vjp(lambda r, o: dot(r, o, pos), row, other)
  ct_row, ct_other = vjp(ct_out)
  return _add_row(ct_w, ct_row, i, grad), ct_other


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
  row = NamedSharding(grad.mesh, P(*tuple(grad.spec)[1:]))
  ct_w = jax.lax.with_sharding_constraint(ct_w, grad)
  ct_row = jax.lax.with_sharding_constraint(ct_row, row)[None]
  old = jax.lax.dynamic_slice_in_dim(ct_w, i, 1, axis=0)
  ct_w = jax.lax.dynamic_update_slice_in_dim(ct_w, old + ct_row.astype(ct_w.dtype), i, axis=0)
  return jax.lax.with_sharding_constraint(ct_w, grad)


def _rows_stay_whole(shardings: tuple, ndim: int) -> bool:
  """Whether a row ``w[i]`` of a leaf is laid out as the leaf is (axis 0 never sharded)."""
  return ndim >= 2 and all(
      not tuple(s.spec) or tuple(s.spec)[0] is None for s in shardings)


def _bare(s: NamedSharding) -> NamedSharding:
  """``s`` on the device (offload is not handled per row)."""
  return NamedSharding(s.mesh, s.spec)


def save_all_but_gathered(prim, *_, **params) -> bool:
  """Remat policy of the per-use formulation: save every residual except gathered parameters.

  A gathered weight is produced by `gather` (a ``custom_vjp_call``, or its sharding
  constraints once differentiated) and named `GATHERED`; none of these outputs may be saved, or
  autodiff would keep the gathered copy from forward to backward. Recomputing it re-gathers
  from the shard, which ZeRO-3 budgets for (3Ψ).
  (``jax.checkpoint_policies.save_anything_except_these_names`` cannot express this: in
  jax 0.10 it saves everything.)
  """
  if prim is name_p:
    return params.get("name") != GATHERED
  if prim.name == "custom_vjp_call" and _only_resharding(params.get("call_jaxpr")):
    return False  # `gather` itself, before differentiation has inlined it
  if prim.name == "device_put":
    return False  # an offloaded layer's shard, brought to the device: fetch it again
  return prim is not sharding_constraint_p


def _only_resharding(jaxpr: Any) -> bool:
  """Whether a ``custom_vjp_call``'s primal is a gather: only resharding (or nothing), or a
  written-out all-gather (the quantised formulation's `ManualGather`)."""
  inner = getattr(jaxpr, "jaxpr", jaxpr)
  eqns = getattr(inner, "eqns", None)
  return eqns is not None and (all(e.primitive is sharding_constraint_p for e in eqns)
                               or any(e.primitive.name == "all_gather" for e in eqns))


@dataclasses.dataclass(frozen=True)
class ScanRemat:
  """What zerojax does to the body of every ``jax.lax.scan`` (e.g. Flax ``nn.scan`` layers) in a
  step: the ``jax.checkpoint`` policy to wrap it in (``None``: leave bodies as written), whether
  bodies that already rematerialise (``nn.remat`` inside ``nn.scan``) are left alone, and how
  many layers may be live at once (``> 1`` unrolls the loop so the next layer's gather can
  overlap the current layer)."""

  policy: Any = None
  only_unremated: bool = True
  live_layers: int = 1
  marked_backward: bool = False  # `recompute_in_backward` instead of jax.checkpoint


def scan_remat(config: Any, per_use: bool) -> ScanRemat:
  """The scanned-layer remat of ``config`` (``config.remat``) for one formulation.

  Remat must act *inside* each scanned layer: remat around a scan recomputes all of its
  residuals in one extra pass and stacks them, which would bring back every layer's gathered
  weights at once.

  * ``'auto'`` (default): a scanned layer the user did not rematerialise would keep what the
    compiler gathered for it (every layer's gathered weights, stacked, until the backward pass;
    measured 101.8 MB against 24.0 MB on a 12-layer MLP), so zerojax rematerialises it
    (``nothing_saveable``; with per-use gathering, everything but the gathered weights).
    Layers the user wrapped in ``nn.remat``/``jax.checkpoint`` are left as written.
  * ``'none'``: scanned layers as written (per-use gathering still never saves gathered
    weights: that is the point of stage 3).
  * ``'full'``, ``'dots'``, ``'offload'``: that policy on every scanned layer.

  With ``quantize_weights`` and a full-precision backward re-gather (the default), every
  scanned layer keeps only its inputs and is re-run whole in its backward pass
  (`recompute_in_backward`), whatever ``remat`` says.
  """
  cp = jax.checkpoint_policies
  live = config.max_live_layers
  if per_use and config.quantize_weights is not None and not config.quantize_weights_backward:
    # The backward pass re-gathers in full precision: each layer is re-run whole in its
    # backward pass, marked as such (a rematerialised forward would repeat the quantised one).
    return ScanRemat(None, False, live, marked_backward=True)
  if config.remat == "full":
    return ScanRemat(cp.nothing_saveable, False, live)
  if config.remat == "dots":
    return ScanRemat(cp.dots_with_no_batch_dims_saveable, False, live)
  if config.remat == "offload":
    return ScanRemat(cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(config.remat_offload_names),
        offload_src="device", offload_dst="pinned_host"), False, live)
  if per_use:
    return ScanRemat(save_all_but_gathered, True, live)
  if config.remat == "auto":
    return ScanRemat(cp.nothing_saveable, True, live)
  return ScanRemat(None, True, live)


def remat_policy(config: Any, per_use: bool):
  """The ``jax.checkpoint`` policy around a whole model *without* scans (linen ``apply_fn``),
  or ``None`` for none. Per-use gathering needs one (else autodiff keeps every gathered weight
  as a residual); otherwise only an explicit ``config.remat`` asks for one."""
  if config.remat in ("full", "dots", "offload"):
    return scan_remat(config, per_use).policy
  return save_all_but_gathered if per_use else None


# -- the scan dispatcher ----------------------------------------------------------------------
# ``jax.lax.scan`` is replaced, once, by a dispatcher that reads a context variable: the
# step's `ScanRemat` while *this* thread traces a zerojax step, ``None`` otherwise. So other
# threads (and code outside a step) always get JAX's own scan. Code that bound ``scan`` before
# zerojax was imported (``from jax.lax import scan``) is not reached.

_SCAN: contextvars.ContextVar[ScanRemat | None] = contextvars.ContextVar(
    "zerojax_scan_remat", default=None)
_install_lock = threading.Lock()


def _body_rematerialises(f: Callable, init: Any, xs: Any) -> bool:
  """Whether a scan body already applies ``jax.checkpoint`` (e.g. ``nn.scan(nn.remat(B))``)."""
  spec = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
  x0 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)), xs)
  try:
    with _setting(_SCAN, None):
      jaxpr = jax.make_jaxpr(f)(jax.tree.map(spec, init), x0)
  except Exception:  # a body we cannot trace on its own: leave it as the user wrote it
    return True
  return jaxpr_has_primitive(jaxpr, REMAT_PRIMITIVE_NAMES)


def _dispatch_scan(f, init, xs=None, length=None, **kwargs):
  rs = _SCAN.get()
  if rs is None:
    return ORIGINAL_SCAN(f, init, xs, length, **kwargs)
  if rs.live_layers > 1:
    unroll = kwargs.get("unroll", 1)
    if not isinstance(unroll, bool) and unroll < rs.live_layers:
      kwargs["unroll"] = rs.live_layers
  if rs.marked_backward:
    f = recompute_in_backward(f)
  elif rs.policy is not None and not (rs.only_unremated and _body_rematerialises(f, init, xs)):
    f = jax.checkpoint(f, policy=rs.policy, prevent_cse=False)
  return ORIGINAL_SCAN(f, init, xs, length, **kwargs)


def _install_dispatcher() -> None:
  with _install_lock:
    if jax.lax.scan is not _dispatch_scan:
      functools.update_wrapper(_dispatch_scan, ORIGINAL_SCAN)
      jax.lax.scan = _dispatch_scan


@contextlib.contextmanager
def scanned_layers(rs: ScanRemat | None) -> Iterator[None]:
  """Applies ``rs`` to every scan traced in this thread (and context) inside the block."""
  _install_dispatcher()
  with _setting(_SCAN, rs):
    yield
