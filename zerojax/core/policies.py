"""The typed sections of a `ZeroConfig`: small frozen policies that validate themselves.

A config is a stage plus these policies, FSDP2-style: ``Precision`` for dtypes, ``HostOffload``
or ``NvmeOffload`` for where the optimizer state (and stage-3 parameters) live, ``Remat``,
``Gather``, ``Quantize`` (ZeRO++), ``Batch`` and ``LossScale``. Each one checks its own fields
when constructed, with the same rules as the flat spelling (`zerojax.core.validation`), and
names itself in the error: ``Precision.compute='fp8' is invalid: ...``. Rules that join a
policy to the stage (offload needs stage >= 1, quantised gathers need stage 3) are checked by
`ZeroConfig`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar, Mapping

from zerojax.core import validation
from zerojax.core.errors import ConfigError

__all__ = ["Precision", "HostOffload", "NvmeOffload", "Offload", "Remat", "Gather", "Quantize",
           "Batch", "LossScale", "POLICIES", "OPTIONAL"]


class _Policy:
  """Shared behaviour: ``_FLAT`` maps each field to its flat `ZeroConfig` keyword, and the
  flat rules check the fields (with the stage at 3, so only the policy's own rules apply)."""

  _FLAT: ClassVar[Mapping[str, str]] = {}
  _FIXED: ClassVar[Mapping[str, Any]] = {}  # flat keywords this policy implies

  def __post_init__(self) -> None:
    for f in dataclasses.fields(self):  # lists from JSON/YAML: keep the policy hashable
      if isinstance(getattr(self, f.name), list):
        object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
    view = validation.FlatView(**self.flat())
    problem = validation.first_problem(view)
    if problem is None:
      problem = self._own_problem()
    if problem is not None:
      field = {v: k for k, v in self._FLAT.items()}.get(problem.field, problem.field)
      raise ConfigError(f"{type(self).__name__}.{field}={problem.value!r} is invalid: "
                        f"{problem.allowed}", field=f"{type(self).__name__}.{field}",
                        value=problem.value, allowed=problem.allowed)
    for attr, flat in self._FLAT.items():  # the flat rules normalise (np.bool_ -> bool, ...)
      object.__setattr__(self, attr, getattr(view, flat))

  def _own_problem(self) -> validation.Problem | None:
    return None

  def flat(self) -> dict[str, Any]:
    """The policy as flat `ZeroConfig` keywords (``{'compute_dtype': 'bfloat16', ...}``)."""
    return {**self._FIXED, **{flat: getattr(self, attr) for attr, flat in self._FLAT.items()}}


@dataclasses.dataclass(frozen=True)
class Precision(_Policy):
  """The dtypes of a run.

  Attributes:
    param: dtype of the master parameters and the optimizer state.
    compute: dtype the model computes in; a parameter is cast to it where it is gathered.
    reduce: dtype of the gradient reduction; ``None`` keeps the gradient's dtype.
  """

  param: str = "float32"
  compute: str = "float32"
  reduce: str | None = None

  _FLAT = {"param": "param_dtype", "compute": "compute_dtype", "reduce": "reduce_dtype"}


@dataclasses.dataclass(frozen=True)
class HostOffload(_Policy):
  """ZeRO-Offload: state in ``pinned_host`` memory.

  Attributes:
    optimizer: keep the optimizer state on the host (stages 1-3).
    params: keep stage-3 parameters on the host.
    update_on_host: run the optimizer update on the host (needs ``optimizer``).
    fallback: a backend without ``pinned_host`` memory: ``'error'`` or ``'warn'`` (warn and
      keep the state on device).
  """

  optimizer: bool = True
  params: bool = False
  update_on_host: bool = False
  fallback: str = "error"

  _FLAT = {"optimizer": "offload_optimizer", "params": "offload_params",
           "update_on_host": "optimizer_on_host", "fallback": "offload_fallback"}

  def _own_problem(self) -> validation.Problem | None:
    if not (self.optimizer or self.params):
      return validation.Problem("optimizer", False, "HostOffload moves nothing with optimizer="
                                "False and params=False; set one, or use offload=None")
    return None


@dataclasses.dataclass(frozen=True)
class NvmeOffload(_Policy):
  """ZeRO-Infinity: the optimizer state in files on a local disk, streamed through the host.

  Attributes:
    path: directory of the optimizer-state files.
    chunk_size: parameters per chunk of the streamed update (DeepSpeed's ``sub_group_size``).
    buffer_count: chunk buffers held in host memory.
    pipeline_read: read the next chunks while the current one updates.
    pipeline_write: write updated chunks in the background.
  """

  path: str | os.PathLike
  chunk_size: int = 1 << 22
  buffer_count: int = 4
  pipeline_read: bool = True
  pipeline_write: bool = True

  _FLAT = {"path": "nvme_path", "chunk_size": "nvme_chunk_size",
           "buffer_count": "nvme_buffer_count", "pipeline_read": "nvme_pipeline_read",
           "pipeline_write": "nvme_pipeline_write"}
  _FIXED = {"offload_optimizer": validation.NVME}


Offload = HostOffload | NvmeOffload


@dataclasses.dataclass(frozen=True)
class Remat(_Policy):
  """Rematerialisation of the model's layers.

  Attributes:
    policy: ``'auto'`` (zerojax's choice per compiler), ``'none'``, ``'full'``, ``'dots'`` or
      ``'offload'`` (the residuals named in ``offload_names`` go to host memory).
    offload_names: ``checkpoint_name`` names offloaded by ``policy='offload'``.
  """

  policy: str = "auto"
  offload_names: tuple[str, ...] = ()

  _FLAT = {"policy": "remat", "offload_names": "remat_offload_names"}


@dataclasses.dataclass(frozen=True)
class Gather(_Policy):
  """How a sharded parameter reaches the layer that uses it.

  Attributes:
    mode: ``'auto'`` (XLA's partitioner inserts the collectives; zerojax gathers per use where
      that is better) or ``'explicit'`` (zerojax gathers each parameter per use).
    max_live_layers: stage 3, scanned layers: gathered layers alive at once, 1 or 2 (one
      ahead); ``None``: the backend's (`zerojax.Backend`).
    persistence_threshold: leaves with fewer elements stay replicated (DeepSpeed's
      ``stage3_param_persistence_threshold``); ``None``: the backend's.
  """

  mode: str = "auto"
  max_live_layers: int | None = None
  persistence_threshold: int | None = None

  _FLAT = {"mode": "gather", "max_live_layers": "max_live_layers",
           "persistence_threshold": "param_persistence_threshold"}


@dataclasses.dataclass(frozen=True)
class Quantize(_Policy):
  """ZeRO++ quantised collectives (at least one of ``weights`` and ``gradients``).

  Attributes:
    weights: qwZ, stage 3: ``'int8'`` or ``'int4'`` parameter all-gathers.
    gradients: qgZ, stages 2-3: ``'int8'`` or ``'int4'`` gradient reductions.
    weights_backward: whether the backward pass's re-gather is quantised too; ``None``:
      whenever ``weights`` is set.
    block_size: elements per scale of both quantisations (even).
  """

  weights: str | None = None
  gradients: str | None = None
  weights_backward: bool | None = None
  block_size: int = 256

  _FLAT = {"weights": "quantize_weights", "gradients": "quantize_gradients",
           "weights_backward": "quantize_weights_backward", "block_size": "quantize_block_size"}

  def _own_problem(self) -> validation.Problem | None:
    if self.weights is None and self.gradients is None:
      return validation.Problem("weights", None, "Quantize needs weights or gradients (one of "
                                f"{validation.QUANTIZED_DTYPES}); use quantize=None for none")
    return None


@dataclasses.dataclass(frozen=True)
class Batch(_Policy):
  """Batch sizes, DeepSpeed's rule: ``global_size = micro_per_device × accumulation_steps ×
  data-parallel size``; any two fix the third.

  Attributes:
    global_size: the global batch per optimizer step (``train_batch_size``).
    micro_per_device: batch per device per micro-step.
    accumulation_steps: micro-steps per optimizer step.
  """

  global_size: int | None = None
  micro_per_device: int | None = None
  accumulation_steps: int | None = None

  _FLAT = {"global_size": "train_batch_size", "micro_per_device": "micro_batch_per_device",
           "accumulation_steps": "gradient_accumulation_steps"}


@dataclasses.dataclass(frozen=True)
class LossScale(_Policy):
  """fp16 loss scaling.

  Attributes:
    scale: ``0`` (dynamic) or a positive static scale.
    initial_scale_power: dynamic scaling starts at ``2**initial_scale_power``.
    window: good steps before the scale doubles.
    hysteresis: overflowing steps tolerated before the scale halves.
    min_scale: the scale never falls below this.
  """

  scale: float = 0.0
  initial_scale_power: int = 16
  window: int = 1000
  hysteresis: int = 2
  min_scale: float = 1.0

  _FLAT = {"scale": "loss_scale", "initial_scale_power": "initial_scale_power",
           "window": "loss_scale_window", "hysteresis": "hysteresis",
           "min_scale": "min_loss_scale"}

  @property
  def dynamic(self) -> bool:
    """Whether the scale adapts (``scale == 0``)."""
    return self.scale == 0


# ZeroConfig section -> the policy classes it accepts.
POLICIES: dict[str, tuple[type, ...]] = {
    "precision": (Precision,), "offload": (HostOffload, NvmeOffload), "remat": (Remat,),
    "gather": (Gather,), "quantize": (Quantize,), "batch": (Batch,), "loss_scale": (LossScale,)}
OPTIONAL = ("offload", "quantize", "loss_scale")  # sections whose None means off
