"""The model as the step runs it: ``state.apply_fn`` under the formulation the plan chose
(`ShardingPlan.formulation`), with parameters and inputs in the compute dtype."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.core import unfreeze

from zerojax.core import context
from zerojax.core.blocks import checkpointed_blocks, recording, repeated_blocks
from zerojax.core.config import ConfigError
from zerojax.core.dtypes import compute_dtype_of, to_compute
from zerojax.core.formulation import Formulation
from zerojax.core.context import setting, tracing
from zerojax.core.gather import ZeroParam, box_params
from zerojax.core.plan import ShardingPlan
from zerojax.core.regather import prefetching, regather_layers
from zerojax.core.remat import block_policy, checkpoint_model
from zerojax.core.rows import per_layer_reads
from zerojax.core.zeropp import shard_map_apply

__all__ = ["ModelApply", "per_use_reason", "linen_applies"]


class ModelApply:
  """``state.apply_fn`` as the step's formulation runs it (see `ZeroConfig.gather`).

  The first call traces the model once, with shapes only, and the plan fixes `formulation`
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
    self._pure = per_layer_reads(apply_fn, plan, functools.partial(setattr, self, "formulation"))
    self._dtype = compute_dtype_of(plan.config)
    self._warned = False

  def __call__(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
    with setting(in_model=True):  # the model's own apply is not routed again
      return self._call(variables, *args, **kwargs)

  def _call(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
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
      # Blocks matter only where remat names a policy for them (`zerojax.core.blocks`).
      with (recording() if block_policy(plan.config) is not None
            else contextlib.nullcontext({})) as calls:
        jaxpr = jax.make_jaxpr(lambda p: run(p, False))(shapes)
      self.formulation = plan.formulation(jaxpr, blocks=repeated_blocks(calls))
    chosen = self.formulation
    if plan.config.quantized:  # ZeRO++: per device, zerojax's own (quantised) collectives
      def body(boxed, a, kw):
        run_boxed = lambda b: self.apply_fn({**variables, "params": b}, *a, **kw)
        return _layers(run_boxed, boxed, plan, chosen)
      return shard_map_apply(body, plan, params, args, kwargs)
    return _layers(lambda p: run(p, chosen.per_use), params, plan, chosen)

  def _run(self, variables, params, per_use, args, kwargs):
    # Parameters reach the model in the compute dtype: cast where each is gathered (per use),
    # else on its shard before the partitioner's gather, so gathers move that dtype. Per use
    # with sharded parameters the cast is on the stacked shards too (1/N of the values), so a
    # scanned layer's gradient is reduce-scattered straight into a compute-dtype stack.
    plan, cd = self.plan, self._dtype
    tables = self.formulation.tables if self.formulation is not None else frozenset()
    boxed = dict(variables)
    if not per_use:
      boxed["params"] = to_compute(params, cd)
      if not plan.params_sharded:  # stage 2: a lookup table's gradient is summed whole
        boxed["params"] = box_params(boxed["params"], plan, tables, only_lookups=True)
    else:
      early = plan.params_sharded and not plan.params_on_host
      boxed["params"] = box_params(to_compute(params, cd) if early else params, plan,
                                   tables)
    tied = nn.intercept_methods(_attend_reads_its_own) if tables else contextlib.nullcontext()
    with tied:
      return self.apply_fn(boxed, *args, **kwargs)

  def _foreign(self, variables, args, kwargs):
    """Variables that are not linen's ``{"params": <the plan's tree>}``: a pure function of
    its own. Only a per-use setting needs the boxes; otherwise XLA's partitioner does the
    gathers anyway."""
    plan = self.plan
    if plan.config.offload_params and jax.tree.structure(variables) == self._treedef:
      # The plan's own host-resident parameters, handed to a pure function as they rest.
      raise ConfigError(
          "offload.params=True fetches each parameter from host memory where a linen model "
          "called as state.apply_fn({'params': params}, ...) uses it; apply_fn was called with "
          "the parameters themselves, which it cannot fetch (a plain pytree model cannot use "
          "it; offload.optimizer=True keeps the optimizer state on the host)")
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


def _layers(run: Callable, params: Any, plan: ShardingPlan, chosen: Formulation) -> Any:
  """``run(params)`` under the formulation's checkpoints (see `ModelApply`)."""
  blocks = (checkpointed_blocks(chosen.blocks, chosen.block_policy) if chosen.blocks
            else contextlib.nullcontext())
  if chosen.checkpoint is None:  # scanned layers get their policy inside each layer
    with blocks:
      return run(params)
  # Stage 3, per use, no scans: nothing orders the layers' gathers but data dependencies, so
  # each layer gathers after its input (on XLA:GPU the previous layer's: `prefetching`) and
  # re-gathers after its output's cotangent.
  layers = (nn.intercept_methods(regather_layers) if chosen.layers
            else contextlib.nullcontext())
  with blocks, layers, prefetching(chosen.layers and plan.backend.prefetches_next_layer,
                                  plan.backend.prefetches_across_checkpoints):
    return checkpoint_model(run, plan, chosen.checkpoint, chosen.layers)(params)


def _attend_reads_its_own(next_fun, args, kwargs, context):
  """``nn.Embed.attend`` (a tied LM head) reads its table through a read of its own, as a head
  reading ``self.variables`` does. Else the one read ``Embed.setup`` made serves the lookup
  and the head, their gradients meet before that read's box sums them whole, and XLA folds
  the head's gradient into the lookup's scatter-add as its operand and all-reduces it."""
  module = context.module
  box = (module.get_variable("params", "embedding")
         if context.method_name == "attend" and isinstance(module, nn.Embed) else None)
  if not isinstance(box, ZeroParam):
    return next_fun(*args, **kwargs)
  kept = module.embedding  # setup's read (setup has run: flax runs it before interceptors)
  object.__setattr__(module, "embedding", box.unbox())
  try:
    return next_fun(*args, **kwargs)
  finally:
    object.__setattr__(module, "embedding", kept)


def per_use_reason(plan: ShardingPlan) -> str:
  """The setting that makes ``plan`` gather per use, as an error message names it
  (``quantize.weights='int8'``, ``gather.mode='explicit'``, ...)."""
  cfg = plan.config
  if cfg.quantize is not None and cfg.quantize.weights is not None:
    return f"quantize.weights={cfg.quantize.weights!r}"
  if cfg.quantize is not None and cfg.quantize.gradients is not None:
    return f"quantize.gradients={cfg.quantize.gradients!r}"
  if cfg.gather.mode == "explicit":
    return "gather.mode='explicit'"
  if cfg.precision.reduce is not None:
    return f"precision.reduce={cfg.precision.reduce!r}"
  return "offload.params=True"


# -- a linen model applied inside the step, not through state.apply_fn ---------------------


@dataclasses.dataclass
class _Applies:
  """The `ModelApply` of each linen model the step applied to the plan's parameters itself."""
  plan: ShardingPlan
  applies: list = dataclasses.field(default_factory=list)

  @property
  def formulation(self) -> Formulation | None:
    chosen = [a.formulation for a in self.applies if a.formulation is not None]
    return chosen[0] if chosen else None


@contextlib.contextmanager
def linen_applies(plan: ShardingPlan) -> Iterator[_Applies]:
  """Inside the block, ``model.apply({"params": params}, ...)`` with the plan's parameter tree
  (a linen model the step calls itself rather than through ``state.apply_fn``) runs as
  `ModelApply` does, so it reaches its parameters as the plan's formulation says (per use on
  TPU and GPU) and in the compute dtype. Other calls run as Flax's own.

  It is seen through Flax's own method interceptor (``nn.intercept_methods``, scoped to this
  block and thread): the model's top-level call is run again through `ModelApply`, with the
  variables, random streams, mutable collections and method the user's ``apply`` gave it.
  ``flax.linen.Module.apply`` itself is never replaced."""
  applies = _Applies(plan)
  with nn.intercept_methods(_route_top_level), setting(linen_applies=applies):
    yield applies


def _route_top_level(next_fun, args, kwargs, context):
  """`linen_applies`' interceptor: a module's top-level call (the one ``Module.apply`` makes)
  with the plan's parameters runs through `ModelApply`; every other call as written."""
  module, t = context.module, tracing()
  scope = module.scope
  applies = t.linen_applies
  if (applies is None or t.in_model or scope is None or scope.parent is not None
      or scope.is_mutable_collection("intermediates")  # capture_intermediates: Flax's own
      or not callable(getattr(type(module), context.method_name, None))):
    return next_fun(*args, **kwargs)
  variables = unfreeze(scope.variables())
  params = variables.get("params")
  if params is None or jax.tree.structure(params) != jax.tree.structure(applies.plan.params):
    return next_fun(*args, **kwargs)
  model = ModelApply(functools.partial(nn.Module.apply, module.clone(parent=None)),
                     applies.plan)
  applies.applies.append(model)
  rngs = {name: rng.as_jax_rng() for name, rng in scope.rngs.items()}
  mutable = scope.mutable
  out = model(variables, *args, rngs=rngs or None, mutable=mutable,
              method=context.method_name, **kwargs)
  if not mutable:
    return out
  out, changed = out
  for collection, tree in changed.items():  # the user's apply returns them from its scope
    for name, value in tree.items():
      scope.put_variable(collection, name, value)
  return out
