"""Host offload (ZeRO-Offload) through JAX memory kinds.

Offloaded state keeps its stage's sharding and only changes ``memory_kind`` to
``pinned_host``. Inside the step, XLA moves it to the device where it is used and back to the
host where the output sharding says so.
"""

from __future__ import annotations

import warnings

import jax
from jax.sharding import AbstractMesh, Mesh

from zerojax.config import ConfigError, ZeroConfig

HOST = "pinned_host"
DEVICE = "device"


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
