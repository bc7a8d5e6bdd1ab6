"""One process of a multi-process test run (started by tests/core/test_multiprocess.py through
``python -m zerojax.tools.launch``). Not a test module itself.

Modes:
  train OUT [--runs flat:0,flat:1,hybrid:3] [--steps N] [--save RUN]
      trains the tiny GPT of tests/helpers.py for each ``mesh:stage`` run (``flat``: one fsdp
      axis over all 8 devices; ``hybrid``: ``('replica', 'fsdp') = (2, 4)``), feeding only this
      process's rows of every global batch, and writes (process 0) ``OUT/result.json`` with
      the losses and ``OUT/params_{run}.npz`` with the final parameters gathered from all
      processes. The final state of run ``--save`` is checkpointed into ``OUT/``.
  agree [--stage 2,3] [--lr 1e-3,1e-1] [--mesh flat,hybrid] [--threshold 4096,1]
      each process takes its own value of an ``a,b`` option, creates the tiny GPT's state and
      runs one step: processes that disagree must raise ProcessMismatchError before it.
  hfdata OUT
      builds fine-tuning batches (`zerojax.tools.hf_data.Batches`, `eval_batches`) from
      `hf_rows` over the 8-device mesh, and writes ``OUT/hfdata_{process}.json``: per step the
      rows this process fed and the global batch, for steps 0-3, for a run resumed at step 2,
      and for the evaluation batches.
  die
      initialises, runs one collective, then process 1 exits abruptly; process 0 keeps
      stepping and must be stopped by JAX's heartbeat.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zerojax.core.agreement  # noqa: E402
import zerojax.core.distributed  # noqa: E402


def train(args) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils

  import zerojax
  from tests import helpers
  from zerojax.runtime.data import process_rows
  from zerojax.models import GPT

  cfg = helpers.TINY
  data = helpers.batches(cfg, args.steps)
  result = {"process_count": jax.process_count(), "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(), "losses": {}, "mesh": {},
            "rows": {}, "mesh_processes": {}}
  for run in args.runs:
    kind, stage = run.split(":")
    stage = int(stage)
    kw = ({} if kind == "flat" else
          {"mesh_shape": (2, -1), "mesh_axes": ("replica", "fsdp")})
    zc = zerojax.ZeroConfig.from_flat(dict(stage=stage,
                                           param_persistence_threshold=helpers.THRESHOLD, **kw))
    model = GPT(cfg)
    state, plan = zerojax.create_train_state(model, helpers.make_tx(), jax.random.key(0),
                                             jnp.asarray(data[0]["x"]), config=zc)
    step = zerojax.zero_step(plan)(helpers.train_step)
    sharding = plan.batch({"x": data[0]["x"]})["x"]
    rows = process_rows(sharding, helpers.BATCH)
    losses = []
    for b in data:
      # Only this process's rows are handed to JAX; the global array is assembled from them.
      local = {k: v[rows] for k, v in b.items()}
      batch = {k: jax.make_array_from_process_local_data(sharding, v, b[k].shape)
               for k, v in local.items()}
      state, m = step(state, batch)
      losses.append(float(m["loss"]))
    result["losses"][run] = losses
    result["mesh"][run] = {k: int(v) for k, v in plan.mesh.shape.items()}
    result["mesh_processes"][run] = np.vectorize(lambda d: d.process_index)(
        plan.mesh.devices).tolist()
    result["rows"][run] = [int(r) for r in rows]
    params = multihost_utils.process_allgather(state.params, tiled=True)
    if jax.process_index() == 0:
      flat = {jax.tree_util.keystr(k): np.asarray(v)
              for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
      np.savez(os.path.join(args.out, f"params_{run.replace(':', '_')}.npz"), **flat)
    if run == args.save:
      result["zerojax_checkpoint"] = save_checkpoint(args.out, state, plan)
  if jax.process_index() == 0:
    with open(os.path.join(args.out, "result.json"), "w") as f:
      json.dump(result, f)
  print(f"process {jax.process_index()}: done {json.dumps(result['losses'])}", flush=True)


def hf_rows():
  """40 one-document rows of 8 tokens; row i's tokens are all i + 1 (its id, in x[:, 0])."""
  import numpy as np
  from zerojax.tools import hf_data
  docs = [(np.full(5, i + 1, np.int32), np.ones(5, np.int32)) for i in range(40)]
  return hf_data.pad(docs, 8, 0)


def hfdata(args) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils

  import zerojax
  from tests import helpers
  from zerojax.models import GPT
  from zerojax.tools import hf_data

  n = 16
  zc = zerojax.ZeroConfig(stage=3)
  x = jax.ShapeDtypeStruct((n, 8), jnp.int32)
  _, plan = zerojax.create_train_state(GPT(helpers.TINY), helpers.make_tx(), jax.random.key(0),
                                       jnp.zeros((n, 8), jnp.int32), config=zc)
  sharding = plan.batch({"x": x})["x"]  # as `zerojax finetune` builds it
  rows = hf_rows()

  def ids(batch):
    shards = {s.index[0].start or 0: s.data for s in batch["x"].addressable_shards}  # 1 per row block
    local = [int(v) for k in sorted(shards) for v in np.asarray(shards[k])[:, 0]]
    whole = multihost_utils.process_allgather(batch["x"], tiled=True)
    return local, [int(v) for v in np.asarray(whole)[:, 0]]

  out = {"local": [], "global": [], "resumed": [], "eval": []}
  it = hf_data.Batches(rows, n, seed=0, sharding=sharding)
  for _ in range(4):
    loc, whole = ids(next(it))
    out["local"].append(loc), out["global"].append(whole)
  resumed = hf_data.Batches(rows, n, seed=0, sharding=sharding, step=2)
  out["resumed"] = [ids(next(resumed))[1] for _ in range(2)]
  out["eval"] = [ids(b)[1] for b in hf_data.eval_batches(rows, n, sharding)]
  with open(os.path.join(args.out, f"hfdata_{jax.process_index()}.json"), "w") as f:
    json.dump(out, f)
  print(f"process {jax.process_index()}: done", flush=True)


def save_checkpoint(out: str, state, plan) -> str:
  """Saves the state from every process: always directly with orbax (so the restore test runs
  either way), and with zerojax.runtime.checkpoint when it exists. Returns what happened to the latter.

  Assumed zerojax.runtime.checkpoint API: ``Checkpointer(directory)``, ``.save(step, state)``,
  ``.wait()``, ``.restore(abstract_state, plan, step=None)``.
  """
  import orbax.checkpoint as ocp
  tree = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(out, "orbax_ckpt"), tree)
  ckptr.wait_until_finished()
  try:
    from zerojax.runtime import checkpoint as zckpt
  except ImportError:
    return "missing"
  try:
    c = zckpt.Checkpointer(os.path.join(out, "zerojax_ckpt"))
    c.save(int(state.step), state)
    c.wait()
  except Exception as e:  # noqa: BLE001 - reported by the test that needs it
    return f"error: {type(e).__name__}: {e}"
  return "saved"


def die(args) -> None:
  import jax
  import numpy as np
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(AxisType.Auto,))
  sh = NamedSharding(mesh, P("fsdp"))
  x = jax.make_array_from_process_local_data(sh, np.ones(jax.local_device_count(), np.float32))
  f = jax.jit(lambda x: x.sum())
  print(f"process {jax.process_index()}: first sum {float(f(x))}", flush=True)
  if jax.process_index() == 1:
    print(f"DYING at {time.time():.3f}", flush=True)
    if args.sigkill:
      os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)
  t0 = time.time()
  if args.raise_after_death:
    time.sleep(1.0)
    raise RuntimeError("simulated failure of process 0 after its peer died")
  while time.time() - t0 < args.survive_for:
    f(x).block_until_ready()
    time.sleep(0.02)
  print("SURVIVED: the death of process 1 went unnoticed", flush=True)


def agree(args) -> None:
  """Each process takes its own value of every ``a,b`` option (process 0: ``a``), builds the
  tiny GPT's state and runs one step; processes that disagree must fail before it."""
  import jax
  import jax.numpy as jnp
  import optax

  import zerojax
  from tests import helpers
  from zerojax.models import GPT

  pick = lambda v: v.split(",")[jax.process_index()] if "," in v else v
  kw = ({} if pick(args.mesh) == "flat" else
        {"mesh_shape": (2, -1), "mesh_axes": ("replica", "fsdp")})
  zc = zerojax.ZeroConfig.from_flat(dict(
      stage=int(pick(args.stage)), param_persistence_threshold=int(pick(args.threshold)), **kw))
  tx = optax.adamw(float(pick(args.lr)), eps=1e-6, weight_decay=0.1)
  data = helpers.batches(helpers.TINY, 1, batch=8)
  state, plan = zerojax.create_train_state(GPT(helpers.TINY), tx, jax.random.key(0),
                                           jnp.asarray(data[0]["x"]), config=zc)
  print(f"process {jax.process_index()}: state created", flush=True)
  step = zerojax.zero_step(plan)(helpers.train_step)
  try:
    state, m = step(state, jax.tree.map(jnp.asarray, data[0]))
  except zerojax.core.agreement.ProcessMismatchError as e:
    print(f"MISMATCH process {jax.process_index()}: {e}", flush=True)
    raise
  print(f"STEP-DONE process {jax.process_index()}: loss {float(m['loss'])}", flush=True)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("mode", choices=["train", "die", "agree", "hfdata"])
  p.add_argument("out", nargs="?")
  p.add_argument("--runs", default="flat:0,flat:1,flat:2,flat:3")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--save", default="")
  p.add_argument("--survive-for", type=float, default=60.0)
  p.add_argument("--sigkill", action="store_true", help="die: process 1 SIGKILLs itself")
  p.add_argument("--raise-after-death", action="store_true",
                 help="die: process 0 raises an exception once process 1 is dead")
  p.add_argument("--stage", default="3")
  p.add_argument("--lr", default="1e-3")
  p.add_argument("--mesh", default="flat")
  p.add_argument("--threshold", default="64")
  args = p.parse_args()
  args.runs = [r for r in args.runs.split(",") if r]
  info = zerojax.core.distributed.initialize()  # reads the launcher's environment
  assert info.num_processes == 2, info
  assert zerojax.core.distributed.initialize() == info  # a second call is harmless
  {"train": train, "die": die, "agree": agree, "hfdata": hfdata}[args.mode](args)


if __name__ == "__main__":
  main()
