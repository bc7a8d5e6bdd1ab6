"""The files of an NVMe-resident optimizer state, and the pipelined stream through them.

One process's state is a few flat vectors (one per per-element optimizer-state leaf, e.g.
Adam's ``mu`` and ``nu`` over every local parameter shard, concatenated) plus a handful of
shared scalars (Adam's ``count``). They live under
``<nvme_path>/zerojax-nvme/process-<i>/``::

  CURRENT               JSON manifest: generation, step, leaves, shared scalars, and a
                        CRC-32 of every chunk of every file as it was written (the commit)
  gen-00000012/0.bin    leaf 0 of generation 12 (raw bytes, native dtype)
  gen-00000012/1.bin    ...

**Generations.** A step never writes into the files it reads: it streams generation ``g`` in and
writes generation ``g+1`` beside it, syncs the new files, and only then replaces ``CURRENT``
(write, fsync, rename, fsync of the directory: the commit). A process killed anywhere before
the rename leaves ``CURRENT`` naming ``g``, whose files were never touched; one killed after it
names ``g+1``, which is complete. Whatever else lies in the directory is removed when the store
is next opened. This costs disk room for two generations while a step runs (checked up front,
`check_nvme_path`), never a torn state.

**The stream.** `NvmeStore.stream` moves the state through a bounded pool of chunk buffers:
a reader thread fills free buffers with chunk ``i+1`` (and on), the calling thread updates
chunk ``i`` in place, and a writer thread writes and syncs chunk ``i-1`` to the next
generation and returns its buffer to the pool. ``os.preadv``/``os.pwrite`` release the GIL, so the three run
at once; host memory holds ``buffer_count`` chunks of optimizer state, never the whole state.
Pages read or written are dropped from the page cache (``posix_fadvise``), so that neither the
reads of the next step nor the process's memory count on the cache.

**Snapshots** (`NvmeStore.snapshot`, a checkpoint's ``nvme-<step>``) keep the manifest, with its
per-chunk CRC-32s, beside the files; `NvmeStore.verify_snapshot` reads them back against it
before a resume, so a truncated, corrupted or missing file is named
(`NvmeSnapshotDamagedError`: which file, which element ranges) instead of resumed from.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import queue
import shutil
import socket
import threading
import time
import zlib
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["FORMAT", "NvmeError", "NvmePathError", "NvmeDiskFullError", "NvmeStateError",
           "NvmeSnapshotDamagedError", "DamagedFile", "StreamStats", "NvmeStore",
           "check_nvme_path", "process_dir"]

FORMAT = "zerojax-nvme-1"
_CURRENT = "CURRENT"
_MANIFEST = "manifest.json"  # a snapshot's copy of CURRENT
_DIGEST = "crc32"  # of each chunk's bytes, as written (zlib: cheap beside the disk's rate)


class NvmeError(RuntimeError):
  """Something about the NVMe optimizer state is wrong."""


class NvmePathError(NvmeError):
  """``nvme_path`` is missing, not writable, or short of space on this host."""


class NvmeDiskFullError(NvmePathError):
  """The disk under ``nvme_path`` filled up while a new generation was written. The committed
  generation is intact and the partial one is removed; the message names the path, the bytes
  needed and the last complete generation."""


# A write that fails for want of room (or quota): the disk is full, nothing else is wrong.
_FULL = (errno.ENOSPC, errno.EDQUOT)


class NvmeStateError(NvmeError):
  """The files under ``nvme_path`` do not hold the state this run expects."""


@dataclasses.dataclass(frozen=True)
class DamagedFile:
  """One file of a snapshot that does not read back as it was written.

  Attributes:
    name: the file's name in the snapshot (``'0.bin'``, or ``'manifest.json'``, whose loss
      leaves every leaf's file unusable).
    leaf: the store leaf the file holds (index into `NvmeStore.leaves`); ``None`` for the
      manifest: every leaf.
    reason: what is wrong, in words.
    ranges: ``(start, stop)`` element ranges whose values are lost or wrong.
  """

  name: str
  leaf: int | None
  reason: str
  ranges: tuple[tuple[int, int], ...]


class NvmeSnapshotDamagedError(NvmeError):
  """A snapshot's files are truncated, corrupted or missing (not a snapshot of another run:
  that is `NvmeStateError`).

  Attributes:
    directory: the snapshot's directory.
    damaged: a `DamagedFile` per damaged file.
  """

  def __init__(self, message: str, *, directory: str, damaged: Sequence[DamagedFile]):
    super().__init__(message)
    self.directory, self.damaged = directory, tuple(damaged)


def process_dir(nvme_path: str, process_index: int) -> str:
  """A process's directory under ``nvme_path``.

  Args:
    nvme_path: the run's ``nvme_path``.
    process_index: the JAX process index.

  Returns:
    ``<nvme_path>/zerojax-nvme/process-<process_index>``.
  """
  return os.path.join(nvme_path, "zerojax-nvme", f"process-{process_index}")


def check_nvme_path(nvme_path: str, bytes_needed: int, *, in_use: int = 0) -> int:
  """Checks, before step 1, that ``nvme_path`` exists, is a writable directory and has room
  for ``bytes_needed`` more bytes (``in_use``: bytes of this store already on that disk, which
  count as room since the store rewrites them).

  Args:
    nvme_path: the directory.
    bytes_needed: bytes of room this process's optimizer state needs there.
    in_use: bytes of this store already on that disk.

  Returns:
    The free bytes.

  Raises:
    NvmePathError: naming the host, the path, the bytes needed and the bytes free.
  """
  host = socket.gethostname()
  where = f"host {host!r}: nvme_path {nvme_path!r}"
  need = f"{bytes_needed:,} bytes needed for this process's optimizer state plus one generation"
  if not os.path.exists(nvme_path):
    raise NvmePathError(f"{where} does not exist ({need}); create it on a local disk or set "
                        "nvme_path to an existing directory")
  if not os.path.isdir(nvme_path):
    raise NvmePathError(f"{where} is not a directory ({need})")
  probe = os.path.join(nvme_path, f".zerojax-write-probe-{os.getpid()}")
  try:
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
      os.write(fd, b"\0" * 4096)
      os.fsync(fd)
    finally:
      os.close(fd)
      os.unlink(probe)
  except OSError as e:
    raise NvmePathError(f"{where} is not writable ({e.strerror}; {need})") from None
  free = shutil.disk_usage(nvme_path).free
  if free + in_use < bytes_needed:
    raise NvmePathError(f"{where} has {free:,} bytes free"
                        + (f" (+{in_use:,} held by its current state)" if in_use else "")
                        + f", {need}; free space there or point nvme_path at a larger disk")
  return free


@dataclasses.dataclass
class StreamStats:
  """What one pass over the state cost; times are seconds.

  Attributes:
    chunks: chunks streamed.
    bytes_read: bytes read from the files.
    bytes_written: bytes written to the files.
    read_s: time the reader spent in system calls (so MB/s is the disk's rate while busy).
    write_s: time the writer spent in system calls.
    sync_s: time spent making the written files durable.
    update_s: time the optimizer update took.
    wait_s: time the update waited for a chunk to arrive or a buffer to free up.
    wall_s: the pass's wall time.
  """

  chunks: int = 0
  bytes_read: int = 0
  bytes_written: int = 0
  read_s: float = 0.0
  write_s: float = 0.0
  sync_s: float = 0.0
  update_s: float = 0.0
  wait_s: float = 0.0
  wall_s: float = 0.0

  @property
  def read_mb_s(self) -> float:
    """Read rate in MiB/s while reading (``nan`` without reads)."""
    return self.bytes_read / 2**20 / self.read_s if self.read_s else float("nan")

  @property
  def write_mb_s(self) -> float:
    """Write rate in MiB/s while writing and syncing (``nan`` without writes)."""
    t = self.write_s + self.sync_s
    return self.bytes_written / 2**20 / t if t else float("nan")

  def add(self, other: "StreamStats") -> None:
    """Adds another pass's figures to these, field by field.

    Args:
      other: the other pass's `StreamStats`.
    """
    for f in dataclasses.fields(self):
      setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

  def summary(self) -> str:
    """The statistics as one line for a log.

    Returns:
      Chunks, bytes and rates, sync, update, wait and wall times.
    """
    return (f"{self.chunks} chunks: read {self.bytes_read / 2**20:.1f} MiB at "
            f"{self.read_mb_s:.0f} MB/s, wrote {self.bytes_written / 2**20:.1f} MiB at "
            f"{self.write_mb_s:.0f} MB/s (sync {self.sync_s:.3f} s), update {self.update_s:.3f} s,"
            f" waited {self.wait_s:.3f} s, wall {self.wall_s:.3f} s")


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _drop_cache(fd: int, offset: int = 0, length: int = 0) -> None:
  if hasattr(os, "posix_fadvise"):
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _pread_into(fd: int, buf: np.ndarray, offset: int) -> None:
  view = memoryview(buf).cast("B")
  done = 0
  while done < len(view):
    n = os.preadv(fd, [view[done:]], offset + done)
    if n <= 0:
      raise NvmeStateError(f"short read at byte {offset + done} (the file ended early)")
    done += n


def _crc(buf: np.ndarray) -> int:
  """CRC-32 of an array's bytes (zlib releases the GIL for it)."""
  return zlib.crc32(memoryview(np.ascontiguousarray(buf)).cast("B"))


def _digests(bounds: Sequence[tuple[int, int]], per_file: Sequence[Sequence[int]]) -> dict:
  """The manifest's record of a generation's chunk checksums: the chunks' element bounds
  (which a later run may cut otherwise) and each file's CRC-32 per chunk."""
  return {"algorithm": _DIGEST, "bounds": [[int(a), int(b)] for a, b in bounds],
          "files": [[int(c) for c in crcs] for crcs in per_file]}


def _merge(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
  out: list[list[int]] = []
  for a, b in sorted(ranges):
    if out and a <= out[-1][1]:
      out[-1][1] = max(out[-1][1], b)
    else:
      out.append([a, b])
  return tuple((a, b) for a, b in out)


def _pwrite_from(fd: int, buf: np.ndarray, offset: int) -> None:
  view = memoryview(np.ascontiguousarray(buf)).cast("B")
  done = 0
  while done < len(view):
    done += os.pwrite(fd, view[done:], offset + done)


def _generation_bytes(leaves: Sequence[tuple[str, Any]], size: int) -> int:
  """Bytes of one generation of ``leaves`` (``(name, dtype)``), ``size`` elements each."""
  return sum(np.dtype(d).itemsize for _, d in leaves) * int(size)


class NvmeStore:
  """One process's optimizer-state files (see the module docstring).

  Args:
    directory: this process's directory (`process_dir`); created if missing.
    leaves: ``(name, dtype)`` of each per-element leaf, in the order the update uses them.
    size: elements per leaf (every local parameter shard, concatenated).
    layout: JSON-able description of what the vectors hold (leaf shapes, shard indices, the
      transformation's state structure); a store written for another layout is refused.
  """

  def __init__(self, directory: str, leaves: Sequence[tuple[str, Any]], size: int,
               layout: Any):
    self.directory = directory
    self.leaves = [(str(n), np.dtype(d)) for n, d in leaves]
    self.size = int(size)
    self.layout = json.loads(json.dumps(layout))
    os.makedirs(directory, exist_ok=True)
    self.manifest: dict | None = self._read_manifest()
    self._clean()

  @classmethod
  def open(cls, nvme_path: str, process_index: int, leaves: Sequence[tuple[str, Any]],
           size: int, layout: Any) -> "NvmeStore":
    """The store of one process of a run, after the start-up checks of ``nvme_path``
    (`check_nvme_path`), made before any file is: room for the state plus one generation,
    counting what this store already holds there.

    Args:
      nvme_path: the run's ``nvme_path``.
      process_index: the JAX process index (`process_dir`).
      leaves: as for `NvmeStore`.
      size: as for `NvmeStore`.
      layout: as for `NvmeStore`.

    Returns:
      The `NvmeStore`, its directory created and its committed generation (if any) read.

    Raises:
      NvmePathError: ``nvme_path`` is unusable (missing, not writable, too little room).
    """
    directory = process_dir(nvme_path, process_index)
    nbytes = _generation_bytes(leaves, size)
    in_use = sum(os.path.getsize(os.path.join(root, f))
                 for root, _, fs in os.walk(directory) for f in fs)
    check_nvme_path(nvme_path, 2 * nbytes + (1 << 20), in_use=in_use)
    return cls(directory, leaves, size, layout)

  # -- sizes ------------------------------------------------------------------------------------

  @property
  def nbytes(self) -> int:
    """Bytes of one generation."""
    return _generation_bytes(self.leaves, self.size)

  def bytes_on_disk(self) -> int:
    """Bytes the committed generation's files hold now."""
    if self.manifest is None:
      return 0
    d = self._gen_dir(self.manifest["generation"])
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))

  # -- the manifest -----------------------------------------------------------------------------

  @property
  def exists(self) -> bool:
    """Whether a committed generation is there."""
    return self.manifest is not None

  @property
  def step(self) -> int | None:
    """The step of the committed generation, or None without one."""
    return None if self.manifest is None else int(self.manifest["step"])

  def shared(self) -> list[np.ndarray]:
    """The committed shared (non-per-element) state leaves."""
    return [_decode(x) for x in self.manifest["shared"]]

  def _read_manifest(self) -> dict | None:
    path = os.path.join(self.directory, _CURRENT)
    if not os.path.exists(path):
      return None
    with open(path) as f:
      m = json.load(f)
    if m.get("format") != FORMAT:
      raise NvmeStateError(f"{path}: format {m.get('format')!r}, expected {FORMAT!r}")
    want = {"leaves": [[n, d.str] for n, d in self.leaves], "size": self.size,
            "layout": self.layout}
    for k, v in want.items():
      if m.get(k) != v:
        raise NvmeStateError(
            f"{self.directory} holds an optimizer state of another {k} than this run's (the "
            "model, optimizer, mesh or process count changed?); restore a checkpoint into a "
            "fresh nvme_path, or remove the directory to start the optimizer state afresh")
    return m

  def _gen_dir(self, g: int) -> str:
    return os.path.join(self.directory, f"gen-{g:08d}")

  def _clean(self) -> None:
    """Removes everything but the committed generation: a generation a killed step was
    writing, the one a step replaced, a manifest that was never renamed into place."""
    keep = None if self.manifest is None else f"gen-{self.manifest['generation']:08d}"
    for name in os.listdir(self.directory):
      if name in (_CURRENT, keep):
        continue
      path = os.path.join(self.directory, name)
      if os.path.isdir(path):
        shutil.rmtree(path)
      else:
        os.unlink(path)

  def _commit(self, generation: int, step: int, shared: Sequence[np.ndarray],
              extra: dict | None = None, digests: dict | None = None) -> None:
    if digests is None and self.manifest is not None and (
        self.manifest["generation"] == generation):  # the same files (a skipped step)
      digests = self.manifest.get("digests")
    m = {"format": FORMAT, "generation": generation, "step": int(step),
         "leaves": [[n, d.str] for n, d in self.leaves], "size": self.size,
         "layout": self.layout, "shared": [_encode(x) for x in shared],
         **({"digests": digests} if digests else {}), **(extra or {})}
    tmp = os.path.join(self.directory, _CURRENT + ".tmp")
    with open(tmp, "w") as f:
      json.dump(m, f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, os.path.join(self.directory, _CURRENT))  # the commit point
    _fsync_dir(self.directory)
    old, self.manifest = self.manifest, m
    if old is not None and old["generation"] != generation:
      shutil.rmtree(self._gen_dir(old["generation"]), ignore_errors=True)

  # -- writing a whole state --------------------------------------------------------------------

  def _open_new(self, g: int) -> tuple[str, list[int]]:
    d = self._gen_dir(g)
    if os.path.exists(d):
      shutil.rmtree(d)
    os.makedirs(d)
    fds = []
    for k, (_, dtype) in enumerate(self.leaves):
      fd = os.open(os.path.join(d, f"{k}.bin"), os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
      os.ftruncate(fd, self.size * dtype.itemsize)
      fds.append(fd)
    return d, fds

  def _finish_new(self, d: str, fds: list[int], stats: StreamStats | None = None) -> None:
    t = time.perf_counter()
    for fd in fds:
      os.fdatasync(fd)
      _drop_cache(fd)
      os.close(fd)
    _fsync_dir(d)
    if stats is not None:
      stats.sync_s += time.perf_counter() - t

  def write_initial(self, fill: Callable[[int, int], Sequence[np.ndarray]],
                    bounds: Sequence[tuple[int, int]], shared: Sequence[np.ndarray],
                    step: int = 0) -> None:
    """Writes and commits a whole new generation, chunk by chunk.

    Args:
      fill: ``fill(start, stop)`` returns each leaf's values in ``[start, stop)``.
      bounds: each chunk's ``(start, stop)``.
      shared: the shared (non-per-element) state leaves.
      step: the step the generation belongs to.

    Raises:
      NvmeDiskFullError: the disk filled up (the committed generation is intact).
    """
    g = 0 if self.manifest is None else self.manifest["generation"] + 1
    d, fds = self._open_new(g)
    crcs: list[list[int]] = [[] for _ in self.leaves]
    try:
      try:
        for start, stop in bounds:
          for fd, (_, dtype), v, c in zip(fds, self.leaves, fill(start, stop), crcs,
                                          strict=True):
            v = np.ascontiguousarray(np.asarray(v, dtype).reshape(-1))
            c.append(_crc(v))
            _pwrite_from(fd, v, start * dtype.itemsize)
      except BaseException:
        for fd in fds:
          os.close(fd)
        raise
      self._finish_new(d, fds)
      self._commit(g, step, shared, digests=_digests(bounds, crcs))
    except OSError as e:
      if e.errno in _FULL:
        raise self._disk_full(e, g) from None
      raise

  def read(self, k: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Leaf ``k``'s committed values.

    Args:
      k: the leaf's index in `leaves`.
      start: the first element.
      stop: the element after the last; None: the end.

    Returns:
      The values in ``[start, stop)``, a copy in memory.
    """
    stop = self.size if stop is None else stop
    dtype = self.leaves[k][1]
    out = np.empty(stop - start, dtype)
    path = os.path.join(self._gen_dir(self.manifest["generation"]), f"{k}.bin")
    fd = os.open(path, os.O_RDONLY)
    try:
      _pread_into(fd, out, start * dtype.itemsize)
    finally:
      os.close(fd)
    return out

  # -- the pipelined stream ---------------------------------------------------------------------

  def stream(self, update: Callable[[int, list[np.ndarray]], None], *,
             bounds: Sequence[tuple[int, int]], buffer_count: int, pipeline_read: bool,
             pipeline_write: bool, shared: Callable[[], Sequence[np.ndarray]],
             step: int) -> StreamStats:
    """One pass: every chunk (``bounds``: each chunk's ``(start, stop)``, covering the
    vectors in order) of the committed generation is read into a pooled buffer,
    ``update(i, arrays)`` changes chunk ``i`` in place, and it is written to the next
    generation, which is then committed with ``shared()`` and ``step``. If anything fails
    (or the process dies) before the commit, the committed generation is untouched.

    Args:
      update: ``update(i, arrays)`` changes chunk ``i``'s leaf arrays in place.
      bounds: each chunk's ``(start, stop)``, covering the vectors in order.
      buffer_count: chunk buffers in the pool.
      pipeline_read: read the next chunks while one updates.
      pipeline_write: write updated chunks in a background thread.
      shared: returns the new shared state leaves, called once all chunks are updated.
      step: the step of the new generation.

    Returns:
      The pass's `StreamStats`.

    Raises:
      NvmeStateError: there is no committed generation to update.
      NvmeDiskFullError: the disk filled up (the committed generation is intact).
    """
    if self.manifest is None:
      raise NvmeStateError(f"{self.directory}: no committed optimizer state to update")
    stats = StreamStats()
    t0 = time.perf_counter()
    old = self._gen_dir(self.manifest["generation"])
    g = self.manifest["generation"] + 1
    rfds = [os.open(os.path.join(old, f"{k}.bin"), os.O_RDONLY) for k in range(len(self.leaves))]
    new, wfds = self._open_new(g)
    pipeline = _ChunkPipeline(self.leaves, rfds, wfds, bounds, buffer_count, stats)
    try:
      try:
        pipeline.run(update, pipeline_read, pipeline_write)
      except BaseException:
        for fd in rfds + wfds:
          os.close(fd)
        raise
      for fd in rfds:
        os.close(fd)
      self._finish_new(new, wfds, stats)
      self._commit(g, step, shared(), digests=_digests(bounds, pipeline.digests))
    except OSError as e:
      if e.errno in _FULL:
        raise self._disk_full(e, g) from None
      raise
    stats.wall_s = time.perf_counter() - t0
    return stats

  def _disk_full(self, e: OSError, g: int) -> NvmeDiskFullError:
    """The error for a disk that filled up while generation ``g`` was written: ``g``'s files,
    never committed, are removed (their room given back), and the message says what is left."""
    try:
      with open(os.path.join(self.directory, _CURRENT)) as f:
        committed = json.load(f).get("generation")
    except (OSError, ValueError):
      committed = None
    if committed != g:  # (a commit that got through before the error keeps its files)
      shutil.rmtree(self._gen_dir(g), ignore_errors=True)
    free = shutil.disk_usage(self.directory).free
    m = self.manifest
    last = (f"the last complete generation, {m['generation']} (the optimizer state after step "
            f"{m['step']}), is intact in {self._gen_dir(m['generation'])!r}" if m is not None
            else "no generation was complete yet")
    return NvmeDiskFullError(
        f"host {socket.gethostname()!r}: the disk under nvme_path is full ({e.strerror}) "
        f"while writing generation {g} of the optimizer state to {self._gen_dir(g)!r}: "
        f"{self.nbytes:,} bytes are needed for it beside the committed one, {free:,} are free "
        f"(its partial files removed); {last}. Free space there, or point nvme_path at a larger "
        "disk, and run the same command again: it resumes from the newest checkpoint")

  # -- snapshots (checkpoints) ------------------------------------------------------------------

  def snapshot(self, dest: str) -> None:
    """Copies the committed generation into ``dest`` (created; must not exist), as hard links
    where ``dest`` is on the same file system: a committed generation's files are never
    written again, so a link is a copy.

    Args:
      dest: the snapshot's directory, which must not exist.

    Raises:
      NvmeStateError: there is no committed generation.
    """
    if self.manifest is None:
      raise NvmeStateError(f"{self.directory}: no committed optimizer state to snapshot")
    src = self._gen_dir(self.manifest["generation"])
    tmp = dest + ".tmp"
    if os.path.exists(tmp):
      shutil.rmtree(tmp)
    os.makedirs(tmp)
    for k in range(len(self.leaves)):
      _link_or_copy(os.path.join(src, f"{k}.bin"), os.path.join(tmp, f"{k}.bin"))
    with open(os.path.join(tmp, _MANIFEST), "w") as f:
      json.dump(self.manifest, f)
      f.flush()
      os.fsync(f.fileno())
    _fsync_dir(tmp)
    os.replace(tmp, dest)
    _fsync_dir(os.path.dirname(os.path.abspath(dest)))

  def verify_snapshot(self, src: str) -> dict:
    """Reads the snapshot in ``src`` back against its manifest: every file there, of the size
    written, and each chunk with the CRC-32 recorded when it was written (a manifest without
    chunk checksums: sizes only). It reads the whole state once.

    Args:
      src: the snapshot's directory (`snapshot`'s ``dest``).

    Returns:
      The snapshot's manifest.

    Raises:
      NvmeSnapshotDamagedError: a file is missing, truncated or corrupted, or the manifest
        is missing or unreadable; naming each damaged file and its damaged element ranges.
      NvmeStateError: the snapshot holds another run's state (leaves, size or layout).
    """
    path = os.path.join(src, _MANIFEST)
    everything = ((0, self.size),)
    try:
      with open(path) as f:
        m = json.load(f)
      if not isinstance(m, dict):
        raise ValueError(f"a JSON {type(m).__name__}, not an object")
    except (OSError, ValueError) as e:
      why = ("missing" + ("" if os.path.isdir(src) else " (so is the snapshot directory)")
             if isinstance(e, FileNotFoundError) else f"unreadable ({type(e).__name__}: {e})")
      raise NvmeSnapshotDamagedError(
          f"snapshot {src!r}: its manifest {_MANIFEST} is {why}; without it no file there can "
          "be used", directory=src,
          damaged=[DamagedFile(_MANIFEST, None, why, everything)]) from None
    for k in ("leaves", "size", "layout"):
      mine = {"leaves": [[n, d.str] for n, d in self.leaves], "size": self.size,
              "layout": self.layout}[k]
      if m.get(k) != mine:
        raise NvmeStateError(f"snapshot {src!r} holds an optimizer state of another {k} than "
                             "this run's")
    d = m.get("digests") or {}
    checked = d.get("algorithm") == _DIGEST and len(d.get("files", ())) == len(self.leaves)
    bounds = [tuple(b) for b in d["bounds"]] if checked else []
    damaged = [f for k in range(len(self.leaves))
               if (f := self._check_file(src, k, bounds, d["files"][k] if checked else None))]
    if damaged:
      what = "; ".join(f"{f.name} {f.reason}" for f in damaged)
      raise NvmeSnapshotDamagedError(f"snapshot {src!r} cannot be read back as written: {what}",
                                     directory=src, damaged=damaged)
    return m

  def _check_file(self, src: str, k: int, bounds: Sequence[tuple[int, int]],
                  crcs: Sequence[int] | None) -> DamagedFile | None:
    """Leaf ``k``'s file in snapshot ``src`` against its size and ``crcs`` (one per chunk of
    ``bounds``; ``None``: its size only)."""
    name, itemsize = f"{k}.bin", self.leaves[k][1].itemsize
    want = self.size * itemsize
    try:
      fd = os.open(os.path.join(src, name), os.O_RDONLY)
    except OSError as e:
      why = "missing" if e.errno == errno.ENOENT else f"cannot be opened ({e.strerror})"
      return DamagedFile(name, k, why, ((0, self.size),))
    try:
      have = os.fstat(fd).st_size
      bad: list[tuple[int, int]] = []
      reasons = []
      if have != want:
        reasons.append(f"has {have:,} bytes, {want:,} were written"
                       + (" (truncated)" if have < want else ""))
        if have < want:
          bad.append((have // itemsize, self.size))
      if crcs is not None:
        buf = np.empty(max((b - a for a, b in bounds), default=0) * itemsize, np.uint8)
        wrong = 0
        for (a, b), c in zip(bounds, crcs):
          if b * itemsize > have:  # lost past the end (counted above); the rest unverifiable
            continue
          view = buf[:(b - a) * itemsize]
          try:
            _pread_into(fd, view, a * itemsize)
          except (OSError, NvmeStateError) as e:  # an I/O error, or a file shrinking now
            bad.append((a, b))
            reasons.append(f"chunk at element {a:,} cannot be read ({e})")
            continue
          _drop_cache(fd, a * itemsize, (b - a) * itemsize)
          if _crc(view) != c:
            bad.append((a, b))
            wrong += 1
        if wrong:
          reasons.append(f"{wrong} of {len(bounds)} chunks read back with another CRC-32 than "
                         "was recorded when they were written (corrupted)")
      if not reasons:
        return None
      return DamagedFile(name, k, ", ".join(reasons), _merge(bad) or ((0, self.size),))
    finally:
      os.close(fd)

  def restore_snapshot(self, src: str, *, verify: bool = True) -> None:
    """Makes the snapshot in ``src`` the committed generation (linked or copied in).

    Args:
      src: the snapshot's directory.
      verify: read it back first (`verify_snapshot`); ``False`` where the caller just did.

    Raises:
      NvmeSnapshotDamagedError, NvmeStateError: as `verify_snapshot` (nothing changed).
    """
    if verify:
      m = self.verify_snapshot(src)
    else:
      with open(os.path.join(src, _MANIFEST)) as f:
        m = json.load(f)
    g = 0 if self.manifest is None else self.manifest["generation"] + 1
    d = self._gen_dir(g)
    if os.path.exists(d):
      shutil.rmtree(d)
    os.makedirs(d)
    for k in range(len(self.leaves)):
      _link_or_copy(os.path.join(src, f"{k}.bin"), os.path.join(d, f"{k}.bin"))
    _fsync_dir(d)
    self._commit(g, m["step"], [_decode(x) for x in m["shared"]], digests=m.get("digests"))


class _ChunkPipeline:
  """One `NvmeStore.stream` pass over open files: a pool of chunk buffers, a reader thread
  that fills them ahead, the caller's update, and a writer thread that empties them."""

  def __init__(self, leaves: Sequence[tuple[str, np.dtype]], rfds: list[int], wfds: list[int],
               bounds: Sequence[tuple[int, int]], buffer_count: int, stats: StreamStats):
    self.leaves, self.rfds, self.wfds, self.stats = leaves, rfds, wfds, stats
    self.starts = [a for a, _ in bounds]
    self.stops = [b for _, b in bounds]
    chunk = max(b - a for a, b in bounds)
    self.pool: queue.Queue = queue.Queue()
    for _ in range(max(1, min(buffer_count, len(self.starts)))):
      self.pool.put([np.empty(chunk, d) for _, d in leaves])
    self.ready: queue.Queue = queue.Queue()
    self.done: queue.Queue = queue.Queue()
    self.failed: list[BaseException] = []
    self.stop_flag = threading.Event()
    self.digests = [[0] * len(self.starts) for _ in leaves]  # CRC-32 per file and chunk

  def read_chunk(self, i: int) -> tuple[int, list[np.ndarray]]:
    """Chunk ``i`` of every leaf, read into a buffer from the pool."""
    bufs = self.pool.get()
    a, b = self.starts[i], self.stops[i]
    t = time.perf_counter()
    for fd, (_, dtype), buf in zip(self.rfds, self.leaves, bufs):
      _pread_into(fd, buf[:b - a], a * dtype.itemsize)
      _drop_cache(fd, a * dtype.itemsize, (b - a) * dtype.itemsize)
      self.stats.bytes_read += (b - a) * dtype.itemsize
    self.stats.read_s += time.perf_counter() - t
    return i, bufs

  def write_chunk(self, i: int, bufs: list[np.ndarray]) -> None:
    """Writes chunk ``i`` of every leaf and returns its buffers to the pool."""
    a, b = self.starts[i], self.stops[i]
    for k, buf in enumerate(bufs):  # before the timing: write_s is the disk's time
      self.digests[k][i] = _crc(buf[:b - a])
    t = time.perf_counter()
    for fd, (_, dtype), buf in zip(self.wfds, self.leaves, bufs):
      _pwrite_from(fd, buf[:b - a], a * dtype.itemsize)
      # Synced here, in the writer's time, not all at once before the commit: a sync of the
      # whole generation at the end overlaps with nothing. Dropping the written pages keeps the
      # page cache (which a memory cgroup charges to the process) at one chunk.
      os.fdatasync(fd)
      _drop_cache(fd, a * dtype.itemsize, (b - a) * dtype.itemsize)
      self.stats.bytes_written += (b - a) * dtype.itemsize
    self.stats.write_s += time.perf_counter() - t
    self.pool.put(bufs)

  def reader(self) -> None:
    """The reader thread: reads the chunks in order, ahead of the update."""
    try:
      for i in range(len(self.starts)):
        if self.stop_flag.is_set():
          return
        self.ready.put(self.read_chunk(i))
    except BaseException as e:  # noqa: BLE001 - handed to the calling thread
      self.failed.append(e)
      self.ready.put(None)

  def writer(self) -> None:
    """The writer thread: writes updated chunks until it is handed ``None``."""
    try:
      while True:
        item = self.done.get()
        if item is None:
          return
        self.write_chunk(*item)
    except BaseException as e:  # noqa: BLE001 - handed to the calling thread
      self.failed.append(e)
      self.stop_flag.set()
      while self.pool.empty():  # unblock a reader waiting for a buffer
        self.pool.put([np.empty(0, d) for _, d in self.leaves])

  def run(self, update: Callable[[int, list[np.ndarray]], None], pipeline_read: bool,
          pipeline_write: bool) -> None:
    """Reads, updates and writes every chunk; re-raises the first error of any thread."""
    threads = []
    if pipeline_read:
      threads.append(threading.Thread(target=self.reader, name="zerojax-nvme-read", daemon=True))
    if pipeline_write:
      threads.append(threading.Thread(target=self.writer, name="zerojax-nvme-write",
                                      daemon=True))
    for t in threads:
      t.start()
    try:
      self._update_all(update, pipeline_read, pipeline_write)
    except BaseException:
      self.stop_flag.set()
      self.done.put(None)
      raise
    self.done.put(None)
    for t in threads:
      t.join()
    if self.failed:
      raise self.failed[0]

  def _update_all(self, update: Callable[[int, list[np.ndarray]], None], pipeline_read: bool,
                  pipeline_write: bool) -> None:
    """The calling thread's loop: each chunk as it is read, updated, then handed on."""
    stats = self.stats
    for i in range(len(self.starts)):
      t, r = time.perf_counter(), stats.read_s
      item = self.ready.get() if pipeline_read else self.read_chunk(i)
      if item is None or self.failed:
        raise self.failed[0]
      # Waiting: for the reader's chunk, or (reading inline) for a buffer the writer holds.
      stats.wait_s += time.perf_counter() - t - (0.0 if pipeline_read else stats.read_s - r)
      _, bufs = item
      a, b = self.starts[i], self.stops[i]
      t = time.perf_counter()
      update(i, [buf[:b - a] for buf in bufs])
      stats.update_s += time.perf_counter() - t
      stats.chunks += 1
      if pipeline_write:
        self.done.put((i, bufs))
      else:
        self.write_chunk(i, bufs)
      if self.failed:
        raise self.failed[0]


def _link_or_copy(src: str, dst: str) -> None:
  try:
    os.link(src, dst)
  except OSError:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
      os.fsync(f.fileno())


def _encode(x: Any) -> dict:
  a = np.asarray(x)
  return {"dtype": a.dtype.str, "shape": list(a.shape), "hex": a.tobytes().hex()}


def _decode(d: dict) -> np.ndarray:
  return np.frombuffer(bytes.fromhex(d["hex"]), np.dtype(d["dtype"])).reshape(d["shape"]).copy()
