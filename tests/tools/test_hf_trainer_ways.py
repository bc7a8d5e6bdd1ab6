"""Fine-tuning the way Hugging Face users do (#51): bf16/fp16 checkpoints, LoRA with gradient
accumulation, DeepSpeed "auto" as the Trainer's defaults, chat templates rendered as
transformers renders them, and ShareGPT data."""

import zerojax
import json
import re
import os
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

# The reference implementation (test extra, Python 3.11's CPU torch); skipped where absent.
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import zerojax  # noqa: E402
from tests.tools.test_hf_finetune import make_base  # noqa: E402
from zerojax.models import llama  # noqa: E402
from zerojax.runtime import weights  # noqa: E402

RUN = ["--no-export", "--no-progress", "steps=1", "seq_len=32", "batch=8", "show_plan=false",
       "plot=false"]


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
  return make_base(tmp_path_factory.mktemp("bf16"), 40, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory):
  return make_base(tmp_path_factory.mktemp("fp32"), 40, dtype=torch.float32)


# -- 1. bf16 and fp16 checkpoints -------------------------------------------------------------


def _stored_dtypes(d):
  return {v[2] for v in weights.checkpoint_index(d).values()}


@pytest.mark.parametrize("ckpt, overrides, want", [
    ("bfloat16", [], "float32"),
    pytest.param("bfloat16", ["param_dtype=bfloat16", "compute_dtype=bfloat16"], "bfloat16",
                 marks=pytest.mark.slow),
    pytest.param("float16", ["compute_dtype=bfloat16"], "float32", marks=pytest.mark.slow),
])
def test_half_precision_checkpoints_finetune_cast_to_param_dtype(tmp_path_factory, ckpt,
                                                                overrides, want, capsys):
  """A bf16 or fp16 Hub checkpoint trains: each leaf is read in param_dtype, its values the
  stored ones (cast exactly: every bf16/fp16 value is a float32 value)."""
  from zerojax.tools import finetune as ft
  from zerojax.tools.cli import main
  d = make_base(tmp_path_factory.mktemp(ckpt), 40, dtype=getattr(torch, ckpt))
  assert _stored_dtypes(d) == {ckpt}
  out = tmp_path_factory.mktemp("run")
  rc = main(["finetune", str(d), "--data", str(d / "train.jsonl"), *RUN, f"out_dir={out}",
             *overrides])
  assert rc == 0, capsys.readouterr().err
  # the values: the task's setup reads the checkpoint into the plan's shards in param_dtype
  opts = ft.TrainOptions(steps=1, batch=8, seq_len=32)
  config = zerojax.ZeroConfig.from_flat(
      {"stage": 3, **dict(o.split("=") for o in overrides)})
  fo = ft.FinetuneOptions(model_dir=str(d), data=str(d / "train.jsonl"))
  task = ft.finetune_task(fo, opts, config)
  (model, _), _, _, _ = task.setup(config, zerojax.make_mesh(config), optax.adamw(0.0), None,
                                   None)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert {np.dtype(x.dtype).name for x in jax.tree.leaves(params)} == {want}
  from safetensors.numpy import load_file
  stored = load_file(str(d / "model.safetensors"))
  np.testing.assert_array_equal(np.asarray(params["norm"]["scale"], np.float32),
                                stored["model.norm.weight"].astype(np.float32))
  emb = np.asarray(params["embed_tokens"]["embedding"], np.float32)
  np.testing.assert_array_equal(emb, stored["model.embed_tokens.weight"].astype(np.float32))


def _big_checkpoint(path, dtype):
  """A Llama-layout checkpoint big enough that the load's memory is its shards, not noise."""
  from safetensors.numpy import save_file
  cfg = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, rope_theta=500.0, model_type="llama",
             tie_word_embeddings=False)
  rs = np.random.RandomState(0)
  d, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
            "lm_head.weight": (v, d)}
  for n in range(2):
    p = f"model.layers.{n}."
    shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (d // 2, d),
                   p + "self_attn.v_proj.weight": (d // 2, d), p + "self_attn.o_proj.weight": (d, d),
                   p + "mlp.gate_proj.weight": (i, d), p + "mlp.up_proj.weight": (i, d),
                   p + "mlp.down_proj.weight": (d, i)})
  path.mkdir()
  save_file({k: rs.standard_normal(s).astype(dtype) for k, s in shapes.items()},
            str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps(cfg))
  return path


@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_half_precision_load_stays_within_its_shards(tmp_path, monkeypatch, param_dtype):
  """Cast as read: the host memory of loading a bf16 checkpoint into param_dtype stays within
  1.2 x the parameters' bytes in param_dtype / processes (here 1 process holds all 8 devices'
  shards): no tensor is ever held whole in both dtypes."""
  d = _big_checkpoint(tmp_path / "ckpt", ml_dtypes.bfloat16)
  ckpt_bytes = (d / "model.safetensors").stat().st_size
  monkeypatch.setattr(weights, "_BLOCK_BYTES", 64 << 10)  # blocks small beside the shards
  cfg = llama.from_hf_config(d, param_dtype=jnp.dtype(param_dtype))
  config = zerojax.ZeroConfig(stage=3, precision=zerojax.Precision(param=param_dtype))
  plan = zerojax.ShardingPlan.create(config, zerojax.make_mesh(config), nnx.state(
      nnx.eval_shape(lambda: llama.Llama(cfg, nnx.Rngs(0))), nnx.Param))
  loaded = sum(int(np.prod(lp.shape)) * np.dtype(lp.dtype).itemsize for lp in plan.leaves)
  assert loaded == pytest.approx(ckpt_bytes * np.dtype(param_dtype).itemsize / 2, rel=0.01)
  tracemalloc.start()
  try:
    tree = weights.load_safetensors(d, plan, llama.hf_mapping(cfg), cast=True)
    jax.block_until_ready(tree)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  print(f"load peak {peak / loaded:.3f} x the shards ({loaded:,} bytes)")
  assert peak <= 1.2 * loaded / jax.process_count(), (peak, loaded)
  assert {np.dtype(x.dtype).name for x in jax.tree.leaves(tree)} == {param_dtype}


# -- 2. LoRA with gradient accumulation and loss scaling ---------------------------------------


def _lora_losses(d, out, *overrides):
  from zerojax.tools import finetune as ft
  fo = ft.FinetuneOptions(model_dir=str(d), data=str(d / "train.jsonl"), lora=4, export=False)
  got = ft.finetune(fo, None, ["steps=3", "seq_len=32", "batch=16", "lr=1e-2", "log_every=1",
                               "show_plan=false", "plot=false", f"out_dir={out}",
                               *overrides], progress=False)
  return [r["loss"] for r in got["result"].history], [r["grad_norm"] for r in
                                                       got["result"].history]


@pytest.mark.slow
def test_lora_with_gradient_accumulation_equals_the_full_batch(fp32_dir, tmp_path):
  """The standard HF LoRA recipe (adapters + gradient_accumulation_steps) trains, and each
  step's loss and gradient norm are the full batch's to float rounding."""
  full, gn_full = _lora_losses(fp32_dir, tmp_path / "full")
  acc, gn_acc = _lora_losses(fp32_dir, tmp_path / "acc", "gradient_accumulation_steps=2")
  assert len(full) == 3 and full[-1] < full[0]  # the adapters learn
  print(f"LoRA accumulation: loss rel diff {np.max(np.abs(np.subtract(acc, full)) / full):.2e}, "
        f"grad norm {np.max(np.abs(np.subtract(gn_acc, gn_full)) / gn_full):.2e}")
  np.testing.assert_allclose(acc, full, rtol=2e-6)
  np.testing.assert_allclose(gn_acc, gn_full, rtol=2e-5)


@pytest.mark.slow
def test_lora_gradient_with_accumulation_and_loss_scale_equals_the_full_batch(fp32_dir):
  """`zerojax.value_and_grad(wrt=nnx.LoRAParam)`: the adapters' gradient only, the same with 2
  micro-batches and a static loss scale as from the full batch."""
  cfg = llama.from_hf_config(fp32_dir, lora_rank=4, lora_targets=("q_proj", "v_proj"))
  rs = np.random.RandomState(0)
  x = jnp.asarray(rs.randint(0, 300, (16, 12)), jnp.int32)

  def loss_of(model, x):
    logits = model(x[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

  out = {}
  for name, accumulate, scale in (("nnx", 1, None), ("full", 1, None), ("acc", 2, None),
                                  ("acc_scaled", 2, 2.0**12)):
    config = zerojax.ZeroConfig(stage=3, batch=zerojax.Batch(accumulation_steps=accumulate))
    model, opt, plan = zerojax.create_nnx(lambda: llama.Llama(cfg, nnx.Rngs(0)), optax.sgd(0.1),
                                          config=config, wrt=nnx.LoRAParam)
    # non-zero adapters, so every adapter leaf has a gradient
    for _, v in nnx.iter_graph(model):
      if isinstance(v, nnx.LoRAParam):
        v[...] = v[...] + 0.05

    @zerojax.zero_step(plan)
    def step(model, opt, x):
      if name == "nnx":  # flax's own, as a reference
        return nnx.value_and_grad(loss_of, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, x)
      return zerojax.value_and_grad(loss_of, wrt=nnx.LoRAParam, loss_scale=scale)(model, x)

    out[name] = jax.device_get(step(model, opt, x))
  loss, grads = out["full"]
  assert jax.tree.leaves(grads) and all(p[-1].key in ("lora_a", "lora_b") for p, _ in
             jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0])
  for name in ("nnx", "acc", "acc_scaled"):
    np.testing.assert_allclose(out[name][0], loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(out[name][1]), jax.tree.leaves(grads)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)


# -- 3. DeepSpeed "auto" is the HF Trainer's TrainingArguments default -------------------------

# transformers.TrainingArguments' defaults (written here, not read from transformers): the
# values its DeepSpeed integration puts in place of each "auto" when the run sets nothing.
TRAINER = {"learning_rate": 5e-5, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
           "adam_epsilon": 1e-8, "max_grad_norm": 1.0, "lr_scheduler_type": "linear",
           "warmup_steps": 0, "per_device_train_batch_size": 8,
           "gradient_accumulation_steps": 1, "bf16": False, "fp16": False}

HF_DS = {  # every key the HF DeepSpeed integration fills, as "auto"
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3}}

# each "auto" key -> the TrainingArguments fields its note names as its source
SOURCES = {"optimizer.params.lr": ["learning_rate=5e-05"],
           "optimizer.params.betas": ["adam_beta1=0.9", "adam_beta2=0.999"],
           "optimizer.params.eps": ["adam_epsilon=1e-08"],
           "optimizer.params.weight_decay": ["weight_decay=0.0"],
           "gradient_clipping": ["max_grad_norm=1.0"],
           "scheduler.params.warmup_num_steps": ["warmup_steps=0"],
           "train_micro_batch_size_per_gpu": ["per_device_train_batch_size=8"],
           "gradient_accumulation_steps": ["gradient_accumulation_steps=1"],
           "bf16.enabled": ["bf16=False"], "fp16.enabled": ["fp16=False"]}


def _check_trainer_defaults(loaded):
  from zerojax.tools import train as zt
  opts = zt.TrainOptions(**loaded.train)
  c = loaded.config
  assert opts.lr == TRAINER["learning_rate"] and opts.weight_decay == TRAINER["weight_decay"]
  assert (opts.b1, opts.b2, opts.eps) == (TRAINER["adam_beta1"], TRAINER["adam_beta2"],
                                          TRAINER["adam_epsilon"])
  assert c.gradient_clipping == TRAINER["max_grad_norm"]
  assert c.compute_dtype == "float32" and c.loss_scale is None  # neither bf16 nor fp16
  assert c.micro_batch_per_device == TRAINER["per_device_train_batch_size"]
  assert c.gradient_accumulation_steps == TRAINER["gradient_accumulation_steps"]
  s = opts.scheduler
  assert (s["warmup_min_lr"], s["warmup_num_steps"], s["warmup_max_lr"]) == (
      0.0, TRAINER["warmup_steps"], TRAINER["learning_rate"])
  # the Trainer's "linear": from the peak straight down to 0 at the last step
  _, sched = zt.make_optimizer(opts)
  n = s["total_num_steps"]
  assert float(sched(0)) == pytest.approx(5e-5)
  assert float(sched(n // 2)) == pytest.approx(5e-5 * (1 - (n // 2) / n), rel=1e-3)
  notes = {n.split(":")[0]: n for n in loaded.notes if "'auto' ->" in n}
  for key, fields in SOURCES.items():
    for f in fields:
      assert "auto: Trainer default" in notes[key] and f in notes[key], (key, notes.get(key))


def test_auto_is_the_trainers_default_in_train(tmp_path):
  p = tmp_path / "ds.json"
  p.write_text(json.dumps(HF_DS))
  loaded = zerojax.load_config(p, apply_xla_flags=False)  # as `zerojax train` loads it
  _check_trainer_defaults(loaded)
  # a value the run gives wins, and says so
  loaded = zerojax.load_config(p, ["lr=1e-3", "b2=0.95"], apply_xla_flags=False)
  assert loaded.train["lr"] == 1e-3
  assert "(lr=0.001, given)" in "\n".join(loaded.notes)


def test_auto_is_the_trainers_default_in_finetune(fp32_dir, tmp_path, capsys):
  from zerojax.tools import finetune as ft
  from zerojax.tools.cli import main
  p = tmp_path / "ds.json"
  p.write_text(json.dumps(HF_DS))
  for lora in (0, 4):  # not the fine-tuning defaults (1e-5, 2e-4 with LoRA)
    fo = ft.FinetuneOptions(model_dir=str(fp32_dir), data=str(fp32_dir / "train.jsonl"),
                            lora=lora)
    _check_trainer_defaults(ft._load_with_defaults(fo, str(p), []))
  # printed, each with its source, in the command's log
  rc = main(["finetune", str(fp32_dir), str(p), "--data", str(fp32_dir / "train.jsonl"),
             "--no-export", "--no-progress", "steps=1", "seq_len=32", "batch=8",
             f"out_dir={tmp_path / 'run'}", "show_plan=false", "plot=false"])
  out = capsys.readouterr().out
  assert rc == 0
  assert ("DeepSpeed optimizer.params.betas: 'auto' -> [0.9, 0.999] (auto: Trainer default "
          "adam_beta1=0.9, adam_beta2=0.999") in out
  assert "DeepSpeed bf16.enabled: 'auto' -> False (auto: Trainer default bf16=False" in out


# DeepSpeed's own fp16 defaults (written here): the Trainer fills none of these keys, so an
# "auto" there gets what DeepSpeed would use.
DS_FP16 = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
           "hysteresis": 2, "min_loss_scale": 1}


def test_fp16_loss_scaling_auto_is_deepspeeds_default(tmp_path):
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({"fp16": {"enabled": True, **{k: "auto" for k in DS_FP16}},
                           "zero_optimization": {"stage": 3}}))
  loaded = zerojax.load_config(p, apply_xla_flags=False)
  c = loaded.config
  assert c.compute_dtype == "float16" and c.loss_scale.dynamic
  assert (c.initial_scale_power, c.loss_scale_window, c.hysteresis, c.min_loss_scale) == (
      16, 1000, 2, 1.0)
  notes = "\n".join(loaded.notes)
  for k, v in DS_FP16.items():
    assert f"fp16.{k}: 'auto' -> {v} (auto: DeepSpeed default fp16.{k}={v}" in notes
  # a value the run gives wins, and says so
  loaded = zerojax.load_config(p, ["loss_scale_window=200"], apply_xla_flags=False)
  assert loaded.config.loss_scale_window == 200
  assert "fp16.loss_scale_window: 'auto' -> 200 (loss_scale_window=200, given)" in "\n".join(
      loaded.notes)


# -- 4. chat templates render as transformers' apply_chat_template -----------------------------

# Templates in the styles of the families' own (written here, short), each exercising what the
# issue found: ChatML; Llama 3.1's date from strftime_now and its `tools is not none` test;
# Mistral's raise_exception on roles; a {% generation %} block (assistant masks).
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if tools is not none %}
    {{- raise_exception("this template takes no tools") }}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
MISTRAL = """{{- bos_token }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + ' [/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""
GENERATION = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
              "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + "
              "'<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}{{ '<|im_start|>' + "
              "message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
              "{% endif %}")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "mistral": MISTRAL, "generation": GENERATION}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "[INST]",
            "[/INST]"]
CONVS = [
    [{"role": "user", "content": "the cat sat on"}, {"role": "assistant", "content": "the mat"}],
    [{"role": "system", "content": "be brief "}, {"role": "user", "content": "hello world"},
     {"role": "assistant", "content": "hello zerojax"}, {"role": "user", "content": "a dog?"},
     {"role": "assistant", "content": "ran in the park, día 3"}],
    [{"role": "user", "content": "fine-tune what users bring"},
     {"role": "assistant", "content": " spaced  out "}],
]


def make_template_tokenizer(d, template, bos="<s>", eos="</s>", vocab=400):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(
      ["the cat sat on the mat", "a dog ran in the park", "hello world, hello zerojax",
       "fine-tune what users bring", "Today Date: system user assistant"] * 4,
      trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                                              eos_token=eos, pad_token="<|endoftext|>",
                                              chat_template=template)
  d.mkdir(parents=True, exist_ok=True)
  fast.save_pretrained(d)
  return transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)


@pytest.mark.parametrize("style", sorted(TEMPLATES))
def test_chat_template_ids_equal_transformers(tmp_path, style):
  from zerojax.tools import hf_data
  bos, eos = {"llama3": ("<|begin_of_text|>", "<|eot_id|>")}.get(style, ("<s>", "</s>"))
  ref = make_template_tokenizer(tmp_path, TEMPLATES[style], bos, eos)
  tok = hf_data.load_tokenizer(tmp_path)
  convs = [c for c in CONVS if style != "mistral" or c[0]["role"] != "system"]
  for conv in convs:
    want = ref.apply_chat_template(conv, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=style == "generation")
    ids, mask = hf_data._chat_ids(tok, conv, "t")
    assert ids == list(want["input_ids"]), (style, tok.render_chat(conv))
    assert tok.render_chat(conv, add_generation_prompt=True) == ref.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True)
    if style == "generation":  # the template's own assistant mask, as transformers gives it
      assert mask == list(want["assistant_masks"]) and sum(mask) > 0
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    assert conv[-1]["content"].strip() in learned and conv[0]["content"] not in learned
  if style == "llama3":  # today's date, as transformers renders it
    import datetime
    assert datetime.datetime.now().strftime("%d %b %Y") in tok.render_chat(CONVS[0])


def test_chat_template_error_names_the_file_the_line_and_the_record(tmp_path):
  from zerojax.tools import hf_data
  make_template_tokenizer(tmp_path, MISTRAL)
  data = tmp_path / "chat.jsonl"
  data.write_text(json.dumps({"messages": CONVS[0]}) + "\n" + json.dumps({"messages": [
      {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}) + "\n")
  tok = hf_data.load_tokenizer(tmp_path)
  with pytest.raises(ValueError) as e:
    hf_data.build_rows(data, tok, 32)
  msg = str(e.value)
  # transformers v5 saves the template as chat_template.jinja
  assert f"{data}:2" in msg and "chat_template.jinja, line 4" in msg, msg
  assert "Conversation roles must alternate" in msg
  # a syntax error: the file and the line
  (tmp_path / "chat_template.jinja").write_text(
      "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
  tok = hf_data.load_tokenizer(tmp_path)
  with pytest.raises(ValueError, match=r"chat_template\.jinja, line 2: .*syntax"):
    hf_data.build_rows(data, tok, 32)


def test_finetune_reports_a_template_error_in_one_line(fp32_dir, tmp_path, capsys):
  import shutil
  from zerojax.tools.cli import main
  d = tmp_path / "m"
  shutil.copytree(fp32_dir, d)
  make_template_tokenizer(d, MISTRAL, vocab=300)
  (d / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "system", "content": "x"},
                                                        {"role": "user", "content": "y"}]}))
  rc = main(["finetune", str(d), "--data", str(d / "bad.jsonl"), *RUN,
             f"out_dir={tmp_path / 'run'}"])
  err = capsys.readouterr().err
  assert rc == 2 and f"{d / 'bad.jsonl'}:1" in err and "chat_template.jinja, line" in err, err
  assert "Traceback" not in err


# -- 5. ShareGPT records ------------------------------------------------------------------------


def _sharegpt(turns):
  return json.dumps({"conversations": [{"from": f, "value": v} for f, v in turns]}) + "\n"


def test_sharegpt_records_train_on_the_assistants_tokens(tmp_path):
  """{"conversations": [{"from": "human"|"gpt"|"system", "value"}]} is read as the same
  conversation in messages form: the same ids and the same loss mask."""
  from zerojax.tools import hf_data
  make_template_tokenizer(tmp_path, CHATML)
  tok = hf_data.load_tokenizer(tmp_path)
  (tmp_path / "sharegpt.jsonl").write_text(_sharegpt(
      [("system", "be brief"), ("human", "hello world"), ("gpt", "hello zerojax")]))
  (tmp_path / "openai.jsonl").write_text(json.dumps({"messages": [
      {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
      {"role": "assistant", "content": "hello zerojax"}]}) + "\n")
  a = hf_data.build_rows(tmp_path / "sharegpt.jsonl", tok, 64)
  b = hf_data.build_rows(tmp_path / "openai.jsonl", tok, 64)
  for f in hf_data.FIELDS:
    np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
  assert a.mask.sum() > 0 and not a.no_loss
  learned = tok.decode(a.y[a.mask.astype(bool)])
  assert "hello zerojax" in learned and "hello world" not in learned


def test_unknown_role_is_refused_by_name_with_file_and_line(tmp_path):
  from zerojax.tools import hf_data
  make_template_tokenizer(tmp_path, CHATML)
  tok = hf_data.load_tokenizer(tmp_path)
  p = tmp_path / "a.jsonl"
  p.write_text(_sharegpt([("human", "hi"), ("gpt", "yo")])
               + _sharegpt([("human", "hi"), ("bot", "yo")]))
  with pytest.raises(ValueError, match=rf"{p}:2: field 'conversations\[1\]\.from'='bot' is an "
                     r"unknown ShareGPT speaker: allowed are \[.*'gpt'.*'human'"):
    hf_data.build_rows(p, tok, 32)
  # ShareGPT's roles under "messages": no template here knows them, refused by name
  p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "yo"}]}) + "\n"
               + json.dumps({"messages": [{"role": "human", "content": "hi"},
                                          {"role": "gpt", "content": "yo"}]}) + "\n")
  with pytest.raises(ValueError, match=rf"{p}:2: field 'messages\[0\]\.role'='human' is a role "
                     r"neither the chat template .* knows.*'user'"):
    hf_data.build_rows(p, tok, 32)


def test_records_with_no_assistant_token_are_counted_and_reported(fp32_dir, tmp_path, capsys):
  from zerojax.tools.cli import main
  p = tmp_path / "mixed.jsonl"
  p.write_text("".join(_sharegpt([("human", "the cat sat"), ("gpt", "on the mat")])
                       for _ in range(20))
               + _sharegpt([("human", "a dog ran")]) + _sharegpt([("system", "hello")]))
  rc = main(["finetune", str(fp32_dir), "--data", str(p), *RUN, f"out_dir={tmp_path / 'run'}"])
  out = capsys.readouterr().out
  assert rc == 0
  assert (f"data {p}: 2 chat records contribute 0 tokens to the loss" in out
          and f"{p}:21, {p}:22" in out), out


# -- 8. logs a cluster user can read -----------------------------------------------------------


def test_no_progress_prints_a_log_line_every_log_every_steps(fp32_dir, tmp_path, capsys):
  """--no-progress: one line at steps 1, 3, 6 and 7 (log_every=3, the first and the last) with
  the step, loss, tokens/s, MFU, live memory and the compiled per-device peak (show_plan)."""
  from zerojax.tools.cli import main
  rc = main(["finetune", str(fp32_dir), "--data", str(fp32_dir / "train.jsonl"), "--no-export",
             "--no-progress", "steps=7", "log_every=3", "seq_len=32", "batch=8", "plot=false",
             f"out_dir={tmp_path / 'run'}"])
  out = capsys.readouterr().out
  assert rc == 0
  lines = [l for l in out.splitlines() if l.startswith("step ")]
  assert [l.split()[1] for l in lines] == ["1/7", "3/7", "6/7", "7/7"], out
  for l in lines:
    for field in ("  loss ", "  tokens/s ", "  MFU ", "  memory ", "  compiled peak "):
      assert field in l, l
  assert "compiled peak -" not in lines[-1] and "tokens/s -" not in lines[-1]
  assert "tokens/s -" in lines[0]  # the first step carries the compilation


class _FakeDevice:
  device_kind = "NVIDIA H100 80GB HBM3"

  def memory_stats(self):
    return {"bytes_in_use": 3 << 30, "peak_bytes_in_use": 5 << 30, "bytes_limit": 80 << 30}


def test_log_line_mfu_and_live_memory_where_the_backend_reports_them():
  from zerojax.tools.train.loop import LogLines
  got = []
  h = LogLines(total=10, log_every=5, tokens_per_step=1000, num_params=1e9,
               devices=[_FakeDevice()] * 8, compiled_peak=lambda: 6 << 30, write=got.append)
  h.on_records([{"step": 1, "loss": 2.0, "elapsed_sec": 10.0}], 0)
  h.on_records([{"step": s, "loss": 1.5, "elapsed_sec": 10.0 + 0.001 * (s - 1)}
                for s in range(2, 6)], 1)
  assert len(got) == 2 and got[0].startswith("step 1/10") and got[1].startswith("step 5/10")
  # 1000 tokens per 1 ms = 1e6 tokens/s x 6e9 FLOPs per token over 8 x 989 TFLOP/s
  assert "tokens/s 1,000,000" in got[1] and f"MFU {100 * 6e15 / (8 * 989e12):.1f}%" in got[1]
  assert "memory 3.00 GiB live (peak 5.00 GiB of 80.00 GiB)" in got[1]
  assert "compiled peak 6.00 GiB" in got[1]


def test_progress_bar_eta_leaves_out_the_compile():
  from zerojax.tools.train.loop import ProgressBar
  bar = ProgressBar(total=10, initial=0, tokens_per_step=100)
  try:
    bar.on_records([{"step": 1, "loss": 1.0, "tokens_per_sec": None, "elapsed_sec": 100.0}], 0)
    bar.on_records([{"step": s, "loss": 1.0, "tokens_per_sec": 100.0,
                     "elapsed_sec": 100.0 + (s - 1)} for s in range(2, 6)], 1)
    assert bar.bar.postfix.startswith("eta=00:05"), bar.bar.postfix  # 5 steps left at 1 s
  finally:
    bar.close()


def test_bar_and_metrics_refresh_whatever_log_every_is(fp32_dir, tmp_path, monkeypatch):
  """DeepSpeed's steps_per_print: 2000 is log_every=2000: the records still reach the bar and
  metrics.jsonl every REFRESH_SEC (0 here: every step)."""
  from zerojax.tools import finetune as ft
  from zerojax.tools.train import Hook, loop
  monkeypatch.setattr(loop, "REFRESH_SEC", 0.0)
  seen = []

  class Seen(Hook):
    def on_records(self, records, previous_step):
      seen.append([r["step"] for r in records])

  fo = ft.FinetuneOptions(model_dir=str(fp32_dir), data=str(fp32_dir / "train.jsonl"),
                          export=False)
  ft.finetune(fo, None, ["steps=4", "log_every=2000", "seq_len=32", "batch=8", "plot=false",
                         "show_plan=false", f"out_dir={tmp_path}"], progress=False,
              hooks=[Seen()])
  assert seen == [[1], [2], [3], [4]]


def test_readme_says_how_to_install_tensorboard():
  import pathlib
  readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
  assert "pip install tensorboard" in readme


def test_loss_plot_carries_the_eval_curve(tmp_path, monkeypatch):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from zerojax.tools.train import metrics
  drawn = {}
  orig = plt.Figure.savefig

  def grab(fig, path, *a, **k):
    drawn["lines"] = [(l.get_label(), list(l.get_xdata()), list(l.get_ydata()))
                      for l in fig.axes[0].get_lines()]
    return orig(fig, path, *a, **k)

  monkeypatch.setattr(plt.Figure, "savefig", grab)
  recs = [{"step": s, "loss": 3.0 - 0.1 * s, **({"eval_loss": 3.5 - 0.1 * s} if s % 2 else {})}
          for s in range(1, 6)]
  metrics.plot_loss(recs, tmp_path / "loss.png")
  lines = {name: (x, y) for name, x, y in drawn["lines"]}
  assert lines["eval loss"][0] == [1, 3, 5]
  np.testing.assert_allclose(lines["eval loss"][1], [3.4, 3.2, 3.0])
  assert (tmp_path / "loss.png").stat().st_size > 0


# -- 7. models by Hub id ----------------------------------------------------------------------


def _hub_cache(cache, repo, src, commit="0123456789abcdef0123456789abcdef01234567"):
  """``src``'s files as the Hub cache lays out a download of ``repo``: blobs, a snapshot of
  links to them, refs/main naming the commit."""
  import hashlib
  import shutil
  root = cache / ("models--" + repo.replace("/", "--"))
  (root / "refs").mkdir(parents=True)
  (root / "refs" / "main").write_text(commit)
  snap = root / "snapshots" / commit
  snap.mkdir(parents=True)
  (root / "blobs").mkdir()
  for f in src.iterdir():
    if f.is_file() and not f.name.endswith(".jsonl"):
      blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
      shutil.copy(f, blob)
      (snap / f.name).symlink_to(os.path.relpath(blob, snap))
  return snap



def test_hub_id_reads_the_local_cache_offline(fp32_dir, tmp_path, monkeypatch, capsys):
  from zerojax.tools.cli import main
  snap = _hub_cache(tmp_path / "hub", "acme/tiny-qwen", fp32_dir)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no test touches the network
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  rc = main(["finetune", "acme/tiny-qwen", "--data", str(fp32_dir / "train.jsonl"), *RUN,
             f"out_dir={tmp_path / 'run'}"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  assert "model acme/tiny-qwen: " in out, out  # read from the cache's snapshot
  assert str(snap) in json.loads((tmp_path / "run" / "run.json").read_text())["options"]["model"]
  rc = main(["finetune", "acme/not-cached", "--data", str(fp32_dir / "train.jsonl"), *RUN,
             f"out_dir={tmp_path / 'run2'}"])
  err = capsys.readouterr().err
  assert rc == 2 and "'acme/not-cached' is not a local directory" in err
  assert "HF_HUB_OFFLINE=1" in err and str(tmp_path / "hub") in err


# -- 6. every command takes a model the way finetune does -------------------------------------

# The published parameter counts of the checkpoints the presets copy their config.json from.
PUBLISHED = {"llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496,
             "qwen2.5-7b": 7_615_616_512, "mistral-7b": 7_241_732_096}

TINY_LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0}


@pytest.fixture
def tiny_llama_dir(tmp_path):
  d = tmp_path / "tiny-llama"
  d.mkdir()
  (d / "config.json").write_text(json.dumps(TINY_LLAMA))
  return d


def test_presets_are_the_published_checkpoints_shapes():
  from zerojax.models.hf_presets import HF_PRESETS
  assert sorted(HF_PRESETS) == sorted(PUBLISHED)
  for name, n in PUBLISHED.items():
    assert llama.from_hf_config(HF_PRESETS[name]).num_params() == n, name


def test_estimate_and_plan_take_presets_directories_and_config_json(tiny_llama_dir, capsys):
  from zerojax.tools.cli import main
  assert main(["estimate", "--model", "llama-3-8b", "--devices", "8"]) == 0
  out = capsys.readouterr().out
  assert "llama-3-8b (8,030,261,248 parameters" in out and "stage 3  + parameters" in out
  n = llama.from_hf_config(TINY_LLAMA).num_params()
  for model in (str(tiny_llama_dir), str(tiny_llama_dir / "config.json")):
    assert main(["plan", "--model", model, "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert f"{n:,} parameters, planned for 8 devices" in out
    assert "llama/layers/mlp/up_proj/kernel" in out
  # the compiled step's peak of the real Llama step decides the fit
  assert main(["estimate", "--model", str(tiny_llama_dir), "--devices", "8", "--fit", "1GB",
               "--seq", "32"]) == 0
  out = capsys.readouterr().out
  assert "compiled peaks: the real training step (AdamW) for a batch of 8 rows x 32" in out
  assert "recommendation: stage 0" in out
  assert main(["plan", "--model", "llama-9b", "--devices", "8"]) == 2
  err = capsys.readouterr().err
  assert "--model 'llama-9b' is unknown" in err and "'llama-3-8b'" in err and "Hub id" in err


def test_train_takes_an_hf_model_directory(tiny_llama_dir, tmp_path, capsys):
  from zerojax.tools.cli import main
  rc = main(["train", f"model={tiny_llama_dir}", "steps=2", "seq_len=32", "batch=8",
             f"out_dir={tmp_path / 'run'}", "show_plan=false", "plot=false", "--no-progress"])
  out = capsys.readouterr().out
  assert rc == 0
  n = llama.from_hf_config(TINY_LLAMA).num_params()
  assert f"model {tiny_llama_dir}: {n:,} parameters" in out and "done: 2 steps" in out


@pytest.mark.skipif(__import__("zerojax.runtime.gpu", fromlist=["gpu"]).cuda_plugin() is None,
                    reason="JAX's CUDA plugin is not installed: no GPU compiler")
def test_compile_llama_3_8b_for_h100s_prints_the_verdict(capsys):
  from zerojax.tools.cli import main
  # The issue's command, as a DeepSpeed or torchtitan user writes it: 2 rows per GPU.
  rc = main(["compile", "--model", "llama-3-8b", "--topology", "h100:8", "--batch", "2",
             "--seq", "8192", "compute_dtype=bfloat16", "remat=full"])
  out = capsys.readouterr().out
  assert rc in (0, 1) and ("model llama-3-8b, global batch 16 x 8192 tokens, h100:8 (--batch 2 "
                           "read as rows per device") in out
  assert ("DOES NOT FIT" in out) == (rc == 1) and "HBM peak" in out
  if rc == 1:  # remedies name only what the config does not already set
    assert "remat='full'" not in out.split("DOES NOT FIT")[1]
    assert "compute_dtype=bfloat16" not in out.split("DOES NOT FIT")[1]
  # bfloat16 on XLA:GPU: cuDNN's fused attention, as transformers' SDPA; with the scores
  # materialised (8192^2 per head) the step needed 73.4 GiB and did not fit
  assert "attention: cuDNN's fused kernel" in out and rc == 0 and "FITS" in out
  # compiled as zerojax finetune trains it, the NNX model: its 32 layers one ahead (through a
  # linen wrapper, gathered whole: 0.67x textbook, 7% of all-gathers beside a matmul, 43.9 GiB)
  assert "scanned layers one ahead" in out and "activation collectives: none" in out
  peak = float(re.search(r"HBM peak +([\d.]+) GiB", out).group(1))
  assert peak < 35


def test_hf_presets_take_the_fused_attention_only_where_it_applies():
  from zerojax.models import llama
  assert llama.fused_attention("gpu", "bfloat16", None) == "cudnn"
  assert llama.fused_attention("gpu", "float32", None) == "xla"  # cuDNN's kernel: 16-bit only
  assert llama.fused_attention("gpu", "bfloat16", 4096) == "xla"  # Mistral's window
  assert llama.fused_attention("tpu", "bfloat16", None) == "xla"
  with pytest.raises(ValueError, match=r"attention='cudnn' needs dtype bfloat16 or float16"):
    llama.LlamaConfig(attention="cudnn")
  with pytest.raises(ValueError, match=r"LlamaConfig.attention='flash' is invalid"):
    llama.LlamaConfig(attention="flash")


@pytest.mark.parametrize("argv, axes, rows, reading", [
    (["--batch", "16"], {}, 16, None),
    (["--batch", "2"], {}, 16, "--batch 2 read as rows per device"),
    (["--batch-per-device", "3"], {}, 24, "3 rows per device x 8 data-parallel devices"),
    (["--batch", "2"], dict(mesh_axes=("fsdp", "tensor"), mesh_shape=(4, 2)), 8,
     "over 4 data-parallel devices"),
    (["--batch-per-device", "1"], dict(mesh_axes=("replica", "fsdp"), mesh_shape=(2, 8)), 16,
     "x 16 data-parallel devices"),
])
def test_compile_reads_batch_as_global_or_per_device(argv, axes, rows, reading):
  from zerojax.core.config import ZeroConfig
  from zerojax.tools.cli import _global_batch, build_parser
  topology = "h100:2x8" if axes.get("mesh_shape") == (2, 8) else "h100:8"
  args = build_parser().parse_args(["compile", *argv, "--seq", "8", "--topology", topology])
  got, note = _global_batch(args, ZeroConfig.from_flat(dict(stage=3, **axes)))
  assert got == rows and (note is None if reading is None else reading in note)


@pytest.mark.parametrize("argv, message", [
    (["--batch", "12"], "--batch 12: the global batch must be a multiple of the 8 "
                        "data-parallel devices of h100:8, e.g. --batch 8 or 16"),
    ([], "give exactly one of --batch (global rows) and --batch-per-device"),
    (["--batch", "8", "--batch-per-device", "1"], "got --batch and --batch-per-device"),
    (["--batch", "0"], "--batch 0 --seq 8: both must be >= 1"),
])
def test_compile_refuses_a_batch_it_cannot_split(argv, message, capsys):
  from zerojax.tools.cli import main
  assert main(["compile", *argv, "--seq", "8", "--topology", "h100:8"]) == 2
  err = capsys.readouterr().err
  assert message in err and len(err.strip().splitlines()) == 1
