"""`zerojax.distributed`: joining a multi-host run. `initialize()` (call it first, before
anything touches a device) finds the cluster (SLURM, Open MPI, Kubernetes, environment
variables) or does nothing alone; `check_agreement` stops processes whose config or plan
differ.
"""

# The public surface, re-exported: the environment's names, start-up, the agreement check.
from zerojax.core.agreement import *  # noqa: F401,F403
from zerojax.core.agreement import __all__ as _agreement
from zerojax.core.distributed import *  # noqa: F401,F403
from zerojax.core.distributed import __all__ as _start_up
from zerojax.core.launch_env import *  # noqa: F401,F403
from zerojax.core.launch_env import __all__ as _environment

__all__ = [*_environment, *_start_up, *_agreement]
