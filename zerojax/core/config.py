"""`ZeroConfig`: the one switch board of zerojax.

Every other module reads this frozen dataclass; nothing else holds settings. It is validated
at construction so a bad value fails before any device work, with a message that names the
field, the value and what is allowed (the rules per field are in `zerojax.core.validation`; a
file is read by `zerojax.core.mapping_file`).

DeepSpeed ``ds_config.json`` files map into the same dataclass (see `zerojax.tools.deepspeed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
from typing import Any, Iterator, Mapping, Sequence

from zerojax.core import validation
from zerojax.core.mapping_file import MappingFileError, read_mapping

__all__ = ["ConfigError", "did_you_mean", "unknown_key_error", "ZeroConfig", "in_file",
           "read_config_file"]


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
      a separate collective per bias costs more than it saves, and at stage 3 on TPU;
      otherwise 0, every divisible leaf sharded: under XLA's partitioner replicated biases
      only change its strategy and add temp, and so they do per use on XLA:GPU (BENCHMARKS.md).
      See `zerojax.core.backend.Backend.persistence_threshold`.
    param_dtype: dtype of the master parameters and optimizer state.
    compute_dtype: dtype the model computes in (set on Flax modules that leave ``dtype``
      unset, an ``nnx.Embed`` whose ``dtype`` is its table's included).
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
      (named residuals go to host memory, see ``remat_offload_names``). A linen or NNX model
      without scans gets the named policy on each of its blocks (the shallowest modules of one
      class that one parent calls two or more of, `zerojax.core.blocks`), as
      ``nn.remat(Block)`` would; a pure function, or a model whose modules do not repeat, is
      checkpointed whole, which re-runs its whole forward pass at once and saves little.
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
    max_live_layers: stage 3, scanned layers: how many gathered layers may be live at once.
      1 gathers each layer inside its own iteration. 2 runs scanned layers one ahead where
      zerojax gathers per use (`zerojax.core.pipeline`): each layer's weights are gathered
      beside the previous layer's compute and each gradient is reduce-scattered beside the
      next layer's, at one more layer of gathered weights and of unreduced gradient (elsewhere
      2 unrolls the scan by two). ``None`` (default): 2 on XLA:GPU, 1 on XLA:TPU (its ICI
      all-gather pipelining issues the gathers an iteration ahead) and XLA:CPU (nothing runs
      beside a collective there). Unscanned layers gather one matmul layer ahead on TPU and
      GPU whatever this says (`zerojax.core.regather`).
    quantize_weights: ZeRO++ qwZ, stage 3: ``'int8'`` (or ``'int4'``) moves each parameter
      all-gather (the forward gather and, unless ``quantize_weights_backward=False``, the
      backward pass's re-gather) as block-quantised values plus one float32 scale per block,
      dequantised to the compute dtype after the gather; the master parameters and the
      optimizer update stay in ``param_dtype``. ``None`` (default): off. Like
      ``quantize_gradients``, it runs the model per device on its batch shard inside
      ``jax.shard_map`` with zerojax's own collectives (a linen model called through
      ``state.apply_fn``; no ``tensor`` axis, no ``offload_params``).
    quantize_weights_backward: whether the backward pass's re-gather of each layer's weights
      is quantised like the forward gather. ``None`` (default): the same as
      ``quantize_weights`` (quantised whenever it is set, as DeepSpeed's qwZ quantises every
      parameter all-gather, the backward pass's fetches included); ``True``: quantised (needs
      ``quantize_weights``); ``False``: the backward re-gather moves full-precision weights
      (compute dtype; more bytes, no quantisation noise in the backward pass), and each
      scanned layer is then re-run whole in its backward pass. `quantizes_backward` is the
      resolved value.
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
  max_live_layers: int | None = None
  quantize_weights: str | None = None
  quantize_weights_backward: bool | None = None
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
  def optimizer_on_nvme(self) -> bool:
    """Whether the optimizer state lives in files under ``nvme_path``
    (``offload_optimizer='nvme'``)."""
    return self.offload_optimizer == validation.NVME

  @property
  def quantized(self) -> bool:
    """Whether ZeRO++ quantised collectives are on (``quantize_weights``/``_gradients``)."""
    return self.quantize_weights is not None or self.quantize_gradients is not None

  @property
  def quantizes_backward(self) -> bool:
    """``quantize_weights_backward`` with ``None`` resolved: whether the backward pass's
    re-gather of each layer's weights is quantised (``None``: whenever ``quantize_weights``
    is set). The only read of that field; everything else reads this."""
    if self.quantize_weights is None:
      return False
    return self.quantize_weights_backward is not False

  @property
  def nonfinite_policy(self) -> str:
    """``nonfinite_grads`` with ``'auto'`` resolved: ``'skip'`` under loss scaling, else
    ``'halt'``."""
    if self.nonfinite_grads != "auto":
      return self.nonfinite_grads
    return "skip" if self.loss_scale is not None else "halt"

  def _validate(self) -> None:
    """Checks every field (`zerojax.core.validation`); the first bad one raises `ConfigError`
    naming it."""
    problem = validation.first_problem(self)
    if problem is not None:
      _fail(*problem)

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


def read_config_file(path: str | os.PathLike, *, allow_empty: bool = False) -> dict[str, Any]:
  """The mapping in a ``.json``, ``.yaml`` or ``.yml`` config file.

  Raises:
    FileNotFoundError: the file does not exist.
    ConfigError: naming the file (and the line where the parser knows it) when the file is
      empty (unless ``allow_empty``: then ``{}``), is not valid JSON/YAML, repeats a key in one
      mapping, or does not hold a mapping.
  """
  try:
    return read_mapping(path, allow_empty=allow_empty)
  except MappingFileError as e:
    raise ConfigError(str(e)) from None


def _is_seq(x: Any) -> bool:
  return isinstance(x, (list, tuple))


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


