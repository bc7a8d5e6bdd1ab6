"""``zerojax finetune`` in fp16 (#51): DeepSpeed's ``"fp16"`` section (or "auto" with
compute_dtype=float16, or the zerojax overrides) trains with DeepSpeed's dynamic loss scaling as
`zerojax train` does, full or LoRA, with or without gradient accumulation; the scale in use is
printed and saved with each checkpoint; a bad fp16 value is one line and exit 2."""

import zerojax
import json

import numpy as np
import pytest

# The checkpoints are written by transformers (test extra); skipped where absent.
pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.tools.test_hf_finetune import make_base  # noqa: E402
import zerojax  # noqa: E402
from zerojax.tools import finetune as ft  # noqa: E402
from zerojax.tools import train as zt  # noqa: E402
from zerojax.tools.cli import main  # noqa: E402

RUN = ["--no-export", "--no-progress", "seq_len=32", "batch=16", "lr=1e-2", "log_every=1",
       "show_plan=false", "plot=false"]
# DeepSpeed's fp16 section as the HF examples write it (dynamic scaling from 2**16).
DS_FP16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                    "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
           "zero_optimization": {"stage": 3}}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  return make_base(tmp_path_factory.mktemp("fp16base"), 40)


def _records(out):
  return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _finetune(base, out, *args, capsys, config=()):
  rc = main(["finetune", str(base), *config, "--data", str(base / "train.jsonl"), *RUN,
             f"out_dir={out}", *args])
  printed = capsys.readouterr()
  assert rc == 0, printed.err
  return printed.out, _records(out)


# LoRA stays in the fast subset; the full fine-tune runs with the slow tests.
@pytest.mark.parametrize("lora", [4, pytest.param(0, marks=pytest.mark.slow)],
                         ids=["lora", "full"])
def test_fp16_with_accumulation_equals_the_doubled_micro_batch(base, tmp_path, capsys, lora):
  """fp16 with gradient_accumulation_steps=2 (the zerojax overrides) gives the losses of
  accumulation 1 with the doubled micro-batch (DeepSpeed's fp16 section): one global batch,
  the same loss scale, equal to float rounding. Both print the scaling they apply."""
  (tmp_path / "ds.json").write_text(json.dumps(DS_FP16))
  lo = ["--lora", str(lora)] if lora else []
  out1, one = _finetune(base, tmp_path / "acc1", *lo, "steps=3", capsys=capsys,
                        config=[str(tmp_path / "ds.json")])
  out2, two = _finetune(base, tmp_path / "acc2", *lo, "steps=3", "compute_dtype=float16",
                        "loss_scale=0", "gradient_accumulation_steps=2", capsys=capsys)
  for out in (out1, out2):
    assert ("fp16: dynamic loss scaling from 2**16 = 65536, doubled after 1000 steps in a row "
            "without overflow, halved at the 2nd overflowing step in a row") in out
    assert "compute_dtype='float16', master weights and optimizer state float32" in out
    assert "step 3/3  loss " in out and "  loss scale 65536  " in out
  assert "2 per device x 1 accumulation" in out1 and "1 per device x 2 accumulation" in out2
  cfg = [json.loads((tmp_path / r / "run.json").read_text())["config"] for r in ("acc1", "acc2")]
  assert [(c["compute_dtype"], c["loss_scale"], c["initial_scale_power"]) for c in cfg] == [
      ("float16", 0.0, 16)] * 2
  # the scale applied, step by step: no overflow at 2**16 here, so it stays
  assert [r["loss_scale"] for r in one] == [r["loss_scale"] for r in two] == [65536.0] * 3
  assert [r["skipped_steps"] for r in one + two] == [0] * 6
  l1, l2 = np.array([r["loss"] for r in one]), np.array([r["loss"] for r in two])
  assert l1[-1] < l1[0]  # it learns
  print(f"fp16 {'LoRA' if lora else 'full'}: accumulation 2 vs 1, loss rel diff "
        f"{np.max(np.abs(l2 - l1) / l1):.2e}")
  # measured on CPU (8 devices, stage 3): 6.7e-7 (LoRA), 2.6e-6 (full): rounding of the
  # float16 compute and of the float32 accumulation
  np.testing.assert_allclose(l2, l1, rtol=2e-5)


class _Stop(zt.Hook):
  """Ends a run with an error after ``step``: what a killed job leaves behind."""

  def __init__(self, step):
    self.step = step

  def after_step(self, step, state, flush):
    if step == self.step:
      raise KeyboardInterrupt


def _lora_fp16(base, out, hooks=()):
  fo = ft.FinetuneOptions(model_dir=str(base), data=str(base / "train.jsonl"), lora=4,
                          export=False)
  # 2**22 overflows in float16 here: DeepSpeed's rule halves it (hysteresis 1) and skips the
  # step until it fits, then doubles it after every 2 good steps.
  return ft.finetune(fo, None, ["steps=6", "seq_len=32", "batch=16", "lr=1e-2", "log_every=1",
                                "checkpoint_every=3", "show_plan=false", "plot=false",
                                f"out_dir={out}", "compute_dtype=float16", "loss_scale=0",
                                "initial_scale_power=22", "hysteresis=1",
                                "loss_scale_window=2"], progress=False, hooks=hooks)


def _deepspeed_rule(overflowed, scale, window=2):
  """DeepSpeed's dynamic scale with hysteresis 1, written here: halved at an overflow,
  doubled after ``window`` good steps in a row; the scale after each step."""
  out, good = [], 0
  for o in overflowed:
    if o:
      scale, good = scale / 2, 0
    elif good + 1 >= window:
      scale, good = scale * 2, 0
    else:
      good += 1
    out.append(scale)
  return out


@pytest.mark.slow
def test_fp16_overflows_skip_steps_and_resume_at_the_scale_reached(base, tmp_path, capsys):
  """Overflowing steps are skipped and the scale moves by DeepSpeed's rule; a run stopped after
  the checkpoint of step 3 and resumed goes on at the scale, counters and losses of the run
  that was never stopped (the scale is in the checkpoint)."""
  whole = _lora_fp16(base, tmp_path / "whole")["result"].history
  skipped = [r["skipped_steps"] for r in whole]
  overflowed = [b > a for a, b in zip([0] + skipped, skipped)]
  assert any(overflowed) and not all(overflowed), skipped
  assert [r["loss_scale"] for r in whole] == _deepspeed_rule(overflowed, 2.0 ** 22)
  scales = [r["loss_scale"] for r in whole]
  moves = [np.sign(b - a) for a, b in zip(scales, scales[1:])]
  assert -1 in moves and 1 in moves, scales  # it fell and grew again
  with pytest.raises(KeyboardInterrupt):
    _lora_fp16(base, tmp_path / "stopped", hooks=[_Stop(4)])
  capsys.readouterr()
  resumed = _lora_fp16(base, tmp_path / "stopped")["result"].history
  keys = ("step", "loss", "grad_norm", "loss_scale", "skipped_steps")
  assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole]
  at3 = whole[2]
  assert (f"fp16: loss scale {at3['loss_scale']:.0f} restored from checkpoint step 3 "
          f"({at3['skipped_steps']} overflowing step(s) skipped before it)"
          ) in capsys.readouterr().out


@pytest.mark.parametrize("where, value, key, allowed", [
    ("ds", {"initial_scale_power": -1}, "'fp16.initial_scale_power'=-1",
     "an integer in [0, 64]"),
    ("ds", {"loss_scale_window": 0}, "'fp16.loss_scale_window'=0", "an integer >= 1"),
    ("ds", {"loss_scale": -2}, "'fp16.loss_scale'=-2", "0 (dynamic) or a positive finite"),
    ("cli", ["loss_scale=0", "initial_scale_power=-1"], "initial_scale_power=-1",
     "an integer in [0, 64]"),
    ("cli", ["compute_dtype=float16", "loss_scale=0", "loss_scale_window=0"],
     "loss_scale_window=0", "an integer >= 1"),
])
def test_bad_fp16_value_is_one_line_and_exit_2(base, tmp_path, capsys, where, value, key,
                                               allowed):
  config, args = [], value
  if where == "ds":
    (tmp_path / "ds.json").write_text(json.dumps(
        {**DS_FP16, "fp16": {**DS_FP16["fp16"], **value}}))
    config, args = [str(tmp_path / "ds.json")], []
  rc = main(["finetune", str(base), *config, "--data", str(base / "train.jsonl"), *RUN,
             "steps=1", f"out_dir={tmp_path / 'run'}", *args])
  err = capsys.readouterr().err
  assert rc == 2
  assert len(err.strip().splitlines()) == 1, err
  assert key in err and allowed in err, err
  assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before it trains


def test_precision_note_says_only_what_the_step_applies():
  """The printed fp16 line reads the fields the step reads; float16 without a loss scale is
  said to scale nothing; float32/bfloat16 print none."""
  note = ft.precision_note
  assert note(zerojax.ZeroConfig()) is None
  assert note(zerojax.ZeroConfig(precision=zerojax.Precision(compute="bfloat16"))) is None
  bare = note(zerojax.ZeroConfig(precision=zerojax.Precision(compute="float16")))
  assert "without loss scaling" in bare and "dynamic loss scaling from" not in bare
  static = note(zerojax.ZeroConfig(precision=zerojax.Precision(compute="float16"), loss_scale=1024))
  assert "static loss scale 1024;" in static and "dynamic" not in static
  dyn = note(zerojax.ZeroConfig(precision=zerojax.Precision(compute="float16"),
                                loss_scale=zerojax.LossScale(0, initial_scale_power=12, window=50,
                                                             hysteresis=3, min_scale=4)))
  assert ("dynamic loss scaling from 2**12 = 4096, doubled after 50 steps in a row without "
          "overflow, halved at the 3rd overflowing step in a row and at each one after (never "
          "below 4)") in dyn
  # a scale with float32 compute is still applied, and said to be unneeded
  assert "compute_dtype='float32' does not need it" in note(zerojax.ZeroConfig(loss_scale=0))


def test_fp16_auto_takes_compute_dtype_float16(base, tmp_path):
  """DeepSpeed ``fp16.enabled: "auto"`` with compute_dtype=float16 given is fp16 with
  DeepSpeed's default dynamic scaling; left alone it is the Trainer's fp16=False."""
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({"fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}))
  fo = ft.FinetuneOptions(model_dir=str(base), data=str(base / "train.jsonl"), lora=4)
  on = ft._load_with_defaults(fo, str(p), ["compute_dtype=float16"]).config
  assert (on.precision.compute, on.loss_scale) == ("float16", zerojax.LossScale(scale=0.0))
  off = ft._load_with_defaults(fo, str(p), []).config
  assert (off.compute_dtype, off.loss_scale) == ("float32", None)
