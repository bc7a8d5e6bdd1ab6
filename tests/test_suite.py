"""The fast subset (`pytest -m "not slow"`) is what the README says."""

import pathlib
import subprocess
import sys

import pytest

from tests import helpers

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _collect(*args: str) -> list[str]:
  env = helpers.child_env()
  r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                      "-p", "no:cacheprovider", *args, "tests"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return [line for line in r.stdout.splitlines() if "::" in line]


@pytest.mark.slow  # two collections of the whole suite in subprocesses
def test_fast_subset_keeps_parity_at_every_stage_and_leaves_out_the_slow_tests():
  everything, fast = _collect(), set(_collect("-m", "not slow"))
  for stage in range(4):
    assert f"tests/core/test_step.py::test_parity_linen_scanned[{stage}]" in fast
  slow = [n for n in everything if n not in fast]
  assert slow and len(fast) + len(slow) == len(everything)
