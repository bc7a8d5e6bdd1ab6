"""The NVMe optimizer state (ZeRO-Infinity) across 2 processes x 2 CPU devices (gloo).

One launch (`tests/nvme_mp_worker.py` under ``zerojax.tools.launch``) runs every case, and one
single-process run of the same global config (4 devices, in memory) is the reference; both
start together and each is bounded by a timeout, so a hang fails the test.

Bit identity with the one-process run is not possible at 4 devices: XLA:CPU's in-process
collectives sum the devices' gradients in device order, ``((g0 + g1) + g2) + g3``, while gloo's
cross-process reduce-scatter sums ``(g0 + g1) + (g2 + g3)``, so the reduced gradients (and so
the losses and parameters) differ in their last bits. The NVMe run is therefore held to the
in-memory run of the same 2-process layout bit for bit (the NVMe update adds no rounding), and
to the one-process run to float32 rounding amplified by Adam (as tests/core/test_multiprocess.py).
With one device per process (``ZEROJAX_NVME_MP_DEVICES=1``) every reduction adds two terms,
which commute, and the runs are bit-identical to the one-process run (measured at stages 2-3).

``ZEROJAX_NVME_MP_STAGES=3,2`` adds stage 2 (about 40 s more on 2 cores).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import helpers

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "nvme_mp_worker.py"
STAGES = [int(s) for s in os.environ.get("ZEROJAX_NVME_MP_STAGES", "3").split(",")]
STEPS = 4
DEVICES = int(os.environ.get("ZEROJAX_NVME_MP_DEVICES", "2"))  # per process; the reference
# has 2 * DEVICES
TIMEOUT = 420


def _env(**extra: str) -> dict:
  env = helpers.child_env(None, JAX_PLATFORMS="cpu", **extra)
  for k in list(env):  # no stray cluster settings: the launcher gives each child its own
    if k.startswith(("ZEROJAX_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                     "SLURM_", "OMPI_")):
      del env[k]
  env.update(extra)
  return env


def _start(cmd: list[str], env: dict, log: pathlib.Path) -> tuple[subprocess.Popen, object]:
  f = open(log, "w+")
  return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT), f


def _finish(p: subprocess.Popen, f, what: str, deadline: float) -> None:
  try:
    code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    p.kill()
    p.wait()
    code = "timeout"
  f.seek(0)
  text = f.read()
  f.close()
  assert code == 0, f"{what} exited with {code}:\n{text[-6000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """``(out, [result of process 0, 1], reference)``: the 2-process launch and the 1-process
  reference, run at once."""
  out, ref = tmp_path_factory.mktemp("nvme_mp"), tmp_path_factory.mktemp("nvme_mp_ref")
  stages = ",".join(map(str, STAGES))
  t0 = time.monotonic()
  launch = _start([sys.executable, "-m", "zerojax.tools.launch", "-n", "2",
                   "--devices-per-process", str(DEVICES), "--heartbeat-timeout", "60",
                   "--timeout", str(TIMEOUT - 20), "--", str(WORKER), str(out), "--stages",
                   stages, "--steps", str(STEPS), "--memory"], _env(), out / "launch.log")
  single = _start([sys.executable, str(WORKER), str(ref), "--reference", "--stages", stages,
                   "--steps", str(STEPS)],
                  {**helpers.child_env(2 * DEVICES, JAX_PLATFORMS="cpu"),
                   "ZEROJAX_CPU_DEVICES": str(2 * DEVICES)}, ref / "reference.log")
  try:
    _finish(*single, "the 1-process reference", t0 + TIMEOUT)
    _finish(*launch, "the 2-process NVMe launch", t0 + TIMEOUT)
  finally:
    for p, _ in (launch, single):
      if p.poll() is None:
        p.kill()
        p.wait()
  print(f"\n2-process NVMe runs and the reference took {time.monotonic() - t0:.1f}s")
  results = [json.loads((out / f"result-{i}.json").read_text()) for i in (0, 1)]
  return out, results, json.loads((ref / "reference.json").read_text()), ref


def _params(path: pathlib.Path) -> dict[str, np.ndarray]:
  with np.load(path) as z:
    return dict(z)


def _bits(values: list[float]) -> bytes:
  return np.asarray(values, np.float32).tobytes()


@pytest.mark.slow
def test_nvme_runs_on_two_processes(runs):
  _, results, ref, _ = runs
  for r in results:
    assert (r["process_count"], r["device_count"], r["local_device_count"]) == (
        2, 2 * DEVICES, DEVICES)
  assert (ref["process_count"], ref["device_count"]) == (1, 2 * DEVICES)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_nvme_matches_in_memory_on_the_same_processes_bit_for_bit(runs, stage):
  out, results, _, _ = runs
  for r in results:  # every process sees the same (replicated) losses
    assert _bits(r["runs"][f"nvme-{stage}"]["losses"]) == _bits(
        results[0]["runs"][f"memory-{stage}"]["losses"])
  got, want = _params(out / f"params-nvme-{stage}.npz"), _params(out / f"params-memory-{stage}.npz")
  assert got.keys() == want.keys()
  for k in want:
    assert got[k].tobytes() == want[k].tobytes(), k


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_nvme_matches_one_process_in_memory_to_rounding(runs, stage):
  out, results, ref, ref_dir = runs
  losses, want_losses = results[0]["runs"][f"nvme-{stage}"]["losses"], ref["runs"][
      f"memory-{stage}"]["losses"]
  got, want = _params(out / f"params-nvme-{stage}.npz"), _params(
      ref_dir / f"params-memory-{stage}.npz")
  assert got.keys() == want.keys()
  if DEVICES == 1:  # two-term sums: the same bits
    assert _bits(losses) == _bits(want_losses)
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)  # measured: 1 ulp at most
  for k in want:  # Adam's 1/sqrt(v) amplifies the last-bit differences (measured 1.6e-6)
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_nvme_each_process_writes_its_own_directory(runs, stage):
  out, results, _, _ = runs
  root = out / f"nvme-{stage}" / "zerojax-nvme"
  assert sorted(os.listdir(root)) == ["process-0", "process-1"]
  sizes = []
  for i, r in enumerate(results):
    run = r["runs"][f"nvme-{stage}"]
    assert run["directory"] == str(root / f"process-{i}")
    assert run["store_step"] == STEPS and run["chunks"] > 1
    manifest = json.loads((root / f"process-{i}" / "CURRENT").read_text())
    assert manifest["step"] == STEPS
    sizes.append(run["size"])
    # Adam's mu and nu of this process's shards only, as float32
    gens = [d for d in os.listdir(root / f"process-{i}") if d.startswith("gen-")]
    assert len(gens) == 1
    assert sum(os.path.getsize(root / f"process-{i}" / gens[0] / f) for f in
               os.listdir(root / f"process-{i}" / gens[0])) == 2 * 4 * run["size"]
  total = sum(x.size for x in _params(out / f"params-nvme-{stage}.npz").values())
  assert sizes[0] == sizes[1] < total  # each holds about half: its own devices' shards


@pytest.mark.slow
def test_nvme_mismatched_settings_refused_before_step_one(runs):
  """Process 0 asks for nvme_chunk_size=20000, process 1 for 4096: both raise
  ProcessMismatchError naming the field, before any file is written."""
  _, results, _, _ = runs
  for i, r in enumerate(results):
    m = r["mismatch"]
    assert m["error"] == "ProcessMismatchError", m
    assert m["fields"] == {"config.offload.chunk_size": [20000, 4096]}, m
    assert f"process {i} reporting" in m["message"]
    assert "config.offload.chunk_size: process 0: 20000, process 1: 4096" in m["message"]
    assert m["files"] == []  # no process directory: the optimizer state was never created


@pytest.mark.slow
def test_nvme_two_process_checkpoint_restores_exactly(runs):
  """A checkpoint saved by both processes at step 2 restores into fresh states whose optimizer
  files live elsewhere, and steps 3-4 from it repeat the uninterrupted run bit for bit."""
  out, results, _, _ = runs
  stage = STAGES[0]
  for i, r in enumerate(results):
    run = r["runs"][f"nvme-{stage}"]
    res = run["resumed"]
    assert res["from_step"] == STEPS // 2 and res["steps"] == [STEPS // 2]
    assert _bits(res["losses"]) == _bits(run["losses"][STEPS // 2:])
    assert (out / f"ckpt-{stage}" / f"nvme-{STEPS // 2}" / f"process-{i}" / "manifest.json"
            ).exists()
  got, want = _params(out / f"params-resumed-{stage}.npz"), _params(
      out / f"params-nvme-{stage}.npz")
  for k in want:
    assert got[k].tobytes() == want[k].tobytes(), k
