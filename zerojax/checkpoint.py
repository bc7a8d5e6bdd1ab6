"""`zerojax.checkpoint`: sharded, asynchronous checkpoints that restore onto any mesh or stage
(`Checkpointer`, `abstract_train_state`). `zerojax.export` consolidates one into a single
``.npz``, ``.safetensors`` or Hugging Face directory, as ``zerojax export`` does.
"""

from zerojax.runtime.checkpoint import *  # noqa: F401,F403 - the public surface, re-exported
from zerojax.runtime.checkpoint import __all__ as _all
from zerojax.runtime.create import abstract_train_state  # every offload, NVMe included

__all__ = [*_all, "abstract_train_state"]
