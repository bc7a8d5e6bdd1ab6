"""Block quantisation for ZeRO++: int8/int4 values with one float32 scale per block.

`quantize`/`dequantize` are pure functions of one array. `all_gather` (qwZ) and
`reduce_scatter` (qgZ) are their collectives, for code that runs per device inside
``jax.shard_map`` (the step's quantized formulation, `zerojax.core.apply.ModelApply`):

* qwZ: each device quantises its own shard, the int8 values and the scales are all-gathered,
  and every device dequantises the whole weight.
* qgZ: each device splits its local (partial) gradient into the chunks the other devices own,
  quantises each chunk, exchanges them with one all-to-all, and dequantises and sums the
  received chunks in float32: the result is its shard of the summed gradient, the layout a
  reduce-scatter gives.

A block is ``block_size`` consecutive elements of the flattened (shard or chunk); the last
block is zero-padded, so any size works, including one below the block size
(`padding` says how much). The scale is ``max|x| / qmax`` of the block, so the round-trip
error of an element is at most half a scale: ``max|x| / (2 * qmax)`` of its block.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["QUANTIZED_DTYPES", "QMAX", "Quantized", "num_blocks", "padding", "quantize",
           "dequantize", "error_bound", "all_gather", "reduce_scatter"]

QUANTIZED_DTYPES = ("int8", "int4")
QMAX = {"int8": 127, "int4": 7}


class Quantized(NamedTuple):
  """``values``: int8, ``(..., blocks, block_size)`` (int4: two values per byte, so
  ``block_size // 2``, the block's first half in the low nibbles); ``scales``: float32,
  ``(..., blocks)``."""

  values: jax.Array
  scales: jax.Array


def num_blocks(size: int, block_size: int) -> int:
  """Blocks needed for ``size`` elements (at least one)."""
  return max(1, -(-size // block_size))


def padding(size: int, block_size: int) -> int:
  """Zero elements appended to ``size`` elements to fill the last block."""
  return num_blocks(size, block_size) * block_size - size


def _check(dtype: str, block_size: int) -> None:
  if dtype not in QMAX:
    raise ValueError(f"quantize: dtype={dtype!r} is not supported; allowed: {QUANTIZED_DTYPES}")
  if not isinstance(block_size, (int, np.integer)) or block_size < 2 or block_size % 2:
    raise ValueError(f"quantize: block_size={block_size!r} must be an even integer >= 2")


def quantize(x: jax.Array, dtype: str = "int8", block_size: int = 256,
             batch_dims: int = 0) -> Quantized:
  """Quantises ``x`` per block of its flattened trailing dims (the first ``batch_dims`` dims
  are kept: each row is blocked on its own)."""
  _check(dtype, block_size)
  lead = x.shape[:batch_dims]
  flat = x.reshape(lead + (-1,)).astype(jnp.float32)
  size = flat.shape[-1]
  pad = padding(size, block_size)
  flat = jnp.pad(flat, [(0, 0)] * batch_dims + [(0, pad)])
  blocks = flat.reshape(lead + (-1, block_size))
  qmax = QMAX[dtype]
  scale = jnp.max(jnp.abs(blocks), axis=-1) / qmax
  safe = jnp.where(scale > 0, scale, 1.0)  # an all-zero block stays zero
  q = jnp.clip(jnp.round(blocks / safe[..., None]), -qmax, qmax).astype(jnp.int8)
  if dtype == "int4":
    # Two 4-bit values per byte: the block's first half in the low nibbles, its second half
    # in the high ones (halves, not even/odd pairs: a trailing axis of 2 would be padded to
    # TPU tiles).
    h = block_size // 2
    q = (q[..., :h] & 0x0F) | (q[..., h:] << 4)
  return Quantized(q, scale)


def dequantize(q: Quantized, shape: tuple[int, ...], out_dtype: Any = jnp.float32,
               dtype: str = "int8", batch_dims: int = 0) -> jax.Array:
  """The array `quantize` was given (to within `error_bound`), of ``shape`` (including the
  kept ``batch_dims``), in ``out_dtype``."""
  v = q.values
  if dtype == "int4":
    low = jnp.left_shift(v, 4) >> 4  # arithmetic shifts restore the sign of each nibble
    high = v >> 4
    v = jnp.concatenate([low, high], axis=-1)
  x = v.astype(jnp.float32) * q.scales[..., None]
  lead = shape[:batch_dims]
  size = int(np.prod(shape[batch_dims:], dtype=np.int64))
  x = x.reshape(lead + (-1,))[..., :size]
  return x.reshape(shape).astype(out_dtype)


def error_bound(x: jax.Array, dtype: str = "int8", block_size: int = 256) -> jax.Array:
  """Per element, the largest round-trip error allowed: half its block's scale."""
  _check(dtype, block_size)
  size = x.size
  flat = jnp.pad(jnp.abs(x.reshape(-1).astype(jnp.float32)), (0, padding(size, block_size)))
  per_block = jnp.max(flat.reshape(-1, block_size), axis=-1) / QMAX[dtype] / 2
  return jnp.repeat(per_block, block_size)[:size].reshape(x.shape)


def all_gather(shard: jax.Array, axis_name: str, dim: int, dtype: str = "int8",
               block_size: int = 256, out_dtype: Any = None) -> jax.Array:
  """qwZ (inside ``shard_map``): the whole array, concatenated along ``dim`` from every
  device's ``shard``, moved as quantised blocks and dequantised here."""
  q = quantize(shard, dtype, block_size)
  values = jax.lax.all_gather(q.values, axis_name)  # (n, blocks, bytes per block)
  scales = jax.lax.all_gather(q.scales, axis_name)  # (n, blocks)
  n = values.shape[0]
  parts = dequantize(Quantized(values, scales), (n,) + shard.shape,
                     out_dtype or shard.dtype, dtype, batch_dims=1)
  parts = jnp.moveaxis(parts, 0, dim)  # (..., n, shard's dim, ...) -> concatenate along dim
  shape = list(shard.shape)
  shape[dim] *= n
  return parts.reshape(shape)


def reduce_scatter(x: jax.Array, axis_name: str, dim: int, dtype: str = "int8",
                   block_size: int = 256, out_dtype: Any = None) -> jax.Array:
  """qgZ (inside ``shard_map``): this device's shard along ``dim`` of the sum of every
  device's ``x``; each chunk travels quantised through one all-to-all, and the received
  chunks are dequantised and summed in float32."""
  n = jax.lax.axis_size(axis_name)
  if x.shape[dim] % n:
    raise ValueError(f"reduce_scatter: dim {dim} of shape {x.shape} does not split into "
                     f"{n} shards over {axis_name!r}")
  moved = jnp.moveaxis(x, dim, 0)
  chunks = moved.reshape((n, moved.shape[0] // n) + moved.shape[1:])  # chunk j: device j's
  q = quantize(chunks, dtype, block_size, batch_dims=1)
  values = jax.lax.all_to_all(q.values, axis_name, 0, 0, tiled=False)  # row i: from device i
  scales = jax.lax.all_to_all(q.scales, axis_name, 0, 0, tiled=False)
  received = dequantize(Quantized(values, scales), chunks.shape, jnp.float32, dtype,
                        batch_dims=1)
  total = jnp.sum(received, axis=0)
  return jnp.moveaxis(total, 0, dim).astype(out_dtype or x.dtype)
