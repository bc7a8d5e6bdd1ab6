"""The Llama-like Hugging Face families in the one NNX implementation (zerojax.models.llama):
Llama (biases), Qwen2/Qwen2.5 (q/k/v biases, tied embeddings, sliding layers), Qwen3 (q/k
RMSNorm, its own head_dim) and Mistral (sliding window), each loaded from its own config.json
and safetensors (written by transformers' save_pretrained), checked against transformers' fp32
logits, exported back under its own names and loaded with from_pretrained; config fields the
model does not implement are refused by name."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

# The reference implementation (test extra, Python 3.11's CPU torch); skipped where absent.
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import zerojax  # noqa: E402
from zerojax.models import llama  # noqa: E402
from zerojax.runtime import weights  # noqa: E402
from zerojax.runtime.checkpoint import Checkpointer  # noqa: E402
from zerojax.tools.export import export  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, rope_theta=500.0)

CONFIGS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "mistral": transformers.MistralConfig,
}

# name -> (family, extra config fields, sequence length)
CASES = {
    "llama_biases": ("llama", dict(attention_bias=True, mlp_bias=True), 16),
    "qwen2_untied": ("qwen2", dict(), 16),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True), 16),
    # layer 0 full, layer 1 sliding (max_window_layers=1), window 5 < 24 positions
    "qwen2_sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=5,
                                    max_window_layers=1), 24),
    "qwen3": ("qwen3", dict(head_dim=32), 16),  # head_dim != hidden_size / heads
    "qwen3_bias_tied": ("qwen3", dict(head_dim=8, attention_bias=True,
                                      tie_word_embeddings=True), 16),
    "mistral_sliding": ("mistral", dict(sliding_window=5), 24),
}


def make_hf(family, seed=0, **kw):
  torch.manual_seed(seed)
  cfg = CONFIGS[family](**{**TINY, **kw})
  m = transformers.AutoModelForCausalLM.from_config(cfg)
  with torch.no_grad():
    for p in m.parameters():
      p.normal_(0.0, 0.1)
    for layer in m.model.layers:  # sharper attention: positions (and the window) matter more
      layer.self_attn.q_proj.weight.mul_(3.0)
      layer.self_attn.k_proj.weight.mul_(3.0)
  return m.float().eval()


def hf_logits(m, tokens):
  with torch.no_grad():
    return m(torch.tensor(tokens)).logits.numpy()


def load(cfg, d):
  mesh_plan = zerojax.ShardingPlan.create(
      zerojax.ZeroConfig(stage=3), zerojax.make_mesh(zerojax.ZeroConfig(stage=3)),
      nnx.state(nnx.eval_shape(lambda: llama.Llama(cfg, nnx.Rngs(0))), nnx.Param))
  # transformers v5 writes a tied head once (under the embedding's name).
  tree = weights.load_safetensors(d, mesh_plan, llama.hf_mapping(cfg),
                                  allow_extra=[r"^lm_head\.weight$"])
  return tree


def logits_of(cfg, tree, tokens):
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: llama.Llama(cfg, nnx.Rngs(0))))
  return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(tree, tokens))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
  name = request.param
  family, kw, T = CASES[name]
  d = tmp_path_factory.mktemp(name)
  m = make_hf(family, seed=len(name), **kw)
  # one case as a sharded checkpoint (several files + model.safetensors.index.json)
  m.save_pretrained(d, **({"max_shard_size": "60KB"} if name == "qwen2_untied" else {}))
  if name == "qwen2_untied":
    assert (d / weights.INDEX_FILE).exists() and len(list(d.glob("*.safetensors"))) > 2
  tokens = np.random.RandomState(1).randint(0, TINY["vocab_size"], (2, T))
  cfg = llama.from_hf_config(d)
  tree = load(cfg, d)
  return name, d, m, cfg, tree, tokens


def test_logits_match_transformers(case):
  name, d, m, cfg, tree, tokens = case
  family, kw, _ = CASES[name]
  assert cfg.model_type == family
  ref = hf_logits(m, tokens)
  got = logits_of(cfg, tree, tokens)
  diff = float(np.abs(got - ref).max())
  print(f"{name}: max |logit diff| vs transformers = {diff:.2e}")
  assert diff <= 1e-4, diff
  if family == "qwen2":
    assert cfg.qkv_bias and not cfg.o_bias
    assert cfg.tie_word_embeddings == bool(kw.get("tie_word_embeddings"))
  if family == "qwen3":
    assert cfg.qk_norm and cfg.hd == kw["head_dim"]
  # Each family's difference changes the logits at this size (so the test tests it).
  if cfg.sliding_window is not None:
    assert cfg.layer_windows() == ((0, 5) if family == "qwen2" else (5, 5))
    full = llama.LlamaConfig(**{**cfg.__dict__, "sliding_window": None, "layer_types": None,
                                "model_type": "llama" if family == "mistral" else family})
    assert np.abs(logits_of(full, tree, tokens) - ref).max() > 1e-3
    # Within the window the sliding layers are full attention.
    w = cfg.sliding_window
    np.testing.assert_allclose(logits_of(full, tree, tokens[:, :w]), ref[:, :w], atol=1e-4,
                               rtol=0)


def test_exported_under_its_own_names_loads_with_from_pretrained(case, tmp_path):
  name, d, m, cfg, tree, tokens = case
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(1, {"params": tree}, force=True, model=llama.checkpoint_model(cfg))
  export(tmp_path / "ckpt", tmp_path / "hf", hf_config=d)
  names = lambda p: set(weights.checkpoint_index(p))
  assert names(tmp_path / "hf") == names(d)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
  assert type(back) is type(m)
  np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(m, tokens))
  # A config written from the model alone (no base) is read by transformers as the same model.
  same = lambda c: dataclasses.replace(c, head_dim=c.hd)  # explicit or derived head_dim
  fresh = llama.hf_config(cfg)
  assert same(llama.from_hf_config(fresh)) == same(cfg)
  again = transformers.AutoConfig.for_model(**fresh)
  assert type(again) is type(m.config)
  assert same(llama.from_hf_config(again.to_dict())) == same(cfg)


# -- refused by name ------------------------------------------------------------------------------


def _base(family, **kw):
  return {**CONFIGS[family](**TINY).to_dict(), **kw}


@pytest.mark.parametrize("family,fields,match", [
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     r"rope_parameters\.rope_type='yarn'.*default rotary embedding or 'llama3'"),
    ("llama", dict(rope_scaling={"type": "linear", "factor": 2.0}, rope_parameters=None),
     r"rope_scaling\.rope_type='linear'"),
    ("llama", dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0\.5"),
    ("llama", dict(hidden_act="gelu"), r"hidden_act='gelu'.*silu"),
    ("llama", dict(sliding_window=4096), r"sliding_window=4096.*'llama' has no sliding"),
    ("llama", dict(attention_dropout=0.1), r"attention_dropout=0\.1"),
    ("mistral", dict(attention_bias=True), r"attention_bias=True.*MistralForCausalLM"),
    ("qwen2", dict(attention_bias=True), r"attention_bias=True.*Qwen2ForCausalLM.*q/k/v"),
    ("qwen2", dict(mlp_bias=True), r"mlp_bias=True.*no MLP biases"),
    ("mistral", dict(sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
     r"layer_types=.*every layer"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8,
                   layer_types=["full_attention", "chunked_attention"]),
     r"layer_types=.*'full_attention', 'sliding_attention'"),
    ("gemma", {}, r"model_type='gemma'.*\('llama', 'qwen2', 'qwen3', 'mistral'\)"),
])
def test_unimplemented_field_is_refused_by_name(family, fields, match):
  cfg = _base("llama" if family == "gemma" else family, **fields)
  if family == "gemma":
    cfg["model_type"] = "gemma"
  with pytest.raises(ValueError, match=match):
    llama.from_hf_config(cfg)


def test_sliding_window_switches_as_transformers_reads_them():
  # Qwen2/Qwen3: a window without use_sliding_window is off (as transformers reads it).
  for fam in ("qwen2", "qwen3"):
    cfg = llama.from_hf_config(_base(fam, sliding_window=16, use_sliding_window=False))
    assert cfg.sliding_window is None and cfg.layer_windows() == (0, 0)
    on = llama.from_hf_config(_base(fam, sliding_window=16, use_sliding_window=True,
                                    max_window_layers=1, layer_types=None))
    assert on.layer_windows() == (0, 16)
    # every layer below max_window_layers: no layer slides
    off = llama.from_hf_config(_base(fam, sliding_window=16, use_sliding_window=True,
                                     max_window_layers=28, layer_types=None))
    assert off.layer_windows() == (0, 0)
    null = llama.from_hf_config(_base(fam, sliding_window=None, use_sliding_window=True,
                                      max_window_layers=0, layer_types=None))
    assert null.sliding_window is None
    bare = {k: v for k, v in _base(fam, use_sliding_window=True, max_window_layers=0,
                                   layer_types=None).items() if k != "sliding_window"}
    assert llama.from_hf_config(bare).layer_windows() == (4096, 4096)
  # Mistral: the window acts on every layer; null turns it off; absent is its default 4096.
  assert llama.from_hf_config(_base("mistral", sliding_window=7)).layer_windows() == (7, 7)
  assert llama.from_hf_config(_base("mistral", sliding_window=None)).sliding_window is None
  bare = {k: v for k, v in _base("mistral").items() if k != "sliding_window"}
  assert llama.from_hf_config(bare).sliding_window == 4096
  # MistralForCausalLM does not read use_sliding_window: its window still acts.
  hf = transformers.MistralConfig(**TINY, sliding_window=7, use_sliding_window=False)
  assert hf.sliding_window == 7
  assert llama.from_hf_config(hf.to_dict()).layer_windows() == (7, 7)
  # Llama 1/2 configs (rope_scaling null, pretraining_tp) and Llama 3.1's rope_scaling.
  old = _base("llama", rope_parameters=None, rope_scaling=None, rope_theta=10000.0,
              pretraining_tp=1)
  assert llama.from_hf_config(old).rope_llama3 is None
  l31 = _base("llama", rope_parameters=None, rope_theta=500000.0, rope_scaling={
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192})
  assert llama.from_hf_config(l31).rope_llama3 == (8.0, 1.0, 4.0, 8192)
  assert llama.from_hf_config(l31).rope_theta == 500000.0
  # without original_max_position_embeddings, max_position_embeddings (as transformers)
  del l31["rope_scaling"]["original_max_position_embeddings"]
  assert llama.from_hf_config(l31).rope_llama3 == (8.0, 1.0, 4.0, 64)


def test_inconsistent_model_config_is_named():
  with pytest.raises(ValueError, match=r"model_type='qwen2'.*q/k/v biases"):
    llama.LlamaConfig(model_type="qwen2")
  with pytest.raises(ValueError, match=r"model_type='mistral'.*no biases"):
    llama.LlamaConfig(model_type="mistral", qkv_bias=True)
  with pytest.raises(ValueError, match=r"sliding_window=0 is invalid"):
    llama.LlamaConfig(model_type="mistral", sliding_window=0)
  with pytest.raises(ValueError, match=r"model_type='phi'.*allowed are"):
    llama.LlamaConfig(model_type="phi")


# -- an export keeps the base checkpoint's identity (issue 26) ------------------------------------


CORPUS = ["the cat sat on the mat", "a dog ran in the park", "hello world, hello zerojax",
          "fine-tune what users bring"] * 4
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(d):
  """A tiny byte-level BPE (Qwen2's kind, 300 ids) with a chat template, trained here and
  saved with save_pretrained."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=300, special_tokens=SPECIAL,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  assert tok.get_vocab_size() <= 300
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
      chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}"
                    "<|im_end|>{% endfor %}")
  fast.save_pretrained(d)
  return fast


@pytest.fixture(scope="module")
def base_qwen2(tmp_path_factory):
  """A tiny random Qwen2 (tied embeddings) with its tokenizer, a generation config and a
  field zerojax does not model, as a user's base checkpoint directory."""
  d = tmp_path_factory.mktemp("base_qwen2")
  m = make_hf("qwen2", seed=5, tie_word_embeddings=True, vocab_size=300, bos_token_id=1,
              eos_token_id=0, pad_token_id=0)
  m.config.my_unmodelled_field = {"kept": [1, 2]}
  m.generation_config.eos_token_id = [0, 2]
  m.generation_config.max_new_tokens = 9
  m.save_pretrained(d)
  make_tokenizer(d)
  assert (d / "generation_config.json").exists() and (d / "tokenizer.json").exists()
  return d, m


def _greedy_zerojax(cfg, tree, prompt, n):
  """zerojax's own greedy decoding: one fixed-length forward per new token (causal, so the
  positions after the current one do not change its logits)."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: llama.Llama(cfg, nnx.Rngs(0))))
  tree = jax.device_get(tree)
  fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  toks = np.zeros((1, len(prompt) + n), np.int32)
  toks[0, :len(prompt)] = prompt
  for t in range(len(prompt), len(prompt) + n):
    toks[0, t] = int(np.argmax(np.asarray(fwd(tree, toks))[0, t - 1]))
  return toks[0, len(prompt):].tolist()


def _generate(path_or_model, ids, n):
  m = (transformers.AutoModelForCausalLM.from_pretrained(path_or_model).float().eval()
       if not isinstance(path_or_model, torch.nn.Module) else path_or_model)
  with torch.no_grad():
    out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
  return out[0, len(ids):].tolist()


def test_export_keeps_config_generation_config_and_tokenizer(base_qwen2, tmp_path):
  from zerojax.tools import cli
  d, m = base_qwen2
  cfg = llama.from_hf_config(d)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(3, {"params": load(cfg, d)}, force=True, model=llama.checkpoint_model(cfg))
  out = tmp_path / "hf"
  assert cli.main(["export", str(tmp_path / "ckpt"), str(out), "--hf-config",
                   str(d / "config.json"), "--dtype", "bf16"]) == 0
  base_cfg, new_cfg = (json.loads((p / "config.json").read_text()) for p in (d, out))
  # Only the dtype changed; bos/eos/pad ids and the field zerojax does not model are kept.
  assert new_cfg.pop("dtype") == "bfloat16" and base_cfg.pop("dtype") == "float32"
  assert new_cfg == base_cfg
  assert new_cfg["my_unmodelled_field"] == {"kept": [1, 2]} and new_cfg["eos_token_id"] == 0
  for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    assert (out / name).read_bytes() == (d / name).read_bytes(), name
  tok, base_tok = (transformers.AutoTokenizer.from_pretrained(p) for p in (out, d))
  text = "the cat ran in the park"
  assert len(tok(text)["input_ids"]) > 3
  assert tok(text)["input_ids"] == base_tok(text)["input_ids"]
  chat = [{"role": "user", "content": "hello world"}]
  assert tok.apply_chat_template(chat, tokenize=False) == \
      base_tok.apply_chat_template(chat, tokenize=False)
  back = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert back.generation_config.max_new_tokens == 9 and back.config.bos_token_id == 1
  assert back.generation_config.eos_token_id == [0, 2]
  # It generates as the base (greedy, the exported weights rounded to bf16 and back).
  ids = tok(text)["input_ids"]
  back32 = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  gen = _generate(back32, ids, 5)
  assert gen and gen == _generate(m, ids, 5)
  assert tok.decode(gen) == base_tok.decode(gen)


def test_lora_export_uses_the_recorded_alpha(base_qwen2, tmp_path, capsys):
  from zerojax.tools import cli
  d, m = base_qwen2
  cfg = llama.from_hf_config(d, lora_rank=4, lora_alpha=8.0,
                             lora_targets=("q_proj", "v_proj", "down_proj"))
  tree = jax.device_get(load(llama.from_hf_config(d), d))
  rs = np.random.RandomState(0)
  L = cfg.num_hidden_layers
  for block, name, din, dout in (("self_attn", "q_proj", 64, 64), ("self_attn", "v_proj", 64, 32),
                                 ("mlp", "down_proj", 96, 64)):
    tree["layers"][block][name]["lora_a"] = rs.normal(0, 0.3, (L, din, 4)).astype(np.float32)
    tree["layers"][block][name]["lora_b"] = rs.normal(0, 0.3, (L, 4, dout)).astype(np.float32)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(1, {"params": tree}, force=True, model=llama.checkpoint_model(cfg))
  # No --lora-alpha: the alpha recorded with the adapters merges them.
  out = tmp_path / "hf"
  assert cli.main(["export", str(tmp_path / "ckpt"), str(out), "--hf-config", str(d)]) == 0
  tokens = np.random.RandomState(4).randint(3, 300, (2, 16))
  ours = logits_of(cfg, tree, tokens)
  back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
  diff = float(np.abs(hf_logits(back, tokens) - ours).max())
  assert diff <= 1e-4, diff
  assert np.abs(hf_logits(m, tokens) - ours).max() > 1e-2  # the adapters changed the model
  prompt = tokens[0, :6].tolist()
  theirs = _generate(back, prompt, 6)
  assert theirs and theirs == _greedy_zerojax(cfg, tree, prompt, 6)[:len(theirs)]
  # A different --lora-alpha than the recorded one is refused, naming both.
  assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "x"), "--hf-config", str(d),
                   "--lora-alpha", "16"]) == 2  # bad input
  assert "lora_alpha=16.0 differs from the alpha 8.0 recorded" in capsys.readouterr().err
  # Without a recorded alpha, export asks for one.
  with Checkpointer(tmp_path / "bare") as ckpt:
    ckpt.save(1, {"params": tree}, force=True)
  with pytest.raises(ValueError, match=r"records no alpha.*--lora-alpha"):
    export(tmp_path / "bare", tmp_path / "y", hf_config=d)
  info = export(tmp_path / "bare", tmp_path / "y", hf_config=d, lora_alpha=8.0)
  assert info["lora_alpha"] == 8.0


def test_export_refuses_a_checkpoint_of_another_architecture(base_qwen2, tmp_path):
  d, _ = base_qwen2
  tree = jax.device_get(load(llama.from_hf_config(d), d))
  del tree["layers"]["self_attn"]["q_proj"]["bias"]
  tree["norm"]["scale"] = np.ones((65,), np.float32)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(1, {"params": tree}, force=True)
  # A checkpoint that records another family than the base config's is refused by name.
  with Checkpointer(tmp_path / "other") as ckpt:
    ckpt.save(1, {"params": tree}, force=True, model={"family": "mistral"})
  with pytest.raises(ValueError, match=r"records a 'mistral' model.*model_type 'qwen2'"):
    export(tmp_path / "other", tmp_path / "hf", hf_config=d)
  with pytest.raises(ValueError, match=r"does not match the Hugging Face config.*qwen2.*"
                     r"'norm/scale' has shape \(65,\), the base config needs \(64,\).*"
                     r"needs leaf 'layers/self_attn/q_proj/bias'"):
    export(tmp_path / "ckpt", tmp_path / "hf", hf_config=d / "config.json")


def test_families_train_at_stage3_with_remat_and_lora(tmp_path):
  """Biases, q/k norms and per-layer windows through create_nnx, zero_step, remat and LoRA."""
  import jax.numpy as jnp
  import optax
  m = make_hf("qwen3", seed=7, head_dim=16, attention_bias=True, use_sliding_window=True,
              sliding_window=6, max_window_layers=1, tie_word_embeddings=True)
  m.save_pretrained(tmp_path)
  base = llama.from_hf_config(tmp_path)
  cfg = llama.from_hf_config(tmp_path, remat=True, lora_rank=4,
                             lora_targets=("q_proj", "k_proj", "o_proj"))
  assert base.layer_windows() == (0, 6) and cfg.qkv_bias and cfg.qk_norm
  src = weights.safetensors_source(tmp_path, llama.hf_mapping(base), skip="lora_",
                                   allow_extra=[r"^lm_head\.weight$"])
  model, opt, plan = zerojax.create_nnx(lambda: llama.Llama(cfg, nnx.Rngs(0)),
                                        optax.adam(1e-2), config=zerojax.ZeroConfig(stage=3),
                                        wrt=nnx.LoRAParam, params=src)
  tokens = np.random.RandomState(0).randint(0, TINY["vocab_size"], (8, 17))
  # the adapters start at zero: the model starts as transformers' base
  np.testing.assert_allclose(np.asarray(jax.jit(lambda mm, t: mm(t))(model, tokens[:2, :16])),
                             hf_logits(m, tokens[:2, :16]), atol=1e-4, rtol=0)

  @zerojax.zero_step(plan)
  def step(model, opt, batch):
    def lf(mm):
      return zerojax.models.loss_fn(mm(batch["x"]), batch["y"])
    loss, grads = nnx.value_and_grad(lf, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    opt.update(model, grads)
    return {"loss": loss}

  batch = {"x": jnp.asarray(tokens[:, :-1]), "y": jnp.asarray(tokens[:, 1:])}
  losses = [float(step(model, opt, batch)["loss"]) for _ in range(4)]
  assert losses[-1] < losses[0], losses
