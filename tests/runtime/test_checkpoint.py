"""Sharded checkpoints: async save, retention, exact resume in a new process, restore onto other
stages/device counts/memory kinds, export, and faults (killed save, corruption, mismatch)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from zerojax.tools import export as zx
from zerojax.checkpoint import (Checkpointer, CheckpointError, CheckpointNotFoundError,
                                abstract_train_state, leaf_checksum, numpy_checksum)
from zerojax.models import GPT
from zerojax.core.plan import path_str
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(ROOT, "tests", "checkpoint_child.py")
N = 3  # steps before the checkpoint; the continuous run trains 2N


def run_child(mode: str, args: dict, devices: int = 8, timeout: int = 300) -> str:
  p = subprocess.run([sys.executable, CHILD, mode, json.dumps(args)], env=helpers.child_env(devices),
                     capture_output=True, text=True, timeout=timeout)
  assert p.returncode == 0, f"child {mode} failed:\n{p.stdout}\n{p.stderr[-4000:]}"
  return p.stdout


def config(stage, **kw):
  return zerojax.ZeroConfig.from_flat(dict(stage=stage,
                                           param_persistence_threshold=helpers.THRESHOLD, **kw))


def first_x():
  return jnp.asarray(helpers.batches(helpers.TINY, 1)[0]["x"])


def target(stage, devices, **kw):
  """(abstract state, plan) of the tiny GPT at ``stage`` on the first ``devices`` devices."""
  zc = config(stage, **kw)
  mesh = zerojax.make_mesh(zc, devices=jax.devices()[:devices])
  return abstract_train_state(GPT(helpers.TINY), helpers.make_tx(), jax.random.key(0), first_x(),
                              config=zc, mesh=mesh)


def to_numpy(tree):
  return jax.tree.map(np.asarray, tree)


def assert_tree_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


def assert_placed(state, plan):
  """Every restored leaf has exactly the sharding (and memory kind) the plan gives it."""
  want = jax.tree.leaves(plan.state(state))
  for x, s in zip(jax.tree.leaves(state), want):
    assert x.sharding.is_equivalent_to(s, x.ndim), (x.sharding, s)
    assert (x.sharding.memory_kind or "device") == (s.memory_kind or "device")


# -- one continuous run: 2N steps at stage 3 on 8 devices, saving at step N ------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """Trains 2N steps in one go, saving (async) at step N while training goes on."""
  d = str(tmp_path_factory.mktemp("ckpt") / "run")
  zc = config(3)
  data = helpers.batches(helpers.TINY, 2 * N)
  state, plan = zerojax.create_train_state(GPT(helpers.TINY), helpers.make_tx(),
                                           jax.random.key(0), jnp.asarray(data[0]["x"]),
                                           config=zc)
  step = zerojax.zero_step(plan)(helpers.train_step)
  ck = Checkpointer(d, config=zc)
  losses, snap, rng = [], None, jax.random.key(42)
  for i, b in enumerate(data):
    if i == N:
      snap = to_numpy(state)  # what the checkpoint must hold
      ck.save(N, state, rng=rng, data={"next_batch": N})
      # no wait: the next step donates `state` while the save is still being written
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  ck.wait()
  ck.close()
  return dict(dir=d, config=zc, plan=plan, losses=losses, snap=snap, rng=rng,
              final=to_numpy(state.params), state=state)


def test_checkpoint_holds_step_rng_params_opt_config_data(run):
  with Checkpointer(run["dir"], read_only=True) as ck:
    assert ck.all_steps() == [N] and ck.latest_step() == N
    meta = ck.read_meta()
    target_state, plan = target(3, 8)
    state, extras = ck.restore(target_state, plan)
  assert meta["config"] == run["config"].to_flat()
  assert extras.step == N and extras.data == {"next_batch": N}
  assert extras.config == run["config"].to_flat()
  np.testing.assert_array_equal(jax.random.key_data(extras.rng),
                                jax.random.key_data(run["rng"]))
  # the async save overlapped a donating train step and still holds the values at step N
  assert_tree_equal(state.params, run["snap"].params)
  assert_tree_equal(state.opt_state, run["snap"].opt_state)
  assert int(state.step) == N
  assert_placed(state, plan)
  # each process writes its own shards (OCDBT: one sub-database per process)
  assert os.path.isdir(os.path.join(run["dir"], str(N), "state", "ocdbt.process_0"))


@pytest.mark.slow
def test_checkpoint_exact_resume_in_new_process(run, tmp_path):
  out = str(tmp_path / "resumed.npz")
  run_child("resume", {"dir": run["dir"], "config": {"stage": 3, "param_persistence_threshold":
                                                      helpers.THRESHOLD},
                       "total": 2 * N, "out": out})
  r = np.load(out)
  # bit-identical: losses of steps N..2N-1 and the final parameters
  np.testing.assert_array_equal(r["losses"], np.asarray(run["losses"][N:], np.float32))
  flat = {jax.tree_util.keystr(k): v
          for k, v in jax.tree_util.tree_flatten_with_path(run["final"])[0]}
  for k, v in flat.items():
    np.testing.assert_array_equal(r[k], v, err_msg=k)
  np.testing.assert_array_equal(r["rng"], jax.random.key_data(run["rng"]))
  assert int(r["step"]) == 2 * N


@pytest.mark.slow
def test_checkpoint_stage3_8dev_to_stage1_4dev_and_back(run, tmp_path):
  """Restore a stage-3/8-device checkpoint at stage 1 on 4 devices, train on, save, and restore
  that at stage 3 on 8 devices; training matches the continuous run."""
  target_state, plan4 = target(1, 4)
  with Checkpointer(run["dir"], read_only=True) as ck:
    state, extras = ck.restore(target_state, plan4)
  assert_placed(state, plan4)
  assert state.params["blocks"]["fc"]["kernel"].sharding.mesh.size == 4
  step = zerojax.zero_step(plan4)(helpers.train_step)
  losses = []
  for b in helpers.batches(helpers.TINY, 2 * N)[extras.data["next_batch"]:]:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  # another device count sums in another order: equal to fp32 noise, not bitwise
  np.testing.assert_allclose(losses, run["losses"][N:], rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
               to_numpy(state.params), run["final"])
  back = str(tmp_path / "back")
  with Checkpointer(back, config=plan4.config) as ck:
    ck.save(2 * N, state, data={"next_batch": 2 * N})
  saved = to_numpy(state)
  target8, plan8 = target(3, 8)
  with Checkpointer(back, read_only=True) as ck:
    state8, extras = ck.restore(target8, plan8)
  assert extras.config["stage"] == 1
  assert_placed(state8, plan8)
  assert_tree_equal(state8, saved)


# -- the topology matrix: stages {0,1,2,3} x devices {1,2,4,8}, with pinned_host offload -----------

# (source stage, devices, offload) -> (target stage, devices, offload). Every stage and every
# device count appears as a source and as a target, offloaded optimizer state on both sides.
# (Sources replicated over many devices are few on purpose: orbax splits a replicated array
# over its replicas to save it, which costs a small compile per slice on CPU.)
MATRIX = [
    ((0, 1, False), (2, 2, False)),
    ((2, 2, False), (3, 4, False)),
    ((3, 4, False), (0, 8, False)),
    ((3, 8, True), (1, 2, True)),
    ((1, 2, True), (3, 8, False)),
    ((2, 4, True), (0, 1, False)),
    ((0, 2, False), (3, 1, True)),
    ((3, 1, False), (1, 8, False)),
]


def _kw(offload):
  return {"offload_optimizer": True} if offload else {}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """Saved random states, one per source topology of MATRIX (no training, no compiles)."""
  root = tmp_path_factory.mktemp("matrix")
  out = {}
  for i, (src, _) in enumerate(MATRIX):
    if src in out:
      continue
    stage, n, off = src
    abstract, plan = target(stage, n, **_kw(off))
    rng = np.random.default_rng(i)

    def fill(x):
      if jnp.issubdtype(x.dtype, jnp.floating):
        v = rng.standard_normal(x.shape).astype(x.dtype)
      else:
        v = np.asarray(rng.integers(0, 1000, x.shape), x.dtype)
      return jax.device_put(v, x.sharding)

    state = jax.tree.map(fill, abstract)
    d = str(root / f"s{stage}_d{n}_o{int(off)}")
    with Checkpointer(d, config=plan.config) as ck:
      ck.save(7, state, rng=jax.random.key(i), data={"epoch": 1, "pos": i})
    out[src] = (d, to_numpy(state), i)
  return out


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", MATRIX, ids=lambda t: f"s{t[0]}d{t[1]}{'h' if t[2] else ''}")
def test_checkpoint_restore_topology_matrix(src, dst, sources):
  d, saved, i = sources[src]
  stage, n, off = dst
  abstract, plan = target(stage, n, **_kw(off))
  with Checkpointer(d, read_only=True) as ck:
    state, extras = ck.restore(abstract, plan)
  assert_tree_equal(state, saved)
  assert_placed(state, plan)
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}
  assert kinds == ({"pinned_host"} if off else {"device"})
  assert extras.data == {"epoch": 1, "pos": i} and extras.step == 7
  np.testing.assert_array_equal(jax.random.key_data(extras.rng),
                                jax.random.key_data(jax.random.key(i)))


# -- retention and save options -------------------------------------------------------------------


def test_checkpoint_retention_keep_last_n_and_every_k(tmp_path):
  params = {"w": jnp.arange(16.0).reshape(4, 4)}
  with Checkpointer(tmp_path / "r", max_to_keep=2, keep_every=4) as ck:
    for s in range(1, 10):
      assert ck.save(s, {"params": jax.tree.map(lambda x: x + s, params)})
    ck.wait()
    assert ck.all_steps() == [4, 8, 9]
    with pytest.raises(CheckpointError, match="already exists"):
      ck.save(9, {"params": params})
  with Checkpointer(tmp_path / "i", save_interval_steps=5) as ck:
    assert not ck.save(3, {"params": params})
    assert ck.save(3, {"params": params}, force=True)
    assert ck.save(5, {"params": params})
    ck.wait()
    assert ck.all_steps() == [3, 5]
  for bad in (dict(max_to_keep=0), dict(keep_every=-1), dict(save_interval_steps=0)):
    with pytest.raises(ValueError, match=list(bad)[0]):
      Checkpointer(tmp_path / "bad", **bad)


def test_checkpoint_checksum_is_sharding_independent():
  x = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)
  mesh = zerojax.make_mesh(zerojax.ZeroConfig(stage=3), devices=jax.devices())
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  a = jax.jit(leaf_checksum)(jax.device_put(x, sh))
  b = jax.jit(leaf_checksum)(jnp.asarray(x))
  assert [int(v) for v in a] == [int(v) for v in b] == list(numpy_checksum(x))
  y = x.copy()
  y[0, 0], y[0, 1] = x[0, 1], x[0, 0]  # a swap changes it
  assert numpy_checksum(y) != numpy_checksum(x)
  for dt in (np.int32, np.uint8, np.bool_):
    z = (x > 0).astype(dt)
    assert [int(v) for v in jax.jit(leaf_checksum)(jnp.asarray(z))] == list(numpy_checksum(z))
  z = x.astype(jnp.bfloat16)
  assert [int(v) for v in jax.jit(leaf_checksum)(jnp.asarray(z))] == list(numpy_checksum(z))


# -- faults --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_checkpoint_killed_save_leaves_last_complete(tmp_path):
  """A save killed (SIGKILL) after writing its shards but before its commit is ignored."""
  d = str(tmp_path / "k")
  p = subprocess.Popen([sys.executable, CHILD, "kill", json.dumps({"dir": d})],
                       env=helpers.child_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
  try:
    seen = []
    deadline = time.time() + 240
    while time.time() < deadline and "STALLED" not in seen:
      line = p.stdout.readline()
      if not line:
        break
      seen.append(line.strip())
    assert "SAVED1" in seen and "STALLED" in seen, (seen, p.stderr.read()[-3000:])
    partial = [e for e in os.listdir(d) if e.startswith("2") and e != "2"]
  finally:
    p.send_signal(signal.SIGKILL)
    p.wait()
  assert partial, os.listdir(d)  # the killed save left a partial directory behind
  assert "2" not in os.listdir(d)
  params = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32),
            "b": jax.ShapeDtypeStruct((256,), jnp.float32)}
  zc = zerojax.ZeroConfig(stage=3, gather=zerojax.Gather(persistence_threshold=1))
  plan = zerojax.ShardingPlan.create(zc, zerojax.make_mesh(zc), params)
  want = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)
  with Checkpointer(d, read_only=True) as ck:  # a reader sees only the complete step
    assert ck.all_steps() == [1]
    state, extras = ck.restore({"params": params}, plan)
  np.testing.assert_array_equal(np.asarray(state["params"]["w"]), want)
  assert extras.data == {"pos": 1}
  assert state["params"]["w"].sharding == plan.params["w"]
  with Checkpointer(d) as ck:  # a writer cleans the partial directory up and saves step 2
    assert ck.all_steps() == [1]
    ck.save(2, state, data={"pos": 2})
  assert sorted(os.listdir(d)) == ["1", "2"]
  with Checkpointer(d, read_only=True) as ck:
    assert ck.all_steps() == [1, 2]
    assert ck.restore({"params": params}, plan)[1].data == {"pos": 2}


def _copy(run, tmp_path, name):
  d = str(tmp_path / name)
  shutil.copytree(run["dir"], d)
  return d


def _data_files(d):
  root = os.path.join(d, str(N), "state", "ocdbt.process_0", "d")
  if not os.path.isdir(root):
    root = os.path.join(d, str(N), "state", "d")
  files = [os.path.join(root, f) for f in os.listdir(root)]
  return sorted(files, key=os.path.getsize, reverse=True)


def test_checkpoint_corrupted_bytes_fail_naming_leaf(run, tmp_path):
  d = _copy(run, tmp_path, "corrupt")
  f = _data_files(d)[0]
  with open(f, "r+b") as fh:
    size = os.path.getsize(f)
    fh.seek(size // 2)
    chunk = bytearray(fh.read(64))
    fh.seek(size // 2)
    fh.write(bytes(b ^ 0x5A for b in chunk))
  abstract, plan = target(3, 8)
  with Checkpointer(d, read_only=True) as ck:
    with pytest.raises(CheckpointError) as e:
      ck.restore(abstract, plan)
  msg = str(e.value)
  assert os.path.join(d, str(N)) in msg
  assert "leaf '" in msg and ("params/" in msg or "opt_state/" in msg), msg
  out = str(tmp_path / "c.npz")
  if "leaf 'params/" in msg:  # export reads the parameters only: it must fail too
    with pytest.raises(CheckpointError, match="params/"):
      zx.export(d, out)
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")
  else:  # the damage is in the optimizer state: the exported parameters are still exact
    got, _ = zx.load_npz(zx.export(d, out)["path"])
    np.testing.assert_array_equal(got["blocks/fc/kernel"],
                                  run["snap"].params["blocks"]["fc"]["kernel"])


def test_checkpoint_truncated_file_fails_naming_leaf(run, tmp_path):
  d = _copy(run, tmp_path, "trunc")
  f = _data_files(d)[0]
  os.truncate(f, os.path.getsize(f) // 2)
  abstract, plan = target(3, 8)
  with Checkpointer(d, read_only=True) as ck:
    with pytest.raises(CheckpointError) as e:
      ck.restore(abstract, plan)
  msg = str(e.value)
  assert os.path.join(d, str(N)) in msg and "leaf '" in msg, msg


def _leaves_in_data_file(db_dir, data_file):
  """Leaves with a chunk stored in ``data_file`` of the OCDBT database at ``db_dir``, read
  from the database's own B-tree (``tensorstore.ocdbt.dump``), independently of zerojax."""
  import tensorstore as ts
  base = ts.KvStore.open({"driver": "file", "path": db_dir + "/"}).result()
  ref = "value::d/" + os.path.basename(data_file) + ":"

  def walk(loc, prefix=b""):
    node = ts.ocdbt.dump(base, loc).result()
    for e in node.get("entries", []):
      if node.get("height", 0):
        yield from walk(e["location"], prefix + e.get("subtree_common_prefix", b""))
      else:
        yield prefix + e["key"], e.get("indirect_value") or ""

  root = ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]
  return {k.decode().split("/")[0].replace(".", "/") for k, v in walk(root)
          if v.startswith(ref)}


def test_checkpoint_deleted_data_file_names_the_damaged_leaves(run, tmp_path):
  """Deleting an OCDBT data file: the error names exactly the leaves stored in it
  (and every leaf of an intact checkpoint, ``opt_state/0/...`` included, reads back alone)."""
  from zerojax.runtime.checkpoint import read_leaf
  d = _copy(run, tmp_path, "deleted")
  with Checkpointer(d, read_only=True) as ck:
    assert ck._find_unreadable_leaves(N) == []
    md = ck._mgr.metadata(N).item_metadata["state"]
  tree = md.tree if hasattr(md, "tree") else md
  mu_kp = (jax.tree_util.DictKey("opt_state"), jax.tree_util.SequenceKey(0),
           jax.tree_util.DictKey("mu"), jax.tree_util.DictKey("head"),
           jax.tree_util.DictKey("kernel"))
  np.testing.assert_array_equal(read_leaf(os.path.join(d, str(N), "state"), mu_kp, tree),
                                run["snap"].opt_state[0].mu["head"]["kernel"])
  # the largest data file that holds parameters (which leaves share a file varies from run
  # to run with the async writer's timing)
  files = _data_files(d)
  db = os.path.dirname(os.path.dirname(files[0]))
  victim, damaged = next((f, leaves) for f in files
                         for leaves in [_leaves_in_data_file(db, f)]
                         if any(p.startswith("params/") for p in leaves))
  abstract, plan = target(3, 8)
  # emptied (the file is there, its data gone): the restore fails and names the leaves
  os.truncate(victim, 0)
  with Checkpointer(d, read_only=True) as ck:
    assert {p for p, _ in ck._find_unreadable_leaves(N)} == damaged
    with pytest.raises(CheckpointError) as e:
      ck.restore(abstract, plan)
  # deleted: the step is not complete (as after a killed retention pass), and says which
  # leaves it lost
  os.remove(victim)
  with Checkpointer(d, read_only=True) as ck:
    assert ck.all_steps() == []
    with pytest.raises(CheckpointNotFoundError) as e2:
      ck.restore(abstract, plan)
  for msg in (str(e.value).split("; orbax says")[0], str(e2.value)):
    assert f"{len(damaged)} leaves cannot be read" in msg, msg
    named = re.findall(r"'((?:params|opt_state)/[^']*)'", msg)
    assert named and set(named) <= damaged, (named, damaged)
    assert "opt_state/0/count" not in msg, msg
    assert named[0].startswith("params/"), msg  # parameters are named first


def test_checkpoint_mismatched_shape_and_dtype(run):
  import dataclasses
  wide = dataclasses.replace(helpers.TINY, d_model=128)
  zc = config(3)
  abstract, plan = abstract_train_state(GPT(wide), helpers.make_tx(), jax.random.key(0),
                                        first_x(), config=zc)
  with Checkpointer(run["dir"], read_only=True) as ck:
    with pytest.raises(CheckpointError) as e:
      ck.restore(abstract, plan)
    msg = str(e.value)
    assert run["dir"] in msg and "params/" in msg and "(2, 64" in msg and "128" in msg, msg
    abstract, plan = target(3, 8, param_dtype="bfloat16")
    with pytest.raises(CheckpointError, match=r"leaf 'params/.*float32.*bfloat16"):
      ck.restore(abstract, plan)
    deep = dataclasses.replace(helpers.TINY, num_layers=3)
    abstract, plan = abstract_train_state(GPT(deep), helpers.make_tx(), jax.random.key(0),
                                          first_x(), config=zc)
    with pytest.raises(CheckpointError, match=r"stored as shape \(2,"):
      ck.restore(abstract, plan)


def test_checkpoint_missing_directory_and_step(run, tmp_path):
  missing = str(tmp_path / "nope")
  with pytest.raises(CheckpointNotFoundError, match="nope.*does not exist"):
    Checkpointer(missing, read_only=True)
  with pytest.raises(CheckpointNotFoundError, match="does not exist"):
    zx.export(missing, str(tmp_path / "x.npz"))
  assert zx.main([missing, str(tmp_path / "x.npz")]) == 1
  abstract, plan = target(3, 8)
  with Checkpointer(tmp_path / "empty") as ck:
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
      ck.restore(abstract, plan)
  with Checkpointer(run["dir"], read_only=True) as ck:
    with pytest.raises(CheckpointNotFoundError, match=rf"no step 99; complete steps are \[{N}\]"):
      ck.restore(abstract, plan, step=99)


def _small_params(tmp_path, steps, **kw):
  """A params-only checkpoint of a sharded 2-leaf model at each of ``steps``."""
  zc = zerojax.ZeroConfig(stage=3, gather=zerojax.Gather(persistence_threshold=1))
  abstract = {"w": jax.ShapeDtypeStruct((256, 64), jnp.float32),  # shards > 1 KiB: not
              "b": jax.ShapeDtypeStruct((64,), jnp.float32), **kw}  # inlined in the index
  plan = zerojax.ShardingPlan.create(zc, zerojax.make_mesh(zc), abstract)
  d = str(tmp_path / "small")
  values = {}
  with Checkpointer(d, config=zc, max_to_keep=None) as ck:
    for s in steps:
      rng = np.random.default_rng(s)  # random: compressed shards stay > 1 KiB
      values[s] = {k: rng.standard_normal(x.shape).astype(x.dtype) for k, x in abstract.items()}
      ck.save(s, {"params": jax.tree.map(jax.device_put, values[s], plan.params)},
               data={"pos": s})
  return d, {"params": abstract}, plan, values


def test_checkpoint_incomplete_steps_are_not_listed_and_restore_falls_back(tmp_path):
  d, abstract, plan, values = _small_params(tmp_path, [1, 2, 3, 4])
  # step 4: a retention pass killed part-way (its data files gone, the rest of the step left);
  # step 3: its metadata file gone; step 9: an empty numbered directory. (Deleting only some
  # data files was once seen listed as complete in a full-suite run: which leaves share a file
  # varies from run to run, so that case is not asserted here.)
  data = os.path.join(d, "4", "state", "ocdbt.process_0", "d")
  for f in sorted(os.listdir(data)):
    os.remove(os.path.join(data, f))
  os.remove(os.path.join(d, "3", "_CHECKPOINT_METADATA"))
  os.mkdir(os.path.join(d, "9"))
  with Checkpointer(d, read_only=True) as ck:
    assert ck.all_steps() == [1, 2] and ck.latest_step() == 2
    why = ck.incomplete_steps()
    assert sorted(why) == [3, 4, 9], why
    assert "data files are missing" in why[4] and "empty directory" in why[9], why
    assert "_CHECKPOINT_METADATA" in why[3], why
    with pytest.warns(UserWarning, match=r"using step 2.*skipped step 3 .*step 4 .*step 9 "
                                         r"\(empty directory\)"):
      state, extras = ck.restore(abstract, plan)
    assert extras.step == 2 and extras.data == {"pos": 2}
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), values[2]["w"])
    with pytest.raises(CheckpointNotFoundError, match="step 4 is incomplete: .*missing"):
      ck.restore(abstract, plan, step=4)
  os.mkdir(os.path.join(d, "9.incomplete"))
  # A writer moves them aside (nothing is deleted): retention (keep 3) must not count them
  with pytest.warns(UserWarning, match=r"'.*/9' is not a complete.*moved it to '.*9\.incomplete1'"):
    ck = Checkpointer(d, max_to_keep=3)
  with ck:
    assert ck.all_steps() == [1, 2] and ck.incomplete_steps() == {}
    ck.save(10, {"params": state["params"]}, data={"pos": 10})
    ck.wait()
    assert ck.all_steps() == [1, 2, 10]
    assert sorted(os.listdir(d)) == ["1", "10", "2", "3.incomplete", "4.incomplete",
                                     "9.incomplete", "9.incomplete1"]
    os.mkdir(os.path.join(d, "11"))  # appears while a writer is open: not written over
    with pytest.raises(CheckpointError, match=r"'.*11' exists but is not a complete.*empty"):
      ck.save(11, {"params": state["params"]})
  with Checkpointer(d, read_only=True) as reader:
    assert reader.all_steps() == [1, 2, 10]


def test_checkpoint_zero_size_leaf_round_trip(tmp_path):
  d, abstract, plan, values = _small_params(
      tmp_path, [1], empty=jax.ShapeDtypeStruct((0, 8), jnp.bfloat16))
  with Checkpointer(d, read_only=True) as ck:
    assert ck.read_meta()["leaves"]["params/empty"] == {"shape": [0, 8], "dtype": "bfloat16"}
    state, extras = ck.restore(abstract, plan)
  e = state["params"]["empty"]
  assert e.shape == (0, 8) and e.dtype == jnp.bfloat16 and e.sharding == plan.params["empty"]
  np.testing.assert_array_equal(np.asarray(state["params"]["w"]), values[1]["w"])
  wrong = {"params": {**abstract["params"], "empty": jax.ShapeDtypeStruct((0, 8), jnp.float32)}}
  with Checkpointer(d, read_only=True) as ck:
    with pytest.raises(CheckpointError, match=r"'params/empty' is stored as shape \(0, 8\) "
                                              "bfloat16"):
      ck.restore(wrong, plan)


def test_checkpoint_step_recorded_in_metadata_must_match_directory(tmp_path):
  from zerojax.runtime.checkpoint import CheckpointStepMismatchError
  d, abstract, plan, values = _small_params(tmp_path, [1, 2])
  meta_file = os.path.join(d, "2", "meta", "metadata")
  meta = json.load(open(meta_file))
  meta["step"] = 999
  json.dump(meta, open(meta_file, "w"))
  os.symlink(os.path.join(d, "1"), os.path.join(d, "6"))
  with Checkpointer(d, read_only=True) as ck:
    with pytest.raises(CheckpointStepMismatchError,
                       match=r"'.*/6'.*records step 1, but the directory is step 6; the "
                             "directory is a link to"):
      ck.restore(abstract, plan)
    with pytest.raises(CheckpointStepMismatchError, match=r"records step 999.*is step 2"):
      ck.restore(abstract, plan, step=2)
    assert ck.restore(abstract, plan, step=1)[1].step == 1
  with pytest.raises(CheckpointError, match="records step 999"):
    zx.export(d, str(tmp_path / "x.npz"), step=2)


# -- export -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_checkpoint_export(run, tmp_path, fmt, dtype):
  out = str(tmp_path / f"model.{fmt}")
  info = zx.export(run["dir"], out, dtype=dtype, format=fmt)
  assert info["step"] == N and info["num_leaves"] == len(jax.tree.leaves(run["snap"].params))
  want = {"/".join(str(getattr(k, "key", k)) for k in kp): v
          for kp, v in jax.tree_util.tree_flatten_with_path(run["snap"].params)[0]}
  if fmt == "npz":
    got, meta = zx.load_npz(out)
    assert meta["step"] == N and meta["config"]["stage"] == 3
  else:
    import safetensors.numpy
    got = safetensors.numpy.load_file(out)
  assert set(got) == set(want)
  for k, v in want.items():
    w = v if dtype == "float32" else v.astype(jnp.bfloat16)
    assert got[k].dtype == w.dtype, k
    np.testing.assert_array_equal(got[k], w, err_msg=k)


@pytest.mark.slow
def test_checkpoint_export_command_line_one_device(run, tmp_path):
  """`python -m zerojax.tools.export` on a 1-device process (trained on 8), bf16 safetensors."""
  out = str(tmp_path / "m.safetensors")
  p = subprocess.run([sys.executable, "-m", "zerojax.tools.export", run["dir"], out, "--dtype", "bf16"],
                     env=helpers.child_env(1), capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert p.returncode == 0, p.stderr[-3000:]
  assert f"exported step {N}" in p.stdout
  import safetensors.numpy
  got = safetensors.numpy.load_file(out)
  np.testing.assert_array_equal(got["blocks/fc/kernel"],
                                run["snap"].params["blocks"]["fc"]["kernel"].astype(jnp.bfloat16))
  p = subprocess.run([sys.executable, "-m", "zerojax.tools.export", str(tmp_path / "none"), out],
                     env=helpers.child_env(1), capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert p.returncode == 1 and "does not exist" in p.stderr


@pytest.mark.slow
def test_checkpoint_export_peak_host_memory(tmp_path):
  """Export of a ~48 MiB model (saved sharded on 8 devices) in a 1-device process: peak host
  memory of the export is measured (VmHWM reset before it) and stays below 1x the model."""
  rng = np.random.default_rng(0)
  params = {f"layer{i}": {"kernel": rng.standard_normal((1024, 1024), dtype=np.float32),
                          "bias": rng.standard_normal((1024,), dtype=np.float32)}
            for i in range(12)}
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  zc = zerojax.ZeroConfig(stage=3)
  plan = zerojax.ShardingPlan.create(zc, zerojax.make_mesh(zc), params)
  sharded = jax.tree.map(jax.device_put, params, plan.params)
  del params
  with Checkpointer(tmp_path / "big", config=zc) as ck:
    ck.save(1, {"params": sharded})
  with Checkpointer(tmp_path / "small") as ck:
    ck.save(1, {"params": {"w": jnp.ones((4, 4))}})
  out = run_child("export_mem", {"dir": str(tmp_path / "big"), "out": str(tmp_path / "big.npz"),
                                 "warm_dir": str(tmp_path / "small"),
                                 "warm_out": str(tmp_path / "small.npz"),
                                 "dtype": "float32", "format": "npz"}, devices=1)
  m = json.loads(out.strip().splitlines()[-1])
  report = (f"export peak host memory: model {model_bytes / 2**20:.1f} MiB, RSS peak over "
            f"baseline {m['rss_peak_delta'] / 2**20:.1f} MiB (VmHWM reset: {m['hwm_reset']}), "
            f"tracemalloc peak {m['traced_peak'] / 2**20:.1f} MiB, {m['seconds']:.2f} s")
  print(report)
  with open(os.path.join(tmp_path, "export_memory.txt"), "w") as f:
    f.write(report + "\n")
  assert m["bytes"] > model_bytes
  assert m["traced_peak"] < 0.5 * model_bytes, report
  assert m["rss_peak_delta"] < 1.0 * model_bytes, report


def test_checkpoint_checksum_host_shards_equal_device_path():
  """The compile-free per-shard host checksum (used on CPU) equals the jitted device one (used
  on accelerators), for sharded, replicated and host-memory leaves."""
  from zerojax.runtime import checkpoint as C
  abstract, plan = target(2, 4, offload_optimizer=True)
  rng = np.random.default_rng(3)
  state = jax.tree.map(lambda x: jax.device_put(
      np.asarray(rng.standard_normal(x.shape), x.dtype), x.sharding), abstract)
  item = {"opt_state": state.opt_state[0].mu["blocks"], "params": state.params["blocks"],
          "step": state.step}
  host = C._checksums(item)
  flat = jax.tree_util.tree_flatten_with_path(item)[0]
  dev = C._checksum_fn(tuple(C._device_memory(x) for _, x in flat))([x for _, x in flat])
  assert {path_str(p): [int(v) for v in np.asarray(s)] for (p, _), s in zip(flat, dev)} == host
  assert host["params/fc/kernel"] == list(numpy_checksum(np.asarray(item["params"]["fc"]["kernel"])))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_checkpoint_export_and_restore_refuse_damaged_params(tmp_path, damage):
  """A checkpoint holding only parameters: any damage to its data hits a parameter, and both
  restore and export refuse it, naming the checkpoint and the leaf."""
  w = np.random.default_rng(0).standard_normal((512, 256), dtype=np.float32)
  zc = zerojax.ZeroConfig(stage=3, gather=zerojax.Gather(persistence_threshold=1))
  params = {"w": jax.ShapeDtypeStruct(w.shape, jnp.float32)}
  plan = zerojax.ShardingPlan.create(zc, zerojax.make_mesh(zc), params)
  d = str(tmp_path / "p")
  with Checkpointer(d, config=zc) as ck:
    ck.save(1, {"params": {"w": jax.device_put(w, plan.params["w"])}})
  root = os.path.join(d, "1", "state", "ocdbt.process_0", "d")
  f = max((os.path.join(root, x) for x in os.listdir(root)), key=os.path.getsize)
  size = os.path.getsize(f)
  if damage == "flip":
    with open(f, "r+b") as fh:
      fh.seek(size // 2)
      b = fh.read(1)
      fh.seek(size // 2)
      fh.write(bytes([b[0] ^ 0x01]))  # a single bit
  else:
    os.truncate(f, size // 2)
  with Checkpointer(d, read_only=True) as ck:
    with pytest.raises(CheckpointError) as e:
      ck.restore({"params": params}, plan)
  assert os.path.join(d, "1") in str(e.value) and "leaf 'params/w'" in str(e.value), e.value
  with pytest.raises(CheckpointError) as e:
    zx.export(d, str(tmp_path / "w.npz"))
  assert os.path.join(d, "1") in str(e.value) and "params/w" in str(e.value), e.value
  print(damage, "->", str(e.value)[:300])
