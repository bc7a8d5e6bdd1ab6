"""Models shipped for examples, tests and benchmarks."""
from zerojax.models.gpt import GPT, GPTConfig, PRESETS, loss_fn, nnx_gpt

__all__ = ["GPT", "GPTConfig", "PRESETS", "loss_fn", "nnx_gpt"]
