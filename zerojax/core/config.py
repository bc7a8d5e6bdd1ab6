"""`ZeroConfig`: the one switch board of zerojax.

Every other module reads this frozen dataclass; nothing else holds settings. It is validated
at construction so a bad value fails before any device work, with a message that names the
field, the value and what is allowed.

DeepSpeed ``ds_config.json`` files map into the same dataclass (see `zerojax.tools.deepspeed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
import re
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import yaml

__all__ = ["STAGES", "MESH_AXES", "DTYPES", "REMAT_POLICIES", "GATHER_MODES", "QUANTIZED_DTYPES",
           "OFFLOAD_FALLBACKS", "NONFINITE_POLICIES", "NVME", "ConfigError", "did_you_mean",
           "unknown_key_error", "BOOL_FIELDS", "ZeroConfig", "in_file", "read_config_file"]

STAGES = (0, 1, 2, 3)
MESH_AXES = ("replica", "fsdp", "tensor")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("auto", "none", "full", "dots", "offload")
GATHER_MODES = ("auto", "explicit")
OFFLOAD_FALLBACKS = ("error", "warn")
NONFINITE_POLICIES = ("auto", "skip", "halt", "ignore")
NVME = "nvme"  # offload_optimizer's one string value: the state in files (ZeRO-Infinity)


class ConfigError(ValueError):
  """A `ZeroConfig` field holds a value zerojax does not allow."""


def _fail(field: str, value: Any, allowed: str) -> None:
  raise ConfigError(f"ZeroConfig.{field}={value!r} is invalid: {allowed}")


def did_you_mean(key: str, allowed: Any) -> str:
  """`` (did you mean 'stage'?)`` for the closest allowed key, or ``''`` if none is close."""
  close = difflib.get_close_matches(str(key), [str(a) for a in allowed], n=1, cutoff=0.6)
  return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key_error(what: str, unknown: Any, allowed: Any, where: str = "",
                      allowed_text: str = "allowed keys are") -> ConfigError:
  """The error for keys outside ``allowed``: names the first (``where`` it is), suggests the
  closest allowed key and lists them all."""
  unknown = sorted(unknown, key=str)
  more = f" (unknown keys: {unknown})" if len(unknown) > 1 else ""
  return ConfigError(f"{what} {unknown[0]!r}{where}{did_you_mean(unknown[0], allowed)}{more}; "
                     f"{allowed_text} {sorted(allowed)}")


# Fields that must hold a real bool: a string such as "false" is truthy in Python.
BOOL_FIELDS = ("offload_optimizer", "offload_params", "optimizer_on_host",
               "quantize_weights_backward", "nvme_pipeline_read", "nvme_pipeline_write")
QUANTIZED_DTYPES = ("int8", "int4")


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
  """Settings of a zerojax run.

  Attributes:
    stage: ZeRO stage. 0 = plain data parallel, 1 = shard optimizer state, 2 = also gradients,
      3 = also parameters (gathered per layer just in time).
    mesh_shape: device-mesh shape; one entry may be -1 to take the remaining devices.
    mesh_axes: names of the mesh axes, a subset of ``('replica', 'fsdp', 'tensor')``. Stages
      shard over ``fsdp``; ``replica`` is plain data parallelism across groups (HSDP);
      ``tensor`` is placed by the model's Flax partitioning metadata.
    param_persistence_threshold: leaves with fewer elements stay replicated (DeepSpeed's
      ``stage3_param_persistence_threshold``). ``None`` (default): 4096 where zerojax gathers
      each parameter itself (``gather='explicit'``, ``reduce_dtype``, ``offload_params``), since
      a separate collective per bias costs more than it saves; otherwise 0, every divisible
      leaf sharded, because under XLA's partitioner replicated biases only change its
      strategy and add temp (BENCHMARKS.md). See `persistence_threshold`.
    param_dtype: dtype of the master parameters and optimizer state.
    compute_dtype: dtype the model computes in (set on Flax modules as ``dtype``).
    reduce_dtype: dtype of the gradient reduction; ``None`` keeps the gradient's dtype.
    offload_optimizer: keep the optimizer state in ``pinned_host`` memory (stages 1-3), or,
      with ``'nvme'``, in files under ``nvme_path`` (ZeRO-Infinity): the step's gradient shards
      come to the host and each process streams its optimizer state through a pipelined,
      chunked optax update there (`zerojax.runtime.nvme`).
    offload_params: keep stage-3 parameters in ``pinned_host`` memory.
    offload_fallback: what to do when the backend has no ``pinned_host``: ``'error'`` or
      ``'warn'`` (warn and keep the state on device).
    optimizer_on_host: run the optimizer update itself on the host (needs offload_optimizer).
    nvme_path: directory of the optimizer-state files (``offload_optimizer='nvme'``); each
      process writes under ``<nvme_path>/zerojax-nvme/process-<i>``.
    nvme_chunk_size: parameters per chunk of the streamed update (DeepSpeed's
      ``sub_group_size``); host memory holds ``nvme_buffer_count`` chunks of optimizer state.
    nvme_buffer_count: chunk buffers in the pool (DeepSpeed's ``buffer_count``); 3 let the read
      of chunk i+1, the update of chunk i and the write of chunk i-1 run at once.
    nvme_pipeline_read: read the next chunks while the current one updates (``pipeline_read``).
    nvme_pipeline_write: write updated chunks in the background (``pipeline_write``).
    remat: rematerialisation of the user's scanned layers: ``'auto'`` (default: a scanned
      layer the model does not rematerialise itself gets ``nothing_saveable``, so no layer's
      gathered weights outlive it; ``nn.remat`` layers are left as written), ``'none'`` (as
      written), ``'full'`` (nothing saveable), ``'dots'`` (dots saveable) or ``'offload'``
      (named residuals go to host memory, see ``remat_offload_names``).
    remat_offload_names: ``checkpoint_name`` names offloaded by ``remat='offload'``.
    gather: how a sharded parameter reaches the layer that reads it. ``'auto'`` (default): the
      plan's shardings on the step's inputs, outputs and gradients, and XLA's partitioner
      (GSPMD) inserts the gathers and reduce-scatters where the model uses each weight, as
      hand-written JAX FSDP does; nothing inside the model is touched, so any model works
      (linen, NNX, plain pytrees, however it is called). Except at stage 3 for linen models
      called through ``state.apply_fn`` on TPU and GPU (whose partitioner moves activations
      instead of weights) and unscanned ones without remat on CPU: those gather per use, as
      ``'explicit'`` does, decided before compiling. ``'explicit'``: zerojax gathers each
      parameter where a linen layer reads it (``state.apply_fn``) and reduce-scatters its
      gradient there, which ``offload_params`` (per-layer fetch from host) and
      ``reduce_dtype`` (the dtype of that reduction) need and so switch on.
    max_live_layers: stage 3, scanned layers: how many gathered layers may be live at once;
      1 gathers each layer just before use, 2 lets the next layer's gather overlap the current
      layer. Unscanned linen layers always gather just before use (see `zerojax.core.gather`).
    quantize_weights: ZeRO++ qwZ, stage 3: ``'int8'`` (or ``'int4'``) moves each forward
      all-gather as block-quantised values plus one float32 scale per block, dequantised to
      the compute dtype after the gather; the master parameters and the optimizer update stay
      in ``param_dtype``. ``None`` (default): off. Like ``quantize_gradients``, it runs the
      model per device on its batch shard inside ``jax.shard_map`` with zerojax's own
      collectives (a linen model called through ``state.apply_fn``; no ``tensor`` axis, no
      ``offload_params``).
    quantize_weights_backward: with ``quantize_weights``, the backward pass's re-gather of each
      layer's weights is quantised too (``True``) or moves in full precision (``False``,
      default; DeepSpeed's qwZ quantises the forward gather).
    quantize_gradients: ZeRO++ qgZ, stages 2-3: ``'int8'`` (or ``'int4'``) reduces each
      gradient by quantising the chunk every other device owns per block, exchanging them in
      one all-to-all, then dequantising and summing in float32 on the owner; the result has
      the reduce-scatter's layout. ``None`` (default): off. ZeRO++'s own choice is int8
      weights and int4 gradients; int4 weights cost more loss (BENCHMARKS.md, ZeRO++).
    quantize_block_size: elements per scale of both (default 256, even). Each shard or chunk
      is blocked on its own and its last block zero-padded (the plan's table shows padding).
    train_batch_size: global batch per optimizer step.
    micro_batch_per_device: batch per device per micro-step.
    gradient_accumulation_steps: micro-steps per optimizer step.
    gradient_clipping: clip gradients to this global norm (``None``: no clipping).
    loss_scale: fp16 loss scaling: ``None`` off, ``0`` dynamic, ``> 0`` a static scale.
    initial_scale_power: dynamic loss scaling starts at ``2**initial_scale_power``.
    loss_scale_window: good steps before the scale doubles.
    hysteresis: overflowing steps tolerated before the scale halves.
    min_loss_scale: the scale never falls below this.
    nonfinite_grads: what a step whose gradient has a NaN or infinity does (DeepSpeed has no
      such key). ``'halt'``: the step reports it (``overflow`` in its metrics) and
      `zerojax.tools.train` stops there with `zerojax.tools.train.NonFiniteGradientsError`, naming the
      last good checkpoint; it costs no memory. ``'skip'``: params and optimizer state stay
      unchanged (bit-identical) and ``skipped_steps`` counts the step, as an fp16 overflow;
      keeping the old state beside the new one costs one optimizer state of temporaries at
      stage 0 (its shard at stages 1-3). ``'ignore'``: the update is applied (the parameters
      become NaN). ``'auto'`` (default): ``'skip'`` with loss scaling (an overflowing step is
      how the scale is found, so only ``'skip'`` is allowed there), else ``'halt'``.
    rules: user overrides ``((regex, partition_spec), ...)``; the first regex that matches a
      leaf's path (``'params/layers/mlp/kernel'``) fixes its spec, e.g.
      ``(("embed", (None, "fsdp")),)``.
  """

  stage: int = 3
  mesh_shape: tuple[int, ...] = (-1,)
  mesh_axes: tuple[str, ...] = ("fsdp",)
  param_persistence_threshold: int | None = None
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  reduce_dtype: str | None = None
  offload_optimizer: bool | str = False
  offload_params: bool = False
  offload_fallback: str = "error"
  optimizer_on_host: bool = False
  nvme_path: str | None = None
  nvme_chunk_size: int = 1 << 22
  nvme_buffer_count: int = 4
  nvme_pipeline_read: bool = True
  nvme_pipeline_write: bool = True
  remat: str = "auto"
  remat_offload_names: tuple[str, ...] = ()
  gather: str = "auto"
  max_live_layers: int = 1
  quantize_weights: str | None = None
  quantize_weights_backward: bool = False
  quantize_gradients: str | None = None
  quantize_block_size: int = 256
  train_batch_size: int | None = None
  micro_batch_per_device: int | None = None
  gradient_accumulation_steps: int | None = None
  gradient_clipping: float | None = None
  loss_scale: float | None = None
  initial_scale_power: int = 16
  loss_scale_window: int = 1000
  hysteresis: int = 2
  min_loss_scale: float = 1.0
  nonfinite_grads: str = "auto"
  rules: tuple[tuple[str, tuple[Any, ...]], ...] = ()

  def __post_init__(self):
    # Normalise sequences that arrive as lists from JSON/YAML so the dataclass stays hashable.
    set_ = lambda k, v: object.__setattr__(self, k, v)
    set_("mesh_shape", tuple(self.mesh_shape) if _is_seq(self.mesh_shape) else self.mesh_shape)
    set_("mesh_axes", tuple(self.mesh_axes) if _is_seq(self.mesh_axes) else self.mesh_axes)
    set_("remat_offload_names", tuple(self.remat_offload_names))
    if _is_seq(self.rules):
      set_("rules", tuple((r[0], tuple(r[1]) if _is_seq(r[1]) else r[1]) for r in self.rules))
    self._validate()

  # -- what the stage shards (the only reads of ``stage``; everything else reads these) ----

  @property
  def shards_opt_state(self) -> bool:
    """Whether the optimizer state is sharded over ``fsdp`` (stages 1-3)."""
    return self.stage >= 1

  @property
  def shards_grads(self) -> bool:
    """Whether each gradient is reduce-scattered to its shard during the backward pass
    (stages 2-3); stage 1 reduces the local gradient once per optimizer step."""
    return self.stage >= 2

  @property
  def shards_params(self) -> bool:
    """Whether parameters rest sharded and are gathered just in time (stage 3)."""
    return self.stage == 3

  @property
  def label(self) -> str:
    """The stage as reports print it: ``'stage 3'``."""
    return f"stage {self.stage}"

  @property
  def per_use_settings(self) -> bool:
    """Whether a setting acts where a layer reads each parameter, so the step must gather per
    use whatever the model: ``gather='explicit'``, ``reduce_dtype``, ``offload_params`` or
    ZeRO++ quantisation."""
    return (self.gather == "explicit" or self.reduce_dtype is not None
            or self.offload_params or self.quantized)

  @property
  def persistence_threshold(self) -> int:
    """``param_persistence_threshold`` with ``None`` resolved (see the field)."""
    if self.param_persistence_threshold is not None:
      return self.param_persistence_threshold
    return 4096 if self.per_use_settings else 0

  @property
  def optimizer_on_nvme(self) -> bool:
    """Whether the optimizer state lives in files under ``nvme_path``
    (``offload_optimizer='nvme'``)."""
    return self.offload_optimizer == NVME

  @property
  def quantized(self) -> bool:
    """Whether ZeRO++ quantised collectives are on (``quantize_weights``/``_gradients``)."""
    return self.quantize_weights is not None or self.quantize_gradients is not None

  @property
  def nonfinite_policy(self) -> str:
    """``nonfinite_grads`` with ``'auto'`` resolved: ``'skip'`` under loss scaling, else
    ``'halt'``."""
    if self.nonfinite_grads != "auto":
      return self.nonfinite_grads
    return "skip" if self.loss_scale is not None else "halt"

  # -- validation -------------------------------------------------------------------------
  # One validator per topic, run in this order: the first bad field found is the one reported.

  def _validate(self) -> None:
    """Checks every field; the first bad one raises `ConfigError` naming it."""
    self._validate_bools()
    self._validate_nvme()
    self._validate_mesh()
    self._validate_dtypes()
    self._validate_offload()
    self._validate_remat()
    self._validate_quantize()
    self._validate_batch()
    self._validate_loss_scale()
    self._validate_rules()

  def _validate_bools(self) -> None:
    """Boolean fields hold real booleans (``offload_optimizer`` may also be ``'nvme'``)."""
    for f in BOOL_FIELDS:
      if f == "offload_optimizer" and isinstance(self.offload_optimizer, str) and (
          self.offload_optimizer.strip().lower() == NVME):
        object.__setattr__(self, f, NVME)
        continue
      if not isinstance(getattr(self, f), (bool, np.bool_)):
        extra = (f", or {NVME!r} (the optimizer state in files under nvme_path)"
                 if f == "offload_optimizer" else "")
        _fail(f, getattr(self, f), "true or false (a boolean; strings such as 'false' or 'no' "
              f"are not booleans){extra}")
      object.__setattr__(self, f, bool(getattr(self, f)))

  def _validate_mesh(self) -> None:
    """The stage, the mesh's axes and its shape."""
    if not _is_int(self.stage) or self.stage not in STAGES:
      _fail("stage", self.stage, "allowed stages are 0, 1, 2 and 3")
    if not isinstance(self.mesh_axes, tuple) or not self.mesh_axes:
      _fail("mesh_axes", self.mesh_axes, f"a non-empty list of names from {MESH_AXES}")
    for a in self.mesh_axes:
      if a not in MESH_AXES:
        _fail("mesh_axes", self.mesh_axes, f"axis {a!r} is unknown; allowed axes are {MESH_AXES}")
    if len(set(self.mesh_axes)) != len(self.mesh_axes):
      _fail("mesh_axes", self.mesh_axes, "axis names must be unique")
    if "fsdp" not in self.mesh_axes:
      _fail("mesh_axes", self.mesh_axes, "must contain 'fsdp', the axis the stages shard over")
    if not isinstance(self.mesh_shape, tuple) or len(self.mesh_shape) != len(self.mesh_axes):
      _fail("mesh_shape", self.mesh_shape,
            f"needs one size per axis of mesh_axes={self.mesh_axes}")
    for s in self.mesh_shape:
      if not _is_int(s) or (s < 1 and s != -1):
        _fail("mesh_shape", self.mesh_shape, "sizes must be positive integers, or -1 (once) for "
              "'all remaining devices'")
    if sum(1 for s in self.mesh_shape if s == -1) > 1:
      _fail("mesh_shape", self.mesh_shape, "at most one size may be -1")

  def _validate_dtypes(self) -> None:
    """The persistence threshold and the parameter, compute and reduction dtypes."""
    if self.param_persistence_threshold is not None and (
        not _is_int(self.param_persistence_threshold) or self.param_persistence_threshold < 0):
      _fail("param_persistence_threshold", self.param_persistence_threshold,
            "a number of elements >= 0")
    for f in ("param_dtype", "compute_dtype"):
      if getattr(self, f) not in DTYPES:
        _fail(f, getattr(self, f), f"allowed dtypes are {DTYPES}")
    if self.reduce_dtype is not None and self.reduce_dtype not in DTYPES:
      _fail("reduce_dtype", self.reduce_dtype, f"None or one of {DTYPES}")

  def _validate_offload(self) -> None:
    """Host offload: each setting needs the stage that shards what it moves."""
    if self.offload_fallback not in OFFLOAD_FALLBACKS:
      _fail("offload_fallback", self.offload_fallback, f"one of {OFFLOAD_FALLBACKS}")
    if self.offload_optimizer and not self.shards_opt_state:
      _fail("offload_optimizer", self.offload_optimizer, "needs stage >= 1: at stage 0 every "
            "device keeps a full optimizer state, so offload would copy it to every host; use "
            "stage 1 or higher")
    if self.offload_params and not self.shards_params:
      _fail("offload_params", True, f"needs stage 3 (stage is {self.stage}): below stage 3 the "
            "parameters are replicated and used whole by every layer on every device")
    if self.optimizer_on_host and self.offload_optimizer is not True:
      _fail("optimizer_on_host", True, "needs offload_optimizer=True" + (
          " (with offload_optimizer='nvme' the update always runs on the host)"
          if self.optimizer_on_nvme else ""))

  def _validate_remat(self) -> None:
    """Rematerialisation, gather mode and live layers."""
    if self.remat not in REMAT_POLICIES:
      _fail("remat", self.remat, f"allowed policies are {REMAT_POLICIES}")
    if self.gather not in GATHER_MODES:
      _fail("gather", self.gather, f"allowed modes are {GATHER_MODES}")
    if self.remat == "offload" and not self.remat_offload_names:
      _fail("remat_offload_names", self.remat_offload_names,
            "remat='offload' needs the checkpoint_name names of the residuals to offload")
    if not _is_int(self.max_live_layers) or self.max_live_layers < 1:
      _fail("max_live_layers", self.max_live_layers, "an integer >= 1")

  def _validate_quantize(self) -> None:
    """ZeRO++ quantisation: dtypes, the stages it needs, and what it cannot combine with."""
    for f in ("quantize_weights", "quantize_gradients"):
      if getattr(self, f) is not None and getattr(self, f) not in QUANTIZED_DTYPES:
        _fail(f, getattr(self, f), f"None (off) or one of {QUANTIZED_DTYPES}")
    if self.quantize_weights is not None and not self.shards_params:
      _fail("quantize_weights", self.quantize_weights, f"needs stage 3 (stage is {self.stage}): "
            "below stage 3 the parameters are replicated and never gathered")
    if self.quantize_gradients is not None and not self.shards_grads:
      _fail("quantize_gradients", self.quantize_gradients, f"needs stage 2 or 3 (stage is "
            f"{self.stage}): below stage 2 the gradient is all-reduced, not reduce-scattered")
    if self.quantize_weights_backward and self.quantize_weights is None:
      _fail("quantize_weights_backward", True, "needs quantize_weights")
    if not _is_int(self.quantize_block_size) or self.quantize_block_size < 2 or (
        self.quantize_block_size % 2):
      _fail("quantize_block_size", self.quantize_block_size, "an even integer >= 2")
    if self.quantized and self.offload_params:
      _fail("offload_params", True, "cannot be combined with quantize_weights/"
            "quantize_gradients: the quantised formulation gathers from device memory")
    if self.quantized and "tensor" in self.mesh_axes and (
        self.mesh_shape[self.mesh_axes.index("tensor")] != 1):
      _fail("mesh_axes", self.mesh_axes, "a 'tensor' axis larger than 1 cannot be combined with "
            "quantize_weights/quantize_gradients: the quantised formulation runs the model per "
            "device over the data axes ('replica', 'fsdp')")

  def _validate_batch(self) -> None:
    """Batch sizes and gradient clipping."""
    for f in ("train_batch_size", "micro_batch_per_device", "gradient_accumulation_steps"):
      v = getattr(self, f)
      if v is not None and (not _is_int(v) or v < 1):
        _fail(f, v, "a positive integer or None")
    if self.gradient_clipping is not None and not (
        _is_num(self.gradient_clipping) and self.gradient_clipping > 0):
      _fail("gradient_clipping", self.gradient_clipping, "a positive finite number or None")

  def _validate_loss_scale(self) -> None:
    """fp16 loss scaling and the non-finite gradient policy it constrains."""
    if self.loss_scale is not None and not (_is_num(self.loss_scale) and self.loss_scale >= 0):
      _fail("loss_scale", self.loss_scale, "None (off), 0 (dynamic) or a positive finite "
            "static scale")
    if not _is_int(self.initial_scale_power) or not 0 <= self.initial_scale_power <= 64:
      _fail("initial_scale_power", self.initial_scale_power, "an integer in [0, 64]")
    for f in ("loss_scale_window", "hysteresis"):
      if not _is_int(getattr(self, f)) or getattr(self, f) < 1:
        _fail(f, getattr(self, f), "an integer >= 1")
    if not _is_num(self.min_loss_scale) or self.min_loss_scale <= 0:
      _fail("min_loss_scale", self.min_loss_scale, "a positive finite number")
    if self.nonfinite_grads not in NONFINITE_POLICIES:
      _fail("nonfinite_grads", self.nonfinite_grads, f"one of {NONFINITE_POLICIES}")
    if self.loss_scale is not None and self.nonfinite_grads not in ("auto", "skip"):
      _fail("nonfinite_grads", self.nonfinite_grads, f"with loss scaling (loss_scale="
            f"{self.loss_scale!r}) an overflowing step is always skipped and the scale "
            "adjusted; use 'skip', or loss_scale=None")

  def _validate_rules(self) -> None:
    """User partitioning rules: ``(regex, partition_spec)`` pairs whose regexes compile."""
    for i, r in enumerate(self.rules):
      if not (isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str)):
        _fail("rules", self.rules, "a list of (regex, partition_spec) pairs")
      try:
        re.compile(r[0])
      except re.error as e:
        _fail(f"rules[{i}]", r, f"the regex {r[0]!r} does not compile ({e}); rules are "
              "(regex, partition_spec) pairs matched with re.search against leaf paths such as "
              "'params/layers/mlp/kernel'")

  def _validate_nvme(self) -> None:
    """``nvme_path`` and the NVMe pool's sizes (``offload_optimizer='nvme'``)."""
    if not self.optimizer_on_nvme:
      if self.nvme_path is not None:
        _fail("nvme_path", self.nvme_path, "only used with offload_optimizer='nvme' "
              f"(offload_optimizer is {self.offload_optimizer!r}); set both, or drop nvme_path")
    else:
      if not isinstance(self.nvme_path, (str, os.PathLike)) or not os.fspath(self.nvme_path):
        _fail("nvme_path", self.nvme_path, "offload_optimizer='nvme' needs the directory of "
              "the optimizer-state files (a path string on a local disk, e.g. '/local_nvme')")
      object.__setattr__(self, "nvme_path", os.fspath(self.nvme_path))
      if self.offload_params:
        _fail("offload_params", True, "cannot be combined with offload_optimizer='nvme': the "
              "NVMe update returns parameter shards to device memory; keep the parameters on "
              "the devices (stage 3 shards them)")
    if not _is_int(self.nvme_chunk_size) or self.nvme_chunk_size < 1:
      _fail("nvme_chunk_size", self.nvme_chunk_size, "a number of parameters >= 1")
    if not _is_int(self.nvme_buffer_count) or self.nvme_buffer_count < 1:
      _fail("nvme_buffer_count", self.nvme_buffer_count, "an integer >= 1 (3 or more let "
            "reading, updating and writing overlap)")

  # -- derived values -----------------------------------------------------------------------

  def resolved_mesh_shape(self, num_devices: int) -> tuple[int, ...]:
    """The mesh shape with -1 replaced, checked against ``num_devices``."""
    return _resolve_shape(self.mesh_shape, num_devices, self.mesh_axes)

  def batch_sizes(self, data_parallel_size: int) -> tuple[int, int, int]:
    """``(train_batch_size, micro_batch_per_device, gradient_accumulation_steps)``.

    DeepSpeed's rule ``train = micro × accumulation × data_parallel``: any two given fix the
    third; all three given must agree.
    """
    t, m, g = self.train_batch_size, self.micro_batch_per_device, self.gradient_accumulation_steps
    dp = data_parallel_size
    if t is None and m is None:
      raise ConfigError("ZeroConfig needs train_batch_size or micro_batch_per_device to fix the "
                        "batch size")
    if g is None:
      if t is not None and m is not None:
        g, rem = divmod(t, m * dp)
        if rem or g < 1:
          _batch_fail(t, m, None, dp)
      else:
        g = 1
    if t is None:
      t = m * g * dp
    if m is None:
      m, rem = divmod(t, g * dp)
      if rem or m < 1:
        _batch_fail(t, None, g, dp)
    if t != m * g * dp:
      _batch_fail(t, m, g, dp)
    return t, m, g

  def replace(self, **changes: Any) -> "ZeroConfig":
    """A copy with ``changes``; an unknown field is a `ConfigError` with a suggestion."""
    unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
    if unknown:
      raise unknown_key_error("ZeroConfig has no field", unknown,
                              [f.name for f in dataclasses.fields(self)])
    return dataclasses.replace(self, **changes)

  # -- I/O ------------------------------------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["mesh_shape"], d["mesh_axes"] = list(self.mesh_shape), list(self.mesh_axes)
    d["remat_offload_names"] = list(self.remat_offload_names)
    d["rules"] = [[r, list(s) if isinstance(s, tuple) else s] for r, s in self.rules]
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ZeroConfig":
    if not isinstance(d, Mapping):
      raise ConfigError(f"a ZeroConfig must be a mapping of fields, got {type(d).__name__}")
    if "zero_optimization" in d:
      raise ConfigError(
          "this is a DeepSpeed config (it has 'zero_optimization'): load it with "
          "zerojax.load_config(path), which also keeps its XLA flags and training options, or "
          "zerojax.tools.deepspeed.from_deepspeed(d) for the ZeroConfig alone")
    if "train" in d:
      raise ConfigError(
          "the config has a 'train' section of training options: load it with "
          "zerojax.load_config(path), which returns them with the ZeroConfig")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
      raise unknown_key_error("ZeroConfig has no field", unknown, known)
    return cls(**d)

  @classmethod
  def from_file(cls, path: str | os.PathLike, *, allow_empty: bool = False) -> "ZeroConfig":
    """Loads a ``.json``, ``.yaml`` or ``.yml`` file (zerojax or DeepSpeed format).

    An empty file is an error unless ``allow_empty`` (then it means the defaults). Errors in
    the file's contents name the file.
    """
    d = read_config_file(path, allow_empty=allow_empty)
    with in_file(path):
      return cls.from_dict(d)


@contextlib.contextmanager
def in_file(path: str | os.PathLike | None) -> Iterator[None]:
  """Prefixes a `ConfigError` raised inside with ``config file 'PATH': `` (once)."""
  try:
    yield
  except ConfigError as e:
    if path is None or repr(os.fspath(path)) in str(e):
      raise
    raise ConfigError(f"config file {os.fspath(path)!r}: {e}") from None


class _Duplicate(Exception):
  def __init__(self, key: Any, first: int | None = None, again: int | None = None):
    super().__init__(key, first, again)
    self.key, self.first, self.again = key, first, again


class _StrictLoader(yaml.SafeLoader):
  """``SafeLoader`` that refuses a key given twice in one mapping (it would silently win)."""

  def construct_mapping(self, node, deep=False):
    if isinstance(node, yaml.MappingNode):
      seen: dict[Any, int] = {}
      for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
          continue  # `<<: *anchor` merges are meant to be overridden
        key = self.construct_object(key_node, deep=True)
        try:
          if key in seen:
            raise _Duplicate(key, seen[key] + 1, key_node.start_mark.line + 1)
        except TypeError:  # an unhashable key: SafeLoader reports it below
          continue
        seen[key] = key_node.start_mark.line
    return super().construct_mapping(node, deep)


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for k, v in pairs:
    if k in out:
      raise _Duplicate(k)
    out[k] = v
  return out


def read_config_file(path: str | os.PathLike, *, allow_empty: bool = False) -> dict[str, Any]:
  """The mapping in a ``.json``, ``.yaml`` or ``.yml`` config file.

  Raises:
    FileNotFoundError: the file does not exist.
    ConfigError: naming the file (and the line where the parser knows it) when the file is
      empty (unless ``allow_empty``: then ``{}``), is not valid JSON/YAML, repeats a key in one
      mapping, or does not hold a mapping.
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"zerojax config file {path!r} does not exist")
  if not path.endswith((".yaml", ".yml", ".json")):
    raise ConfigError(f"config file {path!r}: unknown extension; use .json, .yaml or .yml")
  with open(path) as f:
    text = f.read()
  if not text.strip() or (path.endswith((".yaml", ".yml")) and _yaml_is_empty(text)):
    if allow_empty:
      return {}
    raise ConfigError(f"config file {path!r} is empty; write the settings to use (e.g. "
                      "'stage: 2'), or pass no config file to run with the defaults")
  try:
    if path.endswith((".yaml", ".yml")):
      try:
        d = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
      except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        line = text.splitlines()[mark.line] if mark and mark.line < len(text.splitlines()) else ""
        hint = ("; YAML does not allow tab characters for indentation, use spaces"
                if "\t" in line or "'\\t'" in str(e.problem) else "")
        raise ConfigError(f"config file {path!r}{where}: not valid YAML: {e.problem}"
                          + (f" ({e.context})" if e.context else "") + hint) from None
      except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r}: not valid YAML: {e}") from None
    else:
      try:
        d = json.loads(text, object_pairs_hook=_json_pairs)
      except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path!r}, line {e.lineno}, column {e.colno}: not valid "
                          f"JSON: {e.msg}") from None
  except _Duplicate as e:
    lines = f" (lines {e.first} and {e.again})" if e.first else ""
    raise ConfigError(f"config file {path!r}: key {e.key!r} is given twice in one mapping"
                      f"{lines}; each key may appear once (the second would silently replace "
                      "the first)") from None
  if not isinstance(d, Mapping):
    raise ConfigError(f"config file {path!r} must hold a mapping of settings, got "
                      f"{type(d).__name__}")
  return dict(d)


def _yaml_is_empty(text: str) -> bool:
  """Whether a YAML document has only comments, blank lines and document markers."""
  for line in text.splitlines():
    s = line.strip()
    if s and not s.startswith("#") and s not in ("---", "..."):
      return False
  return True


def _is_seq(x: Any) -> bool:
  return isinstance(x, (list, tuple))


def _is_int(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
  """A finite real number (NaN and infinity are refused: they pass or fail comparisons
  silently)."""
  return (isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
          and math.isfinite(x))


def _batch_fail(t, m, g, dp) -> None:
  raise ConfigError(
      f"inconsistent batch sizes: train_batch_size={t}, micro_batch_per_device={m}, "
      f"gradient_accumulation_steps={g}, data-parallel size={dp}; the rule is "
      "train_batch_size = micro_batch_per_device × gradient_accumulation_steps × data-parallel "
      "size")


def _resolve_shape(shape: Sequence[int], n: int, axes: Sequence[str]) -> tuple[int, ...]:
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if n % known:
      _fail("mesh_shape", tuple(shape), f"the fixed sizes multiply to {known}, which does not "
            f"divide the {n} available devices")
    shape = tuple(n // known if s == -1 else s for s in shape)
  if math.prod(shape) != n:
    _fail("mesh_shape", tuple(shape), f"mesh {dict(zip(axes, shape))} needs "
          f"{math.prod(shape)} devices but {n} are available; sizes must multiply to {n}")
  return tuple(shape)


