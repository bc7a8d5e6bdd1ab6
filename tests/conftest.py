"""Test setup: 8 simulated CPU devices, and shared (session-scoped) models and runs.

The device count must be set before JAX initialises its backend, so it happens at import.
Compiled steps and training runs are session fixtures: each stage is compiled and run once and
every test that needs it reads the cached result.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from tests import helpers  # noqa: E402


def pytest_configure(config):
  assert jax.device_count() == 8, "tests need 8 simulated CPU devices"


@pytest.fixture(scope="session")
def reference():
  """The unsharded single-device AdamW run of the tiny scanned GPT."""
  return helpers.reference_run(helpers.TINY)


@pytest.fixture(scope="session")
def zero_runs():
  """``{stage: Run}`` for the tiny scanned GPT on 8 devices, stages 0-3."""
  return {s: helpers.zero_run(helpers.TINY, s) for s in range(4)}
