"""The training loop: metrics files, TensorBoard encoding, loss scaling, weights round trip."""

import json
import os
import struct

import jax
import numpy as np
import pytest

from zerojax import train as zt
from zerojax.config import ZeroConfig


def test_crc32c_and_masking():
  assert zt.crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
  assert zt.crc32c(b"") == 0
  c = zt.crc32c(b"abc")
  assert zt.masked_crc32c(b"abc") == (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_event_file_round_trip(tmp_path):
  w = zt.EventWriter(tmp_path)
  w.scalars(1, {"train/loss": 2.5, "train/lr": 1e-3})
  w.scalars(300, {"train/loss": 1.25})
  w.close()
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


def test_train_writes_metrics_events_plot_and_weights(tmp_path):
  config = ZeroConfig(stage=2, micro_batch_per_device=1, gradient_accumulation_steps=2,
                      gradient_clipping=1.0)
  opts = zt.TrainOptions(model="tiny", seq_len=32, steps=4, log_every=2, lr=3e-3,
                         out_dir=str(tmp_path / "run"), progress=False, show_plan=False,
                         save_weights=True)
  r = zt.train(config, opts)
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
  from zerojax.plan import ShardingPlan
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


def test_offload_config_trains(tmp_path):
  """Stage 3 with optimizer and parameters offloaded (what configs/ds_zero3_offload.json sets)
  trains, and the state stays in pinned host memory between steps."""
  kw = dict(model="tiny", seq_len=32, steps=2, batch=8, progress=False, show_plan=False,
            plot=False, tensorboard=False)
  r = zt.train(ZeroConfig(stage=3, offload_optimizer=True, offload_params=True,
                          offload_fallback="warn"),
               zt.TrainOptions(out_dir=str(tmp_path), **kw))
  assert all(np.isfinite(h["loss"]) for h in r.history)
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(r.state.params)}
  planned = {s.memory_kind for s in jax.tree.leaves(r.plan.params)}
  assert kinds == planned
