"""zerojax: ZeRO stages 0-3 for JAX as sharding plans over a device mesh.

Data flows one way: `ZeroConfig` -> `make_mesh` -> `ShardingPlan` -> `zero_step` -> checkpoint.
"""

from zerojax.config import ConfigError, ZeroConfig
from zerojax.config_file import load_config
from zerojax.mesh import make_mesh
from zerojax.plan import LeafPlan, ShardingPlan
from zerojax.grad import value_and_grad
from zerojax.step import create_nnx, create_train_state, zero_step, ZeroStep
from zerojax.train_state import StepSettings, ZeroTrainState

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "ZeroConfig", "make_mesh", "LeafPlan", "ShardingPlan", "create_nnx",
    "create_train_state", "zero_step", "ZeroStep", "value_and_grad", "ZeroTrainState",
    "StepSettings", "load_config",
]
