"""Models shipped for examples, tests and benchmarks."""
from zerojax.models.gpt import GPT, GPTConfig, PRESETS, loss_fn, nnx_gpt
from zerojax.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "PRESETS", "loss_fn", "nnx_gpt", "Llama", "LlamaConfig"]
