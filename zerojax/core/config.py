"""`ZeroConfig`: a stage plus typed policies, the one switch board of zerojax.

Every other module reads this frozen dataclass; nothing else holds settings. Its sections are
the policies of `zerojax.core.policies` (`Precision`, `HostOffload` or `NvmeOffload`, `Remat`,
`Gather`, `Quantize`, `Batch`, `LossScale`), each validated when made; the rules that join a
policy to the stage are checked here, so a bad value fails before any device work with a
message that names the setting, the value and what is allowed (the rules are in
`zerojax.core.validation`; a file is read by `zerojax.core.mapping_file`).

Every setting also has a flat keyword (`to_flat`, `from_flat`): DeepSpeed ``ds_config.json``
files (`zerojax.tools.deepspeed`) and command-line overrides are written in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any, Iterator, Mapping, Sequence

from zerojax.core import policies, validation
from zerojax.core.errors import ConfigError, did_you_mean, invalid_setting, unknown_key_error
from zerojax.core.policies import (Batch, Gather, HostOffload, LossScale, NvmeOffload, Offload,
                                   Precision, Quantize, Remat)
from zerojax.core.mapping_file import MappingFileError, read_mapping

__all__ = ["ConfigError", "did_you_mean", "unknown_key_error", "ZeroConfig", "in_file",
           "read_config_file", "setting_of", "Precision", "HostOffload", "NvmeOffload", "Remat", "Gather",
           "Quantize", "Batch", "LossScale"]


def _fail(field: str, value: Any, allowed: str) -> None:
  raise invalid_setting(field, value, allowed)


@dataclasses.dataclass(frozen=True, init=False)
class ZeroConfig:
  """Settings of a zerojax run: a stage plus typed policies, validated when constructed.

  Each setting's behaviour in full, and why the defaults are what they are: docs/design.md,
  "Settings (`ZeroConfig`)".

  Attributes:
    stage: ZeRO stage: 0 data parallel, 1 shards the optimizer state, 2 also gradients, 3 also
      parameters (gathered per layer just in time). Default 3.
    mesh_shape: device-mesh shape; one entry may be -1 to take the remaining devices.
    mesh_axes: subset of ``('replica', 'fsdp', 'tensor')``: stages shard over ``fsdp``,
      ``replica`` is data parallel across groups (HSDP), ``tensor`` follows Flax metadata.
    precision: the dtypes (`Precision`): master parameters and optimizer state, compute,
      gradient reduction.
    offload: where state leaves the devices: ``None`` (default), `HostOffload` (ZeRO-Offload,
      ``pinned_host`` memory) or `NvmeOffload` (ZeRO-Infinity, files on a local disk).
    remat: rematerialisation of the model's layers (`Remat`); a string is short for
      ``Remat(policy)``.
    gather: how a sharded parameter reaches its layer (`Gather`); a string is short for
      ``Gather(mode)``.
    quantize: ZeRO++ quantised collectives (`Quantize`), or ``None`` (default).
    batch: the batch sizes (`Batch`).
    loss_scale: fp16 loss scaling (`LossScale`), or ``None`` (default: off); a number is short
      for ``LossScale(scale)`` (0: dynamic).
    gradient_clipping: clip gradients to this global norm (``None``: no clipping).
    nonfinite_grads: a step whose gradient has a NaN or infinity: ``'halt'`` (stop training),
      ``'skip'`` (leave the state bit-identical), ``'ignore'`` (apply the update) or
      ``'auto'`` (default: ``'skip'`` with loss scaling, the only value allowed there, else
      ``'halt'``).
    rules: user overrides ``((regex, partition_spec), ...)``; the first regex matching a
      leaf's path (``'params/layers/mlp/kernel'``) fixes its spec.

  The flat keywords of zerojax 0.1 (``offload_optimizer='nvme', nvme_path=...``; the list is
  `zerojax.core.validation.FLAT_DEFAULTS`) are still accepted, with a `DeprecationWarning`
  naming the policy that replaces each, and `from_flat` reads them without one (DeepSpeed
  files and command-line overrides use them). Each is also readable as a property:
  ``config.compute_dtype`` is ``config.precision.compute``.
  """

  stage: int = 3
  mesh_shape: tuple[int, ...] = (-1,)
  mesh_axes: tuple[str, ...] = ("fsdp",)
  precision: Precision = Precision()
  offload: Offload | None = None
  remat: Remat = Remat()
  gather: Gather = Gather()
  quantize: Quantize | None = None
  batch: Batch = Batch()
  loss_scale: LossScale | None = None
  gradient_clipping: float | None = None
  nonfinite_grads: str = "auto"
  rules: tuple[tuple[str, tuple[Any, ...]], ...] = ()

  def __init__(self, stage: int = 3, *, mesh_shape: Sequence[int] = (-1,),
               mesh_axes: Sequence[str] = ("fsdp",), precision: Precision = Precision(),
               offload: Offload | None = None, remat: Remat | str = Remat(),
               gather: Gather | str = Gather(), quantize: Quantize | None = None,
               batch: Batch = Batch(), loss_scale: LossScale | float | None = None,
               gradient_clipping: float | None = None, nonfinite_grads: str = "auto",
               rules: Sequence[tuple[str, Any]] = (), **flat: Any):
    unknown = set(flat) - set(validation.FLAT_DEFAULTS)
    if unknown:
      raise _no_field(unknown)
    if flat:
      warnings.warn(_deprecation(flat), DeprecationWarning, stacklevel=2)
    given = {"stage": stage, "mesh_shape": mesh_shape, "mesh_axes": mesh_axes,
             "precision": precision, "offload": offload, "remat": remat, "gather": gather,
             "quantize": quantize, "batch": batch, "loss_scale": loss_scale,
             "gradient_clipping": gradient_clipping, "nonfinite_grads": nonfinite_grads,
             "rules": rules}
    given = _resolve({}, given, flat)
    view = validation.FlatView(**_to_flat(given))  # normalises sequences to tuples
    for name in _FIELDS:
      value = given[name]
      if name in ("mesh_shape", "mesh_axes", "rules"):
        value = getattr(view, name)
      object.__setattr__(self, name, value)
    self._validate(view)
    object.__setattr__(self, "_flat", dict(vars(view)))

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
    use whatever the model: ``Gather('explicit')``, ``Precision.reduce``,
    ``HostOffload(params=True)`` or ZeRO++ quantisation."""
    return (self.gather.mode == "explicit" or self.precision.reduce is not None
            or self.offload_params or self.quantized)

  @property
  def optimizer_on_nvme(self) -> bool:
    """Whether the optimizer state lives in files (``offload`` is an `NvmeOffload`)."""
    return isinstance(self.offload, NvmeOffload)

  @property
  def quantized(self) -> bool:
    """Whether ZeRO++ quantised collectives are on (``quantize`` is set)."""
    return self.quantize is not None

  @property
  def quantizes_backward(self) -> bool:
    """``Quantize.weights_backward`` with ``None`` resolved: whether the backward pass's
    re-gather of each layer's weights is quantised (``None``: whenever ``weights`` is set).
    The only read of that field; everything else reads this."""
    if self.quantize is None or self.quantize.weights is None:
      return False
    return self.quantize.weights_backward is not False

  @property
  def nonfinite_policy(self) -> str:
    """``nonfinite_grads`` with ``'auto'`` resolved: ``'skip'`` under loss scaling, else
    ``'halt'``."""
    if self.nonfinite_grads != "auto":
      return self.nonfinite_grads
    return "skip" if self.loss_scale is not None else "halt"

  def _validate(self, view: validation.FlatView) -> None:
    """Checks the settings together (`zerojax.core.validation`, on ``view``, this config's
    flat spelling): the first bad one raises `ConfigError` naming it as this config spells it
    (``offload.params``)."""
    problem = validation.first_problem(view)
    if problem is not None:
      _fail(_SPELLING.get(problem.field, problem.field), problem.value, problem.allowed)

  # -- derived values -----------------------------------------------------------------------

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
    t, m, g = self.batch.global_size, self.batch.micro_per_device, self.batch.accumulation_steps
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
      **changes: the fields to change and their new values (a flat keyword of zerojax 0.1 is
        accepted with a `DeprecationWarning`).

    Returns:
      The new `ZeroConfig`.

    Raises:
      ConfigError: a field is unknown (with a suggestion) or a new value is not allowed.
    """
    unknown = set(changes) - set(_FIELDS) - set(validation.FLAT_DEFAULTS)
    if unknown:
      raise _no_field(unknown)
    flat = {k: changes.pop(k) for k in list(changes) if k not in _FIELDS}
    if flat:
      warnings.warn(_deprecation(flat), DeprecationWarning, stacklevel=2)
    return ZeroConfig(**_resolve({n: getattr(self, n) for n in _FIELDS}, changes, flat))

  def to_flat(self) -> dict[str, Any]:
    """The config in its flat spelling: one keyword per setting, as DeepSpeed files and
    command-line overrides write it (`zerojax.core.validation.FLAT_DEFAULTS` lists them).

    Returns:
      Every flat keyword and its value as plain JSON/YAML values (tuples as lists); `from_flat`
      reads it back.
    """
    return {k: _plain(v) for k, v in self._flat.items()}

  @classmethod
  def from_flat(cls, flat: Mapping[str, Any]) -> "ZeroConfig":
    """A config from flat keywords (`to_flat`'s spelling), without a deprecation warning.

    Args:
      flat: flat keywords to values; those left out keep their defaults.

    Returns:
      The validated `ZeroConfig`.

    Raises:
      ConfigError: a keyword is unknown, or a value is not allowed (named by its flat
        keyword).
    """
    unknown = set(flat) - set(validation.FLAT_DEFAULTS)
    if unknown:
      raise unknown_key_error("ZeroConfig has no field", unknown, validation.FLAT_DEFAULTS)
    return cls(**_from_flat(flat))

  # -- I/O ------------------------------------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    """The fields as plain JSON/YAML values.

    Returns:
      A mapping of every field to its value, each policy as a mapping of its fields (an
      offload with its ``kind``, ``'host'`` or ``'nvme'``), tuples as lists, that `from_dict`
      reads back.
    """
    return {name: _policy_to_dict(getattr(self, name)) if name in policies.POLICIES
            else _plain(getattr(self, name)) for name in _FIELDS}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ZeroConfig":
    """A config from a mapping of fields (zerojax format).

    Args:
      d: field names to values, each policy as a mapping of its fields (`to_dict`'s form);
        fields left out keep their defaults. A file may also use the flat keywords
        (`to_flat`'s, as command-line overrides do), mixed with sections.

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
    unknown = set(d) - set(_FIELDS) - set(validation.FLAT_DEFAULTS)
    if unknown:
      raise _no_field(unknown)
    flat = {k: v for k, v in d.items() if k not in _FIELDS}
    fields = {k: v for k, v in d.items() if k in _FIELDS}
    return cls(**_resolve({}, fields, flat)) if flat else cls(**fields)

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
    raise ConfigError(f"config file {os.fspath(path)!r}: {e}", field=e.field, value=e.value,
                      allowed=e.allowed) from None


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


_FIELDS = ("stage", "mesh_shape", "mesh_axes", "precision", "offload", "remat", "gather",
           "quantize", "batch", "loss_scale", "gradient_clipping", "nonfinite_grads", "rules")
# flat keyword -> (field, policy class, policy attribute)
_SECTIONS: dict[str, tuple[str, type, str]] = {
    flat: (name, cls, attr) for name, classes in policies.POLICIES.items()
    for cls in classes for attr, flat in cls._FLAT.items()}
# A flat keyword as a config built from policies spells it in errors: ``offload.params``.
_SPELLING = {flat: f"{name}.{attr}" for flat, (name, _, attr) in _SECTIONS.items()
             if flat not in ("remat", "gather", "loss_scale")}


_CLASS_SECTION = {cls.__name__: name for name, classes in policies.POLICIES.items()
                  for cls in classes}


def setting_of(field: str) -> str:
  """The dotted setting a `ConfigError.field` names, whatever spelling raised it.

  Args:
    field: ``'HostOffload.params'`` (a policy's own rule), ``'offload.params'`` (a rule
      between settings), ``'offload_params'`` (a flat keyword) or a plain field (``'stage'``).

  Returns:
    ``'offload.params'`` for each of the first three; a plain field as it is.
  """
  head, dot, attr = field.partition(".")
  if dot and head in _CLASS_SECTION:
    return f"{_CLASS_SECTION[head]}.{attr}"
  if field in _SECTIONS:
    name, _, attr = _SECTIONS[field]
    return f"{name}.{attr}"
  return field


def _plain(v: Any) -> Any:
  """Tuples as lists, recursively: what JSON reads back."""
  return [_plain(x) for x in v] if isinstance(v, (tuple, list)) else v


_KINDS = {"host": HostOffload, "nvme": NvmeOffload}  # an offload mapping's ``kind``


def _policy_to_dict(policy: Any) -> dict[str, Any] | None:
  """A policy as plain JSON/YAML values (an offload with its ``kind``); ``None`` stays."""
  if policy is None:
    return None
  d = {f.name: _plain(getattr(policy, f.name)) for f in dataclasses.fields(policy)}
  if isinstance(policy, (HostOffload, NvmeOffload)):
    d = {"kind": "nvme" if isinstance(policy, NvmeOffload) else "host", **d}
  return d


def _policy_from_dict(section: str, d: Any) -> Any:
  """The policy of ``section`` from a mapping (`policy_to_dict`'s form); a policy or ``None``
  is returned as it is."""
  classes = policies.POLICIES[section]
  optional = section in policies.OPTIONAL
  if isinstance(d, classes) or (d is None and optional):
    return d
  if not isinstance(d, Mapping):
    names = " or ".join(c.__name__ for c in classes)
    raise ConfigError(f"ZeroConfig.{section}={d!r} is invalid: a {names}, a mapping of its "
                      "fields" + (", or null (off)" if optional else ""))
  d = dict(d)
  cls = classes[0]
  if section == "offload":
    kind = d.pop("kind", None)
    if kind not in _KINDS:
      raise ConfigError(f"ZeroConfig.offload.kind={kind!r} is invalid: 'host' (HostOffload) or "
                        "'nvme' (NvmeOffload)")
    cls = _KINDS[kind]
  names = [f.name for f in dataclasses.fields(cls)]
  unknown = set(d) - set(names)
  if unknown:
    raise unknown_key_error(f"{cls.__name__} has no field", unknown, names)
  try:
    return cls(**d)
  except TypeError:  # a required field left out (NvmeOffload.path)
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.name not in d]
    raise ConfigError(f"ZeroConfig.{section}: {cls.__name__} needs {missing[0]!r}") from None


def _no_field(unknown: Any) -> ConfigError:
  """Unknown keywords: the fields are listed, and a flat keyword is suggested as readily."""
  return unknown_key_error("ZeroConfig has no field", unknown, _FIELDS,
                           suggest_from=(*_FIELDS, *validation.FLAT_DEFAULTS))


def _to_flat(fields: Mapping[str, Any]) -> dict[str, Any]:
  """The flat keywords of a config's fields (a policy left out or ``None``, and a field left
  out, keep the defaults)."""
  flat = dict(validation.FLAT_DEFAULTS)
  for name in _FIELDS:
    value = fields.get(name)
    if name in policies.POLICIES:
      if value is not None:
        flat.update(value.flat())
    elif name in fields:
      flat[name] = value
  return flat


def _resolve(base: Mapping[str, Any], changes: Mapping[str, Any],
             flat: Mapping[str, Any]) -> dict[str, Any]:
  """`ZeroConfig`'s fields: ``base``'s, with ``changes`` (a policy may be a mapping of its
  fields) and then flat keywords laid over them. A short spelling (``remat='full'``,
  ``loss_scale=0``) joins the flat keywords, so it keeps the policy's other fields and
  ``remat='offload'`` with ``remat_offload_names`` is checked as one setting."""
  given, flat = dict(base), dict(flat)
  for name, value in changes.items():
    if (name in ("remat", "gather") and isinstance(value, str)) or (
        name == "loss_scale" and value is not None
        and not isinstance(value, (LossScale, Mapping))):
      flat[name] = value
    elif name in policies.POLICIES:
      given[name] = _policy_from_dict(name, value)
    else:
      given[name] = value
  if not flat:
    return given
  return _from_flat({**_to_flat(given), **flat})


def _from_flat(flat: Mapping[str, Any]) -> dict[str, Any]:
  """`ZeroConfig`'s fields from flat keywords, checked by the flat rules first so an error
  names the keyword as it was written."""
  v = validation.FlatView(**flat)
  problem = validation.first_problem(v)
  if problem is not None:
    _fail(*problem)
  of = lambda cls: cls(**{attr: getattr(v, flat) for attr, flat in cls._FLAT.items()})
  if v.optimizer_on_nvme:
    offload = of(NvmeOffload)
  elif v.offload_optimizer or v.offload_params:
    offload = of(HostOffload)
  else:
    offload = None
  return {
      "stage": v.stage, "mesh_shape": v.mesh_shape, "mesh_axes": v.mesh_axes,
      "precision": of(Precision), "offload": offload, "remat": of(Remat), "gather": of(Gather),
      "quantize": of(Quantize) if v.quantized else None, "batch": of(Batch),
      "loss_scale": of(LossScale) if v.loss_scale is not None else None,
      "gradient_clipping": v.gradient_clipping, "nonfinite_grads": v.nonfinite_grads,
      "rules": v.rules}


def _deprecation(flat: Mapping[str, Any]) -> str:
  """The warning for flat keywords: each, and the policy field that replaces it."""
  def new(k: str) -> str:
    if k == "offload_optimizer":
      return "offload=HostOffload() or NvmeOffload(path)"
    name, cls, attr = _SECTIONS[k]
    return f"{name}={cls.__name__}({attr}=...)"
  moved = [k for k in sorted(flat) if k in _SECTIONS]
  return ("ZeroConfig's flat keywords are deprecated and will be removed in the next release: "
          + ", ".join(f"{k} -> {new(k)}" for k in moved))


def _flat_property(name: str) -> property:
  def get(self: ZeroConfig) -> Any:
    return self._flat[name]
  field, cls, attr = _SECTIONS[name]
  return property(get, doc=f"``{field}.{attr}`` (`{cls.__name__}`), or its default when "
                  f"``{field}`` is not that policy: the flat spelling of zerojax 0.1.")


for _name in validation.FLAT_DEFAULTS:
  if _name not in _FIELDS:
    setattr(ZeroConfig, _name, _flat_property(_name))


def _batch_fail(t, m, g, dp) -> None:
  raise ConfigError(
      f"inconsistent batch sizes: train_batch_size={t}, micro_batch_per_device={m}, "
      f"gradient_accumulation_steps={g}, data-parallel size={dp}; the rule is "
      "train_batch_size = micro_batch_per_device × gradient_accumulation_steps × data-parallel "
      "size")
