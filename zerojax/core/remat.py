"""Remat policy: what a layer keeps for its backward pass under each formulation.

Remat must act inside each scanned layer: remat around a scan recomputes all of its residuals
in one extra pass and stacks them, which would bring back every layer's gathered weights at
once. So every ``jax.lax.scan`` traced inside a zerojax step goes through a dispatcher
(`zerojax._compat.scan_hook`, held only while a step traces) that wraps its body as `ScanRemat` says;
other threads, and code outside a step, get JAX's own scan. A model without scans goes under one
checkpoint (`checkpoint_model`) inside which its own checkpoints keep their policies
(`keeping_nested`, a rewrite of the traced model: JAX's rules are left as they are).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from jax.extend.core import Var

from zerojax._compat import (ORIGINAL_SCAN, REMAT_PRIMITIVE_NAMES, bind_eqn, eval_eqns,
                             jaxpr_has_primitive, name_p, read_var, scan_hook,
                             sharding_constraint_p, var_uses)
from zerojax.core.context import MadeGrads, setting, tracing
from zerojax.core.gather import GATHERED
from zerojax.core.pipeline import Declined, Pipeline, pipelined_scan
from zerojax.core.regather import inside_checkpoints

__all__ = ["ScanRemat", "scan_remat", "remat_policy", "checkpoint_model", "save_all_but_gathered",
           "recompute_in_backward", "scanned_layers", "block_policy"]


def recompute_in_backward(f: Callable) -> Callable:
  """``f`` (a scan body ``(carry, x) -> (carry, y)``) keeping only its inputs for the backward
  pass, which re-runs it as traced with `Tracing.in_backward` set (so a quantised formulation may
  re-gather in full precision); as ``jax.checkpoint`` with ``nothing_saveable``, but with the
  re-run marked."""

  def g(carry, x):
    # Both versions are traced here, where f's closed-over values are in scope; the backward
    # one is only evaluated in the backward pass.
    # (closure_convert caches its trace by function: each trace gets a function of its own)
    forward, consts = jax.closure_convert(lambda c, a: f(c, a), carry, x)
    with setting(in_backward=True):
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


def save_all_but_gathered(prim, *_, **params) -> bool:
  """Remat policy of the per-use formulation: save every residual except gathered parameters.

  A gathered weight is produced by `gather` (a ``custom_vjp_call``, or its sharding
  constraints once differentiated) and named `GATHERED`; none of these outputs may be saved, or
  autodiff would keep the gathered copy from forward to backward. Recomputing it re-gathers
  from the shard, which ZeRO-3 budgets for (3Ψ).
  (``jax.checkpoint_policies.save_anything_except_these_names`` cannot express this: in
  jax 0.10 it saves everything.)
  A model's own checkpoints inside (``nn.remat`` blocks in a Python loop) keep their policies
  (`checkpoint_model`): this one, around the whole model, would otherwise save every activation
  inside them.
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
  # A CSE barrier although the body is a scan's: XLA:TPU unrolls short loops and would then
  # merge the backward pass's re-gathers into the forward pass's, keeping gathered weights.
  prevent_cse: bool = True
  # Layers one ahead (`zerojax.core.pipeline`) where a scan's body qualifies; a scan that does
  # not is unrolled by ``live_layers``, the config's explicit ``max_live_layers``.
  pipeline: Pipeline | None = None


def scan_remat(config: Any, per_use: bool, pipeline: Pipeline | None = None) -> ScanRemat:
  """The scanned-layer remat of ``config`` (``config.remat``) for one formulation.

  Remat must act *inside* each scanned layer: remat around a scan recomputes all of its
  residuals in one extra pass and stacks them, which would bring back every layer's gathered
  weights at once.

  * ``'auto'`` (default): a scanned layer the user did not rematerialise would keep what the
    compiler gathered for it (every layer's gathered weights, stacked, until the backward
    pass), so zerojax rematerialises it whole (``nothing_saveable``) whatever the
    formulation: saving everything but the gathered weights keeps every layer's activations.
    Layers the user wrapped in ``nn.remat``/``jax.checkpoint`` are left as written.
  * ``'none'``: scanned layers as written (per-use gathering still never saves gathered
    weights: that is the point of stage 3).
  * ``'full'``, ``'dots'``, ``'offload'``: that policy on every scanned layer.

  With ``quantize_weights`` and a full-precision backward re-gather
  (``quantize_weights_backward=False``; by default it is quantised, see
  `ZeroConfig.quantizes_backward`), every scanned layer keeps only its inputs and is re-run
  whole in its backward pass (`recompute_in_backward`), whatever ``remat`` says.
  """
  cp = jax.checkpoint_policies
  live = config.max_live_layers or 1
  if per_use and config.quantize_weights is not None and not config.quantizes_backward:
    # The backward pass re-gathers in full precision: each layer is re-run whole in its
    # backward pass, marked as such (a rematerialised forward would repeat the quantised one).
    return ScanRemat(None, False, live, marked_backward=True)

  def wrap(policy: Any, only_unremated: bool) -> ScanRemat:
    # No CSE barrier with weights on the host: libtpu 0.0.42.1 fails to compile it ("Fusion
    # must have backend config"), or with max_live_layers=2 aborts in host-offload normalization.
    return ScanRemat(policy, only_unremated, live, prevent_cse=not config.offload_params,
                     pipeline=pipeline)

  if config.remat.policy == "full":
    return wrap(cp.nothing_saveable, False)
  if config.remat.policy == "dots":
    return wrap(cp.dots_with_no_batch_dims_saveable, False)
  if config.remat.policy == "offload":
    return wrap(cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(config.remat_offload_names),
        offload_src="device", offload_dst="pinned_host"), False)
  if config.remat.policy == "auto":
    return wrap(cp.nothing_saveable, True)
  return wrap(save_all_but_gathered if per_use else None, True)


def checkpoint_model(f: Callable, plan: Any, policy: Any, layers: bool) -> Callable:
  """``f``, a whole model without scans, under ``policy`` (`remat_policy`). The checkpoint is a
  CSE barrier only where the plan says (`Backend.model_checkpoint_prevents_cse`); under
  `save_all_but_gathered` the model's own checkpoints inside keep their policies
  (`keeping_nested`), and with ``layers`` (re-gathered layers) a layer inside one computes as
  written (`zerojax.core.regather.inside_checkpoints`)."""
  keep = layers and policy is save_all_but_gathered

  def traced(*args, **kwargs):
    with inside_checkpoints(keep):
      return f(*args, **kwargs)

  cse = plan.backend.model_checkpoint_prevents_cse
  if policy is save_all_but_gathered:
    return keeping_nested(traced, policy, cse)
  return jax.checkpoint(traced, policy=policy, prevent_cse=cse)


# Call primitives whose bodies a model's own checkpoints may sit in (a ``jax.jit``'d block).
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})


def keeping_nested(f: Callable, policy: Any, prevent_cse: bool = True) -> Callable:
  """``jax.checkpoint(f, policy=policy)``, except that a checkpoint ``f`` makes itself (a
  model's own ``nn.remat`` blocks) keeps its own policy, narrowed to what ``policy`` saves.

  JAX applies the outermost checkpoint's policy to every equation of a nested one: under one
  checkpoint around the whole model, a model's own remat blocks would save every activation
  inside them. So ``f`` is traced once and its equations run in order, each run of them
  between the model's own checkpoints under ``jax.checkpoint(policy)``, and each of those
  checkpoints at top level with the policy ``policy and its own`` (``nothing_saveable`` where
  it names none): its residuals are what it would save alone, less what ``policy`` forbids (a
  gathered weight), and its backward pass re-runs it once, as the model asks. A checkpoint
  inside a ``jax.jit``'d call is reached through the call; one inside a loop, a branch or a
  custom derivative follows ``policy`` as JAX decides.

  Args:
    f: the function (positional array arguments, pytrees welcome).
    policy: the ``jax.checkpoint`` policy around ``f``.
    prevent_cse: as ``jax.checkpoint``'s, for the runs between the model's own checkpoints.

  Returns:
    A function with ``f``'s signature and outputs.
  """
  def run(*args):
    flat, tree = jax.tree.flatten(args)
    closed, out_shape = jax.make_jaxpr(lambda *xs: f(*jax.tree.unflatten(tree, xs)),
                                       return_shape=True)(*flat)
    outs = _run_keeping_nested(closed.jaxpr, closed.consts, flat, policy, prevent_cse)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return run


def _run_keeping_nested(jaxpr: Any, consts: list, args: list, policy: Any,
                        prevent_cse: bool) -> list:
  """Evaluates ``jaxpr`` as `keeping_nested` says."""
  env: dict[Any, Any] = {**dict(zip(jaxpr.constvars, consts)), **dict(zip(jaxpr.invars, args))}
  n = len(jaxpr.eqns)
  index = {id(e): i for i, e in enumerate(jaxpr.eqns)}
  # The last equation reading each value (n: an output of the jaxpr).
  last_read = {v: max(n if e is None else index[id(e)] for e, _ in uses)
               for v, uses in var_uses(jaxpr).items()}
  run: list = []  # equations since the last nested checkpoint

  def close_run(end: int) -> None:
    eqns = list(run)
    run.clear()
    if not eqns:
      return
    made = {v for e in eqns for v in e.outvars}
    ins = list(dict.fromkeys(v for e in eqns for v in e.invars
                             if isinstance(v, Var) and v not in made))
    outs = [v for e in eqns for v in e.outvars if last_read.get(v, -1) >= end]

    def part(*values):
      local = dict(zip(ins, values))
      eval_eqns(eqns, local)
      return [local[v] for v in outs]

    results = jax.checkpoint(part, policy=policy, prevent_cse=prevent_cse)(
        *[env[v] for v in ins])
    env.update(zip(outs, results))

  for i, eqn in enumerate(jaxpr.eqns):
    name = eqn.primitive.name
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")) if name in _CALLS else None
    if name in REMAT_PRIMITIVE_NAMES:
      close_run(i)
      own = eqn.params.get("policy") or jax.checkpoint_policies.nothing_saveable
      both = lambda prim, *avals, _own=own, **params: (policy(prim, *avals, **params)
                                                       and _own(prim, *avals, **params))
      outs = bind_eqn(eqn, [read_var(env, v) for v in eqn.invars], policy=both)
    elif body is not None and jaxpr_has_primitive(body, REMAT_PRIMITIVE_NAMES):
      close_run(i)  # a call holding the model's own checkpoints: run through, as if inlined
      outs = _run_keeping_nested(getattr(body, "jaxpr", body), list(getattr(body, "consts", ())),
                                 [read_var(env, v) for v in eqn.invars], policy, prevent_cse)
    else:
      run.append(eqn)
      continue
    env.update(zip(eqn.outvars, outs))
  close_run(n)
  return [read_var(env, v) for v in jaxpr.outvars]


def remat_policy(config: Any, per_use: bool, blocks: bool = False):
  """The ``jax.checkpoint`` policy around a whole model *without* scans (linen ``apply_fn``),
  or ``None`` for none. Per-use gathering needs one (else autodiff keeps every gathered weight
  as a residual); otherwise only an explicit ``config.remat`` asks for one, unless the model's
  ``blocks`` each get it (`zerojax.core.blocks`)."""
  named = block_policy(config)
  if named is not None and not blocks:
    return named
  return save_all_but_gathered if per_use else None


def block_policy(config: Any):
  """The policy ``config.remat`` names for each block or scanned layer (``None``: none named)."""
  if config.remat.policy in ("full", "dots", "offload"):
    return scan_remat(config, False).policy
  return None



def _body_rematerialises(f: Callable, init: Any, xs: Any) -> bool:
  """Whether a scan body already applies ``jax.checkpoint`` (e.g. ``nn.scan(nn.remat(B))``)."""
  spec = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
  x0 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)), xs)
  try:
    with setting(scan=None):
      jaxpr = jax.make_jaxpr(f)(jax.tree.map(spec, init), x0)
  except Exception:  # a body we cannot trace on its own: leave it as the user wrote it
    return True
  return jaxpr_has_primitive(jaxpr, REMAT_PRIMITIVE_NAMES)


def _dispatch_scan(f, init, xs=None, length=None, **kwargs):
  rs = tracing().scan
  if rs is None:
    return ORIGINAL_SCAN(f, init, xs, length, **kwargs)
  if rs.pipeline is not None:
    def as_written(c, x):  # the layer's own body: scans inside it are not routed again
      with setting(scan=None):
        return f(c, x)
    out = pipelined_scan(rs.pipeline, as_written, init, xs, length, **kwargs)
    if not isinstance(out, Declined):
      out, ran = out
      _record(ran)
      return out
    _record(out.reason)
  if rs.live_layers > 1:
    unroll = kwargs.get("unroll", 1)
    if not isinstance(unroll, bool) and unroll < rs.live_layers:
      kwargs["unroll"] = rs.live_layers
  if rs.marked_backward:
    f = recompute_in_backward(f)
  elif rs.policy is not None and not (rs.only_unremated and _body_rematerialises(f, init, xs)):
    f = jax.checkpoint(f, policy=rs.policy, prevent_cse=rs.prevent_cse)
  return ORIGINAL_SCAN(f, init, xs, length, **kwargs)



def _record(outcome: Any) -> None:
  outcomes = tracing().scan_outcomes
  if outcomes is not None:
    outcomes.append(outcome)


@contextlib.contextmanager
def scanned_layers(rs: ScanRemat | None) -> Iterator[list]:
  """Applies ``rs`` to every scan traced in this thread (and context) inside the block. Yields
  the list of what became of each scan given a pipeline: a `zerojax.core.pipeline.OneAhead`
  where its layers ran one ahead, else the reason they could not."""
  outcomes: list = []
  made = MadeGrads() if rs is not None and rs.pipeline is not None else None
  with scan_hook(_dispatch_scan), setting(scan=rs, scan_outcomes=outcomes, made_grads=made):
    yield outcomes
