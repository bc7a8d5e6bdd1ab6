"""Test setup: 8 simulated CPU devices, and shared (session-scoped) models and runs.

The device count must be set before JAX initialises its backend, so it happens at import.
Compiled steps and training runs are session fixtures: each stage is compiled and run once and
every test that needs it reads the cached result.
"""

import os

# The suite's XLA flags, each added unless XLA_FLAGS already names it.
_XLA_FLAGS = {
    "xla_force_host_platform_device_count": 8,
    # The tests' programs are small and compiling them is most of the suite's time: LLVM's -O0
    # cuts it by a fifth. Buffer assignment, the collectives and elementwise arithmetic are
    # XLA's, not LLVM's, so memory, HLO and bit-for-bit assertions read the same programs.
    "xla_backend_optimization_level": 0,
    # XLA:CPU aborts the process when a collective's devices have not all arrived within
    # 20 + 40 s. Eight simulated devices per xdist worker, two workers, on 2 cores: a loaded
    # machine can stall one device's thread that long in a correct program, so the suite waits
    # longer. A real deadlock still aborts, with XLA's message naming the collective.
    "xla_cpu_collective_call_warn_stuck_timeout_seconds": 120,
    "xla_cpu_collective_call_terminate_timeout_seconds": 900,
}
os.environ.setdefault("XLA_FLAGS", "")
for _flag, _value in _XLA_FLAGS.items():
  if _flag not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" --{_flag}={_value}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, its xdist workers and the subprocesses they
# start: tests build the same programs (a preset at a stage) from different closures, which
# JAX's in-memory cache cannot share, and XLA's key is the program itself.
# The process that makes it removes it at the end (about 130 MB a run).
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import tempfile
  _OWN_CACHE = tempfile.mkdtemp(prefix="zerojax_test_jax_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402

from tests import helpers  # noqa: E402


def pytest_configure(config):
  assert jax.device_count() == 8, "tests need 8 simulated CPU devices"


def pytest_unconfigure(config):
  # xdist workers inherit the directory through the environment, so _OWN_CACHE is None there.
  if _OWN_CACHE is not None:
    import shutil
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def reference():
  """The unsharded single-device AdamW run of the tiny scanned GPT."""
  return helpers.reference_run(helpers.TINY)


@pytest.fixture(scope="session")
def zero_runs():
  """``{stage: Run}`` for the tiny scanned GPT on 8 devices, stages 0-3."""
  return {s: helpers.zero_run(helpers.TINY, s) for s in range(4)}
