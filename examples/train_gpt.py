"""Pretrain a small byte-level GPT with zerojax on the bundled public-domain corpus.

With no accelerator present it runs on 8 simulated CPU devices. Usage::

  python examples/train_gpt.py                     # ZeRO-3, 8 CPU devices
  python examples/train_gpt.py --config configs/zero2.json --steps 50
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_CORPUS = HERE / "data" / "corpus.txt"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", default=None, help="zerojax or DeepSpeed config (.json/.yaml); "
                 "default: ZeRO-3 over all devices")
  p.add_argument("--stage", type=int, default=None, help="override the config's stage")
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--batch", type=int, default=32, help="global batch (rows)")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--preset", default="small", help="model preset: tiny | small | gpt-89m")
  p.add_argument("--corpus", default=str(DEFAULT_CORPUS))
  p.add_argument("--cpu-devices", type=int, default=8,
                 help="simulated CPU devices when no accelerator is present")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax
  # Must precede backend initialisation; only affects the CPU backend.
  jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  import jax.numpy as jnp
  import optax
  import zerojax
  import zerojax.memory
  from zerojax.data import TextBatches, load_bytes
  from zerojax.models import GPT, PRESETS, loss_fn
  import dataclasses

  ZeroConfig = zerojax.ZeroConfig
  zc = ZeroConfig.from_file(args.config) if args.config else ZeroConfig(stage=3)
  if args.stage is not None:
    zc = zc.replace(stage=args.stage)
  model_cfg = dataclasses.replace(PRESETS[args.preset], vocab_size=256,
                                  dtype=jnp.dtype(zc.compute_dtype))
  model = GPT(model_cfg)
  tx = optax.adamw(args.lr, weight_decay=0.1)
  data = load_bytes(args.corpus)
  sample = jnp.zeros((args.batch, model_cfg.seq_len), jnp.int32)
  state, plan = zerojax.create_train_state(model, tx, jax.random.key(0), sample, config=zc)
  if jax.process_index() == 0:
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, "
          f"mesh {dict(plan.mesh.shape)}")
    print(plan.table())

  @zerojax.zero_step(plan)
  def train_step(state, batch):
    def lf(params):
      return loss_fn(state.apply_fn({"params": params}, batch["x"]), batch["y"])
    loss, grads = jax.value_and_grad(lf)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  batches = TextBatches(data, args.batch, model_cfg.seq_len,
                        sharding=plan.batch({"x": sample})["x"])
  compiled = train_step.lower(state, next(iter([{"x": sample, "y": sample}]))).compile()
  m = zerojax.memory.measure(compiled)
  if jax.process_index() == 0:
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    print(f"per-device memory (XLA): arguments {mib(m.argument)}, temp {mib(m.temp)}, "
          f"peak {mib(m.peak)}; collectives/step {mib(m.collective_total)}")
  t0 = time.perf_counter()
  for i in range(args.steps):
    state, metrics = train_step(state, next(batches))
    if jax.process_index() == 0 and (i % 10 == 0 or i == args.steps - 1):
      print(f"step {i:4d}  loss {float(metrics['loss']):.4f}  "
            f"{(time.perf_counter() - t0) / (i + 1):.3f}s/step", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
