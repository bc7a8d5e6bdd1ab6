"""Train the GPT example written in Flax NNX with zerojax.

The NNX model is built directly in its sharded layout (``zerojax.create_nnx``) and the step
updates ``model`` and ``optimizer`` in place, as under ``nnx.jit``. Metrics, TensorBoard
events and the loss curve come from `zerojax.train`'s writers. Usage::

  python examples/nnx_train.py                      # ZeRO-3 on 8 simulated CPU devices
  python examples/nnx_train.py --stage 2 --steps 50
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent

from zerojax import DEFAULT_CORPUS  # the bundled corpus (package data)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", default=None, help="zerojax or DeepSpeed config (.json/.yaml)")
  p.add_argument("--stage", type=int, default=None, help="override the config's stage")
  p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
  p.add_argument("--batch", type=int, default=16, help="global batch in rows (default 16)")
  p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
  p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
  p.add_argument("--corpus", default=str(DEFAULT_CORPUS))
  p.add_argument("--out-dir", default="runs/nnx_train")
  p.add_argument("--cpu-devices", type=int, default=8)
  p.add_argument("--no-progress", action="store_true")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  from zerojax import train as zt
  from zerojax import load_config
  loaded = load_config(args.config, [] if args.stage is None else [f"stage={args.stage}"])
  zt.setup_cpu_devices(args.cpu_devices)
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  import zerojax
  from zerojax.data import TextBatches, VOCAB_SIZE, load_bytes
  from zerojax.models import PRESETS, loss_fn, nnx_gpt

  config = loaded.config
  mcfg = dataclasses.replace(PRESETS[args.preset], vocab_size=VOCAB_SIZE,
                             dtype=jnp.dtype(config.compute_dtype))
  tx = optax.adamw(args.lr, b1=0.9, b2=0.95, weight_decay=0.1)
  if config.gradient_clipping:
    tx = optax.chain(optax.clip_by_global_norm(config.gradient_clipping), tx)
  model, optimizer, plan = zerojax.create_nnx(lambda: nnx_gpt(mcfg, nnx.Rngs(0)), tx,
                                              config=config)
  zt.log(f"zerojax NNX: {jax.device_count()} devices, mesh {dict(plan.mesh.shape)}, "
         f"{config.label}, {mcfg.num_params():,} parameters")
  zt.log(plan.table())

  @zerojax.zero_step(plan)
  def train_step(model, optimizer, batch):
    def lf(model):
      return loss_fn(model(batch["x"]), batch["y"])
    loss, grads = nnx.value_and_grad(lf)(model)
    optimizer.update(model, grads)
    return {"loss": loss}

  sample = jnp.zeros((args.batch, mcfg.seq_len), jnp.int32)
  batches = TextBatches(load_bytes(args.corpus), args.batch, mcfg.seq_len,
                        sharding=plan.batch({"x": sample})["x"])
  writer = zt.MetricsWriter(args.out_dir)
  bar = None
  if not args.no_progress and zt.is_main_process():
    from tqdm.auto import tqdm
    bar = tqdm(total=args.steps, desc="nnx train", unit="step", file=sys.stdout)
  history, t0 = [], time.perf_counter()
  t_prev = None
  for step in range(1, args.steps + 1):
    metrics = train_step(model, optimizer, next(batches))
    loss = float(metrics["loss"])  # tiny model: fetching (waiting for) every step is cheap
    now = time.perf_counter()
    # This step's own throughput; none for step 1, which includes compilation.
    tps = None if t_prev is None else round(args.batch * mcfg.seq_len / (now - t_prev), 1)
    t_prev = now
    rec = {"step": step, "loss": loss, "elapsed_sec": round(now - t0, 6),
           "tokens_per_sec": tps}
    history.append(rec)
    writer.write(rec)
    if bar is not None:  # tokens/s as zerojax's own loop shows it: the run's, after step 1
      run_tps = zt.throughput(history, args.batch * mcfg.seq_len)
      bar.set_postfix(loss=f"{loss:.4f}", tok_s="-" if run_tps is None else f"{run_tps:,.0f}",
                      refresh=False)
      bar.update(1)
  if bar is not None:
    bar.close()
  writer.close()
  if zt.is_main_process():
    png = zt.plot_loss(history, os.path.join(args.out_dir, "loss.png"), "NNX GPT loss")
    zt.log(f"done: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}; wrote "
           f"{writer.jsonl_path}, {png}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
