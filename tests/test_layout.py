"""The package's folders are its layers, imports point one way, and users see only the public
modules.

Layers, lowest first: zerojax/core (what a step needs: config, mesh, plan, gather, grad, step,
...), zerojax/runtime (what runs beside it: checkpoint, data, memory measurement, weights),
zerojax/models (GPT, Llama: they read weights through runtime), zerojax/tools (what a person
drives: CLI, launcher, export, DeepSpeed mapping, config files, estimate, the training loop). A
module imports only from its own layer and those below, not even inside a function;
`_compat` (every use of JAX internals) is below them all. The public modules (`zerojax`,
`zerojax.memory`, `zerojax.checkpoint`, ...) sit on top: they re-export the layers and no
layer imports them, except that tools may use the package's own names (`from zerojax import
zero_step`, which is the defining core module's). The package's import graph has no circles.
"""

import ast
import pathlib
import re

import pytest

import zerojax

PKG = pathlib.Path(zerojax.__file__).parent
ROOT = PKG.parent
LAYERS = ("core", "runtime", "models", "tools")
PUBLIC = {"zerojax", "zerojax.__main__", "zerojax.models", "zerojax.memory",
          "zerojax.checkpoint", "zerojax.weights", "zerojax.data", "zerojax.train",
          "zerojax.finetune", "zerojax.distributed", "zerojax.nvme"}


def _module_files() -> dict[str, pathlib.Path]:
  """``{'zerojax.core.plan': path, 'zerojax.tools.train': path/__init__.py, ...}``: every
  module of the package."""
  out = {}
  for f in sorted(PKG.rglob("*.py")):
    parts = list(f.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = f
  return out


MODULES = _module_files()


def _target(name: str) -> str | None:
  """The package module ``name`` refers to (a module, or the module that defines it)."""
  parts = name.split(".")
  while parts:
    if ".".join(parts) in MODULES:
      return ".".join(parts)
    parts.pop()
  return None


def _type_checking_only(tree: ast.AST) -> set[int]:
  """ids of import nodes under ``if TYPE_CHECKING:`` (seen by type checkers, never run)."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      out |= {id(n) for n in ast.walk(node)}
  return out


def _imports(module: str) -> set[str]:
  """Every package module ``module`` imports, at the top or inside functions. ``from zerojax
  import X`` of a name the package exports lazily is an import of the module defining X."""
  path = MODULES[module]
  tree = ast.parse(path.read_text())
  skip = _type_checking_only(tree)
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  out = set()
  for node in ast.walk(tree):
    if id(node) in skip:
      continue
    if isinstance(node, ast.Import):
      out |= {_target(a.name) for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from . import x, from .a import b
        up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(up + ([base] if base else []))
      for a in node.names:
        if base == "zerojax" and a.name in zerojax._EXPORTS:
          out.add(zerojax._EXPORTS[a.name])
        else:
          out.add(_target(f"{base}.{a.name}") or _target(base))
  out.discard(None)
  out.discard(module)
  return out


GRAPH = {m: _imports(m) for m in MODULES}


def _layer(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_package_is_four_layers_under_public_modules():
  top = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
         if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
  public = {m.split(".")[1] for m in PUBLIC if m != "zerojax"}
  assert top == {"__init__", "_compat", *LAYERS, *public}, top
  assert {"zerojax.core.config", "zerojax.core.mesh", "zerojax.core.plan", "zerojax.core.step",
          "zerojax.runtime.checkpoint", "zerojax.runtime.memory", "zerojax.models.gpt",
          "zerojax.models.llama", "zerojax.tools.cli", "zerojax.tools.train"} <= set(MODULES)
  # Outside the layers: the public modules and _compat (zerojax.models is public and a layer).
  assert {m for m in MODULES if _layer(m) is None} == (PUBLIC - {"zerojax.models"}) | {
      "zerojax._compat"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m)))
def test_imports_point_down(module):
  mine = LAYERS.index(_layer(module))
  bad = set()
  for imported in GRAPH[module]:
    if imported == "zerojax._compat":
      continue
    if imported == "zerojax":  # the package itself (its __version__): only tools may
      if _layer(module) != "tools":
        bad.add(imported)
      continue
    layer = _layer(imported)
    if layer is None or LAYERS.index(layer) > mine:  # a public module, or a layer above
      bad.add(imported)
  assert not bad, f"{module} imports from above its layer: {sorted(bad)}"


def test_compat_imports_nothing_of_the_package():
  assert GRAPH["zerojax._compat"] == set()


def test_the_import_graph_has_no_circles():
  """Tarjan's strongly connected components over every import (top level and inside
  functions): a component of more than one module is a circle."""
  index, low, stack, on_stack, circles = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(GRAPH[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        circles.append(sorted(comp))

  for v in sorted(GRAPH):
    if v not in index:
      visit(v)
  assert not circles, f"import circles: {circles}"


def test_public_modules_export_what_they_name():
  import importlib
  for name in sorted(PUBLIC - {"zerojax", "zerojax.__main__"}):
    mod = importlib.import_module(name)
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{name}.__all__ names what it lacks: {missing}"
  assert all(hasattr(zerojax, n) for n in zerojax.__all__)


_INTERNAL = re.compile(r"\bzerojax\.(core|runtime|tools)\b")


# docs/design.md is the design notes: it names the layers' modules on purpose.
@pytest.mark.parametrize("path", ["README.md", *sorted(
    str(p.relative_to(ROOT)) for p in [*(ROOT / "docs").glob("*.md"),
                                       *(ROOT / "examples").glob("*.py")]
    if p.name != "design.md")])
def test_documentation_names_only_public_modules(path):
  """README, docs and examples import `zerojax` and its public modules, never a layer."""
  lines = [f"{i}: {line.strip()}" for i, line in
           enumerate((ROOT / path).read_text().splitlines(), 1) if _INTERNAL.search(line)]
  assert not lines, f"{path} names the internal layers:\n" + "\n".join(lines)


def test_ambient_state_is_one_record_in_one_context_variable():
  # What code called from a traced step reads without being handed it is the fields of
  # `zerojax.core.context.Tracing`, in one context variable; no module keeps its own.
  found = {str(f.relative_to(PKG)): f.read_text().count("ContextVar(")
           for f in sorted(PKG.rglob("*.py")) if "ContextVar(" in f.read_text()}
  assert found == {"core/context.py": 1}
