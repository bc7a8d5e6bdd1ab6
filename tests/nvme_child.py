"""A training run with its optimizer state on NVMe, checkpointing after every step; the
kill test (tests/runtime/test_nvme.py) kills it at random moments and runs it again until it
finishes.

Usage: python -m tests.nvme_child NVME_PATH CKPT_DIR STEPS OUT.npz

Prints ``STEP <n>`` after each step's checkpoint is committed. On start it restores the newest
complete checkpoint (params and the optimizer state's files), or starts afresh (the files are
rewritten) when there is none. At the end it writes the final parameters to OUT.npz.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import zerojax  # noqa: E402
from tests import helpers  # noqa: E402
from zerojax.models import GPT  # noqa: E402
from zerojax.checkpoint import abstract_train_state  # noqa: E402
from zerojax.runtime.checkpoint import Checkpointer  # noqa: E402


def main(nvme_path: str, ckpt_dir: str, steps: int, out: str) -> None:
  cfg = helpers.TINY
  data = helpers.batches(cfg, steps)
  config = zerojax.ZeroConfig(
      stage=2, gather=zerojax.Gather(persistence_threshold=helpers.THRESHOLD),
      offload=zerojax.NvmeOffload(nvme_path, chunk_size=4096, buffer_count=3))
  ckpt = Checkpointer(ckpt_dir, max_to_keep=2, async_save=False)
  args = (GPT(cfg), helpers.make_tx(), jax.random.key(0), jnp.asarray(data[0]["x"]))
  if ckpt.all_steps():  # a killed run's checkpoint (its snapshot is saved first): resume it
    state, plan = abstract_train_state(*args, config=config)
    state, _ = ckpt.restore(state, plan)
  else:
    state, plan = zerojax.create_train_state(*args, config=config, overwrite=True)
  opt, step = plan.nvme, zerojax.zero_step(plan)(helpers.train_step)
  print(f"START {int(state.step)}", flush=True)
  for i in range(int(state.step), steps):
    state, _ = step(state, data[i])
    opt.save_checkpoint(ckpt, state)
    print(f"STEP {i + 1}", flush=True)
  flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
  np.savez(out, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})
  ckpt.close()


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
