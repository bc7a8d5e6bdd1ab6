"""Memory kinds: where each kind of state rests (``device`` or ``pinned_host``), decided once
from the config and what the mesh's devices can address.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh

from zerojax.core.config import ConfigError, ZeroConfig

__all__ = ["DEVICE", "HOST", "supported_memory_kinds", "memory_kinds", "on_device", "on_host"]

DEVICE = "device"
HOST = "pinned_host"  # the memory kind offloaded state rests in


def supported_memory_kinds(mesh: Mesh) -> frozenset[str]:
  """Memory kinds every device of ``mesh`` can address (local devices only are queried)."""
  kinds = None
  for d in mesh.devices.flat:
    if d.process_index != jax.process_index():
      continue
    try:
      ks = {m.kind for m in d.addressable_memories()}
    except Exception:  # backends without the memories API
      ks = {DEVICE}
    kinds = ks if kinds is None else kinds & ks
  return frozenset(kinds or ())


def memory_kinds(config: ZeroConfig, mesh: Mesh) -> tuple[str | None, str | None]:
  """``(param_kind, opt_kind)`` for the plan; ``None`` means the default (device) memory."""
  if config.optimizer_on_nvme:
    # A memory kind cannot say "in files": a plan of device or host memory for this config
    # would silently keep the optimizer state there.
    raise ConfigError(
        f"offload=NvmeOffload({config.nvme_path!r}) keeps the optimizer state in files, which "
        "zerojax.runtime.nvme streams through a host update: create the state with "
        "zerojax.create_train_state or zerojax.create_nnx, which set it up (plan.nvme), and "
        "step with zerojax.zero_step(plan); a ShardingPlan alone places state in device or "
        "pinned_host memory only")
  wants = config.offload_params or config.offload_optimizer
  if not wants:
    return None, None
  if isinstance(mesh, AbstractMesh):  # planning for devices that are not here
    return (HOST if config.offload_params else None, HOST if config.offload_optimizer else None)
  if HOST not in supported_memory_kinds(mesh):
    backend = mesh.devices.flat[0].platform
    msg = (f"offload asked for (offload_params={config.offload_params}, offload_optimizer="
           f"{config.offload_optimizer}) but the {backend!r} backend has no {HOST!r} memory; "
           f"it offers {sorted(supported_memory_kinds(mesh))}")
    if config.offload_fallback == "warn":
      warnings.warn(msg + "; keeping the state on device (offload_fallback='warn')")
      return None, None
    raise ConfigError(msg + "; set offload_fallback='warn' to fall back to device memory")
  return (HOST if config.offload_params else None, HOST if config.offload_optimizer else None)


def on_device(shardings: Any) -> Any:
  """The same shardings in device memory."""
  return jax.tree.map(lambda s: s.with_memory_kind(DEVICE), shardings)


def on_host(shardings: Any) -> Any:
  """The same shardings in ``pinned_host`` memory."""
  return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)
