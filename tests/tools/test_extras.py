"""The ``train`` extra's packages on a machine without them (a GPU image has no tensorboardX,
grain or safetensors, and no network): outputs left off with a note, a package asked for or
needed named in one line before anything starts, never a traceback after the model loads."""

import json
import os
import sys

import numpy as np
import pytest

from zerojax.core.config import ZeroConfig
from zerojax.runtime import extras
from zerojax.runtime.extras import MissingPackageError
from zerojax.tools import train as zt
from zerojax.tools.options import OUTPUT_PACKAGES, TrainOptions, resolve_outputs


def _hide(monkeypatch, *modules):
  """As if ``modules`` were not installed: ``find_spec`` and ``import`` both see none."""
  for m in modules:
    for name in [n for n in sys.modules if n == m or n.startswith(m + ".")]:
      monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, m, None)


def test_check_names_every_missing_package_and_how_to_install(monkeypatch):
  _hide(monkeypatch, "grain", "safetensors")
  extras.check({"numpy": "arrays"}, "x")  # installed: nothing happens
  with pytest.raises(MissingPackageError) as e:
    extras.check({"grain": "the batch order", "numpy": "arrays", "safetensors": "weights"},
                 "zerojax finetune")
  msg = str(e.value)
  assert msg.startswith("zerojax finetune needs 'grain' (the batch order) and 'safetensors' "
                        "(weights), which are not installed: pip install 'zerojax[train]'")
  assert "\n" not in msg and "--find-links" in msg
  assert e.value.missing == {"grain": "the batch order", "safetensors": "weights"}
  assert isinstance(e.value, ImportError)
  with pytest.raises(MissingPackageError, match=r"^the loss plot needs 'grain', which is not"):
    extras.require("grain.python", "the loss plot")
  assert extras.require("numpy.linalg", "x").__name__ == "numpy.linalg"


def _broken(tmp_path, monkeypatch, name):
  """An installed package whose own import fails, as a tensorboardX without protobuf does."""
  (tmp_path / name).mkdir()
  (tmp_path / name / "__init__.py").write_text(
      "raise ImportError(\"No module named 'google.protobuf'\")\n")
  monkeypatch.syspath_prepend(str(tmp_path))


def test_a_package_that_fails_to_import_is_named_with_its_error(tmp_path, monkeypatch):
  _broken(tmp_path, monkeypatch, "zj_broken")
  assert extras.unavailable("numpy") is None
  assert extras.unavailable("zj_absent") == "not installed"
  assert extras.unavailable("zj_broken") == "ImportError: No module named 'google.protobuf'"
  with pytest.raises(MissingPackageError) as e:
    extras.check({"zj_broken": "event files", "zj_absent": "weights"}, "this run")
  assert str(e.value).startswith(
      "this run needs 'zj_broken' (event files; installed, but importing it fails: ImportError: "
      "No module named 'google.protobuf') and 'zj_absent' (weights), which cannot be used: pip "
      "install 'zerojax[train]'"), e.value
  with pytest.raises(MissingPackageError, match=r"^a checkpoint without tokenizer.json needs "
                     r"'zj_broken' \(installed, but importing it fails: ImportError: No module named "
                     r"'google.protobuf'\), which cannot be used: pip install 'zerojax\[train\]' "):
    extras.require("zj_broken.sub", "a checkpoint without tokenizer.json")
  # The package imports and the submodule does not: still one named error, not a traceback.
  with pytest.raises(MissingPackageError, match=r"^x needs 'numpy.zj_absent', which cannot be "
                     r"imported \(No module named 'numpy.zj_absent'\)"):
    extras.require("numpy.zj_absent", "x")
  monkeypatch.setitem(OUTPUT_PACKAGES, "plot", ("zj_broken", "the loss plot"))
  opts, notes = resolve_outputs(TrainOptions(progress=False, tensorboard=False))
  assert opts.plot is False and notes == [
      "note: plot is off, so no the loss plot: 'zj_broken' is failing to import (ImportError: "
      "No module named 'google.protobuf') (pip install zj_broken; plot=false leaves out this "
      "note)"]


def test_the_install_line_names_packages_the_train_extra_lacks(monkeypatch):
  _hide(monkeypatch, "transformers", "grain")
  with pytest.raises(MissingPackageError, match=r"which are not installed: pip install "
                     r"'zerojax\[train\]' transformers \(without network"):
    extras.check({"transformers": "the tokenizer", "grain": "batches"}, "zerojax finetune")


def test_overrides_take_the_help_texts_none_as_null():
  from zerojax.tools.config_file import parse_overrides, parse_value
  assert parse_value("None") is None and parse_value("null") is None
  assert parse_overrides(["plot=None", "progress=false"])[1] == {"plot": None, "progress": False}


def test_outputs_default_to_their_packages_and_true_requires_one(monkeypatch):
  opts, notes = resolve_outputs(TrainOptions())
  assert (opts.progress, opts.tensorboard, opts.plot) == (True, True, True) and notes == []
  _hide(monkeypatch, "tensorboardX")
  opts, notes = resolve_outputs(TrainOptions(plot=False))
  assert (opts.progress, opts.tensorboard, opts.plot) == (True, False, False)
  assert notes == ["note: tensorboard is off, so no TensorBoard event files: 'tensorboardX' is "
                   "not installed (pip install tensorboardX; tensorboard=false leaves out this "
                   "note)"]
  assert resolve_outputs(TrainOptions(tensorboard=False)) == (
      TrainOptions(tensorboard=False, progress=True, plot=True), [])
  with pytest.raises(MissingPackageError, match=r"^this run needs 'tensorboardX' \(tensorboard="
                     r"true: TensorBoard event files\), which is not installed"):
    resolve_outputs(TrainOptions(tensorboard=True))
  with pytest.raises(Exception, match=r"TrainOptions.plot='yes' is invalid: true or false, or "
                     r"null \(when its package is installed\)"):
    TrainOptions(plot="yes")
  with pytest.raises(Exception, match=r"TrainOptions.resume=None is invalid: true or false \(a"):
    TrainOptions(resume=None)


def test_a_run_without_tensorboardx_trains_and_says_so(tmp_path, monkeypatch, capsys):
  _hide(monkeypatch, "tensorboardX")
  out = tmp_path / "run"
  with pytest.raises(MissingPackageError, match="tensorboard=true"):
    zt.train(ZeroConfig(), TrainOptions(out_dir=str(out), tensorboard=True))
  assert not out.exists()  # refused before anything was written
  r = zt.train(ZeroConfig(stage=3), TrainOptions(model="tiny", seq_len=32, steps=2, log_every=1,
                                                 out_dir=str(out), progress=False,
                                                 show_plan=False, plot=False))
  assert [h["step"] for h in r.history] == [1, 2]
  assert "tensorboard" not in r.files
  assert not [f for _, _, fs in os.walk(out) for f in fs if f.startswith("events.out.")]
  assert "note: tensorboard is off, so no TensorBoard event files" in capsys.readouterr().out
  run = json.loads((out / "run.json").read_text())
  assert run["options"]["tensorboard"] is False  # what the run did, not what it was given


def test_finetune_names_its_missing_packages_before_it_starts(tmp_path, monkeypatch, capsys):
  from zerojax.tools.cli import main
  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text("{}")
  (model / "tokenizer.json").write_text("{}")
  (tmp_path / "train.parquet").write_bytes(b"")
  _hide(monkeypatch, "grain", "safetensors", "pyarrow")
  out = tmp_path / "out"
  rc = main(["finetune", str(model), "--data", str(tmp_path / "train.parquet"),
             f"out_dir={out}"])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1, err
  assert err.startswith("zerojax finetune: error: zerojax finetune needs 'safetensors' (the "
                        "checkpoint's weights), 'grain' (the shuffled, resumable batch order) "
                        "and 'pyarrow' (reading Parquet data), which are not installed: pip "
                        "install "), err
  assert not out.exists()


def test_the_check_before_a_run_names_what_the_readers_import(tmp_path, monkeypatch):
  # Without tokenizer.json the tokenizer is transformers'; the check must say so, not tokenizers.
  from zerojax.tools import hf_data
  (tmp_path / "tokenizer_config.json").write_text("{}")
  data = tmp_path / "d.parquet"
  data.write_bytes(b"")
  _hide(monkeypatch, "transformers", "pyarrow", "grain")
  needs = hf_data.packages(str(tmp_path), [None, str(data)])
  assert set(needs) == {"transformers", "grain", "pyarrow"}
  with pytest.raises(MissingPackageError) as e:
    hf_data.Tokenizer(tmp_path)
  assert e.value.missing == {"transformers": needs["transformers"]}
  with pytest.raises(MissingPackageError) as e:
    hf_data.read_documents(data)
  assert e.value.missing == {"pyarrow": needs["pyarrow"]}
  rows = hf_data.Rows(*(np.zeros((2, 4), np.int32) for _ in hf_data.FIELDS))
  with pytest.raises(MissingPackageError) as e:
    hf_data.Batches(rows, 2)
  assert e.value.missing == {"grain": needs["grain"]}
  (tmp_path / "tokenizer.json").write_text("{}")
  assert "tokenizers" in hf_data.packages(str(tmp_path), [])


def test_reading_safetensors_without_the_package_is_named(tmp_path, monkeypatch):
  from zerojax.runtime import weights
  _hide(monkeypatch, "safetensors")
  with pytest.raises(MissingPackageError, match=r"^reading safetensors weights needs "
                     r"'safetensors', which is not installed: pip install 'zerojax\[train\]'"):
    weights.load_safetensors(tmp_path / "none.safetensors", plan=None)


def test_processes_need_not_agree_on_process_0s_outputs():
  from zerojax.tools.train.processes import settings_fields
  a = settings_fields(TrainOptions(tensorboard=True, plot=False))
  b = settings_fields(TrainOptions(tensorboard=False, plot=True, progress=False))
  assert a == b and "train.steps" in a and "train.tensorboard" not in a
