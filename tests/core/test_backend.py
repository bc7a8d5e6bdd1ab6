"""The backend policy: one frozen object per compiler holds every platform decision, the plan
reads it, and a plan made with another backend follows that one."""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax
from zerojax.core import backend
from zerojax.core.pipeline import OneAhead
from tests.helpers import all_eqns


def _params():
  # A stacked (scanned) kernel, a matrix and a small bias.
  return {"layers": jax.ShapeDtypeStruct((4, 64, 256), jnp.float32),
          "w": jax.ShapeDtypeStruct((128, 512), jnp.float32),
          "b": jax.ShapeDtypeStruct((512,), jnp.float32)}


def _plan(config, **kw):
  mesh = zerojax.make_mesh(config)
  return zerojax.ShardingPlan.create(config, mesh, _params(), optax.adam(1e-3), **kw)


def test_a_plan_takes_its_devices_backend_once():
  plan = _plan(zerojax.ZeroConfig(stage=3))
  assert plan.backend is backend.CPU
  assert plan.live_layers == 1 and plan.pipeline is None


def test_a_plan_made_with_another_backend_follows_it_everywhere():
  config = zerojax.ZeroConfig(stage=3)
  cpu, gpu, tpu = (_plan(config, backend=b) for b in (backend.CPU, backend.GPU, backend.TPU))
  # Leaf rule: at stage 3 GPU shards a stacked kernel's first dimension past the layer axis,
  # CPU its largest; TPU keeps leaves under 4096 elements whole.
  assert cpu.leaves[1].sharded == jax.sharding.PartitionSpec(None, None, "fsdp")
  assert gpu.leaves[1].sharded == jax.sharding.PartitionSpec(None, "fsdp", None)
  assert [lp.reason for lp in tpu.leaves] == ["threshold", "sharded", "sharded"]
  assert [lp.reason for lp in cpu.leaves] == ["sharded"] * 3
  # Live layers, and with two of them the scanned layers run one ahead.
  assert (cpu.live_layers, gpu.live_layers, tpu.live_layers) == (1, 2, 1)
  assert gpu.pipeline is not None and cpu.pipeline is None is tpu.pipeline
  # Compiler options.
  assert cpu.compiler_options == {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
  assert tpu.compiler_options == {"xla_tpu_enable_ici_ag_pipelining": True}
  assert "xla_gpu_enable_latency_hiding_scheduler" in gpu.compiler_options
  # The optimizer state mirrors its parameter's plan under each backend.
  for plan in (cpu, gpu, tpu):
    mu = [spec for path, _, _, spec in plan.opt_leaves if path.endswith("mu/layers")
          or "mu" in path and "layers" in path]
    assert mu and all(s == plan.leaves[1].sharded for s in mu), (plan.backend.name, mu)


def test_a_changed_backend_changes_only_what_it_names():
  config = zerojax.ZeroConfig(stage=3)
  one = dataclasses.replace(backend.GPU, live_layers=1)
  plan = _plan(config, backend=one)
  assert plan.live_layers == 1 and plan.pipeline is None
  assert plan.leaves == _plan(config, backend=backend.GPU).leaves
  # The config's own setting wins over the backend's default.
  two = zerojax.ZeroConfig(stage=3, gather=zerojax.Gather(max_live_layers=2))
  assert _plan(two, backend=one).live_layers == 2


def test_pipelined_options_take_the_largest_layers_collectives():
  config = zerojax.ZeroConfig(stage=3)
  gpu = backend.GPU
  opts = gpu.options(config, pipelined=OneAhead(8 << 20, 1 << 20))
  assert opts[gpu.gather_combine_option] == 8 << 20
  assert opts[gpu.reduce_combine_option] == 1 << 20
  # Smaller than the default threshold: the default stays.
  small = gpu.options(config, pipelined=OneAhead(4096, 512))
  assert small[gpu.gather_combine_option] == gpu.pipelined_options[gpu.gather_combine_option]
  # The loops hold each collective one ahead already: no double buffering on top.
  assert not any("double_buffering" in k for k in opts)
  with pytest.raises(TypeError, match=r"^pipelined=True is invalid"):
    gpu.options(config, pipelined=True)


def test_stage_0_on_cpu_compiles_with_no_options_and_stages_1_to_3_keep_each_reduction():
  for stage in range(4):
    opts = backend.CPU.options(zerojax.ZeroConfig(stage=stage))
    assert opts == (None if stage == 0 else
                    {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"})


@pytest.mark.parametrize("name,want", [("gpu", backend.GPU), ("cuda", backend.GPU),
                                       ("rocm", backend.GPU), ("tpu", backend.TPU),
                                       ("cpu", backend.CPU)])
def test_platform_names(name, want):
  assert backend.for_platform(name) is want


def test_bad_input_is_one_line_naming_the_value():
  with pytest.raises(ValueError, match=r"^platform='metal' is invalid: one of \['cpu', 'gpu', "
                     r"'tpu'\]"):
    backend.for_platform("metal")
  with pytest.raises(ValueError, match=r"^Backend.live_layers=0 is invalid: an int >= 1$"):
    dataclasses.replace(backend.GPU, live_layers=0)
  with pytest.raises(ValueError, match="pipelined_options needs"):
    dataclasses.replace(backend.GPU, reduce_combine_option=None)


def test_no_platform_comparison_outside_the_backend_policy():
  # Every decision that depends on the compiler is read from a Backend.
  pkg = pathlib.Path(zerojax.__file__).parent
  pattern = re.compile(r"platform\s*(==|!=)|platform\s+(not\s+)?in\s*[(\[{]|"
                       r"==\s*[\"'](cpu|gpu|tpu)[\"']")
  found = [f"{f.relative_to(pkg)}:{i}: {line.strip()}"
           for f in sorted(pkg.rglob("*.py")) if f.name != "backend.py"
           for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
  assert found == []


def test_create_train_state_and_create_nnx_take_a_backend():
  import flax.linen as nn
  from flax import nnx

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(512)(x)

  config = zerojax.ZeroConfig(stage=3)
  tpu_like = dataclasses.replace(backend.CPU, name="cpu-keeping-small-leaves",
                                 keeps_small_leaves_at_stage3=True)
  _, plan = zerojax.create_train_state(Net(), optax.sgd(0.1), jax.random.key(0),
                                       jnp.ones((8, 64)), config=config, backend=tpu_like)
  assert plan.backend is tpu_like
  assert {lp.path.rsplit("/", 1)[-1]: lp.reason for lp in plan.leaves} == {
      "bias": "threshold", "kernel": "sharded"}
  _, _, nplan = zerojax.create_nnx(lambda: nnx.Linear(64, 512, rngs=nnx.Rngs(0)),
                                   optax.sgd(0.1), config=config, backend=tpu_like)
  assert nplan.backend is tpu_like and sorted(lp.reason for lp in nplan.leaves) == [
      "sharded", "threshold"]


def test_per_use_by_default_from_the_backends_stage():
  on = lambda b, stage: b.per_use_at(zerojax.ZeroConfig(stage=stage))
  assert [on(backend.GPU, s) for s in range(4)] == [False, False, True, True]
  assert [on(backend.TPU, s) for s in range(4)] == [False, False, False, True]
  assert [on(backend.CPU, s) for s in range(4)] == [False] * 4


def test_a_backend_that_is_not_one_is_one_line():
  with pytest.raises(TypeError, match=r"^backend='gpu' is invalid: a zerojax.Backend or None"):
    _plan(zerojax.ZeroConfig(stage=3), backend="gpu")


class _Device:
  def __init__(self, kind, host):
    self.device_kind, self.process_index = kind, host


class _Mesh:
  def __init__(self, devices, names):
    import numpy as np
    self.devices = np.asarray(devices, dtype=object)
    self.axis_names = names


def test_link_bandwidth_is_the_slowest_link_an_axis_group_spans():
  h100 = "NVIDIA H100 80GB HBM3"
  # Two hosts of four: fsdp within a host takes NVLink's figure, across hosts the network's.
  rows = [[_Device(h100, host) for _ in range(4)] for host in range(2)]
  within = _Mesh(rows, ("data", "fsdp"))
  across = _Mesh([list(r) for r in zip(*rows)], ("data", "fsdp"))
  assert backend.GPU.link_bandwidth(within, "fsdp") == 450e9
  assert backend.GPU.link_bandwidth(within, "data") == 50e9
  assert backend.GPU.link_bandwidth(across, "fsdp") == 50e9
  # A device kind without figures, a backend without any, an abstract mesh: nothing to tell.
  odd = _Mesh([_Device("NVIDIA GeForce RTX 4090", 0), _Device(h100, 0)], ("fsdp",))
  assert backend.GPU.link_bandwidth(odd, "fsdp") is None
  assert backend.CPU.link_bandwidth(within, "fsdp") is None
  assert backend.GPU.link_bandwidth(jax.sharding.AbstractMesh((2,), ("fsdp",)), "fsdp") is None
  with pytest.raises(ValueError, match=r"^axis='model' is invalid: one of the mesh's axes "
                                       r"\['data', 'fsdp'\]$"):
    backend.GPU.link_bandwidth(within, "model")


def test_gpu_link_figures_are_the_step_time_models():
  # One table: the scheduler's hint and the step-time prediction read the same figures.
  from zerojax.runtime import gpu
  for spec in gpu.GPUS.values():
    assert backend.GPU_LINKS[spec.device_kind] == (spec.nvlink_bandwidth,
                                                   spec.network_bandwidth)


def _pure_function_of_three_layers(stage, policy):
  """``(params, loss, plain)``: a pure function's loss over three layers of stacked weights,
  through `per_layer_reads` at ``stage`` under ``policy`` and as written, after checking
  that their gradients match."""
  from zerojax.core.rows import per_layer_reads
  config = zerojax.ZeroConfig(stage=stage)
  params = {"u": jax.random.normal(jax.random.key(0), (3, 128, 256)),
            "v": jax.random.normal(jax.random.key(1), (3, 256, 128))}
  plan = zerojax.ShardingPlan.create(config, zerojax.make_mesh(config), params,
                                     optax.sgd(0.1), backend=policy)

  def model(p, x):
    for i in range(3):
      x = x + jnp.tanh(x @ p["u"][i]) @ p["v"][i]
    return (x ** 2).sum()

  x = jax.random.normal(jax.random.key(2), (8, 128))
  wrapped = per_layer_reads(model, plan)
  loss, plain = (lambda p: wrapped(p, x)), (lambda p: model(p, x))
  for a, b in zip(jax.tree.leaves(jax.grad(loss)(params)),
                  jax.tree.leaves(jax.grad(plain)(params))):
    assert jnp.allclose(a, b, rtol=1e-4, atol=1e-4)
  return params, loss, plain


@pytest.mark.parametrize("stage,orders", [(3, False), (3, True), (2, True)])
def test_a_pure_functions_last_row_gradient_comes_before_its_inputs_when_the_backend_orders_it(
    stage, orders):
  # XLA:GPU made the first layer's row gradients after every other matmul, so their
  # reduce-scatters ran beside nothing; ordered, the input's matmul follows each of them. At
  # stage 2, where rows are read in place, ordering them cost XLA:GPU temp and overlap.
  policy = dataclasses.replace(backend.CPU, orders_last_row_gradient=orders,
                               per_use_from_stage=2)
  params, wrapped, plain = _pure_function_of_three_layers(stage, policy)
  assert jnp.allclose(wrapped(params), plain(params), rtol=1e-6)
  found = [e for e in all_eqns(jax.make_jaxpr(jax.grad(wrapped))(params).jaxpr)
           if e.primitive.name == "optimization_barrier"]
  # One per stacked weight, in its first layer's backward pass: over the output's cotangent
  # and the row's gradient, which the input's cotangent then waits for.
  want = [[(8, 128), (256, 128)], [(8, 256), (128, 256)]] if orders and stage == 3 else []
  assert sorted(sorted(v.aval.shape for v in e.invars) for e in found) == want, found


@pytest.mark.parametrize("per_device", [False, True])
def test_a_pure_functions_rows_are_sliced_on_each_device_once_its_input_exists(per_device):
  # An optimization barrier over a row's index orders nothing once the compiler removes the
  # barrier and folds the index to a constant (XLA:GPU from jaxlib 0.12): every row was then
  # sliced at the start. Per device, the index depends on the device's own part of the input.
  policy = dataclasses.replace(backend.CPU, waits_by_barrier=True, per_use_from_stage=3,
                               reads_rows_per_device=per_device)
  params, wrapped, plain = _pure_function_of_three_layers(3, policy)
  assert wrapped(params) == plain(params)
  found = list(all_eqns(jax.make_jaxpr(jax.grad(wrapped))(params).jaxpr))
  # Row slices inside a per-device map: six in the forward pass, and four re-slices in the
  # backward pass (each weight's first row is saved rather than sliced again).
  local = [e for e in found if e.primitive.name == "shard_map" and any(
      i.primitive.name == "dynamic_slice" for i in all_eqns(e.params["jaxpr"]))]
  index_barriers = [e for e in found if e.primitive.name == "optimization_barrier"
                    and any(v.aval.shape == () and v.aval.dtype == jnp.int32 for v in e.invars)]
  assert (len(local), len(index_barriers)) == ((10, 0) if per_device else (0, 10))
  # Each map's index reads its second input, the device's element of the row matmul's input.
  for e in local:
    inner = e.params["jaxpr"]
    assert [v.aval.shape for v in e.invars] == [(3, 128, 256), (8,)] or [
        v.aval.shape for v in e.invars] == [(3, 256, 128), (8,)]
    assert any(inner.invars[1] in i.invars for i in all_eqns(inner))
