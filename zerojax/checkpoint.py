"""`zerojax.checkpoint`: sharded, asynchronous checkpoints that restore onto any mesh or stage.
The public name of `zerojax.runtime.checkpoint` (the same functions and classes; see that
module for the details)."""

from zerojax.runtime.checkpoint import *  # noqa: F401,F403 - the public surface, re-exported
from zerojax.runtime.checkpoint import __all__  # noqa: F401
