"""One process group per launch (issue 52): ``zerojax train`` and ``zerojax finetune`` started by
``zerojax launch`` (or torchrun's, JAX's or SLURM's variables) are one run; every setting the
processes must share is compared before step 1; two runs never write one ``out_dir``; a dead
process ends every survivor within seconds, naming it.

The multi-process tests run 2 processes x 4 CPU devices on localhost (marked ``slow``); each
has a hard timeout, so a hang fails instead of blocking.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import zerojax
from tests import helpers
from zerojax.core import agreement, peers
from zerojax.core import distributed as zd
from zerojax.core.config import ZeroConfig
from zerojax.tools import launch as zlaunch
from zerojax.tools.options import OUTPUT_PACKAGES, TrainOptions
from zerojax.tools.train import processes

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = ["model=tiny", "steps=3", "seq_len=32", "batch=8", "show_plan=false", "plot=false",
         "log_every=1", "--no-progress"]
_CLUSTER_VARS = ("ZEROJAX_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_",
                 "OMPI_", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE")


def _env(**overrides) -> dict:
  """A child's environment: no device count (the launcher sets 4 per process), no stray
  cluster variables."""
  env = helpers.child_env(None, JAX_PLATFORMS="cpu")
  for k in list(env):
    if k.startswith(_CLUSTER_VARS):
      del env[k]
  env.update(overrides)
  return env


def _launch(args: list[str], timeout: float, env: dict | None = None):
  """``zerojax launch -n 2 ARGS``: ``(exit code, output, seconds)``."""
  t0 = time.monotonic()
  try:
    p = subprocess.run([sys.executable, "-m", "zerojax", "launch", "-n", "2", *args],
                       env=env or _env(), cwd=ROOT, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout)
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    pytest.fail(f"launch exceeded {timeout}s:\n{out[-4000:]}")
  return p.returncode, p.stdout, time.monotonic() - t0


def _losses(out_dir) -> list[float]:
  lines = (pathlib.Path(out_dir) / "metrics.jsonl").read_text().splitlines()
  return [json.loads(x)["loss"] for x in lines]


def _clean(log: str) -> str:
  return "\n".join(l for l in log.splitlines() if "[Gloo]" not in l)


# -- joining: the launcher's and the clusters' variables ------------------------------------------


def test_torchrun_variables_name_the_group(monkeypatch):
  for k in list(os.environ):
    if k.startswith(_CLUSTER_VARS):
      monkeypatch.delenv(k)
  monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
  monkeypatch.setenv("MASTER_PORT", "29500")
  monkeypatch.setenv("WORLD_SIZE", "4")
  monkeypatch.setenv("RANK", "3")
  # torchrun's own store listens on MASTER_PORT: the coordinator takes the next port
  assert zd._resolve(None, None, None, None) == ("10.0.0.7:29501", 4, 3, "torchrun-env")
  monkeypatch.setenv("JAX_COORDINATOR_PORT", "1234")
  assert zd._resolve(None, None, None, None)[0] == "10.0.0.7:1234"
  monkeypatch.setenv("LOCAL_RANK", "1")
  monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
  assert zd._torchrun_local_device_ids() == [1]  # several per host: one device each
  monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
  assert zd._torchrun_local_device_ids() is None
  # zerojax's and JAX's own variables come first
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "h:9")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  assert zd._resolve(None, None, None, None) == ("h:9", 2, 1, "jax-env")
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
  monkeypatch.delenv("JAX_NUM_PROCESSES")
  monkeypatch.delenv("JAX_PROCESS_ID")
  monkeypatch.delenv("MASTER_PORT")
  monkeypatch.delenv("JAX_COORDINATOR_PORT")
  with pytest.raises(zd.DistributedInitError, match="MASTER_PORT"):
    zd._resolve(None, None, None, None)


_JOIN = """
import sys
from zerojax.tools import cli
cli._join_process_group()  # what zerojax train and zerojax finetune do first
import jax
from zerojax.core import distributed
print("JOINED", jax.process_index(), jax.process_count(), distributed.info().source, flush=True)
"""


def _cluster_env(style: str, i: int, port: int) -> dict:
  if style == "torchrun":
    return _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1), WORLD_SIZE="2",
                RANK=str(i), LOCAL_RANK=str(i), LOCAL_WORLD_SIZE="2")
  if style == "jax":
    return _env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID=str(i))
  # SLURM, as JAX's cluster detection reads it (srun -n 2 on one node)
  return _env(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
              SLURM_PROCID=str(i), SLURM_LOCALID=str(i), SLURM_STEP_NUM_NODES="1",
              JAX_COORDINATOR_PORT=str(port))


@pytest.mark.slow
@pytest.mark.parametrize("style,source", [("torchrun", "torchrun-env"), ("jax", "jax-env"),
                                          ("slurm", "cluster")])
def test_cluster_launchers_variables_join_one_group(style, source):
  port = zlaunch.free_port()
  procs = [subprocess.Popen([sys.executable, "-c", _JOIN], env=_cluster_env(style, i, port),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in (0, 1)]
  try:
    outs = [p.communicate(timeout=90)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, out[-3000:]
    assert f"JOINED {i} 2 {source}" in out, out[-3000:]


# -- one run: the same losses as one process ------------------------------------------------------


@pytest.mark.slow
def test_launched_train_is_one_run_with_the_one_process_losses(tmp_path, capsys):
  from zerojax.tools.cli import main
  two, one = tmp_path / "two", tmp_path / "one"
  code, log, secs = _launch(["--", "-m", "zerojax", "train", *TRAIN, f"out_dir={two}"], 240)
  assert code == 0, _clean(log)[-4000:]
  assert "[p0] zerojax: 8 x cpu devices, 2 process(es)" in log, _clean(log)[-3000:]
  assert "[p1] zerojax:" not in log  # one run: process 1 neither logs nor writes
  assert log.count("done: 3 steps") == 1, _clean(log)[-3000:]
  assert main(["train", *TRAIN, f"out_dir={one}"]) == 0  # 1 process, 8 devices, same batch
  capsys.readouterr()
  a, b = _losses(two), _losses(one)
  print(f"\n2 processes ({secs:.1f}s) {a}; 1 process {b}")
  # The same numbers up to float32 rounding: the mean loss sums the devices' parts in
  # another order across processes (gloo) than within one.
  assert len(a) == 3
  np.testing.assert_allclose(a, b, rtol=1e-6)
  assert json.loads((two / processes.LOCK_NAME).read_text())["processes"] == 2  # process 0's


@pytest.mark.slow
def test_launched_finetune_is_one_run_with_the_one_process_losses(tmp_path, capsys):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from tests.tools.test_hf_finetune import make_base
  from zerojax.tools.cli import main
  base = make_base(tmp_path / "base", 40)
  args = [str(base), "--data", str(base / "train.jsonl"), "steps=3", "seq_len=64", "batch=8",
          "lr=3e-3", "log_every=1", "show_plan=false", "plot=false", "--no-progress"]
  two, one = tmp_path / "two", tmp_path / "one"
  code, log, secs = _launch(["--", "-m", "zerojax", "finetune", *args, f"out_dir={two}"], 300)
  assert code == 0, _clean(log)[-4000:]
  assert "2 process(es)" in log and log.count("done: 3 steps") == 1, _clean(log)[-3000:]
  assert (two / "hf" / "config.json").exists()  # exported once, by process 0
  assert main(["finetune", *args, f"out_dir={one}", "--no-export"]) == 0
  capsys.readouterr()
  a, b = _losses(two), _losses(one)
  print(f"\n2 processes ({secs:.1f}s) {a}; 1 process {b}")
  assert len(a) == 3
  np.testing.assert_allclose(a, b, rtol=1e-6)  # float32 rounding, as for zerojax train


# -- agreement: every setting, derived from the classes -------------------------------------------


def _perturbed(v):
  """Other values of ``v``'s kind, most likely first (whatever the field: derived, not
  listed); an empty sequence gets one of a string or of a pair (as ``ZeroConfig.rules``)."""
  if isinstance(v, bool):
    return [not v]
  if isinstance(v, int):
    return [v + 1]
  if isinstance(v, float):
    return [v * 2 + 1]
  if isinstance(v, str):
    return [v + "x"]
  if isinstance(v, (tuple, list)):  # one more element of the kind it holds
    return [v + v[:1]] if v else [type(v)(["x"]), type(v)([("x", None)])]
  if isinstance(v, dict):
    return [{**v, "x": 1}]
  if dataclasses.is_dataclass(v):  # a ZeroConfig policy: its first field changed
    first = dataclasses.fields(v)[0].name
    return [_with(v, first, w) for w in _perturbed(getattr(v, first))]
  if v is None:  # an optional policy, or any setting left unset
    return ["x", zerojax.HostOffload(), zerojax.Quantize(weights="int8"), zerojax.LossScale()]
  return ["x"]


def _with(obj, name, value):
  """``obj`` with one field changed, validation bypassed (only the fingerprint reads it)."""
  other = copy.copy(obj)
  object.__setattr__(other, name, value)
  return other


def _fields_of(config, opts, fo=None):
  from zerojax.tools import finetune as ft
  task = ft._agreement(fo) if fo is not None else None
  return agreement.fingerprint(config, fields=processes.settings_fields(opts, task))


def test_every_field_of_every_settings_class_is_compared(tmp_path):
  from zerojax.tools import finetune as ft
  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
  data = tmp_path / "train.jsonl"
  data.write_text('{"text": "a"}\n')
  config, opts = ZeroConfig(), TrainOptions(corpus=str(data))
  fo = ft.FinetuneOptions(model_dir=str(model), data=str(data))
  base = _fields_of(config, opts, fo)
  checked = 0
  for obj, prefix in ((config, "config."), (opts, "train."), (fo, "finetune.")):
    for f in dataclasses.fields(obj):
      for value in _perturbed(getattr(obj, f.name)):
        args = {"config": config, "opts": opts, "fo": fo}
        args[{"config.": "config", "train.": "opts", "finetune.": "fo"}[prefix]] = _with(
            obj, f.name, value)
        try:
          diff = agreement.mismatches([base, _fields_of(**args)])
        except (TypeError, ValueError):  # not a value of this field's kind: the next one
          continue
        if prefix == "train." and f.name in OUTPUT_PACKAGES:  # process 0's outputs alone
          assert not diff, (f.name, list(diff))
        else:  # a policy's fields are compared one by one: ``config.precision.param``
          assert any(k == f"{prefix}{f.name}" or k.startswith(f"{prefix}{f.name}.")
                     for k in diff), (prefix, f.name, list(diff))
        checked += 1
        break
  assert checked == (len(dataclasses.fields(ZeroConfig)) + len(dataclasses.fields(TrainOptions))
                     + len(dataclasses.fields(ft.FinetuneOptions)))
  # the model's config.json, key by key, and the data files' sizes
  (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 3}))
  data.write_text('{"text": "ab"}\n')
  diff = agreement.mismatches([base, _fields_of(config, opts, fo)])
  assert diff["model.config.json.num_hidden_layers"] == [2, 3]
  assert diff["data.corpus.bytes"] == [14, 15] and "data.corpus.digest" in diff
  assert "model.config.json.hidden_size" not in diff


def test_a_new_field_is_compared_without_a_change():
  @dataclasses.dataclass
  class MoreOptions(TrainOptions):
    brand_new: int = 1

  a = processes.settings_fields(MoreOptions())
  b = processes.settings_fields(MoreOptions(brand_new=2))
  assert agreement.mismatches([a, b]) == {"train.brand_new": [1, 2]}


@pytest.mark.slow
def test_processes_given_different_steps_fail_fast_naming_steps(tmp_path):
  # Each process gets its own steps (the launcher passes one command line; sh picks the value).
  cmd = (f"exec {sys.executable} -m zerojax train model=tiny steps=$((4 + ZEROJAX_PROCESS_ID)) "
         f"seq_len=32 batch=8 out_dir={tmp_path / 'run'} show_plan=false --no-progress")
  code, log, secs = _launch(["--", "sh", "-c", cmd], 120)
  errors = [l for l in log.splitlines() if "error:" in l]
  print(f"\nboth processes refused in {secs:.1f}s (from launch): {errors[0]}")
  assert code == 2, _clean(log)[-3000:]
  want = "train.steps (process 0: 4, process 1: 5)"
  for p in ("[p0]", "[p1]"):
    assert any(l.startswith(f"{p} zerojax train: error: ") and want in l for l in errors), log
  assert "Traceback" not in log and "Shutdown barrier" not in log
  assert secs < 30, secs
  assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran


# -- out_dir: one run at a time -------------------------------------------------------------------


_HOLD = """
import sys, time
from zerojax.tools.train import processes
with processes.claim_out_dir(sys.argv[1]):
  print("HELD", flush=True)
  time.sleep(120)
"""


def test_out_dir_of_another_run_is_refused_by_name(tmp_path, capsys):
  from zerojax.tools.cli import main
  out = tmp_path / "run"
  holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "HELD"
    capsys.readouterr()
    assert main(["train", *TRAIN, f"out_dir={out}"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    assert lines[0].startswith(f"zerojax train: error: out_dir {str(out)!r} is in use by "
                               f"another run: pid {holder.pid} on host {socket.gethostname()}")
    assert "did not join one process group" in lines[0]
    assert not (out / "metrics.jsonl").exists()
  finally:
    holder.kill()
    holder.wait()
  # The holder is gone (SIGKILL): the kernel released its lock; its file is no obstacle.
  assert (out / processes.LOCK_NAME).exists()
  with processes.claim_out_dir(str(out)):
    owner = json.loads((out / processes.LOCK_NAME).read_text())
    assert owner["pid"] == os.getpid() and owner["processes"] == 1


# -- the peer watch ------------------------------------------------------------------------------


class _KeyValues:
  """The coordination service's key-value store, in one process."""

  def __init__(self):
    self.d, self.cv = {}, threading.Condition()

  def key_value_set(self, k, v):
    with self.cv:
      self.d[k] = v
      self.cv.notify_all()

  def blocking_key_value_get(self, k, ms):
    with self.cv:
      assert self.cv.wait_for(lambda: k in self.d, ms / 1000)
      return self.d[k]


def _watches(n: int):
  """``n`` connected watches in this process; each records its exit instead of exiting, and
  closes its connection as an exit would."""
  kv, exits = _KeyValues(), {}

  def exit(i, code):
    exits.setdefault(i, code)
    ws[i]._exiting = True
    if i:
      ws[i]._conns[0].shutdown(socket.SHUT_RDWR)

  ws = [peers.PeerWatch(i, n, exit=lambda code, i=i: exit(i, code)) for i in range(n)]
  ws[0].listen("127.0.0.1", kv)
  for w in ws[1:]:
    w.connect(kv, 10)
  ws[0].wait_for_everyone(10)
  return ws, exits


def _until(cond, timeout=5.0):
  deadline = time.monotonic() + timeout
  while not cond() and time.monotonic() < deadline:
    time.sleep(0.01)
  return cond()


def test_peer_watch_names_a_dead_process_at_once(capfd):
  ws, exits = _watches(3)
  t0 = time.monotonic()
  ws[2]._exiting = True  # a dead process does nothing more
  ws[2]._conns[0].shutdown(socket.SHUT_RDWR)  # its end closes without a goodbye
  assert _until(lambda: set(exits) == {0, 1})
  print(f"\nboth survivors ended {time.monotonic() - t0:.3f}s after process 2's death")
  err = capfd.readouterr().err
  assert "zerojax: process 2 of 3 is gone: killed, crashed or its host went down" in err
  assert "process 0 stops now" in err and "process 1 stops now" in err
  assert exits == {0: peers.EXIT_PEER_GONE, 1: peers.EXIT_PEER_GONE}


def test_peer_watch_settle_tells_an_echo_of_a_death_from_an_own_error(capfd):
  # A collective with a killed peer fails about when the peer's connection closes; the
  # exception hook settles first, so the death is what the survivor reports.
  ws, exits = _watches(2)
  t0 = time.monotonic()
  assert ws[1].settle(0.2) is False and time.monotonic() - t0 >= 0.2  # nobody died
  ws[0]._exiting = True  # process 0 is killed: its connections close without a goodbye
  for c in list(ws[0]._conns.values()):
    c.shutdown(socket.SHUT_RDWR)
  assert ws[1].settle(5.0) is True
  # settle answers once the watch has decided; it ends the process just after, naming process 0
  assert _until(lambda: exits == {1: peers.EXIT_PEER_GONE})
  assert "zerojax: process 0 of 2 (the coordinator) is gone" in capfd.readouterr().err
  ws2, exits2 = _watches(2)
  ws2[0].failed()  # a peer's own error is no death: settle stops waiting when it hears it
  t0 = time.monotonic()
  assert ws2[1].settle(5.0) is False and time.monotonic() - t0 < 2.0


def test_peer_watch_takes_a_goodbye_for_no_death(capfd):
  ws, exits = _watches(2)
  ws[1].done()
  time.sleep(0.05)
  ws[1]._exiting = True
  ws[1]._conns[0].shutdown(socket.SHUT_RDWR)  # finished normally, then exited
  ws[0].done()
  time.sleep(0.3)
  assert exits == {} and "zerojax:" not in capfd.readouterr().err


def test_peer_watch_ignores_a_stranger(capfd):
  ws, exits = _watches(2)
  port = ws[0]._server.getsockname()[1]
  with socket.create_connection(("127.0.0.1", port)) as s:  # not one of the run's processes
    s.sendall(b"HELLO 1 not-the-token\nFAIL\n")
  time.sleep(0.3)
  assert exits == {} and "zerojax:" not in capfd.readouterr().err


def test_peer_watch_stops_the_others_after_an_error(capfd, monkeypatch):
  monkeypatch.setattr(peers, "FAILURE_GRACE", 0.2)
  ws, exits = _watches(2)
  ws[0].failed()  # process 0 printed its own error and exits: process 1 follows
  assert _until(lambda: 1 in exits)
  assert 0 not in exits  # a failing process ends itself
  assert ("zerojax: process 0 of 2 (the coordinator) stopped on an error (its own output names "
          "it); process 1 stops too") in capfd.readouterr().err


_KILL_SCRIPT_ARGS = ["--grace", "60", "--", "-m", "zerojax", "train", "model=tiny", "steps=400",
                     "seq_len=32", "batch=8", "show_plan=false", "plot=false", "log_every=1",
                     "--no-progress", "checkpoint_every=3"]


def _kill_during_run(tmp_path, victim: int, when: str):
  """Launches a long ``zerojax train``, SIGKILLs process ``victim`` mid-step (``'step'``),
  while a checkpoint is being written (``'save'``) or mid-step of a run that streams its
  optimizer state through NVMe files (``'nvme'``): ``(output, seconds from the kill to the
  launcher's end, launcher code)``."""
  out = tmp_path / "run"
  extra = []
  if when == "nvme":
    (out / "nvme").mkdir(parents=True)
    extra = ["offload_optimizer=nvme", f"nvme_path={out / 'nvme'}"]
  p = subprocess.Popen([sys.executable, "-m", "zerojax", "launch", "-n", "2",
                        *_KILL_SCRIPT_ARGS, f"out_dir={out}", f"checkpoint_dir={out / 'ckpt'}",
                        *extra],
                       env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
  lines, killed = [], None
  try:
    for line in p.stdout:
      lines.append(line)
      if killed is None and "[p0] step 2/400" in line:
        pid = _child(p.pid, victim)
        if when == "save":  # the next save has begun (orbax's temporary directory)
          deadline = time.monotonic() + 60
          while not glob.glob(str(out / "ckpt" / "*tmp*")) and time.monotonic() < deadline:
            time.sleep(0.002)
          assert glob.glob(str(out / "ckpt" / "*tmp*")), "".join(lines)[-3000:]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
    code = p.wait(timeout=120)
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  assert killed is not None, _clean("".join(lines))[-3000:]
  return "".join(lines), time.monotonic() - killed, code


def _child(launcher: int, i: int) -> int:
  """The pid of the launcher's child with ``ZEROJAX_PROCESS_ID=i``."""
  children = pathlib.Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
  for c in children:
    env = pathlib.Path(f"/proc/{c}/environ").read_bytes().split(b"\0")
    if f"ZEROJAX_PROCESS_ID={i}".encode() in env:
      return int(c)
  raise AssertionError(f"no process {i} among {children}")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("victim,when", [(1, "step"), (0, "save"), (1, "nvme")])
def test_sigkill_of_one_process_ends_the_survivor_within_10s(tmp_path, victim, when):
  log, secs, code = _kill_during_run(tmp_path, victim, when)
  survivor = 1 - victim
  print(f"\nprocess {victim} SIGKILLed mid-{when}: the launcher ended {secs:.2f}s later")
  assert secs < 10, _clean(log)[-3000:]
  assert code == 137, _clean(log)[-3000:]  # the killed child's code comes first
  assert f"[launch] process {victim} was killed by SIGKILL (code 137)" in log
  said = [l for l in log.splitlines() if l.startswith(f"[p{survivor}] zerojax: process {victim} "
                                                      "of 2")]
  assert said and "is gone: killed, crashed or its host went down" in said[0], \
      _clean(log)[-3000:]
  assert "Traceback" not in log and "Check failure" not in log
