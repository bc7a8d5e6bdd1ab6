"""A GPT-style decoder in Flax linen and NNX, used by the examples, tests and benchmarks.

Nothing in it is zerojax-specific (`GPTConfig.num_params` counts as zerojax's reports do):
zerojax shards it from leaf shapes like any user model.
``scan=True`` stacks the blocks with ``nn.scan`` (one compiled block, a leading layer axis on
every block parameter), as large-model code bases do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from zerojax.core.budget import num_params
from zerojax.runtime.memory import next_token_loss

__all__ = ["GPTConfig", "PRESETS", "Block", "GPT", "loss_fn", "nnx_gpt"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """The architecture of `GPT` (and `nnx_gpt`).

  Attributes:
    vocab_size: tokens in the vocabulary.
    seq_len: the longest sequence (rows of the position table).
    num_layers: decoder blocks.
    num_heads: attention heads.
    d_model: the model width.
    mlp_ratio: the MLP's hidden width over ``d_model``.
    scan: stack the blocks with ``nn.scan`` (a leading layer axis on every block parameter).
    remat: ``nn.remat`` around each block (the user's own remat).
    dtype: the compute dtype; ``None`` follows the parameters and inputs, which zerojax casts
      to ``ZeroConfig.compute_dtype`` where the model reads them.
    param_dtype: the parameters' dtype.
    tensor_parallel: Megatron-style partitioning metadata: the qkv and fc kernels split their
      output dimension over the ``tensor`` mesh axis, proj and out their input dimension
      (values unchanged; only the metadata zerojax's plan reads differs).
  """

  vocab_size: int = 256
  seq_len: int = 64
  num_layers: int = 2
  num_heads: int = 4
  d_model: int = 64
  mlp_ratio: int = 4
  scan: bool = True
  remat: bool = False  # nn.remat around each block (the user's own remat)
  # Compute dtype; None follows the parameters and inputs, which zerojax casts to
  # ZeroConfig.compute_dtype where the model reads them.
  dtype: Any = None
  param_dtype: Any = jnp.float32
  # Megatron-style tensor parallelism through Flax partitioning metadata: the qkv and fc
  # kernels split their output dimension over the ``tensor`` mesh axis, proj and out their
  # input dimension. Values are unchanged; only the metadata (read by zerojax's plan) differs.
  tensor_parallel: bool = False

  @property
  def head_dim(self) -> int:
    """The per-head size, ``d_model // num_heads``."""
    return self.d_model // self.num_heads

  def num_params(self) -> int:
    """Parameters of `GPT` with this config, counted from its (abstract) parameter tree.

    Returns:
      The number of parameters.
    """
    tokens = jax.ShapeDtypeStruct((1, self.seq_len), jnp.int32)
    return num_params(jax.eval_shape(lambda t: GPT(self).init(jax.random.key(0), t), tokens))


PRESETS = {
    "tiny": GPTConfig(),
    # 12 layers, d=512, vocab 50257: ~89M parameters (the memory benchmark's model).
    "gpt-89m": GPTConfig(vocab_size=50257, seq_len=128, num_layers=12, num_heads=8, d_model=512),
    "small": GPTConfig(vocab_size=256, seq_len=128, num_layers=4, num_heads=4, d_model=128),
    # Pod-scale shapes for ahead-of-time compilation (`zerojax compile`): 36 x d 4096 is
    # 7.52B parameters, the ZeRO paper's Figure-1 size; 86 x d 8192 is 69.8B, a 70B-class
    # decoder.
    "gpt-7.5b": GPTConfig(vocab_size=32000, seq_len=1024, num_layers=36, num_heads=32,
                          d_model=4096),
    "gpt-70b": GPTConfig(vocab_size=32000, seq_len=1024, num_layers=86, num_heads=64,
                         d_model=8192),
}


class Block(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x, _=None):
    cfg = self.cfg
    tp = {"qkv": (None, "tensor"), "fc": (None, "tensor"), "proj": ("tensor", None),
          "out": ("tensor", None)}

    def dense(n, name, bias=True):
      init = nn.initializers.lecun_normal()
      if cfg.tensor_parallel:
        init = nn.with_partitioning(init, tp[name])
      return nn.Dense(n, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                      kernel_init=init, name=name)

    B, T, D = x.shape
    h = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="ln1")(x)
    # No qkv bias: the key bias has an exactly-zero gradient (softmax is shift invariant), so
    # Adam would turn its rounding noise into lr-sized updates.
    qkv = dense(3 * D, "qkv", bias=False)(h).reshape(B, T, 3, cfg.num_heads, cfg.head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(cfg.head_dim).astype(q.dtype)
    mask = jnp.tril(jnp.ones((T, T), bool))
    att = jnp.where(mask, att, jnp.finfo(att.dtype).min)
    att = jax.nn.softmax(att.astype(jnp.float32), axis=-1).astype(v.dtype)
    y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, D)
    x = x + dense(D, "proj")(y)
    h = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="ln2")(x)
    h = checkpoint_name(nn.gelu(dense(cfg.mlp_ratio * D, "fc")(h)), "mlp_hidden")
    x = x + dense(D, "out")(h)
    return checkpoint_name(x, "block_out"), None


class GPT(nn.Module):
  """The GPT decoder in linen: ``tokens (B, T) int -> logits (B, T, vocab) float32``.

  Attributes:
    cfg: the `GPTConfig`.
  """

  cfg: GPTConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    B, T = tokens.shape
    emb = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                   name="wte")
    x = emb(tokens) + nn.Embed(cfg.seq_len, cfg.d_model, dtype=cfg.dtype,
                               param_dtype=cfg.param_dtype, name="wpe")(jnp.arange(T))[None]
    block = nn.remat(Block) if cfg.remat else Block
    if cfg.scan:
      x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=cfg.num_layers,
                     metadata_params={nn.PARTITION_NAME: None})(cfg, name="blocks")(x, None)
    else:
      for i in range(cfg.num_layers):
        x, _ = block(cfg, name=f"block_{i}")(x)
    x = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="ln_f")(x)
    return nn.Dense(cfg.vocab_size, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    name="head")(x).astype(jnp.float32)


loss_fn = next_token_loss  # mean next-token cross entropy in fp32, as `zerojax train` computes it


# -- NNX ------------------------------------------------------------------------------------------


def nnx_gpt(cfg: GPTConfig, rngs: Any):
  """The same architecture as an ``nnx.Module`` (unscanned blocks).

  Args:
    cfg: the `GPTConfig` (``scan`` and ``remat`` do not apply).
    rngs: the ``nnx.Rngs`` of the initialisation.

  Returns:
    The initialised ``nnx.Module``, called as ``model(tokens)`` for float32 logits.
  """

  class NBlock(nnx.Module):
    def __init__(self, rngs):
      D = cfg.d_model
      lin = lambda i, o, bias=True: nnx.Linear(i, o, use_bias=bias, dtype=cfg.dtype,
                                               param_dtype=cfg.param_dtype, rngs=rngs)
      self.ln1 = nnx.LayerNorm(D, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
      self.qkv, self.proj = lin(D, 3 * D, bias=False), lin(D, D)
      self.ln2 = nnx.LayerNorm(D, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
      self.fc, self.out = lin(D, cfg.mlp_ratio * D), lin(cfg.mlp_ratio * D, D)

    def __call__(self, x):
      B, T, D = x.shape
      qkv = self.qkv(self.ln1(x)).reshape(B, T, 3, cfg.num_heads, cfg.head_dim)
      q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
      att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(cfg.head_dim).astype(q.dtype)
      att = jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, jnp.finfo(att.dtype).min)
      att = jax.nn.softmax(att.astype(jnp.float32), axis=-1).astype(v.dtype)
      x = x + self.proj(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, D))
      return x + self.out(nnx.gelu(self.fc(self.ln2(x))))

  class NGPT(nnx.Module):
    def __init__(self, rngs):
      emb = lambda n: nnx.Embed(n, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                rngs=rngs)
      self.wte, self.wpe = emb(cfg.vocab_size), emb(cfg.seq_len)
      self.blocks = nnx.List([NBlock(rngs) for _ in range(cfg.num_layers)])
      self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                rngs=rngs)
      self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, dtype=cfg.dtype,
                             param_dtype=cfg.param_dtype, rngs=rngs)

    def __call__(self, tokens):
      x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]
      for b in self.blocks:
        x = b(x)
      return self.head(self.ln_f(x)).astype(jnp.float32)

  return NGPT(rngs)
