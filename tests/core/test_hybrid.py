"""Hybrid sharding (HSDP: ``('replica', 'fsdp')``) and a ``tensor`` axis, on 8 CPU devices.

Parity is checked against the flat-mesh runs of conftest (``zero_runs``: one ``fsdp`` axis over
8 devices), and the compiled HSDP step's collectives are read from its HLO: gradients are
reduced within each fsdp group, and only the shard crosses the replica axis.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from zerojax.runtime.memory import reductions, replica_groups
from tests import helpers

HSDP = dict(mesh_shape=(2, 4), mesh_axes=("replica", "fsdp"))
TP = dict(mesh_shape=(4, 2), mesh_axes=("fsdp", "tensor"))
TP_CFG = dataclasses.replace(helpers.TINY, tensor_parallel=True)


@pytest.fixture(scope="module")
def hsdp_runs():
  return {s: helpers.zero_run(helpers.TINY, s, **HSDP) for s in range(4)}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hybrid_parity_with_flat_mesh(stage, hsdp_runs, zero_runs, reference):
  run = hsdp_runs[stage]
  assert dict(run.plan.mesh.shape) == {"replica": 2, "fsdp": 4}
  helpers.assert_parity(run, zero_runs[stage])
  helpers.assert_parity(run, reference)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_hybrid_shards_within_group_and_replicates_across(stage, hsdp_runs, zero_runs):
  run, flat = hsdp_runs[stage], zero_runs[stage]
  for s in jax.tree.leaves(run.plan.opt_state):
    assert "replica" not in _axes(s.spec)
  mu = run.state.opt_state[0].mu["blocks"]["fc"]["kernel"]
  assert "fsdp" in _axes(mu.sharding.spec) and "replica" not in _axes(mu.sharding.spec)
  # a shard lives on 2 devices (one per replica group), so it is twice the flat-mesh shard
  assert mu.addressable_shards[0].data.size * 4 == mu.size
  b, bf = run.plan.bytes_per_device(), flat.plan.bytes_per_device()
  assert b["opt_state"] > 1.8 * bf["opt_state"]
  # the batch is split over both axes: 16 rows -> 2 per device
  x = run.plan.batch({"x": np.zeros((16, 32), np.int32)})["x"]
  assert x.spec == P(("replica", "fsdp"))


# -- collectives of the compiled HSDP step ------------------------------------------------------


def _axes(spec) -> tuple:
  out = []
  for a in spec:
    if a is not None:
      out.extend(a if isinstance(a, tuple) else (a,))
  return tuple(out)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2])
def test_hybrid_hlo_reduces_within_fsdp_group_then_across_replicas(stage, hsdp_runs):
  run = hsdp_runs[stage]
  b = helpers.batches(helpers.TINY, 1)[0]
  hlo = run.step.lower(run.state, b).compile().as_text()
  mesh = run.plan.mesh
  # partition id -> (replica, fsdp) coordinate in the mesh
  coord = {p: np.unravel_index(p, mesh.devices.shape) for p in range(mesh.devices.size)}
  fsdp_groups = {frozenset(p for p in coord if coord[p][0] == r) for r in range(2)}
  replica_groups_ = {frozenset(p for p in coord if coord[p][1] == f) for f in range(4)}
  everything = {frozenset(coord)}
  red = reductions(hlo)
  kinds = {}
  for kind, groups, nbytes in red:
    assert groups is not None, f"a {kind} without parsed replica groups"
    g = set(groups)
    key = ("fsdp" if g == fsdp_groups else "replica" if g == replica_groups_ else
           "all" if g == everything else "other")
    kinds[key] = kinds.get(key, 0) + nbytes
  assert "other" not in kinds, kinds
  assert kinds.get("fsdp", 0) > 0, f"no gradient reduction within the fsdp groups: {kinds}"
  assert kinds.get("replica", 0) > 0, f"no reduction across the replica axis: {kinds}"
  # Only the fsdp shard of each reduced gradient crosses the replica axis (1/4 of the bytes).
  assert kinds["replica"] <= kinds["fsdp"] / 3, kinds


def test_hybrid_replica_groups_parser():
  line = ("all-reduce(%a), replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], "
          "device_ids=([2,4]T(1,0)) {'axis_0'}, use_global_device_ids=true")
  assert set(replica_groups(line)) == {frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7})}
  line = line.replace("{'axis_0'}", "{'axis_2'}")
  assert set(replica_groups(line)) == {frozenset({0, 4}), frozenset({1, 5}), frozenset({2, 6}),
                                       frozenset({3, 7})}
  assert replica_groups("x replica_groups=[4,2]<=[2,4]T(1,0), y") == [
      frozenset({0, 4}), frozenset({1, 5}), frozenset({2, 6}), frozenset({3, 7})]
  assert replica_groups("x replica_groups={{0,1},{2,3}}, y") == [frozenset({0, 1}),
                                                                  frozenset({2, 3})]


# -- tensor axis --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3])
def test_tensor_axis_parity_with_flat_mesh(stage, zero_runs):
  # TP_CFG has the same parameter values as TINY; only Flax partitioning metadata differs.
  run = helpers.zero_run(TP_CFG, stage, **TP)
  helpers.assert_parity(run, zero_runs[stage])
  leaves = {lp.path: lp for lp in run.plan.leaves}
  fc, out = leaves["blocks/fc/kernel"], leaves["blocks/out/kernel"]
  assert fc.reason == "metadata"
  assert fc.sharded == P(None, "fsdp", "tensor") and fc.gathered == P(None, None, "tensor")
  assert out.sharded == P(None, "tensor", "fsdp") and out.gathered == P(None, "tensor", None)
  k = run.state.params["blocks"]["fc"]["kernel"]
  want = P(None, "fsdp", "tensor") if stage == 3 else P(None, None, "tensor")
  assert k.sharding.spec == want
  assert leaves["wte/embedding"].sharded == P(None, "fsdp")  # no metadata: zerojax's rule


@pytest.mark.slow
def test_tensor_hybrid_3d_mesh_parity(zero_runs):
  run = helpers.zero_run(TP_CFG, 3, steps=helpers.STEPS, mesh_shape=(2, 2, 2),
                         mesh_axes=("replica", "fsdp", "tensor"))
  helpers.assert_parity(run, zero_runs[3])
  k = run.state.params["blocks"]["qkv"]["kernel"]
  assert k.sharding.spec == P(None, "fsdp", "tensor")
