"""Temp bytes per stage for scanned vs unscanned layers: ``python benchmarks/layers.py``.

The model of ``tests/runtime/test_memory.py`` (GPT, 8 layers, d_model 256, batch 8×16) on 8
simulated CPU devices, compiled (not run) for stages 0-3 and for stage 3 with ``max_live_layers=2``,
once with ``nn.scan`` layers and once with a Python loop of layers. The step is the README's:
``zerojax.value_and_grad`` with the batch as an argument. Per-device temp and all-gather bytes come
from ``compiled.memory_analysis()`` and the compiled HLO (`zerojax.runtime.memory.measure`). Prints
a markdown table; nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--devices", type=int, default=8)
  args = p.parse_args(argv)
  if args.devices < 1:
    p.error(f"--devices={args.devices} is invalid: needs an integer >= 1")
  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)
  import jax.numpy as jnp
  import numpy as np
  import optax
  import zerojax
  from zerojax.runtime.memory import measure
  from zerojax.models import GPT, GPTConfig, loss_fn

  base = GPTConfig(vocab_size=256, seq_len=16, num_layers=8, num_heads=4, d_model=256)
  tokens = np.random.default_rng(0).integers(0, base.vocab_size, (8, base.seq_len + 1),
                                             dtype=np.int32)
  batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  tx = optax.adamw(1e-3, eps=1e-6, weight_decay=0.1)

  def train_step(state, batch):
    def lf(params, batch):
      return loss_fn(state.apply_fn({"params": params}, batch["x"]), batch["y"])
    loss, grads = zerojax.value_and_grad(lf)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}

  variants = [(s, {}) for s in range(4)] + [(3, {"max_live_layers": 2})]
  mib = lambda b: f"{b / 2**20:.1f}"
  rows, grad_bytes = [], None
  for scan in (True, False):
    cfg = dataclasses.replace(base, scan=scan)
    cells = []
    for stage, extra in variants:
      zc = zerojax.ZeroConfig.from_flat(dict(stage=stage, param_persistence_threshold=64, **extra))
      state, plan = zerojax.create_train_state(GPT(cfg), tx, jax.random.key(0),
                                               jnp.asarray(batch["x"]), config=zc)
      m = measure(zerojax.zero_step(plan)(train_step).lower(state, batch).compile())
      grad_bytes = sum(lp.nbytes for lp in plan.leaves)
      cells.append(f"{mib(m.temp)} ({mib(m.collectives['all-gather'])})")
      print(f"{'scanned' if scan else 'unscanned'} stage {stage} {extra or ''}: temp "
            f"{mib(m.temp)} MiB, all-gather {mib(m.collectives['all-gather'])} MiB", flush=True)
    rows.append(f"| {'`nn.scan`' if scan else 'unscanned'} | " + " | ".join(cells) + " |")
  print(f"\nG (fp32 gradient = Ψ) = {mib(grad_bytes)} MiB; cells: temp MiB (all-gather MiB)\n")
  print("| layers | stage 0 | stage 1 | stage 2 | stage 3 | stage 3, `max_live_layers=2` |")
  print("|---|---|---|---|---|---|")
  print("\n".join(rows))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
