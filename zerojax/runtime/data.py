"""Byte-level text data, fed per process.

Each process reads only its own rows of every global batch and the global array is assembled
with ``jax.make_array_from_process_local_data``, so the same loader runs with 1 process or N.
"""

from __future__ import annotations

import os
from typing import Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding

__all__ = ["VOCAB_SIZE", "load_bytes", "process_rows", "TextBatches"]

VOCAB_SIZE = 256  # bytes


def load_bytes(path: str | os.PathLike) -> np.ndarray:
  """The file's bytes as int32 tokens."""
  with open(path, "rb") as f:
    data = np.frombuffer(f.read(), dtype=np.uint8)
  if data.size < 2:
    raise ValueError(f"corpus {os.fspath(path)!r} is empty")
  return data.astype(np.int32)


def process_rows(sharding: NamedSharding, global_batch: int) -> np.ndarray:
  """Indices of the global batch rows that this process's devices hold under ``sharding``.

  They are in the order ``jax.make_array_from_process_local_data`` expects its local data:
  the distinct row blocks of this process's devices, by position. With one process, all rows.
  A loader that reads only these rows feeds exactly its own slice of the global batch, however
  the mesh orders devices across processes.
  """
  index_map = sharding.addressable_devices_indices_map((global_batch,))
  blocks = set()
  for idx in index_map.values():
    sl = idx[0] if idx else slice(None)
    blocks.add(tuple(range(global_batch))[sl])
  return np.asarray([r for b in sorted(blocks, key=lambda b: b[:1]) for r in b], dtype=np.int64)


class TextBatches:
  """Deterministic next-byte batches ``{'x': [B, T], 'y': [B, T]}``.

  The position (``step``) is plain data, so a checkpoint can store it and resume exactly.

  Args:
    tokens: the corpus as int32 tokens.
    global_batch: rows per step over all processes.
    seq_len: tokens per row.
    seed: shuffling seed; batch ``i`` depends only on ``(seed, i)``.
    sharding: the batch sharding (from ``plan.batch``); with it, batches are global
      ``jax.Array``s built from this process's rows only.
  """

  def __init__(self, tokens: np.ndarray, global_batch: int, seq_len: int, seed: int = 0,
               sharding: NamedSharding | None = None, step: int = 0):
    if tokens.size <= seq_len + 1:
      raise ValueError(f"corpus has {tokens.size} tokens; seq_len={seq_len} needs more")
    self.tokens, self.global_batch, self.seq_len = tokens, global_batch, seq_len
    self.seed, self.sharding, self.step = seed, sharding, step

  def global_rows(self, step: int) -> np.ndarray:
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, self.tokens.size - self.seq_len - 1, self.global_batch)
    return np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])

  def local_rows(self, step: int) -> np.ndarray:
    """The rows of the global batch that this process feeds.

    With a sharding, exactly the rows its devices hold (see `process_rows`); without one, a
    contiguous block of ``global_batch / process_count`` rows.
    """
    if self.sharding is not None:
      return self.global_rows(step)[process_rows(self.sharding, self.global_batch)]
    n, i = jax.process_count(), jax.process_index()
    if self.global_batch % n:
      raise ValueError(f"global batch {self.global_batch} does not divide by the {n} processes")
    per = self.global_batch // n
    return self.global_rows(step)[i * per:(i + 1) * per]

  def __iter__(self) -> Iterator[dict]:
    return self

  def __next__(self) -> dict:
    rows = self.local_rows(self.step)
    self.step += 1
    batch = {"x": rows[:, :-1], "y": rows[:, 1:]}
    if self.sharding is None:
      return batch
    shape = (self.global_batch, self.seq_len)
    return {k: jax.make_array_from_process_local_data(self.sharding, v, shape)
            for k, v in batch.items()}
