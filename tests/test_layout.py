"""The package's folders are its layers, and imports point one way: core <- runtime <- tools.

zerojax/core: what a step needs, in the order data flows (distributed set-up, config, mesh,
plan, gather, quantize/zeropp, grad, step, train state, offload, placement, budget);
zerojax/runtime: what runs beside it (checkpoint, data, memory measurement, weights);
zerojax/tools: what a person drives (CLI, launcher, export, DeepSpeed mapping, config files,
estimate, the training loop). A module never imports from a layer above its own, not even
inside a function, except that `runtime.memory.compile_for_topology` accepts a config file path
(`tools.config_file`). `_compat` (every use of JAX internals) and `models` sit beside core.
"""

import ast
import pathlib

import pytest

import zerojax

PKG = pathlib.Path(zerojax.__file__).parent
LAYERS = ("core", "runtime", "tools")
BESIDE_CORE = {"_compat", "models", "__init__"}  # importable from every layer
ALLOWED = {("runtime.memory", "tools.config_file")}  # compile_for_topology(config="ds.json")


def _modules() -> dict[str, pathlib.Path]:
  """``{'core.plan': path, 'tools.train': path, ...}`` for every module of the three layers."""
  out = {}
  for layer in LAYERS:
    for p in (PKG / layer).iterdir():
      if p.suffix == ".py" and p.stem != "__init__":
        out[f"{layer}.{p.stem}"] = p
      elif p.is_dir() and (p / "__init__.py").exists():
        out[f"{layer}.{p.name}"] = p
  return out


def _imports(path: pathlib.Path) -> set[str]:
  """Every zerojax module a module (or package) imports, as ``'layer.module'`` (or the names
  beside core), at the top or inside functions."""
  files = [path] if path.is_file() else sorted(path.rglob("*.py"))
  out = set()
  for f in files:
    for node in ast.walk(ast.parse(f.read_text())):
      names = []
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zerojax"):
        parts = node.module.split(".")
        if len(parts) == 2 and parts[1] in LAYERS:  # from zerojax.core import plan, gather
          names = [f"{parts[1]}.{a.name}" for a in node.names]
        elif len(parts) >= 3 and parts[1] in LAYERS:
          names = [f"{parts[1]}.{parts[2]}"]
        elif len(parts) >= 2:
          names = [parts[1]]
        else:  # from zerojax import ZeroConfig: the package's public API (it imports tools)
          names = ["__init__"]
      elif isinstance(node, ast.Import):
        for a in node.names:
          parts = a.name.split(".")
          if parts[0] == "zerojax" and len(parts) >= 3 and parts[1] in LAYERS:
            names.append(f"{parts[1]}.{parts[2]}")
      out.update(names)
  return out


def test_the_package_is_three_layers_beside_compat_and_models():
  top = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
         if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
  # zerojax.weights and zerojax.checkpoint: the public names of runtime.weights and
  # runtime.checkpoint (re-exports, like __init__; README's snippets import them)
  assert top == {"__init__", "_compat", "models", "weights", "checkpoint", *LAYERS}, top
  assert {"core.config", "core.mesh", "core.plan", "core.step", "runtime.checkpoint",
          "runtime.memory", "tools.cli", "tools.train"} <= set(_modules())


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_point_down(module):
  layer = LAYERS.index(module.split(".")[0])
  bad = set()
  for imported in _imports(_modules()[module]):
    if imported == "__init__":  # `from zerojax import X` reaches the top: only tools may
      if layer < LAYERS.index("tools"):
        bad.add("zerojax (the package API)")
      continue
    if imported in BESIDE_CORE:
      continue
    if LAYERS.index(imported.split(".")[0]) > layer and (module, imported) not in ALLOWED:
      bad.add(imported)
  assert not bad, f"zerojax.{module} imports from a layer above it: {sorted(bad)}"
