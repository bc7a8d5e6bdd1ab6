"""Fine-tuning what users bring (#27 items 2-5): segment-aware attention, the checkpoint's own
tokenizer and chat template, local data files (packed or padded, loss masks, per-process rows,
resumable), and ``zerojax finetune``."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import helpers
from zerojax.models import llama


def test_packed_segments_equal_separate_documents():
  """A row packing two documents (segment ids) gives each document the logits it has alone:
  attention stays within a document and positions restart at its start."""
  cfg = llama.LlamaConfig(model_type="qwen2", qkv_bias=True, vocab_size=50)
  model = llama.Llama(cfg, nnx.Rngs(3))
  rs = np.random.RandomState(0)
  a, b = rs.randint(0, 50, (1, 5)), rs.randint(0, 50, (1, 7))
  packed = jnp.asarray(np.concatenate([a, b], axis=1))
  seg = jnp.asarray([[1] * 5 + [2] * 7])
  np.testing.assert_array_equal(llama.segment_positions(seg), [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4,
                                                                5, 6]])
  fwd = nnx.jit(lambda m, t, s: m(t, segment_ids=s))  # one shape: one compile
  alone = np.zeros((2, 12), np.int32)  # each document alone at the start of a row (causal:
  alone[0, :5], alone[1, :7] = a[0], b[0]  # what follows it does not matter)
  out = np.asarray(fwd(model, jnp.concatenate([packed, jnp.asarray(alone), packed]),
                       jnp.concatenate([seg, jnp.ones((3, 12), jnp.int32)])))
  np.testing.assert_allclose(out[0, :5], out[1, :5], atol=1e-5)
  np.testing.assert_allclose(out[0, 5:], out[2, :7], atol=1e-5)
  # as one segment, the second document would see the first
  assert np.abs(out[3, 5:] - out[0, 5:]).max() > 1e-3


# -- the checkpoint's tokenizer and the user's data --------------------------------------------

from zerojax.tools import hf_data  # noqa: E402

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "the cat sat"}, {"role": "user", "content": "a dog"},
        {"role": "assistant", "content": "ran in the park"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  from tests.core.test_hf_families import make_tokenizer
  d = tmp_path_factory.mktemp("tok")
  make_tokenizer(d)
  return d


def test_tokenizer_is_the_checkpoints_own(tok_dir):
  import transformers
  ref = transformers.AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
  tok = hf_data.load_tokenizer(tok_dir)
  text = "the cat sat on the mat, hello zerojax"
  assert tok.encode(text)[0] == ref(text)["input_ids"]
  assert tok.eos_id == ref.eos_token_id and tok.pad_id == ref.pad_token_id
  rendered = tok.render_chat(CHAT)
  assert rendered == ref.apply_chat_template(CHAT, tokenize=False)
  ids, mask = hf_data._chat_ids(tok, CHAT, "t")
  assert ids == ref.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
  # the loss covers the assistant's turns (with their closing tokens), nothing else
  learned = tok.decode([i for i, m in zip(ids, mask) if m])
  assert "the cat sat" in learned and "ran in the park" in learned
  assert "hello" not in learned and "be brief" not in learned and "dog" not in learned


def test_tokenizer_without_template_refuses_chat_by_name(tmp_path, tok_dir):
  import shutil
  shutil.copy(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
  tok = hf_data.load_tokenizer(tmp_path)
  with pytest.raises(ValueError, match="no chat_template"):
    tok.render_chat(CHAT)


def test_documents_from_jsonl_parquet_and_text(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n"
                                    + json.dumps({"messages": CHAT}) + "\n")
  assert hf_data.read_documents(tmp_path / "a.jsonl") == [{"text": "one"}, {"messages": CHAT}]
  pq.write_table(pa.table({"messages": [CHAT, CHAT[:3]]}), tmp_path / "b.parquet")
  assert hf_data.read_documents(tmp_path / "b.parquet")[1] == {"messages": CHAT[:3]}
  (tmp_path / "c.txt").write_text("first doc\nline two\n\nsecond\n")
  assert hf_data.read_documents(tmp_path / "c.txt") == [{"text": "first doc\nline two"},
                                                         {"text": "second"}]
  (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:1: .*'text'.*'messages'.*\['prompt'\]"):
    hf_data.read_documents(tmp_path / "bad.jsonl")
  (tmp_path / "bad2.jsonl").write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
  with pytest.raises(ValueError, match=r"messages\[0\]"):
    hf_data.read_documents(tmp_path / "bad2.jsonl")
  with pytest.raises(ValueError, match=r"'.csv' is not read; allowed are .jsonl"):
    (tmp_path / "d.csv").write_text("x")
    hf_data.read_documents(tmp_path / "d.csv")


def test_pack_and_pad_rows():
  docs = [(np.arange(1, 6, dtype=np.int32), np.ones(5, np.int32)),
          (np.arange(10, 14, dtype=np.int32), np.asarray([0, 0, 1, 1], np.int32))]
  r = hf_data.pack(docs, 4, pad_id=0)  # 4 + 3 pairs -> 2 rows, one padded slot
  np.testing.assert_array_equal(r.x, [[1, 2, 3, 4], [10, 11, 12, 0]])
  np.testing.assert_array_equal(r.y, [[2, 3, 4, 5], [11, 12, 13, 0]])
  np.testing.assert_array_equal(r.mask, [[1, 1, 1, 1], [0, 1, 1, 0]])
  np.testing.assert_array_equal(r.segment_ids, [[1, 1, 1, 1], [1, 1, 1, 0]])
  np.testing.assert_array_equal(r.positions, [[0, 1, 2, 3], [0, 1, 2, 0]])
  r = hf_data.pack(docs, 6, pad_id=0)  # the second document continues in row 2
  np.testing.assert_array_equal(r.segment_ids, [[1, 1, 1, 1, 2, 2], [1, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(r.positions, [[0, 1, 2, 3, 0, 1], [2, 0, 0, 0, 0, 0]])
  p = hf_data.pad(docs, 3, pad_id=0)
  assert p.truncated == 1
  np.testing.assert_array_equal(p.x, [[1, 2, 3], [10, 11, 12]])
  np.testing.assert_array_equal(p.mask, [[1, 1, 1], [0, 1, 1]])


def test_batches_resume_at_the_exact_position_and_cover_every_row():
  rows = hf_data.pack([(np.arange(50, dtype=np.int32), np.ones(50, np.int32))], 7, 0)
  a = hf_data.Batches(rows, 3, seed=1)
  seen = [next(a) for _ in range(6)]
  b = hf_data.Batches(rows, 3, seed=1, step=4)  # a restart at step 4
  for want in seen[4:]:
    got = next(b)
    for k in hf_data.FIELDS:
      np.testing.assert_array_equal(got[k], want[k])
  first_epoch = np.concatenate([s["x"][:, 0] for s in seen[:2]] + [seen[2]["x"][:1, 0]])
  assert sorted(first_epoch.tolist()) == sorted(rows.x[:, 0].tolist())  # each row once
  evals = hf_data.eval_batches(rows, 3)
  assert len(evals) == 3 and evals[-1]["mask"][1:].sum() == 0


# -- zerojax finetune ---------------------------------------------------------------------------

HF_TRAINER_DS = {  # as the Hugging Face Trainer's docs write a ZeRO-3 config
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
                          "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True},
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"}}


def make_chat_jsonl(path, n, seed=0):
  import random
  rs = random.Random(seed)
  words = "the cat sat on a mat dog ran in park hello world".split()
  with open(path, "w") as f:
    for _ in range(n):
      q = " ".join(rs.choice(words) for _ in range(4))
      f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                       {"role": "assistant", "content": "the " + q.split()[0]
                                        + " sat on the mat"}]}) + "\n")


def make_base(d, records, eval_records=0, dtype=None):
  """The fine-tuning tests' base checkpoint in ``d``: a tiny tied Qwen2 (seed 5, vocabulary
  300), stored in ``dtype`` (a torch dtype; float32 by default), its tokenizer, and
  ``records`` chat records in train.jsonl (and ``eval_records`` in eval.jsonl)."""
  from tests.core.test_hf_families import make_hf, make_tokenizer
  m = make_hf("qwen2", seed=5, tie_word_embeddings=True, vocab_size=300, bos_token_id=1,
              eos_token_id=0, pad_token_id=0)
  (m if dtype is None else m.to(dtype)).save_pretrained(d)
  make_tokenizer(d)
  make_chat_jsonl(d / "train.jsonl", records)
  if eval_records:
    make_chat_jsonl(d / "eval.jsonl", eval_records, seed=1)
  return d


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  return make_base(tmp_path_factory.mktemp("base"), 200, eval_records=20)


def test_finetune_bad_input_is_named(base_dir, tmp_path, capsys):
  from zerojax.tools.cli import main
  assert main(["finetune", str(base_dir)]) == 2
  assert "needs --data FILE" in capsys.readouterr().err
  assert main(["finetune", str(tmp_path), "--data", str(base_dir / "train.jsonl")]) == 2
  assert f"model_dir={str(tmp_path)!r} is not a Hugging Face checkpoint" in \
      capsys.readouterr().err
  assert main(["finetune", str(base_dir), "--data", str(tmp_path / "no.jsonl")]) == 2
  assert "--data" in capsys.readouterr().err


def test_finetune_hf_trainer_deepspeed_config_with_lora(base_dir, tmp_path, capsys,
                                                        monkeypatch):
  """A DeepSpeed config as an HF Trainer run writes it (ZeRO-3 with CPU offload): every
  "auto" takes the command's settings (or the fine-tuning defaults); LoRA trains; the
  evaluation reads the offloaded parameters; eval metrics are recorded."""
  import os
  from zerojax.tools.cli import main
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored afterwards
  (tmp_path / "ds.json").write_text(json.dumps(HF_TRAINER_DS))
  out = tmp_path / "run"
  rc = main(["finetune", str(base_dir), str(tmp_path / "ds.json"), "--data",
             str(base_dir / "train.jsonl"), "--eval-data", str(base_dir / "eval.jsonl"),
             "--lora", "4", "--no-export", "--no-progress", "steps=2", "seq_len=48", "batch=8",
             f"out_dir={out}", "show_plan=false", "plot=false"])
  assert rc == 0, capsys.readouterr().err
  run = json.loads((out / "run.json").read_text())
  assert run["config"]["stage"] == 3 and run["config"]["train_batch_size"] == 8
  assert run["config"]["offload_params"] and run["config"]["offload_optimizer"]
  assert run["config"]["gradient_clipping"] == 1.0  # the HF Trainer's max_grad_norm
  # "auto" is the HF Trainer's learning_rate and weight_decay (#51), as in zerojax train
  assert run["options"]["lr"] == 5e-5 and run["options"]["weight_decay"] == 0.0
  assert run["options"]["scheduler"]["total_num_steps"] == 2
  recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in recs] == [1, 2]
  assert all(np.isfinite(r["eval_loss"]) and r["eval_ppl"] == pytest.approx(
      np.exp(r["eval_loss"])) for r in recs)
  assert (out / "ckpt").is_dir() and not (out / "hf").exists()
  # resuming it on another data file would mix two runs: refused, naming what changed
  capsys.readouterr()
  rc = main(["finetune", str(base_dir), str(tmp_path / "ds.json"), "--data",
             str(base_dir / "eval.jsonl"), "--lora", "4", "--no-export", "--no-progress",
             "steps=3", "seq_len=48", "batch=8", f"out_dir={out}"])
  err = capsys.readouterr().err
  assert rc == 2 and "corpus" in err and "eval.jsonl" in err and "--overwrite" in err, err


# -- the optimizer state on NVMe (ZeRO-Infinity) --------------------------------------------

NVME_RUN = ["steps=4", "seq_len=48", "batch=8", "lr=3e-3", "checkpoint_every=2", "log_every=1",
            "show_plan=false", "plot=false"]


@pytest.mark.slow
def test_finetune_nvme_equals_in_memory_and_resumes_from_its_snapshot(base_dir, tmp_path):
  """``zerojax finetune`` with ``offload_optimizer=nvme``: the same losses and parameters as in
  memory; each checkpoint gets its optimizer-state snapshot; a run stopped after step 3 resumes
  from checkpoint 2 (its snapshot made the committed state again) and ends bit-identical."""
  from zerojax.tools import finetune as ft
  from zerojax.tools import train as zt
  fo = ft.FinetuneOptions(model_dir=str(base_dir), data=str(base_dir / "train.jsonl"),
                          export=False)

  def nvme(path):
    path.mkdir(parents=True, exist_ok=True)
    return ["offload_optimizer=nvme", f"nvme_path={path}", "nvme_chunk_size=20000",
            "nvme_buffer_count=3"]

  def bits(result):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(nnx.state(result.state[0]))]

  keys = ("step", "loss", "grad_norm")
  memory = ft.finetune(fo, None, NVME_RUN + [f"out_dir={tmp_path / 'memory'}"],
                       progress=False)["result"]
  whole = ft.finetune(fo, None, NVME_RUN + nvme(tmp_path / "nv1")
                      + [f"out_dir={tmp_path / 'whole'}"], progress=False)["result"]
  assert [[h[k] for k in keys] for h in whole.history] == [
      [h[k] for k in keys] for h in memory.history]
  assert bits(whole) == bits(memory)
  assert whole.plan.nvme is not None and whole.plan.nvme.store.step == 4
  assert all(h["nvme_read_mb_s"] > 0 for h in whole.history)
  assert sorted(os.listdir(tmp_path / "whole" / "ckpt")) == ["2", "4", "nvme-2", "nvme-4"]

  class Stop(zt.Hook):
    def after_step(self, step, state, flush):
      if step == 3:  # after checkpoint 2; the files have moved on to step 3
        raise KeyboardInterrupt("stopped at step 3")

  args = NVME_RUN + nvme(tmp_path / "nv2") + [f"out_dir={tmp_path / 'run'}"]
  with pytest.raises(KeyboardInterrupt):
    ft.finetune(fo, None, args, progress=False, hooks=[Stop()])
  resumed = ft.finetune(fo, None, args, progress=False)["result"]
  assert json.loads((tmp_path / "run" / "run.json").read_text())["resumed_from"] == [2]
  lines = zt.read_jsonl(tmp_path / "run" / "metrics.jsonl")
  assert [[r[k] for k in keys] for r in lines] == [[h[k] for k in keys] for h in whole.history]
  assert bits(resumed) == bits(whole)


# -- end to end (slow): 20 steps at stage 3, killed and resumed, exported, generates alike ------

_KILLED_CHILD = """
import os, signal, sys
from zerojax.tools import finetune as ft, train as zt

class Kill(zt.Hook):
  def after_step(self, step, state, flush):
    if step == 13:  # after the checkpoint of step 10, before the next one
      os.kill(os.getpid(), signal.SIGKILL)

model_dir, out = sys.argv[1], sys.argv[2]
fo = ft.FinetuneOptions(model_dir=model_dir, data=model_dir + "/train.jsonl",
                        eval_data=model_dir + "/eval.jsonl", eval_every=5)
ft.finetune(fo, None, sys.argv[3:] + ["out_dir=" + out], progress=False, hooks=[Kill()])
"""

E2E = ["steps=20", "seq_len=64", "batch=8", "lr=3e-3", "checkpoint_every=5", "log_every=1",
       "show_plan=false", "plot=false"]


@pytest.mark.slow
def test_finetune_end_to_end_kill_resume_export_generate(base_dir, tmp_path):
  import subprocess
  import sys
  import torch
  import transformers
  from zerojax.tools import finetune as ft
  from zerojax.tools.hf_data import load_tokenizer
  assert jax.device_count() == 8
  fo = ft.FinetuneOptions(model_dir=str(base_dir), data=str(base_dir / "train.jsonl"),
                          eval_data=str(base_dir / "eval.jsonl"), eval_every=5)
  whole = ft.finetune(fo, None, E2E + [f"out_dir={tmp_path / 'whole'}"], progress=False)
  recs = whole["result"].history
  evals = [r["eval_loss"] for r in recs if r.get("eval_loss") is not None]
  assert [r["step"] for r in recs if r.get("eval_loss") is not None] == [1, 5, 10, 15, 20]
  assert evals[-1] < evals[0] - 0.5, evals  # the eval loss falls
  assert json.loads((tmp_path / "whole" / "run.json").read_text())["config"]["stage"] == 3

  # the same run, killed (SIGKILL) at step 13 and run again: it resumes from its newest
  # complete checkpoint and ends as the uninterrupted run did
  out = tmp_path / "killed"
  env = helpers.child_env(8, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", _KILLED_CHILD, str(base_dir), str(out)] + E2E,
                     env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == -9, r.stderr[-3000:]
  resumed = ft.finetune(fo, None, E2E + [f"out_dir={out}"], progress=False)
  again = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  keys = ("step", "loss", "grad_norm", "eval_loss")
  assert [[x.get(k) for k in keys] for x in again] == [[x.get(k) for k in keys] for x in recs]
  # (step 10's save is asynchronous: the kill may come before it is committed)
  assert json.loads((out / "run.json").read_text())["resumed_from"] in ([10], [5])

  # the export generates transformers' greedy tokens as zerojax's own model does
  info = resumed["export"]
  assert info["path"] == str(out / "hf") and (out / "hf" / "tokenizer.json").exists()
  tok = load_tokenizer(out / "hf")
  prompt = tok.encode(tok.render_chat([{"role": "user", "content": "the cat sat on"}]),
                      special=False)[0]
  model = resumed["result"].state[0]
  graphdef, state = nnx.split(model)
  state = jax.device_get(state)
  fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  n = 8
  toks = np.zeros((1, len(prompt) + n), np.int32)
  toks[0, :len(prompt)] = prompt
  for t in range(len(prompt), len(prompt) + n):
    toks[0, t] = int(np.argmax(np.asarray(fwd(state, toks))[0, t - 1]))
  ours = toks[0, len(prompt):].tolist()
  hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").float().eval()
  with torch.no_grad():
    gen = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
  got = gen[0, len(prompt):].tolist()  # (transformers stops early at an EOS)
  assert got and got == ours[:len(got)], (got, ours)
