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

__all__ = ["MissingPackageError", "installed", "check", "require"]

_INSTALL = ("pip install 'zerojax[train]' (without network: 'pip download' the wheels on a "
            "machine with it, then 'pip install --no-index --find-links DIR' them)")


class MissingPackageError(ImportError):
  """Packages a run needs are not installed.

  Attributes:
    missing: ``{module: what needs it}``.
  """

  def __init__(self, message: str, missing: Mapping[str, str]):
    super().__init__(message)
    self.missing = dict(missing)


def installed(module: str) -> bool:
  """Whether ``module`` can be imported, without importing it.

  Args:
    module: a top-level module name (``'grain'``).

  Returns:
    ``True`` when it is installed.
  """
  return importlib.util.find_spec(module) is not None


def check(needs: Mapping[str, str], who: str) -> None:
  """Fails at once, naming every package of ``needs`` that is not installed.

  Args:
    needs: ``{module: what needs it}``; each module is also its pip package's name.
    who: what needs them, for the message (``'zerojax finetune'``).

  Raises:
    MissingPackageError: one or more are not installed.
  """
  missing = {m: what for m, what in needs.items() if not installed(m)}
  if missing:
    names = [f"{m!r}" + (f" ({what})" if what != who else "") for m, what in missing.items()]
    listed = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
    raise MissingPackageError(f"{who} needs {listed}, which {'is' if len(missing) == 1 else 'are'}"
                              f" not installed: {_INSTALL}", missing)


def require(module: str, what: str) -> ModuleType:
  """``import module``, or a `MissingPackageError` that says what needed it.

  Args:
    module: the module's name (a dotted name imports its package first).
    what: what needs it, for the message.

  Returns:
    The imported module.

  Raises:
    MissingPackageError: its package is not installed.
  """
  check({module.split(".")[0]: what}, what)
  return importlib.import_module(module)
