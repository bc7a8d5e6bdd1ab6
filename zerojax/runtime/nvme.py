"""ZeRO-Infinity: the optimizer state on NVMe, streamed through a pipelined host update.

With ``ZeroConfig(offload=NvmeOffload(path))`` no device and no host ever holds
the optimizer state: each process keeps its shards of it in files under ``nvme_path``
(`zerojax.runtime.nvme_store`). A step is split in two, because an ``io_callback`` reading
memory-mapped state inside ``jax.grad`` hangs:

1. **The device part** is the user's own ``train_step`` under `zerojax.zero_step` (stages 1-3,
   gradient accumulation, loss scaling, ``gradient_clipping`` all as in memory), with the
   optimizer swapped for one that only keeps the reduced gradient: ``apply_gradients`` stores
   each device's gradient shard (the optimizer's layout, ``plan.opt_state``) and its global norm
   (computed on the devices, for ``optax.clip_by_global_norm``), and leaves the parameters as
   they were (``p + -0.0 == p`` for every float, ``-0.0`` included).
2. **The host part** (`NvmeOptimizer.update`) copies the gradient and parameter shards to host
   memory as two flat vectors, streams the state through a pool of chunk buffers (read of
   chunk ``i+1``, update of ``i``, write of ``i-1`` at once), runs the user's optax update on
   each chunk, jitted for the host CPU, and returns the updated parameter shards to their
   devices (then all-gathered at stages 1-2, as the plan lays parameters out).

An optax transformation whose update is elementwise over its leaves gives the same bits on a
chunk of the flattened shards as on the whole tree: Adam/AdamW, Lion, SGD with momentum,
schedules, ``inject_hyperparams``, and chains of them. `chunked_transformation` checks that
before step 1 by running both on a small copy of the parameter tree and comparing bits; a
transformation that needs more than its element (LAMB's trust ratio, Adafactor's factored
moments, a mask by leaf name) is refused, named. ``clip_by_global_norm`` at the head of a chain
is the one non-elementwise transformation kept: its norm is the device's.

Example::

  config = zerojax.ZeroConfig(stage=3, offload=zerojax.NvmeOffload("/local_nvme"))
  state, plan = zerojax.create_train_state(model, optax.adamw(1e-3), rng, x, config=config)
  step = zerojax.zero_step(plan)(train_step)   # the same train_step as without NVMe
  for batch in data:
    state, metrics = step(state, batch)
  print(plan.nvme.stats.summary())     # MB/s read and written, update and wait time

`zerojax.create_train_state` builds the device part from `device_part` and then `start`s
the `NvmeOptimizer`, which it puts in ``plan.nvme``.

A Flax NNX model goes through `zerojax.create_nnx`, and its step is the same
``train_step(model, optimizer, batch) -> metrics``::

  model, optimizer, plan = zerojax.create_nnx(lambda: Model(nnx.Rngs(0)), optax.adamw(1e-3),
                                              config=config)
  step = zerojax.zero_step(plan)(train_step)
  for batch in data:
    metrics = step(model, optimizer, batch)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.experimental import multihost_utils

from zerojax.core import agreement
from zerojax.core.config import ConfigError, ZeroConfig
from zerojax.core.policies import NvmeOffload
from zerojax.core.plan import ShardingPlan, path_str, state_fields
from zerojax.core.step import zero_step
from zerojax.runtime.nvme_store import (NvmeError, NvmePathError, NvmeSnapshotDamagedError,
                                        NvmeStateError, NvmeStore, StreamStats)

__all__ = ["NotChunkableError", "NvmeError", "NvmePathError", "NvmeStateError",
           "NvmeSnapshotDamagedError", "StreamStats",
           "ChunkedTransformation", "chunked_transformation", "capture_gradients",
           "NvmeOptimizer", "NnxView", "device_part", "device_config", "device_tx", "start",
           "METRICS"]

PyTree = Any

# The metrics `NvmeOptimizer.step` adds, each the `StreamStats` attribute it reports.
METRICS = {"nvme_read_mb_s": "read_mb_s", "nvme_write_mb_s": "write_mb_s",
           "nvme_update_s": "update_s", "nvme_wait_s": "wait_s", "nvme_wall_s": "wall_s"}


class NotChunkableError(ConfigError):
  """The optax transformation's update is not elementwise: it cannot run chunk by chunk.

  Raised by `chunked_transformation` (and so by `start` and `zerojax.create_train_state`); the
  message names the first member of the chain that fails alone.
  """


# -- which transformations stream ---------------------------------------------------------------


def _free_vars(fn: Callable) -> dict[str, Any]:
  code = getattr(fn, "__code__", None)
  if code is None or fn.__closure__ is None:
    return {}
  return {n: c.cell_contents for n, c in zip(code.co_freevars, fn.__closure__)}


def _name(fn: Callable) -> str:
  return getattr(fn, "__qualname__", repr(fn)).split(".<locals>")[0]


# An update as the host runs it: (updates, state, params, grad_norm) -> (updates, state).
HostUpdate = Callable[[Any, Any, Any, Any], tuple[Any, Any]]


def _host_update(update: Callable, init: Callable | None, seen: list[str]
                 ) -> tuple[HostUpdate, list[tuple[str, Callable | None, Callable]]]:
  """``update`` rewritten for the host, and its leaf transformations ``(name, init, update)``.

  Chains are walked (optax's ``chain`` keeps its members' functions in its closure) so that a
  ``clip_by_global_norm`` that sees the raw gradient uses the norm the device computed;
  ``seen`` lists the leaf transformations met so far in update order.
  """
  fv, name = _free_vars(update), _name(update)
  if name == "with_extra_args_support" and "tx" in fv:
    return _host_update(fv["tx"].update, fv["tx"].init, seen)
  if name == "chain" and "update_fns" in fv:
    inits = _free_vars(init).get("init_fns") if init is not None else None
    inits = inits if inits is not None and len(inits) == len(fv["update_fns"]) else (
        [None] * len(fv["update_fns"]))
    parts, leaves = [], []
    for u, i in zip(fv["update_fns"], inits):
      f, ls = _host_update(u, i, seen)
      parts.append(f)
      leaves += ls

    def chained(updates, state, params, norm):
      new = []
      for s, f in zip(state, parts):
        updates, s = f(updates, s, params, norm)
        new.append(s)
      return updates, tuple(new)
    return chained, leaves
  if name == "clip_by_global_norm" and "max_norm" in fv:
    if seen:
      raise NotChunkableError(
          f"optax.clip_by_global_norm after {seen[-1]} clips by the norm of {seen[-1]}'s "
          "output, which exists only once every chunk is updated; put clip_by_global_norm "
          "first in the chain (or use ZeroConfig.gradient_clipping), so that the device "
          "computes the gradient's norm before the NVMe update")
    seen.append(name)
    max_norm = fv["max_norm"]

    def clip(updates, state, params, norm):
      # optax.clip_by_global_norm's own arithmetic, with the whole gradient's norm.
      trigger = jnp.squeeze(norm < max_norm)
      return jax.tree.map(
          lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm),
          updates), state
    return clip, [(name, init, update)]
  seen.append(name)
  return (lambda u, s, p, norm: update(u, s, p)), [(name, init, update)]


# The chunk update runs on (chunk, one-element pad), so that it rounds as the in-memory update
# does (docs/design.md, "NVMe update").
_PAD = 1


@dataclasses.dataclass(frozen=True)
class ChunkedTransformation:
  """An optax transformation as the NVMe update runs it: on one flat chunk at a time.

  Attributes:
    name: the transformation's name (its update function's).
    treedef: the state's structure for a ``(chunk, pad)`` parameter pair.
    kinds: per state leaf: ``'chunk'`` (one value per parameter: streamed from disk),
      ``'shared'`` (one value for all, such as a step count: kept in the manifest) or
      ``'pad'`` (the pad's own; never stored).
    dtypes: each state leaf's dtype.
  """

  tx: Any
  name: str
  host_update: Any
  treedef: Any
  kinds: tuple[str, ...]
  dtypes: tuple[np.dtype, ...]
  param_dtype: np.dtype

  @property
  def streamed(self) -> list[int]:
    """Indices of the ``'chunk'`` leaves."""
    return [i for i, k in enumerate(self.kinds) if k == "chunk"]

  def _pair(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x, jnp.zeros((_PAD,), x.dtype)

  def _split(self, state: Any) -> tuple[list, list]:
    leaves = jax.tree.leaves(state)
    return ([x for x, k in zip(leaves, self.kinds) if k == "chunk"],
            [x for x, k in zip(leaves, self.kinds) if k == "shared"])

  def init(self, params: jax.Array) -> tuple[list, list]:
    """The optimizer state of one chunk, fresh.

    Args:
      params: a 1-D chunk of parameters.

    Returns:
      ``(chunk leaves, shared leaves)`` of ``tx.init`` on it.
    """
    return self._split(self.tx.init(self._pair(params)))

  def update(self, grads, params, per, shared, norm):
    """The optax update of one chunk.

    Args:
      grads: the chunk's reduced gradient, 1-D.
      params: the chunk's parameters, 1-D.
      per: its ``'chunk'`` state leaves.
      shared: the ``'shared'`` state leaves.
      norm: the gradient's global norm (computed on the devices).

    Returns:
      ``(new params, new chunk leaves, new shared leaves, the pad's results)``.
    """
    pair = self._pair(params)
    fresh = jax.tree.leaves(self.tx.init(pair))  # only the pad's leaves survive XLA's DCE
    per, shared, leaves = iter(per), iter(shared), []
    for k, x in zip(self.kinds, fresh):
      leaves.append(next(per) if k == "chunk" else next(shared) if k == "shared" else x)
    state = jax.tree.unflatten(self.treedef, leaves)
    updates, state = self.host_update(self._pair(grads), state, pair, norm)
    new_pair = optax.apply_updates(pair, updates)
    new_per, new_shared = self._split(state)
    pad = [x for x, k in zip(jax.tree.leaves(state), self.kinds) if k == "pad"]
    # The pad's results are returned (and dropped by the caller) so that XLA keeps them: with
    # them dead, the program is a one-leaf program again (see _PAD).
    return new_pair[0], new_per, new_shared, (new_pair[1], pad)


def _structure(tx: Any, dtype: np.dtype) -> tuple[Any, list[str], list]:
  def shapes(n, m):
    return jax.tree.flatten(jax.eval_shape(tx.init, (jax.ShapeDtypeStruct((n,), dtype),
                                                     jax.ShapeDtypeStruct((m,), dtype))))
  try:
    (la, ta), (lb, tb), (lc, tc) = shapes(5, _PAD), shapes(6, _PAD), shapes(5, _PAD + 1)
  except Exception:  # noqa: BLE001 - e.g. a mask given as a tree of the model's structure
    return None, [], []
  if not ta == tb == tc:
    return None, [], []
  kinds, dtypes = [], []
  for x, y, z in zip(la, lb, lc):
    if x.shape == z.shape == (5,) and y.shape == (6,):
      kinds.append("chunk")
    elif x.shape == y.shape == (_PAD,) and z.shape == (_PAD + 1,):
      kinds.append("pad")
    elif x.shape == y.shape == z.shape:
      kinds.append("shared")
    else:
      return None, [], []
    dtypes.append(np.dtype(x.dtype))
  return ta, kinds, dtypes


def chunked_transformation(tx: Any, params: PyTree, *, probe_steps: int = 3,
                           _search: bool = True) -> ChunkedTransformation:
  """``tx`` as the NVMe update runs it, after checking that it may.

  The check (`_probe`) runs ``tx`` for ``probe_steps`` steps on a small copy of ``params``'
  tree (each dimension cut to at most 8; random values and gradients): as optax runs it on the
  whole tree, and as the NVMe update does, piece by piece, with two different cuts into pieces,
  which must agree bit for bit (and with optax to rounding). A failure is traced to the first
  member of the chain that fails alone.

  Args:
    tx: the optax transformation.
    params: the parameter tree (arrays or shapes) whose structure the probe copies.
    probe_steps: how many steps the probe runs.

  Returns:
    The `ChunkedTransformation` the NVMe update runs piece by piece.

  Raises:
    NotChunkableError: naming the first transformation whose update is not elementwise.
  """
  leaves = jax.tree.leaves(params)
  dtypes = {np.dtype(x.dtype) for x in leaves}
  if len(dtypes) != 1:
    raise NotChunkableError(
        f"the parameters have several dtypes ({sorted(str(d) for d in dtypes)}); the NVMe "
        "update streams one flat vector per state leaf, so every parameter must have "
        "ZeroConfig.param_dtype")
  pdtype = dtypes.pop()
  host_update, parts = _host_update(tx.update, tx.init, [])
  name = _name(tx.update)
  treedef, kinds, sdtypes = _structure(tx, pdtype)
  chunked = None
  if treedef is not None:
    chunked = ChunkedTransformation(tx, name, host_update, treedef, tuple(kinds),
                                    tuple(sdtypes), pdtype)
  if chunked is None or not _probe(chunked, tx.init, tx.update, params, probe_steps):
    culprit = name
    for pname, pinit, pupdate in parts if _search else ():
      if pinit is None or pname == "clip_by_global_norm":
        continue
      try:
        chunked_transformation(optax.GradientTransformation(pinit, pupdate), params,
                               probe_steps=probe_steps, _search=False)
      except NotChunkableError:
        culprit = pname
        break
    why = ("keeps state that is neither one value per parameter nor one value for all (e.g. "
           "factored moments, or a mask shaped like the model)" if chunked is None else
           "does not update each parameter from its own values alone (probed: updated in "
           "pieces it gave other values than optax on the whole tree)")
    raise NotChunkableError(
        f"the optax transformation {culprit!r} (in {name!r}) {why}, so the NVMe update cannot "
        "run it chunk by chunk; elementwise transformations stream (adam, adamw, lion, sgd "
        "with momentum, schedules, clip_by_global_norm first in a chain); keep this one in "
        "memory (offload_optimizer=True or False)")
  return chunked


def _row_pieces(shape: tuple[int, ...], max_elems: int) -> list[tuple[int, int]]:
  """``(first row, last row + 1)`` pieces of an array of ``shape``, each at most ``max_elems``
  elements (at least one row). A piece keeps the array's trailing dimensions, so an element
  sits at the same place in its row as in the in-memory update and gets the same bits
  (docs/design.md, "NVMe update")."""
  if not shape:
    return [(0, 1)]
  row = int(np.prod(shape[1:], dtype=np.int64))
  per = max(1, max_elems // max(row, 1))
  return [(r, min(r + per, shape[0])) for r in range(0, shape[0], per)]


def _probe(chunked: ChunkedTransformation, init, update, params, steps: int) -> bool:
  """Whether ``chunked`` runs ``tx`` elementwise: each leaf updated whole and in pieces of
  rows must give the same bits (an update that reads more than its element sees other
  neighbours), and both must match optax on the whole tree to float32 rounding (a mask or a
  per-leaf statistic changes whole values; the whole-tree program may round a fused
  multiply-add differently)."""
  cpu = jax.local_devices(backend="cpu")[0]
  rng = np.random.default_rng(0)
  small = jax.tree.map(
      lambda x: jax.device_put((rng.standard_normal(tuple(min(d, 8) for d in x.shape))
                                * 10.0 ** rng.integers(-2, 2)).astype(chunked.param_dtype),
                               cpu), params)
  leaves = jax.tree.leaves(small)
  pieces_by = [[(i, a, b) for i, x in enumerate(leaves) for a, b in _row_pieces(x.shape, n)]
               for n in (1 << 30, 8)]  # whole leaves; rows in twos or ones
  with jax.default_device(cpu):
    try:
      grads = [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype)),
                            small) for _ in range(steps)]
      ref_p, ref_s = _probe_reference(init, update, small, grads)
      step = jax.jit(chunked.update)
      runs = [_probe_chunked(chunked, step, leaves, grads, pieces) for pieces in pieces_by]
    except Exception:  # noqa: BLE001 - a transformation that fails on a flat chunk
      return False
  vectors = _probe_vectors(chunked, runs)
  if vectors is None or not all(_same_bits(x, y) for x, y in zip(*vectors)):
    return False
  flat = lambda t: np.concatenate([np.asarray(x).reshape(-1) for x in jax.tree.leaves(t)])
  want = [flat(ref_p)] + [_reference_leaf(ref_s, chunked, k) for k in chunked.streamed]
  return all(w is not None and w.shape == v.shape and np.allclose(
      v.astype(np.float64), w.astype(np.float64), rtol=1e-5,
      atol=1e-6 * float(np.max(np.abs(w)) or 1.0)) for v, w in zip(vectors[0], want))


def _probe_reference(init, update, params, grads) -> tuple[Any, Any]:
  """``(params, state)`` after optax's own update of the whole tree for each of ``grads``."""
  @jax.jit
  def ref_step(g, state, params):
    updates, state = update(g, state, params)
    return optax.apply_updates(params, updates), state

  ref_p, ref_s = params, jax.jit(init)(params)
  for g in grads:
    ref_p, ref_s = ref_step(g, ref_s, ref_p)
  return ref_p, ref_s


def _probe_chunked(chunked: ChunkedTransformation, step: Callable, leaves: list, grads: list,
                   pieces: list[tuple[int, int, int]]) -> tuple[np.ndarray, list]:
  """``(flat params, per-piece states)`` after the chunked update of each leaf's ``pieces``
  (``(leaf, first row, last row + 1)``) for each of ``grads``."""
  def cut(x, a, b):
    return x[a:b] if np.ndim(x) else x

  p = [np.asarray(x) for x in leaves]
  states = [chunked.init(jnp.asarray(cut(p[i], a, b))) for i, a, b in pieces]
  for g in grads:
    norm, gl, new_p, new_states = optax.tree.norm(g), jax.tree.leaves(g), [], []
    for (i, a, b), (per, shared) in zip(pieces, states):
      q, per, shared, _ = step(cut(gl[i], a, b), cut(p[i], a, b), per, shared, norm)
      new_p.append(np.asarray(q).reshape(-1))
      new_states.append((per, shared))
    flat = np.concatenate(new_p)
    p, pos = [], 0
    for x in leaves:
      p.append(flat[pos:pos + x.size].reshape(x.shape))
      pos += x.size
    states = new_states
  return np.concatenate([x.reshape(-1) for x in p]), states


def _probe_vectors(chunked: ChunkedTransformation, runs: list) -> list[list[np.ndarray]] | None:
  """Per run, the flat parameters and each streamed state leaf; ``None`` when a shared state
  leaf (a scalar such as Adam's count) differs between pieces."""
  streamed = chunked.streamed
  shared_at = [i for i, k in enumerate(chunked.kinds) if k == "shared"]
  vectors = []
  for p, states in runs:
    vs = [p] + [np.concatenate([np.asarray(s[0][streamed.index(k)]).reshape(-1)
                                for s in states]) for k in streamed]
    for k in shared_at:
      vals = [np.asarray(s[1][shared_at.index(k)]) for s in states]
      if not all(_same_bits(vals[0], v) for v in vals):
        return None
    vectors.append(vs)
  return vectors


def _reference_leaf(ref_state: Any, chunked: ChunkedTransformation, k: int) -> np.ndarray | None:
  """State leaf ``k`` of the whole-tree state, flattened over the parameter leaves: where the
  chunk's state has a chunk leaf and a pad leaf, the whole tree's has one leaf per parameter."""
  ref_flat = jax.tree.leaves(ref_state)
  kinds = chunked.kinds
  n_chunk, n_shared = kinds.count("chunk"), kinds.count("shared")
  nparams = (len(ref_flat) - n_shared) // max(n_chunk, 1)
  if nparams * n_chunk + n_shared != len(ref_flat):
    return None
  pos = sum(nparams if kd == "chunk" else 1 if kd == "shared" else 0 for kd in kinds[:k])
  return np.concatenate([np.asarray(x).reshape(-1) for x in ref_flat[pos:pos + nparams]])


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# -- the device part ----------------------------------------------------------------------------


def capture_gradients() -> optax.GradientTransformation:
  """The device step's optimizer, which only keeps the gradient for the host.

  Returns:
    An ``optax.GradientTransformation`` whose state keeps the reduced gradient (in the
    optimizer's sharded layout) and its global norm, and whose updates are ``-0.0``, which
    leave every parameter's bits as they were.
  """

  def init(params):
    return {"grads": jax.tree.map(jnp.zeros_like, params),
            "norm": jnp.zeros((), jnp.float32)}

  def update(grads, state, params=None):
    del state, params
    return (jax.tree.map(lambda g: jnp.full_like(g, -0.0), grads),
            {"grads": grads, "norm": optax.tree.norm(grads).astype(jnp.float32)})

  return optax.GradientTransformation(init, update)


def device_tx(config: ZeroConfig, tx: Any) -> Any:
  """The optax transformation whose state a run's device train state holds.

  Args:
    config: the run's config.
    tx: the run's optax transformation.

  Returns:
    With ``offload=NvmeOffload(path)``, `capture_gradients` (the state itself is in the
    files); else ``tx``.
  """
  return capture_gradients() if config.optimizer_on_nvme else tx


def device_config(config: ZeroConfig) -> ZeroConfig:
  """The config of the device part: the same run with the optimizer state nowhere.

  Args:
    config: the run's config, with the optimizer state on NVMe.

  Returns:
    ``config`` without optimizer offload, for the device step's plan.
  """
  return config.replace(offload=None)


@struct.dataclass
class NnxView:
  """An NNX ``(model, optimizer)`` pair from `zerojax.create_nnx` as `NvmeOptimizer` reads a linen
  train state, as plain arrays (no copies).

  Attributes:
    step: the optimizer's step count.
    params: the trained parameters.
    opt_state: the captured gradient (the device optimizer's state).
  """

  step: Any
  params: Any
  opt_state: Any

  @classmethod
  def of(cls, model: Any, optimizer: Any) -> "NnxView":
    """The view of an NNX pair.

    Args:
      model: the NNX model from `zerojax.create_nnx`.
      optimizer: its device ``nnx.Optimizer``.

    Returns:
      The `NnxView` of their step, trained parameters and captured gradient.
    """
    return cls(step=optimizer.step[...],
               params=nnx.as_pure(nnx.state(model, optimizer.wrt)),
               opt_state=nnx.as_pure(optimizer.opt_state))


# -- the host part ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Segment:
  leaf: int
  index: tuple[slice, ...]
  shape: tuple[int, ...]
  start: int
  stop: int
  devices: tuple[Any, ...]


def _segments(shardings: list, shapes: list) -> list[_Segment]:
  """Every distinct local shard of every leaf, in a fixed order, with its place in the flat
  vector (replicas of one shard on several local devices share a segment)."""
  out, pos = [], 0
  for li, (sh, shape) in enumerate(zip(shardings, shapes)):
    groups: dict[tuple, list] = {}
    for d, idx in sh.addressable_devices_indices_map(shape).items():
      key = tuple((s.start or 0, shape[a] if s.stop is None else s.stop)
                  for a, s in enumerate(idx)) if shape else ()
      groups.setdefault(key, []).append(d)
    for key in sorted(groups, key=lambda k: min(d.id for d in groups[k])):
      sshape = tuple(b - a for a, b in key)
      n = int(np.prod(sshape, dtype=np.int64))
      devs = tuple(sorted(groups[key], key=lambda d: d.id))
      out.append(_Segment(li, tuple(slice(a, b) for a, b in key), sshape, pos, pos + n, devs))
      pos += n
  return out


@dataclasses.dataclass(frozen=True)
class _Piece:
  """Rows ``[r0, r1)`` of one segment: the unit the update is called on."""
  segment: int
  shape: tuple[int, ...]
  start: int
  stop: int


def _chunks(segments: list[_Segment], chunk_size: int
            ) -> tuple[list[list[_Piece]], list[tuple[int, int]]]:
  """Pieces (`_row_pieces` of each segment) grouped into chunks of at most ``chunk_size``
  elements (a single row larger than that is a chunk of its own): ``(pieces per chunk,
  (start, stop) per chunk)``."""
  chunks: list[list[_Piece]] = [[]]
  for si, seg in enumerate(segments):
    row = int(np.prod(seg.shape[1:], dtype=np.int64)) if seg.shape else 1
    for r0, r1 in _row_pieces(seg.shape, chunk_size):
      n = (r1 - r0) * row
      pc = _Piece(si, (r1 - r0, *seg.shape[1:]) if seg.shape else (), seg.start + r0 * row,
                  seg.start + r0 * row + n)
      if chunks[-1] and pc.stop - chunks[-1][0].start > chunk_size:
        chunks.append([])
      chunks[-1].append(pc)
  chunks = [c for c in chunks if c]
  return chunks, [(c[0].start, c[-1].stop) for c in chunks]


class _HostSegments:
  """Per segment, a flat host array made on first use: a view of the segment's device array
  on XLA:CPU (a copy from an accelerator), or new memory of ``dtype`` where there is no array.
  `release` drops a segment's host array and this object's reference to its device array."""

  def __init__(self, arrays: list, segments: list[_Segment], dtype: np.dtype | None = None):
    self.arrays, self.segments, self.dtype = arrays, segments, dtype
    self.host: dict[int, np.ndarray] = {}

  def piece(self, pc: _Piece) -> np.ndarray:
    k, seg = pc.segment, self.segments[pc.segment]
    if k not in self.host:
      self.host[k] = (np.empty(seg.stop - seg.start, self.dtype) if self.arrays[k] is None
                      else np.asarray(self.arrays[k]).reshape(-1))
    return self.host[k][pc.start - seg.start:pc.stop - seg.start].reshape(pc.shape)

  def release(self, k: int) -> None:
    self.host.pop(k, None)
    self.arrays[k] = None


class NvmeOptimizer:
  """The optimizer state of one run on NVMe: its files, its chunked update, its statistics.

  Made by `start` for `zerojax.create_train_state` (and, to restore a checkpoint into, by
  `zerojax.checkpoint.abstract_train_state`); `step` wraps a train step, `update` is the host
  part alone.

  Attributes:
    offload: the run's `zerojax.NvmeOffload` policy (path, chunk size, buffers, pipelining).
    plan: the device part's plan.
    chunked: the `ChunkedTransformation`.
    store: this process's `zerojax.runtime.nvme_store.NvmeStore`.
    stats: the last host update's `StreamStats`; ``total`` sums every update's.
  """

  def __init__(self, offload: NvmeOffload, plan: ShardingPlan, tx: Any, state: Any):
    if not isinstance(offload, NvmeOffload):
      raise ConfigError(f"NvmeOptimizer(offload=...) needs a zerojax.NvmeOffload, got "
                        f"{type(offload).__name__}")
    self.offload, self.plan, self.tx = offload, plan, tx
    self.chunked = chunked_transformation(tx, state.params)
    captured = state.opt_state["grads"]
    self._opt_shardings = [x.sharding for x in jax.tree.leaves(captured)]
    self._param_shardings = [x.sharding for x in jax.tree.leaves(state.params)]
    self._shapes = [tuple(x.shape) for x in jax.tree.leaves(captured)]
    self._treedef = jax.tree.structure(state.params)
    self.segments = _segments(self._opt_shardings, self._shapes)
    self.size = self.segments[-1].stop if self.segments else 0
    self.pieces, self.bounds = _chunks(self.segments, offload.chunk_size)
    self.grad_dtype = np.dtype(jax.tree.leaves(captured)[0].dtype)
    names = [f"state-{k}" for k in self.chunked.streamed]
    layout = {"shapes": [list(s) for s in self._shapes],
              "segments": [[s.leaf, [[x.start, x.stop] for x in s.index]] for s in self.segments],
              "state": hashlib.sha256(repr((self.chunked.treedef, self.chunked.kinds,
                                            [d.str for d in self.chunked.dtypes])).encode()
                                      ).hexdigest()[:16]}
    self.store = NvmeStore.open(os.fspath(offload.path), jax.process_index(),
                                [(n, self.chunked.dtypes[k]) for n, k in
                                 zip(names, self.chunked.streamed)], self.size, layout)
    self._cpu = jax.local_devices(backend="cpu")[0]
    self._update_chunk = jax.jit(self.chunked.update)  # inputs on the host CPU: it runs there
    self._init = jax.jit(self.chunked.init)
    self.stats = StreamStats()
    self.total = StreamStats()
    self._reshard_in = self._reshard_out = lambda p: p
    if self._opt_shardings != self._param_shardings:  # stages 1-2; a jitted identity copies
      self._reshard_in = jax.jit(lambda p: p, out_shardings=jax.tree.unflatten(
          self._treedef, self._opt_shardings))
      self._reshard_out = jax.jit(lambda p: p, out_shardings=jax.tree.unflatten(
          self._treedef, self._param_shardings))
    last: dict[int, int] = {}
    for i, chunk in enumerate(self.pieces):
      for pc in chunk:
        last[pc.segment] = i
    self._finished = [[k for k, c in last.items() if c == i] for i in range(len(self.pieces))]

  @property
  def directory(self) -> str:
    """This process's directory of optimizer-state files."""
    return self.store.directory

  @property
  def state_bytes(self) -> int:
    """Bytes of one generation of this process's optimizer state."""
    return self.store.nbytes

  # -- moving shards between devices and flat host vectors ----------------------------------------

  def _to_flat(self, tree: PyTree, dtype: np.dtype) -> np.ndarray:
    leaves = jax.tree.leaves(tree)
    out = np.empty(self.size, dtype)
    by_leaf: dict[int, dict[Any, Any]] = {}
    for s in self.segments:
      shards = by_leaf.setdefault(
          s.leaf, {sh.device: sh for sh in leaves[s.leaf].addressable_shards})
      out[s.start:s.stop] = np.asarray(shards[s.devices[0]].data).reshape(-1)
    return out

  def _segment_arrays(self, tree: PyTree) -> list[jax.Array]:
    """Each segment's shard of ``tree`` as a single-device array (it shares the shard's
    buffer: the buffer lives as long as either does)."""
    leaves = jax.tree.leaves(tree)
    shards = [{sh.device: sh for sh in x.addressable_shards} for x in leaves]
    return [shards[s.leaf][s.devices[0]].data for s in self.segments]

  def _assemble(self, per_segment: Sequence[list[jax.Array]]) -> PyTree:
    """The tree laid out as the optimizer shards, from each segment's device arrays."""
    per_leaf: list[list] = [[] for _ in self._shapes]
    for s, bufs in zip(self.segments, per_segment):
      per_leaf[s.leaf] += bufs
    arrays = [jax.make_array_from_single_device_arrays(shape, sh, bufs)
              for shape, sh, bufs in zip(self._shapes, self._opt_shardings, per_leaf)]
    return jax.tree.unflatten(self._treedef, arrays)

  # -- state ------------------------------------------------------------------------------------

  def _piece_arrays(self, i: int, flats: Sequence[np.ndarray], offset: int = 0):
    """Chunk ``i``'s pieces: ``(piece, [each flat vector's values there, shaped])``; ``offset``
    is where ``flats`` start in the whole vector (0 for whole vectors, the chunk's start for
    chunk buffers)."""
    for pc in self.pieces[i]:
      a, b = pc.start - offset, pc.stop - offset
      yield pc, [f[a:b].reshape(pc.shape) for f in flats]

  def initialize(self, state: Any, *, overwrite: bool = False) -> None:
    """Writes the optimizer state of ``state.params`` (``tx.init``, piece by piece) as the
    first generation.

    Args:
      state: the device train state.
      overwrite: replace an existing committed state; otherwise it is kept (see
        `check_resume`).

    Raises:
      NvmeStateError: there are no parameters to keep optimizer state for.
    """
    if self.store.exists and not overwrite:
      return
    if self.size == 0:
      raise NvmeStateError("no parameters to keep optimizer state for")
    p = self._to_flat(self._reshard_in(state.params), self.chunked.param_dtype)
    starts = {a: i for i, (a, _) in enumerate(self.bounds)}
    shared: list = []

    def fill(a: int, b: int):
      out = [np.empty(b - a, self.chunked.dtypes[k]) for k in self.chunked.streamed]
      for pc, (pp,) in self._piece_arrays(starts[a], [p]):
        with jax.default_device(self._cpu):
          per, sh = self._init(jnp.asarray(pp))
        for o, x in zip(out, per):
          o[pc.start - a:pc.stop - a] = np.asarray(x).reshape(-1)
        if not shared:  # a step count: the same for every piece
          shared.extend(np.asarray(x) for x in sh)
      return out

    fill(*self.bounds[0])
    self.store.write_initial(fill, self.bounds, shared, step=int(getattr(state, "step", 0)))

  def check_resume(self, state: Any) -> None:
    """Refuses a state whose step is not the step of the committed optimizer state.

    Args:
      state: the train state (or `NnxView`) about to be stepped.

    Raises:
      NvmeStateError: the steps differ (a restored checkpoint needs its NVMe snapshot,
        `restore_checkpoint`).
    """
    step = int(getattr(state, "step", 0))
    if self.store.step != step:
      raise NvmeStateError(
          f"the optimizer state under {self.directory} is at step {self.store.step} but the "
          f"train state is at step {step}; restore both from one checkpoint "
          "(NvmeOptimizer.restore_checkpoint), or initialize(state, overwrite=True) to start "
          "the optimizer state afresh")

  def update(self, state: Any) -> Any:
    """The host part of a step. The optimizer state on disk moves to the next generation.

    Args:
      state: the state after the device part (its ``opt_state`` holds the reduced gradient).

    Returns:
      The state with updated parameters.

    Raises:
      NvmeStateError: the transformation's shared state differs between pieces (it is not
        elementwise).
    """
    return self._update([state])

  def _finish_segment(self, k: int, new: "_HostSegments", *old: "_HostSegments"
                      ) -> list[jax.Array]:
    """Segment ``k``'s new values on its devices; its host buffer and old shards let go."""
    seg = self.segments[k]
    arrays = [jax.device_put(new.host[k].reshape(seg.shape), d) for d in seg.devices]
    jax.block_until_ready(arrays)
    for h in (new, *old):
      h.release(k)
    return arrays

  def _update(self, owned: list) -> Any:
    """`update` of the state in ``owned``, which it takes out. Where that was the only
    reference (`step`), each old parameter shard is freed as soon as its new values are on its
    device, so that host and device memory hold the parameters once, the gradient shards and
    the buffer pool, plus one segment: never the optimizer state, nor two parameter copies."""
    state = owned.pop()
    jax.block_until_ready(state)  # see start: no host program beside the step's
    step = int(state.step)
    settings = getattr(state, "settings", None)
    if settings is not None and settings.skips and bool(state.overflow):
      # The step was skipped (a non-finite gradient): in memory, params and optimizer state
      # stay bit-identical, so nothing is read or written; only the step number moves.
      self.store._commit(self.store.manifest["generation"], step, self.store.shared())
      self.stats = StreamStats()
      return state
    grads = _HostSegments(self._segment_arrays(state.opt_state["grads"]), self.segments)
    # Ready before any host program starts (see start): the reshard is a
    # multi-device program at stages 1-2.
    params = _HostSegments(self._segment_arrays(jax.block_until_ready(
        self._reshard_in(state.params))), self.segments)
    state = state.replace(params=None)  # the segments' arrays now hold the old parameters
    new = _HostSegments([None] * len(self.segments), self.segments, self.chunked.param_dtype)
    out: list[list[jax.Array]] = [[] for _ in self.segments]
    norm = jax.device_put(np.asarray(state.opt_state["norm"]), self._cpu)
    old_shared = [jax.device_put(x, self._cpu) for x in self.store.shared()]
    new_shared: list = []

    def one(i: int, bufs: list[np.ndarray]) -> None:
      a = self.bounds[i][0]
      for pc, views in self._piece_arrays(i, bufs, offset=a):
        g = jax.device_put(grads.piece(pc), self._cpu)
        p = jax.device_put(params.piece(pc), self._cpu)
        per = [jax.device_put(x, self._cpu) for x in views]
        new_p, new_per, new_sh, _ = self._update_chunk(g, p, per, old_shared, norm)
        np.copyto(new.piece(pc), np.asarray(new_p))
        for view, x in zip(views, new_per):
          np.copyto(view, np.asarray(x))
        sh = [np.asarray(x) for x in new_sh]
        if not new_shared:
          new_shared.extend(sh)
        elif not all(_same_bits(x, y) for x, y in zip(new_shared, sh)):
          raise NvmeStateError("pieces disagree on the shared optimizer state (a step count): "
                               f"the transformation {self.chunked.name!r} is not elementwise")
      for k in self._finished[i]:  # segments whose last piece this chunk held
        out[k] = self._finish_segment(k, new, params, grads)

    o = self.offload
    self.stats = self.store.stream(
        one, bounds=self.bounds, buffer_count=o.buffer_count,
        pipeline_read=o.pipeline_read, pipeline_write=o.pipeline_write,
        shared=lambda: new_shared, step=step)
    self.total.add(self.stats)
    new_params = self._reshard_out(self._assemble(out))
    # One multi-device program in flight at a time: the all-gather above and the next step's
    # collectives, both in flight, can deadlock XLA:CPU's collective rendezvous.
    jax.block_until_ready(new_params)
    return state.replace(params=new_params)

  # -- to and from an in-memory optimizer state -------------------------------------------------

  def _full_positions(self) -> tuple[Any, list[tuple[str, int]]]:
    """The whole-tree state's structure and, per leaf of it in tree order, ``('chunk', k, j)``
    (chunk leaf ``k``'s values for parameter leaf ``j``) or ``('shared', k, None)``; a chunk
    leaf stands for one leaf per parameter there (see `_reference_leaf`)."""
    abstract = jax.eval_shape(self.tx.init, jax.tree.unflatten(
        self._treedef, [jax.ShapeDtypeStruct(s, self.chunked.param_dtype) for s in self._shapes]))
    treedef = jax.tree.structure(abstract)
    out = []
    for k, kind in enumerate(self.chunked.kinds):
      if kind == "chunk":
        out += [("chunk", k, j) for j in range(len(self._shapes))]
      elif kind == "shared":
        out.append(("shared", k, None))
    if len(out) != treedef.num_leaves:
      raise NvmeStateError(f"the state of {self.chunked.name!r} on the whole tree has "
                           f"{treedef.num_leaves} leaves, not the {len(out)} its chunks imply")
    return treedef, out

  def opt_state(self) -> PyTree:
    """The committed optimizer state as the optax state tree ``tx.init(params)`` makes, laid
    out as this run's optimizer shards (replicated scalars): what an in-memory or host-offload
    run holds, e.g. to save it with `zerojax.runtime.checkpoint.Checkpointer` or continue in
    memory. It needs memory for the whole state of this process.

    Returns:
      The optax state tree, on this run's devices.
    """
    treedef, positions = self._full_positions()
    streamed = self.chunked.streamed
    shared = self.store.shared()
    shared_at = [i for i, k in enumerate(self.chunked.kinds) if k == "shared"]
    vectors = {k: self.store.read(streamed.index(k)) for k in streamed}
    mesh = self._opt_shardings[0].mesh
    leaves = []
    for kind, k, j in positions:
      if kind == "shared":
        value = shared[shared_at.index(k)]
        leaves.append(jax.device_put(value, jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec())))
        continue
      bufs = [jax.device_put(vectors[k][s.start:s.stop].reshape(s.shape), d)
              for s in self.segments if s.leaf == j for d in s.devices]
      leaves.append(jax.make_array_from_single_device_arrays(self._shapes[j],
                                                             self._opt_shardings[j], bufs))
    return jax.tree.unflatten(treedef, leaves)

  def load_opt_state(self, opt_state: PyTree, step: int) -> None:
    """Writes an optax state tree as the committed generation at ``step``.

    Args:
      opt_state: the state, from an in-memory or host-offload run or a checkpoint of one, in
        any sharding.
      step: the step it belongs to.

    Raises:
      NvmeStateError: its structure is not the one this run's transformation makes.
    """
    treedef, positions = self._full_positions()
    leaves, got = jax.tree.flatten(opt_state)
    if got != treedef:
      raise NvmeStateError(f"the optimizer state given has structure {got}, this run's "
                           f"transformation {self.chunked.name!r} makes {treedef}")
    vectors = {k: np.empty(self.size, self.chunked.dtypes[k]) for k in self.chunked.streamed}
    shared = {}
    for (kind, k, j), x in zip(positions, leaves):
      if kind == "shared":
        shared[k] = np.asarray(jax.device_get(x))
        continue
      x = jax.device_put(x, self._opt_shardings[j])
      views = {sh.device: sh for sh in x.addressable_shards}
      for s in self.segments:
        if s.leaf == j:
          vectors[k][s.start:s.stop] = np.asarray(views[s.devices[0]].data).reshape(-1)
    self.store.write_initial(lambda a, b: [vectors[k][a:b] for k in self.chunked.streamed],
                             self.bounds, [shared[k] for k in sorted(shared)], step=step)

  # -- checkpoints ------------------------------------------------------------------------------

  def _snapshot_dir(self, directory: str, step: int) -> str:
    return os.path.join(directory, f"nvme-{step}", f"process-{jax.process_index()}")

  def save_checkpoint(self, checkpointer: Any, state: Any, **save_kw: Any) -> int:
    """Saves ``state`` with ``checkpointer`` (a `zerojax.runtime.checkpoint.Checkpointer`) as
    checkpoint ``state.step``, with the optimizer state's files beside it, and waits for it.

    The files go first, to ``<checkpoint dir>/nvme-<step>/process-<i>`` (hard links of the
    committed generation, committed by a rename); then the train state through orbax, whose
    own rename commits the checkpoint. A checkpoint counts only when both are there
    (`restore_checkpoint`), so a process killed in between leaves the previous one. Snapshots
    whose orbax step was deleted by retention are removed.

    Args:
      checkpointer: the `zerojax.runtime.checkpoint.Checkpointer`.
      state: the train state after the host update, or the checkpoint item (a dict with a
        ``step``) made of it (an NNX run's).
      **save_kw: passed on to ``checkpointer.save``.

    Returns:
      The step saved.

    Raises:
      NvmeStateError: the optimizer state is not at ``state.step`` (save after the host
        update, as `step` does).
    """
    step = int(state_fields(state)["step"])
    snap = self._snapshot_dir(checkpointer.directory, step)
    if self.store.step != step:
      raise NvmeStateError(f"the optimizer state is at step {self.store.step}, the train state "
                           f"at {step}: save after the host update (NvmeOptimizer.step does)")
    if os.path.exists(snap) and step not in checkpointer.all_steps():
      shutil.rmtree(snap)  # left by a save killed before orbax's commit: maybe other values
    if not os.path.exists(snap):
      self.store.snapshot(snap)
    checkpointer.save(step, state, force=True, **save_kw)
    checkpointer.wait()
    keep = set(checkpointer.all_steps())
    for name in os.listdir(checkpointer.directory):
      if name.startswith("nvme-") and name[5:].isdigit() and int(name[5:]) not in keep:
        shutil.rmtree(os.path.join(checkpointer.directory, name), ignore_errors=True)
    return step

  def checkpoint_steps(self, checkpointer: Any) -> list[int]:
    """Steps with a complete checkpoint: orbax's and the optimizer state's files.

    Args:
      checkpointer: the `zerojax.runtime.checkpoint.Checkpointer`.

    Returns:
      The steps, in orbax's order.
    """
    return [s for s in checkpointer.all_steps()
            if os.path.exists(os.path.join(self._snapshot_dir(checkpointer.directory, s),
                                           "manifest.json"))]

  def restore_checkpoint(self, checkpointer: Any, state: Any, step: int | None = None, *,
                         stacklevel: int = 2) -> tuple[Any, Any]:
    """Restores the newest complete checkpoint (or ``step``): the train state through orbax
    into this run's plan, and the optimizer state's files as the store's committed
    generation, once they read back as written (`NvmeStore.verify_snapshot`: sizes and the
    CRC-32 of every chunk).

    A damaged checkpoint (truncated, corrupted or missing files, in orbax's step or in its
    ``nvme-<step>`` snapshot) is a `zerojax.runtime.checkpoint.CheckpointDamagedError` naming
    the damaged leaves (the optimizer-state leaves a damaged snapshot file holds) and files,
    whose ``beside`` names the snapshot, so that
    `zerojax.runtime.checkpoint.resume_with_fallback` moves both aside. With ``step=None``
    the newest complete step before it is restored instead, with a warning, as
    `Checkpointer.restore` does (a writing ``checkpointer`` moves the damaged step aside).

    Args:
      checkpointer: the run's `zerojax.runtime.checkpoint.Checkpointer`.
      state: the train state to restore into (its structure, shapes and shardings).
      step: the step; ``None`` is the newest complete one.
      stacklevel: the fallback warning's, as if this method called ``warnings.warn`` itself:
        2 (default) names the line that calls it.

    Returns:
      ``(state, extras)`` as `Checkpointer.restore` does.

    Raises:
      CheckpointDamagedError: ``step`` (or, with ``None``, every complete step) is damaged.
      NvmeStateError: no such complete step, or its snapshot holds another run's layout.
    """
    if step is not None:
      if step not in checkpointer.all_steps():
        raise NvmeStateError(f"checkpoint step {step} in {checkpointer.directory!r} does not "
                             f"exist; complete steps are {self.checkpoint_steps(checkpointer)}")
      return self._restore_step(checkpointer, state, step)
    steps = self.checkpoint_steps(checkpointer)
    if not steps:
      raise NvmeStateError(f"no complete NVMe checkpoint in {checkpointer.directory!r} "
                           f"(orbax steps {checkpointer.all_steps()})")
    return checkpointer.newest_readable(
        steps[-1], lambda: self.checkpoint_steps(checkpointer),
        lambda s: self._restore_step(checkpointer, state, s), stacklevel=stacklevel + 1)

  def restore_snapshot(self, checkpointer: Any, step: int) -> None:
    """Makes checkpoint ``step``'s optimizer-state snapshot the committed state, once it reads
    back as written; for a caller that restores the train state itself (an NNX model created
    from the checkpoint with ``zerojax.create_nnx(..., restoring=True)``, as
    ``zerojax finetune`` does). `restore_checkpoint` does both.

    Args:
      checkpointer: the run's `zerojax.runtime.checkpoint.Checkpointer`.
      step: the checkpoint's step.

    Raises:
      CheckpointDamagedError: the snapshot is missing, truncated or corrupted (its ``beside``
        names it, so that `zerojax.runtime.checkpoint.resume_with_fallback` moves it aside
        with the step).
      NvmeStateError: the snapshot holds another run's layout.
    """
    self.store.restore_snapshot(self._checked_snapshot(checkpointer, step), verify=False)

  def _restore_step(self, checkpointer: Any, state: Any, step: int) -> tuple[Any, Any]:
    """`restore_checkpoint` of one step: the snapshot is read back first (the cheaper
    failure, and nothing is restored from a step that cannot be used)."""
    from zerojax.runtime import checkpoint as zc
    snap = self._checked_snapshot(checkpointer, step)
    try:
      state, extras = checkpointer.restore(state, self.plan, step)
    except zc.CheckpointDamagedError as e:
      e.beside = (*e.beside, f"nvme-{step}")  # the snapshot goes aside with orbax's step
      raise
    self.store.restore_snapshot(snap, verify=False)
    return state, extras

  def _checked_snapshot(self, checkpointer: Any, step: int) -> str:
    """The directory of checkpoint ``step``'s snapshot, read back as written, every process
    agreeing on whether each could."""
    from zerojax.runtime import checkpoint as zc
    snap = self._snapshot_dir(checkpointer.directory, step)
    beside = (f"nvme-{step}",)
    damaged = other = None
    try:
      self.store.verify_snapshot(snap)
    except NvmeSnapshotDamagedError as e:
      damaged = e
    except NvmeError as e:  # another run's snapshot: not damage, and no fallback
      other = e
    if jax.process_count() > 1:
      # Each process reads its own snapshot: one that fails must not leave the others
      # restoring (a collective) alone; every process learns who failed and how.
      flags = np.asarray(multihost_utils.process_allgather(
          np.int32(2 if other else 1 if damaged else 0))).reshape(-1)
      if other is None and (flags == 2).any():  # a layout that differs, not damage: no fallback
        raise NvmeStateError(f"checkpoint step {step}: process(es) "
                             f"{[i for i, f in enumerate(flags) if f == 2]} cannot restore "
                             "their optimizer-state snapshot; their errors say why")
      if other is None and damaged is None and flags.any():
        raise zc.CheckpointDamagedError(
            f"checkpoint step {step} in {checkpointer.directory!r}: the optimizer-state "
            f"snapshots of process(es) {[i for i, f in enumerate(flags) if f]} cannot be read "
            "back as written (truncated, corrupted or missing files); their warnings name the "
            "files and leaves", directory=checkpointer.directory, step=step, beside=beside)
    if other is not None:
      raise other
    if damaged is not None:
      raise self._damaged(checkpointer, step, damaged) from None
    return snap

  def _damaged(self, checkpointer: Any, step: int, e: NvmeSnapshotDamagedError) -> Exception:
    """The `CheckpointDamagedError` of a damaged snapshot: its files, and the optimizer-state
    leaves whose values (of this process's shards) they hold, in tree order."""
    from zerojax.runtime import checkpoint as zc
    names = self._state_leaf_names()
    leaves: list[str] = []
    files, held = [], []
    for f in e.damaged:
      rel = os.path.relpath(os.path.join(e.directory, f.name), checkpointer.directory)
      files.append(rel)
      mine = []
      for idx in range(len(self.store.leaves)) if f.leaf is None else [f.leaf]:
        k = self.chunked.streamed[idx]
        params = sorted({s.leaf for s in self.segments for a, b in f.ranges
                         if s.start < b and a < s.stop})
        mine += [names[(k, j)] for j in params]
      held.append(f"{rel} {f.reason}, holding {len(mine)} leaves' values")
      leaves += [n for n in mine if n not in leaves]
    return zc.CheckpointDamagedError(
        f"checkpoint step {step} in {checkpointer.directory!r}: its optimizer-state snapshot "
        f"cannot be read back as written: " + "; ".join(held) + " (" + ", ".join(
            repr(n) for n in leaves[:6]) + (f" and {len(leaves) - 6} more" if len(
                leaves) > 6 else "") + ")", directory=checkpointer.directory, step=step,
        leaves=leaves, files=files, beside=(f"nvme-{step}",))

  def _state_leaf_names(self) -> dict[tuple[int, int], str]:
    """``{(state leaf k, parameter leaf j): name}`` of the streamed leaves, named as the
    in-memory optimizer state's leaves are in a checkpoint (``opt_state/0/mu/...``)."""
    abstract = jax.eval_shape(self.tx.init, jax.tree.unflatten(
        self._treedef, [jax.ShapeDtypeStruct(s, self.chunked.param_dtype) for s in self._shapes]))
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    _, positions = self._full_positions()
    return {(k, j): f"opt_state/{p}" for (kind, k, j), p in zip(positions, paths)
            if kind == "chunk"}

  def step(self, train_step: Callable, donate: bool = True) -> Callable:
    """``train_step`` as a full NVMe step: `zerojax.zero_step` on the devices, then
    `update` on the host. Called as ``step(state, batch, ...) -> (state, metrics)``, or, for
    an NNX pair from `zerojax.create_nnx`, ``step(model, optimizer, batch, ...) -> metrics`` (the
    model's parameters are updated in place, as under ``nnx.jit``). Metrics gain ``nvme_*``
    timings of the host part.

    Args:
      train_step: the user's train step, as for `zerojax.zero_step`.
      donate: donate the state's buffers to the device step.

    Returns:
      The NVMe step. Its first call refuses a state whose step is not the committed optimizer
      state's (`check_resume`).
    """
    device_step = zero_step(self.plan, donate=donate)(train_step)
    checked: list[bool] = []

    def run(*args):
      pair = bool(args) and isinstance(args[0], nnx.Module)
      if not checked:
        self.check_resume(NnxView.of(*args[:2]) if pair else args[0])
        checked.append(True)
      if pair:  # the NNX step updates (model, optimizer) in place and returns metrics; the
        # model holds its old parameters until nnx.update, so they are not freed early
        metrics = device_step(*args)
        nnx.update(args[0], self._update([NnxView.of(*args[:2])]).params)
        return self._metrics(metrics)
      state, metrics = device_step(*args)
      owned = [state]
      del state  # the host update frees each old parameter shard as its new one is made
      return self._update(owned), self._metrics(metrics)

    run.device_step = device_step  # type: ignore[attr-defined]
    return run

  def _metrics(self, metrics: Any) -> Any:
    if not isinstance(metrics, dict):
      return metrics
    return {**metrics, **{k: getattr(self.stats, a) for k, a in METRICS.items()}}


def device_part(config: ZeroConfig, tx: Any, *, nnx_model: bool = False
                ) -> tuple[ZeroConfig, optax.GradientTransformation]:
  """The device part of an NVMe run, checked before any device work.

  `zerojax.create_train_state` (and `zerojax.create_nnx`,
  `zerojax.checkpoint.abstract_train_state`) create the device state with these in place of
  ``config`` and ``tx``; `start` (or `NvmeOptimizer`) then takes the optimizer state of ``tx``
  to the files.

  Args:
    config: the run's config, with ``offload=NvmeOffload(path)``.
    tx: the optax transformation whose state goes to the files; with several processes,
      each must stream the same one (checked here).
    nnx_model: the run is a Flax NNX model's (`zerojax.create_nnx`).

  Returns:
    ``(device config, device transformation)``: ``config`` without optimizer offload
    (`device_config`) and `capture_gradients`.

  Raises:
    ConfigError: ``config`` does not put the optimizer state on NVMe, or (``nnx_model``) asks
      for loss scaling, which the NNX step cannot honour with the state on NVMe.
    ProcessMismatchError: the processes' configs or transformations differ.
  """
  if not isinstance(config, ZeroConfig) or not config.optimizer_on_nvme:
    raise ConfigError("zerojax.runtime.nvme.device_part needs a ZeroConfig with "
                      "offload=NvmeOffload(path)")
  if nnx_model and config.loss_scale is not None:
    # The NNX step skips an overflowing step inside nnx.Optimizer.update; the host update
    # would apply the captured non-finite gradient all the same.
    raise ConfigError(f"loss_scale={config.loss_scale.scale!r} with the optimizer state on "
                      "NVMe needs a linen model (zerojax.create_train_state)",
                      field="loss_scale", value=config.loss_scale.scale,
                      allowed="None with an NNX model and NvmeOffload")
  dtx = device_tx(config, tx)
  device = device_config(config)
  if jax.process_count() > 1:
    agreement.check_agreement(config, extra={"nvme_tx": _name(tx.update)})
  return device, dtx


def start(offload: NvmeOffload, plan: ShardingPlan, tx: Any, state: Any, *,
          overwrite: bool = False, restoring: bool = False) -> NvmeOptimizer:
  """The `NvmeOptimizer` of a device state just created, its files ready for step 1.

  ``tx``'s updates are checked to be elementwise (`chunked_transformation`); then, after the
  start-up checks of the path (`zerojax.runtime.nvme_store.check_nvme_path`), the optimizer
  state is written chunk by chunk as the first generation of files, unless a committed state
  is already there (a resumed run: its step must match the train state's,
  `NvmeOptimizer.check_resume`) or ``overwrite``. With ``restoring`` the files are only
  opened: a checkpoint's snapshot is restored next (`NvmeOptimizer.restore_snapshot`).

  Args:
    offload: the run's `NvmeOffload`.
    plan: the device part's plan.
    tx: the optax transformation whose state goes to the files.
    state: the device state (a linen train state, or an `NnxView`).
    overwrite: replace a committed state under the path instead of resuming it.
    restoring: write nothing; the caller restores a checkpoint's snapshot next.

  Returns:
    The `NvmeOptimizer`.

  Raises:
    NotChunkableError: ``tx``'s update is not elementwise.
    NvmePathError: the path is unusable (not writable, too little space).
    NvmeStateError: a committed state's step does not match the train state's.
  """
  # The host's programs run on one of the devices (XLA:CPU): none may start while a
  # multi-device program is in flight, whose devices could then reach its collectives in
  # different orders and deadlock.
  jax.block_until_ready(state)
  nvme = NvmeOptimizer(offload, plan, tx, state)
  if not restoring:
    nvme.initialize(state, overwrite=overwrite)
  return nvme
