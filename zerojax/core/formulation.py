"""Formulation choice: how the step reaches each parameter, decided once per model.

Two formulations (see `ZeroConfig.gather`):

* **the compiler's**: the step's inputs, outputs and gradients carry the plan's shardings and
  XLA's partitioner inserts the gathers and reduce-scatters, as hand-written JAX FSDP does;
* **per use**: every parameter is boxed (`zerojax.core.gather`) and gathered where a layer
  reads it, in the compute dtype, and re-gathered in the backward pass.

The model is traced once to see how it is written (scans, remat) and `choose` decides before
anything compiles; the plan exposes it as `ShardingPlan.formulation`. Only shapes and the plan's
own decisions are read here, so the plan can import this module.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from jax.extend.core import Var

from zerojax._compat import REMAT_PRIMITIVE_NAMES, jaxpr_has_primitive, subjaxprs
from zerojax.core.remat import block_policy, remat_policy

__all__ = ["Formulation", "choose", "remat_applied", "lookup_tables", "finds_tables",
           "needs_trace"]


class Formulation(NamedTuple):
  """The formulation chosen for one model, read by every way a model runs (linen, NNX, a pure
  function).

  Attributes:
    per_use: gathered per use (boxes); False: by the compiler.
    has_scan: the model scans its layers (then each layer's remat is applied inside the scan,
      `zerojax.core.remat.scanned_layers`).
    tables: its lookup tables (`lookup_tables`: indices of parameter leaves, in tree order,
      whose gradient is summed whole).
    checkpoint: the ``jax.checkpoint`` policy around a model without scans
      (`zerojax.core.remat.remat_policy`), or None for none.
    layers: that model's layers each re-gather their weights after their input, and again
      after their output's cotangent (`zerojax.core.regather`): per use with sharded
      parameters.
    blocks: the paths of a linen or NNX model's blocks (no scans), each checkpointed with
      ``block_policy``.
    block_policy: the policy ``remat`` names, for each of ``blocks`` (`zerojax.core.blocks`),
      or None without blocks.
  """
  per_use: bool
  has_scan: bool
  tables: frozenset[int] = frozenset()
  checkpoint: Any = None
  layers: bool = False
  blocks: frozenset[tuple] = frozenset()
  block_policy: Any = None


def choose(plan: Any, jaxpr: Any, linen: bool = True,
           blocks: frozenset[tuple] = frozenset()) -> Formulation:
  """How a model reaches its parameters on ``plan``'s target, decided before it compiles.

  A setting that acts at each use (`ShardingPlan.gathers_per_use`) always gathers per use.
  Otherwise ``gather='auto'`` gathers per use from the stage the backend names
  (`zerojax.core.backend.Backend.per_use_from_stage`), and elsewhere, at stage 3, only an
  unscanned linen model with ``remat='auto'`` and no checkpoints of its own. With ``remat='full'``,
  ``'dots'`` or ``'offload'`` and repeated ``blocks``, the named policy goes on each block;
  without blocks, on the whole model.

  Args:
    plan: the `zerojax.ShardingPlan`.
    jaxpr: the model traced with the compiler's formulation, or None for an NNX model that
      `needs_trace` did not trace (then it is taken to have no scans).
    linen: the model is a linen model applied through ``state.apply_fn``; False for a pure
      function of the parameter tree (gathered per use by rewriting its matmuls,
      `zerojax.core.rows`) or an NNX model (boxes in its ``nnx.Param`` variables).
    blocks: the paths of the model's repeated blocks (`zerojax.core.blocks`).

  Returns:
    The `Formulation`.
  """
  has_scan = jaxpr is not None and jaxpr_has_primitive(jaxpr, frozenset({"scan"}))
  remats = jaxpr is not None and jaxpr_has_primitive(jaxpr, REMAT_PRIMITIVE_NAMES)
  per_use = plan.gathers_per_use or _per_use_by_default(plan, has_scan, remats, linen)
  named = block_policy(plan.config)
  blocks = blocks if (named is not None and not has_scan) else frozenset()
  checkpoint = None if has_scan else remat_policy(plan.config, per_use, bool(blocks))
  return Formulation(per_use, has_scan, lookup_tables(plan, jaxpr), checkpoint,
                     checkpoint is not None and per_use and plan.params_sharded,
                     blocks, named if blocks else None)


def remat_applied(config: Any, chosen: Formulation | None) -> str:
  """Where ``config.remat`` acted in a step, as `zerojax compile` and `ZeroStep.remat` report it.

  Args:
    config: the run's `zerojax.ZeroConfig`.
    chosen: the model's `Formulation`, or None where the model was not traced for one.

  Returns:
    One line, e.g. ``"remat='auto': inside each scanned layer the model does not rematerialise
    itself"``.
  """
  r = f"remat={config.remat.policy!r}"
  if chosen is None:
    # Untraced (an NNX model at stages 0-1, or without per-use gathers): zerojax's
    # scan hook still acts on any scan the step traces.
    return (f"{r}: the model was not traced for its formulation; any scanned layers run "
            + ("as written" if config.remat.policy == "none" else "with it inside each layer"))
  if chosen.has_scan:
    return (f"{r}: inside each scanned layer the model does not rematerialise itself"
            if config.remat.policy == "auto" else
            f"{r}: inside each scanned layer" if config.remat.policy != "none" else
            f"{r}: scanned layers as written")
  if chosen.blocks:
    natural = lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)]
    names = sorted(("/".join(map(str, p)) for p in chosen.blocks), key=natural)
    return f"{r}: on each of {len(names)} blocks ({names[0]} ... {names[-1]})"
  if block_policy(config) is not None:
    return (f"{r}: around the whole model, which saves little (no modules repeat, or it is a "
            "pure function)")
  return f"{r}: no scanned layers; the model's own checkpoints, if any, as written"


def _per_use_by_default(plan: Any, has_scan: bool, remats: bool, linen: bool) -> bool:
  """Whether ``gather='auto'`` gathers per use for this model and target (see `choose`)."""
  if plan.config.gather.mode != "auto" or not any(lp.is_sharded for lp in plan.leaves):
    return False
  if plan.backend.per_use_at(plan.config):
    return True
  if not linen or not plan.params_sharded:
    return False
  # Left to the partitioner, an unscanned model may keep every layer's gathered weights for the
  # backward pass; per use bounds that to one layer whatever the shapes.
  return plan.config.remat.policy == "auto" and not has_scan and not remats


# Primitives that pass a parameter on as the same values (cast, reshaped, sliced, named).
_SAME_VALUES = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims",
                          "broadcast_in_dim", "transpose", "copy", "copy_p", "slice",
                          "dynamic_slice", "sharding_constraint", "name", "optimization_barrier"})


def lookup_tables(plan: Any, jaxpr: Any) -> frozenset[int]:
  """Which parameters a model looks rows up in, so each use's gradient is summed whole.

  A table is a parameter leaf that reaches the operand of a ``gather`` through casts, reshapes
  and slices. Where `finds_tables` holds, each use's gradient is summed whole before it is
  sharded (`zerojax.core.gather.box_params`; a pure function's, `zerojax.core.rows`), so a
  device scatter-adds only its own rows and the sum is reduce-scattered as for any weight.

  Args:
    plan: the `zerojax.ShardingPlan`.
    jaxpr: the model's jaxpr, its inputs the parameter leaves in tree order; or None.

  Returns:
    The indices of the tables among the parameter leaves (empty where `finds_tables` does not
    hold or there is no jaxpr).
  """
  if not finds_tables(plan) or jaxpr is None:
    return frozenset()
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  taint = [frozenset({i}) for i in range(len(jaxpr.invars))]
  return _inputs_reaching(jaxpr, taint, "gather")[0]


def finds_tables(plan: Any) -> bool:
  """Whether `lookup_tables` can find any on ``plan``.

  Args:
    plan: the `zerojax.ShardingPlan`.

  Returns:
    True where gradients are sharded (stages 2-3) on a backend that finds tables
    (`zerojax.core.backend.Backend.finds_tables`).
  """
  return plan.config.shards_grads and plan.backend.finds_tables


def needs_trace(plan: Any, untraced: Formulation) -> bool:
  """Whether a model must be traced for its formulation.

  Args:
    plan: the `zerojax.ShardingPlan`.
    untraced: the model's formulation without a trace.

  Returns:
    True where it gathers per use, is checkpointed, or may look rows up in tables
    (`finds_tables`).
  """
  return untraced.per_use or untraced.checkpoint is not None or finds_tables(plan)


def _inputs_reaching(jaxpr: Any, taint: list[frozenset[int]], primitive: str
                     ) -> tuple[frozenset[int], list[frozenset[int]]]:
  """Inputs (labels in ``taint``, one per invar) reaching an operand of ``primitive`` (of a
  ``gather``, its operand, not its indices), and the labels of the outputs."""
  none = frozenset()
  of = dict(zip(jaxpr.invars, taint))
  get = lambda v: of.get(v, none) if isinstance(v, Var) else none  # a Literal is no input
  hits: set[int] = set()
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == primitive:
      for v in eqn.invars[:1] if name == "gather" else eqn.invars:
        hits |= get(v)
    elif name in _SAME_VALUES:
      for k, out in enumerate(eqn.outvars):
        of[out] = get(eqn.invars[min(k, len(eqn.invars) - 1)])
    else:
      for sub in subjaxprs(eqn.params):
        skip = len(eqn.invars) - len(sub.invars)  # cond's branch index
        if skip < 0:
          continue
        inner, outs = _inputs_reaching(sub, [get(v) for v in eqn.invars[skip:]], primitive)
        hits |= inner
        if len(outs) == len(eqn.outvars):
          for out, t in zip(eqn.outvars, outs):
            of[out] = of.get(out, none) | t
  return frozenset(hits), [get(v) for v in jaxpr.outvars]
