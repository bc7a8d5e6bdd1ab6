"""`zerojax.memory`: will it fit. The ZeRO paper's model-state estimate for real trees
(`estimate`, `paper_bytes`, `check_fits`), what a compiled step uses (`measure`, collective bytes
and schedules), and ahead-of-time compilation of the real step for a TPU or GPU pod
(`compile_for_topology`: a `ZeroConfig` or a config file path, a Flax module or a GPT preset
name).
"""

from zerojax.runtime.memory import *  # noqa: F401,F403 - the public surface, re-exported
from zerojax.runtime.memory import __all__  # noqa: F401
# The same function, also taking a config file path and a GPT preset name.
from zerojax.tools.estimate import compile_for_topology  # noqa: F401
