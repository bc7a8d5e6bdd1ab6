"""The README's examples run as written (a newcomer pastes them first), and every zerojax
name it uses exists."""

import ast
import importlib
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
from tests import helpers

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _usage_snippet() -> str:
  """The first fenced ``python`` block under ``## Usage``."""
  section = README[README.index("\n## Usage\n"):]
  m = re.search(r"```python\n(.*?)\n```", section, re.S)
  assert m, "README's Usage section has no python block"
  return m.group(1)


def _clean_env() -> dict:
  """The environment of a fresh shell as far as devices go: no device count from this session."""
  return helpers.child_env(None)


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


# -- every zerojax name the README uses exists; its code uses the public surface only -----------

INTERNAL = ("zerojax.core", "zerojax.runtime", "zerojax.tools")


def _python_blocks(readme: str) -> list[str]:
  return re.findall(r"```python\n(.*?)```", readme, re.S)


def _chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
  """``a.b.c`` -> ``("a", ["b", "c"])``; the root is None unless it is a plain name."""
  attrs = []
  while isinstance(node, ast.Attribute):
    attrs.append(node.attr)
    node = node.value
  return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def _code_names(blocks: list[str]) -> list[str]:
  """The dotted zerojax names the README's python blocks import or use (``zerojax.x.y``,
  ``from zerojax.x import a`` as ``zerojax.x.a``, ``m.f(`` after ``from zerojax import m`` as
  ``zerojax.m.f``), in order. Blocks run in one namespace (`test_first_hour`), so names a block
  imports stay bound in the next."""
  bound: dict[str, str] = {}  # local name -> the dotted zerojax name it is bound to
  names = []
  for i, code in enumerate(blocks):
    try:
      tree = ast.parse(code)
    except SyntaxError as e:
      raise AssertionError(f"README python block {i} does not parse: {e}\n{code}") from e
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for a in node.names:
          if a.name.split(".")[0] == "zerojax":
            names.append(a.name)
            if a.asname:
              bound[a.asname] = a.name
            else:
              bound["zerojax"] = "zerojax"
      elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "zerojax":
        for a in node.names:
          names.append(f"{node.module}.{a.name}")
          bound[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute):
        root, attrs = _chain(node)
        if root in bound:
          names.append(".".join([bound[root]] + attrs))
  return list(dict.fromkeys(names))


def _resolve(dotted: str):
  """The object a dotted name names, importing submodules its package does not import."""
  parts = dotted.split(".")
  obj = importlib.import_module(parts[0])
  for i in range(1, len(parts)):
    try:
      obj = getattr(obj, parts[i])
    except AttributeError:
      obj = importlib.import_module(".".join(parts[:i + 1]))
  return obj


def test_every_zerojax_name_the_readme_uses_resolves():
  readme = (ROOT / "README.md").read_text()
  code = _code_names(_python_blocks(readme))
  assert "zerojax.ZeroConfig" in code and "zerojax.zero_step" in code, code  # the parse works
  # and the names the prose and commands give (``zerojax.runtime.memory.estimate``, ``python
  # -m zerojax.tools.launch``)
  prose = re.findall(r"\bzerojax(?:\.[A-Za-z_]\w*)+", re.sub(r"```python\n.*?```", "", readme,
                                                               flags=re.S))
  missing = []
  for name in dict.fromkeys(code + prose):
    try:
      _resolve(name)
    except (ImportError, AttributeError) as e:
      missing.append(f"{name}: {type(e).__name__}: {e}")
  assert not missing, "\n".join(missing)


def test_readme_code_imports_only_the_public_surface():
  """The README's python blocks use ``zerojax`` and its public modules, not the layers beneath
  (core, runtime, tools are internal)."""
  names = _code_names(_python_blocks((ROOT / "README.md").read_text()))
  internal = [n for n in names if n in INTERNAL or n.startswith(tuple(p + "." for p in INTERNAL))]
  assert not internal, internal
