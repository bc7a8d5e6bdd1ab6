"""GPU pods ahead of time: device descriptions, topology names and the memory a step may use.

XLA:GPU compiles for GPUs this machine does not have, given a description of the device (a
``GpuTargetConfig`` text proto) and a topology string. Unlike XLA:TPU it compiles a program
that does not fit, so the fit verdict is zerojax's: the compiled peak against the memory the
JAX GPU client will hand the program (`usable_memory`).

Names are ``GPU:DEVICES`` (one host) or ``GPU:HOSTSxDEVICES``: ``h100:8``, ``h100:2x8``,
``a100-80g:8``, ``h200:8``, ``b200:8``. The device facts ship as package data
(``zerojax/assets/gpu/*.txtpb``, each naming its source).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import os
import re
from typing import Any

from jax.experimental import topologies

__all__ = ["GPU_EXTRA", "GPUS", "GPU_TOPOLOGY_EXAMPLES", "DEFAULT_MEMORY_FRACTION", "GpuSpec",
           "is_gpu_topology", "parse_gpu_topology", "gpu_topology", "target_config",
           "memory_fraction", "usable_memory"]

GPU_EXTRA = 'pip install "zerojax[gpu]"'
# The JAX GPU client preallocates this share of device memory (XLA_PYTHON_CLIENT_MEM_FRACTION).
DEFAULT_MEMORY_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """One GPU model: its target-config file and the memory XLA sees on it."""

  name: str  # the topology prefix, e.g. "h100"
  asset: str  # file under zerojax/assets/gpu
  device_kind: str  # what XLA reports as the device kind
  memory: int  # device_memory_size in the target config, bytes


GPUS: dict[str, GpuSpec] = {s.name: s for s in (
    GpuSpec("h100", "h100_sxm.txtpb", "NVIDIA H100 80GB HBM3", 84942979072),
    GpuSpec("a100-80g", "a100_sxm_80.txtpb", "NVIDIA A100-SXM4-80GB", 85100068864),
    GpuSpec("h200", "h200.txtpb", "NVIDIA H200 141GB HBM3e", 151397597184),
    GpuSpec("b200", "b200.txtpb", "NVIDIA B200", 191514411008),
)}
GPU_TOPOLOGY_EXAMPLES = ("h100:8", "h100:2x8", "h100:8x8", "a100-80g:8", "h200:8", "b200:8")
_NAME = re.compile(r"^([a-z0-9\-]+):(?:(\d+)x)?(\d+)$")


def is_gpu_topology(name: Any) -> bool:
  """Whether ``name`` names a GPU model zerojax describes (``'h100:8'``); TPU names are not."""
  m = _NAME.match(name) if isinstance(name, str) else None
  return m is not None and m.group(1) in GPUS


def parse_gpu_topology(name: str) -> tuple[GpuSpec, int, int]:
  """``(spec, hosts, devices per host)`` of a GPU topology name."""
  m = _NAME.match(name) if isinstance(name, str) else None
  if m is None or m.group(1) not in GPUS:
    raise ValueError(f"topology={name!r} is not a GPU topology: GPU:DEVICES or "
                     f"GPU:HOSTSxDEVICES with GPU one of {sorted(GPUS)}, e.g. "
                     f"{', '.join(GPU_TOPOLOGY_EXAMPLES)}")
  hosts, per_host = int(m.group(2) or 1), int(m.group(3))
  if hosts < 1 or not 1 <= per_host <= 8:
    raise ValueError(f"topology={name!r}: hosts must be >= 1 and devices per host 1-8 "
                     f"(got {hosts} x {per_host})")
  return GPUS[m.group(1)], hosts, per_host


def target_config(gpu: str) -> str:
  """The ``GpuTargetConfig`` text proto of ``gpu`` (a key of `GPUS`), from package data."""
  if gpu not in GPUS:
    raise ValueError(f"gpu={gpu!r} is unknown; known GPUs are {sorted(GPUS)}")
  return (importlib.resources.files("zerojax") / "assets" / "gpu" / GPUS[gpu].asset).read_text()


def gpu_topology(name: str) -> Any:
  """The ``TopologyDescription`` of a GPU pod, e.g. ``'h100:8'``: compile-only devices.

  Needs the CUDA plugin (``pip install "zerojax[gpu]"``) but no GPU, driver or libcuda; JAX's
  default backend stays what it was (CPU here).
  """
  spec, hosts, per_host = parse_gpu_topology(name)
  if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
    raise ImportError(f"compiling for GPU topology {name!r} needs JAX's CUDA plugin, which is "
                      f"not installed; install it with: {GPU_EXTRA}")
  try:
    return topologies.get_topology_desc(platform="cuda", target_config=target_config(spec.name),
                                        topology=f"1x{hosts}x{per_host}")
  except Exception as e:  # the plugin's message names what it could not build
    raise ValueError(f"topology={name!r}: the CUDA plugin could not describe it ({e})") from None


def memory_fraction() -> float:
  """The share of device memory the JAX GPU client will allocate from: the environment's
  ``XLA_PYTHON_CLIENT_MEM_FRACTION``, else JAX's default 0.75."""
  raw = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  if raw is None:
    return DEFAULT_MEMORY_FRACTION
  try:
    f = float(raw)
  except ValueError:
    f = -1.0
  if not 0 < f <= 1:
    raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} is invalid: a number in (0, 1]")
  return f


def usable_memory(spec: GpuSpec, fraction: float | None = None) -> int:
  """Bytes of one GPU the JAX client lets a program use: ``fraction`` of its memory."""
  f = memory_fraction() if fraction is None else fraction
  if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f <= 1:
    raise ValueError(f"memory_fraction={fraction!r} is invalid: a number in (0, 1]")
  return int(spec.memory * f)
