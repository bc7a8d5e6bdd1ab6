"""What each `ZeroConfig` setting allows, checked one topic at a time.

Each ``check_*`` function reads a config in its flat spelling (`FlatView`: one keyword per
setting, as DeepSpeed files and command-line overrides write it) and returns the first
`Problem` it finds (the field, its value and what is allowed), or ``None``; `first_problem`
runs them in a fixed order, so the first bad field found is the one reported. `ZeroConfig` and
each policy (`zerojax.core.policies`) raise it as a `ConfigError` at construction. Two checks also normalise what they accept: a boolean field to ``bool``,
``offload_optimizer=' NVMe '`` to ``'nvme'``, ``nvme_path`` to a string.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Callable, NamedTuple

import numpy as np

# The checks read a `FlatView`.
Config = Any

__all__ = ["STAGES", "MESH_AXES", "DTYPES", "REMAT_POLICIES", "GATHER_MODES", "QUANTIZED_DTYPES",
           "OFFLOAD_FALLBACKS", "NONFINITE_POLICIES", "NVME", "BOOL_FIELDS", "OPTIONAL_BOOL_FIELDS",
           "FLAT_DEFAULTS", "FlatView", "Problem", "first_problem"]

STAGES = (0, 1, 2, 3)
MESH_AXES = ("replica", "fsdp", "tensor")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("auto", "none", "full", "dots", "offload")
GATHER_MODES = ("auto", "explicit")
OFFLOAD_FALLBACKS = ("error", "warn")
NONFINITE_POLICIES = ("auto", "skip", "halt", "ignore")
NVME = "nvme"  # offload_optimizer's one string value: the state in files (ZeRO-Infinity)
QUANTIZED_DTYPES = ("int8", "int4")

# Fields that must hold a real bool: a string such as "false" is truthy in Python.
BOOL_FIELDS = ("offload_optimizer", "offload_params", "optimizer_on_host",
               "quantize_weights_backward", "nvme_pipeline_read", "nvme_pipeline_write")
# Boolean fields whose None means a default resolved elsewhere (a `ZeroConfig` property).
OPTIONAL_BOOL_FIELDS = {"quantize_weights_backward": "null (the same as quantize_weights)"}


# The flat spelling of a config, one keyword per setting, and its defaults: what DeepSpeed
# files, command-line overrides and the old `ZeroConfig` keywords use. The checks below read it.
FLAT_DEFAULTS: dict[str, Any] = {
    "stage": 3, "mesh_shape": (-1,), "mesh_axes": ("fsdp",), "param_persistence_threshold": None,
    "param_dtype": "float32", "compute_dtype": "float32", "reduce_dtype": None,
    "offload_optimizer": False, "offload_params": False, "offload_fallback": "error",
    "optimizer_on_host": False, "nvme_path": None, "nvme_chunk_size": 1 << 22,
    "nvme_buffer_count": 4, "nvme_pipeline_read": True, "nvme_pipeline_write": True,
    "remat": "auto", "remat_offload_names": (), "gather": "auto", "max_live_layers": None,
    "quantize_weights": None, "quantize_weights_backward": None, "quantize_gradients": None,
    "quantize_block_size": 256, "train_batch_size": None, "micro_batch_per_device": None,
    "gradient_accumulation_steps": None, "gradient_clipping": None, "loss_scale": None,
    "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
    "min_loss_scale": 1.0, "nonfinite_grads": "auto", "rules": ()}


class FlatView:
  """A config in its flat spelling (`FLAT_DEFAULTS` for what is not given), as the checks
  read it; the checks normalise some values in place."""

  def __init__(self, **flat: Any):
    self.__dict__.update(FLAT_DEFAULTS)
    self.__dict__.update(flat)
    # Sequences arrive as lists from JSON/YAML; tuples keep a config hashable.
    for k in ("mesh_shape", "mesh_axes", "remat_offload_names"):
      if isinstance(getattr(self, k), list):
        setattr(self, k, tuple(getattr(self, k)))
    if isinstance(self.rules, (list, tuple)):
      self.rules = tuple((r[0], tuple(r[1]) if isinstance(r[1], (list, tuple)) else r[1])
                         if isinstance(r, (list, tuple)) and len(r) == 2 else r
                         for r in self.rules)

  shards_opt_state = property(lambda self: self.stage >= 1)
  shards_grads = property(lambda self: self.stage >= 2)
  shards_params = property(lambda self: self.stage == 3)
  optimizer_on_nvme = property(lambda self: self.offload_optimizer == NVME)
  quantized = property(lambda self: self.quantize_weights is not None
                       or self.quantize_gradients is not None)


class Problem(NamedTuple):
  """A bad field: its name, its value, and what is allowed (the end of the error message)."""

  field: str
  value: Any
  allowed: str


def first_problem(c: Config) -> Problem | None:
  """The first `Problem` of ``c``, checking topic by topic in `CHECKS` order; ``None`` if
  every field is allowed."""
  for check in CHECKS:
    problem = check(c)
    if problem is not None:
      return problem
  return None


def check_bools(c: Config) -> Problem | None:
  """Boolean fields hold real booleans (``offload_optimizer`` may also be ``'nvme'``)."""
  for f in BOOL_FIELDS:
    if f == "offload_optimizer" and isinstance(c.offload_optimizer, str) and (
        c.offload_optimizer.strip().lower() == NVME):
      c.offload_optimizer = NVME
      continue
    if getattr(c, f) is None and f in OPTIONAL_BOOL_FIELDS:
      continue
    if not isinstance(getattr(c, f), (bool, np.bool_)):
      extra = (f", or {NVME!r} (the optimizer state in files under nvme_path)"
               if f == "offload_optimizer" else
               f", or {OPTIONAL_BOOL_FIELDS[f]}" if f in OPTIONAL_BOOL_FIELDS else "")
      return Problem(f, getattr(c, f), "true or false (a boolean; strings such as 'false' or "
                     f"'no' are not booleans){extra}")
    setattr(c, f, bool(getattr(c, f)))


def check_mesh(c: Config) -> Problem | None:
  """The stage, the mesh's axes and its shape."""
  if not _is_int(c.stage) or c.stage not in STAGES:
    return Problem("stage", c.stage, "allowed stages are 0, 1, 2 and 3")
  if not isinstance(c.mesh_axes, tuple) or not c.mesh_axes:
    return Problem("mesh_axes", c.mesh_axes, f"a non-empty list of names from {MESH_AXES}")
  for a in c.mesh_axes:
    if a not in MESH_AXES:
      return Problem("mesh_axes", c.mesh_axes,
                     f"axis {a!r} is unknown; allowed axes are {MESH_AXES}")
  if len(set(c.mesh_axes)) != len(c.mesh_axes):
    return Problem("mesh_axes", c.mesh_axes, "axis names must be unique")
  if "fsdp" not in c.mesh_axes:
    return Problem("mesh_axes", c.mesh_axes,
                   "must contain 'fsdp', the axis the stages shard over")
  if not isinstance(c.mesh_shape, tuple) or len(c.mesh_shape) != len(c.mesh_axes):
    return Problem("mesh_shape", c.mesh_shape,
                   f"needs one size per axis of mesh_axes={c.mesh_axes}")
  for s in c.mesh_shape:
    if not _is_int(s) or (s < 1 and s != -1):
      return Problem("mesh_shape", c.mesh_shape, "sizes must be positive integers, or -1 "
                     "(once) for 'all remaining devices'")
  if sum(1 for s in c.mesh_shape if s == -1) > 1:
    return Problem("mesh_shape", c.mesh_shape, "at most one size may be -1")


def check_dtypes(c: Config) -> Problem | None:
  """The persistence threshold and the parameter, compute and reduction dtypes."""
  if c.param_persistence_threshold is not None and (
      not _is_int(c.param_persistence_threshold) or c.param_persistence_threshold < 0):
    return Problem("param_persistence_threshold", c.param_persistence_threshold,
                   "a number of elements >= 0")
  for f in ("param_dtype", "compute_dtype"):
    if getattr(c, f) not in DTYPES:
      return Problem(f, getattr(c, f), f"allowed dtypes are {DTYPES}")
  if c.reduce_dtype is not None and c.reduce_dtype not in DTYPES:
    return Problem("reduce_dtype", c.reduce_dtype, f"None or one of {DTYPES}")


def check_offload(c: Config) -> Problem | None:
  """Host offload: each setting needs the stage that shards what it moves."""
  if c.offload_fallback not in OFFLOAD_FALLBACKS:
    return Problem("offload_fallback", c.offload_fallback, f"one of {OFFLOAD_FALLBACKS}")
  if c.offload_optimizer and not c.shards_opt_state:
    return Problem("offload_optimizer", c.offload_optimizer, "needs stage >= 1: at stage 0 "
                   "every device keeps a full optimizer state, so offload would copy it to every "
                   "host; use stage 1 or higher")
  if c.offload_params and not c.shards_params:
    return Problem("offload_params", True, f"needs stage 3 (stage is {c.stage}): below stage 3 "
                   "the parameters are replicated and used whole by every layer on every device")
  if c.optimizer_on_host and c.offload_optimizer is not True:
    return Problem("optimizer_on_host", True, "needs offload_optimizer=True" + (
        " (with offload_optimizer='nvme' the update always runs on the host)"
        if c.optimizer_on_nvme else ""))


def check_remat(c: Config) -> Problem | None:
  """Rematerialisation, gather mode and live layers."""
  if c.remat not in REMAT_POLICIES:
    return Problem("remat", c.remat, f"allowed policies are {REMAT_POLICIES}")
  if c.gather not in GATHER_MODES:
    return Problem("gather", c.gather, f"allowed modes are {GATHER_MODES}")
  if c.remat == "offload" and not c.remat_offload_names:
    return Problem("remat_offload_names", c.remat_offload_names,
                   "remat='offload' needs the checkpoint_name names of the residuals to offload")
  if c.max_live_layers is not None and (not _is_int(c.max_live_layers)
                                        or c.max_live_layers < 1):
    return Problem("max_live_layers", c.max_live_layers,
                   "an integer >= 1, or null (2 on TPU and GPU, 1 on CPU)")


def check_quantize(c: Config) -> Problem | None:
  """ZeRO++ quantisation: dtypes, the stages it needs, and what it cannot combine with."""
  for f in ("quantize_weights", "quantize_gradients"):
    if getattr(c, f) is not None and getattr(c, f) not in QUANTIZED_DTYPES:
      return Problem(f, getattr(c, f), f"None (off) or one of {QUANTIZED_DTYPES}")
  if c.quantize_weights is not None and not c.shards_params:
    return Problem("quantize_weights", c.quantize_weights, f"needs stage 3 (stage is "
                   f"{c.stage}): below stage 3 the parameters are replicated and never gathered")
  if c.quantize_gradients is not None and not c.shards_grads:
    return Problem("quantize_gradients", c.quantize_gradients, f"needs stage 2 or 3 (stage is "
                   f"{c.stage}): below stage 2 the gradient is all-reduced, not reduce-scattered")
  if c.quantize_weights_backward is True and c.quantize_weights is None:
    return Problem("quantize_weights_backward", True, f"needs quantize_weights (one of "
                   f"{QUANTIZED_DTYPES}): there is no quantised gather to re-gather; leave it "
                   "None (the default: the same as quantize_weights) or set it to False")
  if not _is_int(c.quantize_block_size) or c.quantize_block_size < 2 or (
      c.quantize_block_size % 2):
    return Problem("quantize_block_size", c.quantize_block_size, "an even integer >= 2")
  if c.quantized and c.offload_params:
    return Problem("offload_params", True, "cannot be combined with quantize_weights/"
                   "quantize_gradients: the quantised formulation gathers from device memory")
  if c.quantized and "tensor" in c.mesh_axes and (
      c.mesh_shape[c.mesh_axes.index("tensor")] != 1):
    return Problem("mesh_axes", c.mesh_axes, "a 'tensor' axis larger than 1 cannot be combined "
                   "with quantize_weights/quantize_gradients: the quantised formulation runs the "
                   "model per device over the data axes ('replica', 'fsdp')")


def check_batch(c: Config) -> Problem | None:
  """Batch sizes and gradient clipping."""
  for f in ("train_batch_size", "micro_batch_per_device", "gradient_accumulation_steps"):
    v = getattr(c, f)
    if v is not None and (not _is_int(v) or v < 1):
      return Problem(f, v, "a positive integer or None")
  if c.gradient_clipping is not None and not (
      _is_num(c.gradient_clipping) and c.gradient_clipping > 0):
    return Problem("gradient_clipping", c.gradient_clipping,
                   "a positive finite number or None")


def check_loss_scale(c: Config) -> Problem | None:
  """fp16 loss scaling and the non-finite gradient policy it constrains."""
  if c.loss_scale is not None and not (_is_num(c.loss_scale) and c.loss_scale >= 0):
    return Problem("loss_scale", c.loss_scale, "None (off), 0 (dynamic) or a positive finite "
                   "static scale")
  if not _is_int(c.initial_scale_power) or not 0 <= c.initial_scale_power <= 64:
    return Problem("initial_scale_power", c.initial_scale_power, "an integer in [0, 64]")
  for f in ("loss_scale_window", "hysteresis"):
    if not _is_int(getattr(c, f)) or getattr(c, f) < 1:
      return Problem(f, getattr(c, f), "an integer >= 1")
  if not _is_num(c.min_loss_scale) or c.min_loss_scale <= 0:
    return Problem("min_loss_scale", c.min_loss_scale, "a positive finite number")
  if c.nonfinite_grads not in NONFINITE_POLICIES:
    return Problem("nonfinite_grads", c.nonfinite_grads, f"one of {NONFINITE_POLICIES}")
  if c.loss_scale is not None and c.nonfinite_grads not in ("auto", "skip"):
    return Problem("nonfinite_grads", c.nonfinite_grads, f"with loss scaling (loss_scale="
                   f"{c.loss_scale!r}) an overflowing step is always skipped and the scale "
                   "adjusted; use 'skip', or loss_scale=None")


def check_rules(c: Config) -> Problem | None:
  """User partitioning rules: ``(regex, partition_spec)`` pairs whose regexes compile."""
  for i, r in enumerate(c.rules):
    if not (isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str)):
      return Problem("rules", c.rules, "a list of (regex, partition_spec) pairs")
    try:
      re.compile(r[0])
    except re.error as e:
      return Problem(f"rules[{i}]", r, f"the regex {r[0]!r} does not compile ({e}); rules "
                     "are (regex, partition_spec) pairs matched with re.search against leaf paths "
                     "such as 'params/layers/mlp/kernel'")


def check_nvme(c: Config) -> Problem | None:
  """``nvme_path`` and the NVMe pool's sizes (``offload_optimizer='nvme'``)."""
  if not c.optimizer_on_nvme:
    if c.nvme_path is not None:
      return Problem("nvme_path", c.nvme_path, "only used with offload_optimizer='nvme' "
                     f"(offload_optimizer is {c.offload_optimizer!r}); set both, or drop "
                     "nvme_path")
  else:
    if not isinstance(c.nvme_path, (str, os.PathLike)) or not os.fspath(c.nvme_path):
      return Problem("nvme_path", c.nvme_path, "offload_optimizer='nvme' needs the directory "
                     "of the optimizer-state files (a path string on a local disk, e.g. "
                     "'/local_nvme')")
    c.nvme_path = os.fspath(c.nvme_path)
    if c.offload_params:
      return Problem("offload_params", True, "cannot be combined with offload_optimizer="
                     "'nvme': the NVMe update returns parameter shards to device memory; keep the "
                     "parameters on the devices (stage 3 shards them)")
  if not _is_int(c.nvme_chunk_size) or c.nvme_chunk_size < 1:
    return Problem("nvme_chunk_size", c.nvme_chunk_size, "a number of parameters >= 1")
  if not _is_int(c.nvme_buffer_count) or c.nvme_buffer_count < 1:
    return Problem("nvme_buffer_count", c.nvme_buffer_count, "an integer >= 1 (3 or more let "
                   "reading, updating and writing overlap)")


CHECKS: tuple[Callable[[Config], Problem | None], ...] = (
    check_bools, check_nvme, check_mesh, check_dtypes, check_offload, check_remat,
    check_quantize, check_batch, check_loss_scale, check_rules)


def _is_int(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
  """A finite real number (NaN and infinity are refused: they pass or fail comparisons
  silently)."""
  return (isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
          and math.isfinite(x))
