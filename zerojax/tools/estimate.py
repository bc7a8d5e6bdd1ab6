"""Will it fit, and which stage: ZeRO model-state estimates per option, the lowest-communication
option that fits a per-device budget (by the estimate, or by the compiled step's peak), and
the table and plot `zerojax estimate` prints. The numbers come from `zerojax.runtime.memory`;
this module adds what names a model or config by a string: GPT presets, Hugging Face models
(the `zerojax.models.hf_presets.HF_PRESETS` names, a model directory, its ``config.json`` or a
Hub id: `hf_model_config`) and config files (`compile_for_topology`, `preset_model`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core import meta
from jax.sharding import AbstractMesh, AxisType

from zerojax.core.config import ConfigError, HostOffload, ZeroConfig
from zerojax.core.mesh import mesh_shape
from zerojax import ShardingPlan, zero_step
from zerojax.models import GPT, PRESETS
from zerojax.runtime import gpu, memory, step_time
from zerojax.core.create import abstract_train_state
from zerojax.tools.config_file import load_config
from zerojax.tools.train.metrics import require

__all__ = ["fmt_bytes", "Option", "COMM", "paper_options", "model_options",
           "recommend", "recommend_compiled", "format_table", "plot_options", "model_shapes",
           "step_peak", "preset_options", "abstract_plan", "preset_model", "compile_for_topology",
           "hf_model_config", "model_names", "model_seq_len"]


def model_names() -> str:
  """What ``--model`` takes, for messages."""
  from zerojax.models.hf_presets import HF_PRESETS
  return (f"a GPT preset {sorted(PRESETS)}, a Hugging Face preset {sorted(HF_PRESETS)}, a "
          "Hugging Face model directory, its config.json, or a Hub id (org/name)")


def hf_model_config(name: Any) -> dict | None:
  """The ``config.json`` facts of a Hugging Face model named by ``name``: a preset of
  `zerojax.models.hf_presets.HF_PRESETS`, a model directory, a ``config.json`` file, or a Hub
  id (through `zerojax.tools.hub.resolve_model_dir`); ``None`` for a GPT preset.

  Raises:
    ConfigError: ``name`` is none of these.
  """
  from zerojax.models import llama
  from zerojax.models.hf_presets import HF_PRESETS
  if not isinstance(name, str) or name in PRESETS:
    return None
  if name in HF_PRESETS:
    return dict(HF_PRESETS[name])
  path = name
  if not os.path.exists(path):
    from zerojax.tools.hub import resolve_model_dir  # a Hub id: the cache or a download
    try:
      path = resolve_model_dir(name)
    except ConfigError as e:
      raise ConfigError(f"--model {name!r} is unknown ({e}); it takes {model_names()}") from None
  cfg_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.isfile(cfg_file):
    raise ConfigError(f"--model {name!r} is unknown: it takes {model_names()}")
  try:
    return llama.read_hf_config(cfg_file)
  except (OSError, ValueError) as e:
    raise ConfigError(f"--model {name!r}: {cfg_file!r} is not a readable config.json ({e})") \
        from None


def _hf_llama_config(d: dict, config: ZeroConfig, name: str, platform: str = "cpu") -> Any:
  """The `zerojax.models.llama.LlamaConfig` of a Hugging Face config in ``config``'s dtypes,
  with the attention ``platform``'s devices compute fastest
  (`zerojax.models.llama.fused_attention`)."""
  from zerojax.models import llama
  try:
    cfg = llama.from_hf_config(d, dtype=jnp.dtype(config.compute_dtype),
                               param_dtype=jnp.dtype(config.param_dtype))
    return dataclasses.replace(cfg, attention=llama.fused_attention(
        platform, cfg.dtype, cfg.sliding_window))
  except (ValueError, KeyError) as e:
    raise ConfigError(f"--model {name!r}: {e}") from None


def attention_note(model: Any) -> str | None:
  """How a Hugging Face preset's attention is computed, for a command to print; None for
  other models."""
  cfg = getattr(model, "cfg", None)
  if getattr(cfg, "attention", None) == "cudnn":
    return "attention: cuDNN's fused kernel (jax.nn.dot_product_attention), memory linear in " \
           "the sequence"
  if getattr(cfg, "attention", None) == "xla":
    return ("attention: scores materialised (XLA's own; cuDNN's fused kernel needs XLA:GPU, "
            "bfloat16 or float16 and no sliding window), memory quadratic in the sequence")
  return None


def model_seq_len(name: str, seq: int | None = None) -> int:
  """The sequence length a step of ``name`` is compiled for: ``seq``, else a GPT preset's own,
  else a Hugging Face model's ``max_position_embeddings`` up to 2048."""
  if seq:
    return seq
  if name in PRESETS:
    return PRESETS[name].seq_len
  d = hf_model_config(name)
  if d is None:
    raise ConfigError(f"--model {name!r} is unknown: it takes {model_names()}")
  return min(int(d.get("max_position_embeddings", 2048)), 2048)


def fmt_bytes(n: float) -> str:
  """Decimal units as in the ZeRO paper (GB = 1e9 bytes)."""
  for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if abs(n) >= div:
      return f"{n / div:.1f} {unit}"
  return f"{n:.0f} B"


@dataclasses.dataclass(frozen=True)
class Option:
  """One memory/communication option of `estimate_options`."""

  name: str
  stage: int
  offload_optimizer: bool
  offload_params: bool
  params: float
  grads: float
  opt_state: float
  host: float
  comm: str  # communication volume per step, in the paper's units
  comm_rank: int  # order by communication (lower is less)

  @property
  def device(self) -> float:
    return self.params + self.grads + self.opt_state


COMM = {0: "2Ψ all-reduce", 1: "2Ψ (reduce-scatter + all-gather)",
        2: "2Ψ (reduce-scatter + all-gather)", 3: "3Ψ (2 all-gathers + reduce-scatter)"}


def _shards(o: Option) -> str:
  """What an option shards, as the table's column names it."""
  if o.offload_optimizer or o.offload_params:
    return "offload"
  c = ZeroConfig(stage=o.stage)
  return ("+ parameters" if c.shards_params else "+ gradients" if c.shards_grads else
          "optimizer state" if c.shards_opt_state else "nothing")


def paper_options(psi: float, n: int, k: int = 12) -> list[Option]:
  """The ZeRO paper's per-device model-state bytes (fp16 params/grads, K bytes of optimizer
  state per parameter), for stages 0-3 and stage 3 with offload."""
  opts = []
  for s in range(4):
    total = memory.paper_bytes(psi, s, n, k)
    c = ZeroConfig(stage=s)
    p = 2 * psi / (n if c.shards_params else 1)
    g = 2 * psi / (n if c.shards_grads else 1)
    o = total - p - g
    opts.append(Option(f"stage {s}", s, False, False, p, g, o, 0.0, COMM[s], s))
  p, g, o = 2 * psi / n, 2 * psi / n, k * psi / n
  opts.append(Option("stage 3 + offload_optimizer", 3, True, False, p, g, 0.0, o,
                     COMM[3] + " + optimizer shard over PCIe", 4))
  opts.append(Option("stage 3 + offload_optimizer + offload_params", 3, True, True, 0.0, g, 0.0,
                     o + p, COMM[3] + " + optimizer and parameter shards over PCIe", 5))
  return opts


def model_options(params: Any, tx: Any, config: ZeroConfig, n: int) -> list[Option]:
  """`paper_options` for a real parameter tree and optimizer (`zerojax.runtime.memory.estimate`)."""
  out = []
  variants = [(f"stage {s}", s, False, False) for s in range(4)]
  variants += [("stage 3 + offload_optimizer", 3, True, False),
               ("stage 3 + offload_optimizer + offload_params", 3, True, True)]
  for rank, (name, s, oo, op) in enumerate(variants):
    cfg = config.replace(stage=s, offload=HostOffload(oo, op) if oo or op else None)
    e = memory.estimate(params, tx, config=cfg, num_devices=n)
    comm = COMM[s] + ("" if not oo else " + optimizer shard over PCIe" if not op else
                      " + optimizer and parameter shards over PCIe")
    out.append(Option(name, s, oo, op, e.params, e.grads, e.opt_state, e.host, comm, rank))
  return out


def recommend(options: Sequence[Option], budget: float) -> tuple[Option | None, list[str]]:
  """The lowest-communication option whose device-resident model state fits ``budget``.

  Order: stage 0 < 1 < 2 (2Ψ each; at equal communication the lower stage wins, it has fewer
  collectives and no per-layer scheduling) < 3 (3Ψ) < 3 + offload_optimizer < + offload_params
  (host transfers each step). Returns the option (None if nothing fits) and the reasoning.
  """
  why = []
  for o in sorted(options, key=lambda o: o.comm_rank):
    if o.device <= budget:
      why.append(f"{o.name}: {fmt_bytes(o.device)} per device fits {fmt_bytes(budget)} "
                 f"({fmt_bytes(budget - o.device)} left for activations and temporaries)")
      return o, why
    why.append(f"{o.name}: {fmt_bytes(o.device)} per device does not fit "
               f"({fmt_bytes(o.device - budget)} over)")
  return None, why


def recommend_compiled(options: Sequence[Option], budget: float,
                       peak: Any) -> tuple[Option | None, list[str], dict[str, int]]:
  """`recommend` by the compiled step's peak: the lowest-communication option whose model
  state fits ``budget`` *and* whose compiled step (``peak(option) -> bytes``) fits too.
  ``peak`` may also return ``(bytes, note)``: the note (e.g. which formulation gave the peak)
  follows the option's line.

  Options whose model state alone exceeds the budget are not compiled. Returns the option,
  the reasoning and the compiled peaks measured (by option name).
  """
  why, peaks = [], {}
  for o in sorted(options, key=lambda o: o.comm_rank):
    if o.device > budget:
      why.append(f"{o.name}: model state {fmt_bytes(o.device)} per device does not fit "
                 f"({fmt_bytes(o.device - budget)} over); not compiled")
      continue
    p, note = peak(o), None
    if isinstance(p, tuple):
      p, note = p
    peaks[o.name] = p
    head = (f"{o.name}: model state {fmt_bytes(o.device)} (estimate), compiled step peak "
            f"{fmt_bytes(p)} per device (XLA{', ' + note if note else ''})")
    if p <= budget:
      why.append(f"{head} fits ({fmt_bytes(budget - p)} left)")
      return o, why, peaks
    why.append(f"{head} does not fit ({fmt_bytes(p - budget)} over: activations and "
               "temporaries come on top of the model state)")
  return None, why, peaks


def format_table(options: Sequence[Option], title: str) -> str:
  rows = [("option", "shards", "params", "grads", "optimizer", "device total", "host",
           "communication/step")]
  for o in options:
    rows.append((o.name, _shards(o), fmt_bytes(o.params), fmt_bytes(o.grads), fmt_bytes(o.opt_state),
                 fmt_bytes(o.device), fmt_bytes(o.host) if o.host else "-", o.comm))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  right = {2, 3, 4, 5, 6}
  line = lambda r: "  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip()
  return "\n".join([title, line(rows[0]), line(tuple("-" * w for w in widths))]
                   + [line(r) for r in rows[1:]])


def plot_options(options: Sequence[Option], path: str, title: str,
                 budget: float | None = None) -> str:
  """Stacked bars (params, grads, optimizer state) of device memory per option."""
  matplotlib = require("matplotlib", "zerojax estimate --plot")
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # optional: the train extra
  names = [o.name.replace(" + ", "\n+ ") for o in options]
  gb = lambda xs: [x / 1e9 for x in xs]
  p, g, s = gb([o.params for o in options]), gb([o.grads for o in options]), \
      gb([o.opt_state for o in options])
  fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(options)), 4.2), dpi=120)
  x = range(len(options))
  ax.bar(x, p, label="parameters", color="#4477aa")
  ax.bar(x, g, bottom=p, label="gradients", color="#66ccee")
  ax.bar(x, s, bottom=[a + b for a, b in zip(p, g)], label="optimizer state", color="#ee6677")
  for i, o in enumerate(options):
    ax.text(i, o.device / 1e9, f"{o.device / 1e9:.1f} GB", ha="center", va="bottom", fontsize=8)
  if budget is not None:
    ax.axhline(budget / 1e9, color="k", ls="--", lw=1, label=f"budget {fmt_bytes(budget)}")
  ax.set_xticks(list(x), names, fontsize=7)
  ax.set_ylabel("model state per device (GB)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return path


def model_shapes(preset: str, config: ZeroConfig):
  """``(model, its config, abstract parameters)`` of a GPT preset, or of a Hugging Face model
  (`hf_model_config`; the model `zerojax.models.hf_presets.LinenLlama`, its config's
  ``seq_len`` from `model_seq_len`), in the config's dtypes."""
  if preset not in PRESETS:
    d = hf_model_config(preset)
    if d is None:
      raise ConfigError(f"--model {preset!r} is unknown: it takes {model_names()}")
    from zerojax.models.hf_presets import LinenLlama
    cfg = _hf_llama_config(d, config, preset)
    model = LinenLlama(cfg)
    seq = model_seq_len(preset)
    shapes = jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"],
                            jax.ShapeDtypeStruct((1, 1), jnp.int32))
    return model, _HFShape(cfg, seq), meta.unbox(shapes)
  mcfg = dataclasses.replace(PRESETS[preset], dtype=jnp.dtype(config.compute_dtype))
  model = GPT(mcfg)
  tokens = jax.ShapeDtypeStruct((1, mcfg.seq_len), jnp.int32)
  shapes = jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)
  pdtype = jnp.dtype(config.param_dtype)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, pdtype)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, meta.unbox(shapes))
  return model, mcfg, shapes


@dataclasses.dataclass(frozen=True)
class _HFShape:
  """A Hugging Face model's config where `step_peak` reads a GPT preset's (``seq_len``)."""
  llama: Any
  seq_len: int


def preset_options(preset: str, config: ZeroConfig, n: int) -> tuple[list[Option], int]:
  """`model_options` of a GPT preset under AdamW, and its parameter count."""
  _, _, shapes = model_shapes(preset, config)
  return model_options(shapes, optax.adamw(1e-3), config, n), memory.num_params(shapes)


def abstract_plan(preset: str, config: ZeroConfig, n: int) -> tuple[ShardingPlan, int]:
  """The plan of a GPT preset under AdamW over ``n`` devices that need not exist (an abstract
  mesh), and its parameter count."""
  shape = mesh_shape(config.mesh_shape, config.mesh_axes, n)
  mesh = AbstractMesh(shape, config.mesh_axes, axis_types=(AxisType.Auto,) * len(shape))
  _, _, shapes = model_shapes(preset, config)
  plan = ShardingPlan.create(config, mesh, shapes, tx=optax.adamw(1e-3))
  return plan, memory.num_params(shapes)


def step_peak(preset: str, config: ZeroConfig, batch: int, seq: int | None = None) -> int:
  """Per-device peak of the GPT training step (`zerojax.tools.train`'s step: AdamW, the config's
  stage, offload, remat and batch sizes) for ``batch`` rows of ``seq`` tokens, from XLA's
  memory analysis of the compiled step (arguments + outputs - aliased + temporaries).

  The step is lowered and compiled on abstract state: nothing is allocated. The mesh is
  ``config``'s over this machine's devices; a config without batch sizes gets ``batch`` rows.
  """
  model, mcfg, _ = model_shapes(preset, config)
  seq = seq or mcfg.seq_len
  longest = (mcfg.llama.max_position_embeddings if isinstance(mcfg, _HFShape) else mcfg.seq_len)
  if seq > longest:
    raise ConfigError(f"--seq {seq} is longer than the {preset} model's seq_len {longest}")
  if (config.train_batch_size, config.micro_batch_per_device) == (None, None):
    config = config.replace(batch=dataclasses.replace(config.batch, global_size=batch))  # before the mesh: abstract_train_state's
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  state, plan = abstract_train_state(model, optax.adamw(1e-3), jax.random.key(0), tokens,
                                     config=config)
  train_step = zero_step(plan)(memory.lm_train_step)
  b = plan.bytes_per_device()
  compiled = train_step.lower(state, {"x": tokens, "y": tokens}).compile()
  return memory.compiled_peak(compiled,
                              host_resident=b["params_host"] + b["opt_state_host"])[0]


def preset_model(model: Any, config: ZeroConfig, seq_len: Any = None,
                 platform: str = "cpu") -> Any:
  """A Flax module as it is, or the preset of that name in ``config.compute_dtype``: a GPT
  (its position table ``seq_len`` long when given) or a Hugging Face model (its attention
  the one ``platform``'s devices compute fastest)."""
  if not isinstance(model, str):
    return model
  if model not in PRESETS:
    d = hf_model_config(model)
    if d is None:
      raise ValueError(f"model={model!r} is unknown: {model_names()} (or pass a Flax linen "
                       "module)")
    from zerojax.models.hf_presets import LinenLlama
    cfg = _hf_llama_config(d, config, model, platform)
    if isinstance(seq_len, (int, np.integer)) and seq_len > cfg.max_position_embeddings:
      raise ConfigError(f"--seq {seq_len} is longer than {model}'s max_position_embeddings "
                        f"{cfg.max_position_embeddings}")
    return LinenLlama(cfg)
  cfg = dataclasses.replace(PRESETS[model], dtype=jnp.dtype(config.compute_dtype))
  if isinstance(seq_len, (int, np.integer)) and seq_len > 0:  # position table = sequence
    cfg = dataclasses.replace(cfg, seq_len=int(seq_len))
  return GPT(cfg)


def compile_for_topology(config: ZeroConfig | str | os.PathLike, model: Any, batch: Any,
                         topology: str, **kwargs: Any) -> memory.TopologyCompile:
  """Compiles the real train step for a TPU or GPU topology ahead of time, on any machine.

  `zerojax.runtime.memory.compile_for_topology`, with a config file and a model name accepted
  as well. A Hugging Face preset compiles as ``zerojax finetune`` trains it: the NNX model, its
  scanned layers gathered per use.

  Args:
    config: a `ZeroConfig`, or the path of a zerojax or DeepSpeed config file.
    model: a Flax linen module, a function making an NNX module, or a preset name
      (``zerojax.models.PRESETS`` or a Hugging Face preset; compute dtype from
      ``config.compute_dtype``, position table as long as ``batch``'s sequence).
    batch: ``(rows, seq_len)`` for a token model, or a pytree of ``jax.ShapeDtypeStruct``.
    topology: a TPU slice such as ``'v5e:8x8'`` or a GPU pod such as ``'h100:8'``.
    **kwargs: that function's keyword arguments (``tx``, ``train_step``, ``init_args``,
      ``compiler_options``, ``memory_fraction``, ``model_flops``, ``predictor``); the
      predictor defaults to `zerojax.runtime.step_time.predict_compiled`.

  Returns:
    The `zerojax.runtime.memory.TopologyCompile`.

  Raises:
    ValueError: an unknown model name, or an invalid topology or batch.
    ConfigError: the config file is invalid, or the sequence is longer than the preset's
      position table.
  """
  if not isinstance(config, ZeroConfig):
    config = load_config(config, apply_xla_flags=False).config
  seq_len = batch[1] if isinstance(batch, tuple) and len(batch) == 2 else None
  platform = "gpu" if gpu.is_gpu_topology(topology) else "tpu"
  module = preset_model(model, config, seq_len, platform)
  if isinstance(model, str) and model not in PRESETS:
    # A Hugging Face model compiles as `zerojax finetune` trains it: the NNX model itself, its
    # scanned layers gathered per use (the linen wrapper's one parameter entry would be
    # gathered whole).
    from flax import nnx
    from zerojax.models import llama
    cfg = module.cfg
    module = lambda: llama.Llama(cfg, nnx.Rngs(0))
  kwargs.setdefault("predictor", step_time.predict_compiled)
  return memory.compile_for_topology(config, module, batch, topology, **kwargs)
