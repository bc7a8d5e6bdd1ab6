"""`zerojax.weights`: Hugging Face safetensors checkpoints read shard by shard into a plan, and
their name mappings. The public name of `zerojax.runtime.weights` (the same functions and
classes; see that module for the details)."""

from zerojax.runtime.weights import *  # noqa: F401,F403 - the public surface, re-exported
from zerojax.runtime.weights import __all__  # noqa: F401
