"""Models shipped for examples, tests and benchmarks: `GPT` (linen and NNX) and `Llama` (NNX,
Hugging Face weights). The models layer sits above runtime (Llama's name mappings are
`zerojax.weights` ones) and below tools, which train and export them."""
from zerojax.models.gpt import GPT, GPTConfig, PRESETS, loss_fn, nnx_gpt
from zerojax.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "PRESETS", "loss_fn", "nnx_gpt", "Llama", "LlamaConfig"]
