"""How a sharded parameter reaches the layer that reads it, and its gradient leaves.

Two formulations, chosen per model by `zerojax.step.wrap_apply_fn` (see `ZeroConfig.gather`):

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

from zerojax._compat import (ORIGINAL_SCAN, REMAT_PRIMITIVE_NAMES, jaxpr_has_primitive, name_p,
                             sharding_constraint_p)

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

  def unbox(self) -> jax.Array:
    v = self.value
    if not isinstance(v, jax.Array) or not jnp.issubdtype(v.dtype, jnp.inexact):
      return v
    ns = lambda s: NamedSharding(self.mesh, P(*s))
    if self.offloaded:  # this layer's shard comes from pinned_host just before use
      v = fetch(v, NamedSharding(self.mesh, P(*self.at_rest), memory_kind="device"))
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
    _, vjp = jax.vjp(lambda s, a: run(s, a, token), shards, arrays)
    return vjp(ct)

  layer.defvjp(layer_fwd, layer_bwd)
  arrays = [x for x, isa in zip(leaves, is_array) if isa]
  try:
    return layer([b.value for b in boxes], arrays)
  except (flax_errors.InvalidRngError, flax_errors.ScopeCollectionNotFound):
    # The module draws random numbers or writes a collection: run it as it is.
    return next_fun(*args, **kwargs)


def box_params(params: Any, plan: Any) -> Any:
  """Wraps every parameter leaf in a `ZeroParam` carrying the plan's layouts."""
  cfg = plan.config
  reduce_dtype = jnp.dtype(cfg.reduce_dtype) if cfg.reduce_dtype else None
  spec = lambda s, nd: tuple(s) + (None,) * (nd - len(tuple(s)))

  def one(x, at_rest, compute, grad):
    nd = jnp.ndim(x)
    return ZeroParam(x, plan.mesh, spec(at_rest.spec, nd), spec(compute.spec, nd),
                     spec(grad.spec, nd), reduce_dtype,
                     offloaded=at_rest.memory_kind == "pinned_host")

  return jax.tree.map(one, params, plan.params, plan.params_gathered, plan.grads)


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
  """Whether a ``custom_vjp_call``'s primal is `gather`: only resharding (or nothing)."""
  inner = getattr(jaxpr, "jaxpr", jaxpr)
  eqns = getattr(inner, "eqns", None)
  return eqns is not None and all(e.primitive is sharding_constraint_p for e in eqns)


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
  """
  cp = jax.checkpoint_policies
  live = config.max_live_layers
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
  cp = jax.checkpoint_policies
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
  if rs.policy is not None and not (rs.only_unremated and _body_rematerialises(f, init, xs)):
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
