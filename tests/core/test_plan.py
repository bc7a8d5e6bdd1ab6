"""ShardingPlan: the leaf rule, stages, optimizer-state coverage, overrides, metadata."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as nn
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax import ConfigError, ShardingPlan, ZeroConfig, make_mesh

S = jax.ShapeDtypeStruct
PARAMS = {
    "big": S((64, 256), jnp.float32),      # shard dim 1 (largest divisible)
    "tall": S((250, 64), jnp.float32),     # 250 % 8 != 0 -> dim 1
    "odd": S((250, 3), jnp.float32),       # nothing divides -> indivisible
    "bias": S((64,), jnp.float32),         # under threshold -> replicated
    "stack": S((4, 64, 64), jnp.float32),  # ties -> later dim
}


def plan_for(stage, params=PARAMS, tx=None, **kw):
  cfg = ZeroConfig.from_flat(dict(stage=stage, param_persistence_threshold=128, **kw))
  return ShardingPlan.create(cfg, make_mesh(cfg), params, tx=tx or optax.adam(1e-3))


def specs(tree):
  return jax.tree.map(lambda s: s.spec, tree)


def test_leaf_rule():
  plan = plan_for(3)
  got = {lp.path: (lp.sharded, lp.reason) for lp in plan.leaves}
  assert got["big"] == (P(None, "fsdp"), "sharded")
  assert got["tall"] == (P(None, "fsdp"), "sharded")
  assert got["odd"] == (P(None, None), "indivisible")
  assert got["bias"] == (P(None), "threshold")
  assert got["stack"] == (P(None, None, "fsdp"), "sharded")
  assert plan.unsharded_bytes() == {"indivisible": 250 * 3 * 4, "threshold": 64 * 4}


@pytest.mark.parametrize("stage, p, g, o", [
    (0, False, False, False), (1, False, False, True), (2, False, True, True),
    (3, True, True, True)])
def test_stage_semantics(stage, p, g, o):
  plan = plan_for(stage)
  sharded = lambda tree: "fsdp" in tuple(tree["big"].spec)
  assert sharded(plan.params) == p
  assert sharded(plan.grads) == g
  assert "fsdp" in tuple(plan.opt_state[0].mu["big"].spec) if o else \
      "fsdp" not in tuple(plan.opt_state[0].mu["big"].spec)


def test_bytes_per_device_follow_stage():
  full = sum(np.prod(x.shape) * 4 for x in PARAMS.values())
  b0, b3 = plan_for(0).bytes_per_device(), plan_for(3).bytes_per_device()
  assert b0["params"] == full and b0["opt_state"] >= 2 * full
  unsh = sum(plan_for(3).unsharded_bytes().values())
  assert b3["params"] == (full - unsh) // 8 + unsh


@pytest.mark.parametrize("name, tx", [
    ("chain", optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))),
    ("masked", optax.masked(optax.adam(1e-3), {k: k != "bias" for k in PARAMS})),
    ("inject", optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)),
    ("multisteps", optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4)),
])
def test_any_optax_state_is_planned(name, tx):
  plan = plan_for(1, tx=tx)
  opt_shapes = jax.eval_shape(tx.init, PARAMS)
  assert jax.tree.structure(plan.opt_state) == jax.tree.structure(opt_shapes)
  for (path, shape, _, spec), x in zip(plan.opt_leaves, jax.tree.leaves(opt_shapes)):
    assert shape == x.shape
    if shape == (64, 256):  # mirrors 'big': sharded like it
      assert spec == P(None, "fsdp"), path
    if shape == ():  # counts, injected hyperparameters
      assert spec == P(), path


def test_user_rules_override():
  plan = plan_for(3, rules=((r"^big$", ("fsdp", None)), (r"stack", ())))
  got = {lp.path: lp.sharded for lp in plan.leaves}
  assert got["big"] == P("fsdp", None)
  # A rule that names no fsdp axis constrains nothing else here: zerojax still shards the
  # largest free dimension over fsdp (ties -> the later one), and says the rule applied.
  assert got["stack"] == P(None, None, "fsdp")
  assert {lp.path: lp.reason for lp in plan.leaves}["stack"] == "rule"


def test_bad_rule_is_explained():
  with pytest.raises(ConfigError, match="axis 'model' is not a mesh axis"):
    plan_for(3, rules=((r"big", (None, "model")),))
  with pytest.raises(ConfigError, match="does not divide"):
    plan_for(3, rules=((r"odd", ("fsdp", None)),))


def test_linen_partitioning_metadata_tensor_axis():
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      k = self.param("k", nn.with_partitioning(nn.initializers.ones, (None, "tensor")),
                     (64, 256))
      return x @ k
  cfg = ZeroConfig(stage=3, mesh_shape=(4, 2), mesh_axes=("fsdp", "tensor"),
                   gather=zerojax.Gather(persistence_threshold=0))
  params = jax.eval_shape(M().init, jax.random.key(0), jnp.ones((2, 64)))["params"]
  plan = ShardingPlan.create(cfg, make_mesh(cfg), params, tx=optax.adam(1e-3))
  (lp,) = plan.leaves
  assert lp.sharded == P("fsdp", "tensor") and lp.gathered == P(None, "tensor")
  assert plan.opt_state[0].mu["k"].spec == P("fsdp", "tensor")


def test_nnx_partitioning_metadata():
  from flax import nnx
  cfg = ZeroConfig(stage=3, mesh_shape=(4, 2), mesh_axes=("fsdp", "tensor"),
                   gather=zerojax.Gather(persistence_threshold=0))
  mesh = make_mesh(cfg)
  with jax.set_mesh(mesh):
    lin = nnx.eval_shape(lambda: nnx.Linear(
        64, 128, rngs=nnx.Rngs(0),
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("tensor", None))))
  plan = ShardingPlan.create(cfg, mesh, nnx.state(lin, nnx.Param))
  got = {lp.path: lp.sharded for lp in plan.leaves}
  assert got["kernel"] == P("tensor", "fsdp")


def test_table_has_totals():
  t = plan_for(3).table()
  for s in ("path", "bytes/device", "big", "P(None, 'fsdp')", "per device:",
            "left replicated over fsdp", "indivisible"):
    assert s in t


def test_batch_sharding_and_error():
  plan = plan_for(2)
  b = plan.batch({"x": np.zeros((16, 4))})
  assert b["x"].spec == P(("fsdp",))
  with pytest.raises(ConfigError, match="does not divide by the data-parallel size 8"):
    plan.batch({"x": np.zeros((12, 4))})


def test_abstract_mesh_planning_without_devices():
  from jax.sharding import AbstractMesh, AxisType
  cfg = ZeroConfig(stage=3, gather=zerojax.Gather(persistence_threshold=0))
  mesh = AbstractMesh((512,), ("fsdp",), axis_types=(AxisType.Auto,))
  plan = ShardingPlan.create(cfg, mesh, {"w": S((4096, 4096), jnp.float32)}, optax.adam(1e-3))
  assert plan.bytes_per_device()["params"] == 4096 * 4096 * 4 // 512


@pytest.mark.parametrize("tx, mirrored, own", [
    # optax.tree_map_params knows these states: the moments mirror their parameters.
    (optax.adamw(1e-3), {"0/mu/big": "big", "0/nu/stack": "stack"}, ["0/count"]),
    (optax.MultiSteps(optax.adam(1e-3), 2), {"inner_opt_state/0/mu/big": "big",
                                             "acc_grads/tall": "tall"}, ["mini_step"]),
    # Factored statistics are parameter-structured but not parameter-shaped: a plan of their own.
    (optax.adafactor(1e-3), {"0/v/big": "big"}, ["0/v_row/big", "0/v_col/big"]),
    # A state optax cannot map (masked): the key path decides, and the shape must agree.
    (optax.masked(optax.adam(1e-3), {k: k != "odd" for k in PARAMS}),
     {"inner_state/0/mu/big": "big"}, ["inner_state/0/count"]),
])
def test_optimizer_state_leaves_index_their_parameters(tx, mirrored, own):
  plan = plan_for(3, tx=tx)
  index = {path: (None if i is None else plan.leaves[i].path)
           for (path, *_), i in zip(plan.opt_leaves, plan.opt_param)}
  assert len(plan.opt_param) == len(plan.opt_leaves)
  for path, param in mirrored.items():
    assert index[path] == param, (path, index)
  for path in own:
    assert index[path] is None, (path, index)
  # A mirroring leaf is sharded exactly as its parameter is at stage >= 1.
  specs_by_path = {path: spec for path, _, _, spec in plan.opt_leaves}
  leaf = {lp.path: lp for lp in plan.leaves}
  for path, param in mirrored.items():
    assert specs_by_path[path] == leaf[param].sharded


def test_state_shardings_for_structs_and_checkpoint_dicts():
  """One method gives a train state's shardings and a checkpoint item's (a dict of its fields)."""
  from flax.training import train_state
  plan = plan_for(3)
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), PARAMS)
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
  as_struct = plan.state(state)
  as_dict = plan.state({"step": state.step, "params": params, "opt_state": state.opt_state})
  assert specs(as_dict["params"]) == specs(as_struct.params) == specs(plan.params)
  assert specs(as_dict["opt_state"]) == specs(as_struct.opt_state)
  assert as_dict["step"] == plan.replicated
  with pytest.raises(TypeError, match="got list"):
    plan.state([params])


def test_nnx_state_shardings_by_variable_type_and_order():
  """NNX states: Params take the plan's parameter shardings, the optimizer's opt_state the
  plan's optimizer-state shardings, the rest is replicated; another tree is refused."""
  from flax import nnx
  import zerojax
  cfg = ZeroConfig(stage=3, gather=zerojax.Gather(persistence_threshold=0))
  model, opt, plan = zerojax.create_nnx(lambda: nnx.Linear(64, 128, rngs=nnx.Rngs(0)),
                                        optax.adam(1e-3), config=cfg)
  sh = plan.nnx_state(nnx.state((model, opt)))
  got = {jax.tree_util.keystr(p, simple=True, separator="/"): s.spec
         for p, s in jax.tree_util.tree_flatten_with_path(sh)[0]}
  assert got["0/kernel/value"] == P(None, "fsdp")
  assert got["1/opt_state/0/mu/kernel/value"] == P(None, "fsdp")
  assert got["1/step/value"] == P()
  other = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="not the tree the plan was made for"):
    plan.nnx_state(nnx.state((other, opt)))


def test_nnx_state_refuses_what_is_not_an_nnx_state():
  with pytest.raises(TypeError, match=r"nnx_state: state must be .*an nnx.State; got dict"):
    plan_for(3).nnx_state({"params": {}})
