"""The local launcher's per-process device count (no processes are started here)."""

import io
import sys

import pytest

from zerojax.tools import launch as zlaunch
from zerojax.core.launch_env import ENV_CPU_DEVICES
from tests import helpers


def test_default_gives_each_cpu_process_devices_to_shard(monkeypatch):
  monkeypatch.setattr(zlaunch, "_accelerator_plugins", lambda: [])
  n, why = zlaunch.resolve_devices_per_process(None, {})
  assert n == zlaunch.DEFAULT_CPU_DEVICES_PER_PROCESS == 4 and "no accelerator" in why
  env = zlaunch.child_env({}, 0, 2, "127.0.0.1:1", n)
  assert env[ENV_CPU_DEVICES] == "4"
  assert "--xla_force_host_platform_device_count=4" in env["XLA_FLAGS"]


def test_cpu_platform_wins_over_installed_plugins(monkeypatch):
  monkeypatch.setattr(zlaunch, "_accelerator_plugins", lambda: ["jax_cuda12_plugin"])
  assert zlaunch.resolve_devices_per_process(None, {"JAX_PLATFORMS": "cpu"})[0] == 4
  n, why = zlaunch.resolve_devices_per_process(None, {})
  assert n is None and "jax_cuda12_plugin" in why


@pytest.mark.parametrize("env", [{ENV_CPU_DEVICES: "2"},
                                 {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}])
def test_count_set_in_environment_is_kept(monkeypatch, env):
  monkeypatch.setattr(zlaunch, "_accelerator_plugins", lambda: [])
  assert zlaunch.resolve_devices_per_process(None, env)[0] is None


def test_explicit_count_wins_and_is_validated(monkeypatch):
  monkeypatch.setattr(zlaunch, "_accelerator_plugins", lambda: ["libtpu"])
  assert zlaunch.resolve_devices_per_process(2, {ENV_CPU_DEVICES: "8"})[0] == 2
  with pytest.raises(SystemExit):
    zlaunch.parse_args(["--devices-per-process", "0", "--", "x.py"])


def test_launcher_reports_and_passes_the_resolved_count(monkeypatch):
  monkeypatch.setattr(zlaunch, "_accelerator_plugins", lambda: [])
  out = io.StringIO()
  show = "import os; print(os.environ['ZEROJAX_CPU_DEVICES'])"
  code = zlaunch.launch([sys.executable, "-c", show], 2,
                        env=helpers.child_env(None), out=out, timeout=60)
  assert code == 0, out.getvalue()
  log = out.getvalue()
  assert "[launch] 2 processes x 4 simulated CPU device(s)" in log
  assert "[p0] 4" in log and "[p1] 4" in log
