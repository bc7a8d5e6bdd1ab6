"""Fine-tuning from saved weights: the model is read from the weights, errors name the source,
and reading a checkpoint logs no orbax read-only notice."""

import importlib.util
import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax.tools import export
from zerojax.tools import train as zt
from zerojax.runtime.checkpoint import Checkpointer
from zerojax.core.config import ConfigError, ZeroConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A 1-step tiny run (seq_len 32) with a sharded checkpoint and a weights.npz."""
  d = tmp_path_factory.mktemp("pretrain")
  zt.train(ZeroConfig(stage=3), zt.TrainOptions(
      model="tiny", seq_len=32, steps=1, batch=8, out_dir=str(d / "run"), progress=False,
      show_plan=False, plot=False, tensorboard=False, checkpoint_dir=str(d / "ckpt"),
      save_weights=True))
  return d


def _finetune_main():
  spec = importlib.util.spec_from_file_location("finetune_example", ROOT / "examples/finetune.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.main


def test_infer_model_reads_preset_and_seq_len_from_stored_shapes(pretrained):
  assert zt.infer_model(pretrained / "ckpt") == ("tiny", 32)
  assert zt.infer_model(pretrained / "run" / "weights.npz") == ("tiny", 32)


def test_infer_model_unknown_shapes_names_the_file_and_suggests_preset(tmp_path):
  path = tmp_path / "other.npz"
  np.savez(path, **{"w/kernel": np.zeros((3, 5), np.float32)})
  with pytest.raises(ConfigError, match=r"other\.npz.*'w/kernel' \(3, 5\).*--preset"):
    zt.infer_model(path)


def test_wrong_model_error_names_the_checkpoint_not_a_temporary_file(pretrained):
  params = {"wte": {"embedding": jnp.zeros((256, 128))}}  # not the tiny model's shape
  sh = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), params)
  with pytest.raises(ValueError) as e:
    zt.load_weights(pretrained / "ckpt", params, sh)
  msg = str(e.value)
  assert f"checkpoint {str(pretrained / 'ckpt')!r}" in msg
  assert "zerojax_init_" not in msg and "weights.npz" not in msg and "--preset" in msg


@pytest.mark.slow
def test_finetune_from_checkpoint_without_preset(pretrained, tmp_path, capsys):
  out = tmp_path / "ft"
  code = _finetune_main()(["--init", str(pretrained / "ckpt"), "--steps", "1", "--batch", "8",
                           "--out-dir", str(out), "--no-progress"])
  assert code == 0
  assert "fine-tuning tiny from" in capsys.readouterr().out
  run = zt.read_jsonl(out / "metrics.jsonl")
  assert len(run) == 1 and run[0]["loss"] is not None
  import json
  assert json.loads((out / "run.json").read_text())["options"]["seq_len"] == 32


def test_finetune_unknown_weights_fail_naming_them(tmp_path, capsys):
  path = tmp_path / "other.npz"
  np.savez(path, **{"w/kernel": np.zeros((3, 5), np.float32)})
  assert _finetune_main()(["--init", str(path), "--steps", "1", "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert "other.npz" in err and "--preset" in err


def test_reading_a_checkpoint_logs_no_read_only_notice(pretrained, tmp_path, caplog):
  import orbax.checkpoint as ocp
  with caplog.at_level(logging.WARNING):
    # the notice exists (orbax logs it through absl whenever it opens a directory read-only) ...
    ocp.CheckpointManager(pretrained / "ckpt", options=ocp.CheckpointManagerOptions(
        read_only=True, create=False)).close()
  assert "Given directory is read only" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    # ... and zerojax's read-only uses (export, fine-tuning, listing) do not show it
    export.export(pretrained / "ckpt", tmp_path / "w.npz")
    Checkpointer(pretrained / "ckpt", read_only=True).close()
    zt.infer_model(pretrained / "ckpt")
  assert "read only" not in caplog.text, caplog.text
  assert not logging.getLogger("absl").filters  # the filter is removed after use
