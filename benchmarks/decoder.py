"""A Llama-style decoder written as a user of Flax linen writes it, and two hand-written FSDP
baselines of the same train step, for the accelerator benchmarks.

The model: token embedding, ``nn.scan(nn.remat(Block))`` over RMSNorm, grouped-query
attention with rotary embeddings, SwiGLU MLP, untied head. ``DecoderConfig.layout`` writes the
layers as a Python loop instead (``"loop"``), or as a Python loop of ``nn.remat`` blocks
(``"loop_remat"``, gradient checkpointing as Hugging Face models do it). No ``dtype`` is set, as a model is
usually written: the run's compute dtype decides. Attention is ``jax.nn.dot_product_attention``
(cuDNN's fused kernel on XLA:GPU, XLA's own elsewhere).

Baselines, each an ordinary ``jax.jit`` step someone would write without zerojax:
* ``hand``: parameters and Adam state sharded on their largest divisible dimension through
  in/out shardings, batch sharded; GSPMD does the rest.
* ``maxtext``: weights sharded on their ``d_model`` dimension and every block's activations
  constrained to batch-on-``fsdp`` (MaxText's FSDP recipe).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

import optax
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  vocab: int = 32000
  d_model: int = 1024
  layers: int = 12
  heads: int = 16
  kv_heads: int = 16
  ffn: int = 2816
  rope_theta: float = 10000.0
  attention: str = "xla"  # jax.nn.dot_product_attention implementation
  constrain: bool = False  # MaxText-style activation constraints (batch on fsdp)
  compute_dtype: Any = None  # only the baselines cast; zerojax casts for its own runs
  layout: str = "scan"  # "scan" (nn.scan(nn.remat(Block))), "loop", "loop_remat"

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads


LLAMA3_8B = DecoderConfig(vocab=128256, d_model=4096, layers=32, heads=32, kv_heads=8,
                          ffn=14336, rope_theta=500000.0)
LLAMA2_70B = DecoderConfig(vocab=32000, d_model=8192, layers=80, heads=64, kv_heads=8,
                           ffn=28672)
ISSUE_LLAMA = DecoderConfig()  # the accelerator-schedule issue's 219.7M-parameter decoder


def _constrain(x, cfg):
  if not cfg.constrain:
    return x
  return jax.lax.with_sharding_constraint(x, P("fsdp", *([None] * (x.ndim - 1))))


class RMSNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("scale", nn.initializers.ones, (x.shape[-1],))
    var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x * jax.lax.rsqrt(var + 1e-5).astype(x.dtype)) * w.astype(x.dtype)


def _rope(x, theta):
  T, hd = x.shape[1], x.shape[-1]
  freq = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  ang = jnp.arange(T, dtype=jnp.float32)[:, None] * freq[None]
  cos, sin = jnp.cos(ang)[None, :, None].astype(x.dtype), jnp.sin(ang)[None, :, None].astype(x.dtype)
  x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Block(nn.Module):
  cfg: DecoderConfig

  @nn.compact
  def __call__(self, x, _):
    cfg = self.cfg
    B, T, D = x.shape
    dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)
    h = RMSNorm(name="attn_norm")(x)
    q = dense(cfg.heads * cfg.head_dim, "wq")(h).reshape(B, T, cfg.heads, cfg.head_dim)
    k = dense(cfg.kv_heads * cfg.head_dim, "wk")(h).reshape(B, T, cfg.kv_heads, cfg.head_dim)
    v = dense(cfg.kv_heads * cfg.head_dim, "wv")(h).reshape(B, T, cfg.kv_heads, cfg.head_dim)
    q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
    fused = cfg.attention != "xla" and q.dtype in (jnp.bfloat16, jnp.float16)  # cuDNN's dtypes
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                       implementation=cfg.attention if fused else None)
    x = _constrain(x + dense(D, "wo")(att.reshape(B, T, D)), cfg)
    h = RMSNorm(name="mlp_norm")(x)
    up = nn.silu(dense(cfg.ffn, "w1")(h)) * dense(cfg.ffn, "w3")(h)
    return _constrain(x + dense(D, "w2")(up), cfg), None


class Decoder(nn.Module):
  cfg: DecoderConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    emb = self.param("embed", nn.initializers.normal(0.02), (cfg.vocab, cfg.d_model))
    if cfg.compute_dtype is not None:
      emb = emb.astype(cfg.compute_dtype)
    x = _constrain(emb[tokens], cfg)
    if cfg.layout == "scan":
      layers = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                       length=cfg.layers)
      x, _ = layers(cfg, name="layers")(x, None)
    elif cfg.layout in ("loop", "loop_remat"):
      block = nn.remat(Block) if cfg.layout == "loop_remat" else Block
      for i in range(cfg.layers):
        x, _ = block(cfg, name=f"layers_{i}")(x, None)
    else:
      raise ValueError(f"layout={cfg.layout!r} is invalid: 'scan', 'loop' or 'loop_remat'")
    x = RMSNorm(name="final_norm")(x)
    return nn.Dense(cfg.vocab, use_bias=False, name="head")(x)


def loss_fn(logits, targets):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def num_params(cfg: DecoderConfig) -> int:
  shapes = jax.eval_shape(Decoder(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


# -- the hand-written baselines ----------------------------------------------------------------


def _largest_dim_spec(shape, n):
  best = None
  for d, s in enumerate(shape):
    if s % n == 0 and (best is None or s > shape[best]):
      best = d
  spec = [None] * len(shape)
  if best is not None:
    spec[best] = "fsdp"
  return P(*spec)


def _model_dim_spec(shape, d_model, n):
  """MaxText: shard the embedding (d_model) dimension; else the largest divisible one."""
  for d in range(len(shape) - 1, -1, -1):
    if shape[d] == d_model and d_model % n == 0:
      spec = [None] * len(shape)
      spec[d] = "fsdp"
      return P(*spec)
  return _largest_dim_spec(shape, n)


def baseline_step(cfg: DecoderConfig, mesh, batch: tuple[int, int], style: str = "hand",
                  compute_dtype=jnp.bfloat16, tx=None):
  """``(jitted step, abstract state, abstract batch)`` of a hand-written FSDP step."""
  n = mesh.shape["fsdp"]
  cfg = dataclasses.replace(cfg, constrain=(style == "maxtext"))
  model = Decoder(cfg)
  tx = optax.adamw(1e-4) if tx is None else tx
  rows, seq = batch
  tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
  key = jax.random.key(0)  # made before the mesh context, whose devices may be compile-only
  with jax.set_mesh(mesh):  # MaxText's activation constraints name mesh axes
    params = jax.eval_shape(model.init, key, tokens)["params"]
  rule = ((lambda s: _model_dim_spec(s, cfg.d_model, n)) if style == "maxtext"
          else (lambda s: _largest_dim_spec(s, n)))
  p_sh = jax.tree.map(lambda x: NamedSharding(mesh, rule(x.shape)), params)
  opt = jax.eval_shape(tx.init, params)
  o_sh = optax.tree_map_params(tx, lambda _, s: s, opt, p_sh,
                               transform_non_params=lambda _: NamedSharding(mesh, P()))
  b_sh = NamedSharding(mesh, P("fsdp"))

  def step(params, opt_state, batch):
    def lf(p):
      p = jax.tree.map(lambda w: w.astype(compute_dtype), p)
      return loss_fn(model.apply({"params": p}, batch["x"]), batch["y"])
    loss, g = jax.value_and_grad(lf)(params)
    upd, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss

  jitted = jax.jit(step, in_shardings=(p_sh, o_sh, {"x": b_sh, "y": b_sh}),
                   out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())), donate_argnums=(0, 1))
  abstract = lambda t, s: jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), t, s)
  return jitted, (abstract(params, p_sh), abstract(opt, o_sh)), {
      "x": jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=b_sh),
      "y": jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=b_sh)}


def zerojax_step(state, batch):
  """The README's step on this model, through `zerojax.value_and_grad`."""
  import zerojax
  def lf(params, batch):
    return loss_fn(state.apply_fn({"params": params}, batch["x"]), batch["y"])
  loss, grads = zerojax.value_and_grad(lf)(state.params, batch)
  return state.apply_gradients(grads=grads), {"loss": loss}


__all__ = ["DecoderConfig", "LLAMA3_8B", "LLAMA2_70B", "ISSUE_LLAMA", "Decoder", "loss_fn",
           "num_params", "baseline_step", "zerojax_step"]


