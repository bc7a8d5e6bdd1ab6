"""Public docstrings are contracts, in optax's style: every public function and method that
takes arguments names them under ``Args:``, one that returns a value says what under
``Returns:`` (``Yields:`` for a generator), and one that raises an exception itself names it
under ``Raises:``.

Public means: a name in the ``__all__`` of a public module, and the methods a public class
defines itself (not those it inherits from Flax or the standard library)."""

import ast
import importlib
import inspect
import textwrap

import pytest

from tests.test_layout import PUBLIC

MODULES = sorted(PUBLIC - {"zerojax.__main__"})


def _public_callables():
  seen = set()
  for name in MODULES:
    mod = importlib.import_module(name)
    for attr in getattr(mod, "__all__", []):
      obj = getattr(mod, attr)
      found = [(f"{name}.{attr}", obj)]
      if inspect.isclass(obj):
        found += [(f"{name}.{attr}.{k}", v) for k, v in vars(obj).items()
                  if not k.startswith("_") and inspect.isfunction(v)]
      for qual, f in found:
        if (inspect.isfunction(f) and id(f) not in seen
            and (f.__module__ or "").startswith("zerojax")):
          seen.add(id(f))
          yield qual, f


def _raises(f) -> bool:
  """Whether ``f``'s own body raises an exception it names (not a bare re-raise, not in a
  function it defines)."""
  fn = ast.parse(textwrap.dedent(inspect.getsource(f))).body[0]
  todo = list(fn.body)
  while todo:
    node = todo.pop()
    if isinstance(node, ast.Raise) and node.exc is not None:
      return True
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
      todo.extend(ast.iter_child_nodes(node))
  return False


def _missing(f) -> list[str]:
  doc = inspect.getdoc(f) or ""
  sig = inspect.signature(f)
  missing = []
  if [p for p in sig.parameters if p not in ("self", "cls")] and "Args:" not in doc:
    missing.append("Args")
  returns = sig.return_annotation not in (None, "None", inspect.Signature.empty)
  if returns and "Returns:" not in doc and "Yields:" not in doc:
    missing.append("Returns")
  if _raises(f) and "Raises:" not in doc:
    missing.append("Raises")
  return missing


def test_every_public_function_states_args_returns_and_raises():
  found = list(_public_callables())
  assert len(found) > 150  # the walk reached the public surface
  bad = {q: m for q, f in found if (m := _missing(f))}
  assert not bad, f"docstrings without the sections they need: {bad}"


def test_the_check_sees_a_missing_section():
  def undocumented(x: int) -> int:
    """Doubles."""
    if x < 0:
      raise ValueError(x)
    return 2 * x

  def documented(x: int) -> int:
    """Doubles.

    Args:
      x: a number.

    Returns:
      ``2 * x``.

    Raises:
      ValueError: ``x`` is negative.
    """
    if x < 0:
      raise ValueError(x)
    return 2 * x

  def reraises() -> None:
    """Passes an error on."""
    try:
      pass
    except OSError:
      raise

  assert _missing(undocumented) == ["Args", "Returns", "Raises"]
  assert _missing(documented) == [] and _missing(reraises) == []


@pytest.mark.parametrize("name", MODULES)
def test_public_modules_have_a_docstring(name):
  assert (importlib.import_module(name).__doc__ or "").strip()
