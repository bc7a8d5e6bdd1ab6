"""One process of the 2-process NVMe optimizer-state test (tests/runtime/test_nvme_multiprocess.py),
started through ``python -m zerojax.tools.launch``; with ``--reference``, the one-process
in-memory run of the same global config on as many devices. Not a test module itself.

Usage::

  python -m zerojax.tools.launch -n 2 --devices-per-process 2 -- tests/nvme_mp_worker.py OUT
      [--stages 3,2] [--steps 4] [--memory]
  ZEROJAX_CPU_DEVICES=4 python tests/nvme_mp_worker.py OUT --reference [--stages 3,2]

Launched, each process:

1. creates the NVMe state with its own ``nvme_chunk_size`` (process 0: 20000, process 1:
   4096): the agreement check must refuse it (`ProcessMismatchError`) before any file exists;
2. per stage, trains the tiny GPT of tests/helpers.py for ``--steps`` steps with the optimizer
   state on NVMe under ``OUT/nvme-<stage>``, feeding only its own rows of each global batch;
   at the first stage it checkpoints after half the steps and, at the end, restores that
   checkpoint into a fresh state on another nvme_path and trains the other half again;
3. with ``--memory``, trains the same runs in memory (to tell the cross-process collectives'
   rounding from the NVMe update's).

Each process writes ``OUT/result-<i>.json`` (``--reference``: ``OUT/reference.json``); process 0
writes the gathered final parameters of each run to ``OUT/params-<run>.npz``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zerojax.core.distributed  # noqa: E402

CHUNK = 20000  # nvme_chunk_size of the runs (several chunks per process at stage 2)


def _config(stage: int, **kw):
  from tests import helpers
  from zerojax.core.config import ZeroConfig
  return ZeroConfig.from_flat(dict(stage=stage, param_persistence_threshold=helpers.THRESHOLD,
                                   **kw))


def _feed(plan, batches: list[dict]) -> list[dict]:
  """Global batches assembled from this process's rows only, as a multi-host loader would."""
  import jax
  from tests import helpers
  from zerojax.runtime.data import process_rows
  sharding = plan.batch({"x": batches[0]["x"]})["x"]
  rows = process_rows(sharding, helpers.BATCH)
  return [{k: jax.make_array_from_process_local_data(sharding, v[rows], v.shape)
           for k, v in b.items()} for b in batches]


def _losses(step, state, batches: list[dict]) -> tuple[object, list[float]]:
  import numpy as np
  out = []
  for b in batches:
    state, m = step(state, b)
    out.append(float(np.float32(m["loss"])))  # a float32 is exact as a JSON double
  return state, out


def _save_params(out: str, run: str, params) -> None:
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  whole = multihost_utils.process_allgather(params, tiled=True)
  if jax.process_index() == 0:
    flat = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_flatten_with_path(whole)[0]}
    np.savez(os.path.join(out, f"params-{run}.npz"), **flat)


def _listing(path: str) -> list[str]:
  return sorted(os.listdir(path)) if os.path.isdir(path) else []


def mismatch(out: str) -> dict:
  """Each process asks for its own nvme_chunk_size: refused, named, before any file exists."""
  import jax
  import jax.numpy as jnp
  from tests import helpers
  from zerojax.core.agreement import ProcessMismatchError
  import zerojax
  from zerojax.models import GPT
  path = os.path.join(out, "nvme-mismatch")
  os.makedirs(path, exist_ok=True)
  zc = _config(3, offload_optimizer="nvme", nvme_path=path,
               nvme_chunk_size=(CHUNK, 4096)[jax.process_index()])
  x = jnp.asarray(helpers.batches(helpers.TINY, 1)[0]["x"])
  try:
    zerojax.create_train_state(GPT(helpers.TINY), helpers.make_tx(), jax.random.key(0), x,
                               config=zc)
  except ProcessMismatchError as e:
    return {"error": type(e).__name__, "message": str(e), "fields": e.fields,
            "files": _listing(os.path.join(path, "zerojax-nvme"))}
  return {"error": None}


def nvme_run(out: str, stage: int, steps: int, checkpoint: bool) -> dict:
  """Trains on NVMe; with ``checkpoint``, saves after half the steps and replays the second
  half from that checkpoint in a fresh state on another nvme_path."""
  import jax
  import jax.numpy as jnp
  from tests import helpers
  import zerojax
  from zerojax.models import GPT
  from zerojax.runtime.checkpoint import Checkpointer
  data = helpers.batches(helpers.TINY, steps)
  path = os.path.join(out, f"nvme-{stage}")
  os.makedirs(path, exist_ok=True)
  zn = _config(stage, offload_optimizer="nvme", nvme_path=path, nvme_chunk_size=CHUNK,
               nvme_buffer_count=3)
  x = jnp.asarray(data[0]["x"])
  state, plan = zerojax.create_train_state(GPT(helpers.TINY), helpers.make_tx(),
                                           jax.random.key(0), x, config=zn)
  opt, step = plan.nvme, zerojax.zero_step(plan)(helpers.train_step)
  batches, half = _feed(plan, data), steps // 2
  ck = Checkpointer(os.path.join(out, f"ckpt-{stage}"), async_save=False) if checkpoint else None
  state, losses = _losses(step, state, batches[:half])
  if ck is not None:
    opt.save_checkpoint(ck, state)
  state, more = _losses(step, state, batches[half:])
  _save_params(out, f"nvme-{stage}", state.params)
  res = {"losses": losses + more, "directory": opt.directory, "size": opt.size,
         "chunks": opt.stats.chunks, "store_step": opt.store.step,
         "files": _listing(os.path.join(path, "zerojax-nvme"))}
  if ck is not None:
    res["resumed"] = _resume(out, zn, x, ck, batches[half:])
    ck.close()
  return res


def _resume(out: str, zn, x, ck, batches: list[dict]) -> dict:
  """The checkpoint restored into a fresh state whose optimizer files live elsewhere."""
  import jax
  from tests import helpers
  import zerojax
  from zerojax.checkpoint import abstract_train_state
  from zerojax.models import GPT
  path = os.path.join(out, f"nvme-{zn.stage}-restored")
  os.makedirs(path, exist_ok=True)
  # The library's resume: nothing is initialised or written before the restore.
  state, plan = abstract_train_state(GPT(helpers.TINY), helpers.make_tx(), jax.random.key(1), x,
                                     config=zn.replace(offload=dataclasses.replace(zn.offload,
                                                                                   path=path)))
  state, _ = ck.restore(state, plan)
  opt, start = plan.nvme, int(state.step)
  state, losses = _losses(zerojax.zero_step(plan)(helpers.train_step), state, batches)
  _save_params(out, f"resumed-{zn.stage}", state.params)
  return {"from_step": start, "losses": losses, "steps": opt.checkpoint_steps(ck)}


def memory_run(out: str, stage: int, steps: int) -> dict:
  import jax
  import jax.numpy as jnp
  import zerojax
  from tests import helpers
  from zerojax.models import GPT
  data = helpers.batches(helpers.TINY, steps)
  state, plan = zerojax.create_train_state(GPT(helpers.TINY), helpers.make_tx(),
                                           jax.random.key(0), jnp.asarray(data[0]["x"]),
                                           config=_config(stage))
  state, losses = _losses(zerojax.zero_step(plan)(helpers.train_step), state,
                          _feed(plan, data))
  _save_params(out, f"memory-{stage}", state.params)
  return {"losses": losses}


def _timed(fn, *args, **kw) -> dict:
  t = time.perf_counter()
  res = fn(*args, **kw)
  return {**res, "seconds": round(time.perf_counter() - t, 1)}


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out")
  p.add_argument("--stages", default="3,2")
  p.add_argument("--steps", type=int, default=4)
  p.add_argument("--memory", action="store_true", help="also train each stage in memory")
  p.add_argument("--reference", action="store_true", help="one process, in memory only")
  args = p.parse_args(argv)
  info = zerojax.core.distributed.initialize()  # the launcher's environment (gloo on CPU)
  import jax
  stages = [int(s) for s in args.stages.split(",")]
  res: dict = {"process_count": jax.process_count(), "device_count": jax.device_count(),
               "local_device_count": jax.local_device_count(), "runs": {}}
  if args.reference:
    assert info.num_processes == 1, info
    for s in stages:
      res["runs"][f"memory-{s}"] = _timed(memory_run, args.out, s, args.steps)
  else:
    assert info.num_processes == 2, info
    res["mismatch"] = _timed(mismatch, args.out)
    for i, s in enumerate(stages):
      res["runs"][f"nvme-{s}"] = _timed(nvme_run, args.out, s, args.steps, checkpoint=i == 0)
      if args.memory:
        res["runs"][f"memory-{s}"] = _timed(memory_run, args.out, s, args.steps)
  name = "reference" if args.reference else f"result-{jax.process_index()}"
  with open(os.path.join(args.out, f"{name}.json"), "w") as f:
    json.dump(res, f)
  print(f"process {jax.process_index()}: done", flush=True)


if __name__ == "__main__":
  main()
