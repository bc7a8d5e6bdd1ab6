"""The direction of imports: core -> nothing above it; tools are on top.

core: what a step needs (config, mesh, plan, gather, quantize, zeropp, grad, step, train state,
offload);
runtime: what runs beside it (checkpoint, distributed, data, memory measurement, weights);
tools: what a person drives (CLI, launcher, export, DeepSpeed mapping, config files, the
training loop). Core never imports tools, not even inside a function; runtime imports no tools
either, except that `memory.compile_for_topology` accepts a config file path.
"""

import ast
import pathlib

import pytest

import zerojax

PKG = pathlib.Path(zerojax.__file__).parent
CORE = {"config", "mesh", "plan", "gather", "grad", "step", "train_state", "offload", "context",
        "quantize", "zeropp",
        "_compat"}
RUNTIME = {"checkpoint", "distributed", "data", "memory", "weights"}
TOOLS = {"cli", "launch", "export", "deepspeed", "config_file", "estimate", "train"}
ALLOWED = {("memory", "config_file")}  # compile_for_topology(config="ds.json")


def _imports(module: str) -> set[str]:
  """Every zerojax module ``module`` imports, at the top or inside functions."""
  tree = ast.parse((PKG / f"{module}.py").read_text())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zerojax"):
      parts = node.module.split(".")
      if len(parts) > 1:
        out.add(parts[1])
      else:  # from zerojax import a, b
        out.update(a.name for a in node.names)
    elif isinstance(node, ast.Import):
      out.update(a.name.split(".")[1] for a in node.names
                 if a.name.startswith("zerojax.") and "." in a.name)
  return out


def test_every_module_is_in_a_layer():
  modules = ({p.stem for p in PKG.glob("*.py")} - {"__init__"}) | {
      p.parent.name for p in PKG.glob("*/__init__.py")} - {"models"}
  assert modules == CORE | RUNTIME | TOOLS, modules ^ (CORE | RUNTIME | TOOLS)


@pytest.mark.parametrize("module", sorted(CORE | RUNTIME))
def test_core_and_runtime_import_no_tools(module):
  bad = {m for m in _imports(module) & TOOLS if (module, m) not in ALLOWED}
  assert not bad, f"zerojax.{module} imports tools {sorted(bad)}"


@pytest.mark.parametrize("module", sorted(CORE))
def test_core_imports_only_core_and_runtime(module):
  assert _imports(module) <= CORE | RUNTIME | {"models"}, _imports(module)
