"""Errors the user can fix end a command with one line on stderr and exit status 2; a
traceback only with ``--debug`` (issue 52, item 5): a missing or read-only ``nvme_path``, the
NVMe disk filling up mid-run (the path, the bytes needed and the last complete generation
named; the rerun after space is freed is bit-identical), a damaged checkpoint with nothing to
fall back to."""

import contextlib
import errno
import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from tests import helpers
from zerojax.runtime import nvme_store
from zerojax.tools import cli
from zerojax.tools import train as zt
from tests.runtime.test_nvme import _add_one, _store

TINY = ["model=tiny", "seq_len=16", "batch=8", "lr=3e-3", "show_plan=false", "plot=false",
        "tensorboard=false", "cpu_devices=8", "--no-progress"]


def _zerojax(*args, timeout=300, **popen):
  return subprocess.run([sys.executable, "-m", "zerojax", *args], env=helpers.child_env(8),
                        cwd=helpers.ROOT, capture_output=True, text=True, timeout=timeout,
                        **popen)


def _one_line_error(p, command="train"):
  """The command failed with exit 2 and exactly one line of error on stderr; returns it."""
  assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
  assert "Traceback" not in p.stderr, p.stderr[-3000:]
  lines = [x for x in p.stderr.splitlines() if x.startswith(f"zerojax {command}: error: ")]
  assert len(lines) == 1, p.stderr[-3000:]
  return lines[0]


# -- the command line: --debug, and which errors are the user's ---------------------------------


def test_debug_is_taken_anywhere_before_a_double_dash_and_by_every_command(monkeypatch):
  monkeypatch.setenv(cli.DEBUG_ENV, "0")  # (restored at the end: --debug sets it)
  assert cli._debug_flag(["train", "--", "--debug"]) == (["train", "--", "--debug"], False)
  argv, debug = cli._debug_flag(["train", "steps=2", "--debug", "--", "--debug"])
  assert debug and argv == ["train", "steps=2", "--", "--debug"]
  parser = cli.build_parser()
  for name, sp in parser._subparsers._group_actions[0].choices.items():
    if name not in ("export", "launch"):
      assert "--debug" in sp.format_help(), name
  assert "--debug" in parser.format_help()


def test_user_errors_are_one_line_and_a_traceback_with_debug(monkeypatch, capsys):
  from zerojax.runtime.checkpoint import CheckpointDamagedError
  monkeypatch.setenv(cli.DEBUG_ENV, "0")  # (restored at the end: --debug sets it)
  errors = [nvme_store.NvmePathError("nvme_path '/x' is not writable\n(read-only)"),
            CheckpointDamagedError("checkpoint '/c/6' cannot be read back", directory="/c",
                                   step=6),
            OSError(errno.ENOSPC, "No space left on device", "/out/metrics.jsonl")]
  for e in errors:
    def boom(args, e=e):
      raise e
    monkeypatch.setattr(cli, "cmd_config", boom)
    assert cli.main(["config", "x.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerojax config: error: "), err
    assert str(e).splitlines()[0] in err or e.strerror in err, err
    with pytest.raises(type(e)):
      cli.main(["config", "x.json", "--debug"])
    assert os.environ[cli.DEBUG_ENV] == "1"  # for the processes a command starts
    monkeypatch.setenv(cli.DEBUG_ENV, "0")
  # zerojax's own bug (any other exception) keeps its traceback
  monkeypatch.setattr(cli, "cmd_config", lambda args: [][1])
  with pytest.raises(IndexError):
    cli.main(["config", "x.json"])


@pytest.mark.slow
def test_missing_nvme_path_is_one_line_exit_2_and_a_traceback_with_debug(tmp_path):
  args = ["train", *TINY, "steps=2", "offload_optimizer=nvme", f"out_dir={tmp_path / 'o'}",
          f"nvme_path={tmp_path / 'absent'}"]
  line = _one_line_error(_zerojax(*args))
  assert f"nvme_path '{tmp_path / 'absent'}' does not exist" in line and "bytes needed" in line
  p = _zerojax(*args, "--debug")
  assert p.returncode == 1 and "Traceback" in p.stderr and "NvmePathError" in p.stderr


def test_read_only_nvme_path_is_one_line_exit_2(tmp_path):
  """A read-only disk (a tmpfs mounted read-only: root ignores a directory's mode bits)."""
  ro = str(tmp_path / "ro")
  os.makedirs(ro)
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs",
                                          ro], capture_output=True).returncode:
    pytest.skip("mounting a read-only tmpfs needs root")
  try:
    line = _one_line_error(_zerojax("train", *TINY, "steps=2", "offload_optimizer=nvme",
                                    f"out_dir={tmp_path / 'o'}", f"nvme_path={ro}"))
  finally:
    subprocess.run(["umount", "-l", ro], capture_output=True)
  assert f"nvme_path '{ro}' is not writable (Read-only file system" in line, line


# -- the NVMe disk fills up mid-run ---------------------------------------------------------




@pytest.mark.parametrize("pipelined", [True, False])
def test_nvme_disk_full_names_path_bytes_and_generation_and_the_state_survives(
    tmp_path, monkeypatch, pipelined):
  s, bounds = _store(tmp_path)
  kw = dict(bounds=bounds, buffer_count=2, pipeline_read=pipelined, pipeline_write=pipelined)
  s.stream(_add_one, shared=lambda: [np.int32(1)], step=1, **kw)  # generation 1, step 1
  before = [s.read(k).copy() for k in range(2)]
  real, calls = nvme_store._pwrite_from, []

  def full(fd, buf, off):  # the disk fills up at the 5th chunk write of the next step
    calls.append(off)
    if len(calls) >= 5:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real(fd, buf, off)

  monkeypatch.setattr(nvme_store, "_pwrite_from", full)
  with pytest.raises(nvme_store.NvmeDiskFullError) as e:
    s.stream(_add_one, shared=lambda: [np.int32(2)], step=2, **kw)
  msg = str(e.value)
  assert isinstance(e.value, nvme_store.NvmePathError)  # the CLI's one-line kind
  assert os.path.join(s.directory, "gen-00000002") in msg, msg  # the path it was writing
  assert f"{s.nbytes:,} bytes are needed" in msg, msg
  assert "free" in msg and "No space left on device" in msg, msg
  assert ("last complete generation, 1 (the optimizer state after step 1), is intact in "
          f"'{os.path.join(s.directory, 'gen-00000001')}'") in msg, msg
  # the partial generation is gone at once (its room back); the committed one is untouched
  assert sorted(os.listdir(s.directory)) == ["CURRENT", "gen-00000001"]
  assert s.step == 1
  monkeypatch.setattr(nvme_store, "_pwrite_from", real)
  s2 = nvme_store.NvmeStore(s.directory, s.leaves, s.size, {"test": 1})
  for k in range(2):
    assert s2.read(k).tobytes() == before[k].tobytes()
  # with room again, the same step gives the same bytes as a store that never filled up
  s2.stream(_add_one, shared=lambda: [np.int32(2)], step=2, **kw)
  ref, _ = _store(tmp_path / "ref")
  for step in (1, 2):
    ref.stream(_add_one, shared=lambda: [np.int32(step)], step=step, **kw)
  for k in range(2):
    assert s2.read(k).tobytes() == ref.read(k).tobytes()


@contextlib.contextmanager
def _small_disk(path, size):
  """A ``size``-byte tmpfs at ``path`` (root only; skips where mounting is not allowed)."""
  os.makedirs(path)
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                                          "tmpfs", path], capture_output=True).returncode:
    pytest.skip("mounting a small tmpfs needs root")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", path], capture_output=True)


def _fill(path, leave, stop):
  """Keeps ``path``'s disk at ``leave`` free bytes or less until ``stop`` is set."""
  filler = os.path.join(path, f"filler-{uuid.uuid4().hex}")
  with open(filler, "ab") as f:
    while not stop.is_set():
      free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
      if free > leave:
        try:
          f.write(b"\0" * (free - leave))
          f.flush()
        except OSError:
          pass
      time.sleep(0.01)
  return filler


@pytest.mark.slow
def test_nvme_disk_filling_up_mid_run_is_one_line_and_the_rerun_is_bit_identical(tmp_path):
  """A real disk: zerojax train with its optimizer state on an 8 MB tmpfs, which a filler
  keeps at a quarter of a generation free from step 2 on. The run ends with one line, exit 2,
  naming the path, the bytes and the last complete generation; with the filler gone, the same
  command resumes and ends with the losses and parameters of a run that never ran short."""
  common = [*TINY, "steps=8", "log_every=1", "checkpoint_every=2", "offload_optimizer=nvme",
            "save_weights=true"]
  os.makedirs(tmp_path / "nv_ref")
  ref = _zerojax("train", *common, f"out_dir={tmp_path / 'ref'}",
                 f"checkpoint_dir={tmp_path / 'ref' / 'ckpt'}", f"nvme_path={tmp_path / 'nv_ref'}")
  assert ref.returncode == 0, ref.stderr[-3000:]
  with _small_disk(str(tmp_path / "nv"), 8 << 20) as nv:
    args = ["train", *common, f"out_dir={tmp_path / 'run'}",
            f"checkpoint_dir={tmp_path / 'run' / 'ckpt'}", f"nvme_path={nv}"]
    p = subprocess.Popen([sys.executable, "-m", "zerojax", *args], env=helpers.child_env(8),
                         cwd=helpers.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    out = []
    for line in p.stdout:
      out.append(line)
      if line.startswith("step 2/"):
        break
    gen = 133_760 * 4 * 2  # tiny's parameters x Adam's mu and nu in float32
    stop = threading.Event()
    filled = []
    t = threading.Thread(target=lambda: filled.append(_fill(nv, gen // 4, stop)))
    t.start()
    try:
      rest, err = p.communicate(timeout=300)
    finally:
      stop.set()
      t.join()
    p.returncode, p.stderr = p.wait(), err
    line = _one_line_error(p)
    assert "the disk under nvme_path is full (No space left on device)" in line, line
    assert os.path.join(nv, "zerojax-nvme", "process-0", "gen-") in line, line
    assert f"{gen:,} bytes are needed" in line, line
    assert "last complete generation" in line and "is intact" in line, line
    os.remove(filled[0])
    again = _zerojax(*args)
    assert again.returncode == 0, again.stderr[-3000:]
  losses = [r["loss"] for r in zt.read_jsonl(tmp_path / "run" / "metrics.jsonl")]
  assert losses == [r["loss"] for r in zt.read_jsonl(tmp_path / "ref" / "metrics.jsonl")]
  a, b = np.load(tmp_path / "ref" / "weights.npz"), np.load(tmp_path / "run" / "weights.npz")
  assert sorted(a.files) == sorted(b.files)
  for k in a.files:
    assert a[k].tobytes() == b[k].tobytes(), k
