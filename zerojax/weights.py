"""`zerojax.weights`: Hugging Face safetensors checkpoints read shard by shard into a plan
(`safetensors_source`, `load_safetensors`), written back (`save_hf`), and their name mappings
(`TensorMap`).
"""

from zerojax.runtime.weights import *  # noqa: F401,F403 - the public surface, re-exported
from zerojax.runtime.weights import __all__  # noqa: F401
