"""Child process for tests/runtime/test_checkpoint.py: resume in a new process, a killed save,
export memory. Run as ``python tests/checkpoint_child.py MODE ARGS_JSON`` with XLA_FLAGS
setting the device count and PYTHONPATH pointing at the work tree."""

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def resume(a):
  """Restores step N, trains N more steps, writes losses and params."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import zerojax
  from zerojax.checkpoint import Checkpointer, abstract_train_state
  from zerojax.models import GPT
  from tests import helpers

  zc = zerojax.ZeroConfig.from_flat(a["config"])
  data = helpers.batches(helpers.TINY, a["total"])
  target, plan = abstract_train_state(GPT(helpers.TINY), helpers.make_tx(), jax.random.key(0),
                                      jnp.asarray(data[0]["x"]), config=zc)
  with Checkpointer(a["dir"], read_only=True) as ck:
    state, extras = ck.restore(target, plan)
  step = zerojax.zero_step(plan)(helpers.train_step)
  losses = []
  for b in data[extras.data["next_batch"]:]:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  flat = {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(state.params)[0]}
  np.savez(a["out"], losses=np.asarray(losses, np.float32),
           rng=np.asarray(jax.random.key_data(extras.rng)), step=np.asarray(state.step), **flat)


def kill(a):
  """Saves step 1 fully, then starts step 2 whose commit never happens; the parent kills us."""
  import asyncio
  import jax
  import numpy as np
  from orbax.checkpoint._src.path import atomicity
  from zerojax.runtime.checkpoint import Checkpointer

  orig = atomicity.AtomicRenameTemporaryPath.finalize

  async def stalled_finalize(self):
    if self._final_path.name == "2":  # step 2's directory: all shards written, never committed
      print("STALLED", flush=True)
      await asyncio.sleep(3600)
    return await orig(self)

  atomicity.AtomicRenameTemporaryPath.finalize = stalled_finalize
  rng = np.random.default_rng(0)
  params = {"w": rng.standard_normal((256, 256), dtype=np.float32),
            "b": rng.standard_normal((256,), dtype=np.float32)}
  ck = Checkpointer(a["dir"])
  ck.save(1, {"params": jax.tree.map(jax.numpy.asarray, params)}, data={"pos": 1})
  ck.wait()
  print("SAVED1", flush=True)
  ck.save(2, {"params": jax.tree.map(lambda x: jax.numpy.asarray(x + 1), params)},
          data={"pos": 2})
  print("SAVING2", flush=True)
  time.sleep(3600)


def export_mem(a):
  """Exports and reports peak host memory of the export alone."""
  import tracemalloc
  import zerojax.tools.export as zx

  def status(key):
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(key + ":"):
          return int(line.split()[1]) * 1024
    return None

  # Import and warm up everything (jax, orbax, tensorstore) on a tiny export first, so that the
  # measured peak is the export's own.
  zx.export(a["warm_dir"], a["warm_out"])
  try:
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM (peak RSS) to current RSS
      f.write("5")
    reset = True
  except OSError:
    reset = False
  rss0 = status("VmRSS")
  tracemalloc.start()
  t = time.time()
  info = zx.export(a["dir"], a["out"], dtype=a["dtype"], format=a["format"])
  dt = time.time() - t
  _, traced_peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  hwm = status("VmHWM")
  print(json.dumps({"rss_before": rss0, "hwm": hwm, "hwm_reset": reset,
                    "rss_peak_delta": hwm - rss0, "traced_peak": traced_peak,
                    "seconds": dt, "bytes": info["bytes"]}), flush=True)


if __name__ == "__main__":
  {"resume": resume, "kill": kill, "export_mem": export_mem}[sys.argv[1]](json.loads(sys.argv[2]))
