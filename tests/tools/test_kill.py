"""``zerojax train`` killed (SIGKILL) ten times at random moments, seeded, and run again each
time: the run that finally completes has the losses and the parameters, bit for bit, of a run
never killed. Once with the optimizer state in memory, once on NVMe (issue 52's targets).

A kill lands anywhere: while the run resumes (restoring a checkpoint, moving files aside),
compiles, steps, writes metrics, saves a checkpoint (every second step) or streams the NVMe
optimizer state. ``ZEROJAX_KILLS`` changes the count (10 by default)."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import helpers
from zerojax.tools import train as zt

KILLS = int(os.environ.get("ZEROJAX_KILLS", "10"))
STEPS = 60
ARGS = ["model=tiny", "seq_len=16", "batch=8", "lr=3e-3", "warmup_steps=4", "decay=cosine",
        f"steps={STEPS}", "log_every=1", "checkpoint_every=2", "show_plan=false", "plot=false",
        "tensorboard=false", "save_weights=true", "--no-progress"]


def _start(out, extra):
  return subprocess.Popen(
      [sys.executable, "-m", "zerojax", "train", *ARGS, *extra, f"out_dir={out}",
       f"checkpoint_dir={os.path.join(out, 'ckpt')}"], env=helpers.child_env(2),
      cwd=helpers.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run_to_the_end(out, extra):
  p = _start(out, extra)
  log, _ = p.communicate(timeout=600)
  assert p.returncode == 0, log[-3000:]
  return log


def _killed_until_done(tmp_path, extra, seed):
  """Runs the command, SIGKILLs it at a random moment, runs it again, ... ``KILLS`` times,
  then lets it finish; returns the out_dir and where each attempt started."""
  rng = random.Random(seed)
  out = str(tmp_path / "killed")
  kills, starts = 0, []
  while kills < KILLS:
    p = _start(out, extra)
    t0 = time.monotonic()
    seen = []
    if rng.random() < 0.3:  # early: resuming (restore, files moved aside) or compiling
      time.sleep(rng.uniform(0.0, 6.0))
    else:  # in the step loop: steps, metrics, checkpoint saves, NVMe streams
      # A step drawn from the kill's own stretch of the run, then a moment into it: counted in
      # steps, not seconds, so a faster machine does not finish the run before the last kill.
      target = rng.randint(kills * STEPS // (KILLS + 1) + 1, (kills + 1) * STEPS // (KILLS + 1))
      for line in p.stdout:
        seen.append(line)
        if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= target:
          break
      time.sleep(rng.uniform(0.0, 0.3))
    if p.poll() is None:
      p.send_signal(signal.SIGKILL)
      kills += 1
    log = "".join(seen) + p.communicate(timeout=120)[0]
    assert p.returncode in (0, -signal.SIGKILL), (p.returncode, log[-3000:])
    assert "Traceback" not in (log or ""), log[-3000:]
    starts.append((round(time.monotonic() - t0, 2), _resumed_from(out)))
    assert p.returncode != 0 or kills == KILLS, (
        f"the run finished after {kills} kills: make it longer ({STEPS} steps)")
  _run_to_the_end(out, extra)
  print("kills: (seconds alive, resumed from)", starts)  # shown with -s
  return out, starts


def _resumed_from(out):
  try:
    with open(os.path.join(out, "run.json")) as f:
      return json.load(f).get("resumed_from", [])[-1:]
  except (OSError, ValueError, IndexError):
    return []


def _assert_same_run(a, b):
  la, lb = zt.read_jsonl(os.path.join(a, "metrics.jsonl")), zt.read_jsonl(
      os.path.join(b, "metrics.jsonl"))
  assert [r["step"] for r in lb] == list(range(1, STEPS + 1))
  for k in ("loss", "grad_norm", "lr"):
    assert [r[k] for r in lb] == [r[k] for r in la], k
  wa, wb = np.load(os.path.join(a, "weights.npz")), np.load(os.path.join(b, "weights.npz"))
  assert sorted(wa.files) == sorted(wb.files)
  for k in wa.files:
    assert wa[k].tobytes() == wb[k].tobytes(), k


@pytest.mark.slow
def test_train_killed_ten_times_equals_a_run_never_killed(tmp_path):
  clean = str(tmp_path / "clean")
  _run_to_the_end(clean, [])
  out, starts = _killed_until_done(tmp_path, [], seed=52)
  _assert_same_run(clean, out)
  resumed = json.load(open(os.path.join(out, "run.json")))["resumed_from"]
  assert len(set(resumed)) > 1, starts  # it resumed from later and later checkpoints


@pytest.mark.slow
def test_nvme_train_killed_ten_times_equals_a_run_never_killed(tmp_path):
  os.makedirs(tmp_path / "nv_clean")
  os.makedirs(tmp_path / "nv")
  clean = str(tmp_path / "clean")
  _run_to_the_end(clean, ["offload_optimizer=nvme", f"nvme_path={tmp_path / 'nv_clean'}"])
  out, starts = _killed_until_done(
      tmp_path, ["offload_optimizer=nvme", f"nvme_path={tmp_path / 'nv'}"], seed=53)
  _assert_same_run(clean, out)
  resumed = json.load(open(os.path.join(out, "run.json")))["resumed_from"]
  assert len(set(resumed)) > 1, starts


def test_the_same_command_stopped_before_its_first_checkpoint_starts_again(tmp_path, capsys):
  """Stopped before its first checkpoint, a run leaves metrics and no checkpoint: the same
  command starts it again from step 1 (the metrics moved aside, as a note says); another
  command in that out_dir is still refused as another run."""
  from zerojax.core.config import ConfigError, ZeroConfig

  class Die(zt.Hook):
    def after_step(self, step, state, flush):
      if step == 3:
        flush()
        raise KeyboardInterrupt("killed at step 3")

  kw = dict(model="tiny", seq_len=16, batch=8, steps=5, log_every=1, checkpoint_every=4,
            progress=False, show_plan=False, plot=False, tensorboard=False)
  config = ZeroConfig(stage=2)
  opts = zt.TrainOptions(out_dir=str(tmp_path / "run"), checkpoint_dir=str(tmp_path / "ck"), **kw)
  with pytest.raises(KeyboardInterrupt):
    zt.train(config, opts, hooks=[Die()])
  assert [r["step"] for r in zt.read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
  with pytest.raises(ConfigError, match=r"previous run \(steps 1\.\.3.*no checkpoint"):
    zt.train(config, zt.TrainOptions(**{**vars(opts), "lr": 2e-3}))
  capsys.readouterr()
  again = zt.train(config, opts)
  assert "stopped at step 3, before its first checkpoint: starting it again from step 1" in \
      capsys.readouterr().out
  clean = zt.train(config, zt.TrainOptions(**{**vars(opts), "out_dir": str(tmp_path / "clean"),
                                              "checkpoint_dir": str(tmp_path / "ck2")}))
  assert [h["loss"] for h in again.history] == [h["loss"] for h in clean.history]
  assert [r["step"] for r in zt.read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [
      1, 2, 3, 4, 5]
