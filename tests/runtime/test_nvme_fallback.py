"""A resumed NVMe run (offload_optimizer='nvme') whose newest checkpoint's optimizer-state
snapshot (``<checkpoint_dir>/nvme-<step>``) cannot be read back as written (a file truncated,
corrupted or missing) falls back to the newest complete step before it: a warning names the
damaged file and the optimizer-state leaves it holds, both the orbax step and its snapshot are
moved aside, and the run goes on bit for bit as an undamaged run resumed from that step (issue
52, item 6). Without a complete step before it: one line and exit 2."""

from __future__ import annotations

import zerojax
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests import helpers
from zerojax.core.config import ZeroConfig
from zerojax.core.plan import path_str
from zerojax.runtime import nvme_store
from zerojax.tools import train as zt
from tests.runtime.test_nvme import _add_one, _store

KW = dict(model="tiny", seq_len=16, batch=8, steps=6, log_every=1, checkpoint_every=2,
          progress=False, show_plan=False, plot=False, tensorboard=False)


def _config(root) -> ZeroConfig:
  path = root / "nvme"
  os.makedirs(path, exist_ok=True)  # nvme_path must exist (checked before step 1)
  return ZeroConfig(stage=2,
                    offload=zerojax.NvmeOffload(str(path), chunk_size=20000, buffer_count=3))


def _opts(root, **kw) -> zt.TrainOptions:
  return zt.TrainOptions(out_dir=str(root / "run"), checkpoint_dir=str(root / "run" / "ckpt"),
                         **{**KW, **kw})


def _finished(root):
  """A finished NVMe run in ``root`` (checkpoints 2, 4, 6 with their snapshots)."""
  r = zt.train(_config(root), _opts(root))
  assert sorted(os.listdir(root / "run" / "ckpt")) == ["2", "4", "6", "nvme-2", "nvme-4",
                                                       "nvme-6"]
  return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A finished run whose step 6 (and its snapshot) was removed, then resumed to the end:
  what a run that falls back to step 4 must reproduce."""
  root = tmp_path_factory.mktemp("nvme_fallback")
  _finished(root)
  for name in ("6", "nvme-6"):
    shutil.rmtree(root / "run" / "ckpt" / name)
  from4 = zt.train(_config(root), _opts(root))
  lines = zt.read_jsonl(root / "run" / "metrics.jsonl")
  assert json.load(open(root / "run" / "run.json"))["resumed_from"] == [4]
  return {"from4": from4, "lines": lines}


def _snapshot(root, step):
  return root / "run" / "ckpt" / f"nvme-{step}" / "process-0"


def _truncate(f):
  os.truncate(f, os.path.getsize(f) // 2)


def _corrupt(f):
  with open(f, "r+b") as fh:
    fh.seek(os.path.getsize(f) // 2)
    chunk = bytearray(fh.read(256))
    fh.seek(os.path.getsize(f) // 2)
    fh.write(bytes(b ^ 0x5A for b in chunk))


def _remove(f):
  os.remove(f)


DAMAGE = {"truncated": _truncate, "corrupted": _corrupt, "missing": _remove}


def _layout(snapshot, state):
  """From the snapshot's own manifest, apart from the code under test: ``({parameter path:
  [(start, stop) element ranges of its shards]}, [(start, stop) of each checksummed chunk],
  elements per file, bytes per element of file 0)``."""
  m = json.load(open(snapshot / "manifest.json"))
  names = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]
  spans, pos = {}, 0
  for leaf, index in m["layout"]["segments"]:
    n = int(np.prod([b - a for a, b in index], dtype=np.int64))
    spans.setdefault(names[leaf], []).append((pos, pos + n))
    pos += n
  assert pos == m["size"] and m["digests"]["algorithm"] == "crc32"
  return spans, [tuple(b) for b in m["digests"]["bounds"]], pos, np.dtype(m["leaves"][0][1]).itemsize


def _lost(damage, size, chunks, n, itemsize):
  """The element range the damage makes unusable: past the cut; the checksummed chunk that
  holds the flipped bytes; the whole file."""
  if damage == "truncated":
    return (size // 2 // itemsize, n)
  if damage == "corrupted":
    hit = [(a, b) for a, b in chunks if a * itemsize <= size // 2 < b * itemsize]
    assert len(hit) == 1 and (size // 2 + 256) <= hit[0][1] * itemsize
    return hit[0]
  return (0, n)


# -- the store: checksums recorded as written, verified on restore --------------------------------




@pytest.mark.parametrize("read, write", [(True, True), (False, False)])
def test_store_records_a_crc_of_every_chunk_as_written(tmp_path, read, write):
  """Each generation's manifest holds the CRC-32 of each file's chunks, computed from the
  bytes as they were written (initially and by each streamed step, pipelined or not); a
  skipped step (the same files) keeps them; a snapshot carries them."""
  import zlib
  s, bounds = _store(tmp_path)
  s.stream(_add_one, bounds=bounds, buffer_count=3, pipeline_read=read, pipeline_write=write,
           shared=lambda: [np.int32(1)], step=1)
  d = s.manifest["digests"]
  assert d["algorithm"] == "crc32" and d["bounds"] == [list(b) for b in bounds]
  for k in range(2):
    raw = open(os.path.join(s.directory, f"gen-{s.manifest['generation']:08d}", f"{k}.bin"),
               "rb").read()
    assert d["files"][k] == [zlib.crc32(raw[a * 4:b * 4]) for a, b in bounds]
  s._commit(s.manifest["generation"], 2, s.shared())  # a skipped step: the same files
  assert s.manifest["digests"] == d
  s.snapshot(str(tmp_path / "snap"))
  assert s.verify_snapshot(str(tmp_path / "snap"))["digests"] == d


def test_store_verify_snapshot_names_each_damaged_file_and_its_elements(tmp_path):
  s, bounds = _store(tmp_path)
  snap = tmp_path / "snap"
  s.snapshot(str(snap))
  for f in ("0.bin", "1.bin"):  # a snapshot is hard links of the committed generation: copy
    data = (snap / f).read_bytes()  # it, so that damaging it leaves the store's files whole
    os.remove(snap / f)
    (snap / f).write_bytes(data)
  _corrupt(snap / "0.bin")  # bytes 2000-2255: elements 500-563, chunk (500, 600)
  os.truncate(snap / "1.bin", 1000)  # elements 250 on lost
  with pytest.raises(nvme_store.NvmeSnapshotDamagedError,
                     match=r"0\.bin 1 of 10 chunks read back with another CRC-32.*1\.bin has "
                           r"1,000 bytes, 4,000 were written \(truncated\)") as e:
    s.verify_snapshot(str(snap))
  assert e.value.damaged == (
      nvme_store.DamagedFile("0.bin", 0, e.value.damaged[0].reason, ((500, 600),)),
      nvme_store.DamagedFile("1.bin", 1, e.value.damaged[1].reason, ((250, 1000),)))
  committed = s.manifest
  with pytest.raises(nvme_store.NvmeSnapshotDamagedError):
    s.restore_snapshot(str(snap))
  assert s.manifest == committed  # nothing changed
  os.remove(snap / "1.bin")
  with pytest.raises(nvme_store.NvmeSnapshotDamagedError, match=r"1\.bin missing") as e:
    s.verify_snapshot(str(snap))
  assert e.value.damaged[1] == nvme_store.DamagedFile("1.bin", 1, "missing", ((0, 1000),))
  os.remove(snap / "manifest.json")
  with pytest.raises(nvme_store.NvmeSnapshotDamagedError, match="manifest.json is missing") as e:
    s.verify_snapshot(str(snap))
  assert e.value.damaged == (
      nvme_store.DamagedFile("manifest.json", None, "missing", ((0, 1000),)),)
  shutil.rmtree(snap)
  with pytest.raises(nvme_store.NvmeSnapshotDamagedError, match="so is the snapshot directory"):
    s.verify_snapshot(str(snap))


def test_store_snapshot_without_checksums_is_checked_by_size(tmp_path):
  """A snapshot written before chunk checksums were recorded still restores, its files'
  sizes checked."""
  s, bounds = _store(tmp_path)
  snap = tmp_path / "snap"
  s.snapshot(str(snap))
  m = json.loads((snap / "manifest.json").read_text())
  del m["digests"]
  (snap / "manifest.json").write_text(json.dumps(m))
  assert "digests" not in s.verify_snapshot(str(snap))
  s.stream(_add_one, bounds=bounds, buffer_count=3, pipeline_read=True, pipeline_write=True,
           shared=lambda: [np.int32(1)], step=1)
  s.restore_snapshot(str(snap))
  assert s.step == 0 and "digests" not in s.manifest
  np.testing.assert_array_equal(s.read(0), np.arange(1000, dtype=np.float32))
  data = (snap / "1.bin").read_bytes()
  os.remove(snap / "1.bin")
  (snap / "1.bin").write_bytes(data[:-4])
  with pytest.raises(nvme_store.NvmeSnapshotDamagedError, match=r"1\.bin has 3,996 bytes"):
    s.verify_snapshot(str(snap))


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_falls_back_past_a_damaged_nvme_snapshot(runs, tmp_path, damage):
  first = _finished(tmp_path)
  snap = _snapshot(tmp_path, 6)
  victim = snap / "0.bin"  # AdamW's mu over every local shard
  size = os.path.getsize(victim)
  spans, chunks, n, itemsize = _layout(snap, first.state)
  lo, hi = _lost(damage, size, chunks, n, itemsize)
  hit = {p for p, ss in spans.items() if any(a < hi and lo < b for a, b in ss)}
  assert 0 < len(hit) and (damage == "missing") == (len(hit) == len(spans))
  DAMAGE[damage](victim)
  with pytest.warns(UserWarning) as caught:
    r = zt.train(_config(tmp_path), _opts(tmp_path))
  msg = " ".join(str(w.message) for w in caught if "step 6" in str(w.message))
  # the warning names the damaged file, the optimizer-state leaves whose values it lost (mu
  # of each parameter with values there), where the step went and what was restored
  assert "'nvme-6/process-0/0.bin'" in msg, msg
  assert re.search(rf"\b{len(hit)} damaged leaves: ", msg), (msg, hit)
  named = re.findall(r"'(opt_state/[^']*)'", msg)
  assert named and all(re.fullmatch(r"opt_state/0/mu/.+", x) for x in named), msg
  assert {x.removeprefix("opt_state/0/mu/") for x in named} <= hit, (msg, hit)
  ckdir = tmp_path / "run" / "ckpt"
  aside = sorted(n for n in os.listdir(ckdir) if "." in n)
  assert aside == ["6.damaged", "nvme-6.damaged"], os.listdir(ckdir)
  assert "6.damaged'" in msg and "restored step 4" in msg, msg
  # the damaged files are kept as they were, for a look
  assert os.path.exists(ckdir / "nvme-6.damaged" / "process-0" / "0.bin") == (
      damage != "missing")
  # the run went on from step 4: the same losses, metrics and weights as an undamaged run
  # resumed from step 4, bit for bit
  lines = zt.read_jsonl(tmp_path / "run" / "metrics.jsonl")
  assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
  for k in ("loss", "grad_norm", "lr"):
    assert [x[k] for x in lines] == [x[k] for x in runs["lines"]], k
  assert [h["loss"] for h in r.history] == [h["loss"] for h in runs["from4"].history]
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               r.state.params, runs["from4"].state.params)
  assert json.load(open(tmp_path / "run" / "run.json"))["resumed_from"] == [4]
  # step 6 was saved again, with its snapshot, beside the damaged pair
  assert sorted(os.listdir(ckdir)) == ["2", "4", "6", "6.damaged", "nvme-2", "nvme-4",
                                       "nvme-6", "nvme-6.damaged"]



@pytest.mark.slow
def test_restore_checkpoint_latest_falls_back_and_a_writer_moves_both_aside(tmp_path):
  """`NvmeOptimizer.restore_checkpoint` with ``step=None`` (the library's way): the newest
  step whose orbax data and snapshot both read back, with a warning; a read-only
  checkpointer leaves the damaged step in place, a writing one moves it and its snapshot
  aside. A step asked for is not replaced by another."""
  from zerojax import make_mesh
  from zerojax.runtime.checkpoint import CheckpointDamagedError, Checkpointer
  from zerojax.tools.train import loop, schedules
  _finished(tmp_path)
  _corrupt(_snapshot(tmp_path, 6) / "1.bin")
  config, opts = _config(tmp_path), _opts(tmp_path)
  task = loop._gpt_task(opts, config)
  tx, _ = schedules.make_optimizer(opts, [(0, opts.steps)])
  state, plan, _, _ = task.setup(config, make_mesh(config), tx, jax.random.key(opts.seed), None)
  opt, ckdir = plan.nvme, str(tmp_path / "run" / "ckpt")
  with Checkpointer(ckdir, read_only=True) as ck:
    # The snapshot alone (an NNX run restores its train state itself): checked, then committed.
    opt.restore_snapshot(ck, 4)
    assert opt.store.step == 4
    np.testing.assert_array_equal(opt.store.read(1), np.fromfile(
        _snapshot(tmp_path, 4) / "1.bin", opt.store.leaves[1][1]))
    with pytest.raises(CheckpointDamagedError, match=r"nvme-6/process-0/1\.bin") as e:
      opt.restore_snapshot(ck, 6)
    assert e.value.beside == ("nvme-6",) and opt.store.step == 4  # nothing committed
    with pytest.raises(CheckpointDamagedError, match=r"nvme-6/process-0/1\.bin 1 of \d+ "
                                                     r"chunks read back with another CRC-32"):
      opt.restore_checkpoint(ck, state, step=6)
    with pytest.warns(UserWarning, match=r"step 6 .*'opt_state/0/nu/.*in 'nvme-6/process-0/"
                                         r"1\.bin'\); left it in place.*restored step 4") as caught:
      restored, extras = opt.restore_checkpoint(ck, state)
    assert {w.filename for w in caught if "cannot be read back" in str(w.message)} == {__file__}
  assert extras.step == 4 == int(restored.step) and opt.store.step == 4
  for k in (0, 1):  # the optimizer state committed is step 4's snapshot
    np.testing.assert_array_equal(opt.store.read(k), np.fromfile(
        _snapshot(tmp_path, 4) / f"{k}.bin", opt.store.leaves[k][1]))
  assert "6" in os.listdir(ckdir) and "nvme-6" in os.listdir(ckdir)
  with Checkpointer(ckdir) as ck:
    with pytest.warns(UserWarning, match=r"moved it to '.*6\.damaged' with 'nvme-6' beside "
                                         r"it") as caught:
      assert ck.restore(state, plan)[1].step == 4  # the common call: the same fallback
    assert {w.filename for w in caught if "cannot be read back" in str(w.message)} == {__file__}
    assert ck.all_steps() == [2, 4] and opt.checkpoint_steps(ck) == [2, 4]
  assert sorted(os.listdir(ckdir)) == ["2", "4", "6.damaged", "nvme-2", "nvme-4",
                                       "nvme-6.damaged"]

def _cli(root, *extra, steps=2):
  """``zerojax train`` of the same small NVMe run as `_finished`, through the command line."""
  (root / "nvme").mkdir(parents=True, exist_ok=True)
  args = [f"{k}={v}" for k, v in {**KW, "steps": steps}.items() if k != "progress"]
  return subprocess.run(
      [sys.executable, "-m", "zerojax", "train", *args, "--no-progress", "stage=2",
       "offload_optimizer=nvme", f"nvme_path={root / 'nvme'}", "nvme_chunk_size=20000",
       "nvme_buffer_count=3", f"out_dir={root / 'run'}", f"checkpoint_dir={root / 'run' / 'ckpt'}",
       *extra], env=helpers.child_env(8), cwd=helpers.ROOT, capture_output=True, text=True,
      timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "corrupted"])
def test_cli_damaged_nvme_snapshot_with_nothing_older_is_one_line_and_exit_2(tmp_path, damage):
  """The only checkpoint's snapshot damaged: nothing to fall back to. The same command again
  says so in one line (the step, the damaged file and leaves, what to do) and exits 2, with
  no traceback; nothing is moved (there is nothing to resume instead)."""
  p = _cli(tmp_path)
  assert p.returncode == 0, p.stderr[-3000:]
  ckdir = tmp_path / "run" / "ckpt"
  assert sorted(os.listdir(ckdir)) == ["2", "nvme-2"]
  DAMAGE[damage](_snapshot(tmp_path, 2) / "1.bin")  # AdamW's nu
  p = _cli(tmp_path)
  assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-3000:])
  assert "Traceback" not in p.stderr, p.stderr
  errors = [x for x in p.stderr.splitlines() if "cannot be read back" in x]
  assert len(errors) == 1, p.stderr
  assert re.search(r"checkpoint step 2 .*cannot be read back \(\d+ damaged leaves: "
                   r"'opt_state/0/nu/[^']+'.* in 'nvme-2/process-0/1\.bin'\) and there is no "
                   r"complete checkpoint before it.*--overwrite", errors[0]), errors[0]
  assert sorted(os.listdir(ckdir)) == ["2", "nvme-2"]


@pytest.mark.slow
def test_cli_resume_past_a_truncated_nvme_snapshot_exits_0(tmp_path):
  """The command line: the newest snapshot truncated, the same command again resumes from the
  step before it (exit 0, no traceback), its warning on stderr, the note in the log."""
  p = _cli(tmp_path, steps=4)
  assert p.returncode == 0, p.stderr[-3000:]
  _truncate(_snapshot(tmp_path, 4) / "0.bin")
  p = _cli(tmp_path, steps=4)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "Traceback" not in p.stderr, p.stderr
  assert re.search(r"checkpoint step 4 .*cannot be read back \(\d+ damaged leaves: "
                   r"'opt_state/0/mu/.* in 'nvme-4/process-0/0\.bin'\); moved it to '[^']*4\."
                   r"damaged' with 'nvme-4' beside it \(to 'nvme-4\.damaged'\) and restored "
                   r"step 2", p.stderr), p.stderr
  assert "resumed from step 2 instead" in p.stdout, p.stdout
  assert json.load(open(tmp_path / "run" / "run.json"))["resumed_from"] == [2]


@pytest.mark.slow
def test_damaged_orbax_step_of_an_nvme_run_takes_its_snapshot_aside(runs, tmp_path):
  """The other half of an NVMe checkpoint: orbax's data file of the newest step truncated.
  The step falls back as well, and its snapshot goes aside with it (not left to be deleted
  as an orphan by the next save)."""
  from tests.runtime.test_checkpoint_fallback import _data_files
  _finished(tmp_path)
  ckdir = tmp_path / "run" / "ckpt"
  _truncate(_data_files(str(ckdir / "6"))[0])
  with pytest.warns(UserWarning, match=r"checkpoint step 6 .*cannot be read back \(\d+ damaged "
                                       r"leaves: .*moved it to '[^']*6\.damaged' with 'nvme-6' "
                                       r"beside it \(to 'nvme-6\.damaged'\) and restored step 4"):
    r = zt.train(_config(tmp_path), _opts(tmp_path))
  assert sorted(os.listdir(ckdir)) == ["2", "4", "6", "6.damaged", "nvme-2", "nvme-4",
                                       "nvme-6", "nvme-6.damaged"]
  assert [x["loss"] for x in zt.read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [
      x["loss"] for x in runs["lines"]]
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               r.state.params, runs["from4"].state.params)
