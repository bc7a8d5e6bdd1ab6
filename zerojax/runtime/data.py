"""Byte-level text data, fed per process.

Each process reads only its own rows of every global batch and the global array is assembled
with ``jax.make_array_from_process_local_data``, so the same loader runs with 1 process or N.
"""

from __future__ import annotations

import os
from typing import Iterator

import jax
import numpy as np

__all__ = ["VOCAB_SIZE", "load_bytes", "process_rows", "TextBatches"]

VOCAB_SIZE = 256  # bytes


def load_bytes(path: str | os.PathLike) -> np.ndarray:
  """The file's bytes as int32 tokens.

  Args:
    path: the corpus file.

  Returns:
    A 1-D int32 array, one token per byte.

  Raises:
    ValueError: the file has fewer than two bytes.
  """
  with open(path, "rb") as f:
    data = np.frombuffer(f.read(), dtype=np.uint8)
  if data.size < 2:
    raise ValueError(f"corpus {os.fspath(path)!r} is empty")
  return data.astype(np.int32)


def process_rows(sharding: jax.sharding.Sharding, global_batch: int) -> np.ndarray:
  """Indices of the global batch rows that this process's devices hold under ``sharding``.

  They are in the order ``jax.make_array_from_process_local_data`` expects its local data:
  the distinct row blocks of this process's devices, by position. With one process, all rows.
  A loader that reads only these rows feeds exactly its own slice of the global batch, however
  the mesh orders devices across processes.

  Args:
    sharding: the sharding of the batch's rows (e.g. ``plan.batch()``).
    global_batch: rows of the global batch.

  Returns:
    The row indices, an int64 array.
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
    sharding: a ``jax.sharding.Sharding`` of the batch's rows: ``plan.batch()`` (the plan's
      data-parallel sharding of a leading dimension; ``plan.batch(tree)`` gives one per leaf of
      a batch tree). With it, batches are global ``jax.Array`` values built from this process's rows
      only; ``None``: numpy arrays of this process's rows.
    step: the position (batch index) to start from.

  Raises:
    TypeError: an argument of the wrong type (each is checked here, not at the first batch).
    ValueError: a corpus too short for ``seq_len``, or a non-positive size.
  """

  def __init__(self, tokens: np.ndarray, global_batch: int, seq_len: int, seed: int = 0,
               sharding: jax.sharding.Sharding | None = None, step: int = 0):
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
      hint = ("; it is a function or method: call it, e.g. sharding=plan.batch() for a "
              "ShardingPlan" if callable(sharding) else "")
      raise TypeError(f"TextBatches: sharding={sharding!r} ({type(sharding).__name__}) is not "
                      "a jax.sharding.Sharding; pass the batch rows' sharding, e.g. "
                      f"plan.batch() (a NamedSharding), or None for host arrays{hint}")
    for name, v, low in (("global_batch", global_batch, 1), ("seq_len", seq_len, 1),
                         ("seed", seed, 0), ("step", step, 0)):
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"TextBatches: {name}={v!r} ({type(v).__name__}) is not an integer")
      if v < low:
        raise ValueError(f"TextBatches: {name}={v!r} is invalid: an integer >= {low}")
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or not np.issubdtype(
        tokens.dtype, np.integer):
      raise TypeError(f"TextBatches: tokens must be a 1-D numpy array of integer token ids "
                      f"(e.g. load_bytes(path)); got {type(tokens).__name__}"
                      + (f" of shape {tokens.shape} and dtype {tokens.dtype}"
                         if isinstance(tokens, np.ndarray) else ""))
    if tokens.size <= seq_len + 1:
      raise ValueError(f"corpus has {tokens.size} tokens; seq_len={seq_len} needs more")
    self.tokens, self.global_batch, self.seq_len = tokens, global_batch, seq_len
    self.seed, self.sharding, self.step = seed, sharding, step

  def global_rows(self, step: int) -> np.ndarray:
    """Every row of one global batch, as every process computes it.

    Args:
      step: the batch index.

    Returns:
      ``[global_batch, seq_len + 1]`` tokens: ``x`` is a row without its last token, ``y``
      without its first.
    """
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, self.tokens.size - self.seq_len - 1, self.global_batch)
    return np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])

  def local_rows(self, step: int) -> np.ndarray:
    """The rows of the global batch that this process feeds.

    With a sharding, exactly the rows its devices hold (see `process_rows`); without one, a
    contiguous block of ``global_batch / process_count`` rows.

    Args:
      step: the batch index.

    Returns:
      ``[rows, seq_len + 1]`` tokens of this process.

    Raises:
      ValueError: without a sharding, the global batch does not divide by the process count.
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
