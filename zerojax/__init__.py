"""zerojax: ZeRO stages 0-3 for JAX as sharding plans over a device mesh.

Data flows one way: `ZeroConfig` -> `make_mesh` -> `ShardingPlan` -> `zero_step` -> checkpoint.

What to import: the names below (`export` consolidates a checkpoint), and the modules named
for what they hold: `zerojax.models` (GPT, Llama), `zerojax.memory` (estimates, measurement,
ahead-of-time compilation), `zerojax.checkpoint` (sharded checkpoints), `zerojax.weights`
(Hugging Face safetensors), `zerojax.data` (per-process batches), `zerojax.train` (the
training loop), `zerojax.finetune`, `zerojax.distributed` (multi-host start-up) and
`zerojax.nvme`. The folders `core`, `runtime` and `tools` are the implementation's layers,
internal: a module may move between them without changing any of these names.

The names below are imported on first use: ``import zerojax`` loads neither JAX, Flax nor
optax and starts no JAX backend (so it prints nothing, even with libtpu installed on a machine
without a TPU), and the ``zerojax`` command starts in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "ConfigError": "zerojax.core.config",
    "ZeroConfig": "zerojax.core.config",
    "Precision": "zerojax.core.policies",
    "HostOffload": "zerojax.core.policies",
    "NvmeOffload": "zerojax.core.policies",
    "Remat": "zerojax.core.policies",
    "Gather": "zerojax.core.policies",
    "Quantize": "zerojax.core.policies",
    "Batch": "zerojax.core.policies",
    "LossScale": "zerojax.core.policies",
    "load_config": "zerojax.tools.config_file",
    "DEFAULT_CORPUS": "zerojax.tools.options",
    "export": "zerojax.tools.export",
    "make_mesh": "zerojax.core.mesh",
    "Backend": "zerojax.core.backend",
    "LeafPlan": "zerojax.core.plan",
    "ShardingPlan": "zerojax.core.plan",
    "value_and_grad": "zerojax.core.grad",
    "accumulate": "zerojax.core.grad",
    "create_nnx": "zerojax.runtime.create",
    "create_train_state": "zerojax.runtime.create",
    "zero_step": "zerojax.core.step",
    "ZeroStep": "zerojax.core.step",
    "StepSettings": "zerojax.core.train_state",
    "ZeroTrainState": "zerojax.core.train_state",
    "master_weights": "zerojax.core.master",
    "MasterWeightsState": "zerojax.core.master",
}
_SUBMODULES = ("models", "memory", "checkpoint", "weights", "data", "train", "finetune",
               "distributed", "nvme", "core", "runtime", "tools")

__all__ = [
    "ConfigError", "ZeroConfig", "Precision", "HostOffload", "NvmeOffload", "Remat", "Gather",
    "Quantize", "Batch", "LossScale", "make_mesh", "Backend", "LeafPlan", "ShardingPlan",
    "create_nnx", "create_train_state", "zero_step", "ZeroStep", "value_and_grad", "accumulate",
    "ZeroTrainState", "StepSettings", "load_config", "DEFAULT_CORPUS", "export", "master_weights",
    "MasterWeightsState",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` imports these
  from zerojax.core.backend import Backend
  from zerojax.core.config import ConfigError, ZeroConfig
  from zerojax.core.policies import (Batch, Gather, HostOffload, LossScale, NvmeOffload,
                                     Precision, Quantize, Remat)
  from zerojax.core.grad import accumulate, value_and_grad
  from zerojax.core.master import MasterWeightsState, master_weights
  from zerojax.core.mesh import make_mesh
  from zerojax.core.plan import LeafPlan, ShardingPlan
  from zerojax.runtime.create import create_nnx, create_train_state
  from zerojax.core.step import ZeroStep, zero_step
  from zerojax.core.train_state import StepSettings, ZeroTrainState
  from zerojax.tools.config_file import load_config
  from zerojax.tools.export import export
  from zerojax.tools.options import DEFAULT_CORPUS


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once imported, a plain attribute
    return value
  if name in _SUBMODULES:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module 'zerojax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
