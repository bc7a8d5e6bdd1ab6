"""Model-state bytes per device, and whether a step or a train state fits the device.

`paper_bytes` is the ZeRO paper's formula (Rajbhandari et al. 2019) for Ψ parameters on N
data-parallel devices with mixed-precision Adam (K = 12 optimizer bytes per parameter):
(2 + 2 + K) Ψ at stage 0, 2Ψ + 2Ψ + KΨ/N at stage 1, 2Ψ + (2 + K) Ψ/N at stage 2 and
(2 + 2 + K) Ψ/N at stage 3. `estimate` generalises it to real trees: it sums the leaves of the
parameter tree and of the optimizer state (any optax transformation, any dtypes), each divided
by the number of devices its plan shards it over; only shapes are needed, on an
``AbstractMesh`` of any size. `check_fits` and `check_state_fits` refuse a compiled step or a
train state that exceeds the devices' memory, naming the next stage or offload that fits.
`zerojax.runtime.memory` re-exports all of it beside its measurement of compiled steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from flax.core import meta
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from zerojax.core.config import HostOffload, ZeroConfig
from zerojax.core.dtypes import cast_shapes
from zerojax.core.mesh import mesh_shape
from zerojax.core.plan import ShardingPlan

__all__ = ["PAPER_K", "paper_bytes", "Estimate", "num_params", "estimate", "DeviceMemoryError",
           "bytes_limit", "compiled_peak", "check_fits", "check_state_fits",
           "suggest_option"]

PAPER_K = 12


def paper_bytes(num_params: float, stage: int, num_devices: int, k: int = PAPER_K) -> float:
  """Bytes of model state per device from the ZeRO paper (mixed-precision Adam).

  Args:
    num_params: Ψ, the number of parameters.
    stage: the ZeRO stage, 0 to 3.
    num_devices: N, the number of data-parallel devices.
    k: optimizer-state bytes per parameter (12 for mixed-precision Adam).

  Returns:
    The bytes per device, from the formula in this module's docstring.

  Raises:
    ValueError: ``stage`` is not 0-3, ``num_devices`` is not a positive integer, or
      ``num_params`` is negative.
  """
  _check_args(stage=stage, num_devices=num_devices)
  if not num_params >= 0:
    raise ValueError(f"num_params={num_params!r} is invalid: a number of parameters >= 0")
  psi, n = float(num_params), num_devices
  return {0: (2 + 2 + k) * psi,
          1: 2 * psi + 2 * psi + k * psi / n,
          2: 2 * psi + (2 + k) * psi / n,
          3: (2 + 2 + k) * psi / n}[stage]


def _check_args(stage: Any = None, num_devices: Any = None) -> None:
  if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
    raise ValueError(f"stage={stage!r} is invalid: allowed stages are 0, 1, 2 and 3")
  if num_devices is not None and (isinstance(num_devices, bool) or
                                  not isinstance(num_devices, (int, np.integer)) or
                                  num_devices < 1):
    raise ValueError(f"num_devices={num_devices!r} is invalid: a positive integer")


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Analytic per-device bytes of one stage (device- and host-resident).

  Attributes:
    stage: the ZeRO stage estimated.
    num_devices: the devices of the mesh planned on.
    params: device-resident parameter bytes per device.
    grads: gradient bytes per device.
    opt_state: device-resident optimizer-state bytes per device.
    params_host: host-resident (offloaded) parameter bytes per device.
    opt_state_host: host-resident (offloaded) optimizer-state bytes per device.
    frozen: paths of frozen leaves (no gradient, no optimizer state).
  """

  stage: int
  num_devices: int
  params: int
  grads: int
  opt_state: int
  params_host: int = 0
  opt_state_host: int = 0
  frozen: tuple[str, ...] = ()  # paths of frozen leaves (no gradient, no optimizer state)

  @property
  def persistent(self) -> int:
    """Device-resident bytes that live across steps: parameters and optimizer state."""
    return self.params + self.opt_state

  @property
  def total(self) -> int:
    """Device-resident model state: parameters, gradients and optimizer state."""
    return self.params + self.grads + self.opt_state

  @property
  def host(self) -> int:
    """Host-resident model state: offloaded parameters and optimizer state."""
    return self.params_host + self.opt_state_host


def num_params(tree: Any) -> int:
  """Parameters (elements) in a tree of arrays, ``ShapeDtypeStruct`` objects or Flax-boxed leaves.

  The one count zerojax prints: run headers, ``zerojax plan``/``estimate`` and
  `ShardingPlan.table` all count the leaves of the real tree.

  Args:
    tree: a pytree of arrays, ``jax.ShapeDtypeStruct`` or Flax-boxed leaves.

  Returns:
    The total number of elements.
  """
  return sum(math.prod(np.shape(x)) for x in jax.tree.leaves(meta.unbox(tree)))


def estimate(params: Any, tx: Any = None, *, config: ZeroConfig | None = None,
             stage: int | None = None, num_devices: int | None = None,
             opt_state: Any = None, mesh: Any = None,
             trainable: Any = None) -> Estimate:
  """Per-device bytes of params, grads and optimizer state for one stage.

  Args:
    params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``).
    tx: the optax transformation (its state shapes come from ``eval_shape``).
    config: a `ZeroConfig` (defaults to one with ``stage``). When given, floating parameters
      are counted in ``config.param_dtype`` (the dtype `create_train_state` stores them in),
      and the optimizer state in whatever dtypes ``tx`` derives from those.
    stage: overrides ``config.stage``.
    num_devices: size of the ``fsdp`` axis to plan for (devices need not exist).
    opt_state: the optimizer state or its shapes, instead of ``tx``.
    mesh: a mesh to plan on instead of an abstract ``(num_devices,)`` fsdp mesh.
    trainable: ``path -> bool``: frozen leaves count no gradient (give ``tx``/``opt_state``
      for the trained leaves only, e.g. ``optax.masked``); `Estimate.frozen` lists them.

  Returns:
    The `Estimate` for the stage.

  Raises:
    ValueError: ``stage`` is not 0-3, or ``num_devices`` is not a positive integer.
    ConfigError: the mesh shape does not fit ``num_devices``, or the plan cannot be made.
  """
  if config is not None:
    # `create_train_state` stores floating parameters in config.param_dtype: count that.
    params = cast_shapes(params, np.dtype(config.param_dtype))
  _check_args(stage=stage, num_devices=num_devices)
  config = config or ZeroConfig(stage=stage if stage is not None else 3)
  if stage is not None and stage != config.stage:
    config = config.replace(stage=stage)
  if mesh is None:
    n = num_devices if num_devices is not None else jax.device_count()
    shape = config.mesh_shape
    if len(shape) == 1 or -1 in shape:
      shape = tuple(-1 if a == "fsdp" else (1 if s == -1 else s)
                    for a, s in zip(config.mesh_axes, shape))
      if -1 in config.mesh_shape and config.mesh_shape[config.mesh_axes.index("fsdp")] != -1:
        shape = config.mesh_shape
    shape = mesh_shape(shape, config.mesh_axes, n) if -1 in shape else shape
    mesh = AbstractMesh(tuple(shape), config.mesh_axes,
                        axis_types=(AxisType.Auto,) * len(shape))
  plan = ShardingPlan.create(config, mesh, params, tx=tx, opt_state=opt_state,
                             trainable=trainable)
  b = plan.bytes_per_device()
  return Estimate(config.stage, math.prod(mesh.shape.values()), b["params"], b["grads"],
                  b["opt_state"], b["params_host"], b["opt_state_host"],
                  tuple(lp.path for lp in plan.leaves if not lp.trainable))


# -- measurement ------------------------------------------------------------------------------



# -- checking against the device's memory ------------------------------------------------------


class DeviceMemoryError(RuntimeError):
  """A compiled step, or a train state, needs more memory per device than the device has.

  Raised before anything is allocated; the message gives the numbers and the next stage or
  offload that would fit.
  """


def bytes_limit(devices: Any) -> int | None:
  """The devices' memory limit: the smallest ``memory_stats()['bytes_limit']``.

  Args:
    devices: an iterable of ``jax.Device``.

  Returns:
    The limit in bytes, or ``None`` where the backend reports none (CPU reports no memory
    stats).
  """
  limits = []
  for d in devices:
    try:
      stats = d.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats raise or return None
      stats = None
    if stats and stats.get("bytes_limit"):
      limits.append(int(stats["bytes_limit"]))
  return min(limits) if limits else None


def compiled_peak(compiled: Any, host_resident: int = 0) -> tuple[int, str]:
  """A compiled computation's device-memory peak per device, from XLA's memory analysis.

  The peak is arguments + outputs - aliased (donated) + temporaries. Host-offloaded buffers
  reported in the ``host_*`` fields are not counted; where every ``host_*`` field is 0 (the
  backend counts host arguments as ordinary ones, see ``docs/design.md``), ``host_resident`` is
  subtracted instead.

  Args:
    compiled: a ``jax.stages.Compiled``.
    host_resident: the state's host-resident bytes per device (e.g. from
      `ShardingPlan.bytes_per_device`), subtracted where the backend reports no ``host_*``
      bytes.

  Returns:
    ``(bytes, breakdown)``: the peak in bytes and a one-line breakdown of its parts.
  """
  ma = compiled.memory_analysis()
  a, o, al, t = (int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
                 int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes))
  host_fields = (ma.host_argument_size_in_bytes, ma.host_output_size_in_bytes,
                 ma.host_alias_size_in_bytes, ma.host_temp_size_in_bytes)
  h = int(host_resident) if not any(host_fields) else 0
  parts = (f"arguments {_mib(a)} + outputs {_mib(o)} - aliased {_mib(al)} + temporaries "
           f"{_mib(t)}" + (f" - host-resident state {_mib(h)}" if h else ""))
  return a + o - al + t - h, parts


def check_fits(compiled: Any, devices: Any, *, limit: int | None = None,
               config: ZeroConfig | None = None, params: Any = None, tx: Any = None,
               opt_state: Any = None) -> int | None:
  """Fails if a compiled step's peak per device exceeds the devices' memory limit.

  Args:
    compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``: nothing is
      allocated to get it).
    devices: the devices it runs on (their ``memory_stats()['bytes_limit']`` is the limit).
    limit: the limit in bytes per device instead of the devices' own.
    config: the run's config; with ``params`` and ``tx`` (or ``opt_state``) the error names
      the next stage or offload that would fit.
    params: the run's parameter tree.
    tx: the run's optax transformation.
    opt_state: the run's optimizer state (or its shapes), instead of ``tx``.

  Returns:
    the peak in bytes, or ``None`` when no limit is known (then nothing is checked).

  Raises:
    DeviceMemoryError: the peak exceeds the limit.
  """
  limit = bytes_limit(devices) if limit is None else int(limit)
  if limit is None:
    return None
  peak, parts = compiled_peak(compiled)
  if peak > limit:
    raise DeviceMemoryError(
        f"the compiled step needs {_mib(peak)} per device ({parts}), more than the "
        f"{_mib(limit)} the device has (memory_stats()['bytes_limit']); it would fail with "
        f"RESOURCE_EXHAUSTED. "
        f"{suggest_option(peak, limit, config, params, tx, opt_state, devices)}")
  return peak


def check_state_fits(plan: ShardingPlan, devices: Any = None, *, limit: int | None = None,
                     params: Any = None, tx: Any = None) -> int | None:
  """Fails if the train state of ``plan`` exceeds the devices' memory limit.

  The state is its device-resident parameters and optimizer state per device; it is checked
  before the state is created.

  Args:
    plan: the `ShardingPlan` of the state.
    devices: the devices it lives on; default the plan's mesh's devices.
    limit: the limit in bytes per device instead of the devices' own.
    params: the parameter tree; with ``tx``, the error names the next option that fits.
    tx: the optax transformation.

  Returns:
    The state's bytes per device, or ``None`` when no limit is known (then nothing is
    checked).

  Raises:
    DeviceMemoryError: the state exceeds the limit.
  """
  devices = list(plan.mesh.devices.flat) if devices is None else devices
  limit = bytes_limit(devices) if limit is None else int(limit)
  if limit is None:
    return None
  b = plan.bytes_per_device()
  need = b["params"] + b["opt_state"]
  if need > limit:
    raise DeviceMemoryError(
        f"the train state needs {_mib(need)} per device (parameters {_mib(b['params'])} + "
        f"optimizer state {_mib(b['opt_state'])} at {plan.config.label}), more than the "
        f"{_mib(limit)} the device has (memory_stats()['bytes_limit']); creating it would fail "
        "with RESOURCE_EXHAUSTED. "
        + suggest_option(need, limit, plan.config, params, tx, None, devices,
                   state_only=True))
  return need


# The options in order of communication, as `zerojax estimate --fit` ranks them.
_OPTIONS = [(s, False, False) for s in range(4)] + [(3, True, False), (3, True, True)]


def _option_name(stage: int, oo: bool, op: bool) -> str:
  return f"stage {stage}" + (" + offload_optimizer" if oo else "") + \
      (" + offload_params" if op else "")


def suggest_option(need: int, limit: int, config: ZeroConfig | None, params: Any, tx: Any,
             opt_state: Any, devices: Any, state_only: bool = False) -> str:
  """The next (more sharded) option whose estimated need fits ``limit``.

  The estimate keeps everything but the model state as measured (activations and
  temporaries do not depend on the stage to first order) and swaps the current model state
  for the option's (`estimate`).

  Args:
    need: the bytes per device the current option needs.
    limit: the devices' limit in bytes.
    config: the current config (``None``: a generic suggestion).
    params: the parameter tree (``None``: a generic suggestion).
    tx: the optax transformation.
    opt_state: the optimizer state, instead of ``tx``.
    devices: the devices (their number is the data-parallel size estimated for).
    state_only: compare the persistent state (parameters and optimizer state) only, as
      `check_state_fits` does, rather than the whole model state.

  Returns:
    One or two sentences naming the option and the settings to use.
  """
  if config is None or params is None or (tx is None and opt_state is None):
    return ("Use a higher stage, offload (offload_optimizer / offload_params), remat, a smaller "
            "batch or more devices; `zerojax estimate --fit` compares the options.")
  n = len(list(devices))
  cur = (config.stage, config.offload_optimizer, config.offload_params)

  def model_state(stage, oo, op):
    if oo == "nvme":  # the current config's own files
      offload = config.offload
    elif oo or op:
      offload = HostOffload(bool(oo), op, config.optimizer_on_host and bool(oo),
                            config.offload_fallback)
    else:
      offload = None
    cfg = config.replace(stage=stage, offload=offload)
    e = estimate(params, tx, config=cfg, num_devices=n, opt_state=opt_state)
    return e.persistent if state_only else e.total

  base = model_state(*cur)
  tried = []
  for stage, oo, op in _OPTIONS:
    oo, op = oo or cur[1], op or cur[2]
    if (stage, oo, op) == cur or stage < cur[0] or (op and stage != 3) or (oo and stage == 0):
      continue
    name = _option_name(stage, oo, op)
    if name in tried:
      continue
    tried.append(name)
    want = need - base + model_state(stage, oo, op)
    if want <= limit:
      flags = f"stage={stage}" + (" offload_optimizer=true" if oo else "") + \
          (" offload_params=true" if op else "")
      return (f"{name} would need about {_mib(want)} per device (estimated: the model state "
              f"from zerojax.core.budget.estimate, everything else as measured); set {flags}.")
  last = _option_name(3, True, True)
  want = need - base + model_state(3, True, True)
  return (f"Even {last} would need about {_mib(want)} per device (estimated): use more devices "
          f"or {activation_remedies(config)}.")


def activation_remedies(config: Any) -> str:
  """What shrinks activations that ``config`` does not already set, as one phrase.

  Args:
    config: the `ZeroConfig` of the step that did not fit.

  Returns:
    For example ``"a smaller batch per device, remat='full' or compute_dtype=bfloat16"``.
  """
  ways = ["a smaller batch per device (micro_batch_per_device with "
          "gradient_accumulation_steps)"]
  if config.remat.policy != "full":
    ways.append("remat='full'")
  if str(config.compute_dtype) == "float32":
    ways.append("compute_dtype=bfloat16")
  return ", ".join(ways[:-1]) + " or " + ways[-1] if len(ways) > 1 else ways[0]


def _mib(n: float) -> str:
  """Binary units, as XLA and ``memory_stats`` count."""
  for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= div:
      return f"{n / div:,.1f} {unit}"
  return f"{n:,.0f} B"
