"""`zerojax train` with the optimizer state on NVMe (offload_optimizer='nvme'): the loop's state,
step, checkpoints, resume and metrics go through `zerojax.runtime.nvme`."""

from __future__ import annotations

import zerojax
import json
import os
import re

import jax
import numpy as np
import pytest

from zerojax.core.config import ConfigError, ZeroConfig
from zerojax.tools import train as zt
from zerojax.tools.train import loop

KW = dict(model="tiny", seq_len=16, batch=8, steps=3, log_every=1, checkpoint_every=2,
          progress=False, show_plan=False, plot=False, tensorboard=False)
NVME_KEYS = {"nvme_read_mb_s", "nvme_write_mb_s", "nvme_update_s", "nvme_wait_s", "nvme_wall_s"}


def _nvme(path) -> ZeroConfig:
  os.makedirs(path, exist_ok=True)  # nvme_path must exist (checked before step 1)
  return ZeroConfig(stage=2,
                    offload=zerojax.NvmeOffload(str(path), chunk_size=20000, buffer_count=3))


def _opts(root, checkpoints: bool = True) -> zt.TrainOptions:
  return zt.TrainOptions(out_dir=str(root), checkpoint_dir=str(root / "ckpt") if checkpoints
                         else None, **KW)


def _bits(tree) -> list[bytes]:
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The same 3 steps with the optimizer state in memory and on NVMe (checkpoints at 2, 3)."""
  root = tmp_path_factory.mktemp("train_nvme")
  memory = zt.train(ZeroConfig(stage=2), _opts(root / "memory", checkpoints=False))
  disk = zt.train(_nvme(root / "nvme"), _opts(root / "disk"))
  return root, memory, disk


@pytest.mark.slow
def test_train_nvme_equals_in_memory_bit_for_bit(runs):
  _, memory, disk = runs
  assert [h["step"] for h in disk.history] == [1, 2, 3]
  for k in ("loss", "grad_norm", "lr"):  # AdamW streamed in chunks: the same bits as in memory
    assert [h[k] for h in disk.history] == [h[k] for h in memory.history], k
  assert _bits(disk.state.params) == _bits(memory.state.params)
  lines = zt.read_jsonl(disk.files["metrics"])
  assert lines == disk.history and all(NVME_KEYS <= set(r) for r in lines)
  assert all(r["nvme_read_mb_s"] > 0 and r["nvme_wall_s"] > 0 for r in lines)
  assert not NVME_KEYS & set(memory.history[0])


@pytest.mark.slow
def test_train_nvme_writes_the_state_files_and_snapshots(runs):
  root, _, disk = runs
  proc = root / "nvme" / "zerojax-nvme" / "process-0"
  current = json.loads((proc / "CURRENT").read_text())
  assert current["step"] == 3
  gen = proc / f"gen-{current['generation']:08d}"
  files = sorted(os.listdir(gen))
  assert files == ["0.bin", "1.bin"]  # AdamW's mu and nu, float32 over every local shard
  assert (gen / "0.bin").stat().st_size == (gen / "1.bin").stat().st_size > 0
  ck = root / "disk" / "ckpt"
  for step in (2, 3):  # each checkpoint: orbax's directory and the files' snapshot beside it
    assert (ck / str(step)).is_dir()
    assert (ck / f"nvme-{step}" / "process-0" / "manifest.json").is_file()


@pytest.mark.slow
def test_train_nvme_resume_equals_uninterrupted_run(runs, tmp_path, monkeypatch):
  from zerojax.runtime import checkpoint as zc
  _, memory, disk = runs
  config, opts = _nvme(tmp_path / "nvme"), _opts(tmp_path / "run")
  real_save = zc.Checkpointer.save

  def dying_save(self, step, *args, **kw):
    # Killed at step 3 between the optimizer-state snapshot and orbax's commit: checkpoint 3
    # is incomplete, and the resumed run restores 2.
    if step == 3:
      raise KeyboardInterrupt("killed at step 3")
    return real_save(self, step, *args, **kw)

  monkeypatch.setattr(zc.Checkpointer, "save", dying_save)
  with pytest.raises(KeyboardInterrupt):
    zt.train(config, opts)
  monkeypatch.setattr(zc.Checkpointer, "save", real_save)
  assert sorted(os.listdir(tmp_path / "run" / "ckpt")) == ["2", "nvme-2", "nvme-3"]
  resumed = zt.train(config, opts)  # the same command again
  assert json.load(open(resumed.files["run"]))["resumed_from"] == [2]
  lines = zt.read_jsonl(resumed.files["metrics"])
  assert [r["step"] for r in lines] == [1, 2, 3]
  for k in ("loss", "grad_norm"):
    assert [r[k] for r in lines] == [h[k] for h in disk.history] == [
        h[k] for h in memory.history], k
  assert _bits(resumed.state.params) == _bits(disk.state.params)


def test_deepspeed_json_with_nvme_trains_through_the_cli(tmp_path, capsys):
  from zerojax.tools import cli
  nv = tmp_path / "nvme"
  nv.mkdir()
  ds = {"train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 2, "sub_group_size": 20000, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(nv), "buffer_count": 3}}}
  path = tmp_path / "ds_config.json"
  path.write_text(json.dumps(ds))
  out = tmp_path / "run"
  assert cli.main(["train", str(path), "model=tiny", "seq_len=16", "steps=2",
                   f"out_dir={out}", "plot=false", "tensorboard=false", "--no-progress"]) == 0
  log = capsys.readouterr().out
  assert "DeepSpeed zero_optimization.offload_optimizer: device nvme" in log
  assert "per-device memory (XLA)" in log  # show_plan measures the step's device part
  assert "optimizer state on NVMe:" in log and "nvme optimizer state, this run's updates" in log
  # the run's own chunk size and buffers (sub_group_size, buffer_count), not the defaults
  assert re.search(r"chunk\(s\) of <= 20,000 parameters under .* streamed through 3 buffers", log)
  lines = zt.read_jsonl(out / "metrics.jsonl")
  assert [r["step"] for r in lines] == [1, 2] and all(np.isfinite(r["loss"]) for r in lines)
  assert all(NVME_KEYS <= set(r) for r in lines)
  current = json.loads((nv / "zerojax-nvme" / "process-0" / "CURRENT").read_text())
  assert current["step"] == 2
  assert json.load(open(out / "run.json"))["config"]["offload_optimizer"] == "nvme"


# -- what the loop refuses ---------------------------------------------------------------------


def test_a_task_without_nvme_support_is_refused_before_setup(tmp_path):
  def never(*args):
    raise AssertionError("the task's setup ran")

  task = zt.Task("finetune-like", 16, never, never, never, never)
  with pytest.raises(ConfigError, match=r"offload_optimizer='nvme' is not supported by the "
                                        r"'finetune-like' task.*offload_optimizer=true"):
    zt.train(_nvme(tmp_path / "nvme"), _opts(tmp_path / "run"), task=task)
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_resume_refuses_to_switch_the_optimizer_state_on_or_off_nvme(runs, tmp_path):
  import dataclasses
  import jax.numpy as jnp
  from zerojax.runtime.checkpoint import Checkpointer
  root, _, _ = runs
  # An NVMe run's checkpoints, resumed in memory: refused before anything is read or written.
  with pytest.raises(ConfigError, match=r"ZeroConfig.offload_optimizer=False cannot resume "
                                        r"checkpoint step 3.*saved with "
                                        r"offload_optimizer='nvme'.*Resume with "
                                        r"offload_optimizer='nvme'"):
    zt.train(ZeroConfig(stage=2), _opts(root / "disk"))
  # and an in-memory run's checkpoint resumed on NVMe
  opts = _opts(tmp_path / "memory")
  with Checkpointer(opts.checkpoint_dir) as c:
    c.save(2, {"params": {"w": jnp.ones(4)}})
  (tmp_path / "memory" / "run.json").write_text(json.dumps(
      {"run_id": "r", "config": ZeroConfig(stage=2).to_flat(),
       "options": dataclasses.asdict(opts)}))
  with pytest.raises(ConfigError, match=r"offload_optimizer='nvme' cannot resume .*saved with "
                                        r"offload_optimizer=False"):
    zt.train(_nvme(tmp_path / "nvme"), opts)


def test_overwrite_deletes_nvme_snapshots_too(tmp_path):
  ck = tmp_path / "ckpt"
  for name in ("2", "4.incomplete", "nvme-2", "nvme-4", "other"):
    (ck / name).mkdir(parents=True)
  loop._delete_previous(str(tmp_path / "out"), str(ck), None)
  assert os.listdir(ck) == ["other"]
