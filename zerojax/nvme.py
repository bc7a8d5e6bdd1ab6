"""`zerojax.nvme`: the optimizer state in files (``offload_optimizer="nvme"``), streamed
through the host a chunk at a time. `create_train_state` returns the state, its plan and the
`NvmeOptimizer` whose ``step(train_step)`` runs the device and host parts.
"""

from zerojax.runtime.nvme import *  # noqa: F401,F403 - the public surface, re-exported
from zerojax.runtime.nvme import __all__  # noqa: F401
