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
  its ``path`` (`zerojax.runtime.nvme.create_train_state`; ``tx`` must be elementwise, and a
  committed state there is resumed unless ``overwrite=True``, which any other offload
  refuses with a `ConfigError`): the plan's ``nvme`` is the
  `NvmeOptimizer` that streams it (its ``save_checkpoint``, ``restore_checkpoint`` and
  ``stats``), and `zerojax.zero_step` runs its host update after each device step.
"""

_ABSTRACT_NVME_NOTE = """

  With ``config.offload`` an `NvmeOffload`, the plan's ``nvme`` is the `NvmeOptimizer` of the
  files under its ``path`` (`zerojax.runtime.nvme.abstract_train_state`: nothing is written),
  and `Checkpointer.restore` with this plan restores the checkpoint's optimizer-state snapshot
  beside the train state.
"""


def _overwrite_needs_nvme(config: ZeroConfig, overwrite: bool) -> None:
  if overwrite and not config.optimizer_on_nvme:
    raise ConfigError(f"overwrite=True is invalid with config.offload={config.offload!r}: it "
                      "starts an NvmeOffload's optimizer-state files afresh, and only that "
                      "offload has files; drop overwrite", field="overwrite", value=True,
                      allowed="False unless config.offload is an NvmeOffload")


def create_train_state(model: Any, tx: Any, rng: jax.Array, *init_args: Any,
                       config: ZeroConfig, mesh: jax.sharding.Mesh | None = None,
                       state_cls: type | None = None, params: Any = None,
                       backend: Backend | None = None, overwrite: bool = False,
                       **init_kwargs: Any) -> tuple[Any, ShardingPlan]:
  _overwrite_needs_nvme(config, overwrite)
  if config.optimizer_on_nvme:
    state, plan, opt = nvme.create_train_state(
        model, tx, rng, *init_args, config=config, mesh=mesh, state_cls=state_cls,
        params=params, backend=backend, overwrite=overwrite, **init_kwargs)
    return state, dataclasses.replace(plan, nvme=opt)
  return _core.create_train_state(model, tx, rng, *init_args, config=config, mesh=mesh,
                                  state_cls=state_cls, params=params, backend=backend,
                                  **init_kwargs)


def create_nnx(model_fn: Callable[[], Any], tx: Any, *, config: ZeroConfig,
               mesh: jax.sharding.Mesh | None = None, wrt: Any = None, params: Any = None,
               backend: Backend | None = None, overwrite: bool = False):
  _overwrite_needs_nvme(config, overwrite)
  if config.optimizer_on_nvme:
    model, optimizer, plan, opt = nvme.create_nnx(model_fn, tx, config=config, mesh=mesh,
                                                  wrt=wrt, params=params, backend=backend,
                                                  overwrite=overwrite)
    return model, optimizer, dataclasses.replace(plan, nvme=opt)
  return _core.create_nnx(model_fn, tx, config=config, mesh=mesh, wrt=wrt, params=params,
                          backend=backend)


def abstract_train_state(model: Any, tx: Any, rng: jax.Array, *init_args: Any,
                         config: ZeroConfig, mesh: jax.sharding.Mesh | None = None,
                         state_cls: type | None = None, backend: Backend | None = None,
                         **init_kwargs: Any) -> tuple[Any, ShardingPlan]:
  if config.optimizer_on_nvme:
    state, plan, opt = nvme.abstract_train_state(
        model, tx, rng, *init_args, config=config, mesh=mesh, state_cls=state_cls,
        backend=backend, **init_kwargs)
    return state, dataclasses.replace(plan, nvme=opt)
  return _core.abstract_train_state(model, tx, rng, *init_args, config=config, mesh=mesh,
                                    state_cls=state_cls, backend=backend, **init_kwargs)


create_train_state.__doc__ = _core.create_train_state.__doc__.rstrip() + _NVME_NOTE
create_nnx.__doc__ = _core.create_nnx.__doc__.rstrip() + _NVME_NOTE
abstract_train_state.__doc__ = (_core.abstract_train_state.__doc__.rstrip()
                                + _ABSTRACT_NVME_NOTE)
