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

import contextlib
import dataclasses
import importlib
import importlib.resources
import importlib.util
import os
import re
from typing import Any, Iterator

import jax
from jax.experimental import topologies

from zerojax.core.backend import GPU_LINKS

__all__ = ["CUDA_PLUGINS", "cuda_plugin", "cuda_install_line", "GPUS", "GPU_TOPOLOGY_EXAMPLES",
           "DEFAULT_MEMORY_FRACTION", "GpuSpec",
           "is_gpu_topology", "parse_gpu_topology", "gpu_topology", "target_config",
           "memory_fraction", "usable_memory"]

# JAX's CUDA plugins by module, newest CUDA first: the extra that installs each.
CUDA_PLUGINS = {"jax_plugins.xla_cuda13": "cuda13", "jax_plugins.xla_cuda12": "cuda12"}
# Read by the CUDA plugin's start-up: skip its CUDA version check, which calls cuInit and so
# fails on a machine without a GPU, where only compiling is wanted.
_SKIP_CUDA_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
# The JAX GPU client preallocates this share of device memory (XLA_PYTHON_CLIENT_MEM_FRACTION).
DEFAULT_MEMORY_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """One GPU model: its target-config file, the memory XLA sees on it and its published peaks.

  The peaks, per GPU, are for `zerojax.runtime.step_time`; 0 means not known.

  Attributes:
    name: the topology prefix, e.g. ``"h100"``.
    asset: the target-config file under ``zerojax/assets/gpu``.
    device_kind: what XLA reports as the device kind.
    memory: ``device_memory_size`` in the target config, bytes.
    bf16_flops: dense bf16 tensor-core FLOP/s (datasheets print bf16 and tf32 "with
      sparsity", twice these).
    tf32_flops: dense tf32 tensor-core FLOP/s.
    fp32_flops: fp32 FLOP/s without tensor cores.
    hbm_bandwidth: HBM bytes/s.
    nvlink_bandwidth: NVLink bytes/s per direction (datasheets print both directions summed).
    network_bandwidth: bytes/s across hosts per GPU per direction: the reference system's NIC
      per GPU (a cloud VM may have less, e.g. GCP A3 High: 100 Gb/s per GPU).
  """

  name: str
  asset: str
  device_kind: str
  memory: int
  bf16_flops: float = 0.0
  tf32_flops: float = 0.0
  fp32_flops: float = 0.0
  hbm_bandwidth: float = 0.0
  nvlink_bandwidth: float = 0.0
  network_bandwidth: float = 0.0


GPUS: dict[str, GpuSpec] = {s.name: s for s in (
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): bf16 1,979 / tf32 989 TFLOPS with sparsity,
    # fp32 67 TFLOPS, HBM3 3.35 TB/s. Links (here and below): `zerojax.core.backend.GPU_LINKS`.
    GpuSpec("h100", "h100_sxm.txtpb", "NVIDIA H100 80GB HBM3", 84942979072,
            989.4e12, 494.7e12, 66.9e12, 3.35e12, *GPU_LINKS["NVIDIA H100 80GB HBM3"]),
    # NVIDIA A100 datasheet (SXM 80GB): bf16 312 / tf32 156 TFLOPS dense, fp32 19.5, HBM2e
    # 2,039 GB/s.
    GpuSpec("a100-80g", "a100_sxm_80.txtpb", "NVIDIA A100-SXM4-80GB", 85100068864,
            312e12, 156e12, 19.5e12, 2.039e12, *GPU_LINKS["NVIDIA A100-SXM4-80GB"]),
    # NVIDIA H200 datasheet (SXM): the H100's tensor cores, HBM3e 4.8 TB/s.
    GpuSpec("h200", "h200.txtpb", "NVIDIA H200 141GB HBM3e", 151397597184,
            989.4e12, 494.7e12, 66.9e12, 4.8e12, *GPU_LINKS["NVIDIA H200 141GB HBM3e"]),
    # NVIDIA HGX B200 datasheet, per GPU (1,000 W): bf16 4.5 / tf32 2.2 PFLOPS with sparsity,
    # fp32 80 TFLOPS, HBM3e 8 TB/s.
    GpuSpec("b200", "b200.txtpb", "NVIDIA B200", 191514411008,
            2250e12, 1100e12, 80e12, 8e12, *GPU_LINKS["NVIDIA B200"]),
)}
GPU_TOPOLOGY_EXAMPLES = ("h100:8", "h100:2x8", "h100:8x8", "a100-80g:8", "h200:8", "b200:8")
_NAME = re.compile(r"^([a-z0-9\-]+):(?:(\d+)x)?(\d+)$")


def is_gpu_topology(name: Any) -> bool:
  """Whether ``name`` is a GPU topology name.

  Args:
    name: anything; a topology name is a string such as ``'h100:8'``.

  Returns:
    True where it names a GPU model zerojax describes (`GPUS`); TPU names are not.
  """
  m = _NAME.match(name) if isinstance(name, str) else None
  return m is not None and m.group(1) in GPUS


def parse_gpu_topology(name: str) -> tuple[GpuSpec, int, int]:
  """The GPU model and shape a GPU topology name gives.

  Args:
    name: ``GPU:DEVICES`` or ``GPU:HOSTSxDEVICES``, e.g. ``'h100:2x8'``.

  Returns:
    ``(spec, hosts, devices per host)``.

  Raises:
    ValueError: ``name`` is no GPU topology, or has fewer than one host or other than 1-8
      devices per host.
  """
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
  """The ``GpuTargetConfig`` text proto of a GPU model, from package data.

  Args:
    gpu: a key of `GPUS`, e.g. ``'h100'``.

  Returns:
    The text proto.

  Raises:
    ValueError: ``gpu`` is not a key of `GPUS`.
  """
  if gpu not in GPUS:
    raise ValueError(f"gpu={gpu!r} is unknown; known GPUs are {sorted(GPUS)}")
  return (importlib.resources.files("zerojax") / "assets" / "gpu" / GPUS[gpu].asset).read_text()


def cuda_plugin() -> str | None:
  """The installed JAX CUDA plugin.

  Returns:
    Its module name (a key of `CUDA_PLUGINS`, CUDA 13 first), or None where none is installed.
  """
  for module in CUDA_PLUGINS:
    try:
      if importlib.util.find_spec(module) is not None:
        return module
    except ModuleNotFoundError:  # no jax_plugins namespace at all
      return None
  return None


def cuda_install_line() -> str:
  """The command that installs the CUDA plugin matching the installed JAX exactly (plugins
  are released in lockstep with jaxlib, and a newer one would upgrade JAX).

  Returns:
    The ``pip install`` lines for CUDA 13 and CUDA 12.
  """
  v = jax.__version__
  return f'pip install "jax[cuda13]=={v}" (CUDA 13), or pip install "jax[cuda12]=={v}" (CUDA 12)'


def _has_gpu() -> bool:
  """Whether this machine shows an NVIDIA driver (its device nodes)."""
  return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")


@contextlib.contextmanager
def _cuda_check_skipped(skip: bool) -> Iterator[None]:
  """Sets `_SKIP_CUDA_CHECK` for the block (when ``skip``), restoring what was there."""
  before = os.environ.get(_SKIP_CUDA_CHECK)
  if skip:
    os.environ[_SKIP_CUDA_CHECK] = "1"
  try:
    yield
  finally:
    if skip and before is None:
      os.environ.pop(_SKIP_CUDA_CHECK, None)
    elif skip:
      os.environ[_SKIP_CUDA_CHECK] = before


def gpu_topology(name: str) -> Any:
  """The ``TopologyDescription`` of a GPU pod, e.g. ``'h100:8'``: compile-only devices.

  Needs JAX's CUDA plugin (CUDA 12 or 13) but no GPU, driver or libcuda, and no
  ``JAX_PLATFORMS`` setting: on a machine without a GPU the plugin is registered without its
  CUDA version check (which needs a driver), so JAX's default backend stays the CPU.

  Args:
    name: ``GPU:DEVICES`` or ``GPU:HOSTSxDEVICES`` (`parse_gpu_topology`).

  Returns:
    The topology; its ``devices`` are what a mesh for an ahead-of-time compile is built from.

  Raises:
    ValueError: ``name`` is no GPU topology, or the plugin cannot describe it.
    ImportError: no CUDA plugin is installed (the message gives the install line).
  """
  spec, hosts, per_host = parse_gpu_topology(name)
  module = cuda_plugin()
  if module is None:
    raise ImportError(f"compiling for GPU topology {name!r} needs JAX's CUDA plugin, which is "
                      f"not installed; install it with: {cuda_install_line()}")
  describe = lambda: topologies.get_topology_desc(
      platform="cuda", target_config=target_config(spec.name), topology=f"1x{hosts}x{per_host}")
  try:
    with _cuda_check_skipped(not _has_gpu()):
      try:
        return describe()
      except NotImplementedError:
        # The plugin failed to start when JAX first looked for plugins (its version check
        # needs a GPU): register it again, for compiling only.
        with _cuda_check_skipped(True):
          importlib.import_module(module).initialize()
        return describe()
  except Exception as e:  # the plugin's message names what it could not build
    raise ValueError(f"topology={name!r}: the CUDA plugin ({module}) could not describe it "
                     f"({e})") from None


def memory_fraction() -> float:
  """The share of device memory the JAX GPU client will allocate from.

  Returns:
    The environment's ``XLA_PYTHON_CLIENT_MEM_FRACTION``, else JAX's default 0.75
    (`DEFAULT_MEMORY_FRACTION`).

  Raises:
    ValueError: the variable is set to anything but a number in (0, 1].
  """
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
  """Bytes of one GPU the JAX client lets a program use.

  Args:
    spec: the GPU model.
    fraction: the share of its memory; None: `memory_fraction`.

  Returns:
    ``fraction`` of ``spec.memory``, in bytes.

  Raises:
    ValueError: ``fraction`` (or the environment's) is not a number in (0, 1].
  """
  f = memory_fraction() if fraction is None else fraction
  if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f <= 1:
    raise ValueError(f"memory_fraction={fraction!r} is invalid: a number in (0, 1]")
  return int(spec.memory * f)
