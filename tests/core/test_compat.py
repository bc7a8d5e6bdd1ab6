"""zerojax._compat on the installed JAX release: every internal has a path, every default
compiler option is one this release's XLA takes, and JAX outside a zerojax step is JAX's own."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax import _compat
from zerojax.core.backend import GPU

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_internal_has_a_path_on_this_release():
  missing = [n for n, p in _compat.INTERNALS.items() if p is None]
  assert not missing, f"jax {jax.__version__} has none of the paths of {missing}"
  for name, path in _compat.INTERNALS.items():
    assert path in _compat.INTERNAL_PATHS[name]


def test_public_api_is_preferred_where_the_release_has_it():
  # The primitives the remat policy recognises are public (jax.extend) on 0.10.2 to 0.12.x.
  for name in ("name_p", "sharding_constraint_p"):
    assert _compat.INTERNALS[name].startswith("jax.extend."), _compat.INTERNALS[name]


@pytest.mark.parametrize("version,kept,added", [
    ((0, 10, 2), {"xla_gpu_enable_pipelined_all_gather",
                  "xla_gpu_enable_pipelined_reduce_scatter",
                  "xla_gpu_enable_analytical_latency_estimator"}, set()),
    ((0, 11, 2), set(), {"xla_gpu_pipeline_all_gather", "xla_gpu_pipeline_reduce_scatter"}),
    ((0, 12, 0), set(), {"xla_gpu_pipeline_all_gather", "xla_gpu_pipeline_reduce_scatter"}),
])
def test_gpu_options_follow_the_release(monkeypatch, version, kept, added):
  monkeypatch.setattr(_compat, "JAX_VERSION", version)
  given = {**GPU.compiler_options, **GPU.layers_ahead_options}
  got = _compat.xla_gpu_options(given)
  renamed = set(_compat._GPU_OPTIONS_FROM)
  assert set(got) == (set(given) - renamed) | kept | added
  for k in added:
    assert got[k] == "COLLECTIVE_PIPELINING_MODE_ON"
  # Options no release renames pass through with their values.
  for k in set(given) - renamed:
    assert got[k] == given[k]


def _option_sets():
  sets = {"default": GPU.compiler_options,
          "layers_ahead": {**GPU.compiler_options, **GPU.layers_ahead_options},
          "in_checkpoints": {**GPU.compiler_options, **GPU.layers_ahead_in_checkpoints_options},
          "pipelined": GPU.pipelined_options,
          "rows_ahead": {**GPU.compiler_options, **GPU.rows_ahead_options},
          "wide_rows_ahead": {**GPU.compiler_options, **GPU.wide_rows_ahead_options}}
  return {k: _compat.xla_gpu_options(v) for k, v in sets.items()}


@pytest.mark.parametrize("name", ["default", "layers_ahead", "in_checkpoints", "pipelined",
                                  "rows_ahead", "wide_rows_ahead"])
def test_this_release_takes_every_default_gpu_option(name):
  # XLA validates option names and values against its DebugOptions whatever the backend: a
  # refused option fails this CPU compile as it would fail a GPU one.
  lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(4))
  options = _option_sets()[name]
  assert options
  lowered.compile(options)


def _child(*args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "jax_untouched_child.py"),
                      *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_jax_outside_a_zerojax_step_computes_as_jax_does():
  plain = _child()
  after = _child("zerojax")
  # The zerojax steps traced with its scan interceptor in place (Flax's Module.apply and JAX's
  # checkpoint rule are their own even then), and after them JAX's and Flax's objects are
  # their own.
  assert after.pop("live") == {"scan": True, "apply": False, "remat_rule": False}
  assert after.pop("hooks") == {"scan": False, "apply": False, "remat_rule": False}
  losses = {k: after.pop(k) for k in list(after) if k.startswith("zerojax_loss")}
  assert all(map(jnp.isfinite, losses.values()))
  assert after.keys() == plain.keys()
  for key in plain:  # jaxprs (forward and under grad) and values, exactly
    assert after[key] == plain[key], key


def test_compute_on_host_runs_the_update_on_the_host_on_this_release():
  """ZeRO-Offload's host update: the call is marked for the host in the lowered step, its
  results come back in pinned host memory, and the values are the function's."""
  mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
  host = jax.sharding.NamedSharding(mesh, jax.P("fsdp"), memory_kind="pinned_host")
  dev = host.with_memory_kind("device")
  x = jax.device_put(jnp.arange(16.0), host)

  @jax.jit
  def step(x):
    y = _compat.compute_on_host(lambda a: (a * 2.0, a + 1.0))(x)
    return jax.device_put(y[0], dev), y[1]

  text = step.lower(x).as_text()
  assert '_xla_compute_type = "host"' in text
  out_dev, out_host = step(x)
  assert out_host.sharding.memory_kind == "pinned_host"
  assert out_dev.sharding.memory_kind == "device"
  assert (np.asarray(out_dev) == np.arange(16.0) * 2).all()
  assert (np.asarray(out_host) == np.arange(16.0) + 1).all()


def test_collective_time_reaches_the_collective_in_nanoseconds():
  # XLA's latency-hiding scheduler reads `latency_metadata` (ns) off the instruction.
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("fsdp",))

  def gather(x):
    with _compat.collective_time(16.3e-6):
      y = jax.lax.all_gather(x, "fsdp", tiled=True)
    return y + jax.lax.all_gather(x, "fsdp", tiled=True)

  f = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("fsdp"), out_specs=P(),
                            check_vma=False))
  text = f.lower(jnp.ones((8,), jnp.float32)).as_text()
  tagged = [line for line in text.splitlines() if "all_gather" in line]
  assert len(tagged) == 2 and sum('latency_metadata = "16300"' in t for t in tagged) == 1, tagged


def test_compiles_without_cache_writes_store_nothing_and_others_still_do(tmp_path):
  # The test run's persistent cache (tests/conftest.py) stores every compile; inside the block
  # a compile stores nothing, and the same program compiled after it is stored as before.
  cache = jax.config.jax_compilation_cache_dir
  assert cache and os.path.isdir(cache), "tests/conftest.py sets a persistent cache"
  name = f"zerojax_probe_{os.getpid()}_{tmp_path.name}".replace("-", "_")

  def compile_probe(scale):
    def f(x):
      return x * scale + 1.0
    f.__name__ = name
    jax.jit(f).lower(jax.ShapeDtypeStruct((4,), jnp.float32)).compile()
    return [p for p in os.listdir(cache) if p.startswith(f"jit_{name}-")]

  with _compat.without_cache_writes():
    assert compile_probe(3.0) == []
  assert len(compile_probe(5.0)) == 1
