"""`create_train_state`, `create_nnx` and `abstract_train_state` for every offload policy,
chosen by its type.

``config.offload`` says where the optimizer state lives. `HostOffload` and ``None`` are memory
kinds of the plan (`zerojax.core.create`). `NvmeOffload` keeps the state in files
(`zerojax.runtime.nvme`): the plan returned carries the `NvmeOptimizer` that streams it as
``plan.nvme``, and `zerojax.zero_step` steps through it, so the same two calls run every
offload.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from zerojax.core import create as _core
from zerojax.core.backend import Backend
from zerojax.core.config import ConfigError, ZeroConfig
from zerojax.core.plan import ShardingPlan
from zerojax.runtime import nvme

__all__ = ["create_train_state", "create_nnx", "abstract_train_state"]

_NVME_NOTE = """

  With ``config.offload`` an `NvmeOffload`, the optimizer state of ``tx`` goes to files under
  its ``path``: the device state carries only the step's reduced gradient
  (`zerojax.runtime.nvme.device_part`), and `zerojax.runtime.nvme.start` then checks that
  ``tx`` is elementwise and writes its state as the first generation of files, or resumes a
  committed state there unless ``overwrite=True`` (which any other offload refuses with a
  `ConfigError`). The plan's ``nvme`` is the `NvmeOptimizer` that streams it (its
  ``save_checkpoint``, ``restore_checkpoint`` and ``stats``), and `zerojax.zero_step` runs its
  host update after each device step.
"""

_ABSTRACT_NVME_NOTE = """

  With ``config.offload`` an `NvmeOffload`, the plan's ``nvme`` is the `NvmeOptimizer` of the
  files under its ``path`` (nothing is written), and `Checkpointer.restore` with this plan
  restores the checkpoint's optimizer-state snapshot beside the train state.
"""


def _overwrite_needs_nvme(config: ZeroConfig, overwrite: bool) -> None:
  if overwrite and not config.optimizer_on_nvme:
    raise ConfigError(f"overwrite=True is invalid with config.offload={config.offload!r}: it "
                      "starts an NvmeOffload's optimizer-state files afresh, and only that "
                      "offload has files; drop overwrite", field="overwrite", value=True,
                      allowed="False unless config.offload is an NvmeOffload")


def _device_part(config: ZeroConfig, tx: Any, nnx_model: bool = False) -> tuple[ZeroConfig, Any]:
  """The config and transformation the device state is created with: the run's own, or an
  NVMe run's device part."""
  if config.optimizer_on_nvme:
    return nvme.device_part(config, tx, nnx_model=nnx_model)
  return config, tx


def create_train_state(model: Any, tx: Any, rng: jax.Array, *init_args: Any,
                       config: ZeroConfig, mesh: jax.sharding.Mesh | None = None,
                       state_cls: type | None = None, params: Any = None,
                       backend: Backend | None = None, overwrite: bool = False,
                       **init_kwargs: Any) -> tuple[Any, ShardingPlan]:
  _overwrite_needs_nvme(config, overwrite)
  device, device_tx = _device_part(config, tx)
  state, plan = _core.create_train_state(model, device_tx, rng, *init_args, config=device,
                                         mesh=mesh, state_cls=state_cls, params=params,
                                         backend=backend, **init_kwargs)
  if config.optimizer_on_nvme:
    plan = dataclasses.replace(plan, nvme=nvme.start(config.offload, plan, tx, state,
                                                     overwrite=overwrite))
  return state, plan


def create_nnx(model_fn: Callable[[], Any], tx: Any, *, config: ZeroConfig,
               mesh: jax.sharding.Mesh | None = None, wrt: Any = None, params: Any = None,
               backend: Backend | None = None, overwrite: bool = False,
               restoring: bool = False):
  _overwrite_needs_nvme(config, overwrite)
  if overwrite and restoring:
    raise ConfigError("restoring=True takes the optimizer state from a checkpoint and "
                      "overwrite=True starts it afresh; pass one", field="restoring",
                      value=True, allowed="False with overwrite=True")
  device, device_tx = _device_part(config, tx, nnx_model=True)
  model, optimizer, plan = _core.create_nnx(model_fn, device_tx, config=device, mesh=mesh,
                                            wrt=wrt, params=params, backend=backend)
  if config.optimizer_on_nvme:
    plan = dataclasses.replace(plan, nvme=nvme.start(
        config.offload, plan, tx, nvme.NnxView.of(model, optimizer), overwrite=overwrite,
        restoring=restoring))
  return model, optimizer, plan


def abstract_train_state(model: Any, tx: Any, rng: jax.Array, *init_args: Any,
                         config: ZeroConfig, mesh: jax.sharding.Mesh | None = None,
                         state_cls: type | None = None, backend: Backend | None = None,
                         **init_kwargs: Any) -> tuple[Any, ShardingPlan]:
  device, device_tx = _device_part(config, tx)
  state, plan = _core.abstract_train_state(model, device_tx, rng, *init_args, config=device,
                                           mesh=mesh, state_cls=state_cls, backend=backend,
                                           **init_kwargs)
  if config.optimizer_on_nvme:  # opens the store; nothing is written
    plan = dataclasses.replace(plan, nvme=nvme.NvmeOptimizer(config.offload, plan, tx, state))
  return state, plan


create_train_state.__doc__ = _core.create_train_state.__doc__.rstrip() + _NVME_NOTE
create_nnx.__doc__ = _core.create_nnx.__doc__.rstrip() + _NVME_NOTE + """
  ``restoring=True`` says the optimizer state comes from a checkpoint next, as when
  ``params`` reads a checkpoint's parameters: with an `NvmeOffload` the files are then only
  opened, and ``plan.nvme.restore_snapshot(checkpointer, step)`` makes the step's snapshot
  the committed state (a linen run restores through `abstract_train_state` instead). Other
  offloads initialise the optimizer state as usual, for the caller to replace.
"""
abstract_train_state.__doc__ = (_core.abstract_train_state.__doc__.rstrip()
                                + _ABSTRACT_NVME_NOTE)
