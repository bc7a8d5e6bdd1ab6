"""A newcomer's first hour (issue 26): DeepSpeed "auto" values, README snippets, argument types,
a quiet and fast start, one throughput, the estimate's stage-3 peak, models with no or integer
parameters, a misspelled DeepSpeed key, and one exit-status convention."""

import ast
import json
import pathlib
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax.core.config import ConfigError
from zerojax.tools import cli
from zerojax.tools import deepspeed as ds
from tests import helpers

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _clean_env(**extra) -> dict:
  """A fresh shell's device settings: no device count and no platform from this session
  (its compiler flags and compilation cache stay)."""
  return helpers.child_env(None, **{"JAX_PLATFORMS": None, **extra})


# -- 2. DeepSpeed "auto" values come from the run ----------------------------------------------

HF_STYLE = {  # what the Hugging Face Trainer's DeepSpeed integration documents
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"},
}


@pytest.fixture
def hf_file(tmp_path):
  p = tmp_path / "ds_config.json"
  p.write_text(json.dumps(HF_STYLE))
  return p


def test_auto_without_a_value_takes_the_trainers_default_and_says_so(hf_file):
  """#51: an "auto" the run leaves unset is the HF Trainer's default, as in the Trainer (the
  full table is tests/tools/test_hf_trainer_ways.py's)."""
  loaded = zerojax.load_config(hf_file, apply_xla_flags=False)
  notes = "\n".join(loaded.notes)
  for key, field in (("optimizer.params.lr", "learning_rate=5e-05"),
                     ("gradient_clipping", "max_grad_norm=1.0"), ("bf16.enabled", "bf16=False")):
    assert re.search(rf"^{re.escape(key)}: 'auto' -> .*auto: Trainer default "
                     rf"{re.escape(field)}", notes, re.M), notes


def test_auto_values_come_from_the_run_and_each_is_printed(hf_file):
  from zerojax.tools import train as zt
  loaded = zerojax.load_config(hf_file, ["steps=4", "lr=1e-3", "compute_dtype=float32",
                                         "gradient_clipping=0.5", "b2=0.999"],
                               apply_xla_flags=False)
  opts = zt.TrainOptions(**loaded.train)
  assert opts.lr == 1e-3 and (opts.b1, opts.b2) == (0.9, 0.999) and opts.eps == 1e-8
  s = opts.scheduler
  assert (s["warmup_min_lr"], s["warmup_max_lr"], s["warmup_num_steps"],
          s["total_num_steps"]) == (0.0, 1e-3, 0, 4)
  assert loaded.config.gradient_clipping == 0.5 and loaded.config.compute_dtype == "float32"
  notes = "\n".join(loaded.notes)
  for line in ("optimizer.params.lr: 'auto' -> 0.001 (lr=0.001, given)",
               "scheduler.params.total_num_steps: 'auto' -> 4 (steps=4, given)",
               "scheduler.params.warmup_num_steps: 'auto' -> 0 (auto: Trainer default "
               "warmup_steps=0",
               "optimizer.params.betas: 'auto' -> [0.9, 0.999]",
               "bf16.enabled: 'auto' -> False (compute_dtype='float32', given)",
               "gradient_clipping: 'auto' -> 0.5 (gradient_clipping=0.5, given)",
               "train_batch_size: 'auto' -> derived as the Trainer does",
               "train_micro_batch_size_per_gpu: 'auto' -> 8 (auto: Trainer default "
               "per_device_train_batch_size=8",
               "zero_optimization.stage3_param_persistence_threshold: 'auto' -> zerojax's "
               "default", "steps_per_print: log_every=2000"):
    assert line in notes, (line, notes)
  # every "auto" in the file has its line
  assert notes.count("'auto' ->") == 14, notes
  # the 4-step run: its learning rate is past warm-up from the first step on
  _, sched = zt.make_optimizer(opts)
  lrs = [float(sched(i)) for i in range(4)]
  assert lrs[0] == pytest.approx(1e-3) and all(x > 0 for x in lrs), lrs


def test_auto_is_shown_with_its_source_where_nothing_trains(hf_file, capsys):
  assert cli.main(["config", str(hf_file)]) == 0
  out = capsys.readouterr().out
  assert "optimizer.params.lr: 'auto' -> 5e-05 (auto: Trainer default learning_rate=5e-05" in out
  m = ds.map_deepspeed(HF_STYLE, {"lr": 2e-4, "compute_dtype": "bfloat16"})
  assert m.auto["optimizer.params.lr"] == 2e-4 and m.auto["bf16.enabled"] is True
  assert m.config.compute_dtype == "bfloat16" and m.config.gradient_clipping == 1.0
  assert not m.unresolved


def test_shipped_trainer_style_config_takes_the_run_or_the_trainers_values():
  path = ROOT / "configs/ds_zero2.json"
  loaded = zerojax.load_config(path, apply_xla_flags=False)
  assert loaded.train["lr"] == 5e-5 and loaded.config.compute_dtype == "float32"
  loaded = zerojax.load_config(path, ["lr=3e-4", "compute_dtype=bfloat16"],
                               apply_xla_flags=False)
  assert loaded.train["lr"] == 3e-4 and loaded.config.compute_dtype == "bfloat16"


# -- 4. every README python snippet runs ---------------------------------------------------------

CONTINUES = "# continues the Usage example above"


def _snippets() -> list[tuple[str, str]]:
  """``(section heading, code)`` of every fenced python block, in order."""
  out = []
  for m in re.finditer(r"```python\n(.*?)\n```", README, re.S):
    heading = re.findall(r"^#+ (.*)$", README[:m.start()], re.M)[-1]
    out.append((heading, m.group(1)))
  return out


def test_readme_snippets_are_complete_programs_or_say_what_they_continue():
  snippets = _snippets()
  # The README keeps one example; the docs pages' blocks run in tests/tools/test_docs.py.
  assert snippets and snippets[0][0] == "Usage"
  for heading, code in snippets:
    tree = ast.parse(code)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    bound = {a.asname or a.name.split(".")[0] for n in ast.walk(tree)
             if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    if not code.startswith(CONTINUES):
      # a standalone snippet imports every module it names
      for mod in ("jax", "jnp", "optax", "zerojax", "nnx", "weights", "llama"):
        assert mod not in names or mod in bound, (heading, mod)
  # every import in them works (`from zerojax import weights` once did not)
  for heading, code in snippets:
    for node in ast.walk(ast.parse(code)):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        exec(compile(ast.Module([node], []), f"README {heading}", "exec"), {})


def test_public_weights_and_checkpoint_modules_are_the_runtime_ones():
  from zerojax import checkpoint, weights
  from zerojax.runtime import checkpoint as rc, weights as rw
  from zerojax.runtime import create
  for alias, mod in ((weights, rw), (checkpoint, rc)):
    assert set(mod.__all__) <= set(alias.__all__)
    assert all(getattr(alias, n) is getattr(mod, n) for n in mod.__all__)
  # the restore target of every offload (NVMe's too) is the one beside `create_train_state`
  assert set(checkpoint.__all__) - set(rc.__all__) == {"abstract_train_state"}
  assert checkpoint.abstract_train_state is create.abstract_train_state
  assert zerojax.weights is weights and zerojax.checkpoint is checkpoint


def _make_llama(model_dir: pathlib.Path) -> None:
  """A tiny Llama checkpoint as ``LlamaForCausalLM.save_pretrained`` lays it out (config.json,
  model.safetensors under its tensor names), random weights, written without torch so the
  snippets also run on Pythons that have no torch build."""
  from safetensors.numpy import save_file
  d, f, layers, heads, kv, vocab = 64, 176, 2, 4, 2, 256
  hd = d // heads
  cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
         "hidden_size": d, "intermediate_size": f, "num_hidden_layers": layers,
         "num_attention_heads": heads, "num_key_value_heads": kv, "hidden_act": "silu",
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "tie_word_embeddings": False, "torch_dtype": "float32"}
  shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,),
            "lm_head.weight": (vocab, d)}
  for i in range(layers):
    p = f"model.layers.{i}."
    shapes.update({p + "self_attn.q_proj.weight": (heads * hd, d),
                   p + "self_attn.k_proj.weight": (kv * hd, d),
                   p + "self_attn.v_proj.weight": (kv * hd, d),
                   p + "self_attn.o_proj.weight": (d, heads * hd),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                   p + "post_attention_layernorm.weight": (d,)})
  rs = np.random.RandomState(0)
  tensors = {k: (np.ones(s) if len(s) == 1 else rs.normal(0, 0.02, s)).astype(np.float32)
             for k, s in shapes.items()}
  model_dir.mkdir(parents=True)
  (model_dir / "config.json").write_text(json.dumps(cfg))
  save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


_DRIVER = """
import json, sys
snippets = json.load(open(sys.argv[1]))
usage = {}
exec(compile(snippets[0][1], "README Usage", "exec"), usage)
for heading, code in snippets[1:]:
  ns = dict(usage) if code.startswith(%r) else {}
  exec(compile(code, "README " + heading, "exec"), ns)
  print("ran:", heading, flush=True)
"""


@pytest.mark.slow
def test_every_readme_python_snippet_runs_verbatim(tmp_path):
  snippets = _snippets()
  (tmp_path / "snippets.json").write_text(json.dumps(snippets))
  (tmp_path / "driver.py").write_text(_DRIVER % CONTINUES)
  _make_llama(tmp_path / "models" / "my-llama")  # the fine-tuning snippet's checkpoint
  r = subprocess.run([sys.executable, "driver.py", "snippets.json"], cwd=tmp_path,
                     env=_clean_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  ran = re.findall(r"^ran: (.*)$", r.stdout, re.M)
  assert ran == [h for h, _ in snippets[1:]], ran
  assert re.search(r"^8 devices, mesh \{'fsdp': 8\}, loss [0-9.]+$", r.stdout, re.M)


# -- 5. argument types are checked where they enter --------------------------------------------


def _plan():
  cfg = zerojax.ZeroConfig(stage=3)
  return zerojax.ShardingPlan.create(cfg, zerojax.make_mesh(cfg), {"w": jnp.zeros((64, 64))})


def test_text_batches_refuses_the_method_and_takes_the_plans_batch_sharding():
  from zerojax.runtime.data import TextBatches
  plan = _plan()
  tokens = np.arange(1000, dtype=np.int32) % 256
  with pytest.raises(TypeError) as e:
    TextBatches(tokens, 16, 8, sharding=plan.batch)
  msg = str(e.value)
  assert "sharding=" in msg and "(method)" in msg and "jax.sharding.Sharding" in msg
  assert "plan.batch()" in msg
  with pytest.raises(TypeError, match=r"global_batch='16' \(str\)"):
    TextBatches(tokens, "16", 8)
  with pytest.raises(ValueError, match=r"seq_len=0 is invalid"):
    TextBatches(tokens, 16, 0)
  with pytest.raises(TypeError, match="tokens must be a 1-D numpy array"):
    TextBatches(list(tokens), 16, 8)
  b = next(TextBatches(tokens, 16, 8, sharding=plan.batch()))
  assert b["x"].shape == (16, 8) and b["x"].sharding == plan.batch()
  assert b["x"].sharding == plan.batch({"x": b["x"]})["x"]
  # What its docstring says of ``sharding``: with plan.batch() the batches are global
  # jax.Arrays of the rows that sharding=None gives as numpy arrays (this process's rows: all
  # of them here), and batch i depends only on (seed, i), so ``step=i`` starts at it.
  host = TextBatches(tokens, 16, 8)
  first = next(host)
  assert isinstance(b["x"], jax.Array) and isinstance(first["x"], np.ndarray)
  for k in ("x", "y"):
    np.testing.assert_array_equal(np.asarray(b[k]), first[k])
  third = [next(host) for _ in range(2)][-1]
  assert not np.array_equal(third["x"], first["x"])
  resumed = next(TextBatches(tokens, 16, 8, sharding=plan.batch(), step=2))
  for k in ("x", "y"):
    np.testing.assert_array_equal(np.asarray(resumed[k]), third[k])


# -- 6. import and --help start nothing -------------------------------------------------------


def test_import_and_help_load_no_jax_backend():
  code = ("import sys, zerojax\n"
          "assert 'jax' not in sys.modules, 'import zerojax imported jax'\n"
          "from zerojax.tools import cli\n"
          "try:\n  cli.main(['--help'])\nexcept SystemExit:\n  pass\n"
          "assert 'jax' not in sys.modules, '--help imported jax'\n"
          "print('ok')\n")
  r = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stdout + r.stderr
  assert r.stderr == "", r.stderr  # libtpu's "Failed to find host bounds" block, for one


@pytest.mark.slow
def test_commands_on_shapes_start_only_the_cpu_backend():
  code = ("from zerojax.tools import cli\n"
          "import contextlib, io\n"
          "with contextlib.redirect_stdout(io.StringIO()):\n"
          "  assert cli.main(['plan', '--model', 'tiny', '--devices', '8']) == 0\n"
          "import jax\n"
          "print(sorted({d.platform for d in jax.devices()}), jax.device_count())\n")
  r = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip() == "['cpu'] 8", r.stdout
  assert "host bounds" not in r.stderr and "TPU" not in r.stderr, r.stderr


# -- 8. one tokens/s ----------------------------------------------------------------------------


def test_throughput_is_one_definition_for_bar_summary_and_records(capsys):
  from zerojax.tools import train as zt
  recs = [{"step": 1, "loss": 5.0, "tokens_per_sec": None, "elapsed_sec": 100.0},
          {"step": 2, "loss": 4.0, "tokens_per_sec": 1000.0, "elapsed_sec": 101.0},
          {"step": 3, "loss": 3.0, "tokens_per_sec": 10000.0, "elapsed_sec": 101.1}]
  # 2 steps of 1000 tokens in 1.1 s after step 1 finished; a single step: its own time
  assert zt.throughput(recs, 1000) == pytest.approx(2000 / 1.1)
  assert zt.throughput(recs[1:], 1000) == pytest.approx(recs[2]["tokens_per_sec"])
  assert zt.throughput(recs[:1], 1000) is None
  bar = zt.ProgressBar(3, 0, tokens_per_step=1000)
  bar.on_records(recs[:2], 0)
  bar.on_records(recs[2:], 2)
  assert bar.bar.postfix.endswith(f"tok_s={2000 / 1.1:,.0f}"), bar.bar.postfix
  bar.close()


@pytest.mark.slow
def test_train_bar_and_summary_print_the_same_tokens_per_sec(tmp_path, capsys):
  from zerojax.core.config import ZeroConfig
  from zerojax.tools import train as zt
  zt.train(ZeroConfig(stage=2), zt.TrainOptions(
      model="tiny", seq_len=32, steps=6, batch=8, log_every=2, out_dir=str(tmp_path),
      progress=True, show_plan=False, plot=False, tensorboard=False))
  out = capsys.readouterr().out
  bar = re.findall(r"tok_s=([\d,]+)", out)
  summary = re.search(r"([\d,]+) tokens/s after the first step", out)
  assert bar and summary, out[-2000:]
  assert bar[-1] == summary.group(1), (bar, summary.group(0))


# -- 9. the estimate's stage-3 peak --------------------------------------------------------------


def test_estimate_title_says_what_stays_replicated(capsys):
  assert cli.main(["estimate", "--model", "tiny", "--devices", "8"]) == 0
  out = capsys.readouterr().out
  assert "below 0 elements" not in out
  assert "every leaf with a dimension divisible by 8 is sharded" in out
  assert cli.main(["estimate", "--model", "tiny", "--devices", "8",
                   "param_persistence_threshold=4096"]) == 0
  assert "leaves below param_persistence_threshold=4,096 elements" in capsys.readouterr().out


def test_recommend_compiled_shows_which_formulation_gave_the_peak():
  from zerojax.tools.estimate import Option, recommend_compiled
  o = Option("stage 3", 3, False, False, 1e6, 1e6, 1e6, 0, "3Ψ", 3)
  best, why, peaks = recommend_compiled([o], 1e9, lambda _: (5e8, "gather=explicit"))
  assert best is o and peaks == {"stage 3": 5e8}
  assert "peak 500.0 MB per device (XLA, gather=explicit) fits" in why[0]


@pytest.mark.slow
def test_estimate_stage3_peak_is_not_above_stage2(capsys):
  # gpt-89m's LM head (vocabulary 50257, divisible by no device count) is sharded along its
  # contracting dimension; XLA:CPU's partitioner then gives every device whole-batch logits
  # (723.9 MB at stage 3 against stage 2's 689.6 MB). Per-use gathering needs 537.6 MB.
  rc = cli.main(["estimate", "--model", "gpt-89m", "--devices", "8", "--fit", "500MB"])
  out = capsys.readouterr().out
  peak = {m.group(1): float(m.group(2)) for m in re.finditer(
      r"^  (stage \d[^:]*): .*compiled step peak ([\d.]+) MB", out, re.M)}
  assert peak["stage 3"] <= peak["stage 2"], out
  assert "gather=explicit" in out.split("recommendation:")[1], out
  assert rc == 0


# -- 10. models with no or integer parameters ----------------------------------------------------


class _NoParams(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x * 2


class _IntParam(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(), (x.shape[-1], 8))
    n = self.param("count", lambda *_: jnp.zeros((), jnp.int32))
    return x @ w + n


@pytest.mark.parametrize("model, error, match", [
    (_NoParams(), ValueError, r"_NoParams\.init\(\.\.\.\) made no parameters"),
    (_IntParam(), TypeError, r"\['count'\] \(int32\[\]\) .*not floating point"),
])
def test_create_train_state_names_what_it_cannot_train(model, error, match):
  cfg = zerojax.ZeroConfig(stage=3)
  with pytest.raises(error, match=match):
    zerojax.create_train_state(model, optax.adamw(1e-3), jax.random.key(0),
                               jnp.zeros((8, 16)), config=cfg)


# -- 11. a misspelled DeepSpeed key -------------------------------------------------------------


@pytest.mark.parametrize("d, match", [
    ({"zero_optimisation": {"stage": 2}, "train_batch_size": 8},
     r"'zero_optimisation' is not a zerojax setting; did you mean DeepSpeed's "
     r"'zero_optimization'\?"),
    ({"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}},
     r"'bf16', 'optimizer' are DeepSpeed keys, but this file has no top-level "
     r"'zero_optimization'"),
    ({"stgae": 2}, r"ZeroConfig has no field 'stgae' \(did you mean 'stage'\?\)"),
])
def test_deepspeed_lookalike_files_get_the_deepspeed_key(tmp_path, d, match):
  p = tmp_path / "c.json"
  p.write_text(json.dumps(d))
  with pytest.raises(ConfigError, match=match):
    zerojax.load_config(p, apply_xla_flags=False)


# -- 12. one exit-status convention -------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["train", "/no/such.json"], ["plan", "/no/such.json"], ["config", "/no/such.json"],
    ["estimate", "--model", "tiny", "/no/such.json"],
    ["compile", "/no/such.json", "--batch", "8", "--seq", "8", "--topology", "v5e:2x4"],
    ["export", "/no/such/checkpoint", "out.npz"],
])
def test_a_missing_file_exits_2_in_every_command(argv, capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert f"zerojax {argv[0]}: error:" in err and "/no/such" in err


def test_a_missing_init_from_exits_2_before_training(capsys, tmp_path):
  rc = cli.main(["train", "model=tiny", "steps=1", "init_from=/no/such.npz",
                 f"out_dir={tmp_path}", "--no-progress"])
  assert rc == 2
  assert "TrainOptions.init_from='/no/such.npz' does not exist" in capsys.readouterr().err


def test_readme_documents_the_exit_statuses():
  section = README[README.index("\n## Command line\n"):]
  section = section[:section.index("\n## ", 1)]
  assert "Exit status" in section
  for code in ("0", "1", "2"):
    assert re.search(rf"`{code}`", section), code
