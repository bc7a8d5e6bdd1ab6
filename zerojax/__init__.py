"""zerojax: ZeRO stages 0-3 for JAX as sharding plans over a device mesh.

Data flows one way: `ZeroConfig` -> `make_mesh` -> `ShardingPlan` -> `zero_step` -> checkpoint.
"""

from zerojax.core.config import ConfigError, ZeroConfig
from zerojax.tools.config_file import load_config
from zerojax.core.mesh import make_mesh
from zerojax.core.plan import LeafPlan, ShardingPlan
from zerojax.core.grad import value_and_grad
from zerojax.core.step import create_nnx, create_train_state, zero_step, ZeroStep
from zerojax.core.train_state import StepSettings, ZeroTrainState

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "ZeroConfig", "make_mesh", "LeafPlan", "ShardingPlan", "create_nnx",
    "create_train_state", "zero_step", "ZeroStep", "value_and_grad", "ZeroTrainState",
    "StepSettings", "load_config",
]
