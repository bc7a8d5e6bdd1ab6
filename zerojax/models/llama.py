"""A Llama-architecture decoder in Flax NNX that loads and exports Hugging Face weights.

RMSNorm, rotary position embeddings (the Hugging Face "rotate half" layout), a SwiGLU MLP,
grouped-query attention and optional tied embeddings. The decoder layers are created with
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

from zerojax.runtime.weights import TensorMap

__all__ = ["LlamaConfig", "Llama", "hf_mapping", "from_hf_config", "hf_config"]

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The architecture; field names follow Hugging Face's ``LlamaConfig``."""

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
  dtype: Any = jnp.float32  # compute dtype
  param_dtype: Any = jnp.float32
  remat: bool = False  # jax.checkpoint around each scanned layer
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ("q_proj", "v_proj")

  def __post_init__(self):
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

  @property
  def hd(self) -> int:
    return self.head_dim or self.hidden_size // self.num_attention_heads

  def num_params(self) -> int:
    d, i, hd = self.hidden_size, self.intermediate_size, self.hd
    q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
    layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * i
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
  """A bias-free linear projection, with an optional LoRA adapter (``x A B * alpha/r``)."""

  def __init__(self, din: int, dout: int, cfg: LlamaConfig, lora: bool, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.kernel = nnx.Param(init(rngs.params(), (din, dout), cfg.param_dtype))
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
    if self.lora_a is not None:
      a, b = self.lora_a[...].astype(self.dtype), self.lora_b[...].astype(self.dtype)
      y = y + (x @ a @ b) * jnp.asarray(self.lora_scale, self.dtype)
    return y


class Attention(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, hd = cfg.hidden_size, cfg.hd
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    lo = lambda n: cfg.lora_rank > 0 and n in cfg.lora_targets
    self.q_proj = Proj(d, h * hd, cfg, lo("q_proj"), rngs)
    self.k_proj = Proj(d, kv * hd, cfg, lo("k_proj"), rngs)
    self.v_proj = Proj(d, kv * hd, cfg, lo("v_proj"), rngs)
    self.o_proj = Proj(h * hd, d, cfg, lo("o_proj"), rngs)
    self.cfg = cfg

  def __call__(self, x, cos, sin):
    cfg = self.cfg
    B, T, _ = x.shape
    h, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hd
    q = _rope(self.q_proj(x).reshape(B, T, h, hd), cos, sin)
    k = _rope(self.k_proj(x).reshape(B, T, kv, hd), cos, sin)
    v = self.v_proj(x).reshape(B, T, kv, hd)
    # Grouped-query attention: query head j reads key/value head j // (h // kv).
    q = q.reshape(B, T, kv, h // kv, hd)
    att = jnp.einsum("bqgrd,bkgd->bgrqk", q, k).astype(jnp.float32) * hd ** -0.5
    att = jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, jnp.finfo(jnp.float32).min)
    att = jax.nn.softmax(att, axis=-1).astype(cfg.dtype)
    y = jnp.einsum("bgrqk,bkgd->bqgrd", att, v).reshape(B, T, h * hd)
    return self.o_proj(y)


class MLP(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, i = cfg.hidden_size, cfg.intermediate_size
    lo = lambda n: cfg.lora_rank > 0 and n in cfg.lora_targets
    self.gate_proj = Proj(d, i, cfg, lo("gate_proj"), rngs)
    self.up_proj = Proj(d, i, cfg, lo("up_proj"), rngs)
    self.down_proj = Proj(i, d, cfg, lo("down_proj"), rngs)

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

  def __call__(self, x, cos, sin):
    x = x + self.self_attn(self.input_layernorm(x), cos, sin)
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


def _rope_tables(cfg: LlamaConfig, T: int):
  inv = _inv_freq(cfg)
  freqs = jnp.arange(T, dtype=jnp.float32)[:, None] * inv[None]
  emb = jnp.concatenate([freqs, freqs], axis=-1)  # (T, hd)
  cos, sin = jnp.cos(emb)[None, :, None], jnp.sin(emb)[None, :, None]
  return cos.astype(cfg.dtype), sin.astype(cfg.dtype)


class Llama(nnx.Module):
  """Llama causal LM: ``tokens (B, T) int -> logits (B, T, vocab) float32``."""

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

  def __call__(self, tokens):
    cfg = self.cfg
    x = self.embed_tokens(tokens).astype(cfg.dtype)
    cos, sin = _rope_tables(cfg, tokens.shape[1])
    graphdef, state = nnx.split(self.layers)

    def body(x, layer_state):
      return nnx.merge(graphdef, layer_state)(x, cos, sin), None

    if cfg.remat:
      body = jax.checkpoint(body)
    x, _ = jax.lax.scan(body, x, state)
    x = self.norm(x)
    if self.lm_head is None:
      logits = x @ self.embed_tokens.embedding[...].astype(cfg.dtype).T
    else:
      logits = self.lm_head(x)
    return logits.astype(jnp.float32)


# -- Hugging Face names and config ---------------------------------------------------------------


def hf_mapping(cfg: LlamaConfig) -> dict[str, TensorMap]:
  """``{zerojax leaf path: TensorMap}`` for Hugging Face ``LlamaForCausalLM`` checkpoints.

  Per-layer tensors ``model.layers.{i}.<name>`` are stacked on the leading layer axis; linear
  weights are transposed (PyTorch ``(out, in)``, Flax ``(in, out)``). LoRA adapters have no
  Hugging Face name (they are not in the base checkpoint).
  """
  m = {"embed_tokens/embedding": TensorMap("model.embed_tokens.weight"),
       "norm/scale": TensorMap("model.norm.weight")}
  for n in ("input_layernorm", "post_attention_layernorm"):
    m[f"layers/{n}/scale"] = TensorMap(f"model.layers.{{i}}.{n}.weight")
  for block, names in (("self_attn", _ATTN), ("mlp", _MLP)):
    for n in names:
      m[f"layers/{block}/{n}/kernel"] = TensorMap(f"model.layers.{{i}}.{block}.{n}.weight",
                                                  transpose=True)
  if not cfg.tie_word_embeddings:
    m["lm_head/kernel"] = TensorMap("lm_head.weight", transpose=True)
  return m


def from_hf_config(config: dict | str | os.PathLike, **overrides: Any) -> LlamaConfig:
  """A `LlamaConfig` from a Hugging Face ``config.json`` (a dict, the file, or its directory).

  ``overrides`` set zerojax-only fields (``dtype``, ``param_dtype``, ``remat``, LoRA).
  Rope scaling other than the default is refused rather than silently ignored.
  """
  if not isinstance(config, dict):
    path = os.fspath(config)
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    with open(path) as f:
      config = json.load(f)
  arch = config.get("model_type")
  if arch not in (None, "llama"):
    raise ValueError(f"config model_type={arch!r}: zerojax.models.llama reads 'llama' configs")
  rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  llama3 = None
  if rope_type == "llama3":
    try:
      llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    except KeyError as e:
      raise ValueError(f"config rope parameters {rope} lack {e} (needed by rope_type "
                       "'llama3')") from None
  elif rope_type != "default":
    raise ValueError(f"config rope type {rope_type!r} is not supported: zerojax's Llama "
                     "implements the default and 'llama3' rotary embeddings")
  theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
  for f in ("attention_bias", "mlp_bias"):
    if config.get(f):
      raise ValueError(f"config {f}=true is not supported by zerojax's Llama (no biases)")
  if config.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config hidden_act={config['hidden_act']!r}: only 'silu' is supported")
  kw = dict(
      vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
      intermediate_size=config["intermediate_size"],
      num_hidden_layers=config["num_hidden_layers"],
      num_attention_heads=config["num_attention_heads"],
      num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
      head_dim=config.get("head_dim"), rms_norm_eps=config.get("rms_norm_eps", 1e-6),
      rope_theta=float(theta), rope_llama3=llama3,
      max_position_embeddings=config.get("max_position_embeddings", 2048),
      tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))
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
  """The Hugging Face ``config.json`` of ``cfg`` (what ``LlamaForCausalLM`` reads)."""
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
      "num_attention_heads": cfg.num_attention_heads,
      "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.hd,
      "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
      "rope_parameters": _rope_parameters(cfg),
      "max_position_embeddings": cfg.max_position_embeddings,
      "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
      "attention_bias": False, "mlp_bias": False, "torch_dtype": torch_dtype,
      "dtype": torch_dtype,
  }
