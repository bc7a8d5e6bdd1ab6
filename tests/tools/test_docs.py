"""The documentation's examples run as a reader pastes them: every ```python block of a page
under docs/, in order, in one namespace, in a fresh process with 8 simulated CPU devices.

A block that cannot run here says so on the line before it:

* ``<!-- skip: why -->``: never run (PyTorch code shown for comparison, say);
* ``<!-- requires: module -->``: run only where ``module`` is installed (libtpu, which the
  ``tpu`` extra installs and CI has), skipped elsewhere.

The names the blocks use resolve and are public, as the README's are (`test_readme`), and
the pages build with Sphinx without a warning where Sphinx is installed (CI builds them too).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

from tests import helpers
from tests.tools.test_first_hour import _make_llama
from tests.tools.test_readme import INTERNAL, _code_names, _resolve

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))

_FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
_MARK = re.compile(r"<!--\s*(skip|requires):\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
  page: str
  line: int           # of the opening fence, 1-based
  code: str
  skip: str | None    # the reason, for <!-- skip: ... -->
  requires: str | None  # a module, for <!-- requires: ... -->


def blocks(page: str) -> list[Block]:
  text = (DOCS / page).read_text()
  out = []
  for m in _FENCE.finditer(text):
    before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
    mark = _MARK.search(before)
    kind, arg = (mark.group(1), mark.group(2)) if mark else (None, None)
    out.append(Block(page, text.count("\n", 0, m.start()) + 1, m.group(1),
                     arg if kind == "skip" else None, arg if kind == "requires" else None))
  return out


def _runs(b: Block) -> bool:
  return b.skip is None and (b.requires is None or importlib.util.find_spec(b.requires)
                             is not None)


# Pages whose blocks take longer than a few seconds of compiling (-m "not slow" leaves them out).
SLOW = {"offload.md", "finetuning.md", "training.md", "multihost.md",
        "compile.md"}
RUNNABLE = [p for p in PAGES if any(b.skip is None for b in blocks(p))]


def test_every_block_parses_and_every_skip_says_why():
  assert "quickstart.md" in RUNNABLE and "index.md" in PAGES
  for page in PAGES:
    for b in blocks(page):
      compile(b.code, f"docs/{page}:{b.line}", "exec")
      assert b.skip is None or len(b.skip) > 10, f"docs/{page}:{b.line}: a skip needs a reason"
  skipped = [f"{b.page}:{b.line}" for p in PAGES for b in blocks(p) if b.skip is not None]
  assert len(skipped) <= 2, f"blocks that never run should be rare: {skipped}"


def test_every_zerojax_name_the_docs_use_resolves_and_is_public():
  for page in PAGES:
    names = _code_names([b.code for b in blocks(page)])
    missing = []
    for name in names:
      try:
        _resolve(name)
      except (ImportError, AttributeError) as e:
        missing.append(f"{name}: {type(e).__name__}: {e}")
    assert not missing, f"docs/{page}:\n" + "\n".join(missing)
    internal = [n for n in names if n in INTERNAL
                or n.startswith(tuple(p + "." for p in INTERNAL))]
    assert not internal, f"docs/{page}: {internal}"


_DRIVER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for page, line, code in blocks:
  exec(compile(code, f"docs/{page}, the block at line {line}", "exec"), ns)
  print(f"ran: {line}", flush=True)
"""


SETUP = {"finetuning.md": lambda cwd: _make_llama(cwd / "models" / "my-llama")}


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p
                                  for p in RUNNABLE])
def test_page_runs_as_pasted(page, tmp_path):
  todo = [b for b in blocks(page) if _runs(b)]
  if not todo:
    pytest.skip(f"docs/{page}: every block needs what is not installed here")
  if page in SETUP:
    SETUP[page](tmp_path)
  (tmp_path / "blocks.json").write_text(json.dumps([[b.page, b.line, b.code] for b in todo]))
  (tmp_path / "driver.py").write_text(_DRIVER)
  # A fresh shell with the tests' 8 CPU devices, on the CPU (no GPU or TPU plugin starts).
  r = subprocess.run([sys.executable, "driver.py", "blocks.json"], cwd=tmp_path,
                     env=helpers.child_env(8, JAX_PLATFORMS="cpu"), capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, f"docs/{page}\n" + r.stdout[-3000:] + r.stderr[-5000:]
  ran = [int(x) for x in re.findall(r"^ran: (\d+)$", r.stdout, re.M)]
  assert ran == [b.line for b in todo], ran


def test_quickstart_starts_with_the_readme_usage_example():
  """The quickstart's first block is the README's Usage example, character for character."""
  readme = (ROOT / "README.md").read_text()
  usage = re.search(r"```python\n(.*?)\n```", readme[readme.index("\n## Usage\n"):], re.S)
  assert usage and blocks("quickstart.md")[0].code.rstrip("\n") == usage.group(1)


@pytest.mark.slow
def test_sphinx_builds_without_a_warning(tmp_path):
  pytest.importorskip("sphinx")
  pytest.importorskip("myst_parser")
  pytest.importorskip("sphinx_book_theme")
  r = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                      "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
                     cwd=ROOT, env=helpers.child_env(8, JAX_PLATFORMS="cpu"),
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
  assert (tmp_path / "html" / "api.html").exists()
