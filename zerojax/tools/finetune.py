"""``zerojax finetune MODEL_DIR --data train.jsonl [CONFIG] [key=value ...]``: fine-tune a
Hugging Face checkpoint (Llama, Qwen2, Qwen3, Mistral) on local data, end to end.

* The model is read from the directory's ``config.json`` and safetensors straight into its
  ZeRO shards (`zerojax.models.llama`, `zerojax.runtime.weights`); ``--lora RANK`` trains
  LoRA adapters only (the base weights frozen, with no gradient or optimizer state).
* The data is tokenized with the directory's own tokenizer and chat template
  (`zerojax.tools.hf_data`): packed rows whose documents do not see each other (or one
  document per row, ``--packing pad``), the loss on the assistant's tokens for chat data.
* The run is `zerojax.tools.train.train`'s loop (a `zerojax.tools.train.Task`): the same
  progress bar, ``metrics.jsonl``, TensorBoard run, checkpoints and exact resume as
  ``zerojax train``; with ``--eval-data``, ``eval_loss`` and ``eval_ppl`` every
  ``--eval-every`` steps.
* It ends with a Hugging Face export (`zerojax.tools.export.export`): the base's config,
  generation config and tokenizer carried over, LoRA adapters merged.

CONFIG is a zerojax YAML/JSON or a DeepSpeed ``ds_config.json`` (as an HF Trainer run writes
it): its ``"auto"`` values take this command's settings (``lr=``, ``batch=``, ...). Its
``"fp16"`` section (or ``compute_dtype=float16 loss_scale=0``) trains with `zerojax train`'s
dynamic loss scaling (`zerojax.core.train_state`), LoRA or full, accumulated or not; the scale
is printed (`precision_note`, each log line) and checkpointed with the optimizer state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.experimental import multihost_utils

from zerojax import create_nnx, value_and_grad, zero_step
from zerojax.core import agreement, distributed, memory_kinds, offload
from zerojax.core.config import ConfigError, read_config_file
from zerojax.tools.bounds import FINETUNE_BOUNDS
from zerojax.tools.hub import resolve_model_dir
from zerojax.core.train_state import nnx_loss_scaling
from zerojax.models import llama
from zerojax.runtime import nvme, weights
from zerojax.runtime.extras import check
from zerojax.runtime.checkpoint import Checkpointer
from zerojax.tools import hf_data
from zerojax.tools.config_file import load_config, parse_overrides
from zerojax.tools.export import export
from zerojax.tools.options import TrainOptions, resolve_outputs
from zerojax.tools.train import Task, is_main_process, log, setup_cpu_devices, train
from zerojax.tools.train import processes

__all__ = ["FinetuneOptions", "finetune", "finetune_task", "run", "DEFAULTS",
           "resolve_model_dir", "precision_note"]

# The training options' defaults for fine-tuning (`zerojax train`'s suit a tiny GPT from
# scratch); any of them given on the command line or in the config file wins.
DEFAULTS = {"steps": 100, "batch": 8, "seq_len": 512, "weight_decay": 0.0, "warmup_steps": 0,
            "out_dir": "runs/finetune", "checkpoint_every": 50}
LR_FULL, LR_LORA = 1e-5, 2e-4


@dataclasses.dataclass
class FinetuneOptions:
  """What ``zerojax finetune`` adds to `zerojax.tools.train.TrainOptions`.

  Attributes:
    model_dir: the Hugging Face checkpoint directory (config.json, safetensors, tokenizer), or
      a Hub id (`resolve_model_dir`: the local cache, or a download).
    data: the training file (``.jsonl``, ``.parquet`` or ``.txt``).
    eval_data: an evaluation file (same formats), or None.
    eval_every: steps between evaluations (also at the first and the last step).
    packing: ``'pack'`` (documents packed into rows, kept apart by segment ids) or ``'pad'``.
    lora: LoRA rank (0: full fine-tuning).
    lora_alpha, lora_targets: LoRA's scale numerator and the projections it adapts.
    remat: recompute each layer's activations in the backward pass.
    export_dir: where the Hugging Face export goes (default ``out_dir/hf``); None with
      ``export=False`` for none.
  """

  model_dir: str
  data: str
  eval_data: str | None = None
  eval_every: int = 50
  packing: str = "pack"
  lora: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
  remat: bool = True
  export: bool = True
  export_dir: str | None = None

  def __post_init__(self):
    for f, bound in FINETUNE_BOUNDS.items():
      bound.check(f"--{f.replace('_', '-')}", getattr(self, f))
    self.model_dir = resolve_model_dir(os.fspath(self.model_dir))
    if not os.path.isfile(os.path.join(self.model_dir, "config.json")):
      raise ConfigError(f"model_dir={self.model_dir!r} is not a Hugging Face checkpoint "
                        "directory: it has no config.json")
    for f in ("data", "eval_data"):
      v = getattr(self, f)
      if v is not None and not os.path.isfile(v):
        raise ConfigError(f"--{f.replace('_', '-')} {v!r}: no such file (a .jsonl, .parquet "
                          "or .txt file)")
    if self.packing not in ("pack", "pad"):
      raise ConfigError(f"--packing {self.packing!r} is invalid: 'pack' or 'pad'")
    self.lora_targets = tuple(self.lora_targets)


def _loss(logits, batch):
  """Mean cross-entropy over the targets the mask keeps in the whole global batch: each row's
  ``loss_norm`` (`zerojax.tools.hf_data.loss_norm`) makes the mean over micro-batches (and
  over devices at stages 0-1) the global batch's per-token mean, so gradient accumulation
  changes nothing but rounding."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  w = batch["mask"].astype(jnp.float32) * batch["loss_norm"]
  return (ce * w).sum() / ce.shape[0]


def finetune_task(fo: FinetuneOptions, opts: Any, config: Any) -> Task:
  """The `zerojax.tools.train.Task` of a fine-tuning run: the model, its data and evaluation.

  Args:
    fo: the `FinetuneOptions` (checkpoint directory, data, LoRA, evaluation).
    opts: the run's `zerojax.tools.options.TrainOptions` (``seq_len``, ``seed``).
    config: the run's `ZeroConfig` (its compute and parameter dtypes).

  Returns:
    The `Task`, ready for `zerojax.tools.train.train`.

  Raises:
    ConfigError: ``seq_len`` exceeds the checkpoint's ``max_position_embeddings``.
    ValueError: the data cannot be read or tokenized (see `zerojax.data.build_rows`).
  """
  base = llama.from_hf_config(fo.model_dir)
  cfg = llama.from_hf_config(fo.model_dir, remat=fo.remat, lora_rank=fo.lora,
                             lora_alpha=float(fo.lora_alpha), lora_targets=fo.lora_targets,
                             dtype=jnp.dtype(config.compute_dtype),
                             param_dtype=jnp.dtype(config.param_dtype))
  seq_len = opts.seq_len
  if seq_len > cfg.max_position_embeddings:
    raise ConfigError(f"seq_len={seq_len} is invalid for {fo.model_dir!r}: at most its "
                      f"max_position_embeddings={cfg.max_position_embeddings}")
  rows, eval_rows = _read_data(fo, cfg, seq_len)

  def sharding(plan, n):
    return plan.batch({"x": jax.ShapeDtypeStruct((n, seq_len), jnp.int32)})["x"]

  def batches(plan, n, data_step):
    return hf_data.Batches(rows, n, seed=opts.seed, sharding=sharding(plan, n), step=data_step)

  evaluate, cache = (None, {}) if eval_rows is None else _evaluator(eval_rows, sharding)

  def make_step(plan):
    if evaluate is not None:
      cache["plan"] = plan
    return _make_step(fo, plan)

  name = _model_name(fo.model_dir) + (f" + LoRA {fo.lora}" if fo.lora else "")
  return Task(name, seq_len, _setup(fo, opts, cfg, base), make_step, batches,
              num_params=lambda state: cfg.num_params(), save_item=_item,
              checkpoint_model=llama.checkpoint_model(cfg), evaluate=evaluate,
              eval_every=fo.eval_every, measure=True, nvme=True,
              agreement=_agreement(fo) if distributed.info().is_multiprocess else None)


def _agreement(fo: FinetuneOptions) -> dict[str, Any]:
  """What the processes of a fine-tuning run must share beyond the config and the training
  options (`zerojax.tools.train.processes`): every `FinetuneOptions` field, the model's
  config.json key by key, the evaluation file (the training file is the options' corpus)."""
  fields = {f"finetune.{f.name}": getattr(fo, f.name) for f in dataclasses.fields(fo)}
  fields.update(processes.json_fields("model.config.json",
                                      os.path.join(fo.model_dir, "config.json")))
  fields.update(processes.file_fields("eval_data", fo.eval_data))
  return fields


def _model_name(model_dir: str) -> str:
  """The directory's name, or the Hub id of a cache snapshot (``models--org--name/snapshots/
  <commit>``)."""
  path = os.path.normpath(model_dir)
  repo = os.path.basename(os.path.dirname(os.path.dirname(path)))
  if repo.startswith("models--") and os.path.basename(os.path.dirname(path)) == "snapshots":
    return repo[len("models--"):].replace("--", "/")
  return os.path.basename(path)


def _read_data(fo: FinetuneOptions, cfg: Any, seq_len: int) -> tuple[Any, Any]:
  """The training rows and the evaluation rows (or None), tokenized with the checkpoint's
  own tokenizer; logs what they hold."""
  tok = hf_data.load_tokenizer(fo.model_dir)
  if tok.vocab_size > cfg.vocab_size:
    raise ConfigError(f"the tokenizer in {fo.model_dir!r} has {tok.vocab_size} ids, the "
                      f"model's vocab_size is {cfg.vocab_size}")
  rows = hf_data.build_rows(fo.data, tok, seq_len, fo.packing)
  eval_rows = hf_data.build_rows(fo.eval_data, tok, seq_len, fo.packing) if fo.eval_data else None
  counted = int(rows.mask.sum())
  log(f"data {fo.data}: {len(rows)} rows of {seq_len} tokens ({fo.packing}), {counted:,} "
      "targets in the loss" + (f", {rows.truncated} documents cut at seq_len"
                               if rows.truncated else "")
      + (f"; eval {fo.eval_data}: {len(eval_rows)} rows" if eval_rows is not None else ""))
  for r, name in ((rows, fo.data), (eval_rows, fo.eval_data)):
    if r is not None and r.no_loss:  # said, not fatal: a few such records are common
      log(f"data {name}: {len(r.no_loss)} chat records contribute 0 tokens to the loss (their "
          "assistant turns render to no assistant token: no assistant message, or a role the "
          f"template does not mark): {', '.join(r.no_loss[:5])}"
          + (" ..." if len(r.no_loss) > 5 else ""))
  return rows, eval_rows


def _item(state):
  """What a checkpoint of a fine-tuning run holds: the parameters and the optimizer's state;
  under fp16 also the loss-scaling counters (``loss_scaling``: the scale, good steps,
  hysteresis, skipped steps), so that a resumed run goes on at the scale it had reached."""
  model, optimizer = state
  o = nnx.to_pure_dict(nnx.state(optimizer))
  item = {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
          "opt_state": o["opt_state"], "step": o["step"]}
  if "loss_scaling" in o:
    item["loss_scaling"] = o["loss_scaling"]
  return item


def _setup(fo: FinetuneOptions, opts: Any, cfg: Any, base: Any):
  """`Task.setup`: the model read from the checkpoint directory's safetensors into its
  shards, or a resumed run's state from its checkpoint."""
  wrt = nnx.LoRAParam if fo.lora else nnx.Param
  make = lambda: llama.Llama(cfg, nnx.Rngs(opts.seed))

  def setup(config, mesh, tx, rng, resume_step):
    if resume_step is None:
      # Adapters are new (the model's init); everything else comes from the files.
      # transformers writes a tied head once, under the embedding's name. Hub checkpoints
      # are mostly bf16: each block read is cast to param_dtype in place (cast=True), so the
      # load holds the shards in param_dtype and one block, never a tensor in both dtypes.
      src = weights.safetensors_source(
          fo.model_dir, llama.hf_mapping(base), skip="lora_" if fo.lora else None,
          allow_extra=[r"^lm_head\.weight$"] if cfg.tie_word_embeddings else False,
          cast=True)
      # A new run writes NVMe optimizer-state files afresh.
      model, optimizer, plan = create_nnx(make, tx, config=config, mesh=mesh, wrt=wrt,
                                          params=src, overwrite=config.optimizer_on_nvme)
      return (model, optimizer), plan, 0, 0
    scaled = _checkpoint_has_loss_scale(opts.checkpoint_dir, resume_step)
    # With the optimizer state on NVMe the checkpoint's own opt_state is the device part's
    # (the captured gradient); the state itself is the step's snapshot beside it.
    device_tx = nvme.device_tx(config, tx)
    with jax.set_mesh(mesh):
      target = _item(nnx.eval_shape(lambda: _with_scaling(
          (lambda m: (m, nnx.Optimizer(m, device_tx, wrt=wrt)))(make()), config, scaled)))
    got: dict = {}

    class _Restore:  # create_nnx's lazy params source: the checkpoint, in the new plan's layout
      def load(self, plan):
        with Checkpointer(opts.checkpoint_dir, read_only=True) as ck:
          got["state"], got["extras"] = ck.restore(target, plan, step=resume_step)
        return got["state"]["params"]

    model, optimizer, plan = create_nnx(make, tx, config=config, mesh=mesh, wrt=wrt,
                                        params=_Restore(), restoring=True)
    st = nnx.state(optimizer)
    nnx.replace_by_pure_dict(st, {"opt_state": got["state"]["opt_state"],
                                  "step": got["state"]["step"]})
    nnx.update(optimizer, st)
    if plan.nvme is not None:  # the step's snapshot becomes the committed optimizer state
      with Checkpointer(opts.checkpoint_dir, read_only=True) as ck:
        plan.nvme.restore_snapshot(ck, resume_step)
    _restore_loss_scaling(optimizer, got["state"].get("loss_scaling"), resume_step)
    extras = got["extras"]
    return ((model, optimizer), plan, int(extras.step),
            int((extras.data or {}).get("batches_step", extras.step)))
  return setup


def _checkpoint_has_loss_scale(checkpoint_dir: str, step: int) -> bool:
  """Whether checkpoint ``step`` holds fp16 loss-scaling counters (a run saved under fp16)."""
  with Checkpointer(checkpoint_dir, read_only=True) as ck:
    return any(p.startswith("loss_scaling/") for p in ck.stored_leaves(step))


def _with_scaling(pair: tuple, config: Any, scaled: bool) -> tuple:
  """``(model, optimizer)`` with the loss-scaling counters a checkpoint saved under fp16
  holds (as `zerojax.create_nnx` attaches them), so that the restore target matches it
  whatever this run's precision."""
  model, optimizer = pair
  if scaled:
    optimizer.loss_scaling = nnx_loss_scaling(config.replace(loss_scale=0.0)
                                              if config.loss_scale is None else config)
  return model, optimizer


def _restore_loss_scaling(optimizer: Any, saved: dict | None, step: int) -> None:
  """Puts a checkpoint's loss-scaling counters into this run's optimizer and says what the
  run goes on with: the saved scale, or (a checkpoint saved without fp16) the initial one."""
  if not hasattr(optimizer, "loss_scaling"):
    return  # this run scales nothing: the saved counters have no use
  if saved is None:
    log(f"fp16: checkpoint step {step} was saved without loss scaling; the loss scale starts "
        f"at {_scale(optimizer.loss_scaling.scale[...])}")
    return
  st = nnx.state(optimizer.loss_scaling)
  nnx.replace_by_pure_dict(st, saved)
  nnx.update(optimizer.loss_scaling, st)
  log(f"fp16: loss scale {_scale(optimizer.loss_scaling.scale[...])} restored from checkpoint "
      f"step {step} ({int(optimizer.loss_scaling.skipped_steps[...])} overflowing step(s) "
      "skipped before it)")


def _make_step(fo: FinetuneOptions, plan: Any):
  """`Task.make_step`: ``(state, batch) -> (state, metrics)`` over the plan."""
  def loss_of(model, batch):
    return _loss(model(batch["x"], segment_ids=batch["segment_ids"],
                       positions=batch["positions"]), batch)

  # zerojax's gradient (accumulation, loss scaling); with LoRA, of the adapters only.
  grad = value_and_grad(loss_of, wrt=nnx.LoRAParam if fo.lora else None)

  @zero_step(plan)
  def step(model, optimizer, batch):
    loss, grads = grad(model, batch)
    gn = optax.tree.norm(grads)
    optimizer.update(model, grads)
    return {"loss": loss, "grad_norm": gn,
            "overflow": ~(jnp.isfinite(loss) & jnp.isfinite(gn))}

  def run_step(state, batch):
    return state, step(*state, batch)

  # show_plan's compiled peak: of the device part where the optimizer state is on NVMe
  run_step.lower = lambda state, batch: getattr(step, "device_step", step).lower(*state, batch)
  return run_step


def _evaluator(eval_rows: Any, sharding: Any) -> tuple[Any, dict]:
  """``(evaluate, cache)``: `Task.evaluate` over every evaluation row; the caller puts the
  run's plan in ``cache['plan']`` once it exists."""
  cache: dict = {}

  def eval_sums(params, rest, batch):  # pure: the trained model is not touched
    plan = cache["plan"]
    if plan.params_on_host:  # offloaded parameters come to the device, as the step does
      params = offload.put_like(params, memory_kinds.on_device(plan.params))
    model = nnx.merge(cache["graphdef"], params, rest)
    logits = model(batch["x"], segment_ids=batch["segment_ids"], positions=batch["positions"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    m = batch["mask"].astype(jnp.float32)
    return (ce * m).sum(), m.sum()

  def evaluate(state):
    model, optimizer = state
    n = cache["plan"].batch_sizes[0]  # the training batch's rows and sharding
    if "batches" not in cache:
      cache["batches"] = hf_data.eval_batches(eval_rows, n, sharding(cache["plan"], n))
      cache["fn"] = jax.jit(eval_sums)
    cache["graphdef"], params, rest = nnx.split(model, nnx.Param, ...)
    total = count = 0.0
    for b in cache["batches"]:
      s, c = cache["fn"](params, rest, b)
      total, count = total + s, count + c
    return {"eval_loss": total / jnp.maximum(count, 1.0)}
  return evaluate, cache


def finetune(fo: FinetuneOptions, config_path: str | None = None,
             overrides: Sequence[str] = (), *, progress: bool | None = None,
             resume: bool | None = None, overwrite: bool = False, hooks: Sequence[Any] = ()
             ) -> dict:
  """Runs a fine-tuning (see the module's docstring), then exports the result.

  Args:
    fo: the `FinetuneOptions`.
    config_path: a zerojax or DeepSpeed config file, or ``None`` for the defaults.
    overrides: ``KEY=VALUE`` settings over the file.
    progress: ``False`` as the command's ``--no-progress``; ``None`` keeps the options'.
    resume: ``False`` as ``--no-resume``; ``None`` keeps the options'.
    overwrite: as ``--overwrite``.
    hooks: extra `zerojax.tools.train.Hook` objects for the loop.

  Returns:
    ``{"result": TrainResult, "export": the export's summary or None}``.

  Raises:
    MissingPackageError: a package the run needs (safetensors, grain, tokenizers; pyarrow
      for Parquet data; one an output set to true needs) is not installed or fails to
      import. It is raised before the data is read or the weights load (a Hub id's
      snapshot is fetched first: its files decide the tokenizer's package); jinja2, which
      conversations need for the chat template, is named when the data is read.
    ConfigError: the config or overrides are invalid, set ``corpus`` or ``init_from``
      (fine-tuning reads the checkpoint and ``fo.data``), or ask for
      ``nonfinite_grads='skip'`` where fine-tuning cannot honour it.
  """
  check(_packages(fo), "zerojax finetune")  # now, not after the weights are on the devices
  distributed.initialize()  # under a launcher: its process group, before any device is used
  loaded = _load_with_defaults(fo, config_path, list(overrides))
  train_opts = dict(loaded.train)
  for k in ("corpus", "init_from"):
    if train_opts.get(k) is not None:
      raise ConfigError(f"{k}={train_opts[k]!r} is not read by zerojax finetune: it starts from "
                        "MODEL_DIR's weights and reads --data")
  train_opts.setdefault("checkpoint_dir", os.path.join(train_opts["out_dir"], "ckpt"))
  # What the run trains and on what, recorded in run.json: a resume with another data file,
  # packing or LoRA rank is refused as another run (zerojax train's check of the options).
  train_opts["model"] = (f"{os.path.normpath(fo.model_dir)} [packing={fo.packing}, "
                         f"lora={fo.lora}]")
  train_opts["corpus"] = os.path.abspath(fo.data)
  train_opts["save_weights"] = False
  opts = TrainOptions(**train_opts)
  if progress is not None:
    opts.progress = progress
  if resume is not None:
    opts.resume = resume
  opts.overwrite = overwrite or opts.overwrite
  resolve_outputs(opts)  # an output set to true without its package: before the data is read
  setup_cpu_devices(opts.cpu_devices)
  notes = [f"DeepSpeed {n}" for n in loaded.notes]
  if loaded.xla_flags:
    notes.append(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
  config = loaded.config
  if config.nonfinite_policy == "skip" and config.loss_scale is None:
    # The NNX step skips a step only under loss scaling (`zerojax.core.step`).
    raise ConfigError("nonfinite_grads='skip' is not available to zerojax finetune without "
                      "loss scaling: 'halt' (stop at a non-finite step) or 'ignore'; with fp16 "
                      "loss scaling (loss_scale=0) overflowing steps are skipped")
  if (note := precision_note(config)) is not None:
    notes.append(note)
  result = train(config, opts, xla_notes=notes, task=finetune_task(fo, opts, config),
                 hooks=hooks)
  return {"result": result, "export": _export(fo, opts, result)}


def _packages(fo: FinetuneOptions) -> dict[str, str]:
  """The packages a fine-tuning run of ``fo`` needs beyond the library's: ``{module: what}``."""
  return {"safetensors": "the checkpoint's weights",
          **hf_data.packages(fo.model_dir, (fo.data, fo.eval_data))}


def precision_note(config: Any) -> str | None:
  """The log line saying what the step does about fp16, read from the fields the step itself
  reads (`zerojax.core.train_state.StepSettings`, `nnx_loss_scaling`); None where the run
  neither computes in float16 nor scales its loss.

  Args:
    config: the run's `zerojax.ZeroConfig`.

  Returns:
    one line, or None.
  """
  cd, ls = config.compute_dtype, config.to_flat()["loss_scale"]
  if ls is None:
    if cd != "float16":
      return None
    # Said, not refused: `zerojax train` takes it too; the user should know nothing scales.
    return ("fp16: compute_dtype='float16' without loss scaling (loss_scale is not set): "
            "gradients below float16's range become 0; loss_scale=0 (DeepSpeed's fp16 "
            "default) scales the loss dynamically")
  if ls == 0:
    p = config.initial_scale_power
    how = (f"dynamic loss scaling from 2**{p} = {_scale(2.0 ** p)}, doubled after "
           f"{config.loss_scale_window} steps in a row without overflow, halved at the "
           f"{_nth(config.hysteresis)} overflowing step in a row and at each one after "
           f"(never below {_scale(config.min_loss_scale)})")
  else:
    how = f"static loss scale {_scale(ls)}"
  unneeded = "" if cd == "float16" else f"; compute_dtype={cd!r} does not need it"
  return (f"fp16: {how}; an overflowing step is skipped (parameters and optimizer state "
          f"unchanged); compute_dtype={cd!r}, master weights and optimizer state "
          f"{config.param_dtype}{unneeded}")


def _scale(v: Any) -> str:
  """A loss scale as printed: a power of 2 in full (65536, not 6.5536e+04)."""
  v = float(v)
  return f"{v:.0f}" if v == int(v) else f"{v:g}"


def _nth(n: int) -> str:
  return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _load_with_defaults(fo: FinetuneOptions, config_path: str | None, overrides: list[str]):
  """The config file and overrides, with the fine-tuning defaults filling what neither sets. A
  DeepSpeed file's settings (numbers or "auto") are its own: an "auto" the command line leaves
  unset takes the HF Trainer's default, as `zerojax train` does (`zerojax.tools.deepspeed`)."""
  first = load_config(config_path, overrides, apply_xla_flags=False, for_training=False)
  _, given = parse_overrides(overrides)
  have = set(first.train) | set(given)
  if first.deepspeed:
    have = set(given) | (set(first.train) - {"lr", "weight_decay", "warmup_steps", "batch"}) \
        | _deepspeed_sets(config_path)
  defaults = dict(DEFAULTS, lr=LR_LORA if fo.lora else LR_FULL)
  extra = [f"{k}={v}" for k, v in defaults.items() if k not in have]
  return load_config(config_path, extra + overrides)


def _export(fo: FinetuneOptions, opts: TrainOptions, result: Any) -> dict | None:
  """The Hugging Face export of a run that reached its last step (process 0 writes it)."""
  if not (fo.export and result.history and result.history[-1]["step"] == opts.steps):
    return None
  out = fo.export_dir or os.path.join(opts.out_dir, "hf")
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("zerojax finetune: checkpoints written")
    # The checkpoint is read through orbax, which synchronises every process of a
    # multi-process run even to read: process 0 exports in a one-process child, and the
    # others wait for it (a process that dies meanwhile is the peer watch's).
    info = _export_alone(opts.checkpoint_dir, out, fo.model_dir) if is_main_process() else None
    agreement.exchange("finetune-export", "", timeout=_EXPORT_TIMEOUT)
  else:
    info = export(opts.checkpoint_dir, out, hf_config=fo.model_dir)
  if info is None:
    return None
  log(f"exported step {info['step']} to {info['path']} ({info['num_params']:,} "
      "parameters): transformers' AutoModelForCausalLM.from_pretrained reads it")
  return info


_EXPORT_TIMEOUT = 6 * 3600.0  # seconds the other processes wait for process 0's export
_EXPORT_CHILD = ("import json, sys\nfrom zerojax.tools.export import export\n"
                 "print(json.dumps(export(sys.argv[1], sys.argv[2], hf_config=sys.argv[3]), "
                 "default=str))\n")
_GROUP_VARIABLES = ("ZEROJAX_COORDINATOR", "ZEROJAX_NUM_PROCESSES", "ZEROJAX_PROCESS_ID",
                    "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_", "OMPI_",
                    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE")


def _export_alone(checkpoint_dir: str, out: str, model_dir: str) -> dict:
  """`zerojax.tools.export.export` in a child process of its own (no process group, CPU only:
  it reads files and writes files)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(_GROUP_VARIABLES)}
  env["JAX_PLATFORMS"] = "cpu"
  r = subprocess.run([sys.executable, "-c", _EXPORT_CHILD, checkpoint_dir, out, model_dir],
                     env=env, capture_output=True, text=True)
  if r.returncode != 0:
    last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise RuntimeError(f"the Hugging Face export of checkpoint_dir {checkpoint_dir!r} to "
                       f"{out!r} failed (code {r.returncode}): {last}")
  return json.loads(r.stdout.strip().splitlines()[-1])


def _deepspeed_sets(config_path: str) -> set[str]:
  """The training options a DeepSpeed file sets, with a number or an "auto" (the Trainer's
  default then): ``lr``, ``weight_decay``, ``warmup_steps``, ``batch``."""
  d = read_config_file(config_path)
  sect = lambda x, k: x.get(k) if isinstance(x, dict) and isinstance(x.get(k), dict) else {}
  opt, sched = sect(sect(d, "optimizer"), "params"), sect(sect(d, "scheduler"), "params")
  out = {k for k in ("lr", "weight_decay") if k in opt}
  out |= {"lr"} if "warmup_max_lr" in sched else set()
  out |= {"warmup_steps"} if "warmup_num_steps" in sched else set()
  out |= {"batch"} if any(k in d for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                           "gradient_accumulation_steps")) else set()
  return out


def run(args) -> int:
  """The ``zerojax finetune`` command (`zerojax.tools.cli`).

  Args:
    args: the parsed command-line arguments.

  Returns:
    The exit status: 0 when the run trained, 1 when it recorded no step.

  Raises:
    ConfigError: no ``--data``, or an error of `finetune`.
  """
  if args.data is None:
    raise ConfigError("zerojax finetune needs --data FILE (a .jsonl, .parquet or .txt file)")
  fo = FinetuneOptions(
      model_dir=args.model_dir, data=args.data, eval_data=args.eval_data,
      eval_every=args.eval_every, packing=args.packing, lora=args.lora,
      lora_alpha=args.lora_alpha,
      lora_targets=tuple(t for t in args.lora_targets.split(",") if t),
      remat=not args.no_remat, export=not args.no_export, export_dir=args.export_dir)
  out = finetune(fo, args.config, args.overrides, progress=False if args.no_progress else None,
                 resume=False if args.no_resume else None, overwrite=args.overwrite)
  return 0 if out["result"].history else 1
