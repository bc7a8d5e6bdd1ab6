"""The README's examples run as written (a newcomer pastes them first)."""

import os
import pathlib
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

import zerojax
from zerojax.core import plan as plan_mod

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _usage_snippet() -> str:
  """The first fenced ``python`` block under ``## Usage``."""
  section = README[README.index("\n## Usage\n"):]
  m = re.search(r"```python\n(.*?)\n```", section, re.S)
  assert m, "README's Usage section has no python block"
  return m.group(1)


def _clean_env() -> dict:
  """The environment of a fresh shell: no device-count flag from this test session."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  return env


@pytest.mark.slow
def test_readme_usage_snippet_runs_as_pasted_on_8_devices(tmp_path):
  script = tmp_path / "snippet.py"
  script.write_text(_usage_snippet())
  r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_clean_env(),
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  m = re.search(r"^(\d+) devices, mesh (\{.*\}), loss ([0-9.]+)$", r.stdout, re.M)
  assert m, r.stdout[-2000:]
  assert int(m.group(1)) == 8 and m.group(2) == "{'fsdp': 8}"
  assert 0 < float(m.group(3)) < 20  # one step trained, finite loss
  assert "nothing is sharded" not in r.stderr
  assert "P('fsdp'" in r.stdout or "'fsdp')" in r.stdout  # the table shows sharded leaves


def test_plan_over_one_device_warns_once(monkeypatch):
  monkeypatch.setattr(plan_mod, "_warned_nothing_to_shard", False)
  cfg = zerojax.ZeroConfig(stage=3)
  mesh = zerojax.make_mesh(cfg, devices=jax.devices()[:1])
  params = {"w": jnp.zeros((128, 128))}
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    zerojax.ShardingPlan.create(cfg, mesh, params)
    zerojax.ShardingPlan.create(cfg, mesh, params)
  msgs = [str(x.message) for x in w if "nothing is sharded" in str(x.message)]
  assert len(msgs) == 1, msgs
  assert "stage 3" in msgs[0] and "{'fsdp': 1}" in msgs[0] and "jax_num_cpu_devices" in msgs[0]


@pytest.mark.parametrize("stage,devices", [(0, 1), (3, 8)])
def test_no_single_device_warning_when_sharding_is_possible_or_not_asked(monkeypatch, stage,
                                                                         devices):
  monkeypatch.setattr(plan_mod, "_warned_nothing_to_shard", False)
  cfg = zerojax.ZeroConfig(stage=stage)
  mesh = zerojax.make_mesh(cfg, devices=jax.devices()[:devices])
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    zerojax.ShardingPlan.create(cfg, mesh, {"w": jnp.zeros((128, 128))})
  assert not [x for x in w if "nothing is sharded" in str(x.message)]
