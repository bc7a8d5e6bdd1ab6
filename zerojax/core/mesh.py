"""Device mesh from a `ZeroConfig`.

Axis types are ``AxisType.Auto`` on purpose. zerojax annotates the *boundaries* of a step
(inputs, outputs, and each parameter where a layer uses it) and lets GSPMD/Shardy propagate the
rest, so that a user's step stays plain JAX. ``Explicit`` axes (the default of
``jax.make_mesh`` since 0.7) would put shardings into every intermediate type and make ordinary
user code such as ``x @ w`` with differently sharded operands an error.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zerojax.core.config import ZeroConfig
from zerojax.core.errors import invalid_setting

__all__ = ["make_mesh", "mesh_shape", "data_axes", "platform"]


def make_mesh(config: ZeroConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the mesh over all devices (of every process) or over ``devices``.

  With several processes and a ``replica`` axis whose size divides the process count, the
  ``replica`` axis spans processes (slow network) and ``fsdp``/``tensor`` stay within a
  process (fast links): this is hybrid sharding, ZeRO++ hpZ-style.

  Args:
    config: the configuration whose ``mesh_axes`` and ``mesh_shape`` (a -1 entry takes the
      remaining devices) shape the mesh.
    devices: the devices to lay out; default every device of every process.

  Returns:
    A ``jax.sharding.Mesh`` with ``config.mesh_axes`` as its axis names, every axis of type
    ``AxisType.Auto``.

  Raises:
    ConfigError: the mesh shape does not match the number of devices (`mesh_shape`).
  """
  devices = list(jax.devices() if devices is None else devices)
  axes = config.mesh_axes
  shape = mesh_shape(config.mesh_shape, axes, len(devices))
  types = (AxisType.Auto,) * len(axes)
  nproc = len({d.process_index for d in devices})
  if "replica" in axes and nproc > 1:
    r = shape[axes.index("replica")]
    if r % nproc == 0 or nproc % r == 0:
      return _hybrid_mesh(shape, axes, devices, nproc, types)
  if len(devices) == jax.device_count():
    return jax.make_mesh(shape, axes, axis_types=types, devices=devices)
  return Mesh(np.asarray(devices).reshape(shape), axes, axis_types=types)


def mesh_shape(shape: Sequence[int], axes: Sequence[str], num_devices: int) -> tuple[int, ...]:
  """A config's ``mesh_shape`` resolved for ``num_devices``.

  Args:
    shape: the sizes per axis (``ZeroConfig.mesh_shape``); one may be -1, the devices left.
    axes: the axis names (``ZeroConfig.mesh_axes``), for the error message.
    num_devices: the devices the mesh spans.

  Returns:
    ``shape`` with its -1 entry replaced by the remaining devices.

  Raises:
    ConfigError: the sizes do not divide, or do not multiply to, ``num_devices``.
  """
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise invalid_setting("mesh_shape", tuple(shape), f"the fixed sizes multiply to {known}, "
                            f"which does not divide the {num_devices} available devices")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise invalid_setting("mesh_shape", tuple(shape), f"mesh {dict(zip(axes, shape))} needs "
                          f"{math.prod(shape)} devices but {num_devices} are available; sizes "
                          f"must multiply to {num_devices}")
  return tuple(shape)


def _hybrid_mesh(shape, axes, devices, nproc, types) -> Mesh:
  """Mesh whose ``replica`` axis runs across processes and the rest within each process."""
  # Order devices process-major, so the replica axis (leading in MESH_AXES order) crosses
  # process boundaries and the inner axes stay local.
  order = sorted(devices, key=lambda d: (d.process_index, d.id))
  ordered_axes = ["replica"] + [a for a in axes if a != "replica"]
  ordered_shape = [shape[axes.index(a)] for a in ordered_axes]
  arr = np.asarray(order).reshape(ordered_shape)
  # Move axes back to the user's order.
  arr = np.moveaxis(arr, list(range(len(axes))), [axes.index(a) for a in ordered_axes])
  return Mesh(arr, axes, axis_types=types)


def data_axes(mesh: Mesh) -> tuple[str, ...]:
  """Mesh axes the batch is split over: every data-parallel axis (``replica``, ``fsdp``).

  Args:
    mesh: the device mesh.

  Returns:
    The names of ``mesh``'s data-parallel axes, in the order ``replica``, ``fsdp``.
  """
  return tuple(a for a in ("replica", "fsdp") if a in mesh.axis_names)


def platform(mesh: Any) -> str:
  """The backend a mesh's devices compile for (``'cpu'``, ``'gpu'``, ``'tpu'``).

  Args:
    mesh: a ``Mesh``, or an ``AbstractMesh`` (planning without devices).

  Returns:
    The platform name of the mesh's first device; for an abstract mesh, its abstract device's
    platform, else ``'cpu'``.
  """
  if isinstance(mesh, jax.sharding.AbstractMesh):
    device = mesh.abstract_device
    return device.platform if device is not None else "cpu"
  return next(iter(mesh.devices.flat)).platform
