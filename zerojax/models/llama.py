"""A Llama-architecture decoder in Flax NNX that loads and exports Hugging Face weights.

RMSNorm, rotary position embeddings (the Hugging Face "rotate half" layout), a SwiGLU MLP,
grouped-query attention and optional tied embeddings.

One implementation serves the Llama-like families; their differences are configuration
(``LlamaConfig.model_type`` says which Hugging Face family a config reads and writes):

* ``llama`` (Llama 1-3.x): default or ``llama3`` rope scaling; optional ``attention_bias``
  (q/k/v/o) and ``mlp_bias``.
* ``qwen2`` (Qwen2, Qwen2.5): biases on q/k/v (not o); tied embeddings on small sizes;
  sliding-window layers when ``use_sliding_window`` is true (layers ``>= max_window_layers``).
* ``qwen3``: per-head RMSNorm of queries and keys (``q_norm``/``k_norm``) before the rotary
  embedding, an explicit ``head_dim``, optional ``attention_bias``.
* ``mistral``: sliding-window attention (a query sees the last ``sliding_window`` positions,
  itself included) on every layer.

`from_hf_config` refuses, by name, a ``config.json`` field that changes the computation and
that this model does not implement. The decoder layers are created with
``nnx.vmap`` (every layer parameter has a leading layer axis) and run with ``jax.lax.scan``,
so one layer is compiled and a sharded layer is gathered one at a time.

Parameters are stored as Flax stores them (``Linear`` kernels are ``(in, out)``);
`hf_mapping` maps each leaf onto the Hugging Face tensor names (``model.layers.{i}...``,
PyTorch's ``(out, in)``), for `zerojax.runtime.weights.load_safetensors` and `zerojax.runtime.weights.save_hf`.

Optional LoRA adapters (``lora_rank > 0``) add ``lora_a``/``lora_b`` (`flax.nnx.LoRAParam`) to
the projections named in ``lora_targets``; train only them with ``wrt=nnx.LoRAParam``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.core.backend import for_platform
from zerojax.runtime.weights import TensorMap

__all__ = ["LlamaConfig", "Llama", "hf_mapping", "from_hf_config", "hf_config", "FAMILIES",
           "ATTENTIONS", "fused_attention",
           "checkpoint_model", "segment_positions"]

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mistral": "MistralForCausalLM"}
_LAYER_TYPES = ("full_attention", "sliding_attention")
ATTENTIONS = ("xla", "cudnn")
_FUSED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def fused_attention(platform: str, dtype: Any, sliding_window: int | None) -> str:
  """The `LlamaConfig.attention` a model computing in ``dtype`` on ``platform`` gets by
  default: ``'cudnn'`` where the backend has a fused kernel (`Backend.fused_attention`:
  XLA:GPU) in bfloat16 or float16 without a sliding window (memory
  linear in the sequence, as transformers' SDPA attention), else ``'xla'``.

  Args:
    platform: the devices' platform (``'gpu'``, ``'tpu'``, ``'cpu'``).
    dtype: the compute dtype.
    sliding_window: the model's window, or None.

  Returns:
    ``'cudnn'`` or ``'xla'``.
  """
  fused = (for_platform(platform).fused_attention and jnp.dtype(dtype) in _FUSED_DTYPES
           and sliding_window is None)
  return "cudnn" if fused else "xla"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The architecture; field names follow Hugging Face's ``LlamaConfig``.

  The fields not listed below are Hugging Face's, with its meaning.

  Attributes:
    model_type: the Hugging Face family, one of ``FAMILIES`` (``'llama'``, ``'qwen2'``,
      ``'qwen3'``, ``'mistral'``).
    head_dim: per-head size; ``None`` is ``hidden_size // num_attention_heads``.
    rope_llama3: Llama 3.1 rope scaling ``(factor, low_freq_factor, high_freq_factor,
      original_max_position_embeddings)``; ``None`` is the default rotary embedding.
    qkv_bias: biases on ``q_proj``, ``k_proj`` and ``v_proj``.
    o_bias: a bias on ``o_proj``.
    mlp_bias: biases on ``gate_proj``, ``up_proj`` and ``down_proj``.
    qk_norm: Qwen3's RMSNorm of each query and key head before the rotary embedding.
    sliding_window: query ``i`` sees keys ``i - sliding_window < j <= i`` (on the layers
      ``layer_types`` names, every layer when it is ``None``).
    layer_types: ``'full_attention'`` or ``'sliding_attention'`` per layer.
    dtype: the compute dtype.
    param_dtype: the parameters' dtype.
    remat: ``jax.checkpoint`` around each scanned layer.
    attention: ``'xla'`` (the scores materialised, as transformers' eager attention) or
      ``'cudnn'`` (``jax.nn.dot_product_attention``'s fused kernel: GPU only, bfloat16 or
      float16, no sliding window, no packed segments; memory linear in the sequence).
    lora_rank: LoRA adapters' rank (0: none).
    lora_alpha: LoRA's scale numerator (the adapters are scaled by ``lora_alpha / rank``).
    lora_targets: the projections that get adapters.

  Raises:
    ValueError: a field is out of range, or the fields are inconsistent with each other or
      with ``model_type``'s family (so that an export reads back as this model).
  """

  model_type: str = "llama"  # the Hugging Face family: one of FAMILIES
  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 176
  num_hidden_layers: int = 2
  num_attention_heads: int = 4
  num_key_value_heads: int = 2
  head_dim: int | None = None  # default hidden_size // num_attention_heads
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  # Llama 3.1 rope scaling ("rope_type": "llama3"): (factor, low_freq_factor, high_freq_factor,
  # original_max_position_embeddings); None is the default rotary embedding.
  rope_llama3: tuple[float, float, float, int] | None = None
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj
  o_bias: bool = False  # a bias on o_proj
  mlp_bias: bool = False  # biases on gate_proj, up_proj, down_proj
  qk_norm: bool = False  # Qwen3: RMSNorm of each query and key head before the rotary embedding
  # Sliding-window attention: query i sees keys i - sliding_window < j <= i. ``layer_types``
  # ("full_attention" / "sliding_attention" per layer) says which layers use it; None with a
  # window means every layer.
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  dtype: Any = jnp.float32  # compute dtype
  param_dtype: Any = jnp.float32
  remat: bool = False  # jax.checkpoint around each scanned layer
  # "xla": the scores materialised, as transformers' eager attention computes them; "cudnn":
  # cuDNN's fused kernel (`jax.nn.dot_product_attention`), XLA:GPU only, bfloat16 or float16,
  # no sliding window, no packed segments: memory linear in the sequence, not quadratic.
  attention: str = "xla"
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ("q_proj", "v_proj")

  def __post_init__(self):
    if self.model_type not in FAMILIES:
      raise ValueError(f"LlamaConfig.model_type={self.model_type!r} is not supported: allowed "
                       f"are {FAMILIES}")
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads"):
      v = getattr(self, f)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"LlamaConfig.{f}={v!r} is invalid: a positive integer")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"LlamaConfig.num_attention_heads={self.num_attention_heads} must be a "
                       f"multiple of num_key_value_heads={self.num_key_value_heads}")
    if self.head_dim is None and self.hidden_size % self.num_attention_heads:
      raise ValueError(f"LlamaConfig.hidden_size={self.hidden_size} does not divide by "
                       f"num_attention_heads={self.num_attention_heads}; set head_dim")
    if self.lora_rank < 0 or not isinstance(self.lora_rank, int):
      raise ValueError(f"LlamaConfig.lora_rank={self.lora_rank!r} is invalid: an integer >= 0")
    bad = [t for t in self.lora_targets if t not in _ATTN + _MLP]
    if bad:
      raise ValueError(f"LlamaConfig.lora_targets has {bad}: allowed are {_ATTN + _MLP}")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"LlamaConfig.attention={self.attention!r} is invalid: one of "
                       f"{ATTENTIONS}")
    if self.attention == "cudnn" and (jnp.dtype(self.dtype) not in _FUSED_DTYPES
                                      or self.sliding_window is not None):
      raise ValueError(f"LlamaConfig.attention='cudnn' needs dtype bfloat16 or float16 and no "
                       f"sliding_window (given dtype={jnp.dtype(self.dtype).name}, "
                       f"sliding_window={self.sliding_window!r}); use attention='xla'")
    w = self.sliding_window
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
      raise ValueError(f"LlamaConfig.sliding_window={w!r} is invalid: a positive integer or "
                       "None")
    if self.layer_types is not None:
      lt = tuple(self.layer_types)
      if len(lt) != self.num_hidden_layers or any(t not in _LAYER_TYPES for t in lt):
        raise ValueError(f"LlamaConfig.layer_types={list(lt)!r} is invalid: one of "
                         f"{_LAYER_TYPES} per layer ({self.num_hidden_layers} layers)")
      if "sliding_attention" in lt and w is None:
        raise ValueError("LlamaConfig.layer_types has 'sliding_attention' layers but "
                         "sliding_window=None: set the window")
      object.__setattr__(self, "layer_types", lt)
    # What each family's Hugging Face model can express (so that export writes a config that
    # transformers reads as this model).
    fam, why = self.model_type, None
    if fam == "llama" and (self.qkv_bias != self.o_bias):
      why = "qkv_bias and o_bias differ (Llama's attention_bias sets all four)"
    elif fam == "llama" and (self.qk_norm or w is not None):
      why = "qk_norm or sliding_window is set (Llama has neither)"
    elif fam == "qwen2" and not (self.qkv_bias and not self.o_bias and not self.mlp_bias
                                 and not self.qk_norm):
      why = "Qwen2 has q/k/v biases, no o_proj or MLP bias and no qk_norm"
    elif fam == "qwen3" and not (self.qk_norm and self.qkv_bias == self.o_bias
                                 and not self.mlp_bias):
      why = "Qwen3 has qk_norm, attention_bias on all of q/k/v/o or none, no MLP bias"
    elif fam == "mistral" and (self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm
                               or "full_attention" in (self.layer_types or ())):
      why = "Mistral has no biases, no qk_norm, and one window for every layer"
    if why:
      flags = ", ".join(f"{k}={getattr(self, k)!r}" for k in (
          "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "sliding_window", "layer_types"))
      raise ValueError(f"LlamaConfig(model_type={fam!r}) is inconsistent: {why} (given "
                       f"{flags})")

  @property
  def hd(self) -> int:
    """The per-head size: ``head_dim``, else ``hidden_size // num_attention_heads``."""
    return self.head_dim or self.hidden_size // self.num_attention_heads

  def layer_windows(self) -> tuple[int, ...]:
    """Each layer's attention window.

    Returns:
      One window per layer; 0 is full causal attention.
    """
    if self.sliding_window is None:
      return (0,) * self.num_hidden_layers
    types = self.layer_types or ("sliding_attention",) * self.num_hidden_layers
    return tuple(self.sliding_window if t == "sliding_attention" else 0 for t in types)

  def num_params(self) -> int:
    """Parameters of the base model with this config, counted from shapes.

    Returns:
      The count, without LoRA adapters.
    """
    d, i, hd = self.hidden_size, self.intermediate_size, self.hd
    q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
    layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * i
    layer += (q + 2 * kv) * self.qkv_bias + d * self.o_bias + (2 * i + d) * self.mlp_bias
    layer += 2 * hd * self.qk_norm
    head = 0 if self.tie_word_embeddings else d * self.vocab_size
    return self.vocab_size * d + self.num_hidden_layers * layer + d + head


class RMSNorm(nnx.Module):
  """``x / rms(x) * scale``, normalised in fp32 as Hugging Face's ``LlamaRMSNorm``."""

  def __init__(self, dim: int, eps: float, *, dtype: Any, param_dtype: Any):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps, self.dtype = eps, dtype

  def __call__(self, x):
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(self.dtype) * h.astype(self.dtype)


class Proj(nnx.Module):
  """A linear projection (bias optional), with an optional LoRA adapter (``x A B * alpha/r``)."""

  def __init__(self, din: int, dout: int, cfg: LlamaConfig, lora: bool, rngs: nnx.Rngs,
               bias: bool = False):
    init = nnx.initializers.normal(0.02)
    self.kernel = nnx.Param(init(rngs.params(), (din, dout), cfg.param_dtype))
    self.bias = nnx.data(nnx.Param(jnp.zeros((dout,), cfg.param_dtype)) if bias else None)
    self.dtype = cfg.dtype
    self.lora_a = self.lora_b = nnx.data(None)
    if lora:
      r = cfg.lora_rank
      self.lora_a = nnx.data(nnx.LoRAParam(
          nnx.initializers.he_uniform()(rngs.params(), (din, r), cfg.param_dtype)))
      # B starts at zero, so the adapted model starts as the base model.
      self.lora_b = nnx.data(nnx.LoRAParam(jnp.zeros((r, dout), cfg.param_dtype)))
      self.lora_scale = cfg.lora_alpha / r

  def __call__(self, x):
    x = x.astype(self.dtype)
    y = x @ self.kernel[...].astype(self.dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    if self.lora_a is not None:
      a, b = self.lora_a[...].astype(self.dtype), self.lora_b[...].astype(self.dtype)
      y = y + (x @ a @ b) * jnp.asarray(self.lora_scale, self.dtype)
    return y


class Attention(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, hd = cfg.hidden_size, cfg.hd
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    lo = lambda n: cfg.lora_rank > 0 and n in cfg.lora_targets
    self.q_proj = Proj(d, h * hd, cfg, lo("q_proj"), rngs, cfg.qkv_bias)
    self.k_proj = Proj(d, kv * hd, cfg, lo("k_proj"), rngs, cfg.qkv_bias)
    self.v_proj = Proj(d, kv * hd, cfg, lo("v_proj"), rngs, cfg.qkv_bias)
    self.o_proj = Proj(h * hd, d, cfg, lo("o_proj"), rngs, cfg.o_bias)
    norm = lambda: RMSNorm(hd, cfg.rms_norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    self.q_norm = nnx.data(norm() if cfg.qk_norm else None)
    self.k_norm = nnx.data(norm() if cfg.qk_norm else None)
    self.cfg = cfg

  def __call__(self, x, cos, sin, window=None, segment_ids=None):
    """``window``: this layer's sliding window (a traced int, 0 for full attention), or None
    when no layer of the model has one. ``segment_ids`` ``(B, T)``: a query sees only keys of
    its own segment (packed documents), or None."""
    cfg = self.cfg
    B, T, _ = x.shape
    h, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hd
    q = self.q_proj(x).reshape(B, T, h, hd)
    k = self.k_proj(x).reshape(B, T, kv, hd)
    if self.q_norm is not None:  # per head, before the rotary embedding
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    v = self.v_proj(x).reshape(B, T, kv, hd)
    if cfg.attention == "cudnn":
      if segment_ids is not None:
        raise ValueError("LlamaConfig.attention='cudnn' takes no segment_ids (packed rows); "
                         "use attention='xla' or unpacked rows")
      y = jax.nn.dot_product_attention(q.astype(cfg.dtype), k.astype(cfg.dtype),
                                       v.astype(cfg.dtype), is_causal=True,
                                       implementation="cudnn")
      return self.o_proj(y.reshape(B, T, h * hd))
    # Grouped-query attention: query head j reads key/value head j // (h // kv).
    q = q.reshape(B, T, kv, h // kv, hd)
    att = jnp.einsum("bqgrd,bkgd->bgrqk", q, k).astype(jnp.float32) * hd ** -0.5
    qi, ki = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    mask = ki <= qi
    if window is not None:  # query i sees keys i - window < j <= i; window 0 sees all
      mask = mask & (qi - ki < jnp.where(window > 0, window, T))
    if segment_ids is not None:  # (B, 1, 1, T, T) against att's (B, kv, h // kv, T, T)
      mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
    att = jnp.where(mask, att, jnp.finfo(jnp.float32).min)
    att = jax.nn.softmax(att, axis=-1).astype(cfg.dtype)
    y = jnp.einsum("bgrqk,bkgd->bqgrd", att, v).reshape(B, T, h * hd)
    return self.o_proj(y)


class MLP(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, i = cfg.hidden_size, cfg.intermediate_size
    lo = lambda n: cfg.lora_rank > 0 and n in cfg.lora_targets
    self.gate_proj = Proj(d, i, cfg, lo("gate_proj"), rngs, cfg.mlp_bias)
    self.up_proj = Proj(d, i, cfg, lo("up_proj"), rngs, cfg.mlp_bias)
    self.down_proj = Proj(i, d, cfg, lo("down_proj"), rngs, cfg.mlp_bias)

  def __call__(self, x):
    return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.dtype,
                           param_dtype=cfg.param_dtype)
    self.input_layernorm = norm()
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = norm()
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, cos, sin, window=None, segment_ids=None):
    x = x + self.self_attn(self.input_layernorm(x), cos, sin, window, segment_ids)
    return x + self.mlp(self.post_attention_layernorm(x))


def _rope(x, cos, sin):
  """Rotary embedding, Hugging Face layout: the two halves of each head are the pairs."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  rot = jnp.concatenate([-x2, x1], axis=-1)
  return (x * cos + rot * sin).astype(x.dtype)


def _inv_freq(cfg: LlamaConfig) -> jnp.ndarray:
  hd = cfg.hd
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  if cfg.rope_llama3 is None:
    return inv
  # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band
  # between interpolates smoothly.
  factor, low, high, old_len = cfg.rope_llama3
  wavelen = 2 * jnp.pi / inv
  scaled = jnp.where(wavelen > old_len / low, inv / factor, inv)
  smooth = (old_len / wavelen - low) / (high - low)
  mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def _rope_tables(cfg: LlamaConfig, T: int, positions=None):
  """``(cos, sin)`` of shape ``(1, T, 1, hd)`` for positions ``0..T-1``, or ``(B, T, 1, hd)``
  for given ``positions`` ``(B, T)``."""
  inv = _inv_freq(cfg)
  pos = jnp.arange(T, dtype=jnp.float32)[None] if positions is None else (
      jnp.asarray(positions).astype(jnp.float32))
  freqs = pos[..., None] * inv  # (B or 1, T, hd / 2)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  cos, sin = jnp.cos(emb)[:, :, None], jnp.sin(emb)[:, :, None]
  return cos.astype(cfg.dtype), sin.astype(cfg.dtype)


def segment_positions(segment_ids):
  """Each token's position within its segment: ``[[1,1,1,2,2]] -> [[0,1,2,0,1]]``."""
  seg = jnp.asarray(segment_ids)
  idx = jnp.broadcast_to(jnp.arange(seg.shape[1]), seg.shape)
  first = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  return idx - jax.lax.cummax(jnp.where(first, idx, 0), axis=1)


class Llama(nnx.Module):
  """Llama causal LM: ``tokens (B, T) int -> logits (B, T, vocab) float32``.

  The decoder layers are stacked (a leading layer axis) and run under ``jax.lax.scan``.

  Args:
    cfg: the `LlamaConfig`.
    rngs: the ``nnx.Rngs`` of the initialisation.

  Attributes:
    cfg: the `LlamaConfig`.
    embed_tokens: the token embedding.
    layers: the stacked decoder layers.
    norm: the final RMSNorm.
    lm_head: the output projection, ``None`` with tied embeddings.
  """

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype,
                                  embedding_init=nnx.initializers.normal(0.02), rngs=rngs)

    @nnx.split_rngs(splits=cfg.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_layers(rngs):
      return DecoderLayer(cfg, rngs)

    self.layers = make_layers(rngs)
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.dtype,
                        param_dtype=cfg.param_dtype)
    self.lm_head = None if cfg.tie_word_embeddings else Proj(
        cfg.hidden_size, cfg.vocab_size, dataclasses.replace(cfg, lora_rank=0), False, rngs)

  def __call__(self, tokens, segment_ids=None, positions=None):
    """The logits of a batch of token rows.

    Args:
      tokens: ``(B, T)`` integer token ids.
      segment_ids: ``(B, T)`` for packed rows: attention stays within a segment (0 is
        padding).
      positions: ``(B, T)`` token positions; by default they restart at each segment.

    Returns:
      ``(B, T, vocab)`` float32 logits.
    """
    cfg = self.cfg
    x = self.embed_tokens(tokens).astype(cfg.dtype)
    if segment_ids is not None and positions is None:
      positions = segment_positions(segment_ids)
    cos, sin = _rope_tables(cfg, tokens.shape[1], positions)
    graphdef, state = nnx.split(self.layers)
    windows = cfg.layer_windows()
    if any(windows):  # each layer's window rides along the scan
      xs = (state, jnp.asarray(windows, jnp.int32))
    else:
      xs = (state, None)

    def body(x, layer):
      layer_state, window = layer
      return nnx.merge(graphdef, layer_state)(x, cos, sin, window, segment_ids), None

    if cfg.remat:
      body = jax.checkpoint(body)
    x, _ = jax.lax.scan(body, x, xs)
    x = self.norm(x)
    if self.lm_head is None:
      logits = x @ self.embed_tokens.embedding[...].astype(cfg.dtype).T
    else:
      logits = self.lm_head(x)
    return logits.astype(jnp.float32)


# -- Hugging Face names and config ---------------------------------------------------------------


def hf_mapping(cfg: LlamaConfig) -> dict[str, TensorMap]:
  """``{zerojax leaf path: TensorMap}`` for the Hugging Face checkpoint of ``cfg``'s family
  (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``:
  they share these names).

  Per-layer tensors ``model.layers.{i}.<name>`` are stacked on the leading layer axis; linear
  weights are transposed (PyTorch ``(out, in)``, Flax ``(in, out)``); biases and norms are not.
  LoRA adapters have no Hugging Face name (they are not in the base checkpoint).
  """
  m = {"embed_tokens/embedding": TensorMap("model.embed_tokens.weight"),
       "norm/scale": TensorMap("model.norm.weight")}
  for n in ("input_layernorm", "post_attention_layernorm"):
    m[f"layers/{n}/scale"] = TensorMap(f"model.layers.{{i}}.{n}.weight")
  bias = {"q_proj": cfg.qkv_bias, "k_proj": cfg.qkv_bias, "v_proj": cfg.qkv_bias,
          "o_proj": cfg.o_bias, **{n: cfg.mlp_bias for n in _MLP}}
  for block, names in (("self_attn", _ATTN), ("mlp", _MLP)):
    for n in names:
      m[f"layers/{block}/{n}/kernel"] = TensorMap(f"model.layers.{{i}}.{block}.{n}.weight",
                                                  transpose=True)
      if bias[n]:
        m[f"layers/{block}/{n}/bias"] = TensorMap(f"model.layers.{{i}}.{block}.{n}.bias")
  if cfg.qk_norm:
    for n in ("q_norm", "k_norm"):
      m[f"layers/self_attn/{n}/scale"] = TensorMap(f"model.layers.{{i}}.self_attn.{n}.weight")
  if not cfg.tie_word_embeddings:
    m["lm_head/kernel"] = TensorMap("lm_head.weight", transpose=True)
  return m


def read_hf_config(config: dict | str | os.PathLike) -> dict:
  """A ``config.json`` as a dict (given a dict, the file, or its directory)."""
  if isinstance(config, dict):
    return config
  path = os.fspath(config)
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  with open(path) as f:
    return json.load(f)


def _refuse(field: str, value: Any, allowed: str) -> ValueError:
  return ValueError(f"config {field}={value!r} is not supported by zerojax.models.llama: "
                    f"{allowed}")


def _rope_of_config(config: dict) -> tuple[float, tuple[float, float, float, int] | None]:
  """``(rope_theta, llama3 scaling or None)`` from either spelling (v5 ``rope_parameters`` or
  the older ``rope_scaling`` + ``rope_theta``)."""
  key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
  rope = config.get(key) or {}
  if not isinstance(rope, dict):
    raise _refuse(key, rope, "a dict of rope parameters, or null")
  if rope and all(isinstance(v, dict) for v in rope.values()):
    raise _refuse(key, rope, "one set of rope parameters for every layer (not per layer type)")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  theta = float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)
  prf = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
  if prf not in (None, 1, 1.0):
    raise _refuse("partial_rotary_factor", prf, "only 1.0 (the rotary embedding covers the "
                  "whole head)")
  if rope_type == "default":
    return theta, None
  if rope_type != "llama3":
    raise _refuse(f"{key}.rope_type", rope_type, "the default rotary embedding or 'llama3'")
  try:
    return theta, (float(rope["factor"]), float(rope["low_freq_factor"]),
                   float(rope["high_freq_factor"]),
                   int(rope.get("original_max_position_embeddings")
                       or config["max_position_embeddings"]))
  except KeyError as e:
    raise ValueError(f"config {key}={rope} lacks {e} (needed by rope_type 'llama3': factor, "
                     "low_freq_factor, high_freq_factor, original_max_position_embeddings)"
                     ) from None


def _sliding(config: dict, arch: str, n_layers: int
             ) -> tuple[int | None, tuple[str, ...] | None]:
  """``(sliding_window, layer_types)`` as transformers reads them for ``arch``."""
  window, types = config.get("sliding_window"), config.get("layer_types")
  if arch == "llama":
    # LlamaForCausalLM has no sliding window: a window in its config would be ignored there.
    if window is not None or config.get("use_sliding_window"):
      raise _refuse("sliding_window", window, "model_type 'llama' has no sliding-window "
                    "attention (transformers' LlamaForCausalLM would ignore it); use "
                    "model_type 'mistral' for a window on every layer, or remove the field")
    if types is not None and set(types) != {"full_attention"}:
      raise _refuse("layer_types", types, "model_type 'llama' has full attention only")
    return None, None
  if arch == "mistral":
    # MistralForCausalLM applies the window to every layer (it reads neither
    # use_sliding_window nor layer_types); a missing key is its default, 4096.
    window = config.get("sliding_window", 4096)
    if types is not None and window is not None and set(types) != {"sliding_attention"}:
      raise _refuse("layer_types", types, "MistralForCausalLM applies sliding_window="
                    f"{window} to every layer and ignores layer_types; a per-layer mix is "
                    "not what it computes (remove layer_types, or set sliding_window null)")
  else:  # qwen2 / qwen3: only with use_sliding_window, on layers >= max_window_layers
    # (a missing sliding_window is their default 4096; an explicit null is no window)
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window") else None
    if window is None:
      types = None
    elif types is None:
      mwl = int(config.get("max_window_layers", 28))
      types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(n_layers)]
  if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                             or window < 1):
    raise _refuse("sliding_window", window, "a positive integer or null")
  if types is not None:
    bad = [t for t in types if t not in _LAYER_TYPES]
    if bad or len(types) != n_layers:
      raise _refuse("layer_types", types, f"one of {_LAYER_TYPES} per layer ({n_layers})")
    types = tuple(types)
    if "sliding_attention" not in types:
      window, types = None, None
  return window, types


def from_hf_config(config: dict | str | os.PathLike, **overrides: Any) -> LlamaConfig:
  """A `LlamaConfig` from a Hugging Face ``config.json`` (a dict, the file, or its directory).

  Reads ``model_type`` ``llama``, ``qwen2``, ``qwen3`` and ``mistral`` (see the module's
  docstring for what each adds). ``overrides`` set zerojax-only fields (``dtype``,
  ``param_dtype``, ``remat``, LoRA). A field that changes the computation and that this model
  does not implement (another rope type, a partial rotary embedding, another activation,
  biases on a family without them, attention dropout, a per-layer window mix that
  transformers' model would not compute) is refused with its name, never ignored.
  """
  config = read_hf_config(config)
  arch = config.get("model_type") or "llama"
  if arch not in FAMILIES:
    raise _refuse("model_type", arch, f"the families read are {FAMILIES}")
  theta, llama3 = _rope_of_config(config)
  if config.get("hidden_act", "silu") != "silu":
    raise _refuse("hidden_act", config["hidden_act"], "only 'silu' (SwiGLU)")
  if config.get("attention_dropout"):
    raise _refuse("attention_dropout", config["attention_dropout"], "only 0 (no dropout)")
  attn_bias, mlp_bias = bool(config.get("attention_bias")), bool(config.get("mlp_bias"))
  if mlp_bias and arch != "llama":
    raise _refuse("mlp_bias", config["mlp_bias"], f"{_ARCH[arch]} has no MLP biases")
  if attn_bias and arch in ("qwen2", "mistral"):
    raise _refuse("attention_bias", config["attention_bias"],
                  f"{_ARCH[arch]} does not read it ("
                  + ("its q/k/v biases are always there and o_proj has none)" if arch == "qwen2"
                     else "it has no attention biases)"))
  n_layers = config["num_hidden_layers"]
  window, types = _sliding(config, arch, n_layers)
  head_dim = config.get("head_dim")
  if head_dim is None and arch == "qwen3":
    head_dim = 128  # Qwen3Config's default (not hidden_size // num_attention_heads)
  kw = dict(
      model_type=arch, vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
      intermediate_size=config["intermediate_size"], num_hidden_layers=n_layers,
      num_attention_heads=config["num_attention_heads"],
      num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
      head_dim=head_dim, rms_norm_eps=config.get("rms_norm_eps", 1e-6),
      rope_theta=theta, rope_llama3=llama3,
      max_position_embeddings=config.get("max_position_embeddings", 2048),
      tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
      qkv_bias=arch == "qwen2" or attn_bias, o_bias=attn_bias, mlp_bias=mlp_bias,
      qk_norm=arch == "qwen3", sliding_window=window, layer_types=types)
  kw.update(overrides)
  return LlamaConfig(**kw)


def _rope_parameters(cfg: LlamaConfig) -> dict:
  if cfg.rope_llama3 is None:
    return {"rope_type": "default", "rope_theta": cfg.rope_theta}
  factor, low, high, old_len = cfg.rope_llama3
  return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": factor,
          "low_freq_factor": low, "high_freq_factor": high,
          "original_max_position_embeddings": old_len}


def hf_config(cfg: LlamaConfig, torch_dtype: str = "float32") -> dict:
  """A Hugging Face ``config.json`` for ``cfg``, in its family's terms (what
  ``AutoModelForCausalLM`` reads as this model). An export from a base checkpoint starts from
  the base's own ``config.json`` instead (`zerojax.tools.export`)."""
  fam = cfg.model_type
  out = {
      "architectures": [_ARCH[fam]], "model_type": fam,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
      "num_attention_heads": cfg.num_attention_heads,
      "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.hd,
      "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
      "rope_parameters": _rope_parameters(cfg),
      "max_position_embeddings": cfg.max_position_embeddings,
      "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
      "torch_dtype": torch_dtype, "dtype": torch_dtype,
  }
  if fam == "llama":
    out.update(attention_bias=cfg.o_bias, mlp_bias=cfg.mlp_bias)
  elif fam == "qwen3":
    out.update(attention_bias=cfg.o_bias)
  if fam == "mistral":
    out["sliding_window"] = cfg.sliding_window
  elif fam in ("qwen2", "qwen3"):
    types = ((cfg.layer_types or ("sliding_attention",) * cfg.num_hidden_layers)
             if cfg.sliding_window is not None else ("full_attention",) * cfg.num_hidden_layers)
    out.update(use_sliding_window=cfg.sliding_window is not None,
               sliding_window=cfg.sliding_window, layer_types=list(types),
               max_window_layers=cfg.num_hidden_layers if cfg.sliding_window is None else
               types.index("sliding_attention"))
  return out


def checkpoint_model(cfg: LlamaConfig) -> dict:
  """What a checkpoint records about the model (``Checkpointer.save(..., model=...)``), so that
  `zerojax.tools.export` merges LoRA adapters with the alpha they were trained with."""
  out = {"family": cfg.model_type}
  if cfg.lora_rank:
    out["lora"] = {"rank": cfg.lora_rank, "alpha": float(cfg.lora_alpha),
                   "targets": list(cfg.lora_targets)}
  return out
