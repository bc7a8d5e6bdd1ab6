"""DeepSpeed ``ds_config.json`` -> `ZeroConfig`, XLA flags and notes.

A DeepSpeed config maps onto zerojax in three ways:

* **settings** with a zerojax equivalent become `ZeroConfig`'s stage and policies, section by
  section (``bf16``/``fp16`` a `Precision`, ``offload_optimizer`` a `HostOffload` or
  `NvmeOffload`, the persistence threshold a `Gather`, the batch sizes a `Batch`, ...);
* **keys whose job XLA does** become XLA flags: the bucket sizes become XLA's collective
  combine thresholds on GPU and ``overlap_comm`` becomes the latency-hiding scheduler;
  `DeepSpeedMapping.xla_flags` lists them and `DeepSpeedMapping.apply_xla_flags` adds them to
  ``XLA_FLAGS`` (which must happen before JAX initialises its backend);
* **keys with no XLA meaning** (``contiguous_gradients``, ...) are accepted, each with a
  one-line note in `DeepSpeedMapping.notes`.

An unknown key is an error that names it; an unsupported device (``offload_param`` on
``nvme``) is an error that says what to use instead. ``offload_optimizer`` on ``nvme`` maps to
`NvmeOffload` (`zerojax.runtime.nvme`).
``"auto"`` values (as written by the Hugging Face Trainer
integration) mean what they mean there: the run's own setting where it gives one, else the
Trainer's ``TrainingArguments`` default (`TRAINER_DEFAULTS`); `map_deepspeed` resolves each and
says where it came from, or lists it as unresolved.

Training-loop settings DeepSpeed keeps in the same file (``optimizer``, ``scheduler``,
``steps_per_print``, ``tensorboard``) are returned in `DeepSpeedMapping.train` for
`zerojax.tools.train`. A top-level ``"zerojax"`` mapping may hold `ZeroConfig` fields DeepSpeed has no
key for (e.g. ``mesh_shape``, ``remat``); they are applied last.

Example::

  m = zerojax.tools.deepspeed.map_deepspeed(json.load(open("ds_config.json")))
  m.apply_xla_flags()        # before the first JAX computation
  print(m.summary())
  config = m.config          # a ZeroConfig; zerojax.load_config("ds_config.json") gives the same
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any, Mapping

from zerojax.core import validation
from zerojax.core.policies import POLICIES
from zerojax.core.config import (ConfigError, ZeroConfig, in_file, read_config_file, setting_of,
                                 unknown_key_error)
from zerojax.tools.bounds import TRAIN_BOUNDS
from zerojax.tools.options import SCHEDULERS, TrainOptions, check_scheduler

__all__ = ["RS_COMBINE", "AG_COMBINE", "AR_COMBINE", "LHS", "TOP_LEVEL_KEYS", "TRAINER_DEFAULTS",
           "DeepSpeedMapping", "from_deepspeed", "load_deepspeed", "is_deepspeed",
           "map_deepspeed"]

# XLA flag names (GPU backend; accepted and ignored by the CPU backend).
RS_COMBINE = "--xla_gpu_reduce_scatter_combine_threshold_bytes"
AG_COMBINE = "--xla_gpu_all_gather_combine_threshold_bytes"
AR_COMBINE = "--xla_gpu_all_reduce_combine_threshold_bytes"
LHS = "--xla_gpu_enable_latency_hiding_scheduler"

_DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
                "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class DeepSpeedMapping:
  """The result of mapping a DeepSpeed config.

  Attributes:
    config: the `ZeroConfig`.
    xla_flags: XLA flags that do the job of DeepSpeed keys, e.g.
      ``('--xla_gpu_enable_latency_hiding_scheduler=true', ...)``.
    notes: one line per key: what it became, or why it needs nothing.
    train: training-loop settings (``optimizer``, ``scheduler``, ``log_every``,
      ``tensorboard_dir``) for `zerojax.tools.train`.
    auto: ``{key: value}`` for every ``"auto"`` resolved from the run's settings (``None``:
      left to a zerojax setting the note names, e.g. the run's batch); `notes` says where
      each came from.
    unresolved: ``{key: how to set it}`` for every ``"auto"`` nothing gave a value;
      `require_resolved` refuses them (a training run calls it).
  """

  config: ZeroConfig
  xla_flags: tuple[str, ...] = ()
  notes: tuple[str, ...] = ()
  train: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  auto: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  unresolved: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def require_resolved(self) -> None:
    """Refuses ``"auto"`` values nothing resolved: a run must not start on values nobody chose.

    Raises:
      ConfigError: naming every ``"auto"`` key nothing gave a value, and how to set each.
    """
    if self.unresolved:
      raise ConfigError(
          f"DeepSpeed config: {len(self.unresolved)} 'auto' value(s) the run gives no value "
          "for (\"auto\" means the run's own setting):\n" + "\n".join(
              f"  {k}: {how}" for k, how in self.unresolved.items()))

  def apply_xla_flags(self, environ: "os._Environ | dict | None" = None) -> list[str]:
    """Appends `xla_flags` to ``XLA_FLAGS`` (flags the user already set win).

    Call it before JAX initialises its backend; afterwards XLA has already read ``XLA_FLAGS``
    and the flags have no effect (a warning says so).

    Args:
      environ: the environment to change; None: ``os.environ``, and a warning where the JAX
        backend has already started.

    Returns:
      The flags actually added.
    """
    env = os.environ if environ is None else environ
    current = env.get("XLA_FLAGS", "")
    present = {f.split("=")[0] for f in current.split()}
    added = [f for f in self.xla_flags if f.split("=")[0] not in present]
    if added:
      env["XLA_FLAGS"] = (current + " " + " ".join(added)).strip()
      if environ is None:
        from zerojax._compat import backends_initialized  # lazy: JAX, unneeded by --help
        if backends_initialized():
          warnings.warn("zerojax: XLA_FLAGS changed after the JAX backend started; the DeepSpeed "
                        f"flags {added} take effect in the next process only")
    return added

  def summary(self) -> str:
    """A human-readable account of what was set.

    Returns:
      Lines of text: the stage, the XLA flags set and the notes.
    """
    lines = [f"DeepSpeed config -> ZeroConfig(stage={self.config.stage}, ...)"]
    if self.xla_flags:
      lines.append("XLA flags set:")
      lines += [f"  {f}" for f in self.xla_flags]
    if self.notes:
      lines.append("notes:")
      lines += [f"  {n}" for n in self.notes]
    return "\n".join(lines)


def from_deepspeed(d: Mapping[str, Any], given: Mapping[str, Any] | None = None) -> ZeroConfig:
  """The `ZeroConfig` of a DeepSpeed config dict (`map_deepspeed` gives flags and notes too).

  Args:
    d: the DeepSpeed config.
    given: the settings the run was given, for ``"auto"`` values (see `map_deepspeed`).

  Returns:
    The `ZeroConfig`.

  Raises:
    ConfigError: as `map_deepspeed`, and for an ``"auto"`` nothing resolves
      (`DeepSpeedMapping.require_resolved`).
  """
  m = map_deepspeed(d, given)
  m.require_resolved()
  return m.config


def load_deepspeed(path: str | os.PathLike) -> DeepSpeedMapping:
  """`map_deepspeed` of a ``.json`` (or ``.yaml``) DeepSpeed config file.

  Args:
    path: the file.

  Returns:
    Its `DeepSpeedMapping`.

  Raises:
    FileNotFoundError: the file does not exist.
    ConfigError: naming the file, when the reader refuses it
      (`zerojax.core.config.read_config_file`) or `map_deepspeed` does.
  """
  d = read_config_file(path)
  with in_file(path):
    return map_deepspeed(d)


def is_deepspeed(d: Mapping[str, Any]) -> bool:
  """Whether a config dict is in DeepSpeed format.

  Args:
    d: the config, any value.

  Returns:
    True where ``d`` is a mapping with ``zero_optimization``.
  """
  return isinstance(d, Mapping) and "zero_optimization" in d


# -- the mapping ------------------------------------------------------------------------------

_TOP_IGNORED = {
    "wall_clock_breakdown": "timing breakdown is not collected; use jax.profiler for traces",
    "zero_allow_untested_optimizer": "any optax optimizer is sharded by the plan; nothing to allow",
    "zero_force_ds_cpu_optimizer": "offloaded optimizer state is updated by XLA; no DeepSpeed CPU "
                                   "Adam is involved",
    "prescale_gradients": "XLA's reduce computes the mean gradient; no prescaling is needed",
    "gradient_predivide_factor": "XLA's reduce computes the mean gradient; no predivision is "
                                 "needed",
    "sparse_gradients": "JAX gradients are dense arrays",
    "memory_breakdown": "use `zerojax estimate` and zerojax.runtime.memory.measure for memory numbers",
    "dump_state": "use `zerojax plan` to print the sharding of every leaf",
    "flops_profiler": "use jax.profiler for FLOP/time profiles",
    "wandb": "metrics go to JSONL and TensorBoard event files in the run directory",
    "csv_monitor": "metrics go to JSONL and TensorBoard event files in the run directory",
    "comms_logger": "collective volumes per step: zerojax.runtime.memory.measure(compiled).collectives",
    "activation_checkpointing": "activation checkpointing is ZeroConfig.remat ('full', 'dots', "
                                "'offload'); set it under the \"zerojax\" key",
    "seed": "the run seed is a training option (seed=...)",
    "aio": "libaio settings: zerojax's NVMe offload streams with threads and a buffer pool "
           "(offload_optimizer.buffer_count, pipeline_read/pipeline_write)",
}

_ZERO_IGNORED = {
    "contiguous_gradients": "XLA allocates gradient buffers itself; there is no fragmentation to "
                            "avoid",
    "allgather_partitions": "stage 3 all-gathers each layer's shards with one XLA all-gather",
    "reduce_scatter": "stages 2-3 reduce-scatter gradients per layer; stage 1 reduce-scatters "
                      "each device's local gradient once after the backward pass; stage 0 "
                      "all-reduces",
    "round_robin_gradients": "XLA places reduced gradient shards; no round-robin is needed",
    "sub_group_size": "the optimizer update is one XLA computation over the local shards "
                      "(with offload_optimizer on nvme: the chunk size, offload.chunk_size)",
    "elastic_checkpoint": "checkpoints are saved sharded and restore onto any mesh",
    "load_from_fp32_weights": "master weights are kept in param_dtype and restored from it",
    "ignore_unused_parameters": "unused parameters get zero gradients in JAX",
    "stage3_max_reuse_distance": "whether a gathered weight is kept for backward is decided by "
                                 "the stage-3 remat policy (re-gathered, never cached)",
    "stage3_gather_16bit_weights_on_model_save": "use `zerojax export` for consolidated weights",
    "stage3_gather_fp16_weights_on_model_save": "use `zerojax export` for consolidated weights",
    "memory_efficient_linear": "XLA fuses linear layers itself",
    "use_multi_rank_bucket_allreduce": "XLA combines collectives itself (see combine thresholds)",
    "log_trace_cache_warnings": "no trace cache: the step is compiled once by XLA",
}

_OFFLOAD_KEYS = {"device", "pin_memory", "buffer_count", "fast_init", "pipeline",
                 "pipeline_read", "pipeline_write", "nvme_path", "ratio", "buffer_size",
                 "max_in_cpu"}
_FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
              "hysteresis", "consecutive_hysteresis", "min_loss_scale",
              "fp16_master_weights_and_grads"}
_BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow",
              "bf16_master_weights_and_grads", "bf16_optimizer_states"}
_TOP_KEYS = ({"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps", "gradient_clipping", "bf16", "bfloat16", "fp16",
              "communication_data_type", "optimizer", "scheduler", "steps_per_print",
              "tensorboard", "zerojax"} | set(_TOP_IGNORED))
TOP_LEVEL_KEYS = frozenset(_TOP_KEYS)  # every top-level key a DeepSpeed config may have here
_ZERO_KEYS = ({"stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params",
               "stage3_param_persistence_threshold", "stage3_max_live_parameters",
               "stage3_prefetch_bucket_size", "prefetch_bucket_size", "reduce_bucket_size",
               "allgather_bucket_size", "overlap_comm", "zero_hpz_partition_size",
               "mics_shard_size", "zero_quantized_weights", "zero_quantized_gradients",
               "zero_quantized_nontrainable_weights", "param_persistence_threshold",
               "max_live_parameters", "max_reuse_distance"} | set(_ZERO_IGNORED))


def _auto(v: Any) -> bool:
  return isinstance(v, str) and v.strip().lower() == "auto"


def _err(key: str, value: Any, allowed: str) -> ConfigError:
  return ConfigError(f"DeepSpeed config key {key!r}={value!r} is invalid: {allowed}")


def _unknown(section: str, keys: set, known: set) -> None:
  unknown = set(keys) - set(known)
  if unknown:
    raise unknown_key_error("unknown DeepSpeed config key", unknown, known,
                            f" in {section!r}" if section else "", "zerojax accepts")


def _real(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(key: str, v: Any) -> int:
  if not _real(v) or int(v) != v:
    raise _err(key, v, "an integer" + (" (NaN and infinity are not numbers of anything)"
                                       if isinstance(v, float) and not math.isfinite(v) else ""))
  return int(v)


def _num(key: str, v: Any) -> float:
  if not _real(v):
    raise _err(key, v, "a finite number")
  return v


def _section(d: Mapping, key: str, full: str | None = None) -> Mapping:
  """``d[key]`` as a mapping: missing or null is ``{}``, any other non-mapping an error
  (``[]`` or ``false`` would otherwise read as an empty section)."""
  v = d.get(key)
  if v is None:
    return {}
  if not isinstance(v, Mapping):
    raise _err(full or key, v, "a mapping (JSON object)")
  return v


def _bool(key: str, v: Any) -> bool:
  if not isinstance(v, bool):
    raise _err(key, v, "true or false")
  return v


@dataclasses.dataclass
class _Mapped:
  """What `map_deepspeed` builds up, section by section.

  ``config`` holds `ZeroConfig` fields as `ZeroConfig.from_dict` reads them, each policy a
  mapping of its own fields (``{'stage': 3, 'precision': {'compute': 'bfloat16'}}``): each
  DeepSpeed section fills the policy it corresponds to. ``source`` names the DeepSpeed key
  behind each setting, and its value in the file, so that a value `ZeroConfig` refuses is
  reported by the key the user wrote."""

  config: dict[str, Any] = dataclasses.field(default_factory=dict)
  source: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)
  flags: dict[str, str] = dataclasses.field(default_factory=dict)  # XLA flags
  train: dict[str, Any] = dataclasses.field(default_factory=dict)  # training-loop options
  notes: list[str] = dataclasses.field(default_factory=list)

  def set(self, setting: str, value: Any, key: str | None = None, raw: Any = None) -> None:
    """Sets ``setting`` (``'stage'``, or ``'policy.field'`` such as ``'offload.params'``) to
    ``value``; ``key`` is the DeepSpeed key that gave it, ``raw`` that key's value in the
    file (``None`` key: a value the section implies, not one the file wrote)."""
    name, _, attr = setting.partition(".")
    if attr:
      self.config.setdefault(name, {})[attr] = value
    else:
      self.config[name] = value
    if key is not None:
      self.source[setting] = (key, raw)

  def get(self, setting: str) -> Any:
    """The value set for ``setting``, or ``None``."""
    name, _, attr = setting.partition(".")
    value = self.config.get(name)
    return value.get(attr) if attr and isinstance(value, Mapping) else value

  def note(self, key: str, text: str) -> None:
    self.notes.append(f"{key}: {text}")


def map_deepspeed(d: Mapping[str, Any],
                  given: Mapping[str, Any] | None = None) -> DeepSpeedMapping:
  """Maps a DeepSpeed config dict to a `DeepSpeedMapping` (config, XLA flags, notes).

  Each DeepSpeed section becomes the policy it corresponds to: ``bf16``/``fp16`` and
  ``communication_data_type`` a `Precision` (and ``fp16``'s loss scaling a `LossScale`),
  ``offload_optimizer``/``offload_param`` a `HostOffload` or `NvmeOffload`, the persistence
  threshold and prefetch bucket a `Gather`, ZeRO++'s quantised collectives a `Quantize`, the
  batch sizes a `Batch`.

  ``"auto"`` values (Hugging Face Trainer configs) mean "from the trainer's arguments": they
  are resolved from ``given`` (the run's own settings: training options such as
  ``lr``, ``steps``, ``batch``, ``warmup_steps``, ``b1``; `ZeroConfig` fields such as
  ``compute_dtype``, ``gradient_clipping``), and from `TrainOptions`' defaults where those are
  the run's own (the optimizer's betas, eps and weight decay, ``warmup_steps``, ``steps``,
  ``batch``). A note per key says what was chosen and why; what nothing resolves is listed in
  `DeepSpeedMapping.unresolved` (the learning rate, precision and clipping have no default).

  Args:
    d: the DeepSpeed config.
    given: the settings the run was given, by `TrainOptions` or `ZeroConfig` field name.

  Returns:
    The `DeepSpeedMapping`.

  Raises:
    ConfigError: for an unknown key (named), an unsupported value such as ``device: nvme``
      (with what to use instead), or a value the resulting `ZeroConfig` rejects (named by the
      DeepSpeed key that set it).
  """
  if not isinstance(d, Mapping):
    raise ConfigError(f"a DeepSpeed config must be a mapping, got {type(d).__name__}")
  _unknown("", set(d), _TOP_KEYS)
  d, auto = _resolve_auto(d, given or {})
  m = _Mapped()
  _map_batch(d, m)
  _map_precision(d, m)
  z = _section(d, "zero_optimization")
  _unknown("zero_optimization", set(z), _ZERO_KEYS)
  _map_partitioning(z, m)
  _map_collectives(z, m)
  _map_training(d, m)
  # zerojax extras: ZeroConfig fields DeepSpeed has no key for, applied last.
  extra = _section(d, "zerojax")
  _unknown("zerojax", set(extra), set(validation.FLAT_DEFAULTS) | set(POLICIES))
  return DeepSpeedMapping(_config(m, extra), tuple(f"{k}={v}" for k, v in m.flags.items()),
                          tuple(_auto_notes(auto) + m.notes), m.train,
                          {k: v for k, (v, _) in auto.chosen.items()}, dict(auto.unresolved))


def _config(m: _Mapped, extra: Mapping[str, Any]) -> ZeroConfig:
  """The `ZeroConfig` of the mapped sections with the ``"zerojax"`` section laid over them: a
  policy given there as a mapping (``{'offload': {'kind': 'nvme', ...}}``) replaces the one
  DeepSpeed's sections built, a flat keyword changes one field of it. A value `ZeroConfig`
  refuses is reported by the key that set it."""
  for k, v in extra.items():
    if k in POLICIES and (isinstance(v, Mapping) or v is None):
      for setting in [s for s in m.source if s.startswith(f"{k}.")]:
        del m.source[setting]
      for attr, value in (v or {}).items():
        m.source[f"{k}.{attr}"] = (f"zerojax.{k}.{attr}", value)
    else:
      m.source[setting_of(k)] = (f"zerojax.{k}", v)
  try:
    return ZeroConfig.from_dict({**m.config, **extra})
  except ConfigError as e:
    setting = setting_of(e.field) if e.field else None
    if setting not in m.source:
      raise ConfigError(f"DeepSpeed config maps to an invalid ZeroConfig: {e}") from None
    key, raw = m.source[setting]
    sets = "" if key == f"zerojax.{setting}" else f" (it sets ZeroConfig.{setting}={e.value!r})"
    raise ConfigError(f"DeepSpeed config key {key!r}={raw!r} is invalid: {e.allowed}{sets}",
                      field=key, value=raw, allowed=e.allowed) from None


def _map_batch(d: Mapping[str, Any], m: _Mapped) -> None:
  """Batch sizes (`Batch`) and gradient clipping."""
  for ds_key, setting in (("train_batch_size", "batch.global_size"),
                          ("train_micro_batch_size_per_gpu", "batch.micro_per_device"),
                          ("gradient_accumulation_steps", "batch.accumulation_steps")):
    if ds_key in d:
      if _auto(d[ds_key]):
        m.note(ds_key, "'auto': left unset (derived from the other batch sizes)")
      else:
        m.set(setting, _int(ds_key, d[ds_key]), ds_key, d[ds_key])
  if "gradient_clipping" in d:
    v = d["gradient_clipping"]
    if _auto(v):
      m.note("gradient_clipping", "'auto': no clipping")
    elif _num("gradient_clipping", v) > 0:
      m.set("gradient_clipping", float(v), "gradient_clipping", v)
    elif v == 0:
      m.note("gradient_clipping", "0 means no clipping")
    else:
      raise _err("gradient_clipping", v, "a number >= 0 (0 = no clipping)")


# fp16's loss-scaling keys -> (LossScale field, converter)
_FP16_SCALING = (("initial_scale_power", "initial_scale_power", _int),
                 ("loss_scale_window", "window", _int), ("hysteresis", "hysteresis", _int),
                 ("min_loss_scale", "min_scale", lambda key, v: float(_num(key, v))))


def _map_precision(d: Mapping[str, Any], m: _Mapped) -> None:
  """bf16 / fp16 and ``communication_data_type`` (`Precision`), and fp16's loss scaling
  (`LossScale`)."""
  note = m.note
  if "bf16" in d and "bfloat16" in d:
    raise ConfigError(f"DeepSpeed config sets both 'bf16'={d['bf16']!r} and "
                      f"'bfloat16'={d['bfloat16']!r}; they are aliases of one setting, give "
                      "only 'bf16'")
  bf16 = _section(d, "bf16" if "bf16" in d else "bfloat16")
  fp16 = _section(d, "fp16")
  for name, sect, known in (("bf16", bf16, _BF16_KEYS), ("fp16", fp16, _FP16_KEYS)):
    _unknown(name, set(sect), known)
  bf16_on = _enabled("bf16", bf16)
  fp16_on = _enabled("fp16", fp16)
  for name, sect in (("bf16", bf16), ("fp16", fp16)):
    if _auto(sect.get("enabled")):
      note(f"{name}.enabled", "'auto': off (float32); enable it explicitly to train in " + name)
  if bf16_on and fp16_on:
    raise ConfigError("DeepSpeed config enables both 'bf16' and 'fp16'; enable at most one")
  if bf16_on:
    m.set("precision.compute", "bfloat16", "bf16.enabled", True)
    note("bf16", "precision.compute='bfloat16'; master weights and optimizer state stay "
         "float32 (precision.param)")
    for k in sorted(set(bf16) - {"enabled"}):
      note(f"bf16.{k}", "XLA keeps float32 master weights and gradients reduce in "
           "precision.reduce; nothing to set")
  if fp16_on:
    m.set("precision.compute", "float16", "fp16.enabled", True)
    ls = fp16.get("loss_scale", 0)
    m.set("loss_scale.scale", 0.0 if _auto(ls) else float(_num("fp16.loss_scale", ls)),
          *(("fp16.loss_scale", ls) if "loss_scale" in fp16 else ()))
    for ds_key, attr, read in _FP16_SCALING:
      if ds_key in fp16 and not _auto(fp16[ds_key]):
        m.set(f"loss_scale.{attr}", read(f"fp16.{ds_key}", fp16[ds_key]), f"fp16.{ds_key}",
              fp16[ds_key])
    note("fp16", "precision.compute='float16' with " + (
        "dynamic loss scaling (LossScale)" if m.get("loss_scale.scale") == 0 else
        f"static loss scale {ls} (LossScale(scale={m.get('loss_scale.scale')}))"))
    for k in sorted(set(fp16) & {"auto_cast", "consecutive_hysteresis",
                                 "fp16_master_weights_and_grads"}):
      note(f"fp16.{k}", "not needed: the model casts to precision.compute and master weights "
           "stay in precision.param")
  if "communication_data_type" in d and d["communication_data_type"] is not None:
    v = d["communication_data_type"]
    if not isinstance(v, str) or v.lower() not in _DTYPE_NAMES:
      raise _err("communication_data_type", v, f"one of {sorted(_DTYPE_NAMES)}")
    m.set("precision.reduce", _DTYPE_NAMES[v.lower()], "communication_data_type", v)
    note("communication_data_type", f"precision.reduce={_DTYPE_NAMES[v.lower()]!r}")


def _map_partitioning(z: Mapping[str, Any], m: _Mapped) -> None:
  """``zero_optimization``: the stage, offload (`HostOffload` or `NvmeOffload`), and the
  persistence threshold and prefetch (`Gather`)."""
  note = m.note
  stage = z.get("stage", 0)
  if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
    raise _err("zero_optimization.stage", stage, "0, 1, 2 or 3")
  m.set("stage", int(stage), "zero_optimization.stage", stage)

  for key, attr in (("offload_optimizer", "optimizer"), ("offload_param", "params")):
    kind = _offload(z, key, m)
    if kind == "nvme":
      _map_nvme(z, m)
    elif kind == "host":
      _host(m, attr, f"zero_optimization.{key}", z[key])
  for key, attr in (("cpu_offload", "optimizer"), ("cpu_offload_params", "params")):
    if key in z and _bool(f"zero_optimization.{key}", z[key]):
      _host(m, attr, f"zero_optimization.{key}", z[key])
      note(f"zero_optimization.{key}", f"legacy key: offload.{attr}=True (HostOffload)")

  for key in ("stage3_param_persistence_threshold", "param_persistence_threshold"):
    if key in z and not _auto(z[key]):
      v = _int(f"zero_optimization.{key}", z[key])
      m.set("gather.persistence_threshold", v, f"zero_optimization.{key}", z[key])
      note(f"zero_optimization.{key}", f"gather.persistence_threshold={v} (leaves with fewer "
           "elements stay replicated)")
  for key in ("stage3_prefetch_bucket_size", "prefetch_bucket_size"):
    if key in z and not _auto(z[key]):
      v = _num(f"zero_optimization.{key}", z[key])
      m.set("gather.max_live_layers", 2 if v > 0 else 1, f"zero_optimization.{key}", z[key])
      note(f"zero_optimization.{key}", f"{v:g} -> gather.max_live_layers="
           f"{m.get('gather.max_live_layers')} (" + (
               "the next layer's gather may overlap the current layer)" if v > 0 else
               "no prefetch: each layer is gathered just before use)"))
  for key in ("stage3_max_live_parameters", "max_live_parameters"):
    if key in z:
      v = z[key] if _auto(z[key]) else _num(f"zero_optimization.{key}", z[key])
      note(f"zero_optimization.{key}",
           f"{v if _auto(v) else format(v, 'g')} is a parameter count; zerojax bounds "
           "gathered weights in whole layers (gather.max_live_layers), set by the prefetch "
           "bucket size")
  if "max_reuse_distance" in z:
    note("zero_optimization.max_reuse_distance", _ZERO_IGNORED["stage3_max_reuse_distance"])


def _host(m: _Mapped, attr: str, key: str, raw: Any) -> None:
  """``offload.<attr>`` on the host (`HostOffload`), from DeepSpeed's ``key``."""
  offload = m.config.get("offload")
  if offload is not None and offload["kind"] == "nvme":
    raise _err(key, raw, "cannot be combined with zero_optimization.offload_optimizer on "
               "nvme: the NVMe update returns parameter shards to device memory (NvmeOffload "
               "has no params); keep the parameters on the devices (stage 3 shards them)"
               if attr == "params" else "conflicts with zero_optimization.offload_optimizer "
               "on nvme; give one of them")
  if offload is None:  # a section that offloads only the parameters keeps the optimizer
    m.config["offload"] = {"kind": "host", "optimizer": False}
  m.set(f"offload.{attr}", True, key, raw)


def _map_collectives(z: Mapping[str, Any], m: _Mapped) -> None:
  """``zero_optimization`` keys whose job XLA does (combining, overlap), hpZ/MiCS groups,
  and ZeRO++'s quantised collectives (qwZ, qgZ)."""
  _map_combining(z, m)
  _map_groups(z, m)
  _map_quantized(z, m)
  for key, why in _ZERO_IGNORED.items():
    if key in z:
      m.note(f"zero_optimization.{key}", why)


def _map_combining(z: Mapping[str, Any], m: _Mapped) -> None:
  """Keys whose job XLA does: collective combining (bucket sizes) and overlap."""
  flags, note = m.flags, m.note
  grad_dtype = m.get("precision.reduce") or "float32"
  param_bytes = _BYTES["float32"]
  for key, targets, nbytes, what in (
      ("reduce_bucket_size", (RS_COMBINE, AR_COMBINE), _BYTES[grad_dtype],
       f"{grad_dtype} gradients"),
      ("allgather_bucket_size", (AG_COMBINE,), param_bytes, "float32 parameters")):
    if key in z:
      if _auto(z[key]):
        note(f"zero_optimization.{key}", "'auto': XLA's default combine threshold")
        continue
      v = _num(f"zero_optimization.{key}", z[key])
      if v <= 0:
        raise _err(f"zero_optimization.{key}", v, "a positive number of elements")
      b = int(v) * nbytes
      for t in targets:
        flags[t] = str(b)
      note(f"zero_optimization.{key}", f"{int(v):,} elements x {nbytes} bytes ({what}) -> "
           + ", ".join(f"{t}={b}" for t in targets))
  if "overlap_comm" in z:
    v = "true" if _bool("zero_optimization.overlap_comm", z["overlap_comm"]) else "false"
    flags[LHS] = v
    note("zero_optimization.overlap_comm", f"{LHS}={v} (XLA's latency-hiding scheduler "
         "overlaps collectives with compute)")


def _map_groups(z: Mapping[str, Any], m: _Mapped) -> None:
  """ZeRO++ hpZ / MiCS: shard within groups, replicate across groups = the replica x fsdp
  mesh."""
  for key in ("zero_hpz_partition_size", "mics_shard_size"):
    if key in z and not _auto(z[key]):
      v = _int(f"zero_optimization.{key}", z[key])
      if v > 1 or (key == "mics_shard_size" and v > 0):
        m.set("mesh_shape", (-1, v), f"zero_optimization.{key}", z[key])
        m.set("mesh_axes", ("replica", "fsdp"), f"zero_optimization.{key}", z[key])
        m.note(f"zero_optimization.{key}", f"{v} -> mesh_shape=[-1, {v}], mesh_axes=["
               "'replica', 'fsdp'] (shard within groups, data parallel across them)")
      else:
        m.note(f"zero_optimization.{key}", f"{v}: no hierarchical partitioning")


def _map_quantized(z: Mapping[str, Any], m: _Mapped) -> None:
  """ZeRO++ qwZ / qgZ: zerojax's own quantised collectives (`Quantize`)."""
  for key, attr, what in (
      ("zero_quantized_weights", "weights", "qwZ: each stage-3 parameter "
       "all-gather, the forward gather and the backward pass's re-gather as in DeepSpeed, "
       "moves int8 values plus a float32 scale per 256-element block, dequantised after the "
       "gather (quantize.weights_backward=false keeps the re-gather in full precision); master "
       "weights and the update stay in full precision"),
      ("zero_quantized_gradients", "gradients", "qgZ: each gradient is reduced by a "
       "quantised all-to-all (int8 per 256-element block) and summed in float32 on its owner, "
       "in place of the reduce-scatter")):
    if key in z:
      if _bool(f"zero_optimization.{key}", z[key]):
        m.set(f"quantize.{attr}", "int8", f"zero_optimization.{key}", z[key])
        m.note(f"zero_optimization.{key}", f"quantize.{attr}='int8' ({what}); the model then "
               "runs per device inside jax.shard_map")
      else:
        m.note(f"zero_optimization.{key}", "false: full-precision collectives")
  if "zero_quantized_nontrainable_weights" in z and _bool(
      "zero_optimization.zero_quantized_nontrainable_weights",
      z["zero_quantized_nontrainable_weights"]):
    raise _err("zero_optimization.zero_quantized_nontrainable_weights", True,
               "zerojax keeps frozen weights in their dtype at rest; set it to false (or remove "
               "it), and use zero_quantized_weights to quantise their all-gather")


def _map_training(d: Mapping[str, Any], m: _Mapped) -> None:
  """Optimizer, scheduler, logging and TensorBoard: training-loop options."""
  train, note = m.train, m.note
  if "optimizer" in d:
    train["optimizer"] = _optimizer(d["optimizer"])
    note("optimizer", f"-> optax.{train['optimizer']['name']} (training loop)")
  if "scheduler" in d:
    train["scheduler"] = _scheduler(d["scheduler"])
    note("scheduler", f"-> {train['scheduler']['name']} learning-rate schedule (training loop)")
  if "steps_per_print" in d:
    train["log_every"] = _int("steps_per_print", d["steps_per_print"])
    note("steps_per_print", f"log_every={train['log_every']} (metrics are fetched, logged and "
         "shown every log_every steps, at the first and at the last step)")
  if "tensorboard" in d:
    tb = _section(d, "tensorboard")
    _unknown("tensorboard", set(tb), {"enabled", "output_path", "job_name"})
    train["tensorboard"] = _bool("tensorboard.enabled", tb.get("enabled", False))
    if tb.get("output_path"):
      train["out_dir"] = os.path.join(tb["output_path"], tb.get("job_name", ""))
    note("tensorboard", "event files are written to the run directory (out_dir)")
  for key, why in _TOP_IGNORED.items():
    if key in d:
      note(key, why)


def _enabled(name: str, sect: Mapping) -> bool:
  v = sect.get("enabled", False)
  if _auto(v):
    return False
  return _bool(f"{name}.enabled", v)


def _offload(z: Mapping, key: str, m: _Mapped) -> str | None:
  """The offload kind an ``offload_optimizer``/``offload_param`` section asks for: ``'host'``
  (device cpu), ``'nvme'`` or ``None`` (no offload)."""
  full = f"zero_optimization.{key}"
  if key not in z or z[key] is None:
    return None
  sect = z[key]
  if not isinstance(sect, Mapping):
    raise _err(full, sect, "a mapping such as {\"device\": \"cpu\"}")
  _unknown(full, set(sect), _OFFLOAD_KEYS)
  raw = sect.get("device", "none")
  if not isinstance(raw, str):  # e.g. `device: false`: say what the strings are
    raise _err(f"{full}.device", raw, "\"cpu\" (offload to pinned host memory) or \"none\"")
  device = raw.strip().lower()
  if device == "auto":
    m.note(f"{full}.device", "'auto': not set, no offload")
    device = "none"
  if device == "nvme" and key == "offload_param":
    raise _err(f"{full}.device", sect.get("device"),
               "zerojax does not keep parameters on NVMe; use \"device\": \"cpu\" (pinned host "
               "memory) or \"none\" for the parameters, and put the optimizer state (the larger "
               "part: 12 bytes per parameter with Adam) on NVMe with offload_optimizer: "
               "{\"device\": \"nvme\", \"nvme_path\": ...} at stage 3")
  if device == "nvme":
    return "nvme"
  if device not in ("cpu", "none"):
    raise _err(f"{full}.device", sect.get("device"), "\"cpu\", \"nvme\" or \"none\"")
  if device == "none":
    return None
  attr = "optimizer" if key == "offload_optimizer" else "params"
  m.note(full, f"device cpu -> offload.{attr}=True (HostOffload: pinned_host memory)")
  for k in sorted(set(sect) - {"device"}):
    m.note(f"{full}.{k}", "XLA transfers between pinned host and device memory itself; "
           "nothing to set")
  return "host"


# offload_optimizer's NVMe keys -> the NvmeOffload fields each sets. The legacy "pipeline"
# sets both; an explicit pipeline_read/pipeline_write (later in the table) wins over it.
_NVME_PIPELINE = (("pipeline", ("pipeline_read", "pipeline_write"),
                   "legacy key: both pipeline_read and pipeline_write"),
                  ("pipeline_read", ("pipeline_read",),
                   "the next chunks are read while the current one updates"),
                  ("pipeline_write", ("pipeline_write",),
                   "updated chunks are written back in the background"))


def _map_nvme(z: Mapping, m: _Mapped) -> None:
  """``offload_optimizer: {device: nvme, ...}``: ZeRO-Infinity's optimizer state on disk
  (`NvmeOffload`)."""
  full, note = "zero_optimization.offload_optimizer", m.note
  sect = z["offload_optimizer"]
  if "nvme_path" not in sect or _auto(sect["nvme_path"]):
    raise _err(f"{full}.nvme_path", sect.get("nvme_path"), "device nvme needs nvme_path, the "
               "directory of the optimizer-state files (a local NVMe disk)")
  if not isinstance(sect["nvme_path"], str) or not sect["nvme_path"]:
    raise _err(f"{full}.nvme_path", sect["nvme_path"], "a directory path string")
  m.config["offload"] = {"kind": "nvme"}
  m.set("offload.path", sect["nvme_path"], f"{full}.nvme_path", sect["nvme_path"])
  note(full, f"device nvme -> offload=NvmeOffload(path={sect['nvme_path']!r}): the optimizer "
       f"state lives in files under '{sect['nvme_path']}/zerojax-nvme/process-<i>' and is "
       "streamed through a chunked optax update on each host (zerojax.runtime.nvme)")
  note(f"{full}.nvme_path", f"offload.path={sect['nvme_path']!r} (checked before step 1: "
       "exists, writable, room for the state plus one generation)")
  if "buffer_count" in sect and not _auto(sect["buffer_count"]):
    v = _int(f"{full}.buffer_count", sect["buffer_count"])
    m.set("offload.buffer_count", v, f"{full}.buffer_count", sect["buffer_count"])
    note(f"{full}.buffer_count", f"offload.buffer_count={v}: chunk buffers in the host pool "
         "(3 or more overlap read, update and write)")
  for key, attrs, what in _NVME_PIPELINE:
    if key in sect and not _auto(sect[key]):
      v = _bool(f"{full}.{key}", sect[key])
      for a in attrs:
        m.set(f"offload.{a}", v, f"{full}.{key}", sect[key])
      note(f"{full}.{key}", f"{str(v).lower()} -> "
           f"{' and '.join(f'offload.{a}={v}' for a in attrs)} ({what})")
  if "sub_group_size" in z and not _auto(z["sub_group_size"]):
    v = _int("zero_optimization.sub_group_size", z["sub_group_size"])
    m.set("offload.chunk_size", v, "zero_optimization.sub_group_size", z["sub_group_size"])
    note("zero_optimization.sub_group_size", f"offload.chunk_size={v}: parameters per "
         "streamed chunk of the NVMe update")
  for k in sorted(set(sect) - {"device", "nvme_path", "buffer_count", "pipeline_read",
                               "pipeline_write", "pipeline"}):
    note(f"{full}.{k}", "not used by the NVMe update (pinned buffers and ratios are "
         "DeepSpeed's CPU Adam's)")


_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd", "lamb": "lamb",
               "adagrad": "adagrad", "fusedadam": "adam", "cpuadam": "adam",
               "deepspeedcpuadam": "adam"}


def _optimizer(o: Any) -> dict:
  if not isinstance(o, Mapping) or "type" not in o:
    raise _err("optimizer", o, "a mapping with \"type\" and \"params\"")
  _unknown("optimizer", set(o), {"type", "params"})
  t = str(o["type"]).lower()
  if t not in _OPTIMIZERS:
    raise _err("optimizer.type", o["type"], f"one of {sorted(set(_OPTIMIZERS))}")
  params = dict(_section(o, "params", "optimizer.params"))
  name = _OPTIMIZERS[t]
  if name == "adam" and params.get("adam_w_mode", True) and t in ("adam", "fusedadam") and \
      params.get("weight_decay", 0):
    name = "adamw"  # DeepSpeed's Adam with weight decay defaults to AdamW mode
  params.pop("adam_w_mode", None)
  params.pop("torch_adam", None)
  out = {"name": name}
  for k, v in params.items():
    if k not in ("lr", "betas", "eps", "weight_decay", "momentum"):
      raise _err(f"optimizer.params.{k}", v, "zerojax maps lr, betas, eps, weight_decay, momentum")
    if _auto(v):
      continue
    if k == "betas":
      if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise _err("optimizer.params.betas", v, "a list of two numbers [beta1, beta2]")
      for i, (b, field) in enumerate(zip(v, ("b1", "b2"))):
        TRAIN_BOUNDS[field].check(f"optimizer.params.betas[{i}]", b)
    else:
      TRAIN_BOUNDS[k].check(f"optimizer.params.{k}", v)
    out[k] = v
  return out


def _scheduler(s: Any) -> dict:
  if not isinstance(s, Mapping) or "type" not in s:
    raise _err("scheduler", s, "a mapping with \"type\" and \"params\"")
  _unknown("scheduler", set(s), {"type", "params"})
  t = s["type"]
  if t not in SCHEDULERS:
    raise _err("scheduler.type", t, f"one of {sorted(SCHEDULERS)}")
  params = dict(_section(s, "params", "scheduler.params"))
  _unknown(f"scheduler.params ({t})", set(params), SCHEDULERS[t])
  given = {k: v for k, v in params.items() if not _auto(v)}
  check_scheduler(given)
  return {"name": t, **given}


# -- "auto" (Hugging Face Trainer configs) ----------------------------------------------------
#
# "auto" means "from the trainer's own arguments". zerojax's are the settings the run was given
# (training options such as lr, batch, warmup_steps, b1; ZeroConfig fields such as
# compute_dtype, gradient_clipping); where the run gives none, the Trainer's own default, as a
# config written for it would get. Each "auto" says which. The run's length (steps) is the
# run's own. What neither gives is listed in `DeepSpeedMapping.unresolved` with how to set it.

# The Hugging Face Trainer's `TrainingArguments` defaults, for the keys its DeepSpeed
# integration fills: {zerojax setting: (value, TrainingArguments field)}.
TRAINER_DEFAULTS: dict[str, tuple[Any, str]] = {
    "lr": (5e-5, "learning_rate"), "weight_decay": (0.0, "weight_decay"),
    "b1": (0.9, "adam_beta1"), "b2": (0.999, "adam_beta2"), "eps": (1e-8, "adam_epsilon"),
    "gradient_clipping": (1.0, "max_grad_norm"), "warmup_steps": (0, "warmup_steps"),
    "micro_batch_per_device": (8, "per_device_train_batch_size"),
    "gradient_accumulation_steps": (1, "gradient_accumulation_steps"),
    "bf16": (False, "bf16"), "fp16": (False, "fp16"), "lr_scheduler_type": ("linear", "lr_scheduler_type"),
}

_BATCH_KEYS = (("train_batch_size", "train_batch_size"),
               ("train_micro_batch_size_per_gpu", "micro_batch_per_device"),
               ("gradient_accumulation_steps", "gradient_accumulation_steps"))
_FP16_FIELDS = ("loss_scale", *(ds_key for ds_key, _, _ in _FP16_SCALING))
# DeepSpeed's defaults of its fp16 section (loss_scale 0: dynamic).
DEEPSPEED_FP16_DEFAULTS: dict[str, Any] = {"loss_scale": 0, "initial_scale_power": 16,
                                           "loss_scale_window": 1000, "hysteresis": 2,
                                           "min_loss_scale": 1}


@dataclasses.dataclass
class _AutoValues:
  """Resolves the "auto" values of one DeepSpeed config from what the run was given."""

  given: Mapping[str, Any]  # TrainOptions / ZeroConfig fields the run set itself
  defaults: Mapping[str, Any]  # TrainOptions' defaults
  chosen: dict[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)
  unresolved: dict[str, str] = dataclasses.field(default_factory=dict)

  def option(self, name: str) -> tuple[Any, str]:
    """A training option the Trainer has no argument for (``steps``, ``momentum``): the run's
    value and where it came from."""
    if name in self.given:
      return self.given[name], f"{name}={self.given[name]!r}, given"
    return self.defaults[name], (f"{name}={self.defaults[name]!r}, zerojax's default; set "
                                 f"{name}=... to change it")

  def trainer(self, name: str) -> tuple[Any, str]:
    """A setting the Trainer fills: the run's, else the Trainer's default (`TRAINER_DEFAULTS`)."""
    if name in self.given:
      return self.given[name], f"{name}={self.given[name]!r}, given"
    v, field = TRAINER_DEFAULTS[name]
    return v, f"auto: Trainer default {field}={v!r}; set {name}=... to change it"

  def lr(self, d: Mapping[str, Any]) -> tuple[Any, str]:
    """The peak learning rate: ``lr`` given to the run, else the optimizer's own number, else
    the Trainer's ``learning_rate``."""
    if "lr" in self.given:
      return self.given["lr"], f"lr={self.given['lr']!r}, given"
    o = d.get("optimizer")
    v = o.get("params", {}).get("lr") if isinstance(o, Mapping) and isinstance(
        o.get("params"), Mapping) else None
    if _real(v):
      return v, "optimizer.params.lr in the file"
    return self.trainer("lr")


def _resolve_auto(d: Mapping[str, Any], given: Mapping[str, Any]) -> tuple[dict, _AutoValues]:
  """``d`` with every "auto" it knows replaced by the run's value (or removed, where zerojax's
  own setting applies), and the record of what was chosen and what could not be."""
  a = _AutoValues(given, {f.name: f.default for f in dataclasses.fields(TrainOptions)})
  d = dict(d)
  for resolve in (_auto_batch, _auto_clipping, _auto_precision, _auto_fp16,
                  _auto_hyperparameters, _auto_zero_sizes):
    resolve(d, a)  # each replaces its "auto" values in d and records them in a
  return d, a


def _auto_batch(d: dict, a: _AutoValues) -> None:
  """Batch sizes: the run's batch option, or what the numeric ones imply."""
  given = a.given
  numeric = [k for k, _ in _BATCH_KEYS if k in d and not _auto(d[k])]
  for ds_key, field in _BATCH_KEYS:
    if not _auto(d.get(ds_key)):
      continue
    del d[ds_key]
    if field in given:
      d[ds_key] = given[field]
      a.chosen[ds_key] = (given[field], f"{field}={given[field]!r}, given")
    elif numeric:
      a.chosen[ds_key] = (None, "derived from " + ", ".join(f"{k}={d[k]}" for k in numeric)
                          + " (train = micro x accumulation x data-parallel devices)")
    elif field == "gradient_accumulation_steps":
      v, why = a.trainer(field)
      d[ds_key] = v
      a.chosen[ds_key] = (v, why)
    elif "batch" in given:  # the run's global batch (zerojax's batch=)
      rows = given["batch"]
      a.chosen[ds_key] = ((rows, f"the run's global batch: batch={rows!r}, given")
                          if field == "train_batch_size" else
                          (None, f"the run's global batch over the data-parallel devices "
                                 f"(batch={rows!r}, given)"))
    elif field == "micro_batch_per_device":
      v, why = a.trainer(field)
      d[ds_key] = v
      a.chosen[ds_key] = (v, why)
    else:
      a.chosen[ds_key] = (None, "derived as the Trainer does: train_micro_batch_size_per_gpu x "
                          "gradient_accumulation_steps x data-parallel devices")


def _auto_clipping(d: dict, a: _AutoValues) -> None:
  """gradient_clipping: the run's, else the Trainer's max_grad_norm."""
  given = a.given
  if _auto(d.get("gradient_clipping")):
    if "gradient_clipping" in given:
      d["gradient_clipping"] = given["gradient_clipping"] or 0
      a.chosen["gradient_clipping"] = (given["gradient_clipping"],
                                       f"gradient_clipping={given['gradient_clipping']!r}, given")
    else:
      v, why = a.trainer("gradient_clipping")
      d["gradient_clipping"] = v
      a.chosen["gradient_clipping"] = (v, why)


def _auto_precision(d: dict, a: _AutoValues) -> None:
  """Precision: the compute_dtype the run was given, else the Trainer's (neither bf16 nor
  fp16: float32)."""
  given = a.given
  cd = given.get("compute_dtype")
  names = [n for n in ("bf16", "bfloat16", "fp16") if isinstance(d.get(n), Mapping)]
  explicit = {n for n in names if d[n].get("enabled") is True}
  for name in names:
    if not _auto(d[name].get("enabled")):
      continue
    dtype = "float16" if name == "fp16" else "bfloat16"
    key, sect = f"{name}.enabled", dict(d[name])
    d[name] = sect
    if cd is not None:
      sect["enabled"] = cd == dtype
      a.chosen[key] = (sect["enabled"], f"compute_dtype={cd!r}, given")
    elif explicit - {name}:
      sect["enabled"] = False
      a.chosen[key] = (False, f"{sorted(explicit - {name})[0]} is enabled")
    else:
      v, field = TRAINER_DEFAULTS[name if name == "fp16" else "bf16"]
      sect["enabled"] = v
      a.chosen[key] = (v, f"auto: Trainer default {field}={v!r}; set compute_dtype=bfloat16 "
                          "(bf16) or float16 (fp16) to change it")


def _auto_fp16(d: dict, a: _AutoValues) -> None:
  """fp16 loss-scaling settings: the run's, when fp16 is on."""
  given = a.given
  fp16 = d.get("fp16")
  if isinstance(fp16, Mapping):
    fp16 = d["fp16"] = dict(fp16)
    on = fp16.get("enabled") is True
    for k in _FP16_FIELDS:
      if not _auto(fp16.get(k)):
        continue
      del fp16[k]
      if not on:
        a.chosen[f"fp16.{k}"] = (None, "not used: fp16 is off")
      elif k in given:
        fp16[k] = given[k]
        a.chosen[f"fp16.{k}"] = (given[k], f"{k}={given[k]!r}, given")
      else:
        # The Trainer fills none of these; DeepSpeed's own default is what "auto" gets there.
        fp16[k] = DEEPSPEED_FP16_DEFAULTS[k]
        a.chosen[f"fp16.{k}"] = (fp16[k], f"auto: DeepSpeed default fp16.{k}={fp16[k]!r}; "
                                          f"set {k}=... to change it")


def _auto_hyperparameters(d: dict, a: _AutoValues) -> None:
  """The optimizer's hyperparameters and the schedule: the training options."""
  def optimizer_value(k):
    if k == "lr":
      return a.lr({})  # the optimizer's own lr is the "auto" one
    if k == "betas":
      (b1, w1), (b2, w2) = a.trainer("b1"), a.trainer("b2")
      if "b1" in a.given or "b2" in a.given:
        return [b1, b2], f"{w1}; {w2}"
      return [b1, b2], (f"auto: Trainer default adam_beta1={b1!r}, adam_beta2={b2!r}; set "
                        "b1=... b2=... to change them")
    if k in ("eps", "weight_decay"):
      return a.trainer(k)
    if k == "momentum":
      return a.option(k)
    return None  # not a key zerojax maps: the mapping names it

  def scheduler_value(k):
    if k == "warmup_min_lr":
      return 0.0, "auto: the Trainer's 0 (its schedules start from 0)"
    if k == "warmup_max_lr":  # the optimizer's learning rate, whatever gave it
      return a.chosen.get("optimizer.params.lr") or a.lr(d)
    if k == "warmup_num_steps":
      return a.trainer("warmup_steps")
    if k == "total_num_steps":
      return a.option("steps")
    return None, "zerojax has no training option for it: write the value in the file"

  for section, value in (("optimizer", optimizer_value), ("scheduler", scheduler_value)):
    sec = d.get(section)
    if not (isinstance(sec, Mapping) and isinstance(sec.get("params"), Mapping)):
      continue
    params = dict(sec["params"])
    for k in [k for k, v in params.items() if _auto(v)]:
      got = value(k)
      if got is None:
        continue
      v, why = got
      if v is None:
        del params[k]
        a.unresolved[f"{section}.params.{k}"] = why
      else:
        params[k] = v
        a.chosen[f"{section}.params.{k}"] = (v, why)
    d[section] = {**sec, "params": params}


def _auto_zero_sizes(d: dict, a: _AutoValues) -> None:
  """zero_optimization sizes the Trainer derives from the model's hidden size: zerojax's own."""
  given = a.given
  z = d.get("zero_optimization")
  if isinstance(z, Mapping):
    z = d["zero_optimization"] = dict(z)
    for ds_key, field, default in (
        ("stage3_param_persistence_threshold", "param_persistence_threshold",
         "zerojax's default for the formulation (0 elements where XLA's partitioner places "
         "the gathers, 4096 where zerojax gathers each parameter)"),
        ("param_persistence_threshold", "param_persistence_threshold",
         "zerojax's default for the formulation (0 or 4096 elements)"),
        ("stage3_prefetch_bucket_size", "max_live_layers",
         "zerojax's default max_live_layers=null (2 on GPU: the next layer gathered beside the "
         "current one; 1 on TPU and CPU)"),
        ("prefetch_bucket_size", "max_live_layers",
         "zerojax's default max_live_layers=null (2 on GPU, 1 on TPU and CPU)"),
        ("zero_hpz_partition_size", "mesh_shape", "no hierarchical partitioning (the mesh "
         "as configured)"),
        ("mics_shard_size", "mesh_shape", "no hierarchical partitioning (the mesh as "
         "configured)")):
      if not _auto(z.get(ds_key)):
        continue
      del z[ds_key]
      key = f"zero_optimization.{ds_key}"
      if field in given:
        a.chosen[key] = (given[field], f"{field}={given[field]!r}, given")
      else:
        a.chosen[key] = (None, f"{default}; set {field}=... to change it")


def _auto_notes(a: _AutoValues) -> list[str]:
  """One line per "auto": the value chosen and where it came from, or how to set it."""
  out = []
  for key, (v, why) in a.chosen.items():
    out.append(f"{key}: 'auto' -> " + (f"{v!r} ({why})" if v is not None else why))
  for key, how in a.unresolved.items():
    out.append(f"{key}: 'auto' is not resolved (the run sets nothing it could come from): "
               f"{how}")
  return out
