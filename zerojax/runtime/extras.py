"""The optional packages behind zerojax's tools (the ``train`` extra), and the one error a
missing one raises.

The library needs only jax, flax, optax, orbax-checkpoint, numpy and pyyaml. Reading a
safetensors checkpoint, tokenizing, shuffling batches, the progress bar, TensorBoard event
files and the loss plot each need a package of the ``train`` extra, which an accelerator
image may lack (and, without network, cannot fetch). A run names what it needs before it
touches a device (`check`), so a missing package is one line naming each one, what needs it
and how to install it, not a traceback after the model has loaded.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Mapping

__all__ = ["MissingPackageError", "NOT_INSTALLED", "unavailable", "check", "require"]

_INSTALL = ("pip install 'zerojax[train]' (without network: 'pip download' the wheels on a "
            "machine with it, then 'pip install --no-index --find-links DIR' them)")
# Packages a run may need that the train extra does not bring: the install line names them.
_OUTSIDE_TRAIN = frozenset({"transformers"})
NOT_INSTALLED = "not installed"
"""`unavailable`'s answer for a package that is not there at all."""


class MissingPackageError(ImportError):
  """Packages a run needs are not installed, or fail to import.

  Attributes:
    missing: ``{module: what needs it}``.
  """

  def __init__(self, message: str, missing: Mapping[str, str]):
    super().__init__(message)
    self.missing = dict(missing)


def unavailable(module: str) -> str | None:
  """Why ``module`` cannot be used, or ``None`` when it imports.

  A package that is installed is imported to find out: one whose own dependencies are broken
  (a tensorboardX without protobuf) is as unusable as a missing one.

  Args:
    module: a top-level module name (``'grain'``).

  Returns:
    ``None``, ``'not installed'``, or the error its import raised.
  """
  try:
    if importlib.util.find_spec(module) is None:
      return NOT_INSTALLED
  except ValueError:  # in sys.modules without a spec: it was imported
    return None
  try:
    importlib.import_module(module)
  except Exception as e:  # noqa: BLE001 (any failure of a third party's import makes it unusable)
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0]}" if first else type(e).__name__
  return None


def check(needs: Mapping[str, str], who: str) -> None:
  """Fails at once, naming every package of ``needs`` that cannot be used.

  Args:
    needs: ``{module: what needs it}``; each module is also its pip package's name.
    who: what needs them, for the message (``'zerojax finetune'``).

  Raises:
    MissingPackageError: one or more are not installed or fail to import.
  """
  why = {m: r for m in needs if (r := unavailable(m)) is not None}
  if not why:
    return
  names = []
  for m, reason in why.items():
    said = [needs[m]] if needs[m] != who else []
    if reason != NOT_INSTALLED:
      said.append(f"installed, but importing it fails: {reason}")
    names.append(f"{m!r}" + (f" ({'; '.join(said)})" if said else ""))
  listed = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
  if all(r == NOT_INSTALLED for r in why.values()):
    state = "is not installed" if len(why) == 1 else "are not installed"
  else:
    state = "cannot be used"
  install = _INSTALL
  if extra := sorted(set(why) & _OUTSIDE_TRAIN):
    install = install.replace("'zerojax[train]'", "'zerojax[train]' " + " ".join(extra), 1)
  raise MissingPackageError(f"{who} needs {listed}, which {state}: {install}",
                            {m: needs[m] for m in why})


def require(module: str, what: str) -> ModuleType:
  """``import module``, or a `MissingPackageError` that says what needed it.

  Args:
    module: the module's name (a dotted name imports its package first).
    what: what needs it, for the message.

  Returns:
    The imported module.

  Raises:
    MissingPackageError: its package is not installed or fails to import.
  """
  check({module.split(".")[0]: what}, what)
  try:
    return importlib.import_module(module)
  except ImportError as e:  # the package imports, this submodule does not
    raise MissingPackageError(f"{what} needs {module!r}, which cannot be imported ({e}): "
                              f"{_INSTALL}", {module: what}) from e
