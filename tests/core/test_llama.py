"""Hugging Face Llama checkpoints in and out: the NNX Llama against transformers' PyTorch
``LlamaForCausalLM``, sharded safetensors loading on every stage and mesh, named errors,
existing parameters in `create_nnx`/`create_train_state`, frozen parameters, export."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

# The reference implementation: part of the [test] extra, so a broken install fails here
# rather than skipping the Llama tests.
# The reference implementation (test extra, Python 3.11's CPU torch); skipped where absent.
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import zerojax  # noqa: E402
from zerojax.runtime import memory, weights  # noqa: E402
from zerojax.models import llama  # noqa: E402

pytestmark = pytest.mark.slow

HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
          rms_norm_eps=1e-5, rope_theta=500.0)


def hf_model(tie=False, seed=0, **kw):
  torch.manual_seed(seed)
  m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF, **kw},
                                                             tie_word_embeddings=tie))
  with torch.no_grad():
    for p in m.parameters():
      p.normal_(0.0, 0.1)
  return m.float().eval()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tiny random Llama saved sharded (several files + model.safetensors.index.json)."""
  d = tmp_path_factory.mktemp("hf_llama")
  m = hf_model()
  m.save_pretrained(d, max_shard_size="60KB")
  assert os.path.exists(d / weights.INDEX_FILE) and len(list(d.glob("*.safetensors"))) > 2
  tokens = np.random.RandomState(0).randint(0, HF["vocab_size"], (2, 16))
  with torch.no_grad():
    logits = m(torch.tensor(tokens)).logits.numpy()
  sd = {k: v.numpy().copy() for k, v in m.state_dict().items()}
  return d, tokens, logits, sd


def abstract_llama(cfg):
  return nnx.eval_shape(lambda: llama.Llama(cfg, nnx.Rngs(0)))


def plan_for(cfg, config, devices=None):
  mesh = zerojax.make_mesh(config, devices)
  return zerojax.ShardingPlan.create(config, mesh, nnx.state(abstract_llama(cfg), nnx.Param))


def logits_of(cfg, tree, tokens):
  graphdef, _ = nnx.split(abstract_llama(cfg))
  return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(tree, tokens))


def test_logits_match_transformers(hf_dir):
  d, tokens, ref, _ = hf_dir
  cfg = llama.from_hf_config(d)
  plan = plan_for(cfg, zerojax.ZeroConfig(stage=3))
  tree = weights.load_safetensors(d, plan, llama.hf_mapping(cfg))
  np.testing.assert_allclose(logits_of(cfg, tree, tokens), ref, atol=1e-4, rtol=0)


def test_tied_embeddings_match_transformers(tmp_path):
  m = hf_model(tie=True, seed=1)
  m.save_pretrained(tmp_path)
  cfg = llama.from_hf_config(tmp_path)
  assert cfg.tie_word_embeddings
  plan = plan_for(cfg, zerojax.ZeroConfig(stage=3))
  # transformers v5 writes the tied head once (under the embedding's name).
  tree = weights.load_safetensors(tmp_path, plan, llama.hf_mapping(cfg),
                                  allow_extra=[r"^lm_head\.weight$"])
  tokens = np.arange(32).reshape(2, 16) % HF["vocab_size"]
  with torch.no_grad():
    ref = m(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(logits_of(cfg, tree, tokens), ref, atol=1e-4, rtol=0)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
  rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
  # (rope_theta 500 and head_dim 16 put wavelengths 6.3 ... 1445 into all three bands)
  m = hf_model(seed=2, rope_parameters=rope)
  with torch.no_grad():  # sharper attention, so positions (and their encoding) matter more
    for layer in m.model.layers:
      layer.self_attn.q_proj.weight.mul_(4.0)
      layer.self_attn.k_proj.weight.mul_(4.0)
  m.save_pretrained(tmp_path)
  cfg = llama.from_hf_config(tmp_path)
  assert cfg.rope_llama3 == (8.0, 1.0, 4.0, 64)
  # The three bands of the scaling all occur at this size (wavelengths vs 64/4 and 64/1).
  inv = np.asarray(llama._inv_freq(dataclasses.replace(cfg, rope_llama3=None)))
  wl = 2 * np.pi / inv
  assert (wl < 16).any() and ((wl > 16) & (wl < 64)).any() and (wl > 64).any()
  plan = plan_for(cfg, zerojax.ZeroConfig(stage=3))
  tree = weights.load_safetensors(tmp_path, plan, llama.hf_mapping(cfg))
  tokens = np.random.RandomState(3).randint(0, HF["vocab_size"], (2, 64))
  with torch.no_grad():
    ref = m(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(logits_of(cfg, tree, tokens), ref, atol=1e-4, rtol=0)
  plain = dataclasses.replace(cfg, rope_llama3=None)  # the scaling matters at this length
  assert np.abs(logits_of(plain, tree, tokens) - ref).max() > 1e-3
  assert llama.hf_config(cfg)["rope_parameters"] == {**rope, "factor": 8.0}


@pytest.mark.parametrize("stage,mesh_shape,axes,ndev", [
    (0, (8,), ("fsdp",), 8), (1, (8,), ("fsdp",), 8), (2, (8,), ("fsdp",), 8),
    (3, (8,), ("fsdp",), 8), (3, (2, 4), ("replica", "fsdp"), 8), (3, (-1,), ("fsdp",), 1),
    (3, (8,), ("fsdp",), "blocks")])
def test_load_sharded_checkpoint_every_stage_and_mesh(hf_dir, stage, mesh_shape, axes, ndev,
                                                      monkeypatch):
  d, _, _, sd = hf_dir
  if ndev == "blocks":  # every tensor read a few stored rows at a time, assembled in place
    monkeypatch.setattr(weights, "_BLOCK_BYTES", 256)
    ndev = 8
  cfg = llama.from_hf_config(d)
  config = zerojax.ZeroConfig(stage=stage, mesh_shape=mesh_shape, mesh_axes=axes)
  plan = plan_for(cfg, config, jax.devices()[:ndev])
  mapping = llama.hf_mapping(cfg)
  tree = weights.load_safetensors(d, plan, mapping)
  for lp, x, sh in zip(plan.leaves, jax.tree.leaves(tree), jax.tree.leaves(plan.params)):
    assert x.sharding == sh, lp.path
    tm = mapping[lp.path]
    parts = [sd[n] for n in tm.names(lp.shape)]
    parts = [p.T if tm.transpose else p for p in parts]
    want = np.stack(parts) if tm.stacked else parts[0]
    np.testing.assert_array_equal(np.asarray(x), want, err_msg=lp.path)
    if stage == 3 and lp.is_sharded:  # each device holds only its shard
      n = dict(plan.mesh.shape)["fsdp"]
      assert {s.data.size for s in x.addressable_shards} == {x.size // n}


def test_loaded_shards_are_the_device_buffers(hf_dir, monkeypatch):
  """On CPU each shard read from the checkpoint becomes the device buffer, not a copy of it: the
  load peaks at its shards plus one block (benchmarks/load_rss.py)."""
  d = hf_dir[0]
  cfg = llama.from_hf_config(d)
  plan = plan_for(cfg, zerojax.ZeroConfig(stage=3), jax.devices())
  made = []
  orig = weights._aligned_empty
  monkeypatch.setattr(weights, "_aligned_empty", lambda *a: made.append(orig(*a)) or made[-1])
  tree = weights.load_safetensors(d, plan, llama.hf_mapping(cfg))
  buffers = {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)
             for s in x.addressable_shards}
  assert made and all(a.ctypes.data % 64 == 0 and a.ctypes.data in buffers for a in made)


# -- named errors ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stage3(hf_dir):
  cfg = llama.from_hf_config(hf_dir[0])
  return cfg, plan_for(cfg, zerojax.ZeroConfig(stage=3))


def _write(path, tensors):
  from safetensors.numpy import save_file
  save_file(tensors, str(path))
  return path


def test_mismatched_shape_names_leaf_shapes_and_file(hf_dir, stage3, tmp_path):
  cfg, plan = stage3
  sd = dict(hf_dir[3])
  sd["model.layers.1.mlp.up_proj.weight"] = np.zeros((97, 64), np.float32)
  f = _write(tmp_path / "bad.safetensors", sd)
  with pytest.raises(weights.WeightsError) as e:
    weights.load_safetensors(f, plan, llama.hf_mapping(cfg))
  msg = str(e.value)
  assert "'layers/mlp/up_proj/kernel'" in msg and "(97, 64)" in msg and "(96, 64)" in msg
  assert "model.layers.1.mlp.up_proj.weight" in msg and str(f) in msg


def test_missing_tensor_is_named(hf_dir, stage3, tmp_path):
  cfg, plan = stage3
  sd = dict(hf_dir[3])
  del sd["model.layers.0.self_attn.k_proj.weight"]
  f = _write(tmp_path / "missing.safetensors", sd)
  with pytest.raises(weights.WeightsError, match=r"tensor 'model\.layers\.0\.self_attn\.k_proj"
                     r"\.weight' \(for leaf 'layers/self_attn/k_proj/kernel'.*missing"):
    weights.load_safetensors(f, plan, llama.hf_mapping(cfg))


def test_extra_tensor_is_named_unless_allowed(hf_dir, stage3, tmp_path):
  cfg, plan = stage3
  sd = dict(hf_dir[3])
  sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros((8,), np.float32)
  f = _write(tmp_path / "extra.safetensors", sd)
  with pytest.raises(weights.WeightsError, match=r"not used by any leaf.*rotary_emb\.inv_freq"):
    weights.load_safetensors(f, plan, llama.hf_mapping(cfg))
  tree = weights.load_safetensors(f, plan, llama.hf_mapping(cfg), allow_extra=[r"inv_freq$"])
  assert len(jax.tree.leaves(tree)) == len(plan.leaves)


def test_dtype_mismatch_named_and_cast_on_request(hf_dir, stage3, tmp_path):
  import ml_dtypes
  cfg, plan = stage3
  sd = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_dir[3].items()}
  f = _write(tmp_path / "bf16.safetensors", sd)
  with pytest.raises(weights.WeightsError, match=r"has dtype bfloat16, the leaf is float32 \(pass cast=True"):
    weights.load_safetensors(f, plan, llama.hf_mapping(cfg))
  tree = weights.load_safetensors(f, plan, llama.hf_mapping(cfg), cast=True)
  x = np.asarray(tree["norm"]["scale"])
  np.testing.assert_array_equal(x, sd["model.norm.weight"].astype(np.float32))


def test_place_mismatched_tree_names_leaf_and_shapes(stage3):
  cfg, plan = stage3
  tree = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                      nnx.to_pure_dict(nnx.state(abstract_llama(cfg), nnx.Param)))
  tree["norm"]["scale"] = np.zeros((65,), np.float32)
  with pytest.raises(weights.WeightsError, match=r"'norm/scale' has shape \(65,\), the model "
                     r"needs \(64,\)"):
    weights.place(tree, plan)


# -- existing parameters into the plan ------------------------------------------------------------


def test_create_nnx_from_checkpoint_trains(hf_dir):
  d, tokens, ref, _ = hf_dir
  cfg = llama.from_hf_config(d)
  src = weights.safetensors_source(d, llama.hf_mapping(cfg))
  model, opt, plan = zerojax.create_nnx(lambda: llama.Llama(cfg, nnx.Rngs(0)),
                                        optax.adam(1e-2), config=zerojax.ZeroConfig(stage=3),
                                        params=src)
  np.testing.assert_allclose(np.asarray(jax.jit(lambda m, t: m(t))(model, tokens)), ref,
                             atol=1e-4, rtol=0)
  k = model.layers.mlp.up_proj.kernel[...]
  assert k.sharding.spec == jax.tree.leaves(plan.params)[
      [lp.path for lp in plan.leaves].index("layers/mlp/up_proj/kernel")].spec
  mu = opt.opt_state[0].mu.layers.mlp.up_proj.kernel[...]
  assert mu.sharding.spec == k.sharding.spec and not np.asarray(mu).any()

  @zerojax.zero_step(plan)
  def step(model, opt, batch):
    def lf(m):
      return zerojax.models.loss_fn(m(batch["x"]), batch["y"])
    loss, grads = nnx.value_and_grad(lf)(model)
    opt.update(model, grads)
    return {"loss": loss}

  batch = {"x": jnp.asarray(np.tile(tokens[:, :-1], (4, 1))),
           "y": jnp.asarray(np.tile(tokens[:, 1:], (4, 1)))}
  losses = [float(step(model, opt, batch)["loss"]) for _ in range(3)]
  assert losses[-1] < losses[0]


def test_create_train_state_from_numpy_params():
  from zerojax.models import GPT, GPTConfig
  mcfg = GPTConfig(num_layers=2, d_model=32, num_heads=2, seq_len=16)
  model, sample = GPT(mcfg), jnp.zeros((8, 16), jnp.int32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), sample)["params"])
  rs = np.random.RandomState(0)
  given = jax.tree.map(lambda s: rs.standard_normal(s.shape).astype(np.float32), shapes)
  state, plan = zerojax.create_train_state(model, optax.adam(1e-3), jax.random.key(1), sample,
                                           config=zerojax.ZeroConfig(stage=3), params=given)
  for a, b, sh in zip(jax.tree.leaves(state.params), jax.tree.leaves(given),
                      jax.tree.leaves(plan.params)):
    np.testing.assert_array_equal(np.asarray(a), b)
    assert a.sharding == sh
  bad = jax.tree.map(lambda x: x, given)
  bad["head"]["kernel"] = np.zeros((3, 3), np.float32)
  with pytest.raises(weights.WeightsError, match=r"'head/kernel' has shape \(3, 3\)"):
    zerojax.create_train_state(model, optax.adam(1e-3), jax.random.key(1), sample,
                               config=zerojax.ZeroConfig(stage=3), params=bad)


# -- frozen parameters (LoRA) ---------------------------------------------------------------------


def test_frozen_leaves_cost_only_their_shard(hf_dir):
  """LoRA at stage 3: the frozen base weights are sharded like the rest, and the compiled step
  holds exactly their shards: no gradient buffers (temp) and no optimizer state for them."""
  d = hf_dir[0]
  base = llama.from_hf_config(d)
  cfg = llama.from_hf_config(d, lora_rank=4)
  batch = {"x": jnp.zeros((8, 16), jnp.int32), "y": jnp.zeros((8, 16), jnp.int32)}
  out = {}
  for name, wrt in (("lora", nnx.LoRAParam), ("full", nnx.Param)):
    src = weights.safetensors_source(d, llama.hf_mapping(base), skip="lora_")
    model, opt, plan = zerojax.create_nnx(lambda: llama.Llama(cfg, nnx.Rngs(0)),
                                          optax.adam(1e-3), config=zerojax.ZeroConfig(stage=3),
                                          wrt=wrt, params=src)

    @zerojax.zero_step(plan)
    def step(model, opt, batch, wrt=wrt):
      def lf(m):
        return zerojax.models.loss_fn(m(batch["x"]), batch["y"])
      loss, grads = nnx.value_and_grad(lf, argnums=nnx.DiffState(0, wrt))(model)
      opt.update(model, grads)
      return {"loss": loss}

    ma = step.lower(model, opt, batch).compile().memory_analysis()
    out[name] = (plan, ma, model)
  plan, ma, model = out["lora"]
  frozen = [lp for lp in plan.leaves if not lp.trainable]
  assert frozen and all("lora_" not in lp.path for lp in frozen)
  assert all("lora_" in lp.path for lp in plan.leaves if lp.trainable)
  k = model.layers.mlp.up_proj.kernel[...]  # frozen, and still sharded at stage 3
  assert "fsdp" in str(k.sharding.spec) and k.addressable_shards[0].data.size == k.size // 8
  assert "frozen" in plan.table() and "sharded, frozen" in plan.table()
  b = plan.bytes_per_device()
  frozen_shards = sum(lp.nbytes // (8 if lp.is_sharded else 1) for lp in frozen)
  batch_bytes = 2 * 8 * 16 * 4 // 8
  # Arguments: every parameter shard, the adapters' Adam state, the batch shard and the two
  # step counters (optimizer step, Adam count): nothing else.
  assert ma.argument_size_in_bytes == b["params"] + b["opt_state"] + batch_bytes + 4
  lora_only = b["params"] - frozen_shards
  assert b["grads"] == lora_only and b["opt_state"] == 2 * lora_only + 4
  full_plan, full_ma, _ = out["full"]
  fb = full_plan.bytes_per_device()
  assert full_ma.argument_size_in_bytes - ma.argument_size_in_bytes == \
      fb["opt_state"] - b["opt_state"]
  # Full fine-tuning needs at least the frozen leaves' gradient shards more temporaries.
  assert full_ma.temp_size_in_bytes - ma.temp_size_in_bytes >= frozen_shards
  est = memory.estimate(nnx.state(abstract_llama(cfg), nnx.Param),
                                opt_state=jax.eval_shape(lambda: opt_shapes(cfg)),
                                config=zerojax.ZeroConfig(stage=3), num_devices=8,
                                trainable=lambda p: "lora_" in p)
  assert est.grads == b["grads"] and est.params == b["params"]
  assert set(est.frozen) == {lp.path for lp in frozen}


def opt_shapes(cfg):
  model = llama.Llama(cfg, nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)
  return nnx.to_pure_dict(nnx.state(opt))["opt_state"]


# -- the fine-tuning example: stage 3 + offload, checkpoint, resume, export ------------------------


def _example():
  import importlib.util
  path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples",
                      "finetune_llama.py")
  spec = importlib.util.spec_from_file_location("finetune_llama_example", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _losses(out):
  with open(out / "metrics.jsonl") as f:
    return [json.loads(line)["loss"] for line in f]


def _trained_logits(ex, out, tokens, lora=0):
  """Logits of the zerojax model restored from the run's last checkpoint."""
  from zerojax.runtime.checkpoint import Checkpointer
  cfg = llama.from_hf_config(out / "base", lora_rank=lora, lora_alpha=16.0)
  config = zerojax.ZeroConfig(stage=3)
  wrt = nnx.LoRAParam if lora else nnx.Param
  tx = ex.make_optimizer(1e-3, 6)
  make = lambda: llama.Llama(cfg, nnx.Rngs(0))
  with jax.set_mesh(zerojax.make_mesh(config)):
    abstract = nnx.eval_shape(lambda: (lambda m: (m, nnx.Optimizer(m, tx, wrt=wrt)))(make()))
  with Checkpointer(out / "ckpt", read_only=True) as ckpt:
    model, _, _ = zerojax.create_nnx(make, tx, config=config, wrt=wrt,
                                     params=ex.Resume(ckpt, ex.checkpoint_item(*abstract)))
  return np.asarray(jax.jit(lambda m, t: m(t))(model, tokens))


def _hf_logits(path, tokens):
  m = transformers.LlamaForCausalLM.from_pretrained(path).float().eval()
  with torch.no_grad():
    return m(torch.tensor(tokens)).logits.numpy()


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory):
  ex = _example()
  base = ["--steps", "6", "--save-every", "3", "--batch", "8", "--seq-len", "32"]
  resumed = tmp_path_factory.mktemp("resumed")
  assert ex.main(["--out-dir", str(resumed), "--stop-after", "3"] + base) == 0
  assert not (resumed / "hf").exists() and (resumed / "ckpt" / "3").is_dir()
  assert ex.main(["--out-dir", str(resumed)] + base) == 0  # resumes at step 3
  straight = tmp_path_factory.mktemp("straight")
  assert ex.main(["--out-dir", str(straight)] + base) == 0
  lora = tmp_path_factory.mktemp("lora")
  assert ex.main(["--out-dir", str(lora), "--lora", "4", "--lr", "1e-2"] + base) == 0
  return ex, resumed, straight, lora


def test_example_finetunes_resumes_and_exports(example_runs):
  ex, resumed, straight, _ = example_runs
  losses = _losses(resumed)
  assert len(losses) == 6 and losses[-1] < losses[0] - 0.3
  # Resuming from the step-3 checkpoint continues exactly as the uninterrupted run.
  np.testing.assert_allclose(losses, _losses(straight), rtol=1e-5)
  tokens = np.random.RandomState(1).randint(0, 256, (2, 24))
  ours = _trained_logits(ex, resumed, tokens)
  theirs = _hf_logits(resumed / "hf", tokens)
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
  # The fine-tuned model is not the base model.
  assert np.abs(_hf_logits(resumed / "base", tokens) - theirs).max() > 1e-2
  with open(resumed / "hf" / "config.json") as f:
    assert json.load(f)["architectures"] == ["LlamaForCausalLM"]


def test_example_lora_exports_merged_adapters(example_runs):
  ex, _, _, lora = example_runs
  losses = _losses(lora)
  assert losses[-1] < losses[0]
  tokens = np.random.RandomState(2).randint(0, 256, (2, 24))
  ours = _trained_logits(ex, lora, tokens, lora=4)
  theirs = _hf_logits(lora / "hf", tokens)
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
  assert np.abs(_hf_logits(lora / "base", tokens) - theirs).max() > 1e-3


def test_given_params_compile_no_init(monkeypatch):
  """With every parameter given, the jitted creation has no random init left (XLA removed
  the model's dead init): its compiled HLO has no RNG, unlike a fresh init's."""
  cfg = llama.LlamaConfig()
  texts = []
  real_jit = jax.jit

  def spy(f=None, **kw):
    if f is None:
      return lambda g: spy(g, **kw)
    j = real_jit(f, **kw)

    def call(*a):
      texts.append(j.lower(*a).compile().as_text())
      return j(*a)
    return call

  given = jax.tree.map(lambda s: np.ones(s.shape, s.dtype),
                       nnx.to_pure_dict(nnx.state(abstract_llama(cfg), nnx.Param)))
  monkeypatch.setattr(jax, "jit", spy)
  rng_ops = lambda t: sum(t.count(k) for k in ("rng-bit-generator", "threefry", "random"))
  model, _, _ = zerojax.create_nnx(lambda: llama.Llama(cfg, nnx.Rngs(0)), optax.adam(1e-3),
                                   config=zerojax.ZeroConfig(stage=3), params=given)
  assert len(texts) == 1 and rng_ops(texts[0]) == 0
  np.testing.assert_array_equal(np.asarray(model.layers.mlp.up_proj.kernel[...]), 1.0)
  zerojax.create_nnx(lambda: llama.Llama(cfg, nnx.Rngs(0)), optax.adam(1e-3),
                     config=zerojax.ZeroConfig(stage=3))
  assert len(texts) == 2 and rng_ops(texts[1]) > 0


def test_cli_export_hf(example_runs, tmp_path, capsys):
  from safetensors.numpy import load_file
  from zerojax.tools import cli
  _, resumed, _, lora = example_runs
  out = tmp_path / "hf"
  assert cli.main(["export", str(resumed / "ckpt"), str(out), "--hf-config",
                   str(resumed / "base")]) == 0
  ours, theirs = load_file(out / "model.safetensors"), load_file(resumed / "hf" /
                                                                  "model.safetensors")
  assert sorted(ours) == sorted(theirs) and "model.layers.1.mlp.down_proj.weight" in ours
  for k in ours:
    np.testing.assert_array_equal(ours[k], theirs[k])
  # A LoRA checkpoint records its adapters' alpha: no --lora-alpha needed, same tensors.
  assert cli.main(["export", str(lora / "ckpt"), str(tmp_path / "x"), "--hf-config",
                   str(lora / "base")]) == 0
  ours, theirs = load_file(tmp_path / "x" / "model.safetensors"), load_file(
      lora / "hf" / "model.safetensors")
  assert sorted(ours) == sorted(theirs)
  for k in ours:
    np.testing.assert_array_equal(ours[k], theirs[k])
  # Another alpha than the recorded one is refused (bad input).
  assert cli.main(["export", str(lora / "ckpt"), str(tmp_path / "y"), "--hf-config",
                   str(lora / "base"), "--lora-alpha", "4"]) == 2
  assert "differs from the alpha 16.0 recorded" in capsys.readouterr().err


def test_bf16_compute_and_params(hf_dir):
  d, tokens, ref, _ = hf_dir
  cfg = llama.from_hf_config(d, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  plan = plan_for(cfg, zerojax.ZeroConfig(stage=3))
  assert {np.dtype(lp.dtype).name for lp in plan.leaves} == {"bfloat16"}
  tree = weights.load_safetensors(d, plan, llama.hf_mapping(cfg), cast=True)
  got = logits_of(cfg, tree, tokens)
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, ref, atol=0.1, rtol=0)  # bf16 rounding, same model
  assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.99
