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
  """A setting zerojax does not allow.

  Raised by `ZeroConfig` for a field whose value is not allowed (the message names the field,
  the value and what is allowed), and by config files and mappings that cannot be read as one
  (unknown keys, inconsistent batch sizes, a file that is not a mapping).
  """


def _fail(field: str, value: Any, allowed: str) -> None:
  raise ConfigError(f"ZeroConfig.{field}={value!r} is invalid: {allowed}")


def did_you_mean(key: str, allowed: Any) -> str:
  """The suggestion for a mistyped key.

  Args:
    key: the unknown key.
    allowed: the keys allowed there.

  Returns:
    `` (did you mean 'stage'?)`` for the closest allowed key, or ``''`` if none is close.
  """
  close = difflib.get_close_matches(str(key), [str(a) for a in allowed], n=1, cutoff=0.6)
  return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key_error(what: str, unknown: Any, allowed: Any, where: str = "",
                      allowed_text: str = "allowed keys are") -> ConfigError:
  """The error for keys outside ``allowed``.

  Args:
    what: the message's start, e.g. ``'ZeroConfig has no field'``.
    unknown: the unknown keys (at least one).
    allowed: the keys allowed there.
    where: where the first unknown key is, appended to it.
    allowed_text: the words before the list of allowed keys.

  Returns:
    A `ConfigError` (not raised) that names the first unknown key, suggests the closest allowed
    key, names the other unknown keys and lists the allowed ones.
  """
  unknown = sorted(unknown, key=str)
  more = f" (unknown keys: {unknown})" if len(unknown) > 1 else ""
  return ConfigError(f"{what} {unknown[0]!r}{where}{did_you_mean(unknown[0], allowed)}{more}; "
                     f"{allowed_text} {sorted(allowed)}")


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
  """Settings of a zerojax run, validated when constructed.

  Each field's behaviour in full, and why the defaults are what they are: docs/design.md,
  "Settings (`ZeroConfig`)".

  Attributes:
    stage: ZeRO stage: 0 data parallel, 1 shards the optimizer state, 2 also gradients, 3 also
      parameters (gathered per layer just in time). Default 3.
    mesh_shape: device-mesh shape; one entry may be -1 to take the remaining devices.
    mesh_axes: subset of ``('replica', 'fsdp', 'tensor')``: stages shard over ``fsdp``,
      ``replica`` is data parallel across groups (HSDP), ``tensor`` follows Flax metadata.
    param_persistence_threshold: leaves with fewer elements stay replicated (DeepSpeed's
      ``stage3_param_persistence_threshold``). ``None`` (default): the backend's
      (`zerojax.core.backend.Backend.persistence_threshold`): 4096 where zerojax gathers each
      parameter itself or at stage 3 on TPU, else 0.
    param_dtype: dtype of the master parameters and optimizer state.
    compute_dtype: dtype the model computes in, set on Flax modules that leave ``dtype`` unset.
    reduce_dtype: dtype of the gradient reduction; ``None`` keeps the gradient's dtype.
    offload_optimizer: ``False`` (default), ``True`` (optimizer state in ``pinned_host``
      memory, stages 1-3) or ``'nvme'`` (in files under ``nvme_path``, ZeRO-Infinity).
    offload_params: keep stage-3 parameters in ``pinned_host`` memory.
    offload_fallback: without ``pinned_host``: ``'error'`` (default) or ``'warn'`` (warn and
      keep the state on device).
    optimizer_on_host: run the optimizer update on the host (needs ``offload_optimizer``).
    nvme_path: directory of the optimizer-state files (``offload_optimizer='nvme'``).
    nvme_chunk_size: parameters per chunk of the streamed update (``sub_group_size``).
    nvme_buffer_count: chunk buffers held in host memory (``buffer_count``).
    nvme_pipeline_read: read the next chunks while the current one updates (``pipeline_read``).
    nvme_pipeline_write: write updated chunks in the background (``pipeline_write``).
    remat: rematerialisation policy for the model's layers: ``'auto'`` (default), ``'none'``,
      ``'full'``, ``'dots'`` or ``'offload'`` (see ``remat_offload_names``).
    remat_offload_names: ``checkpoint_name`` names offloaded by ``remat='offload'``.
    gather: how a sharded parameter reaches its layer: ``'auto'`` (default: XLA's partitioner
      inserts the collectives; zerojax gathers per use where that is better) or
      ``'explicit'`` (zerojax gathers per use; ``offload_params`` and ``reduce_dtype`` need it).
    max_live_layers: stage 3, scanned layers: gathered layers live at once, 1 or 2 (one ahead).
      ``None`` (default): 2 on XLA:GPU, 1 on XLA:TPU and XLA:CPU.
    quantize_weights: ZeRO++ qwZ, stage 3: ``'int8'`` or ``'int4'`` parameter all-gathers;
      ``None`` (default): off.
    quantize_weights_backward: whether the backward re-gather is quantised too; ``None``
      (default): whenever ``quantize_weights`` is set (resolved: `quantizes_backward`).
    quantize_gradients: ZeRO++ qgZ, stages 2-3: ``'int8'`` or ``'int4'`` gradient
      reductions; ``None`` (default): off.
    quantize_block_size: elements per scale of both quantisations (default 256, even).
    train_batch_size: global batch per optimizer step.
    micro_batch_per_device: batch per device per micro-step.
    gradient_accumulation_steps: micro-steps per optimizer step.
    gradient_clipping: clip gradients to this global norm (``None``: no clipping).
    loss_scale: fp16 loss scaling: ``None`` off, ``0`` dynamic, ``> 0`` a static scale.
    initial_scale_power: dynamic loss scaling starts at ``2**initial_scale_power``.
    loss_scale_window: good steps before the scale doubles.
    hysteresis: overflowing steps tolerated before the scale halves.
    min_loss_scale: the scale never falls below this.
    nonfinite_grads: a step whose gradient has a NaN or infinity: ``'halt'`` (stop training),
      ``'skip'`` (leave the state bit-identical), ``'ignore'`` (apply the update) or
      ``'auto'`` (default: ``'skip'`` with loss scaling, the only value allowed there, else
      ``'halt'``).
    rules: user overrides ``((regex, partition_spec), ...)``; the first regex matching a
      leaf's path (``'params/layers/mlp/kernel'``) fixes its spec.
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
    """The mesh shape with -1 replaced, checked against ``num_devices``.

    Args:
      num_devices: the devices the mesh spans.

    Returns:
      ``mesh_shape`` with its -1 entry replaced by the remaining devices.

    Raises:
      ConfigError: the sizes do not divide, or do not multiply to, ``num_devices``.
    """
    return _resolve_shape(self.mesh_shape, num_devices, self.mesh_axes)

  def batch_sizes(self, data_parallel_size: int) -> tuple[int, int, int]:
    """``(train_batch_size, micro_batch_per_device, gradient_accumulation_steps)``.

    DeepSpeed's rule ``train = micro × accumulation × data_parallel``: any two given fix the
    third; all three given must agree. ``gradient_accumulation_steps`` unset is 1 unless both
    others are given.

    Args:
      data_parallel_size: devices the batch is split over (``replica`` × ``fsdp``).

    Returns:
      ``(train_batch_size, micro_batch_per_device, gradient_accumulation_steps)``, all set.

    Raises:
      ConfigError: neither ``train_batch_size`` nor ``micro_batch_per_device`` is set, or the
        sizes do not satisfy the rule.
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
    """A copy with some fields changed, validated again.

    Args:
      **changes: the fields to change and their new values.

    Returns:
      The new `ZeroConfig`.

    Raises:
      ConfigError: a field is unknown (with a suggestion) or a new value is not allowed.
    """
    unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
    if unknown:
      raise unknown_key_error("ZeroConfig has no field", unknown,
                              [f.name for f in dataclasses.fields(self)])
    return dataclasses.replace(self, **changes)

  # -- I/O ------------------------------------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    """The fields as plain JSON/YAML values.

    Returns:
      A mapping of every field to its value, tuples as lists, that `from_dict` reads back.
    """
    d = dataclasses.asdict(self)
    d["mesh_shape"], d["mesh_axes"] = list(self.mesh_shape), list(self.mesh_axes)
    d["remat_offload_names"] = list(self.remat_offload_names)
    d["rules"] = [[r, list(s) if isinstance(s, tuple) else s] for r, s in self.rules]
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ZeroConfig":
    """A config from a mapping of fields (zerojax format).

    Args:
      d: field names to values; fields left out keep their defaults.

    Returns:
      The validated `ZeroConfig`.

    Raises:
      ConfigError: ``d`` is not a mapping, is a DeepSpeed config or has a ``train`` section
        (both are read by `zerojax.load_config`), has an unknown key, or holds a value not
        allowed.
    """
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

    Args:
      path: the file.
      allow_empty: an empty file means the defaults instead of an error.

    Returns:
      The validated `ZeroConfig`.

    Raises:
      FileNotFoundError: the file does not exist.
      ConfigError: naming the file, when it cannot be read as a config (see
        `read_config_file`) or its contents are not allowed (see `from_dict`).
    """
    d = read_config_file(path, allow_empty=allow_empty)
    with in_file(path):
      return cls.from_dict(d)


@contextlib.contextmanager
def in_file(path: str | os.PathLike | None) -> Iterator[None]:
  """Names a config file in the errors raised while its contents are read.

  Args:
    path: the file; ``None`` leaves errors as they are.

  Yields:
    Nothing; a `ConfigError` raised inside is raised again prefixed ``config file 'PATH': ``
    (once: a message that already names the file is left as it is).
  """
  try:
    yield
  except ConfigError as e:
    if path is None or repr(os.fspath(path)) in str(e):
      raise
    raise ConfigError(f"config file {os.fspath(path)!r}: {e}") from None


def read_config_file(path: str | os.PathLike, *, allow_empty: bool = False) -> dict[str, Any]:
  """The mapping in a ``.json``, ``.yaml`` or ``.yml`` config file.

  Args:
    path: the file.
    allow_empty: an empty file is ``{}`` instead of an error.

  Returns:
    The file's top-level mapping.

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


