"""The train-step decorator and sharded state creation.

``@zero_step(plan)`` turns a plain ``train_step(state, batch) -> (state, metrics)`` into a jitted
step whose input/output shardings come from the plan, whose state buffers are donated, and whose
batch is split over every data-parallel axis. Inside, ``state.apply_fn`` is wrapped so every
parameter is gathered just in time and its gradient leaves the backward pass in the stage's
layout (see `zerojax.core.gather`). The user's code is unchanged.

For Flax NNX the same decorator takes ``train_step(model, optimizer, batch) -> metrics`` that
updates ``model``/``optimizer`` in place, as under ``nnx.jit``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.core import meta
from flax.training import train_state as ts

from zerojax.core import context, offload
from zerojax.core import budget
from zerojax.core.config import ConfigError, ZeroConfig
from zerojax._compat import REMAT_PRIMITIVE_NAMES, jaxpr_has_primitive
from zerojax.core.gather import (box_params, compute_dtype_of, per_layer_reads,
                                 regather_layers, remat_policy, scan_remat, scanned_layers,
                                 to_compute)
from zerojax.core.mesh import make_mesh
from zerojax.core.plan import ShardingPlan
from zerojax.core.grad import check_batch
from zerojax.core.zeropp import shard_map_apply
from zerojax.core.train_state import StepSettings, ZeroTrainState, nnx_loss_scaling, skip_nonfinite

__all__ = ["wrap_apply_fn", "compiler_options", "GPU_COMPILER_OPTIONS", "ZeroStep", "zero_step",
           "create_train_state", "state_initializer", "create_nnx", "abstract_nnx",
           "existing_params"]

PyTree = Any


def wrap_apply_fn(apply_fn: Callable, plan: ShardingPlan, seen: dict | None = None) -> Callable:
  """``apply_fn`` as the step's formulation needs it (see `ZeroConfig.gather`).

  The model is traced once to see how it was written, and the formulation is decided then,
  before anything compiles (`_per_use_by_default`). On XLA:CPU, scanned layers, or layers the
  user rematerialises, run as written: the loop (or the remat) already bounds what each layer
  keeps, and XLA's partitioner places the gathers as in hand-written FSDP (the step's scan
  hook rematerialises scanned layers the user did not). An unscanned model with no remat at
  stage 3 would keep every layer's gathered weights for the backward pass, and on TPU and GPU
  the partitioner would move activations instead of weights; there, as with
  ``gather='explicit'`` or a per-use feature (`ShardingPlan.gathers_per_use`), every parameter
  is boxed: each layer gathers its weights, in the compute dtype, where it reads them and
  re-gathers them in the backward pass. ``seen['per_use']`` records the decision.
  """
  cfg = plan.config
  treedef = jax.tree.structure(plan.params)
  warned = []
  pure = per_layer_reads(apply_fn, plan)
  decided: list[tuple[bool, bool]] = []  # (per use, has scan), from the first trace
  cd = compute_dtype_of(cfg)

  @functools.wraps(apply_fn)
  def apply(variables, *args, **kwargs):
    args = to_compute(args, cd)  # the batch's floating inputs enter in the compute dtype
    if not plan.gathers_per_use and jax.tree.structure(variables) == treedef:
      # A pure function of the plan's parameters (a plain pytree model).
      return pure(to_compute(variables, cd), *args, **kwargs)
    params = variables.get("params") if hasattr(variables, "get") else None
    if params is None or jax.tree.structure(params) != treedef:
      # Not linen's {"params": ...}: a pure function of its own (a plain pytree model). Only a
      # per-use setting needs the boxes; otherwise XLA's partitioner does the gathers anyway.
      if cfg.quantized:
        raise ConfigError(
            f"{_per_use_reason(plan)} runs a linen model called as state.apply_fn({{'params': "
            "params}, ...) per device; apply_fn was called with variables whose 'params' do "
            "not match the plan's tree (a plain pytree model cannot use it)")
      if plan.gathers_per_use and not warned:
        warned.append(True)
        warnings.warn("zerojax: apply_fn was called with variables whose 'params' do not match "
                      "the plan's tree; parameters are not gathered per layer for this call")
      return apply_fn(variables, *args, **kwargs)
    ctx = context.current()
    if ctx is not None:
      ctx.apply_calls += 1

    def run(params, per_use):
      # Parameters reach the model in the compute dtype: cast where each is gathered (per
      # use), else on its shard before the partitioner's gather, so gathers move that dtype.
      # Per use at stage 3 the cast is on the stacked shards too (Ψ/N values), so a scanned
      # layer's gradient is reduce-scattered straight into a compute-dtype stack, no convert.
      boxed = dict(variables)
      if not per_use:
        boxed["params"] = to_compute(params, cd)
      else:
        early = cfg.stage == 3 and not plan.params_on_host
        boxed["params"] = box_params(to_compute(params, cd) if early else params, plan)
      return apply_fn(boxed, *args, **kwargs)

    if not decided:
      # Shapes only: host-resident parameters may not meet the model unfetched, even in a trace.
      shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), params)
      jaxpr = jax.make_jaxpr(lambda p: run(p, False))(shapes)
      has_scan = jaxpr_has_primitive(jaxpr, frozenset({"scan"}))
      remats = jaxpr_has_primitive(jaxpr, REMAT_PRIMITIVE_NAMES)
      per_use = plan.gathers_per_use or _per_use_by_default(plan, has_scan, remats)
      if seen is not None:
        seen["per_use"] = per_use
      decided.append((per_use, has_scan))
    per_use, has_scan = decided[0]
    if cfg.quantized:  # ZeRO++: per device, zerojax's own (quantised) collectives
      def body(boxed, a, kw):
        def run_boxed(b):
          return apply_fn({**variables, "params": b}, *a, **kw)
        return _layers(run_boxed, boxed, cfg, True, has_scan)
      return shard_map_apply(body, plan, params, args, kwargs)
    return _layers(lambda p: run(p, per_use), params, cfg, per_use, has_scan)

  return apply


def _per_use_by_default(plan: ShardingPlan, has_scan: bool, remats: bool) -> bool:
  """Whether ``gather='auto'`` gathers each parameter where a layer reads it, decided before
  compiling from the plan, the model's structure and the target.

  On accelerators, stage 3 always does: XLA:TPU and XLA:GPU's partitioner, left to place the
  gathers, keeps square kernels sharded and all-gathers the layer's activations instead
  (1.6-1.8x the collective bytes of hand-written FSDP, BENCHMARKS.md), while per-use gathering
  moves each weight, in the compute dtype, at the textbook 3 psi. On XLA:CPU the partitioner's
  formulation matches hand-written FSDP except for unscanned models without remat, which
  would keep every layer's gathered weights for the backward pass.
  """
  cfg = plan.config
  if cfg.gather != "auto" or cfg.stage != 3 or not any(lp.is_sharded for lp in plan.leaves):
    return False
  if next(iter(plan.mesh.devices.flat)).platform != "cpu":
    return True
  # XLA:CPU's partitioner keeps every layer's gathered weights of an unscanned model for the
  # backward pass when a kernel is sharded on the dimension its layer contracts; per use bounds
  # that to one layer whatever the shapes.
  return cfg.remat == "auto" and not has_scan and not remats


def _layers(run: Callable, params: Any, cfg: ZeroConfig, per_use: bool, has_scan: bool) -> Any:
  """``run(params)`` under the formulation's remat (see `wrap_apply_fn`)."""
  policy = remat_policy(cfg, per_use)
  if has_scan or policy is None:
    # Scanned layers get their policy inside each layer (the step's scan hook); a
    # whole-model checkpoint on top would override it (measured: its residuals are saved
    # again), so it is only for models without scans.
    return run(params)
  # Stage 3, per use, no scans: nothing orders the layers' gathers but data dependencies, so
  # each layer gathers after its input and re-gathers after its output's cotangent.
  layers = (nn.intercept_methods(regather_layers) if per_use and cfg.stage == 3
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
  (full size: XLA:CPU lowers reduce-scatter as all-reduce) coexists with the local gradient,
  which measured 2G of temporaries instead of G.

  On XLA:GPU the latency-hiding scheduler with pipelined all-gathers and reduce-scatters and
  double-buffered loops issues the next layer's gather while the current one computes (the
  flags MaxText ships for GPUs; measured in BENCHMARKS.md). They are per-compile options, so
  they need no process-wide ``XLA_FLAGS``.
  """
  platform = next(iter(plan.mesh.devices.flat)).platform
  if plan.config.stage >= 1 and platform == "cpu":
    return {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
  if platform == "gpu":
    return dict(GPU_COMPILER_OPTIONS)
  return None


class ZeroStep:
  """A jitted ZeRO train step; create it with `zero_step`."""

  def __init__(self, fn: Callable, plan: ShardingPlan, donate: bool = True):
    functools.update_wrapper(self, fn)
    self.fn, self.plan, self.donate = fn, plan, donate
    self._jitted: dict[Any, Any] = {}
    # How each compiled variant gathers parameters: "compiler" (XLA's partitioner) or
    # "per use" (zerojax's gather boxes); see `wrap_apply_fn`.
    self.formulation: dict[Any, str] = {}
    self._last_dispatch: float | None = None
    self.last_step_time = math.nan  # see __call__

  # -- linen / TrainState (or any flax.struct state with params/opt_state) ---------------------

  def _linen(self, state, batch, rest):
    plan = self.plan
    key = ("state", jax.tree.structure(state), _shapes_key(batch), _shapes_key(rest))
    if key not in self._jitted:
      orig = state.apply_fn
      _check_state_features(plan, state)
      check_batch(plan, batch)
      _check_processes_agree(plan, getattr(state, "tx", None), state)
      orig_tx = getattr(state, "tx", None)

      def make(seen):
        def step(state, batch, *rest):
          changes = {"apply_fn": wrap_apply_fn(orig, plan, seen)}
          if orig_tx is not None:
            changes["tx"] = offload.wrap_tx(orig_tx, plan)
          state = state.replace(**changes)
          with _step_context(plan, state) as ctx, scanned_layers(
              scan_remat(plan.config, plan.gathers_per_use)):
            new_state, metrics = self.fn(state, batch, *rest)
          _check_features_used(ctx)
          if not isinstance(new_state, type(state)):
            raise TypeError(f"train_step must return (state, metrics); got {type(new_state)}")
          if isinstance(new_state, ZeroTrainState) and isinstance(metrics, dict):
            metrics = {**new_state.step_metrics(), **metrics}
          restore = {"apply_fn": orig} if orig_tx is None else {"apply_fn": orig, "tx": orig_tx}
          return new_state.replace(**restore), metrics

        state_sh = plan.state(state)
        return jax.jit(
            step, in_shardings=(state_sh, plan.batch(batch), *_replicated(plan, rest)),
            out_shardings=(state_sh, plan.replicated),
            donate_argnums=(0,) if self.donate else (),
            compiler_options=compiler_options(plan))

      seen: dict = {}
      jitted = make(seen)
      lowered = jitted.lower(state, batch, *rest)  # one trace (cached for the first call)
      if compute_dtype_of(plan.config) is not None:
        _check_compute_dtype(plan.config, lowered)
      self.formulation[key] = "per use" if seen.get("per_use", plan.gathers_per_use) \
          else "compiler"
      self._jitted[key] = jitted
    return self._jitted[key]

  # -- NNX ------------------------------------------------------------------------------------

  def _nnx(self, model, optimizer, batch, rest):
    from flax import nnx
    graphdef, state = nnx.split((model, optimizer))
    key = ("nnx", graphdef, _shapes_key(batch), _shapes_key(rest))
    if key not in self._jitted:
      plan = self.plan
      state_sh = plan.nnx_state(state)
      scaling = plan.config.loss_scale is not None
      if scaling and not hasattr(optimizer, "loss_scaling"):
        raise ConfigError(
            f"loss_scale={plan.config.loss_scale!r}: an NNX optimizer keeps the fp16 loss "
            "scale in optimizer.loss_scaling, which zerojax.create_nnx adds; build the "
            "(model, optimizer) pair with zerojax.create_nnx(..., config=config)")
      check_batch(plan, batch)
      _check_processes_agree(plan, getattr(optimizer, "tx", None), None)
      cfg = plan.config
      if cfg.gather == "explicit" or cfg.reduce_dtype is not None or cfg.quantized:
        raise ConfigError(
            f"{_per_use_reason(plan)} needs per-use gathering, which zerojax does through a "
            "linen model's state.apply_fn; an NNX step cannot honour it. Use a linen model, or "
            "drop the setting")
      # Host-resident NNX parameters come to the device (as the plan shards them) when the
      # step starts and go back when it ends; a linen model fetches each layer's just in time.
      params_host = plan.params_on_host

      cd = compute_dtype_of(cfg)

      def step(state, batch, *rest):
        m, o = nnx.merge(graphdef, state)
        _nnx_compute_dtype(m, cd)
        if params_host:
          nnx.update(m, offload.put_like(nnx.state(m, nnx.Param), offload.on_device(plan.params)))
        finite: list = []
        tx = skip_nonfinite(o.tx, finite) if scaling else o.tx
        o.tx = offload.wrap_tx(tx, plan, clip=cfg.gradient_clipping, params_fetched=params_host)
        scale = o.loss_scaling.scale[...] if scaling else None
        with _step_context(plan, None, scale) as ctx, scanned_layers(scan_remat(cfg, False)):
          metrics = self.fn(m, o, batch, *rest)
        _check_features_used(ctx)
        if scaling:
          if len(finite) != 1:
            raise ConfigError(
                f"loss_scale={cfg.loss_scale!r}: the NNX step must call optimizer.update(model, "
                f"grads) exactly once (it called it {len(finite)} times), so that an "
                "overflowing step can be skipped")
          o.loss_scaling.update(finite[0], StepSettings.from_config(cfg))
          if isinstance(metrics, dict):
            metrics = {**o.loss_scaling.metrics(), **metrics}
        return nnx.state((m, o)), metrics

      jitted = jax.jit(
          step, in_shardings=(state_sh, plan.batch(batch), *_replicated(plan, rest)),
          out_shardings=(state_sh, plan.replicated),
          donate_argnums=(0,) if self.donate else (),
          compiler_options=compiler_options(plan))
      if cd is not None:
        _check_compute_dtype(cfg, jitted.lower(state, batch, *rest))
      self.formulation[key] = "compiler"  # an NNX step is never boxed (see above)
      self._jitted[key] = jitted
    return self._jitted[key], state

  def _dispatch(self, args):
    """``(kind, leading, batch, rest)`` by the type of the first argument: an ``nnx.Module``
    starts ``(model, optimizer, batch, *rest)``; anything else ``(state, batch, *rest)``."""
    if args and _is_nnx(args[0]):
      if len(args) < 3:
        raise TypeError("an NNX zerojax step is called as step(model, optimizer, batch, ...); "
                        f"got {len(args)} arguments")
      return "nnx", args[:2], args[2], tuple(args[3:])
    if len(args) < 2:
      raise TypeError("a zerojax step is called as step(state, batch, ...) (or, for Flax NNX, "
                      f"step(model, optimizer, batch, ...)); got {len(args)} argument(s)")
    return "state", args[:1], args[1], tuple(args[2:])

  def __call__(self, *args):
    """Runs one step. Metrics gain host-side ``step_time`` and ``tokens_per_sec``.

    Both come from dispatch times, not from device timers, so the hot path never waits for the
    device: ``step_time`` is the wall time between the returns of the previous and of this
    call. JAX dispatch is asynchronous, so this interval measures the device's step time once
    the loop is device-bound (the steady state of any training loop that reads a metric or
    feeds data); it is ``nan`` for the first call and for any call that compiled.
    ``tokens_per_sec`` is the batch's tokens (rows × sequence length of the first batch leaf
    with two or more dimensions, rows otherwise) divided by ``step_time``.

    Arguments after the batch (an RNG key, a step number) are passed through replicated.
    """
    n = len(self._jitted)
    kind, lead, batch, rest = self._dispatch(args)
    if kind == "nnx":
      from flax import nnx
      f, state = self._nnx(*lead, batch, rest)
      if len(self._jitted) != n:  # first call with these shapes: check memory before it allocates
        _check_step_memory(self.plan, f, state, batch, *rest)
      new_state, metrics = f(state, batch, *rest)
      nnx.update(tuple(lead), new_state)
      return self._host_metrics(metrics, batch, compiled=len(self._jitted) != n)
    (state,) = lead
    f = self._linen(state, batch, rest)
    if len(self._jitted) != n:  # first call with these shapes: check memory before it allocates
      _check_step_memory(self.plan, f, state, batch, *rest, params=state.params,
                         tx=getattr(state, "tx", None), opt_state=getattr(state, "opt_state", None))
    new_state, metrics = f(state, batch, *rest)
    return new_state, self._host_metrics(metrics, batch, compiled=len(self._jitted) != n)

  def _host_metrics(self, metrics, batch, compiled):
    now = time.perf_counter()
    last, self._last_dispatch = self._last_dispatch, now
    dt = math.nan if (compiled or last is None) else now - last
    self.last_step_time = dt
    if not isinstance(metrics, dict):
      return metrics
    metrics = dict(metrics)
    metrics.setdefault("step_time", dt)
    metrics.setdefault("tokens_per_sec", _tokens(batch) / dt if dt == dt and dt > 0 else math.nan)
    return metrics

  def jitted(self, *args) -> Any:
    """The ``jax.jit`` function this step runs for ``args`` (e.g. for ``jax.export`` or
    ``.trace``): called as ``f(state, batch, *rest)``, for NNX as ``f(nnx.state((model,
    optimizer)), batch, *rest)``."""
    kind, lead, batch, rest = self._dispatch(args)
    if kind == "nnx":
      return self._nnx(*lead, batch, rest)[0]
    return self._linen(lead[0], batch, rest)

  def lower(self, *args):
    """Lowers the step for ``args`` (arrays or ShapeDtypeStructs), e.g. to inspect memory."""
    kind, lead, batch, rest = self._dispatch(args)
    if kind == "nnx":
      f, state = self._nnx(*lead, batch, rest)
      return f.lower(state, batch, *rest)
    return self._linen(lead[0], batch, rest).lower(lead[0], batch, *rest)


def zero_step(plan: ShardingPlan, *, donate: bool = True) -> Callable[[Callable], ZeroStep]:
  """Decorates a plain train step with the ZeRO stage of ``plan``.

  Example::

    @zerojax.zero_step(plan)
    def train_step(state, batch):
      def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}

  Args:
    plan: the `ShardingPlan`; its shardings become the step's in/out shardings.
    donate: donate the state's buffers to the step (it is updated in place).
  """
  if not isinstance(plan, ShardingPlan):
    raise TypeError(f"zero_step(plan) needs a zerojax.ShardingPlan, got {type(plan).__name__}")
  plan.accumulation_steps  # inconsistent batch sizes fail here
  return lambda fn: ZeroStep(fn, plan, donate)


# -- what the traced step knows (issue 7: accumulation, loss scaling, metrics) ------------------


def _step_context(plan: ShardingPlan, state: Any, scale: Any = None):
  """The `zerojax.core.context` of one trace: plan, accumulation steps, the input's loss scale
  (from a `ZeroTrainState`, or ``scale`` for an NNX step)."""
  if isinstance(state, ZeroTrainState) and state.settings.scaling:
    scale = state.loss_scale
  return context.active(context.StepContext(
      plan, plan.accumulation_steps, scale,
      linen=state is not None))


def _check_processes_agree(plan: ShardingPlan, tx: Any, state: Any) -> None:
  """Multi-process runs: every process must have the same config, plan and optimizer before
  the first compile (a mismatch would hang in a collective or diverge silently)."""
  if jax.process_count() > 1:
    from zerojax.core import distributed
    distributed.check_agreement(plan.config, plan, tx=tx,
                                state=state if hasattr(state, "opt_state") else None)


def _check_state_features(plan: ShardingPlan, state: Any) -> None:
  """Clipping and loss scaling live in `ZeroTrainState`; refuse a state that would ignore them."""
  cfg = plan.config
  wanted = [f"{k}={getattr(cfg, k)!r}" for k in ("gradient_clipping", "loss_scale")
            if getattr(cfg, k) is not None]
  if wanted and not isinstance(state, ZeroTrainState):
    kind = "an NNX step" if state is None else f"a {type(state).__name__}"
    raise ConfigError(f"{', '.join(wanted)} needs a zerojax.ZeroTrainState (create it with "
                      f"zerojax.create_train_state); {kind} would silently ignore it")


def _nnx_compute_dtype(model: Any, dtype: Any) -> None:
  """Sets ``dtype`` on every NNX layer of ``model`` that leaves it unset (``None``: promote
  the operands), so the layer casts its parameters and input to the compute dtype where it
  reads them. ``model`` is the step's own merged copy, so the user's module is unchanged."""
  if dtype is None:
    return
  from flax import nnx
  for _, mod in nnx.iter_modules(model):
    if "dtype" in vars(mod) and mod.dtype is None:
      mod.dtype = dtype


_DOT = re.compile(r"(?:stablehlo|mhlo)\.dot(?:_general)?\b.*?:\s*\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)")


def _check_compute_dtype(cfg: ZeroConfig, lowered: Any) -> None:
  """``compute_dtype`` must reach the model's matrix multiplications: counted in the lowered
  step (forward and backward). None of them in it is an error (the setting did nothing); some
  in float32 (a model that upcasts, or reads its parameters past zerojax) is a warning."""
  dots = [(a.rsplit("x", 1)[-1], b.rsplit("x", 1)[-1]) for a, b in _DOT.findall(lowered.as_text())]
  if not dots:
    return
  wide = sum(1 for a, b in dots if a in ("f32", "f64") and b in ("f32", "f64"))
  what = (f"compute_dtype={cfg.compute_dtype!r}: {wide} of the step's {len(dots)} matrix "
          "multiplications (forward and backward) still take float32 operands")
  if wide == len(dots):
    raise ConfigError(
        f"{what}, so the setting does nothing to this model. zerojax casts parameters where "
        "the model reads them (linen state.apply_fn, plain pytree models) and sets dtype on "
        "NNX layers that leave it None; a model that reads parameters another way must set "
        "its own dtype. Or drop compute_dtype")
  if wide:
    warnings.warn(f"zerojax: {what} (a model that upcasts on its own, or reads parameters past "
                  "zerojax, keeps them)", stacklevel=3)


def _is_nnx(x: Any) -> bool:
  try:
    from flax import nnx
  except ImportError:  # pragma: no cover
    return False
  return isinstance(x, nnx.Module)


def _replicated(plan: ShardingPlan, tree: Any) -> Any:
  return jax.tree.map(lambda _: plan.replicated, tree)


def _per_use_reason(plan: ShardingPlan) -> str:
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


def _check_features_used(ctx: context.StepContext) -> None:
  plan = ctx.plan
  if plan.gathers_per_use and ctx.apply_calls == 0 and ctx.linen:
    # The model never ran through state.apply_fn, so nothing gathered per use: host-resident
    # parameters would reach XLA in host memory, a reduce_dtype would silently not apply.
    raise ConfigError(
        f"{_per_use_reason(plan)} acts where the model reads its parameters, which zerojax "
        "sees only when the model is called through state.apply_fn({'params': params}, ...) "
        "inside the step; this step never called it. Call the model as "
        "state.apply_fn(...), or drop the setting")
  if ctx.grad_calls:
    return
  cfg = ctx.plan.config
  if ctx.accumulation_steps > 1 or ctx.loss_scale is not None:
    raise ConfigError(
        f"gradient_accumulation_steps={ctx.accumulation_steps}, loss_scale={cfg.loss_scale!r}: "
        "the train step must compute its gradient with zerojax.value_and_grad(loss_fn)"
        "(params, batch) (a drop-in for jax.value_and_grad; linen TrainState steps), else "
        "the accumulation/loss scaling would silently not happen")


def _tokens(batch: Any) -> int:
  shapes = [np.shape(x) for x in jax.tree.leaves(batch) if np.ndim(x) >= 1]
  for s in shapes:
    if len(s) >= 2:
      return s[0] * s[1]
  return shapes[0][0] if shapes else 0


# -- memory check before the first step (issue 15 item 7) ---------------------------------------


def _check_step_memory(plan: ShardingPlan, jitted: Any, *args: Any, **suggest: Any) -> None:
  """Compiles the step ahead of its first call and compares its peak per device with the
  devices' memory limit (`zerojax.core.budget.check_fits`), so a step that cannot fit fails with
  the numbers and a suggestion instead of ``RESOURCE_EXHAUSTED``. Backends that report no
  limit (CPU) skip it: nothing is compiled twice there."""
  devices = list(plan.mesh.devices.flat)
  if budget.bytes_limit(devices) is None:
    return
  compiled = jitted.lower(*args).compile()  # the call after it reuses JAX's compilation cache
  budget.check_fits(compiled, devices, config=plan.config, **suggest)


# -- state creation -----------------------------------------------------------------------------


def create_train_state(model: Any, tx: Any, rng: jax.Array, *init_args: Any,
                       config: ZeroConfig, mesh: jax.sharding.Mesh | None = None,
                       state_cls: type | None = None, params: Any = None, **init_kwargs: Any
                       ) -> tuple[ts.TrainState, ShardingPlan]:
  """Initialises a linen model's train state directly in its sharded layout.

  The init function is jitted with the plan's output shardings, so each device only ever
  computes and holds its own shards: the full parameters never exist on one device (the
  equivalent of ``deepspeed.zero.Init``).

  ``state_cls`` defaults to `zerojax.ZeroTrainState` (gradient clipping, loss scaling and step
  metrics from ``config``); a `ZeroTrainState` subclass gets ``config=config`` at creation.
  Inconsistent batch sizes in ``config`` fail here, before any device work.

  ``params`` starts from existing parameters instead of the model's init: see
  `existing_params`.

  Returns:
    ``(state, plan)``.
  """
  make_state, plan, abstract = state_initializer(model, tx, rng, *init_args, config=config,
                                                 mesh=mesh, state_cls=state_cls, **init_kwargs)
  # A state too big for the devices fails here, named, not as RESOURCE_EXHAUSTED in the init.
  budget.check_state_fits(plan, params=getattr(abstract, "params", None), tx=tx)
  if params is not None:
    return _state_from_params(make_state, plan, abstract, params, rng, init_args), plan
  state = jax.jit(make_state, out_shardings=plan.state(abstract))(rng, *init_args)
  return state, plan


def state_initializer(model: Any, tx: Any, rng: jax.Array, *init_args: Any,
                      config: ZeroConfig, mesh: jax.sharding.Mesh | None = None,
                      state_cls: type | None = None, **init_kwargs: Any):
  """``(make_state, plan, abstract_state)``: the pieces `create_train_state` and a checkpoint
  restore target (`zerojax.runtime.checkpoint.abstract_train_state`) share. Nothing is allocated."""
  mesh = make_mesh(config) if mesh is None else mesh
  pdtype = jnp.dtype(config.param_dtype)
  state_cls = ZeroTrainState if state_cls is None else state_cls
  extra = {"config": config} if issubclass(state_cls, ZeroTrainState) else {}

  def init_params(rng, *args):
    variables = model.init(rng, *args, **init_kwargs)
    if not jax.tree.leaves((variables or {}).get("params", {})):
      raise ValueError(
          f"create_train_state: {type(model).__name__}.init(...) made no parameters (its "
          f"collections: {sorted(variables or {})}); zerojax shards and trains a model's "
          "'params' collection, and this model has none. Check that its layers are called "
          "(an `nn.compact` method, or submodules used in __call__)")
    return variables["params"]

  boxed = jax.eval_shape(init_params, rng, *init_args)
  # A parameter leaf that is not floating point (an int counter, a bool mask) fails here,
  # named: jax.grad of the step would fail on it later, deep inside the trace.
  bad = []
  for path, x in jax.tree_util.tree_flatten_with_path(
      boxed, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))[0]:
    x = x.unbox() if isinstance(x, meta.AxisMetadata) else x
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      bad.append(f"{jax.tree_util.keystr(path)} ({x.dtype}{list(x.shape)})")
  if bad:
    raise TypeError(
        f"create_train_state: parameter leaves {', '.join(bad[:8])}"
        f"{f' and {len(bad) - 8} more' if len(bad) > 8 else ''} are not floating point; a "
        "train step differentiates every leaf of 'params' and jax.grad takes only float (or "
        "complex) leaves. Keep integer or boolean state in another collection (e.g. "
        "self.variable('state', ...)) or a constant, or make the leaf float")
  plan = ShardingPlan.create(config, mesh, _cast_shapes(boxed, pdtype), tx)
  plan.accumulation_steps  # inconsistent batch sizes fail here

  def make_state(rng, *args):
    params = _cast(meta.unbox(init_params(rng, *args)), pdtype)
    return state_cls.create(apply_fn=model.apply, params=params, tx=tx, **extra)

  return make_state, plan, jax.eval_shape(make_state, rng, *init_args)


def abstract_nnx(model_fn: Callable[[], Any], tx: Any, *, config: ZeroConfig,
                 mesh: jax.sharding.Mesh | None = None, wrt: Any = None):
  """`create_nnx` without allocating: ``(model, optimizer, plan)`` whose variables are
  ``jax.ShapeDtypeStruct`` in the plan's sharded layout, for ``zero_step(plan)(...).lower`` on
  devices that can only be compiled for (a TPU or GPU topology)."""
  from flax import nnx
  mesh = make_mesh(config) if mesh is None else mesh
  graphdef, abs_state, shardings, plan = _nnx_layout(model_fn, tx, config, mesh, wrt)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       abs_state, shardings)
  model, optimizer = nnx.merge(graphdef, state)
  return model, optimizer, plan


def _nnx_layout(model_fn, tx, config, mesh, wrt):
  """``(graphdef, abstract state, shardings, plan)`` of an NNX model and its optimizer."""
  from flax import nnx
  wrt = nnx.Param if wrt is None else wrt

  def build():
    model = model_fn()
    return model, nnx.Optimizer(model, tx, wrt=wrt)

  with jax.set_mesh(mesh):  # lets nnx.with_partitioning metadata resolve its mesh
    abs_model, abs_opt = nnx.eval_shape(build)
  planned, trainable = _nnx_planned(nnx, abs_model, wrt)
  plan = ShardingPlan.create(config, mesh, planned, opt_state=_nnx_values(abs_opt.opt_state),
                             trainable=trainable)
  graphdef, abs_state = nnx.split((abs_model, abs_opt))
  return graphdef, abs_state, plan.nnx_state(abs_state), plan


def create_nnx(model_fn: Callable[[], Any], tx: Any, *, config: ZeroConfig,
               mesh: jax.sharding.Mesh | None = None, wrt: Any = None, params: Any = None):
  """Builds an NNX ``(model, optimizer)`` directly in its sharded layout.

  Args:
    model_fn: a no-argument function returning the ``nnx.Module`` (it is traced, not run
      eagerly, so the full parameters never materialise on one device).
    tx: the optax transformation.
    wrt: the NNX filter of the trained parameters (``nnx.Param`` by default; e.g.
      ``nnx.LoRAParam`` trains adapters only). The other ``nnx.Param`` leaves are frozen: they
      are planned and sharded like the rest, but get no optimizer state (and no gradient when
      the step differentiates with the same filter); ``plan.table()`` marks them.
    params: existing parameters instead of the model's init: see `existing_params`.

  Returns:
    ``(model, optimizer, plan)``.
  """
  from flax import nnx
  mesh = make_mesh(config) if mesh is None else mesh
  wrt = nnx.Param if wrt is None else wrt

  def build():
    model = model_fn()
    return model, nnx.Optimizer(model, tx, wrt=wrt)

  graphdef, _, shardings, plan = _nnx_layout(model_fn, tx, config, mesh, wrt)
  if params is not None:
    with jax.set_mesh(mesh):
      model, optimizer = nnx.merge(graphdef, _nnx_from_params(
          nnx, model_fn, tx, wrt, plan, shardings, params))
    return model, _with_loss_scaling(optimizer, config), plan

  @functools.partial(jax.jit, out_shardings=shardings)
  def init():
    return nnx.state(build())

  with jax.set_mesh(mesh):
    model, optimizer = nnx.merge(graphdef, init())
  return model, _with_loss_scaling(optimizer, config), plan


def _with_loss_scaling(optimizer: Any, config: ZeroConfig) -> Any:
  if config.loss_scale is not None:
    optimizer.loss_scaling = nnx_loss_scaling(config)
  return optimizer


def _nnx_values(tree):
  from flax import nnx
  return jax.tree.map(lambda x: x.get_value() if isinstance(x, nnx.Variable) else x, tree,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def _cast(tree, dtype):
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _cast_shapes(tree, dtype):
  def one(x):
    if isinstance(x, meta.AxisMetadata):
      return x.replace_boxed(one(x.unbox()))
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jax.ShapeDtypeStruct(x.shape, dtype)
    return x
  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))


def _shapes_key(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)


# -- existing parameters (issue 13) -------------------------------------------------------------


def existing_params(params: Any, plan: ShardingPlan) -> tuple[list[jax.Array], tuple[bool, ...]]:
  """``params=`` of `create_train_state` / `create_nnx`, placed into ``plan.params``' layout.

  ``params`` is a pytree of numpy or jax arrays shaped like the model's parameters, or a lazy
  source with ``load(plan)`` (e.g. `zerojax.runtime.weights.safetensors_source`); each leaf goes
  straight into its shards (`zerojax.core.placement.place`). ``jax.ShapeDtypeStruct`` leaves mark
  parameters to take from the model's init (e.g. new LoRA adapters). The optimizer state is
  initialised from the given parameters, in its sharded layout, inside one jitted function
  whose random init of the given leaves is dead code that XLA removes (the model is only
  traced: ``eval_shape`` gives the structure). Given jax arrays are donated to the new state.

  Returns:
    ``(arrays, given)``: the placed arrays, and per plan leaf whether it was given.
  """
  from zerojax.core.placement import place
  leaves = jax.tree.leaves(place(params, plan))
  given = tuple(not isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  return [x for x, g in zip(leaves, given) if g], given


def _merge_given(init_leaves: list, arrays: list, given: tuple[bool, ...]) -> list:
  if len(init_leaves) != len(given):
    raise ValueError(f"the model has {len(init_leaves)} parameter leaves, the plan "
                     f"{len(given)}: was the plan made for this model?")
  it = iter(arrays)
  return [next(it) if g else x for x, g in zip(init_leaves, given)]


def _state_from_params(make_state, plan, abstract, params, rng, init_args):
  arrays, given = existing_params(params, plan)

  def make(arrays, rng, *args):
    state = make_state(rng, *args)
    leaves, treedef = jax.tree.flatten(state.params)
    new = jax.tree.unflatten(treedef, _merge_given(leaves, arrays, given))
    return state.replace(params=new, opt_state=state.tx.init(new))

  return jax.jit(make, out_shardings=plan.state(abstract), donate_argnums=0)(
      arrays, rng, *init_args)


def _nnx_planned(nnx, abs_model, wrt):
  """Every parameter (trained or frozen) is planned; ``trainable`` marks the ``wrt`` ones."""
  from zerojax.core.plan import path_str
  planned = nnx.state(abs_model, nnx.Any(nnx.Param, wrt))
  trained = {path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(
      _nnx_values(nnx.state(abs_model, wrt)))[0]}
  return planned, lambda path: path in trained


def _nnx_from_params(nnx, model_fn, tx, wrt, plan, shardings, params):
  arrays, given = existing_params(params, plan)

  @functools.partial(jax.jit, out_shardings=shardings, donate_argnums=0)
  def init(arrays):
    model = model_fn()
    state = nnx.state(model, nnx.Any(nnx.Param, wrt))
    leaves, treedef = jax.tree.flatten(_nnx_values(state))
    values = jax.tree.unflatten(treedef, _merge_given(leaves, arrays, given))
    nnx.update(model, values)
    return nnx.state((model, nnx.Optimizer(model, tx, wrt=wrt)))

  return init(arrays)
