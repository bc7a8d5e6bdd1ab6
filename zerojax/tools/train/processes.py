"""The processes of one training run: what they must share, compared before step 1, and the
claim a run lays on its ``out_dir`` so that two runs that did not join one process group
never write one directory.

What is compared is derived from the classes that hold it, never listed by hand: every field
of the resolved `ZeroConfig` (`zerojax.core.agreement.fingerprint`), every field of
`TrainOptions` (``train.FIELD``; the seed among them), the data files' sizes and digests
(``data.ROLE.bytes``, ``data.ROLE.digest``), and what a `Task` adds (``Task.agreement``:
``zerojax finetune``'s options and the model's config.json). A field added to any of those
classes is compared without a change here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import sys
import time
from typing import Any, Iterator

import jax

from zerojax.core import agreement, distributed
from zerojax.core.config import ConfigError
from zerojax.tools.options import DEFAULT_CORPUS, OUTPUT_PACKAGES

try:
  import fcntl
except ImportError:  # pragma: no cover - not POSIX: no claim (the run goes on unguarded)
  fcntl = None

__all__ = ["OutDirInUseError", "LOCK_NAME", "file_fields", "json_fields", "settings_fields",
           "check_processes_agree", "claim_out_dir"]

LOCK_NAME = ".zerojax-run.lock"
_DIGEST_BYTES = 1 << 20  # digest of the first and last MiB: a changed file is caught cheaply


class OutDirInUseError(ConfigError):
  """Another run (not of this process group) writes the same ``out_dir``. Raised on every
  process of this run."""

  on_every_process = True


def file_fields(role: str, path: str | None) -> dict[str, Any]:
  """``{'data.ROLE.bytes': size, 'data.ROLE.digest': sha256 of its first and last MiB}`` of
  a data file (``'<missing>'`` where it is not a readable file).

  Args:
    role: what the file is to the run (``corpus``, ``eval_data``).
    path: the file.

  Returns:
    the two fields.
  """
  key = f"data.{role}"
  if path is None:
    return {f"{key}.bytes": None, f"{key}.digest": None}
  try:
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
      h.update(f.read(_DIGEST_BYTES))
      if size > _DIGEST_BYTES:
        f.seek(max(_DIGEST_BYTES, size - _DIGEST_BYTES))
        h.update(f.read(_DIGEST_BYTES))
  except OSError:
    return {f"{key}.bytes": "<missing>", f"{key}.digest": "<missing>"}
  return {f"{key}.bytes": size, f"{key}.digest": h.hexdigest()[:16]}


def json_fields(prefix: str, path: str) -> dict[str, Any]:
  """``{'PREFIX.KEY': value}`` for every top-level key of a JSON file (``{PREFIX: '<missing>'}``
  where it cannot be read).

  Args:
    prefix: the fields' prefix, e.g. ``model.config.json``.
    path: the JSON file.

  Returns:
    one field per key.
  """
  try:
    with open(path) as f:
      d = json.load(f)
  except (OSError, ValueError):
    return {prefix: "<missing>"}
  if not isinstance(d, dict):
    return {prefix: d}
  return {f"{prefix}.{k}": v for k, v in d.items()}


def settings_fields(opts: Any, task_fields: dict[str, Any] | None = None) -> dict[str, Any]:
  """What the processes of a run must share beyond the `ZeroConfig`: every field of ``opts``
  (``train.FIELD``) but process 0's outputs (`OUTPUT_PACKAGES`), the corpus file's size and
  digest, and ``task_fields``.

  Args:
    opts: the run's `TrainOptions` (any dataclass).
    task_fields: the task's own (`Task.agreement`).

  Returns:
    ``{field: value}``.
  """
  # Process 0 alone draws the bar, the plot and the event files; another may lack their packages.
  fields = {f"train.{f.name}": getattr(opts, f.name) for f in dataclasses.fields(opts)
            if f.name not in OUTPUT_PACKAGES}
  corpus = getattr(opts, "corpus", None) or os.fspath(DEFAULT_CORPUS)
  fields.update(file_fields("corpus", corpus))
  fields.update(task_fields or {})
  return fields


def check_processes_agree(config: Any, opts: Any, task_fields: dict[str, Any] | None = None
                          ) -> None:
  """Compares the resolved config, the options, the data files and ``task_fields`` across the
  processes of a multi-process run (nothing to do alone); call it before anything else of the
  run (mesh, files, step).

  Args:
    config: the resolved `ZeroConfig`.
    opts: the `TrainOptions`.
    task_fields: the task's own fields (`Task.agreement`).

  Raises:
    ProcessMismatchError: on every process, naming each differing field and its values.
  """
  if jax.process_count() == 1:
    return
  agreement.check_agreement(config, fields=settings_fields(opts, task_fields))


@contextlib.contextmanager
def claim_out_dir(out_dir: str) -> Iterator[None]:
  """Holds ``out_dir`` for this run while the block runs: process 0 takes an exclusive lock on
  ``out_dir/.zerojax-run.lock`` (released by the kernel when the process ends, however it
  ends) and writes who holds it there; every process learns the outcome.

  Args:
    out_dir: the run's output directory.

  Raises:
    OutDirInUseError: on every process of this run, when another run (another process group,
      or a process started alone) holds ``out_dir``; it names that run's pid and host.
  """
  held, error = None, ""
  if jax.process_index() == 0:
    try:
      held = _lock(out_dir)
    except OutDirInUseError as e:
      error = str(e)
  first = agreement.exchange("out_dir-claim", error)[0]
  if first:
    _release(held)
    raise OutDirInUseError(first)
  try:
    yield
  finally:
    _release(held)


def _lock(out_dir: str) -> tuple[int, str, bool] | None:
  """``(descriptor, out_dir, whether this call created out_dir)``, or None (no lock here)."""
  if fcntl is None:
    return None
  path = os.path.join(out_dir, LOCK_NAME)
  created = not os.path.isdir(out_dir)
  try:
    os.makedirs(out_dir, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError:
    return None  # an unwritable out_dir: the run's own writes name it
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    holder = _holder(fd)
    os.close(fd)
    raise OutDirInUseError(
        f"out_dir {out_dir!r} is in use by another run: {holder} holds {path}. Two runs "
        "that did not join one process group must not write one out_dir: start every process "
        "through one launcher (zerojax launch -n N, srun, torchrun) so that they join one run, "
        "let the other run end, or choose another out_dir") from None
  info = distributed.info()
  owner = {"pid": os.getpid(), "host": socket.gethostname(),
           "processes": info.num_processes, "coordinator": info.coordinator_address,
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}
  os.ftruncate(fd, 0)
  os.pwrite(fd, json.dumps(owner).encode(), 0)
  return fd, out_dir, created


def _holder(fd: int) -> str:
  """Who holds the lock, as its file says."""
  try:
    d = json.loads(os.pread(fd, 1 << 16, 0).decode() or "{}")
    run = (f"process 0 of a {d['processes']}-process run with coordinator {d['coordinator']}"
           if d.get("processes", 1) > 1 else "a 1-process run")
    return f"pid {d['pid']} on host {d['host']} ({run}, started {d.get('started', '?')})"
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return "another process"


def _release(held: tuple[int, str, bool] | None) -> None:
  if held is None:
    return
  fd, out_dir, created = held
  # A run refused before it wrote anything leaves no out_dir behind (it made it for the lock).
  try:
    if created and os.listdir(out_dir) == [LOCK_NAME]:
      os.remove(os.path.join(out_dir, LOCK_NAME))
      os.rmdir(out_dir)
  except OSError:
    pass
  os.close(fd)  # closing the only descriptor releases the lock
