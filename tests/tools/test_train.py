"""The training loop: metrics files, TensorBoard event files, loss scaling, weights round trip."""

import zerojax
import dataclasses
import json
import os
import struct

import jax
import numpy as np
import pytest

from zerojax.tools import train as zt
from zerojax.core.config import ConfigError
from zerojax.core.config import ZeroConfig


def test_event_file_round_trip(tmp_path):
  w = zt.EventWriter(tmp_path)
  w.scalars(1, {"train/loss": 2.5, "train/lr": 1e-3})
  w.scalars(300, {"train/loss": 1.25})
  w.close()
  again = zt.EventWriter(tmp_path)  # opened within the same second: a file of its own, later
  again.close()
  assert again.path != w.path and sorted([w.path, again.path])[0] == w.path
  assert os.path.basename(w.path).startswith("events.out.tfevents.")
  events = zt.read_events(w.path)
  assert events == [(1, "train/loss", 2.5), (1, "train/lr", pytest.approx(1e-3)),
                    (300, "train/loss", 1.25)]
  data = open(w.path, "rb").read()
  (n,) = struct.unpack("<Q", data[:8])
  assert b"brain.Event:2" in data[12:12 + n]  # the first record is the file version
  bad = bytearray(data)
  bad[-5] ^= 1
  (tmp_path / "bad").write_bytes(bytes(bad))
  with pytest.raises(ValueError, match="CRC"):
    zt.read_events(tmp_path / "bad")


class _Seen(zt.Hook):
  """A user hook: what the loop hands every hook."""

  def __init__(self):
    self.steps, self.records, self.closed = [], [], False

  def after_step(self, step, state, flush):
    self.steps.append(step)

  def on_records(self, records, previous_step):
    assert records and records[0]["step"] > previous_step
    self.records += records

  def close(self):
    self.closed = True


def test_train_refuses_a_hook_that_is_not_one(tmp_path):
  with pytest.raises(TypeError, match=r"hooks\[0\]=<object .*is not a zerojax.tools.train.Hook"):
    zt.train(ZeroConfig(), zt.TrainOptions(out_dir=str(tmp_path)), hooks=[object()])


def test_train_writes_metrics_events_plot_and_weights(tmp_path):
  config = ZeroConfig(stage=2, batch=zerojax.Batch(micro_per_device=1, accumulation_steps=2),
                      gradient_clipping=1.0)
  opts = zt.TrainOptions(model="tiny", seq_len=32, steps=4, log_every=2, lr=3e-3,
                         out_dir=str(tmp_path / "run"), progress=False, show_plan=False,
                         save_weights=True)
  seen = _Seen()
  r = zt.train(config, opts, hooks=[seen])
  assert seen.steps == [1, 2, 3, 4] and seen.records == r.history and seen.closed
  assert [h["step"] for h in r.history] == [1, 2, 3, 4]
  assert all(np.isfinite(h["loss"]) for h in r.history)
  assert r.history[0]["tokens_per_sec"] is None  # compilation/warm-up: no throughput
  assert all(h["tokens_per_sec"] > 0 for h in r.history[1:])
  assert r.history[-1]["loss"] < r.history[0]["loss"]
  lines = zt.read_jsonl(r.files["metrics"])
  assert lines == r.history
  assert set(lines[0]) >= {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "elapsed_sec"}
  ev = zt.read_events(r.files["tensorboard"])
  assert [v for s, t, v in ev if t == "train/loss"] == pytest.approx([h["loss"] for h in lines])
  assert open(r.files["loss_png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  run = json.load(open(r.files["run"]))
  assert run["config"]["gradient_accumulation_steps"] == 2 and run["options"]["model"] == "tiny"
  # weights round trip into a new layout (stage 3)
  from zerojax.core.plan import ShardingPlan
  plan3 = ShardingPlan.create(config.replace(stage=3), r.plan.mesh, r.state.params)
  loaded = zt.load_weights(r.files["weights"], r.state.params, plan3.params)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               loaded, r.state.params)
  assert jax.tree.leaves(loaded)[1].sharding == jax.tree.leaves(plan3.params)[1]


def test_train_options_validation():
  with pytest.raises(Exception, match="TrainOptions.steps=0"):
    zt.TrainOptions(steps=0)
  with pytest.raises(Exception, match="TrainOptions.optimizer='adafactor'"):
    zt.TrainOptions(optimizer="adafactor")


@pytest.mark.slow
def test_offload_config_trains(tmp_path):
  """Stage 3 with optimizer and parameters offloaded (what configs/ds_zero3_offload.json sets)
  trains, and the state stays in pinned host memory between steps."""
  kw = dict(model="tiny", seq_len=32, steps=2, batch=8, progress=False, show_plan=False,
            plot=False, tensorboard=False)
  r = zt.train(ZeroConfig(stage=3, offload=zerojax.HostOffload(params=True, fallback="warn")),
               zt.TrainOptions(out_dir=str(tmp_path), **kw))
  assert all(np.isfinite(h["loss"]) for h in r.history)
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(r.state.params)}
  planned = {s.memory_kind for s in jax.tree.leaves(r.plan.params)}
  assert kinds == planned


# -- resume, new runs and overwrite in one out_dir ---------------------------------------------

RESUME_KW = dict(model="tiny", seq_len=16, batch=8, steps=5, log_every=3, lr=3e-3,
                 warmup_steps=2, decay="cosine", checkpoint_every=2, progress=False,
                 show_plan=False, plot=False)


@pytest.mark.slow
def test_train_resume_equals_uninterrupted_run(tmp_path, monkeypatch):
  from zerojax.runtime import checkpoint as zc
  config = ZeroConfig(stage=3, gather=zerojax.Gather(persistence_threshold=64))
  a = zt.train(config, zt.TrainOptions(out_dir=str(tmp_path / "a"),
                                       checkpoint_dir=str(tmp_path / "a" / "ckpt"), **RESUME_KW))
  opts = zt.TrainOptions(out_dir=str(tmp_path / "b"), checkpoint_dir=str(tmp_path / "b" / "ckpt"),
                         **RESUME_KW)
  real_save = zc.Checkpointer.save

  def dying_save(self, step, *args, **kw):  # the process "dies" at step 4, after checkpoint 2
    if step == 4:
      raise KeyboardInterrupt("killed at step 4")
    return real_save(self, step, *args, **kw)

  monkeypatch.setattr(zc.Checkpointer, "save", dying_save)
  with pytest.raises(KeyboardInterrupt):
    zt.train(config, opts)
  monkeypatch.setattr(zc.Checkpointer, "save", real_save)
  # metrics are fetched every 3 steps and before each checkpoint: steps 3 and 4 were logged
  # after checkpoint 2, and the resumed run must replace them, not repeat them
  assert [r["step"] for r in zt.read_jsonl(tmp_path / "b" / "metrics.jsonl")] == [1, 2, 3, 4]
  b = zt.train(config, opts)  # the same command again: resumes from step 2
  lines_a = zt.read_jsonl(a.files["metrics"])
  lines_b = zt.read_jsonl(b.files["metrics"])
  assert [r["step"] for r in lines_b] == [1, 2, 3, 4, 5]
  for k in ("loss", "grad_norm", "lr"):  # exactly: same params, optimizer, data, schedule
    assert [r[k] for r in lines_b] == [r[k] for r in lines_a], k
  assert [h["loss"] for h in b.history] == [r["loss"] for r in lines_a]
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               b.state.params, a.state.params)
  run = json.load(open(tmp_path / "b" / "run.json"))
  assert run["resumed_from"] == [2]
  # the TensorBoard run continues: one run directory, steps 3.. of the killed attempt dropped
  (tb,) = os.listdir(tmp_path / "b" / "tb")
  assert tb == run["run_id"]
  events = zt.read_run_events(tmp_path / "b" / "tb" / tb)
  assert [(s, v) for s, t, v in events if t == "train/loss"] == [
      (r["step"], pytest.approx(r["loss"])) for r in lines_a]
  # a finished run, run again: nothing to do, nothing changes
  again = zt.train(config, opts)
  assert zt.read_jsonl(again.files["metrics"]) == lines_b


@pytest.mark.slow
def test_train_runs_in_one_out_dir_never_mix(tmp_path):
  out, ck = str(tmp_path / "run"), str(tmp_path / "ck")
  kw = dict(RESUME_KW, steps=2, checkpoint_every=0)
  config = ZeroConfig(stage=2)
  first = zt.train(config, zt.TrainOptions(out_dir=out, lr=1e-3, **{
      k: v for k, v in kw.items() if k != "lr"}))
  # again into the same out_dir, with no checkpoint to resume: refused, naming both flags
  with pytest.raises(ConfigError, match=r"previous run \(steps 1\.\.2.*no checkpoint.*"
                                           r"--no-resume.*--overwrite"):
    zt.train(config, zt.TrainOptions(out_dir=out, **dict(kw, steps=3)))
  second = zt.train(config, zt.TrainOptions(out_dir=out, resume=False, **dict(kw, steps=3)))
  runs = sorted(os.listdir(os.path.join(out, "tb")))
  assert len(runs) == 2
  second_id = json.load(open(second.files["run"]))["run_id"]
  assert os.path.dirname(second.files["tensorboard"]) == os.path.join(out, "tb", second_id)
  ev = zt.read_run_events(os.path.join(out, "tb", second_id))
  losses2 = [h["loss"] for h in second.history]
  assert [(s, v) for s, t, v in ev if t == "train/loss"] == [
      (i + 1, pytest.approx(l)) for i, l in enumerate(losses2)]
  assert [r["step"] for r in zt.read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]
  (old,) = [f for f in os.listdir(out) if f.startswith("metrics.") and f != "metrics.jsonl"]
  assert [r["loss"] for r in zt.read_jsonl(os.path.join(out, old))] == [
      h["loss"] for h in first.history]
  first_events = zt.read_run_events(os.path.join(out, "tb", [r for r in runs
                                                             if r != second_id][0]))
  assert [s for s, t, _ in first_events if t == "train/loss"] == [1, 2]
  # --no-resume into a checkpoint_dir that holds checkpoints: refused (they would mix)
  import jax.numpy as jnp
  from zerojax.runtime.checkpoint import Checkpointer
  with Checkpointer(ck) as c:
    c.save(7, {"params": {"w": jnp.ones(4)}})
  with pytest.raises(ConfigError, match=r"holds checkpoints.*latest step 7.*--overwrite"):
    zt.train(config, zt.TrainOptions(out_dir=out, checkpoint_dir=ck, resume=False, **kw))
  # --overwrite: the previous runs' files and checkpoints are gone, one fresh run remains
  third = zt.train(config, zt.TrainOptions(out_dir=out, checkpoint_dir=ck, overwrite=True,
                                           **dict(kw, checkpoint_every=1)))
  assert os.listdir(os.path.join(out, "tb")) == [json.load(open(third.files["run"]))["run_id"]]
  assert not [f for f in os.listdir(out) if f.startswith("metrics.") and f != "metrics.jsonl"]
  assert sorted(os.listdir(ck)) == ["1", "2"]


def test_train_cli_resume_flags():
  from zerojax.tools import cli
  args = cli.build_parser().parse_args(["train", "--no-resume", "--overwrite", "steps=3"])
  assert args.no_resume and args.overwrite
  with pytest.raises(ConfigError, match="TrainOptions.resume='no'"):
    zt.TrainOptions(resume="no")


@pytest.mark.slow
def test_resume_with_more_steps_continues_the_schedule(tmp_path, monkeypatch, capsys):
  """#52: a cosine run resumed with another ``steps`` goes on from the rate it had: no jump
  back up, no early end; the note names the old and the new curve."""
  from zerojax.runtime import checkpoint as zc
  from zerojax.tools.train.schedules import make_schedule, run_schedule
  config = ZeroConfig(stage=2)
  kw = dict(RESUME_KW, steps=8, log_every=1)
  opts = zt.TrainOptions(out_dir=str(tmp_path / "b"), checkpoint_dir=str(tmp_path / "b" / "ck"),
                         **kw)
  real_save = zc.Checkpointer.save

  def dying_save(self, step, *args, **kw_):
    if step == 6:
      raise KeyboardInterrupt("killed at step 6")
    return real_save(self, step, *args, **kw_)

  monkeypatch.setattr(zc.Checkpointer, "save", dying_save)
  with pytest.raises(KeyboardInterrupt):
    zt.train(config, opts)
  monkeypatch.setattr(zc.Checkpointer, "save", real_save)
  capsys.readouterr()
  longer = dataclasses.replace(opts, steps=12)
  zt.train(config, longer)  # resumes from checkpoint 4
  out = capsys.readouterr().out
  lr = [r["lr"] for r in zt.read_jsonl(tmp_path / "b" / "metrics.jsonl")]
  old, new = make_schedule(longer, 8), run_schedule(longer, [(0, 8), (4, 12)])
  assert len(lr) == 12
  assert lr[:4] == pytest.approx([float(old(i)) for i in range(4)])  # before the resume
  assert lr == pytest.approx([float(new(i)) for i in range(12)])  # step k: count k - 1
  peak = kw["warmup_steps"]
  assert all(a >= b for a, b in zip(lr[peak:], lr[peak + 1:]))  # decays, never jumps back up
  assert float(new(12)) == pytest.approx(float(old(8)))  # ends where the old curve ends
  assert f"steps 8 -> 12 on resume at step 4: the learning rate goes on from {lr[4]:.4g} (step 5)" in out
  assert json.load(open(tmp_path / "b" / "run.json"))["lengths"] == [[0, 8], [4, 12]]
  # resumed again with that length: the same schedule, no new change
  capsys.readouterr()
  zt.train(config, dataclasses.replace(longer, steps=12))
  assert "on resume at step" not in capsys.readouterr().out


@pytest.mark.slow
def test_resume_after_the_end_holds_the_final_rate(tmp_path, capsys):
  config = ZeroConfig(stage=2)
  opts = zt.TrainOptions(out_dir=str(tmp_path), checkpoint_dir=str(tmp_path / "ck"),
                         **dict(RESUME_KW, steps=4, log_every=1))
  zt.train(config, opts)
  capsys.readouterr()
  zt.train(config, dataclasses.replace(opts, steps=7))
  out = capsys.readouterr().out
  lr = [r["lr"] for r in zt.read_jsonl(tmp_path / "metrics.jsonl")]
  end = 0.1 * RESUME_KW["lr"]  # where the 4-step cosine curve ends (count 4)
  assert len(lr) == 7 and lr[3] > end and lr[4:] == pytest.approx([end] * 3)
  assert "steps 4 -> 7 on resume at step 4" in out and "stays at its curve's final value" in out


@pytest.mark.parametrize("steps, when", [(3, 0), (8, 1), (8, 4)])
def test_stretched_schedule_is_continuous_and_ends_at_the_curves_end(steps, when):
  """`run_schedule` for every schedule that depends on the run's length."""
  from zerojax.tools.train.schedules import depends_on_steps, make_schedule, run_schedule
  for opts in (zt.TrainOptions(decay="cosine", steps=steps, warmup_steps=2, lr=1e-3),
               zt.TrainOptions(steps=steps, lr=1e-3, scheduler={
                   "name": "WarmupDecayLR", "warmup_num_steps": 2, "warmup_type": "linear"}),
               zt.TrainOptions(steps=steps, lr=1e-3, scheduler={
                   "name": "WarmupCosineLR", "warmup_num_steps": 2, "cos_min_ratio": 0.1})):
    assert depends_on_steps(opts)
    at = 5 if when else 0
    for old in (6, 12):
      lengths = [(0, old), (at, steps)] if steps > at else [(0, old)]
      s, o, n = run_schedule(opts, lengths), make_schedule(opts, old), make_schedule(opts, steps)
      values = [float(s(i)) for i in range(max(steps, old) + 1)]
      assert values[:at + 1] == pytest.approx([float(o(i)) for i in range(at + 1)])
      if steps > at and at <= 2:  # resumed in warmup: simply the new length's schedule
        assert values[:steps + 1] == pytest.approx([float(n(i)) for i in range(steps + 1)])
      if steps > at:
        assert values[steps] == pytest.approx(float(o(old)), abs=1e-9)
      if steps > at > 2:  # stretched: no step moves the rate more than the old curve did
        jumps = [abs(b - a) for a, b in zip(values[at:steps], values[at + 1:steps + 1])]
        assert max(jumps, default=0) <= max(abs(float(o(i + 1)) - float(o(i)))
                                            for i in range(old)) + 1e-9
