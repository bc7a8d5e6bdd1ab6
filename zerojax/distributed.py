"""`zerojax.distributed`: joining a multi-host run. `initialize()` (call it first, before
anything touches a device) finds the cluster (SLURM, Open MPI, Kubernetes, environment
variables) or does nothing alone; `check_agreement` stops processes whose config or plan
differ.
"""

from zerojax.core.distributed import *  # noqa: F401,F403 - the public surface, re-exported
from zerojax.core.distributed import __all__  # noqa: F401
