"""Multi-process runs: 2 processes x 4 CPU devices on localhost, through ``zerojax.launch``.

The children are separate programs with their own device count (the launcher sets it); this
test process (1 process, 8 devices) is the reference they must match. Every child run has a
hard timeout, so a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import zerojax
from tests import helpers
from zerojax import distributed as zd
from zerojax import launch as zlaunch

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multiprocess_worker.py"
EXAMPLE = ROOT / "examples" / "multihost_train.py"
RUNS = ["flat:0", "flat:1", "flat:2", "flat:3", "hybrid:3"]


def _env() -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(
      os.pathsep) if p])
  env["JAX_PLATFORMS"] = "cpu"
  for k in list(env):  # the parent's 8-device flags and any stray cluster settings
    if k == "XLA_FLAGS" or k.startswith(("ZEROJAX_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES",
                                         "JAX_PROCESS_ID", "SLURM_", "OMPI_")):
      del env[k]
  return env


def launch(args: list[str], timeout: float) -> tuple[int, str, float]:
  t0 = time.monotonic()
  try:
    p = subprocess.run([sys.executable, "-m", "zerojax.launch"] + args, env=_env(), cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    pytest.fail(f"multi-process run exceeded {timeout}s:\n{out[-4000:]}")
  return p.returncode, p.stdout, time.monotonic() - t0


@pytest.fixture(scope="session")
def mp_started(tmp_path_factory):
  """Starts the 2-process training runs in the background (session scope, so that pytest sets
  it up before the in-process ``zero_runs`` reference, which then computes meanwhile)."""
  out = tmp_path_factory.mktemp("mp_train")
  args = ["-n", "2", "--devices-per-process", "4", "--heartbeat-timeout", "30", "--timeout",
          "600", "--", str(WORKER), "train", str(out), "--runs", ",".join(RUNS), "--save",
          "flat:3"]
  log = open(out / "launch.log", "w+")
  p = subprocess.Popen([sys.executable, "-m", "zerojax.launch"] + args, env=_env(), cwd=ROOT,
                       stdout=log, stderr=subprocess.STDOUT)
  yield p, out, log, time.monotonic()
  if p.poll() is None:
    p.kill()
    p.wait()
  log.close()


@pytest.fixture(scope="module")
def mp_train(mp_started):
  p, out, log, t0 = mp_started
  try:
    code = p.wait(timeout=660)
  except subprocess.TimeoutExpired:
    p.kill()
    p.wait()
    code = None
  log.seek(0)
  text = log.read()
  assert code == 0, f"2-process training exited with {code}:\n{text[-6000:]}"
  with open(out / "result.json") as f:
    result = json.load(f)
  print(f"\n2-process training runs took {time.monotonic() - t0:.1f}s (from launch)")
  return result, out, text


def _npz_params(path):
  with np.load(path) as z:
    return dict(z)


def _flat(tree):
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_multiprocess_parity_with_one_process(stage, mp_started, zero_runs, mp_train):
  result, out, _ = mp_train
  assert result["process_count"] == 2 and result["device_count"] == 8
  assert result["local_device_count"] == 4
  run = f"flat:{stage}"
  np.testing.assert_allclose(result["losses"][run], zero_runs[stage].losses, rtol=1e-5,
                             atol=1e-5)
  got, want = _npz_params(out / f"params_flat_{stage}.npz"), _flat(zero_runs[stage].params)
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_multiprocess_hybrid_replica_spans_processes(mp_train, zero_runs):
  result, out, _ = mp_train
  run = "hybrid:3"
  assert result["mesh"][run] == {"replica": 2, "fsdp": 4}
  # each replica group (row of the mesh) is one process: fsdp stays within a host
  assert result["mesh_processes"][run] == [[0, 0, 0, 0], [1, 1, 1, 1]]
  np.testing.assert_allclose(result["losses"][run], zero_runs[3].losses, rtol=1e-5, atol=1e-5)
  got, want = _npz_params(out / "params_hybrid_3.npz"), _flat(zero_runs[3].params)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_multiprocess_each_process_feeds_its_own_rows(mp_train):
  result, _, _ = mp_train
  for run, rows in result["rows"].items():  # process 0's rows
    assert len(rows) == helpers.BATCH // 2, run
    assert rows == list(range(helpers.BATCH // 2)), run


def _restore_target(stage: int = 3):
  """The abstract sharded train state of this 1-process, 8-device run (nothing allocated or
  compiled): the layout to restore into, with its plan."""
  import jax.numpy as jnp
  from zerojax.checkpoint import abstract_train_state
  from zerojax.models import GPT
  zc = zerojax.ZeroConfig(stage=stage, param_persistence_threshold=helpers.THRESHOLD)
  x = jax.ShapeDtypeStruct((helpers.BATCH, helpers.TINY.seq_len), jnp.int32)
  return abstract_train_state(GPT(helpers.TINY), helpers.make_tx(), jax.random.key(1), x,
                              config=zc)


def test_multiprocess_checkpoint_restores_in_one_process(mp_train, zero_runs):
  import orbax.checkpoint as ocp
  _, out, _ = mp_train
  state, plan = _restore_target()
  abstract = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
  restored = ocp.StandardCheckpointer().restore(out / "orbax_ckpt", abstract)
  assert int(restored["step"]) == helpers.STEPS
  want = _flat(zero_runs[3].params)
  got = _flat(restored["params"])
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
  k = restored["params"]["blocks"]["fc"]["kernel"]
  assert k.sharding == plan.params["blocks"]["fc"]["kernel"]  # restored straight into the plan
  mu = restored["opt_state"][0].mu["blocks"]["fc"]["kernel"]
  assert mu.sharding == plan.opt_state[0].mu["blocks"]["fc"]["kernel"]


def test_multiprocess_zerojax_checkpoint_restores_in_one_process(mp_train, zero_runs):
  ckpt = pytest.importorskip("zerojax.checkpoint")
  result, out, _ = mp_train
  assert result.get("zerojax_checkpoint") == "saved", result.get("zerojax_checkpoint")
  state, plan = _restore_target()
  restored = ckpt.Checkpointer(out / "zerojax_ckpt").restore(state, plan)
  restored = restored[0] if isinstance(restored, tuple) else restored
  want, got = _flat(zero_runs[3].params), _flat(restored.params)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_multiprocess_process_death_stops_the_survivor():
  # Process 1 exits abruptly after the first collective; process 0 keeps computing. With a
  # 2s heartbeat timeout JAX must stop process 0 with an error. The launcher's grace (90s) is
  # longer than the survivor's loop (60s), so only JAX can stop it in time.
  t0 = time.monotonic()
  p = subprocess.Popen([sys.executable, "-m", "zerojax.launch", "-n", "2",
                        "--devices-per-process", "2", "--heartbeat-timeout", "2",
                        "--grace", "90", "--", str(WORKER), "die", "--survive-for", "60"],
                       env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
  lines, died_at = [], None
  try:
    for line in p.stdout:
      lines.append(line)
      if "DYING" in line and died_at is None:
        died_at = time.monotonic()
    code = p.wait(timeout=120)
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  end = time.monotonic()
  log = "".join(lines)
  assert died_at is not None, log[-4000:]
  assert "SURVIVED" not in log, log[-4000:]
  assert code != 0
  detect = end - died_at
  print(f"\nsurvivor stopped {detect:.1f}s after its peer died (heartbeat timeout 2s); "
        f"total {end - t0:.1f}s")
  assert detect < 30, log[-4000:]
  p0 = [l for l in lines if l.startswith("[p0]")]
  assert any("Terminating process" in l or "unhealthy" in l or "heartbeat" in l for l in p0), \
      "".join(p0)[-4000:]


def test_multiprocess_launcher_fails_fast():
  # JAX's heartbeat is long here (100s): the launcher itself must stop the survivor after its
  # grace period and report the failing child's exit code.
  code, log, secs = launch(["-n", "2", "--devices-per-process", "1", "--heartbeat-timeout",
                            "100", "--grace", "1", "--", str(WORKER), "die", "--survive-for",
                            "60"], timeout=120)
  assert code == 3, log[-3000:]
  assert "terminating the remaining processes" in log
  assert secs < 45, (secs, log[-3000:])


def test_multiprocess_unreachable_coordinator_is_a_clear_error():
  port = zlaunch.free_port()
  code = ("import time, zerojax.distributed as zd\n"
          "t = time.monotonic()\n"
          "try:\n"
          f"  zd.initialize('127.0.0.1:{port}', 2, 1, initialization_timeout=2)\n"
          "except zd.DistributedInitError as e:\n"
          "  print('ERROR', round(time.monotonic() - t, 1), e)\n"
          "  print('AGAIN', zd.initialize(cpu_devices=1))\n")
  t0 = time.monotonic()
  p = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT, capture_output=True,
                     text=True, timeout=60)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "ERROR" in p.stdout and f"127.0.0.1:{port}" in p.stdout, p.stdout + p.stderr
  assert time.monotonic() - t0 < 30
  # the failed call left nothing half-started: a later call works (here: single process)
  assert "AGAIN DistributedInfo(process_id=0, num_processes=1" in p.stdout, p.stdout


def test_multiprocess_example_runs_under_the_launcher(capsys):
  code, log, secs = launch(["-n", "2", "--devices-per-process", "4", "--timeout", "300", "--",
                            str(EXAMPLE), "--steps", "3", "--mesh", "hybrid"], timeout=330)
  assert code == 0, log[-4000:]
  assert "[p0] processes: 2 (zerojax-env), devices: 8 (4 local)" in log, log[-3000:]
  finals = [l for l in log.splitlines() if "final loss" in l]
  assert len(finals) == 2, log[-3000:]
  a, b = (float(l.rsplit(" ", 1)[1]) for l in finals)
  assert a == b and np.isfinite(a)
  # The same script, unchanged, in this single process with 8 devices: the same loss.
  sys.path.insert(0, str(EXAMPLE.parent))
  try:
    import multihost_train
  finally:
    sys.path.pop(0)
  capsys.readouterr()
  assert multihost_train.main(["--steps", "3", "--mesh", "hybrid"]) == 0
  single = capsys.readouterr().out
  assert "processes: 1 (single), devices: 8 (8 local)" in single, single
  one = float(next(l for l in single.splitlines() if "final loss" in l).rsplit(" ", 1)[1])
  np.testing.assert_allclose(one, a, rtol=1e-5)
  print(f"\nexample under the launcher: {secs:.1f}s; final loss 2 processes {a:.6f}, "
        f"1 process {one:.6f}")


# -- resolution of the settings (no processes started) ------------------------------------------


def test_multiprocess_settings_resolution(monkeypatch):
  for k in list(os.environ):
    if k.startswith(("ZEROJAX_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                     "SLURM_", "OMPI_")):
      monkeypatch.delenv(k)
  assert zd._resolve(None, None, None, None) == (None, None, None, "single")
  # SLURM, as JAX detects it
  monkeypatch.setenv("SLURM_JOB_ID", "4242")
  monkeypatch.setenv("SLURM_STEP_NODELIST", "node[007-008]")
  monkeypatch.setenv("SLURM_NTASKS", "2")
  monkeypatch.setenv("SLURM_PROCID", "1")
  monkeypatch.setenv("SLURM_LOCALID", "0")
  coord, n, pid, src = zd._resolve(None, None, None, None)
  assert (coord.split(":")[0], n, pid, src) == ("node007", 2, 1, "cluster")
  monkeypatch.setenv("JAX_COORDINATOR_PORT", "12345")
  assert zd._resolve(None, None, None, None)[0] == "node007:12345"
  # explicit environment beats detection; arguments beat both
  monkeypatch.setenv("ZEROJAX_COORDINATOR_ADDRESS", "10.0.0.1:999")
  monkeypatch.setenv("ZEROJAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("ZEROJAX_PROCESS_ID", "3")
  assert zd._resolve(None, None, None, None) == ("10.0.0.1:999", 4, 3, "zerojax-env")
  assert zd._resolve("h:1", 8, 5, None) == ("h:1", 8, 5, "arguments")
  for k in ("ZEROJAX_COORDINATOR_ADDRESS", "ZEROJAX_NUM_PROCESSES", "ZEROJAX_PROCESS_ID"):
    monkeypatch.delenv(k)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.2:1")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "0")
  assert zd._resolve(None, None, None, None) == ("10.0.0.2:1", 2, 0, "jax-env")


def test_multiprocess_initialize_in_a_single_process_is_harmless():
  # This test process already runs JAX on 8 local devices; initialize() finds no cluster and
  # changes nothing, however often it is called.
  a = zd.initialize(cluster_detection_method="deactivate")
  b = zd.initialize()
  assert a == b and a.num_processes == 1 and not a.is_multiprocess
  assert jax.device_count() == 8
  with pytest.raises(zd.DistributedInitError, match="num_processes"):
    zd.initialize(num_processes=2)


@pytest.mark.parametrize("address", ["localhost", "10.0.0.1:", "host:port", "::1", "h:70000"])
def test_multiprocess_coordinator_without_port_is_named(monkeypatch, address):
  # Checked before anything starts (JAX itself fails with a bare IndexError on 'localhost').
  monkeypatch.setattr(zd, "_info", None)
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  with pytest.raises(zd.DistributedInitError) as e:
    zd.initialize(coordinator_address=address, num_processes=2, process_id=0)
  assert f"coordinator address {address!r} is invalid: expected host:port" in str(e.value)
