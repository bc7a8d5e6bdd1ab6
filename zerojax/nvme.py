"""`zerojax.nvme`: the optimizer state in files (``offload=NvmeOffload(path)``), streamed
through the host a chunk at a time.

`zerojax.create_train_state` and `zerojax.create_nnx` choose NVMe by the offload policy's type
and put the `NvmeOptimizer` in ``plan.nvme``. The three-value calls below are the earlier
spelling of the same thing, kept for one release.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from zerojax.core.config import ConfigError
from zerojax.runtime import create as _create
from zerojax.runtime.nvme import *  # noqa: F401,F403 - the public surface, re-exported
from zerojax.runtime.nvme import NvmeOptimizer, __all__ as _runtime_all

__all__ = [*_runtime_all, "create_train_state", "abstract_train_state", "create_nnx"]


def _old_spelling(common: Callable[..., tuple], *args: Any, **kwargs: Any) -> tuple:
  """``common(*args, **kwargs)`` (the common call of the same name) with ``plan.nvme``
  appended, after warning that ``zerojax.nvme.<name>`` is deprecated. A config without NVMe is
  refused, as these calls always did, before any device work."""
  name, config = common.__name__, kwargs.get("config")
  warnings.warn(f"zerojax.nvme.{name} is deprecated and will be removed in the next release: "
                f"zerojax.{name} with config.offload=NvmeOffload(path) does the same and puts "
                "the NvmeOptimizer in plan.nvme", DeprecationWarning, stacklevel=3)
  if not getattr(config, "optimizer_on_nvme", False):
    raise ConfigError(f"zerojax.nvme.{name} needs config.offload=NvmeOffload(path); got "
                      f"offload={getattr(config, 'offload', None)!r}. For any other offload "
                      f"use zerojax.{name}", field="offload",
                      value=getattr(config, "offload", None), allowed="an NvmeOffload")
  out = common(*args, **kwargs)
  return (*out, out[-1].nvme)


def create_train_state(model: Any, tx: Any, rng: Any, *init_args: Any, **kwargs: Any
                       ) -> tuple[Any, Any, NvmeOptimizer]:
  """Deprecated: `zerojax.create_train_state`, with the `NvmeOptimizer` as a third value.

  Args:
    model: the linen module.
    tx: the optax transformation whose state goes to the files.
    rng: the init's random key.
    *init_args: example inputs for ``model.init``.
    **kwargs: as `zerojax.create_train_state` (``config`` with an `NvmeOffload`).

  Returns:
    ``(state, plan, plan.nvme)``.

  Raises:
    ConfigError: ``config`` does not put the optimizer state on NVMe.
  """
  return _old_spelling(_create.create_train_state, model, tx, rng, *init_args, **kwargs)


def abstract_train_state(model: Any, tx: Any, rng: Any, *init_args: Any, **kwargs: Any
                         ) -> tuple[Any, Any, NvmeOptimizer]:
  """Deprecated: `zerojax.checkpoint.abstract_train_state`, with the `NvmeOptimizer` as a
  third value.

  Args:
    model: the linen module.
    tx: the optax transformation whose state is in the files.
    rng: a random key (only its shape matters).
    *init_args: example inputs for ``model.init``.
    **kwargs: as `zerojax.checkpoint.abstract_train_state`.

  Returns:
    ``(abstract_state, plan, plan.nvme)``.

  Raises:
    ConfigError: ``config`` does not put the optimizer state on NVMe.
  """
  return _old_spelling(_create.abstract_train_state, model, tx, rng, *init_args, **kwargs)


def create_nnx(model_fn: Callable[[], Any], tx: Any, **kwargs: Any
               ) -> tuple[Any, Any, Any, NvmeOptimizer]:
  """Deprecated: `zerojax.create_nnx`, with the `NvmeOptimizer` as a fourth value.

  Args:
    model_fn: a no-argument function returning the ``nnx.Module``.
    tx: the optax transformation whose state goes to the files.
    **kwargs: as `zerojax.create_nnx` (``config`` with an `NvmeOffload`).

  Returns:
    ``(model, optimizer, plan, plan.nvme)``.

  Raises:
    ConfigError: ``config`` does not put the optimizer state on NVMe.
  """
  return _old_spelling(_create.create_nnx, model_fn, tx, **kwargs)

