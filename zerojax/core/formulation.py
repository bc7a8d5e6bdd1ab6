"""Formulation choice: how the step reaches each parameter, decided once per model.

Two formulations (see `ZeroConfig.gather`):

* **the compiler's**: the step's inputs, outputs and gradients carry the plan's shardings and
  XLA's partitioner inserts the gathers and reduce-scatters, as hand-written JAX FSDP does;
* **per use**: every parameter is boxed (`zerojax.core.gather`) and gathered where a layer
  reads it, in the compute dtype, and re-gathered in the backward pass.

The model is traced once to see how it is written (scans, remat) and `choose` decides before
anything compiles. `ModelApply` is ``state.apply_fn`` as the chosen formulation runs it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from zerojax._compat import REMAT_PRIMITIVE_NAMES, jaxpr_has_primitive
from zerojax.core import context
from zerojax.core.config import ConfigError
from zerojax.core.dtypes import compute_dtype_of, to_compute
from zerojax.core.gather import box_params
from zerojax.core.plan import ShardingPlan
from zerojax.core.regather import regather_layers
from zerojax.core.remat import remat_policy
from zerojax.core.rows import per_layer_reads
from zerojax.core.zeropp import shard_map_apply

__all__ = ["Formulation", "choose", "ModelApply", "compiler_options", "GPU_COMPILER_OPTIONS",
           "per_use_reason"]


class Formulation(NamedTuple):
  """The formulation chosen for one model: ``per_use`` (boxes) or the compiler's, and whether
  the model scans its layers (then each layer's remat is applied inside the scan)."""
  per_use: bool
  has_scan: bool

  @property
  def name(self) -> str:
    return "per use" if self.per_use else "compiler"


def choose(plan: ShardingPlan, jaxpr: Any) -> Formulation:
  """The formulation for a model traced (with the compiler's formulation) as ``jaxpr``.

  A setting that acts at each use (`ShardingPlan.gathers_per_use`) always gathers per use.
  Otherwise ``gather='auto'`` at stage 3 gathers per use on TPU and GPU, where XLA's
  partitioner left to itself keeps square kernels sharded and moves the layer's activations
  instead of its weights; on XLA:CPU the partitioner's formulation matches hand-written FSDP
  except for an unscanned model without remat, which would keep every layer's gathered
  weights for the backward pass.
  """
  has_scan = jaxpr_has_primitive(jaxpr, frozenset({"scan"}))
  remats = jaxpr_has_primitive(jaxpr, REMAT_PRIMITIVE_NAMES)
  return Formulation(plan.gathers_per_use or _per_use_by_default(plan, has_scan, remats),
                     has_scan)


class ModelApply:
  """``state.apply_fn`` as the step's formulation runs it (see `ZeroConfig.gather`).

  The first call traces the model once, with shapes only, and `choose` fixes `formulation`
  for every later trace, before anything compiles. Per use, every parameter is boxed: each
  layer gathers its weights, in the compute dtype, where it reads them, and re-gathers them in
  the backward pass. A plain pytree model (called with the plan's parameter tree itself) runs
  through `zerojax.core.rows.per_layer_reads`.
  """

  def __init__(self, apply_fn: Callable, plan: ShardingPlan):
    functools.update_wrapper(self, apply_fn)
    self.apply_fn, self.plan = apply_fn, plan
    self.formulation: Formulation | None = None
    self._treedef = jax.tree.structure(plan.params)
    self._pure = per_layer_reads(apply_fn, plan)
    self._dtype = compute_dtype_of(plan.config)
    self._warned = False

  def __call__(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
    plan, cd = self.plan, self._dtype
    args = to_compute(args, cd)  # the batch's floating inputs enter in the compute dtype
    if not plan.gathers_per_use and jax.tree.structure(variables) == self._treedef:
      # A pure function of the plan's parameters (a plain pytree model).
      return self._pure(to_compute(variables, cd), *args, **kwargs)
    params = variables.get("params") if hasattr(variables, "get") else None
    if params is None or jax.tree.structure(params) != self._treedef:
      return self._foreign(variables, args, kwargs)
    ctx = context.current()
    if ctx is not None:
      ctx.apply_calls += 1
    run = lambda p, per_use: self._run(variables, p, per_use, args, kwargs)
    if self.formulation is None:
      # Shapes only: host-resident parameters may not meet the model unfetched, even in a trace.
      shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), params)
      self.formulation = choose(plan, jax.make_jaxpr(lambda p: run(p, False))(shapes))
    per_use, has_scan = self.formulation
    if plan.config.quantized:  # ZeRO++: per device, zerojax's own (quantised) collectives
      def body(boxed, a, kw):
        run_boxed = lambda b: self.apply_fn({**variables, "params": b}, *a, **kw)
        return _layers(run_boxed, boxed, plan, True, has_scan)
      return shard_map_apply(body, plan, params, args, kwargs)
    return _layers(lambda p: run(p, per_use), params, plan, per_use, has_scan)

  def _run(self, variables, params, per_use, args, kwargs):
    # Parameters reach the model in the compute dtype: cast where each is gathered (per use),
    # else on its shard before the partitioner's gather, so gathers move that dtype. Per use
    # with sharded parameters the cast is on the stacked shards too (1/N of the values), so a
    # scanned layer's gradient is reduce-scattered straight into a compute-dtype stack.
    plan, cd = self.plan, self._dtype
    boxed = dict(variables)
    if not per_use:
      boxed["params"] = to_compute(params, cd)
    else:
      early = plan.params_sharded and not plan.params_on_host
      boxed["params"] = box_params(to_compute(params, cd) if early else params, plan)
    return self.apply_fn(boxed, *args, **kwargs)

  def _foreign(self, variables, args, kwargs):
    """Variables that are not linen's ``{"params": <the plan's tree>}``: a pure function of
    its own. Only a per-use setting needs the boxes; otherwise XLA's partitioner does the
    gathers anyway."""
    plan = self.plan
    if plan.config.quantized:
      raise ConfigError(
          f"{per_use_reason(plan)} runs a linen model called as state.apply_fn({{'params': "
          "params}, ...) per device; apply_fn was called with variables whose 'params' do "
          "not match the plan's tree (a plain pytree model cannot use it)")
    if plan.gathers_per_use and not self._warned:
      self._warned = True
      warnings.warn("zerojax: apply_fn was called with variables whose 'params' do not match "
                    "the plan's tree; parameters are not gathered per layer for this call")
    return self.apply_fn(variables, *args, **kwargs)


def _per_use_by_default(plan: ShardingPlan, has_scan: bool, remats: bool) -> bool:
  """Whether ``gather='auto'`` gathers per use for this model and target (see `choose`)."""
  if plan.config.gather != "auto" or not plan.params_sharded:
    return False
  if not any(lp.is_sharded for lp in plan.leaves):
    return False
  if plan.platform != "cpu":
    return True
  # XLA:CPU's partitioner keeps every layer's gathered weights of an unscanned model for the
  # backward pass when a kernel is sharded on the dimension its layer contracts; per use bounds
  # that to one layer whatever the shapes.
  return plan.config.remat == "auto" and not has_scan and not remats


def _layers(run: Callable, params: Any, plan: ShardingPlan, per_use: bool,
            has_scan: bool) -> Any:
  """``run(params)`` under the formulation's remat (see `ModelApply`)."""
  policy = remat_policy(plan.config, per_use)
  if has_scan or policy is None:
    # Scanned layers get their policy inside each layer (the step's scan hook); a
    # whole-model checkpoint on top would save their residuals again, so it is only for
    # models without scans.
    return run(params)
  # Stage 3, per use, no scans: nothing orders the layers' gathers but data dependencies, so
  # each layer gathers after its input and re-gathers after its output's cotangent.
  layers = (nn.intercept_methods(regather_layers) if per_use and plan.params_sharded
            else contextlib.nullcontext())
  with layers:
    return jax.checkpoint(run, policy=policy)(params)


GPU_COMPILER_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True,
                        "xla_gpu_enable_pipelined_all_gather": True,
                        "xla_gpu_enable_pipelined_reduce_scatter": True,
                        "xla_gpu_enable_while_loop_double_buffering": True}


def compiler_options(plan: ShardingPlan) -> dict[str, Any] | None:
  """XLA options the stage needs on this backend.

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
  flags MaxText ships for GPUs). They are per-compile options, so
  they need no process-wide ``XLA_FLAGS``.
  """
  platform = plan.platform
  if plan.config.shards_opt_state and platform == "cpu":
    return {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
  if platform == "gpu":
    return dict(GPU_COMPILER_OPTIONS)
  return None


def per_use_reason(plan: ShardingPlan) -> str:
  """The setting that makes ``plan`` gather per use, as an error message names it."""
  cfg = plan.config
  if cfg.quantize_weights is not None:
    return f"quantize_weights={cfg.quantize_weights!r}"
  if cfg.quantize_gradients is not None:
    return f"quantize_gradients={cfg.quantize_gradients!r}"
  if cfg.gather == "explicit":
    return "gather='explicit'"
  if cfg.reduce_dtype is not None:
    return f"reduce_dtype={cfg.reduce_dtype!r}"
  return "offload_params=True"
