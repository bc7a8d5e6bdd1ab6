"""The NVMe optimizer state's snapshots (a checkpoint's ``nvme-<step>``) record a CRC-32 of
every chunk of every file as it is written, and are read back against it before a resume: a
truncated, corrupted or missing file is named, with the element ranges it lost (issue 52,
item 6)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from zerojax.runtime import nvme_store


def _corrupt(f):
  with open(f, "r+b") as fh:
    fh.seek(os.path.getsize(f) // 2)
    chunk = bytearray(fh.read(256))
    fh.seek(os.path.getsize(f) // 2)
    fh.write(bytes(b ^ 0x5A for b in chunk))


# -- the store: checksums recorded as written, verified on restore --------------------------------


def _store(tmp_path, size=1000):
  s = nvme_store.NvmeStore(str(tmp_path / "p0"), [("mu", np.float32), ("nu", np.float32)], size,
                           {"test": 1})
  bounds = [(a, min(a + 100, size)) for a in range(0, size, 100)]
  s.write_initial(lambda a, b: [np.arange(a, b, dtype=np.float32)] * 2, bounds,
                  [np.int32(0)], step=0)
  return s, bounds


def _add_one(i, arrays):
  for a in arrays:
    a += 1


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
