"""Formulation choice: how the step reaches each parameter, decided once per model.

Two formulations (see `ZeroConfig.gather`):

* **the compiler's**: the step's inputs, outputs and gradients carry the plan's shardings and
  XLA's partitioner inserts the gathers and reduce-scatters, as hand-written JAX FSDP does;
* **per use**: every parameter is boxed (`zerojax.core.gather`) and gathered where a layer
  reads it, in the compute dtype, and re-gathered in the backward pass.

The model is traced once to see how it is written (scans, remat) and `choose` decides before
anything compiles; the plan exposes it as `ShardingPlan.formulation`, with the compiler options
the stage needs on the plan's backend (`compiler_options`). Only shapes and the plan's own
decisions are read here, so the plan can import this module.
"""

from __future__ import annotations

import os
import re
from typing import Any, NamedTuple

from jax.extend.core import Var

from zerojax._compat import REMAT_PRIMITIVE_NAMES, jaxpr_has_primitive, subjaxprs, xla_gpu_options
from zerojax.core.pipeline import OneAhead
from zerojax.core.remat import block_policy, remat_policy

__all__ = ["Formulation", "choose", "remat_applied", "lookup_tables", "finds_tables",
           "needs_trace", "compiler_options",
           "GPU_COMPILER_OPTIONS", "GPU_LAYERS_AHEAD_OPTIONS", "GPU_PIPELINED_OPTIONS",
           "GPU_IN_CHECKPOINTS_IN_FLIGHT", "TPU_COMPILER_OPTIONS"]


class Formulation(NamedTuple):
  """The formulation chosen for one model, read by every way a model runs (linen, NNX, a pure
  function):

  * ``per_use``: gathered per use (boxes), or by the compiler;
  * ``has_scan``: the model scans its layers (then each layer's remat is applied inside the
    scan, `zerojax.core.remat.scanned_layers`);
  * ``tables``: its lookup tables (`lookup_tables`: parameter leaves, in tree order, whose
    gradient is summed whole);
  * ``checkpoint``: the ``jax.checkpoint`` policy around a model without scans
    (`zerojax.core.remat.remat_policy`), or None for none;
  * ``layers``: that model's layers each re-gather their weights after their input, and again
    after their output's cotangent (`zerojax.core.regather`): per use with sharded parameters;
  * ``blocks``: the paths of a linen or NNX model's blocks (no scans), each checkpointed with
    ``block_policy``, the policy ``remat`` names (`zerojax.core.blocks`).
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
  """The formulation for a model traced (with the compiler's formulation) as ``jaxpr``, or
  for an NNX model (``jaxpr`` None). ``linen``: a linen model through ``state.apply_fn``; a
  plain function of the parameter tree is gathered per use by rewriting its matmuls
  (`zerojax.core.rows`), an NNX model through boxes in its ``nnx.Param`` variables
  (`zerojax.core.grad`).

  The model's lookup tables are found in the same trace (`lookup_tables`), and the checkpoint
  around a model without scans is chosen: with ``remat='full'``, ``'dots'`` or ``'offload'``
  and the model's repeated ``blocks`` (`zerojax.core.blocks`), the named policy goes on each
  block and the model keeps the checkpoint ``'auto'`` gives it; without blocks, on the whole
  model. An NNX model is traced where `needs_trace` says so; without a trace (``jaxpr``
  None) a model is taken to have no scans.

  A setting that acts at each use (`ShardingPlan.gathers_per_use`) always gathers per use.
  Otherwise ``gather='auto'`` at stage 3 gathers per use on TPU and GPU, where XLA's
  partitioner left to itself keeps square kernels sharded and moves the layer's activations
  instead of its weights; on XLA:CPU the partitioner's formulation matches hand-written FSDP
  except for an unscanned linen model without remat, which would keep every layer's gathered
  weights for the backward pass (other models keep the partitioner's formulation there, as
  the CPU conformance table measures them).
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
  """Where ``config.remat`` acted in a step whose model got ``chosen`` (as `zerojax compile`
  and `ZeroStep.remat` report it)."""
  r = f"remat={config.remat!r}"
  if chosen is None:
    # Untraced (an NNX model at stages 0-1, or on XLA:CPU without per-use gathers): zerojax's
    # scan hook still acts on any scan the step traces.
    return (f"{r}: the model was not traced for its formulation; any scanned layers run "
            + ("as written" if config.remat == "none" else "with it inside each layer"))
  if chosen.has_scan:
    return (f"{r}: inside each scanned layer the model does not rematerialise itself"
            if config.remat == "auto" else
            f"{r}: inside each scanned layer" if config.remat != "none" else
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
  if plan.config.gather != "auto" or not plan.params_sharded:
    return False
  if not any(lp.is_sharded for lp in plan.leaves):
    return False
  if plan.platform != "cpu":
    return True
  if not linen:
    return False
  # XLA:CPU's partitioner keeps every layer's gathered weights of an unscanned model for the
  # backward pass when a kernel is sharded on the dimension its layer contracts; per use bounds
  # that to one layer whatever the shapes.
  return plan.config.remat == "auto" and not has_scan and not remats


# Primitives that pass a parameter on as the same values (cast, reshaped, sliced, named).
_SAME_VALUES = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims",
                          "broadcast_in_dim", "transpose", "copy", "copy_p", "slice",
                          "dynamic_slice", "sharding_constraint", "name", "optimization_barrier"})


def lookup_tables(plan: Any, jaxpr: Any) -> frozenset[int]:
  """Which inputs of a model's ``jaxpr`` (its parameter leaves, in tree order) are tables it
  looks rows up in (the operand of a ``gather``, through casts, reshapes and slices), on a
  plan whose gradients are sharded (stages 2-3): each use's gradient is summed whole before it
  is sharded (`zerojax.core.gather.box_params`; a pure function's, `zerojax.core.rows`).

  Left to itself, XLA:TPU's and XLA:GPU's partitioner computes the gradient of a lookup into a
  table whose gradient is sharded where the shard lives: it all-gathers every device's cotangent
  rows (the global batch's activations) and the token ids, and scatter-adds them into the local
  shard. Summed whole first, each device scatter-adds its own rows and the sum is
  reduce-scattered, as for any weight. XLA:CPU keeps the formulation its conformance table
  measures."""
  if not finds_tables(plan) or jaxpr is None:
    return frozenset()
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  taint = [frozenset({i}) for i in range(len(jaxpr.invars))]
  return _inputs_reaching(jaxpr, taint, "gather")[0]


def finds_tables(plan: Any) -> bool:
  """Whether `lookup_tables` can find any on ``plan``: gradients sharded (stages 2-3) on a
  compiler other than XLA:CPU."""
  return plan.config.shards_grads and plan.platform != "cpu"


def needs_trace(plan: Any, untraced: Formulation) -> bool:
  """Whether a model whose formulation without a trace is ``untraced`` must be traced for it:
  it gathers per use, is checkpointed, or may look rows up in tables (`finds_tables`)."""
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


GPU_COMPILER_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True,
                        "xla_gpu_enable_pipelined_all_gather": True,
                        "xla_gpu_enable_pipelined_reduce_scatter": True,
                        "xla_gpu_enable_while_loop_double_buffering": True,
                        "xla_gpu_reduce_scatter_combine_threshold_bytes": 1,
                        "xla_gpu_all_gather_combine_threshold_bytes": 1 << 20}

# XLA:GPU, a model without scans whose layers gather one matmul layer ahead
# (`ShardingPlan.prefetches_next_layer`): see `compiler_options`.
GPU_LAYERS_AHEAD_OPTIONS = {"xla_gpu_enable_analytical_latency_estimator": True,
                            "xla_gpu_experimental_parallel_collective_overlap_limit": 8,
                            "xla_gpu_experimental_collective_start_as_early_as_possible": True}

# XLA:GPU, a pure function whose row matmuls gather one row matmul ahead
# (`zerojax.core.rows`): see `compiler_options`.
GPU_ROWS_AHEAD_OPTIONS = {"xla_gpu_experimental_parallel_collective_overlap_limit": 5}

# XLA:GPU, collectives in flight where layers gathered one matmul layer ahead ran inside a
# model's own checkpoints: see `compiler_options`.
GPU_IN_CHECKPOINTS_IN_FLIGHT = 32

# XLA:GPU, a step whose scanned layers run one ahead (`zerojax.core.pipeline`): the loops
# already issue each collective an iteration ahead, so XLA's own pipelining and double
# buffering are off, and the combine thresholds are raised to the largest layer's
# collectives; see `compiler_options`.
GPU_PIPELINED_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True,
                         "xla_gpu_enable_analytical_latency_estimator": True,
                         "xla_gpu_reduce_scatter_combine_threshold_bytes": 1,
                         "xla_gpu_all_gather_combine_threshold_bytes": 1 << 20}

TPU_COMPILER_OPTIONS = {"xla_tpu_enable_ici_ag_pipelining": True}

# Where a user sets the flags each backend's options stand for; a flag set there wins.
_USER_FLAGS = {"gpu": "XLA_FLAGS", "tpu": "LIBTPU_INIT_ARGS"}


def compiler_options(plan: Any, layers_ahead: bool = False, pipelined: Any = None,
                     in_checkpoints: bool = False, rows_ahead: bool = False
                     ) -> dict[str, Any] | None:
  """XLA options the stage needs on this backend; ``layers_ahead``: for a step whose model
  (no scans) gathered its layers one matmul layer ahead (`zerojax.core.regather.prefetching`),
  ``in_checkpoints`` where some of them ran inside the model's own checkpoints
  (`zerojax.core.regather.inside_checkpoints`); ``pipelined``: for a step whose scanned layers
  ran one ahead (`zerojax.core.pipeline`), the largest layer's
  `zerojax.core.pipeline.OneAhead`.

  At stages 2-3 each layer's gradient must be reduce-scattered as soon as it exists. XLA's
  CPU backend merges all gradient all-reduces of an unscanned model into one combined op,
  which keeps every layer's full gradient alive until the end of the backward pass (GPU
  backends bound this with ``--xla_gpu_*_combine_threshold_bytes``, DeepSpeed's
  ``reduce_bucket_size``). There is no threshold on CPU, so the combiner is turned off. At
  stage 1 it would merge the once-per-step reduction of every leaf into one op whose output
  (full size: XLA:CPU lowers reduce-scatter as all-reduce) coexists with the local gradient:
  2G of temporaries instead of G.

  On XLA:GPU the latency-hiding scheduler with pipelined all-gathers and reduce-scatters and
  double-buffered loops issues the next layer's gather while the current one computes (the
  flags MaxText ships for GPUs). Each gradient is reduce-scattered on its own (combine
  threshold 1 byte): combined, a layer's reductions waited for its last gradient (a norm's,
  at the end of its backward pass) with nothing left to compute beside them. They are
  per-compile options, so they need no process-wide ``XLA_FLAGS``; a flag set there (by the
  user, or by a DeepSpeed config's bucket sizes and ``overlap_comm``) wins. All-gathers are
  combined only up to 1 MiB: XLA's combiner joins independent gathers into one op that waits
  for the last of their inputs, so a weight prefetched for the next layer
  (`ShardingPlan.prefetches_next_layer`) would wait for that layer's norm scales, and a
  scanned layer's gathers for each other.

  Where layers gather one matmul layer ahead, XLA:GPU schedules with its analytical latency
  estimator and up to eight collectives in flight: with one, a layer's reduce-scatters held
  the slot while its matmuls ran and the next layer's gathers waited; with two or four, the
  query, key and value gathers and the previous layer's reduce-scatters still queued behind
  each other (six or more gave the same schedule as sixteen). Each collective also starts as
  early as its operands allow: otherwise the scheduler left a layer's query, key and value
  gathers beside the previous layer's residual add and norm, which it judged long enough. That
  keeps about one more layer's gathered weights alive, the memory `max_live_layers=2` allows
  scanned layers. Not inside a model's own checkpoints (``nn.remat`` blocks), where the
  blocks' re-runs in the backward pass gather too, and starting early held more of them at
  once (a small GPT's loop of remat blocks: 25.9 -> 33.8 MB of temp). Not started early,
  their collectives keep the same temp with more in flight, and more of them find a matmul
  (`GPU_IN_CHECKPOINTS_IN_FLIGHT`). A pure function's row matmuls (``rows_ahead``, gathered
  one row matmul ahead both ways) keep XLA's estimator and start times with five collectives
  in flight: with one, each row's gradient reduce-scatter ran blocking, its slot wanted by
  the next gather; with the analytical estimator, most reduce-scatters lost their matmuls.
  A scanned layer's
  reduce-scatters lost their matmuls under the same options, so scanned models keep one in
  flight.

  Where scanned layers ran one ahead, each loop iteration already holds the next layer's
  gather and the previous layer's reduce-scatter, neither waiting for anything the iteration
  computes. XLA:GPU's collective pipeliner and double buffering would move them once more
  (two layers ahead, more memory), so they are off, and the analytical latency estimator
  tells the scheduler how long each collective and matmul takes: with the approximate one it
  left the reduce-scatters beside no matmul. Each layer gathers and reduces weight by weight,
  so each weight and gradient has a buffer of its own (one flat buffer, sliced, held the
  gathered layer twice); XLA's combiners join a layer's collectives into one of each kind, up
  to the size of the largest layer's (not beyond: an embedding table's collectives in the
  same computation stay their own).

  On XLA:TPU, ICI all-gather pipelining issues a scanned layer's gather an iteration ahead:
  measured one by one among the flags MaxText ships (BENCHMARKS.md), it is the one that moved
  the schedule. A flag in ``LIBTPU_INIT_ARGS`` wins there.
  """
  platform = plan.platform
  if plan.config.shards_opt_state and platform == "cpu":
    return {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
  defaults = {"gpu": GPU_COMPILER_OPTIONS, "tpu": TPU_COMPILER_OPTIONS}.get(platform)
  if defaults is None:
    return None
  if pipelined is not None and not isinstance(pipelined, OneAhead):
    raise TypeError(f"pipelined={pipelined!r} is invalid: the largest scanned layer's "
                    "zerojax.core.pipeline.OneAhead(gathered, reduced) bytes, or None")
  if pipelined is not None and platform == "gpu":
    defaults = {**GPU_PIPELINED_OPTIONS,
                "xla_gpu_all_gather_combine_threshold_bytes": max(
                    pipelined.gathered, GPU_PIPELINED_OPTIONS[
                        "xla_gpu_all_gather_combine_threshold_bytes"]),
                "xla_gpu_reduce_scatter_combine_threshold_bytes": pipelined.reduced}
  elif rows_ahead and not layers_ahead and platform == "gpu":
    defaults = {**defaults, **GPU_ROWS_AHEAD_OPTIONS}
  elif layers_ahead and platform == "gpu":
    defaults = {**defaults, **GPU_LAYERS_AHEAD_OPTIONS}
    if in_checkpoints:
      del defaults["xla_gpu_experimental_collective_start_as_early_as_possible"]
      defaults["xla_gpu_experimental_parallel_collective_overlap_limit"] = (
          GPU_IN_CHECKPOINTS_IN_FLIGHT)
  if platform == "gpu":
    defaults = xla_gpu_options(defaults)
  user = set(re.findall(r"--(xla_\w+)", os.environ.get(_USER_FLAGS[platform], "")))
  return {k: v for k, v in defaults.items() if k not in user} or None
