"""Train the byte-level GPT on several processes (hosts) with zerojax.

The same script runs everywhere: alone (1 process), under the local launcher, or under a
cluster scheduler (SLURM, Kubernetes; see docs/multihost.md). Each process reads only its own
rows of every global batch (`zerojax.data.TextBatches`), and the mesh spans the devices of all
processes.

Usage::

  # 2 processes x 4 simulated CPU devices on this machine, hybrid sharding (HSDP):
  zerojax launch -n 2 --devices-per-process 4 -- \\
      examples/multihost_train.py --mesh hybrid --steps 20

  # single process, 8 CPU devices (same numbers as the 2-process run):
  python examples/multihost_train.py --cpu-devices 8 --mesh hybrid --steps 20
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent

from zerojax import DEFAULT_CORPUS  # the bundled corpus (package data)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--stage", type=int, default=3)
  p.add_argument("--mesh", default="hybrid", choices=["flat", "hybrid", "tensor"],
                 help="flat: fsdp over all devices; hybrid: replica across processes x fsdp "
                 "within; tensor: fsdp x tensor=2 (Megatron-style metadata on the model)")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--batch", type=int, default=16, help="global batch (rows)")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--preset", default="tiny", help="model preset: tiny | small | gpt-89m")
  p.add_argument("--corpus", default=str(DEFAULT_CORPUS))
  p.add_argument("--cpu-devices", type=int, default=None,
                 help="simulated CPU devices of this process (default: ZEROJAX_CPU_DEVICES, "
                 "set by the launcher)")
  p.add_argument("--init-timeout", type=float, default=None, metavar="SECONDS",
                 help="seconds to wait at start-up for the coordinator and the other processes "
                 "(default: ZEROJAX_INIT_TIMEOUT or 300); progress is printed meanwhile")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  import zerojax.distributed
  # First, before anything touches devices: joins the other processes (launcher, SLURM,
  # Kubernetes or explicit environment variables), or does nothing when running alone.
  info = zerojax.distributed.initialize(cpu_devices=args.cpu_devices, timeout=args.init_timeout)

  import jax
  import jax.numpy as jnp
  import optax
  import zerojax
  from zerojax.data import TextBatches, load_bytes
  from zerojax.models import GPT, PRESETS, loss_fn

  nproc = jax.process_count()
  if args.mesh == "flat":
    zc = zerojax.ZeroConfig(stage=args.stage)
  elif args.mesh == "hybrid":
    zc = zerojax.ZeroConfig(stage=args.stage, mesh_shape=(max(nproc, 2), -1),
                            mesh_axes=("replica", "fsdp"))
  else:
    zc = zerojax.ZeroConfig(stage=args.stage, mesh_shape=(-1, 2), mesh_axes=("fsdp", "tensor"))
  model_cfg = dataclasses.replace(PRESETS[args.preset], vocab_size=256,
                                  tensor_parallel=args.mesh == "tensor")
  model = GPT(model_cfg)
  tx = optax.adamw(args.lr, weight_decay=0.1)
  sample = jnp.zeros((args.batch, model_cfg.seq_len), jnp.int32)
  state, plan = zerojax.create_train_state(model, tx, jax.random.key(0), sample, config=zc)
  if info.is_coordinator:
    print(f"processes: {nproc} ({info.source}), devices: {jax.device_count()} "
          f"({jax.local_device_count()} local), mesh {dict(plan.mesh.shape)}", flush=True)

  @zerojax.zero_step(plan)
  def train_step(state, batch):
    def lf(params):
      return loss_fn(state.apply_fn({"params": params}, batch["x"]), batch["y"])
    loss, grads = jax.value_and_grad(lf)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  # Each process reads only the rows its devices hold; the batches are global jax.Arrays.
  batches = TextBatches(load_bytes(args.corpus), args.batch, model_cfg.seq_len,
                        sharding=plan.batch({"x": sample})["x"])
  t0 = time.perf_counter()
  loss = float("nan")
  for i in range(args.steps):
    state, metrics = train_step(state, next(batches))
    loss = float(metrics["loss"])
    if info.is_coordinator and (i % 10 == 0 or i == args.steps - 1):
      print(f"step {i:4d}  loss {loss:.4f}  {(time.perf_counter() - t0) / (i + 1):.3f}s/step",
            flush=True)
  print(f"process {jax.process_index()}: final loss {loss:.6f}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
