"""The `zerojax` console script (as `python -m zerojax.tools.cli`) and the examples, as subprocesses."""

import zerojax
import json
import pathlib
import re
import subprocess
import sys

import pytest

from zerojax.tools import cli
from zerojax.tools import estimate as est
from zerojax.core.config import ZeroConfig
from zerojax.runtime.memory import paper_bytes
from tests import helpers

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIG1 = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12


def run(*args, script=None, cwd=None, timeout=300):
  # The session's compilation cache (tests/conftest.py): the fine-tuning run reuses the
  # pretraining run's compiled step (same model, stage and batch).
  env = helpers.child_env(8, JAX_PLATFORMS="cpu")
  cmd = [sys.executable] + ([str(script)] if script else ["-m", "zerojax.tools.cli"]) + list(args)
  return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


# -- estimate ---------------------------------------------------------------------------------


def test_figure1_numbers():
  for stage, gb in FIG1.items():
    assert round(paper_bytes(7.5e9, stage, 64) / 1e9, 1) == gb
  opts = est.paper_options(7.5e9, 64)
  assert [round(o.device / 1e9, 1) for o in opts[:4]] == list(FIG1.values())


def test_estimate_prints_figure1():
  r = run("estimate", "--params", "7.5e9", "--devices", "64")
  assert r.returncode == 0, r.stderr
  totals = {}
  for line in r.stdout.splitlines():
    m = re.match(r"stage (\d)\s.*?\s([\d.]+) GB\s+-\s", line)
    if m:
      totals[int(m.group(1))] = float(m.group(2))
  assert totals == FIG1, r.stdout


@pytest.mark.parametrize("budget, expect", [
    (200e9, "stage 0"), (40e9, "stage 1"), (20e9, "stage 2"), (16e9, "stage 3"),
    (1e9, "stage 3 + offload_optimizer"),
    (0.3e9, "stage 3 + offload_optimizer + offload_params"), (0.1e9, None)])
def test_fit_picks_lowest_communication_option(budget, expect):
  opts = est.paper_options(7.5e9, 64)
  best, why = est.recommend(opts[::-1], budget)  # ordered by communication, not by the list
  assert (best.name if best else None) == expect
  # Every option that communicates less does not fit, and the reasoning says so of each, by
  # name and by how much; the one chosen fits.
  cheaper = [o for o in opts if best is None or o.comm_rank < best.comm_rank]
  assert all(o.device > budget for o in cheaper)
  for o in cheaper:
    line = next(w for w in why if w.startswith(f"{o.name}: "))
    assert "does not fit" in line and est.fmt_bytes(o.device - budget) in line, line
  if best is not None:
    assert best.device <= budget and why[-1].startswith(f"{best.name}: ")
    assert "does not fit" not in why[-1]


def test_estimate_fit_and_plot_subprocess(tmp_path):
  png = tmp_path / "mem.png"
  r = run("estimate", "--params", "7.5B", "--devices", "64", "--fit", "16GB", "--plot", str(png))
  assert r.returncode == 0, r.stderr
  assert "recommendation: stage 3 " in r.stdout
  assert "stage 2: 16.6 GB per device does not fit" in r.stdout
  assert png.read_bytes()[:4] == b"\x89PNG"
  r = run("estimate", "--params", "7.5e9", "--devices", "64", "--fit", "100MB")
  assert r.returncode == 1 and "nothing fits" in r.stdout


def test_estimate_model_json():
  # --no-compile: by the model-state estimate alone (the compiled peak: see
  # test_estimate_fit_uses_the_compiled_peak)
  r = run("estimate", "--model", "gpt-89m", "--devices", "8", "--fit", "500MB", "--json",
          "--no-compile")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  dev = [o["device"] for o in out["options"]]
  assert dev[0] > dev[1] > dev[2] > dev[3] > dev[4] > dev[5]
  # float32 params + grads + Adam's mu/nu = 16 bytes/parameter at stage 0
  assert dev[0] == pytest.approx(16 * out["params"], rel=0.01)
  assert out["fit"]["recommendation"] == "stage 2" and out["fit"]["compiled_peak"] == {}


# -- plan, config, help, errors ---------------------------------------------------------------


def test_plan_without_training():
  r = run("plan", "configs/zero2.json", "--model", "tiny", "--devices", "64",
          "param_persistence_threshold=0", cwd=ROOT)
  assert r.returncode == 0, r.stderr
  assert "zerojax plan: stage 2, mesh {'fsdp': 64}" in r.stdout
  assert "blocks/fc/kernel" in r.stdout and "per device:" in r.stdout


def test_config_shows_deepspeed_mapping():
  r = run("config", "configs/ds_zero3_offload.json", cwd=ROOT)
  assert r.returncode == 0, r.stderr
  assert "--xla_gpu_all_gather_combine_threshold_bytes=2000000000" in r.stdout
  assert "zero_optimization.contiguous_gradients:" in r.stdout
  assert json.loads(r.stdout[:r.stdout.index("\nXLA flags")])["zerojax"]["offload"]["params"]


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [None, "train", "plan", "estimate", "config"])
def test_help(cmd):
  r = run(*([cmd] if cmd else []), "--help")
  assert r.returncode == 0, r.stderr
  assert "usage: zerojax" in r.stdout
  if cmd in ("train", "plan", "config"):
    assert "key=value" in r.stdout
  if cmd == "estimate":
    text = " ".join(r.stdout.split())
    assert "--fit" in text and "Figure 1 (120 / 31.4 / 16.6 / 1.9 GB)" in text


def test_export_delegates():
  r = run("export", "--help")
  assert r.returncode == 0, r.stderr
  assert "usage: zerojax export" in r.stdout


@pytest.mark.parametrize("args, msg", [
    (["train", "configs/zero3.json", "stagee=2"], "unknown key 'stagee'"),
    (["plan", "configs/zero3.json", "stage=5"], "ZeroConfig.stage=5 is invalid"),
    (["estimate", "--devices", "8"], "exactly one of --params"),
    (["estimate", "--params", "7.5e9", "--fit", "lots"], "not a byte size"),
])
def test_errors_name_the_key(args, msg):
  r = run(*args, cwd=ROOT)
  assert r.returncode == 2
  assert msg in r.stderr


def test_unknown_deepspeed_key_in_file(tmp_path):
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({"zero_optimization": {"stage": 2, "bucket": 1}}))
  r = run("config", str(p))
  assert r.returncode == 2 and "'bucket'" in r.stderr


# -- train and the examples ---------------------------------------------------------------------


@pytest.mark.slow
def test_cli_train_deepspeed_config(tmp_path):
  # ds_zero2.json is Hugging Face Trainer style: its "auto" lr and bf16 come from the run
  r = run("train", str(ROOT / "configs/ds_zero2.json"), "model=tiny", "steps=3", "seq_len=32",
          "train_batch_size=16", "log_every=1", f"out_dir={tmp_path}", "show_plan=false",
          "lr=2e-3", "compute_dtype=float32")
  assert r.returncode == 0, r.stderr[-3000:]
  out = r.stdout
  assert "DeepSpeed optimizer.params.lr: 'auto' -> 0.002 (lr=0.002, given)" in out
  assert "DeepSpeed bf16.enabled: 'auto' -> False (compute_dtype='float32', given)" in out
  assert "stage 2" in out and "1 per device x 2 accumulation x 8 data parallel" in out
  assert "DeepSpeed zero_optimization.overlap_comm" in out
  flags = next(l for l in out.splitlines() if l.startswith("XLA_FLAGS="))
  assert "--xla_force_host_platform_device_count=8" in flags  # the user's flags are kept
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
  assert "--xla_gpu_all_gather_combine_threshold_bytes=800000000" in flags
  assert "tok_s=" in out and "3/3" in out  # the progress bar
  recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r_["step"] for r_ in recs] == [1, 2, 3]
  assert list(tmp_path.glob("tb/*/events.out.tfevents.*")) and (tmp_path / "loss.png").exists()


@pytest.mark.slow
def test_example_train_then_finetune(tmp_path):
  pre = tmp_path / "pre"
  r = run("--preset", "tiny", "--steps", "3", "--out-dir", str(pre), "--save-weights",
          "--no-progress", script=ROOT / "examples/train_gpt.py")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "zerojax plan: stage 3" in r.stdout and "per-device memory (XLA)" in r.stdout
  assert (pre / "weights.npz").exists()
  r = run("--init", str(pre / "weights.npz"), "--stage", "3", "--steps", "2", "--out-dir",
          str(tmp_path / "ft"), "--no-progress", script=ROOT / "examples/finetune.py")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "fine-tuning tiny from" in r.stdout and "stage 3" in r.stdout
  assert len((tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_example_nnx(tmp_path):
  r = run("--steps", "2", "--out-dir", str(tmp_path), "--no-progress",
          script=ROOT / "examples/nnx_train.py")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "done: loss" in r.stdout and (tmp_path / "loss.png").exists()


@pytest.mark.slow
def test_example_train_checkpoint_then_finetune_and_export(tmp_path):
  ck = tmp_path / "ckpt"
  r = run("--preset", "tiny", "--steps", "2", "--out-dir", str(tmp_path / "pre"),
          "--checkpoint-dir", str(ck), "--no-progress", script=ROOT / "examples/train_gpt.py")
  assert r.returncode == 0, r.stderr[-3000:]
  # Fine-tune from the sharded checkpoint at another stage.
  r = run("--init", str(ck), "--preset", "tiny", "--stage", "1", "--steps", "2", "--out-dir",
          str(tmp_path / "ft"), "--no-progress", script=ROOT / "examples/finetune.py")
  assert r.returncode == 0, r.stderr[-3000:]
  assert len((tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()) == 2
  # And export it for inference through the console script's `export` command.
  r = run("export", str(ck), str(tmp_path / "w.safetensors"), "--dtype", "bf16")
  assert r.returncode == 0, r.stderr[-3000:]
  from safetensors.numpy import load_file
  w = load_file(str(tmp_path / "w.safetensors"))
  assert any("wte" in k for k in w)


def test_cli_train_refuses_to_mix_runs(tmp_path):
  # a previous run's metrics and no checkpoint to resume: refused before anything is built
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
  r = run("train", "model=tiny", "steps=2", f"out_dir={tmp_path}", "show_plan=false")
  assert r.returncode == 2, r.stderr[-3000:]
  assert "previous run (steps 1..2" in r.stderr and "--no-resume" in r.stderr \
      and "--overwrite" in r.stderr, r.stderr[-3000:]
  assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2  # untouched


# -- typos and files (issue 18 item 9, issue 15 item 2) -----------------------------------------


@pytest.mark.parametrize("args, msg", [
    (["stpes=5"], "unknown key 'stpes' (did you mean 'steps'?)"),
    (["train.stpes=5"], "unknown training option 'stpes' (did you mean 'steps'?)"),
    (["stgae=2"], "unknown key 'stgae' (did you mean 'stage'?)"),
    (["offload_optimizer=\"false\""], "ZeroConfig.offload_optimizer='false' is invalid"),
])
def test_override_typos_suggest_the_closest(capsys, args, msg):
  assert cli.main(["config", str(ROOT / "configs/zero3.json"), *args]) == 2
  assert msg in capsys.readouterr().err


@pytest.mark.parametrize("text, msg", [
    ("stage: 2\ntrain:\n  stpes: 5\n", "unknown training option 'stpes' in 'train' (did you "
     "mean 'steps'?)"),
    ("stage: 2\ntrain:\n  show_plan: \"false\"\n", "TrainOptions.show_plan='false' is invalid: "
     "true or false"),
    ("stage: 2\ntrain: [steps, 5]\n", "'train'=['steps', 5] is invalid: a mapping"),
    ("stage: 2\nofload_optimizer: true\n", "no field 'ofload_optimizer' (did you mean "
     "'offload_optimizer'?)"),
    ("stage: 2\ntrain:\n  steps: 0\n", "TrainOptions.steps=0 is invalid"),
    ("", "is empty"),
    ("stage: 2\nstage: 3\n", "key 'stage' is given twice"),
])
def test_errors_inside_a_file_name_the_file(tmp_path, capsys, text, msg):
  p = tmp_path / "run.yaml"
  p.write_text(text)
  assert cli.main(["config", str(p)]) == 2
  err = capsys.readouterr().err
  assert f"config file {str(p)!r}" in err and msg in err, err


def test_override_errors_do_not_blame_the_file(tmp_path, capsys):
  p = tmp_path / "run.yaml"
  p.write_text("stage: 2\n")
  assert cli.main(["config", str(p), "stgae=3"]) == 2
  err = capsys.readouterr().err
  assert "run.yaml" not in err and "did you mean 'stage'" in err


def test_deepspeed_typo_in_file_names_file_and_suggestion(tmp_path, capsys):
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_com": True}}))
  assert cli.main(["config", str(p)]) == 2
  err = capsys.readouterr().err
  assert f"config file {str(p)!r}" in err and "(did you mean 'overlap_comm'?)" in err


# -- estimate --fit by the compiled step (issue 15 item 7) -------------------------------------


@pytest.mark.slow
def test_estimate_fit_uses_the_compiled_peak(capsys):
  import optax
  cfg = ZeroConfig(gather=zerojax.Gather(persistence_threshold=64))
  _, _, shapes = est.model_shapes("tiny", cfg)
  opts = {o.name: o for o in est.model_options(shapes, optax.adamw(1e-3), cfg, 8)}
  peak0 = est.step_peak("tiny", cfg.replace(stage=0), batch=8, seq=32)
  state0 = opts["stage 0"].device
  assert peak0 > state0  # activations and temporaries come on top
  budget = (peak0 + state0) / 2  # the model-state estimate alone would pick stage 0
  args = ["estimate", "--model", "tiny", "--devices", "8", "--fit", f"{budget:.0f}",
          "--batch", "8", "--seq", "32", "param_persistence_threshold=64"]
  cli.main(args + ["--json"])
  fit = json.loads(capsys.readouterr().out)["fit"]
  assert fit["compiled_peak"]["stage 0"] == peak0
  assert fit["recommendation"] not in (None, "stage 0")
  best = fit["recommendation"]
  assert fit["compiled_peak"][best] <= budget < peak0
  cli.main(args)
  out = capsys.readouterr().out
  assert (f"stage 0: model state {est.fmt_bytes(state0)} (estimate), compiled step peak "
          f"{est.fmt_bytes(peak0)} per device (XLA) does not fit") in out
  assert f"recommendation: {best}" in out
  assert "batch of 8 rows x 32 tokens over 8 devices" in out


@pytest.mark.slow
def test_estimate_fit_without_seq_uses_the_presets_length(capsys):
  # Without --seq the compiled step takes the preset's sequence length (this path once named
  # an undefined variable).
  cli.main(["estimate", "--model", "tiny", "--devices", "8", "--fit", "1GB", "--batch", "8"])
  out = capsys.readouterr().out
  from zerojax.models import PRESETS
  assert f"batch of 8 rows x {PRESETS['tiny'].seq_len} tokens over 8 devices" in out
