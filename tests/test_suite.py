"""The fast subset (`pytest -m "not slow"`) is what the README and tests/conftest.py say."""

import os
import pathlib
import subprocess
import sys

from tests import conftest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _collect(*args: str) -> list[str]:
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                      "-p", "no:cacheprovider", *args, "tests"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return [line for line in r.stdout.splitlines() if "::" in line]


def test_fast_subset_keeps_parity_at_every_stage_and_every_slow_entry_names_tests():
  everything, fast = _collect(), set(_collect("-m", "not slow"))
  for stage in range(4):
    assert f"tests/test_step.py::test_parity_linen_scanned[{stage}]" in fast
  slow = [n for n in everything if n not in fast]
  assert slow and len(fast) + len(slow) == len(everything)
  # a renamed test must not leave a stale entry behind (its new name would run in the subset)
  stale = [p for p in conftest.SLOW if not any(n.startswith(p) for n in everything)]
  assert not stale, stale
  assert all(n.startswith(conftest.SLOW) for n in slow)
