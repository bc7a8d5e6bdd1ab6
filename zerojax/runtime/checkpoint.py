"""Sharded checkpoints on `orbax.checkpoint.CheckpointManager`.

A checkpoint is one orbax step directory with two items:

* ``state``: the train state's array fields (``step``, ``params``, ``opt_state``, and any other
  pytree field of the state), saved as a sharded PyTree. Each process writes only the shards it
  owns (orbax/tensorstore, OCDBT), so no device or host ever holds the whole model.
* ``meta``: JSON with the zerojax config (`ZeroConfig.to_flat`), the user's data position and
  RNG, and one **checksum per leaf**.

Restoring reads target shardings from a (new) `ShardingPlan`: the same files restore at any
stage, on any number of devices, into device or ``pinned_host`` memory. There is no conversion
step. Before anything is loaded, the stored shape and dtype of every leaf are compared with the
target; after loading, every leaf's checksum is recomputed and compared. The checksum is a sum
of mixed 32-bit words modulo 2**32, which is exact and independent of the order of summation,
so it is computed on the devices, in whatever sharding the arrays have, and gives the same
number for the same values on any topology (and in numpy, for `zerojax.tools.export`).

Saves are asynchronous: `Checkpointer.save` returns once the device buffers have been copied
to host, and the files are written in the background while training goes on (the train step
may donate the state's buffers right away). `Checkpointer.wait` blocks until the write is
committed. A step directory is committed by an atomic rename, so a save killed part-way
leaves only a temporary directory that is never listed, restored or counted by retention, and
older checkpoints are deleted only after a newer one is committed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import sys
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from orbax.checkpoint import checkpoint_managers as cm

from zerojax.core.backend import for_platform
from zerojax.core.config import ZeroConfig
from zerojax.core.plan import ShardingPlan, path_str, state_fields

PyTree = Any

FORMAT = "zerojax-checkpoint"
FORMAT_VERSION = 1
STATE_ITEM = "state"
META_ITEM = "meta"

__all__ = [
    "Checkpointer", "CheckpointError", "CheckpointDamagedError", "CheckpointNotFoundError",
    "CheckpointStepMismatchError", "Extras",
    "leaf_checksum", "move_aside", "numpy_checksum",
    "resume_with_fallback",
]


class _ReadOnlyNoticeFilter(logging.Filter):
  """Drops orbax's ``Given directory is read only=...`` warning.

  orbax's ``CheckpointManager`` logs it (through absl, at WARNING) whenever it is opened with
  ``read_only=True``, which zerojax does on purpose to read a checkpoint (export, fine-tuning,
  evaluation): the notice says nothing about the directory itself, which may well be writable.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Given directory is read only")

  @classmethod
  @contextlib.contextmanager
  def installed(cls, active: bool = True):
    """While active, the filter sits on the ``absl`` logger orbax logs through."""
    if not active:
      yield
      return
    logger, f = logging.getLogger("absl"), cls()
    logger.addFilter(f)
    try:
      yield
    finally:
      logger.removeFilter(f)


class CheckpointError(RuntimeError):
  """A checkpoint is corrupted, truncated, or does not match the state it is restored into."""


class CheckpointNotFoundError(FileNotFoundError):
  """The checkpoint directory, or the requested step in it, does not exist."""


class CheckpointStepMismatchError(CheckpointError):
  """A step directory's metadata records another step (edited, renamed, copied or linked)."""


class CheckpointDamagedError(CheckpointError):
  """A committed checkpoint's files cannot be read back as saved (truncated, corrupted or
  missing data files, unreadable metadata): the step is damaged, not mismatched, so an older
  complete step is a safe place to resume from (`resume_with_fallback`).

  Attributes:
    directory: the checkpoint root.
    step: the damaged step.
    leaves: the leaves that cannot be read or read back wrong (parameters first; may be empty
      where only another process could name them, or the metadata is what is damaged).
    files: the damaged files, relative to ``directory``, where they are known (an NVMe
      optimizer-state snapshot's, `zerojax.runtime.nvme`).
    beside: what lies beside the step in ``directory`` and belongs to it (an NVMe run's
      ``nvme-<step>`` snapshot): moved aside with it (`move_aside`).
  """

  def __init__(self, message: str, *, directory: str, step: int, leaves: Sequence[str] = (),
               files: Sequence[str] = (), beside: Sequence[str] = ()):
    super().__init__(message)
    self.directory, self.step, self.leaves = directory, int(step), tuple(leaves)
    self.files, self.beside = tuple(files), tuple(beside)


@dataclasses.dataclass(frozen=True)
class Extras:
  """What a checkpoint holds besides the train state.

  Attributes:
    step: the step the checkpoint was saved at.
    rng: the RNG passed to `Checkpointer.save` (same kind: typed key or raw ``uint32`` key
      data), or ``None``.
    data: the data position passed to `Checkpointer.save` (JSON round trip), or ``None``.
    config: the saving run's `ZeroConfig.to_flat()`, or ``None`` if none was given.
    model: the model description passed to `Checkpointer.save` (e.g. LoRA's rank and alpha,
      `zerojax.models.llama.checkpoint_model`), or ``None``.
  """

  step: int
  rng: Any = None
  data: Any = None
  config: dict | None = None
  model: dict | None = None


# -- checksums ----------------------------------------------------------------------------------

_M1, _M2, _M3, _M4 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F


def _words_jax(x: jax.Array) -> jax.Array:
  """The value bits of every element as one ``uint32`` word (same shape as ``x``)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = np.dtype(x.dtype).itemsize
  if size == 4:
    return lax.bitcast_convert_type(x, jnp.uint32)
  if size == 2:
    return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  if size == 1:
    return lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
  if size == 8:  # two words, combined symmetrically (word order does not matter)
    y = lax.bitcast_convert_type(x, jnp.uint32)
    a, b = y[..., 0], y[..., 1]
    return (a ^ b) ^ ((a + b) * jnp.uint32(_M3))
  raise TypeError(f"cannot checksum dtype {x.dtype}")


def _mix(v, idx, xp):
  u32 = xp.uint32
  h1 = (v ^ (idx * u32(_M1))) * u32(_M2)
  rot = (v << u32(16)) | (v >> u32(16))
  h2 = (rot + u32(_M4)) * (idx * u32(2) + u32(1))
  return h1, h2


def leaf_checksum(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two ``uint32`` checksums of a (possibly sharded) array; traceable, sharding-independent.

  Args:
    x: the array.

  Returns:
    ``(s1, s2)``, two ``uint32`` scalars; the same for the same values however ``x`` is
    sharded, and the same as `numpy_checksum` of its host copy.
  """
  v = _words_jax(x)
  shape = v.shape
  idx = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for d in reversed(range(len(shape))):
    idx = idx + lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
    stride *= shape[d]
  h1, h2 = _mix(v, idx, jnp)
  return jnp.sum(h1, dtype=jnp.uint32), jnp.sum(h2, dtype=jnp.uint32)


def _np_words(x: np.ndarray) -> np.ndarray:
  if x.dtype == np.bool_:
    return x.astype(np.uint32)
  size = x.dtype.itemsize
  if size == 4:
    return x.view(np.uint32)
  if size == 2:
    return x.view(np.uint16).astype(np.uint32)
  if size == 1:
    return x.view(np.uint8).astype(np.uint32)
  if size == 8:
    y = np.ascontiguousarray(x).view(np.uint32).reshape(x.shape + (2,))
    a, b = y[..., 0], y[..., 1]
    with np.errstate(over="ignore"):
      return (a ^ b) ^ ((a + b) * np.uint32(_M3))
  raise TypeError(f"cannot checksum dtype {x.dtype}")


def _np_partial_checksum(x: np.ndarray, start: Sequence[int], global_shape: Sequence[int]
                         ) -> tuple[int, int]:
  """The checksum terms of the block ``x`` that sits at ``start`` in a ``global_shape`` array
  (sums modulo 2**32, so the blocks of an array add up to the array's checksum)."""
  x = np.asarray(x)
  v = _np_words(x)
  if v.ndim == 0:
    v = v.reshape(1)
    start, global_shape = (0,), (1,)
  strides = [1] * len(global_shape)
  for d in range(len(global_shape) - 2, -1, -1):
    strides[d] = strides[d + 1] * int(global_shape[d + 1])
  inner = [(int(start[d]) + np.arange(v.shape[d], dtype=np.uint64)) * np.uint64(strides[d] % 2**64)
           for d in range(1, v.ndim)]
  inner_idx = sum((a.reshape((-1,) + (1,) * (v.ndim - 2 - i)) for i, a in enumerate(inner)),
                  np.zeros((), np.uint64))
  row_size = max(1, math.prod(v.shape[1:]))
  rows = max(1, (1 << 18) // row_size)  # bounded temporaries
  s1 = s2 = 0
  with np.errstate(over="ignore"):
    for r0 in range(0, v.shape[0], rows):
      part = v[r0:r0 + rows]
      lead = (int(start[0]) + r0 + np.arange(part.shape[0], dtype=np.uint64)) * np.uint64(
          strides[0] % 2**64)
      idx = (lead.reshape((-1,) + (1,) * (v.ndim - 1)) + inner_idx).astype(np.uint32)
      h1, h2 = _mix(part, idx, np)
      s1 += int(np.sum(h1, dtype=np.uint32))
      s2 += int(np.sum(h2, dtype=np.uint32))
  return s1 % 2**32, s2 % 2**32


def numpy_checksum(x: np.ndarray) -> tuple[int, int]:
  """`leaf_checksum` of a host array, in numpy (same numbers).

  Args:
    x: the host array.

  Returns:
    ``(s1, s2)`` as Python ints.
  """
  x = np.asarray(x)
  return _np_partial_checksum(x, (0,) * x.ndim, x.shape)


def _shard_checksum(x: jax.Array) -> tuple[int, int]:
  """`leaf_checksum` from this process's shards, on the host (no compilation): every distinct
  shard is counted once (``replica_id == 0``) and the processes' sums are added."""
  s1 = s2 = 0
  for sh in x.addressable_shards:
    if sh.replica_id != 0:
      continue
    start = [0 if i.start is None else i.start for i in sh.index] + [0] * (x.ndim - len(sh.index))
    a, b = _np_partial_checksum(np.asarray(sh.data), start, x.shape)
    s1, s2 = s1 + a, s2 + b
  return s1 % 2**32, s2 % 2**32


@functools.lru_cache(maxsize=64)
def _checksum_fn(to_device: tuple):
  """Jitted checksums of a list of leaves; leaves in host memory are moved to device first
  (``to_device`` holds their device-memory sharding, ``None`` for the others)."""
  def f(leaves):
    out = []
    for x, s in zip(leaves, to_device):
      out.append(jnp.stack(leaf_checksum(x if s is None else jax.device_put(x, s))))
    return out
  return jax.jit(f)


def _device_memory(x: jax.Array):
  s = x.sharding
  kind = getattr(s, "memory_kind", None)
  if kind is None or kind == "device" or not isinstance(s, NamedSharding):
    return None
  return s.with_memory_kind("device")


def _checksums(item: PyTree) -> dict[str, list[int]]:
  """``{leaf path: [h1, h2]}`` of every leaf, computed where the leaf lives."""
  flat = jax.tree_util.tree_flatten_with_path(item)[0]
  out: dict[str, list[int]] = {}
  dev = [(p, x) for p, x in flat if isinstance(x, jax.Array)]
  host = [(p, x) for p, x in flat if not isinstance(x, jax.Array)]
  on_cpu = all(for_platform(d.platform).device_memory_is_host
               for _, x in dev for d in x.sharding.device_set)
  if dev and on_cpu:
    # CPU "device" memory is host memory: hashing the shards in numpy costs no compilation.
    sums = [_shard_checksum(x) for _, x in dev]
    if jax.process_count() > 1:
      every = multihost_utils.process_allgather(np.asarray(sums, np.uint32))
      sums = [[int(v) % 2**32 for v in row] for row in
              np.asarray(every, np.uint64).sum(axis=0) % 2**32]
    for (p, _), s in zip(dev, sums):
      out[path_str(p)] = [int(v) for v in s]
  elif dev:
    sums = _checksum_fn(tuple(_device_memory(x) for _, x in dev))([x for _, x in dev])
    for (p, _), s in zip(dev, sums):
      out[path_str(p)] = [int(v) for v in np.asarray(s.addressable_data(0))]
  for p, x in host:
    out[path_str(p)] = list(numpy_checksum(np.asarray(x)))
  return out


# -- state <-> checkpoint item --------------------------------------------------------------------


def _state_item(state: Any) -> dict[str, Any]:
  """The pytree fields of a train state as a dict (what goes into the ``state`` item)."""
  try:
    return state_fields(state)
  except TypeError:
    raise TypeError(f"zerojax checkpoints need a flax.struct train state (e.g. "
                    f"flax.training.train_state.TrainState) or a dict, got "
                    f"{type(state).__name__}") from None


def _item_shardings(state: Any, plan: ShardingPlan) -> dict[str, Any]:
  """Target shardings of the ``state`` item, all read from ``plan``."""
  return _state_item(plan.state(state))


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], np.dtype]:
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return tuple(x.shape), np.dtype(x.dtype)
  a = np.asarray(x)
  return a.shape, a.dtype


def _json_default(o: Any) -> Any:
  if isinstance(o, np.integer):
    return int(o)
  if isinstance(o, np.floating):
    return float(o)
  if isinstance(o, np.bool_):
    return bool(o)
  if isinstance(o, (np.ndarray, jax.Array)) and np.ndim(o) <= 1 and np.size(o) <= 4096:
    return np.asarray(o).tolist()
  raise TypeError(f"value of type {type(o).__name__} is not JSON serialisable")


def _rng_to_json(rng: Any) -> dict | None:
  if rng is None:
    return None
  typed = jax.dtypes.issubdtype(getattr(rng, "dtype", np.float32), jax.dtypes.prng_key)
  data = jax.random.key_data(rng) if typed else rng
  if isinstance(data, jax.Array) and not data.is_fully_addressable:
    data = data.addressable_data(0)
  data = np.asarray(data)
  if data.dtype != np.uint32:
    raise TypeError(f"Checkpointer.save(rng=...) must be a JAX PRNG key (typed or uint32 key "
                    f"data); got an array of dtype {data.dtype}")
  impl = str(jax.random.key_impl(rng)) if typed else None
  return {"typed": bool(typed), "impl": impl, "shape": list(data.shape),
          "data": data.reshape(-1).tolist()}


def _rng_from_json(d: dict | None) -> Any:
  if d is None:
    return None
  data = np.asarray(d["data"], np.uint32).reshape(d["shape"])
  if d["typed"]:
    return jax.random.wrap_key_data(data, impl=d["impl"])
  return jnp.asarray(data)


# -- the checkpointer ---------------------------------------------------------------------------


class Checkpointer:
  """Saves and restores sharded zerojax train states in one directory.

  Example::

    ckpt = zerojax.runtime.checkpoint.Checkpointer("/ckpt", config=config, max_to_keep=3,
                                           keep_every=1000)
    for step in range(start, steps):
      state, metrics = train_step(state, next(data))
      ckpt.save(step + 1, state, rng=rng, data={"step": data.step})  # async
    ckpt.close()  # waits for the last save

    # later, on another topology/stage:
    state, plan = zerojax.checkpoint.abstract_train_state(model, tx, rng, x, config=new_config)
    state, extras = ckpt.restore(state, plan)

  Args:
    directory: the checkpoint root; one sub-directory per step.
    config: the run's `ZeroConfig`, stored in every checkpoint.
    max_to_keep: keep the last ``max_to_keep`` checkpoints (``None``: keep all).
    keep_every: also keep every checkpoint whose step is a multiple of ``keep_every``.
    save_interval_steps: `save` without ``force`` only saves steps that are multiples of it.
    async_save: write in the background (`wait` blocks until written).
    read_only: never write or delete (for evaluation jobs and export); the directory must
      exist.
  """

  def __init__(self, directory: str | os.PathLike, *, config: ZeroConfig | None = None,
               max_to_keep: int | None = 3, keep_every: int | None = None,
               save_interval_steps: int = 1, async_save: bool = True,
               read_only: bool = False):
    for name, v in (("max_to_keep", max_to_keep), ("keep_every", keep_every)):
      if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise ValueError(f"Checkpointer({name}={v!r}) is invalid: a positive integer or None")
    if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
      raise ValueError(f"Checkpointer(save_interval_steps={save_interval_steps!r}) is invalid: "
                       "a positive integer")
    if config is not None and not isinstance(config, ZeroConfig):
      raise TypeError(f"Checkpointer(config=...) must be a ZeroConfig, got "
                      f"{type(config).__name__}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.config = config
    self.read_only = read_only
    self.save_interval_steps = save_interval_steps
    if read_only and not os.path.isdir(self.directory):
      raise CheckpointNotFoundError(
          f"checkpoint directory {self.directory!r} does not exist"
          + ("" if not os.path.exists(self.directory) else " (it is not a directory)"))
    policies = [cm.LatestN(n=max_to_keep)]
    if keep_every is not None:
      policies.append(cm.EveryNSteps(interval_steps=keep_every))
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=0 if read_only else 1,  # `save` decides (see save_interval_steps)
        preservation_policy=cm.AnyPreservationPolicy(policies),
        enable_async_checkpointing=async_save,
        create=not read_only,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,
    )
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(STATE_ITEM, ocp.args.StandardSave, ocp.handlers.StandardCheckpointHandler)
    registry.add(STATE_ITEM, ocp.args.StandardRestore, ocp.handlers.StandardCheckpointHandler)
    registry.add(META_ITEM, ocp.args.JsonSave, ocp.handlers.JsonCheckpointHandler)
    registry.add(META_ITEM, ocp.args.JsonRestore, ocp.handlers.JsonCheckpointHandler)
    if not read_only:
      self._move_incomplete_aside()
    with _ReadOnlyNoticeFilter.installed(read_only):
      self._mgr = ocp.CheckpointManager(self.directory, options=options,
                                        handler_registry=registry)
    self._complete: set[int] = set()  # steps found complete (a commit is final)

  def _move_incomplete_aside(self) -> None:
    """Renames numbered step directories that are not complete checkpoints (left by a killed
    retention pass, or created by hand) to ``<step>.incomplete``: orbax would otherwise count
    them as checkpoints, and its retention would delete complete ones in their place. Nothing
    is deleted."""
    if not os.path.isdir(self.directory) or jax.process_index() != 0:
      return
    for name in sorted(os.listdir(self.directory)):
      path = os.path.join(self.directory, name)
      if not name.isdigit() or not os.path.isdir(path):
        continue
      reason = _incomplete_reason(path)
      if reason is None:
        continue
      dest = _aside_name(path, "incomplete")
      os.rename(path, dest)
      warnings.warn(f"zerojax.runtime.checkpoint: step directory {path!r} is not a complete checkpoint "
                    f"({reason}); moved it to {dest!r} so that it is neither listed nor counted "
                    "by retention", stacklevel=3)

  # -- queries ----------------------------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints, ascending.

    A read-only `Checkpointer` re-reads the directory and lists committed checkpoints only. A
    writing one also lists the steps it is still saving (`wait` commits them); it never lists
    a partial directory left by a killed save. A step directory that is not complete (empty,
    or left half-deleted by a retention pass that was killed) is not listed either;
    `incomplete_steps` says why.

    Returns:
      The steps.
    """
    if self.read_only:
      self._mgr.reload()
    steps = []
    for step in sorted(self._mgr.all_steps()):
      if step in self._complete:
        steps.append(step)
        continue
      if not os.path.lexists(self.step_dir(step)):
        steps.append(step)  # still being saved by this Checkpointer (not yet committed)
        continue
      reason = _incomplete_reason(self.step_dir(step))
      if reason is None:
        self._complete.add(step)
        steps.append(step)
    return steps

  def incomplete_steps(self) -> dict[int, str]:
    """The numbered step directories that are not complete checkpoints.

    Returns:
      ``{step: why}``, ascending.
    """
    if self.read_only:
      self._mgr.reload()
    out = {}
    for step in sorted(self._mgr.all_steps()):
      if step not in self._complete and os.path.lexists(self.step_dir(step)):
        reason = _incomplete_reason(self.step_dir(step))
        if reason is not None:
          out[step] = reason
    return out

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step.

    Returns:
      The step, or ``None`` where there is none.
    """
    steps = self.all_steps()
    return steps[-1] if steps else None

  def step_dir(self, step: int) -> str:
    """Where a step is kept.

    Args:
      step: the checkpoint step.

    Returns:
      ``<directory>/<step>``, whether or not it exists.
    """
    return os.path.join(self.directory, str(step))

  # -- save -------------------------------------------------------------------------------------

  def save(self, step: int, state: Any, *, rng: Any = None, data: Any = None,
           force: bool = False, model: dict | None = None) -> bool:
    """Starts an asynchronous save of ``state`` as checkpoint ``step``.

    Returns once the device buffers are copied to host; training may go on (and donate the
    state) at once. Call `wait` (or `close`) to block until the files are committed.

    Args:
      step: the step number (a non-negative int); an existing step is never overwritten.
      state: a train state (e.g. ``flax.training.train_state.TrainState``) or a dict.
      rng: a JAX PRNG key to store (restored as the same kind of key).
      data: the data position, any JSON-serialisable value (e.g. ``{"step": 1200}``).
      force: save even if ``step`` is not a multiple of ``save_interval_steps``.
      model: a JSON-serialisable description of the model that the parameters alone do not
        give (e.g. `zerojax.models.llama.checkpoint_model`: LoRA's rank and alpha), which
        `zerojax.tools.export` reads.

    Returns:
      whether a save was started.
    """
    step = self._new_step(step)
    if not force and step % self.save_interval_steps:
      return False
    item = _state_item(state)
    meta = self._meta(step, item, rng, data, model)
    # orbax cannot store arrays of zero size: they hold no values, so only their shape and
    # dtype (in ``meta['leaves']``) are kept, and restore recreates them.
    stored = jax.tree.map(lambda x: None if math.prod(_shape_dtype(x)[0]) == 0 else x, item)
    return self._mgr.save(step, args=ocp.args.Composite(
        **{STATE_ITEM: ocp.args.StandardSave(stored), META_ITEM: ocp.args.JsonSave(meta)}),
        force=True)

  def _new_step(self, step: Any) -> int:
    """``step`` as an int, checked: writable here, and neither saved nor left incomplete."""
    if self.read_only:
      raise CheckpointError(f"checkpoint directory {self.directory!r} was opened read-only")
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
      raise ValueError(f"Checkpointer.save(step={step!r}) is invalid: a non-negative integer")
    step = int(step)
    if step in self.all_steps():
      raise CheckpointError(f"checkpoint step {step} already exists in {self.directory!r}; "
                            "zerojax never overwrites a checkpoint (delete it first)")
    if os.path.lexists(self.step_dir(step)):
      raise CheckpointError(
          f"checkpoint directory {self.step_dir(step)!r} exists but is not a complete checkpoint "
          f"({_incomplete_reason(self.step_dir(step))}); zerojax does not write over it: "
          "delete it first")
    return step

  def _meta(self, step: int, item: PyTree, rng: Any, data: Any, model: dict | None) -> dict:
    """The ``meta`` item: format, step, config, data position, RNG, model, leaves, checksums."""
    try:
      data_json = json.loads(json.dumps(data, default=_json_default))
    except (TypeError, ValueError) as e:
      raise TypeError(f"Checkpointer.save(data=...) must be JSON-serialisable (numbers, "
                      f"strings, lists, dicts): {e}") from None
    if model is not None and not isinstance(model, dict):
      raise TypeError(f"Checkpointer.save(model={model!r}) is invalid: a JSON-serialisable "
                      "dict or None")
    try:
      model_json = json.loads(json.dumps(model))
    except (TypeError, ValueError) as e:
      raise TypeError(f"Checkpointer.save(model=...) must be JSON-serialisable: {e}") from None
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "config": None if self.config is None else self.config.to_flat(),
        "data": data_json,
        "rng": _rng_to_json(rng),
        "model": model_json,
        "leaves": {path_str(p): {"shape": list(_shape_dtype(x)[0]),
                                  "dtype": _shape_dtype(x)[1].name}
                   for p, x in jax.tree_util.tree_flatten_with_path(item)[0]},
        "checksums": _checksums(item),
    }

  def wait(self) -> None:
    """Blocks until every started save is committed (and re-raises its error, if any)."""
    self._mgr.wait_until_finished()
    self._mgr.check_for_errors()

  def close(self) -> None:
    """Waits for pending saves and releases orbax's resources."""
    self._mgr.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- restore ----------------------------------------------------------------------------------

  def _resolve_step(self, step: int | None) -> int:
    if not os.path.isdir(self.directory):
      raise CheckpointNotFoundError(f"checkpoint directory {self.directory!r} does not exist")
    if not self.read_only:
      self.wait()  # a step being saved by this Checkpointer is restorable once committed
    steps = self.all_steps()
    skipped = self.incomplete_steps()
    if not steps:
      raise CheckpointNotFoundError(
          f"checkpoint directory {self.directory!r} holds no complete checkpoint (entries: "
          f"{sorted(os.listdir(self.directory))[:10]}"
          + "".join(f"; step {s} is incomplete: {why}" for s, why in skipped.items()) + ")")
    if step is None:
      newer = {s: why for s, why in skipped.items() if s > steps[-1]}
      if newer:
        warnings.warn(f"zerojax.runtime.checkpoint: {self.directory!r}: using step {steps[-1]}, the "
                      "newest complete checkpoint; skipped " + "; ".join(
                          f"step {s} ({why})" for s, why in sorted(newer.items())),
                      stacklevel=3)
      return steps[-1]
    if step not in steps:
      why = f" (step {step} is incomplete: {skipped[step]})" if step in skipped else ""
      raise CheckpointNotFoundError(f"checkpoint {self.directory!r} has no step {step}{why}; "
                                    f"complete steps are {steps}")
    return int(step)

  def read_meta(self, step: int | None = None) -> dict:
    """The JSON ``meta`` item of a checkpoint.

    Args:
      step: the step; ``None`` is the newest complete one.

    Returns:
      The item: the config, the data position, the random key, the leaf shapes and checksums.

    Raises:
      CheckpointNotFoundError: no such directory or step.
      CheckpointDamagedError: the item cannot be read.
      CheckpointError: it is not a zerojax checkpoint's.
      CheckpointStepMismatchError: it records another step than its directory's.
    """
    step = self._resolve_step(step)
    path = os.path.join(self.step_dir(step), META_ITEM)
    try:
      meta = self._mgr.restore(step, args=ocp.args.Composite(
          **{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
    except Exception as e:
      raise CheckpointDamagedError(
          f"checkpoint {self.step_dir(step)!r}: cannot read its zerojax metadata {path!r}: "
          f"{type(e).__name__}: {e}", directory=self.directory, step=step) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      raise CheckpointError(f"checkpoint {self.step_dir(step)!r} is not a zerojax checkpoint "
                            f"(its meta item has format {getattr(meta, 'get', lambda k: None)('format')!r}, "
                            f"expected {FORMAT!r})")
    if meta.get("step") != step:
      target = os.path.realpath(self.step_dir(step))
      moved = (f"; the directory is a link to {target!r}"
               if target != os.path.join(os.path.realpath(self.directory), str(step)) else "")
      raise CheckpointStepMismatchError(
          f"checkpoint {self.step_dir(step)!r}: its metadata records step "
          f"{meta.get('step')!r}, but the directory is step {step}{moved}. The metadata was "
          "edited or the directory was renamed, copied or linked from another step; refusing "
          "to restore a state under the wrong step")
    return meta

  def stored_leaves(self, step: int | None = None) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The stored state's leaves, from orbax's metadata (no array is read).

    Args:
      step: the step; ``None`` is the newest complete one.

    Returns:
      ``{leaf path: (shape, dtype)}``.

    Raises:
      CheckpointNotFoundError: no such directory or step.
      CheckpointError: the metadata cannot be read.
    """
    step = self._resolve_step(step)
    try:
      md = self._mgr.metadata(step).item_metadata[STATE_ITEM]
      tree = md.tree if hasattr(md, "tree") else md
      flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    except Exception as e:
      raise CheckpointError(f"checkpoint {self.step_dir(step)!r}: cannot read the array "
                            f"metadata of item {STATE_ITEM!r}: {type(e).__name__}: {e}") from e
    return {path_str(p): (tuple(m.shape), np.dtype(m.dtype)) for p, m in flat}

  def restore(self, state: Any, plan: ShardingPlan, step: int | None = None
              ) -> tuple[Any, Extras]:
    """Restores a checkpoint into the layout of ``plan``.

    The checkpoint may come from any stage and any device count: every leaf is read straight
    into the sharding (and memory kind) that ``plan`` gives it. With the optimizer state on
    NVMe (``plan.nvme``, see `zerojax.checkpoint.abstract_train_state`) the step's
    optimizer-state snapshot is restored with it
    (`zerojax.runtime.nvme.NvmeOptimizer.restore_checkpoint`).

    Args:
      state: the target train state: a real one, or an abstract one (``ShapeDtypeStruct``
        leaves, see `abstract_train_state`). Only its structure, shapes and dtypes are used;
        non-array fields (``apply_fn``, ``tx``) are kept.
      plan: the `ShardingPlan` of the run that restores (it fixes every target sharding).
      step: the step to restore; ``None`` is the latest complete checkpoint, and where that
        one is damaged (`CheckpointDamagedError`), the newest one before it that reads back
        whole: a warning names the damaged leaves, and a writing `Checkpointer` moves the
        damaged step aside (`move_aside`).

    Returns:
      ``(state, extras)``.

    Raises:
      CheckpointNotFoundError: no such directory or step.
      CheckpointDamagedError: the checkpoint (``step``, or with ``step=None`` every one) is
        corrupted or truncated (a leaf cannot be read or its checksum differs); the message
        names the checkpoint and the damaged leaves.
      CheckpointError: the checkpoint does not match ``state`` (a leaf is missing, extra, or
        has another shape or dtype). The message names the checkpoint, the leaf and the
        mismatch.
      NvmeStateError: with ``plan.nvme``, the step has no optimizer-state snapshot, or it
        holds another run's layout.
    """
    if not isinstance(plan, ShardingPlan):
      raise TypeError(f"restore(state, plan): plan must be a zerojax.ShardingPlan, got "
                      f"{type(plan).__name__}")
    if plan.nvme is not None:  # its device plan (nvme None) brings it back here
      return plan.nvme.restore_checkpoint(self, state, step, stacklevel=3)
    if step is not None:
      return self._restore_step(state, plan, self._resolve_step(step))
    return self.newest_readable(self._resolve_step(None), self.all_steps,
                                lambda s: self._restore_step(state, plan, s), stacklevel=3)

  def newest_readable(self, step: int, steps: Callable[[], list[int]],
                      attempt: Callable[[int], Any], *, stacklevel: int = 2) -> Any:
    """``attempt(step)``, falling back past damaged checkpoints to the newest step before.

    Where ``attempt`` raises this directory's `CheckpointDamagedError` for ``step``, a writing
    `Checkpointer` moves the step aside (`set_aside`, with what the error says lies beside
    it; a read-only one leaves it), a warning names the damage, and the newest of ``steps()``
    before it is attempted; and so on.

    Args:
      step: the step to attempt first.
      steps: the complete steps a fallback may choose from (asked again after each move).
      attempt: ``step -> result``.
      stacklevel: the warning's, as if this method called ``warnings.warn`` itself: 2
        (default) names the line that calls it.

    Returns:
      ``attempt``'s result for the first step that reads back.

    Raises:
      CheckpointDamagedError: no step before a damaged one is left; the message names the
        damage and what to do.
    """
    return _newest_readable(
        self.directory, step, steps, attempt,
        lambda s, e: None if self.read_only else self.set_aside(s, beside=e.beside),
        stacklevel + 1)

  def set_aside(self, step: int, *, beside: Sequence[str] = (), why: str = "damaged") -> str:
    """`move_aside` of checkpoint ``step`` (and ``beside``), which this `Checkpointer` then
    neither lists nor restores. Every process calls it.

    Args:
      step: the step to move aside.
      beside: names in the directory that belong to the step (an NVMe run's ``nvme-<step>``).
      why: the new names' suffix.

    Returns:
      the path the step directory was moved to.

    Raises:
      CheckpointError: this `Checkpointer` is read-only.
    """
    if self.read_only:
      raise CheckpointError(f"checkpoint {self.directory!r} is opened read-only: step {step} "
                            "cannot be moved aside")
    dest = move_aside(self.directory, step, why, beside=beside)
    self._mgr.reload()
    self._complete.discard(step)
    return dest

  def _restore_step(self, state: Any, plan: ShardingPlan, step: int) -> tuple[Any, Extras]:
    """`restore` of one resolved ``step``."""
    where = self.step_dir(step)
    meta = self.read_meta(step)
    t_flat, t_def = jax.tree_util.tree_flatten_with_path(_state_item(state))
    s_flat = jax.tree.leaves(_item_shardings(state, plan),
                             is_leaf=lambda x: isinstance(x, NamedSharding))
    if len(s_flat) != len(t_flat):
      raise ValueError(f"the plan's shardings ({len(s_flat)} leaves) do not match the target "
                       f"state ({len(t_flat)} leaves): was the plan made for this model and "
                       "optimizer?")
    abstract, empty = _restore_targets(where, t_flat, s_flat, self._stored_with_empty(step, meta))
    restored = self._read_state(step, jax.tree_util.tree_unflatten(t_def, abstract))
    if empty:
      leaves = jax.tree.leaves(restored, is_leaf=lambda v: v is None)
      restored = jax.tree_util.tree_unflatten(
          t_def, [empty.get(i, v) for i, v in enumerate(leaves)])
    _verify(where, meta, restored)
    if dataclasses.is_dataclass(state):
      new_state = state.replace(**restored)
    else:
      new_state = {**dict(state), **restored}
    extras = Extras(step=int(meta["step"]), rng=_rng_from_json(meta.get("rng")),
                    data=meta.get("data"), config=meta.get("config"),
                    model=meta.get("model"))
    return new_state, extras

  def _stored_with_empty(self, step: int, meta: dict
                         ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """`stored_leaves`, plus the zero-size leaves that only the meta item records."""
    stored = self.stored_leaves(step)
    for path, leaf in (meta.get("leaves") or {}).items():
      if path not in stored and 0 in leaf["shape"]:
        stored[path] = (tuple(leaf["shape"]), np.dtype(leaf["dtype"]))
    return stored

  def _read_state(self, step: int, abstract_item: PyTree) -> PyTree:
    """Reads the ``state`` item into ``abstract_item``'s shardings; a failure names the
    leaves that cannot be read."""
    error = None
    try:
      out = self._mgr.restore(step, args=ocp.args.Composite(
          **{STATE_ITEM: ocp.args.StandardRestore(abstract_item)}))[STATE_ITEM]
    except Exception as e:  # noqa: BLE001 - named below, after the processes agree
      error = e
    if jax.process_count() > 1:
      # Each process reads its own shards: one that fails must not leave the others restoring
      # (and verifying, a collective) alone. Every process learns who failed.
      failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None)))
      others = [i for i, f in enumerate(failed.reshape(-1)) if f and i != jax.process_index()]
      if error is None and others:
        raise CheckpointDamagedError(
            f"checkpoint {self.step_dir(step)!r} cannot be read (corrupted or truncated?) by "
            f"process(es) {others}; their errors name the leaves", directory=self.directory,
            step=step)
    if error is None:
      return out
    _quiet_failed_read_aftermath()
    bad = self._find_unreadable_leaves(step)
    bad.sort(key=lambda b: not b[0].startswith("params/"))  # parameters first
    named = ""
    if bad:
      more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
      named = (f": {len(bad)} leaves cannot be read: "
               + ", ".join(repr(p) for p, _ in bad[:5]) + more
               + f"; leaf {bad[0][0]!r} fails with {bad[0][1]}")
    raise CheckpointDamagedError(
        f"checkpoint {self.step_dir(step)!r} cannot be read (corrupted or truncated?)" + named
        + f"; orbax says: {type(error).__name__}: {str(error)[:800]}",
        directory=self.directory, step=step, leaves=[p for p, _ in bad]) from error

  def _find_unreadable_leaves(self, step: int) -> list[tuple[str, str]]:
    """On a failed restore: reads every leaf on its own (to host) to name the damaged ones."""
    item_dir = os.path.join(self.step_dir(step), STATE_ITEM)
    tree = self._mgr.metadata(step).item_metadata[STATE_ITEM]
    tree = tree.tree if hasattr(tree, "tree") else tree
    bad = []
    for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
      try:
        read_leaf(item_dir, kp, tree)
      except Exception as e:  # noqa: BLE001 - we only report it
        bad.append((path_str(kp), f"{type(e).__name__}: {str(e)[:300]}"))
    return bad


_QUIET = []


def _quiet_failed_read_aftermath() -> None:
  """After a failed orbax read, its abandoned tensorstore reads still complete in the
  background, onto an asyncio loop that is gone: each prints a traceback ("Exception
  ignored": ``Event loop is closed`` or a read coroutine never awaited; asyncio's "exception
  was never retrieved" of each failed read), hundreds of them, at any later moment. The
  failure itself is reported by name, so from then on those are dropped; every other
  unraisable exception and asyncio error is shown as before."""
  if _QUIET:
    return
  previous = sys.unraisablehook

  class _Filter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
      msg = record.getMessage()
      return not ("exception was never retrieved" in msg
                  and ("OCDBT" in msg or f"{os.sep}orbax{os.sep}" in msg))

  def hook(u):
    exc, obj = u.exc_value, u.object
    loop_gone = isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
    code = getattr(obj, "cr_code", None)
    orphan = code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
    if not (loop_gone or orphan):
      previous(u)

  sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(_Filter())
  _QUIET.append(hook)


def _restore_targets(where: str, t_flat: list, s_flat: list,
                     stored: dict[str, tuple[tuple[int, ...], np.dtype]]
                     ) -> tuple[list[Any], dict[int, jax.Array]]:
  """``(abstract leaves to read, {index: zero-size leaf made here})`` of a restore; a
  `CheckpointError` listing every leaf whose path, shape or dtype differs from ``stored``."""
  abstract, problems, empty = [], [], {}
  for i, ((kp, x), sh) in enumerate(zip(t_flat, s_flat)):
    path = path_str(kp)
    shape, dtype = _shape_dtype(x)
    if math.prod(shape) == 0 and stored.get(path) == (shape, dtype):
      empty[i] = jax.device_put(np.zeros(shape, dtype), sh)
      abstract.append(None)
      continue
    if path not in stored:
      problems.append(f"leaf {path!r} (shape {shape} {dtype.name}) is not in the checkpoint")
    elif stored[path] != (shape, dtype):
      s_shape, s_dtype = stored[path]
      problems.append(f"leaf {path!r} is stored as shape {s_shape} {s_dtype.name}, the "
                      f"target expects shape {shape} {dtype.name}")
    abstract.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sh))
  names = {path_str(kp) for kp, _ in t_flat}
  problems += [f"leaf {p!r} (shape {stored[p][0]} {stored[p][1].name}) is in the checkpoint "
               "but not in the target" for p in sorted(set(stored) - names)]
  if problems:
    problems.sort(key=lambda m: not m.startswith("leaf 'params/"))  # parameters first
    more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
    raise CheckpointError(f"checkpoint {where!r} does not match the target state "
                          f"({len(problems)} leaves differ; nothing was loaded): "
                          + "; ".join(problems[:5]) + more)
  return abstract, empty


def _aside_name(path: str, why: str, *others: str) -> str:
  """``<path>.<why>``, or ``<path>.<why><n>`` where that exists: nothing is written over.
  The suffix is free for each of ``others`` too (a step and its companions share it)."""
  suffix, n = f".{why}", 1
  while any(os.path.lexists(p + suffix) for p in (path, *others)):
    suffix, n = f".{why}{n}", n + 1
  return path + suffix


def move_aside(directory: str | os.PathLike, step: int, why: str = "damaged", *,
               beside: Sequence[str] = ()) -> str:
  """Renames checkpoint ``step`` to ``<step>.<why>`` in ``directory``, so that it is neither
  listed, restored nor counted by retention; nothing is deleted. Every process calls it (process
  0 renames, the others wait for it).

  Args:
    directory: the checkpoint root.
    step: the step to move aside.
    why: the new name's suffix.
    beside: other names in ``directory`` that belong to the step (an NVMe run's
      ``nvme-<step>`` snapshot), each moved to ``<name>.<why>`` too where it exists.

  Returns:
    the path the step directory was moved to.
  """
  root = os.path.abspath(os.fspath(directory))
  path = os.path.join(root, str(int(step)))
  companions = [os.path.join(root, b) for b in beside]
  dest = _aside_name(path, why, *companions)
  others = [(p, p + dest[len(path):]) for p in companions]  # the step's suffix
  if jax.process_count() > 1:  # every process named dest before process 0 made it exist
    multihost_utils.sync_global_devices(f"zerojax.checkpoint: move {step} aside: named")
  if jax.process_index() == 0:
    # The companions first: a step directory without its snapshot is never listed complete.
    for src, to in others:
      if os.path.lexists(src):
        os.rename(src, to)
    if os.path.lexists(path):
      os.rename(path, dest)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"zerojax.checkpoint: move {step} aside: moved")
  return dest


def _damage(e: CheckpointDamagedError) -> str:
  """A damaged checkpoint's leaves (and files, where known), briefly, for a warning or a
  one-line error."""
  files = ""
  if e.files:
    more = f" and {len(e.files) - 4} more" if len(e.files) > 4 else ""
    files = " in " + ", ".join(repr(f) for f in e.files[:4]) + more
  if not e.leaves:
    return str(e).split("; orbax says")[0][:300] + files
  more = f" and {len(e.leaves) - 6} more" if len(e.leaves) > 6 else ""
  return (f"{len(e.leaves)} damaged leaves: " + ", ".join(repr(p) for p in e.leaves[:6])
          + more + files)


def _fallback_warning(e: CheckpointDamagedError, older: int, dest: str | None) -> str:
  moved = f"moved it to {dest!r}" if dest else "left it in place (read-only)"
  if e.beside:
    suffix = "." + os.path.basename(dest).split(".", 1)[1] if dest else ""  # <step>.<suffix>
    moved += (" with " + ", ".join(f"{b!r}" for b in e.beside) + " beside it"
              + (" (to " + ", ".join(f"{b + suffix!r}" for b in e.beside) + ")" if dest else ""))
  return (f"zerojax.runtime.checkpoint: checkpoint step {e.step} in {e.directory!r} cannot be "
          f"read back ({_damage(e)}); {moved} and restored step {older}, the newest complete "
          "checkpoint before it")


def _no_fallback(e: CheckpointDamagedError) -> CheckpointDamagedError:
  return CheckpointDamagedError(
      f"checkpoint step {e.step} in {e.directory!r} cannot be read back ({_damage(e)}) and "
      "there is no complete checkpoint before it to fall back to; start a new run (--overwrite) "
      f"or restore the directory from a copy. {e}", directory=e.directory, step=e.step,
      leaves=e.leaves, files=e.files, beside=e.beside)


def resume_with_fallback(directory: str | os.PathLike, step: int,
                         resume: Callable[[int], Any]) -> tuple[Any, int]:
  """``resume(step)``, falling back past damaged checkpoints.

  Where checkpoint ``step`` in ``directory`` turns out damaged (``resume`` raises its
  `CheckpointDamagedError`: truncated, corrupted or missing data files), the step is moved
  aside (`move_aside`, as a writer moves a half-written step aside; with what the error says
  lies beside it, an NVMe run's ``nvme-<step>`` snapshot), a warning names its
  damaged leaves, and ``resume`` is called with the newest complete step before it; and so
  on. Every process calls it (they agree on the damage, `Checkpointer.restore`).

  Args:
    directory: the checkpoint root.
    step: the step to resume from first (usually the newest complete one).
    resume: ``step -> result``; restores the run from that checkpoint.

  Returns:
    ``(resume's result, the step it resumed from)``.

  Raises:
    CheckpointDamagedError: no complete step before a damaged one is left; the message names
      the damaged leaves and what to do.
  """
  def steps() -> list[int]:
    with Checkpointer(directory, read_only=True) as ck:
      return ck.all_steps()

  return _newest_readable(directory, step, steps, lambda s: (resume(s), s),
                          lambda s, e: move_aside(directory, s, beside=e.beside), 3)


def _newest_readable(directory: str | os.PathLike, step: int, steps: Callable[[], list[int]],
                     attempt: Callable[[int], Any],
                     set_aside: Callable[[int, CheckpointDamagedError], str | None],
                     stacklevel: int) -> Any:
  """The one fallback loop of `Checkpointer.newest_readable` and `resume_with_fallback`."""
  directory = os.path.abspath(os.fspath(directory))
  while True:
    try:
      return attempt(step)
    except CheckpointDamagedError as e:
      if os.path.abspath(e.directory) != directory or e.step != step:
        raise  # another checkpoint's damage: not this loop's to handle
      older = [s for s in steps() if s < step]
      if not older:
        raise _no_fallback(e) from e
      dest = set_aside(step, e)
      warnings.warn(_fallback_warning(e, older[-1], dest), stacklevel=stacklevel)
      step = older[-1]


_REQUIRED_FILES = ("_CHECKPOINT_METADATA", os.path.join(META_ITEM, "metadata"),
                   os.path.join(STATE_ITEM, "_METADATA"))


def _incomplete_reason(step_dir: str) -> str | None:
  """Why a committed-looking step directory is not a complete checkpoint, or ``None``.

  Checks the files every zerojax checkpoint has, and that every data file the state's OCDBT
  database refers to exists (a retention pass killed part-way deletes them in any order).
  """
  if not os.path.isdir(step_dir):
    return "not a directory"
  if not os.listdir(step_dir):
    return "empty directory"
  missing = [f for f in _REQUIRED_FILES if not os.path.isfile(os.path.join(step_dir, f))]
  if missing:
    return f"missing {', '.join(missing)} (half-deleted?)"
  item_dir = os.path.join(step_dir, STATE_ITEM)
  if not os.path.isfile(os.path.join(item_dir, "manifest.ocdbt")):
    return None  # not an OCDBT item: orbax's own files were checked above
  try:
    files = _ocdbt_files(item_dir)
  except Exception as e:  # noqa: BLE001 - an unreadable index is what we report
    return f"its state index cannot be read (half-deleted?): {type(e).__name__}: {str(e)[:200]}"
  gone = sorted(f for f in files if not os.path.isfile(os.path.join(item_dir, f)))
  if gone:
    leaves = sorted(set().union(*(files[f] for f in gone)),
                    key=lambda p: (not p.startswith("params/"), p))  # parameters first
    more = f" and {len(leaves) - 5} more" if len(leaves) > 5 else ""
    return (f"{len(gone)} of its {len(files)} data files are missing (half-deleted?), e.g. "
            f"{os.path.join(STATE_ITEM, gone[0])!r}"
            + (f"; {len(leaves)} leaves cannot be read: "
               + ", ".join(repr(p) for p in leaves[:5]) + more if leaves else ""))
  return None


def _ocdbt_files(item_dir: str) -> dict[str, set[str]]:
  """``{file: leaves}``: every file (relative to ``item_dir``) that an OCDBT database's B-tree
  refers to, with the state leaves (``params/...``) whose chunks it holds."""
  base = ts.KvStore.open({"driver": "file", "path": item_dir.rstrip("/") + "/"}).result()
  files: dict[str, set[str]] = {}

  def ref(loc: str) -> set[str]:  # "<kind>:<base path>:<file id>:<offset>:<length>"
    _, prefix, file_id = loc.split(":")[:3]
    return files.setdefault(prefix + file_id, set())

  manifest = ts.ocdbt.dump(base).result()
  for node in manifest.get("version_tree_nodes") or []:
    if isinstance(node, dict) and "location" in node:
      ref(node["location"])
  root = ((manifest.get("versions") or [{}])[-1].get("root") or {}).get("location")
  todo = [(root, b"")] if root else []
  while todo:
    loc, prefix = todo.pop()
    ref(loc)
    node = ts.ocdbt.dump(base, loc).result()
    for e in node.get("entries", []):
      if node.get("height", 0):
        todo.append((e["location"], prefix + e.get("subtree_common_prefix", b"")))
      elif e.get("indirect_value"):
        key = (prefix + e.get("key", b"")).decode("utf-8", "replace")
        ref(e["indirect_value"]).add(key.split("/")[0].replace(".", "/"))  # orbax joins with '.'
  return files


def _verify(where: str, meta: dict, item: PyTree) -> None:
  """Compares the restored leaves' checksums with the ones recorded at save time; a
  `CheckpointDamagedError` names every leaf that differs."""
  want = meta.get("checksums")
  if not want:
    raise CheckpointError(f"checkpoint {where!r} has no leaf checksums in its meta item; "
                          "it was not written by zerojax.runtime.checkpoint")
  got = _checksums(item)
  bad = []
  for path, g in got.items():
    w = want.get(path)
    if w is None:
      raise CheckpointError(f"checkpoint {where!r}: leaf {path!r} has no recorded checksum")
    if list(w) != list(g):
      bad.append((path, g, w))
  if bad:
    bad.sort(key=lambda b: not b[0].startswith("params/"))  # parameters first
    path, g, w = bad[0]
    more = f" (and {len(bad) - 1} more: " + ", ".join(
        repr(b[0]) for b in bad[1:6]) + (", ..." if len(bad) > 6 else "") + ")" if len(
            bad) > 1 else ""
    directory, step = os.path.split(where.rstrip("/"))
    raise CheckpointDamagedError(
        f"checkpoint {where!r} is corrupted: leaf {path!r}{more} was read back with checksum "
        f"{g[0]:08x}{g[1]:08x}, but {w[0]:08x}{w[1]:08x} was recorded when it was saved",
        directory=directory, step=int(meta.get("step", step)), leaves=[b[0] for b in bad])


# -- reading single leaves to host (export, diagnostics) ----------------------------------------


def read_leaf(item_dir: str, keypath: Sequence[Any], tree: PyTree | None = None) -> np.ndarray:
  """Reads one stored leaf, whole, into host memory, with no devices or mesh involved.

  Args:
    item_dir: the ``state`` item directory of a checkpoint step.
    keypath: the leaf's key path in the stored tree.
    tree: the stored tree's metadata (read from ``item_dir`` when ``None``); every other leaf
      is skipped, so a leaf under a list (``opt_state/0/...``) is addressed as stored.
  """
  if tree is None:
    with ocp.PyTreeCheckpointer() as ck:
      md = ck.metadata(item_dir)
    md = getattr(md, "item_metadata", md)
    tree = md.tree if hasattr(md, "tree") else md
  want = tuple(keypath)
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  keys = [tuple(kp) for kp, _ in flat]
  if want not in keys:
    raise KeyError(f"checkpoint item {item_dir!r} has no leaf {path_str(want)!r}")
  item = [np.zeros(()) if k == want else ocp.PLACEHOLDER for k in keys]
  args = [ocp.RestoreArgs(restore_type=np.ndarray) if k == want else ocp.PLACEHOLDER
          for k in keys]
  with ocp.PyTreeCheckpointer() as ck:
    out = ck.restore(item_dir, args=ocp.args.PyTreeRestore(
        item=treedef.unflatten(item), restore_args=treedef.unflatten(args)))
  return np.asarray(_leaf_at(out, want))


def _leaf_at(tree: PyTree, keypath: Sequence[Any]) -> Any:
  for k in keypath:
    if isinstance(k, jax.tree_util.SequenceKey):
      tree = tree[k.idx]
    else:
      tree = tree[getattr(k, "key", getattr(k, "name", k))]
  return tree
