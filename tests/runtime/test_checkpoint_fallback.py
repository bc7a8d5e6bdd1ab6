"""A resumed run whose newest checkpoint cannot be read back (a data file truncated, corrupted
or missing) falls back to the newest complete checkpoint before it: a warning names the
damaged leaves, the damaged step is moved aside, and the run goes on exactly as an undamaged
run resumed from that step (issue 52, item 6)."""

import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests import helpers
from tests.runtime.test_checkpoint import _leaves_in_data_file
import zerojax
from zerojax.core.config import ZeroConfig
from zerojax.runtime.checkpoint import (CheckpointDamagedError, Checkpointer, move_aside,
                                        resume_with_fallback)
from zerojax.tools import train as zt

KW = dict(model="tiny", seq_len=16, batch=8, steps=6, log_every=1, lr=3e-3, warmup_steps=2,
          decay="cosine", checkpoint_every=2, progress=False, show_plan=False, plot=False,
          tensorboard=False)
CONFIG = ZeroConfig(stage=3, gather=zerojax.Gather(persistence_threshold=64))


def _opts(root, **kw):
  return zt.TrainOptions(out_dir=str(root), checkpoint_dir=str(root / "ckpt"), **{**KW, **kw})


def _finished(root):
  """A finished 6-step run in ``root`` (checkpoints 2, 4, 6). (A run directory is not copied:
  run.json records its paths, and a run resumed elsewhere is refused as another run.)"""
  r = zt.train(CONFIG, _opts(root))
  assert sorted(os.listdir(root / "ckpt")) == ["2", "4", "6"]
  return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A finished run whose step 6 was removed, then resumed to the end: what a run that falls
  back to step 4 must reproduce."""
  root = tmp_path_factory.mktemp("fallback") / "from4"
  _finished(root)
  shutil.rmtree(root / "ckpt" / "6")
  from4 = zt.train(CONFIG, _opts(root))
  return {"from4": from4,
          "losses": [r["loss"] for r in zt.read_jsonl(root / "metrics.jsonl")]}


def _data_files(step_dir):
  d = os.path.join(step_dir, "state", "ocdbt.process_0", "d")
  return sorted((os.path.join(d, f) for f in os.listdir(d)), key=os.path.getsize, reverse=True)


def _truncate(f):
  os.truncate(f, os.path.getsize(f) // 2)


def _corrupt(f):
  with open(f, "r+b") as fh:
    fh.seek(os.path.getsize(f) // 2)
    chunk = bytearray(fh.read(256))
    fh.seek(os.path.getsize(f) // 2)
    fh.write(bytes(b ^ 0x5A for b in chunk))


DAMAGE = {"truncated": _truncate, "corrupted": _corrupt, "missing": os.remove}


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_falls_back_past_a_damaged_checkpoint(runs, tmp_path, damage):
  run = tmp_path / "run"
  _finished(run)
  victim = _data_files(str(run / "ckpt" / "6"))[0]
  held = _leaves_in_data_file(os.path.dirname(os.path.dirname(victim)), victim)
  DAMAGE[damage](victim)
  with pytest.warns(UserWarning) as caught:
    r = zt.train(CONFIG, _opts(run))
  msg = " ".join(str(w.message) for w in caught
                 if "step 6" in str(w.message) or "/6'" in str(w.message))
  # the warning names the damaged step, its leaves, where it went and what was restored
  named = re.findall(r"'((?:params|opt_state)/[^']*)'", msg)
  assert named and set(named) <= held, (msg, held)
  aside = [n for n in os.listdir(run / "ckpt") if n.startswith("6.")]
  assert len(aside) == 1, os.listdir(run / "ckpt")
  assert aside[0] in msg, msg
  # the run went on from step 4: the same losses, metrics and parameters as an undamaged
  # run resumed from step 4
  assert [h["loss"] for h in r.history] == runs["losses"]
  lines = zt.read_jsonl(run / "metrics.jsonl")
  assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
  assert [x["loss"] for x in lines] == runs["losses"]
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               r.state.params, runs["from4"].state.params)
  assert sorted(n for n in os.listdir(run / "ckpt") if n.isdigit()) == ["2", "4", "6"]
  import json
  assert json.load(open(run / "run.json"))["resumed_from"] == [4]


def test_resume_with_fallback_gives_up_naming_the_leaves_when_nothing_older_is_left(tmp_path):
  """Without a complete step before the damaged one, the error says so and what to do; the
  damaged step is not moved (there is nothing to resume instead)."""
  d = str(tmp_path / "ck")
  os.makedirs(os.path.join(d, "3"))

  def resume(step):
    raise CheckpointDamagedError(f"checkpoint {step} is corrupted", directory=d, step=step,
                                 leaves=["params/w", "opt_state/0/mu/w"])

  with pytest.raises(CheckpointDamagedError, match=r"step 3 .*2 damaged leaves: 'params/w', "
                                                   r"'opt_state/0/mu/w'.*no complete checkpoint "
                                                   r"before it.*--overwrite") as e:
    resume_with_fallback(d, 3, resume)
  assert e.value.leaves == ("params/w", "opt_state/0/mu/w")
  assert os.listdir(d) == ["3"]
  # another error (a mismatch, a bug) is not damage: it passes through, nothing moves
  with pytest.raises(ValueError, match="other"):
    resume_with_fallback(d, 3, lambda step: (_ for _ in ()).throw(ValueError("other")))
  assert move_aside(d, 3) == os.path.join(d, "3.damaged")
  os.makedirs(os.path.join(d, "3"))
  assert move_aside(d, 3) == os.path.join(d, "3.damaged1")  # nothing is written over
  assert sorted(os.listdir(d)) == ["3.damaged", "3.damaged1"]


def test_restore_latest_falls_back_and_a_writer_moves_the_damaged_step_aside(tmp_path):
  """`Checkpointer.restore` with ``step=None``: the newest step that reads back whole, with a
  warning naming the damaged leaves; a reader leaves the files, a writer moves the step aside."""
  import jax.numpy as jnp
  import zerojax
  zc = ZeroConfig(stage=3, gather=zerojax.Gather(persistence_threshold=1))
  abstract = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
  plan = zerojax.ShardingPlan.create(zc, zerojax.make_mesh(zc), abstract)
  d = str(tmp_path / "ck")
  values = {}
  with Checkpointer(d, config=zc) as ck:
    for s in (1, 2):
      values[s] = np.random.default_rng(s).standard_normal((64, 64), np.float32)
      ck.save(s, {"params": {"w": jax.device_put(values[s], plan.params["w"])}})
  _corrupt(_data_files(os.path.join(d, "2"))[0])
  with Checkpointer(d, read_only=True) as ck:
    with pytest.warns(UserWarning, match=r"step 2 .*'params/w'.*left it in place.*restored "
                                         r"step 1") as caught:
      state, extras = ck.restore({"params": abstract}, plan)
    # The warning names the line that called restore, not zerojax's own.
    assert {w.filename for w in caught if "cannot be read back" in str(w.message)} == {__file__}
    assert extras.step == 1
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), values[1])
    with pytest.raises(CheckpointDamagedError, match="params/w") as e:
      ck.restore({"params": abstract}, plan, step=2)  # a step asked for: no fallback
    assert e.value.step == 2 and e.value.leaves == ("params/w",)
  assert sorted(os.listdir(d)) == ["1", "2"]
  with Checkpointer(d, config=zc) as ck:
    with pytest.warns(UserWarning, match=r"moved it to '.*2\.damaged'"):
      assert ck.restore({"params": abstract}, plan)[1].step == 1
    assert ck.all_steps() == [1]
    ck.save(2, {"params": {"w": jax.device_put(values[2], plan.params["w"])}})
  assert sorted(os.listdir(d)) == ["1", "2", "2.damaged"]


@pytest.mark.slow
def test_cli_resume_past_a_truncated_checkpoint_warns_once_and_exits_0(runs, tmp_path):
  """The command line: the same command again after the newest checkpoint's data file was
  truncated resumes from the step before it (exit 0, no traceback), its warning on stderr."""
  run = tmp_path / "run"
  _finished(run)
  _truncate(_data_files(str(run / "ckpt" / "6"))[0])
  args = [f"{k}={v}" for k, v in KW.items() if k not in ("progress",)]
  p = subprocess.run([sys.executable, "-m", "zerojax", "train", *args, "--no-progress",
                      f"out_dir={run}", f"checkpoint_dir={run / 'ckpt'}",
                      f"param_persistence_threshold=64"], env=helpers.child_env(8),
                     cwd=helpers.ROOT, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr
  assert "Traceback" not in p.stderr, p.stderr
  assert re.search(r"checkpoint step 6 .*cannot be read back \(\d+ damaged leaves: '(params|opt_state)/",
                   p.stderr), p.stderr
  assert "resumed from step 4 instead" in p.stdout, p.stdout
  assert [x["loss"] for x in zt.read_jsonl(run / "metrics.jsonl")] == runs["losses"]
