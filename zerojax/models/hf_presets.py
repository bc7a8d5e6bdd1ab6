"""Hugging Face model families as presets, for the commands that size, plan, compile and train a
model without its weights (`zerojax estimate`, `plan`, `compile`, `train`).

`HF_PRESETS` holds the ``config.json`` facts of published checkpoints (the shapes, the rope, the
norms; no weights); `zerojax.models.llama.from_hf_config` reads them as it reads a checkpoint
directory's file. `LinenLlama` presents the NNX `zerojax.models.llama.Llama` as a Flax linen
module, so the linen train state these commands compile (``create_train_state``,
``lm_train_step``) takes it as it takes a GPT preset.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax import nnx

from zerojax.models import llama

__all__ = ["HF_PRESETS", "LinenLlama"]

_LLAMA3 = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
               hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
               mlp_bias=False, bos_token_id=128000, eos_token_id=128001)

# config.json of each published checkpoint (meta-llama/Meta-Llama-3-8B, -70B, Qwen/Qwen2.5-7B,
# mistralai/Mistral-7B-v0.1), the fields that shape the model.
HF_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "llama-3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
    "qwen2.5-7b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                       vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=131072, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, hidden_act="silu", tie_word_embeddings=False,
                       use_sliding_window=False, sliding_window=131072, max_window_layers=28,
                       bos_token_id=151643, eos_token_id=151643),
    "mistral-7b": dict(model_type="mistral", architectures=["MistralForCausalLM"],
                       vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0,
                       sliding_window=4096, hidden_act="silu", tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2),
}


class LinenLlama(nn.Module):
  """`zerojax.models.llama.Llama` as a linen module: ``tokens (B, T) -> logits``.

  Its parameters are one ``"llama"`` entry holding the NNX model's ``nnx.Param`` state as a
  plain dict (the NNX paths: ``llama/layers/mlp/up_proj/kernel``, scanned layers stacked), so a
  plan shards exactly the leaves `zerojax.models.llama.Llama` has.

  Attributes:
    cfg: the `zerojax.models.llama.LlamaConfig`.
  """

  cfg: Any

  @nn.compact
  def __call__(self, tokens):
    # The structure comes from an abstract model (nothing allocated); the values from the
    # parameters, so zerojax's per-use gathers reach the layers as they read their kernels.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: llama.Llama(self.cfg, nnx.Rngs(0))))
    params = self.param("llama", lambda rng: nnx.to_pure_dict(nnx.state(
        llama.Llama(self.cfg, nnx.Rngs(rng)), nnx.Param)))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)(tokens)
