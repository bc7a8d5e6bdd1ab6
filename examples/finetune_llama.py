"""Fine-tune a Hugging Face Llama checkpoint with ZeRO-3 and offload; export it back.

From a local Hugging Face model directory (``config.json`` + ``model.safetensors`` or sharded
``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``) to a fine-tuned
one that ``transformers`` loads with ``from_pretrained``:

1. each parameter is read from the safetensors files straight into its ZeRO-3 shards
   (`zerojax.weights`): no process reads or holds the whole model;
2. the run trains at stage 3 with the optimizer state and the parameters offloaded to host
   memory (``--no-offload`` keeps them on the device), saving sharded checkpoints every
   ``--save-every`` steps; run it again with the same ``--out-dir`` and it resumes from the
   latest checkpoint (parameters, optimizer state and data position);
3. the last checkpoint is exported to ``OUT_DIR/hf`` (``zerojax export --hf-config``): the
   base directory's config, generation config and tokenizer files carried over, LoRA
   adapters merged with the alpha the checkpoint records.

``--lora RANK`` trains LoRA adapters on the attention projections only: the base weights are
frozen (still sharded, with no gradient and no optimizer state) and the adapters are merged
into the exported weights.

With no ``--model-dir`` (or ``--random``) a small random Llama is generated locally with
``transformers``' ``save_pretrained``: nothing is downloaded. The example feeds the bundled
corpus as byte tokens (ids 0-255), so it runs with any vocabulary of at least 256; a real run
brings its tokenizer. Usage::

  python examples/finetune_llama.py --out-dir runs/llama               # random tiny Llama
  python examples/finetune_llama.py --model-dir ~/models/Llama-3.2-1B --steps 100 --lora 16
  python examples/finetune_llama.py --out-dir runs/llama --steps 20    # resumes at its step
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent

from zerojax import DEFAULT_CORPUS  # the bundled corpus (package data)

RANDOM_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--model-dir", default=None,
                 help="Hugging Face Llama, Qwen2, Qwen3 or Mistral directory (default: "
                      "OUT_DIR/base, a random Llama generated there)")
  p.add_argument("--random", action="store_true",
                 help="generate a random tiny Llama in --model-dir (or OUT_DIR/base) first")
  p.add_argument("--out-dir", default="runs/finetune_llama")
  p.add_argument("--steps", type=int, default=12, help="total optimizer steps (default 12)")
  p.add_argument("--stop-after", type=int, default=None,
                 help="stop (after a checkpoint) once this step is reached: a resumable pause")
  p.add_argument("--save-every", type=int, default=4, help="checkpoint interval in steps")
  p.add_argument("--batch", type=int, default=16, help="global batch in rows (default 16)")
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--stage", type=int, default=3)
  p.add_argument("--no-offload", action="store_true", help="keep all state on the device")
  p.add_argument("--lora", type=int, default=0, metavar="RANK",
                 help="train LoRA adapters of this rank only (0: full fine-tuning)")
  p.add_argument("--lora-alpha", type=float, default=16.0)
  p.add_argument("--lora-targets", default="q_proj,v_proj")
  p.add_argument("--corpus", default=str(DEFAULT_CORPUS))
  p.add_argument("--cpu-devices", type=int, default=8)
  p.add_argument("--no-export", action="store_true")
  return p.parse_args(argv)


def make_random_llama(model_dir: str, seed: int = 0) -> None:
  """Writes a random tiny Llama with ``transformers`` (sharded safetensors + index)."""
  import torch
  import transformers
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**RANDOM_LLAMA))
  model.save_pretrained(model_dir, max_shard_size="200KB")


def make_optimizer(lr: float, steps: int):
  """AdamW with a short warmup and cosine decay over the run."""
  import optax
  return optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, 2, max(steps, 3)),
                     b1=0.9, b2=0.95, weight_decay=0.0)


def checkpoint_item(model, optimizer) -> dict:
  """What a checkpoint holds: every parameter (trained or frozen), the optimizer state (laid
  out as the plan's ``opt_state``) and the optimizer's step."""
  from flax import nnx
  opt = nnx.to_pure_dict(nnx.state(optimizer))
  return {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
          "opt_state": opt["opt_state"], "step": opt["step"]}


class Resume:
  """A lazy ``params=`` source for `zerojax.create_nnx` that restores a checkpoint into the
  new plan's layout (parameters and optimizer state), keeping the optimizer part for later."""

  def __init__(self, ckpt, target):
    self.ckpt, self.target = ckpt, target
    self.restored = self.extras = None

  def load(self, plan):
    self.restored, self.extras = self.ckpt.restore(self.target, plan)
    return self.restored["params"]


def main(argv=None) -> int:
  args = parse_args(argv)
  from zerojax import train as zt
  zt.setup_cpu_devices(args.cpu_devices)
  import jax
  import jax.numpy as jnp
  from flax import nnx
  import zerojax
  from zerojax import weights
  from zerojax.checkpoint import Checkpointer
  from zerojax.data import TextBatches, load_bytes
  from zerojax import export
  from zerojax.models import llama, loss_fn

  out = pathlib.Path(args.out_dir)
  model_dir = args.model_dir or str(out / "base")
  if args.random or (args.model_dir is None and not os.path.exists(model_dir)):
    if zt.is_main_process() and not os.path.exists(os.path.join(model_dir, "config.json")):
      make_random_llama(model_dir)
      zt.log(f"generated a random Llama in {model_dir}")
  targets = tuple(t for t in args.lora_targets.split(",") if t)
  cfg = llama.from_hf_config(model_dir, lora_rank=args.lora, lora_alpha=args.lora_alpha,
                             lora_targets=targets, remat=True)
  offload = not args.no_offload and args.stage == 3
  config = zerojax.ZeroConfig(stage=args.stage,
                              offload=zerojax.HostOffload(params=True) if offload else None)
  tx = make_optimizer(args.lr, args.steps)
  wrt = nnx.LoRAParam if args.lora else nnx.Param
  make = lambda: llama.Llama(cfg, nnx.Rngs(0))

  ckpt = Checkpointer(out / "ckpt", config=config, max_to_keep=2)
  resume = None
  if ckpt.latest_step() is not None:
    # The restore target: shapes only (nothing is allocated), in the new plan's layout.
    with jax.set_mesh(zerojax.make_mesh(config)):
      abstract = nnx.eval_shape(lambda: (lambda m: (m, nnx.Optimizer(m, tx, wrt=wrt)))(make()))
    resume = Resume(ckpt, checkpoint_item(*abstract))
    source = resume
  else:
    # Adapters are new: they come from the model's init; everything else from the files.
    # transformers writes a tied head once, under the embedding's name.
    source = weights.safetensors_source(
        model_dir, llama.hf_mapping(cfg), skip="lora_" if args.lora else None,
        allow_extra=[r"^lm_head\.weight$"] if cfg.tie_word_embeddings else False)
  model, optimizer, plan = zerojax.create_nnx(make, tx, config=config, wrt=wrt, params=source)
  start = 0
  if resume is not None:
    state = nnx.state(optimizer)
    nnx.replace_by_pure_dict(state, {"opt_state": resume.restored["opt_state"],
                                     "step": resume.restored["step"]})
    nnx.update(optimizer, state)
    start = int(resume.extras.data["position"])
    zt.log(f"resumed from {ckpt.step_dir(resume.extras.step)} at step {start}")
  zt.log(f"zerojax Llama fine-tuning: {jax.device_count()} devices, {config.label}"
         f"{' + offload' if offload else ''}, {cfg.num_params():,} base parameters"
         + (f", LoRA rank {args.lora} on {targets}" if args.lora else ""))
  zt.log(plan.table())

  diff = nnx.DiffState(0, wrt)

  @zerojax.zero_step(plan)
  def train_step(model, optimizer, batch):
    def lf(model):
      return loss_fn(model(batch["x"]), batch["y"])
    loss, grads = nnx.value_and_grad(lf, argnums=diff)(model)
    optimizer.update(model, grads)
    return {"loss": loss}

  sample = jnp.zeros((args.batch, args.seq_len), jnp.int32)
  batches = TextBatches(load_bytes(args.corpus), args.batch, args.seq_len,
                        sharding=plan.batch({"x": sample})["x"], step=start)
  stop = min(args.steps, args.stop_after or args.steps)
  # Appended, so a resumed run continues the record of the run it resumes.
  log = open(out / "metrics.jsonl", "a") if zt.is_main_process() else None
  for step in range(start + 1, stop + 1):
    loss = float(train_step(model, optimizer, next(batches))["loss"])
    if log is not None:
      log.write(json.dumps({"step": step, "loss": loss}) + "\n")
      log.flush()
    zt.log(f"step {step}: loss {loss:.4f}")
    if step % args.save_every == 0 or step == stop:
      # The model record keeps LoRA's rank and alpha with the adapters, for the export.
      ckpt.save(step, checkpoint_item(model, optimizer), data={"position": step}, force=True,
                model=llama.checkpoint_model(cfg))
  if log is not None:
    log.close()
  ckpt.wait()
  if stop < args.steps:
    zt.log(f"stopped at step {stop}; run again to resume")
    ckpt.close()
    return 0
  ckpt.close()
  if not args.no_export and zt.is_main_process():
    info = export(out / "ckpt", out / "hf", hf_config=model_dir)
    zt.log(f"exported step {info['step']} to {info['path']} ({info['num_params']:,} "
           "parameters): load it with transformers.LlamaForCausalLM.from_pretrained")
  return 0


if __name__ == "__main__":
  sys.exit(main())
