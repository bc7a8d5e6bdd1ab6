"""A model's blocks: where ``remat='full'``, ``'dots'`` or ``'offload'`` acts on a linen or NNX
model without scans.

Checkpointed whole, a model re-runs its whole forward pass in the backward pass and keeps
every residual of that re-run until the backward pass reads it: as much memory as no remat,
and one more gather of every weight. Per block, each block keeps only its inputs (or what the
policy saves) and re-runs alone, as ``nn.remat(Block)`` in a Python loop would.

A linen model's blocks are found in its first trace (`recording`): the shallowest two or more
modules of one class, made of modules that own parameters, that one parent calls
(``Block_0`` … ``Block_11``; a Hugging Face model's ``layers/0`` …; `repeated_blocks`). The
step then checkpoints each of their calls (`checkpointed_blocks`); the rest of the model runs
as written. An NNX model's blocks are found in its module graph (`nnx_blocks`) and
checkpointed with ``nnx.remat`` (`checkpoint_nnx_blocks`).
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from typing import Any, Hashable, Iterator

import jax
from flax import errors as flax_errors
from flax import linen as nn
from flax import nnx

from zerojax.core.context import setting, tracing
from zerojax.core.gather import ZeroParam
from zerojax.core.regather import array_args

__all__ = ["recording", "repeated_blocks", "checkpointed_blocks", "nnx_blocks",
           "checkpoint_nnx_blocks"]

Path = tuple[Hashable, ...]


@contextlib.contextmanager
def recording() -> Iterator[dict[Path, type]]:
  """Inside the block, every linen module call that owns parameters is recorded as
  ``{scope path: module class}`` in the dict yielded (for `repeated_blocks`)."""
  calls: dict[Path, type] = {}

  def record(next_fun, args, kwargs, context):
    module = context.module
    scope = module.scope
    if scope is not None and scope.path and module.variables.get("params"):
      calls.setdefault(tuple(scope.path), type(module))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    yield calls


def repeated_blocks(calls: dict[Path, type]) -> frozenset[Path]:
  """The model's blocks among its recorded ``calls``: the shallowest group of two or more
  modules of one class called by one parent that are themselves made of modules (a block of
  layers, not an input projection and a head that are both ``Dense``); failing that, the
  shallowest such group of modules that are not (a stack of ``Dense`` layers). Empty if no
  module repeats."""
  made_of = {p[:k] for p in calls for k in range(1, len(p))}
  for composite in (True, False):
    for depth in sorted({len(p) for p in calls}):
      groups: dict[tuple[Path, type], list[Path]] = collections.defaultdict(list)
      for path, cls in calls.items():
        if len(path) == depth and (path in made_of) == composite:
          groups[(path[:-1], cls)].append(path)
      found = [p for ps in groups.values() if len(ps) > 1 for p in ps]
      if found:
        return frozenset(found)
  return frozenset()


@contextlib.contextmanager
def checkpointed_blocks(paths: frozenset[Path], policy: Any) -> Iterator[None]:
  """Inside the block, each call of a linen module at one of ``paths`` runs under
  ``jax.checkpoint(policy)``, a CSE barrier as ``nn.remat``'s default is, with keys drawn from
  the module's RNG streams. A block that writes or holds collections other than ``params``
  (batch statistics, ``sow``) runs as written, with a warning."""

  def intercept(next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    scope = module.scope
    if (tracing().in_block or scope is None or tuple(scope.path) not in paths
        or method == "setup" or (method.startswith("_") and method != "__call__")):
      return next_fun(*args, **kwargs)
    variables = module.variables
    if scope.mutable or set(variables) != {"params"}:
      _warn_as_written(scope.path, f"collections {sorted(variables)}, mutable "
                                   f"{scope.mutable}")
      return next_fun(*args, **kwargs)
    boxes, treedef = jax.tree.flatten(variables["params"],
                                      is_leaf=lambda x: isinstance(x, ZeroParam))
    values = [b.value if isinstance(b, ZeroParam) else b for b in boxes]
    arrays, rebuild = array_args(args, kwargs)
    keys = {name: module.make_rng(name) for name in (scope.rngs or {})}
    unbound = module.clone(parent=None)

    out_static: list = []  # the output's non-array leaves, in place (set while tracing)

    def run(values, arrays, keys):
      params = jax.tree.unflatten(treedef, [b.replace(value=v) if isinstance(b, ZeroParam)
                                            else v for b, v in zip(boxes, values)])
      a, kw = rebuild(arrays)
      with setting(in_block=True):
        out = unbound.apply({"params": params}, *a, method=method, rngs=keys or None, **kw)
      # A block may return Python values beside its arrays (``(x, None, 3)``); only arrays
      # leave a checkpoint, so the rest is put back in place after it.
      leaves, out_def = jax.tree.flatten(out)
      out_static[:] = [out_def, [None if isinstance(x, jax.Array) else x for x in leaves]]
      return [x for x in leaves if isinstance(x, jax.Array)]

    try:
      arrays_out = jax.checkpoint(run, policy=policy, prevent_cse=True)(values, arrays, keys)
    except (flax_errors.InvalidRngError, flax_errors.ScopeCollectionNotFound) as e:
      _warn_as_written(scope.path, type(e).__name__)
      return next_fun(*args, **kwargs)
    out_def, static = out_static
    it = iter(arrays_out)
    return jax.tree.unflatten(out_def, [next(it) if x is None else x for x in static])

  with nn.intercept_methods(intercept):
    yield


def _warn_as_written(path: Path, why: str) -> None:
  warnings.warn(f"zerojax: remat cannot checkpoint block {'/'.join(map(str, path))} on its own "
                f"({why}); it runs as written", stacklevel=3)


# -- NNX ---------------------------------------------------------------------------------------


def nnx_blocks(model: Any) -> frozenset[Path]:
  """`repeated_blocks` of an NNX model, from its module graph: every module that owns
  ``nnx.Param`` state (``blocks/0`` … of an ``nnx.List``)."""
  calls = {tuple(path): type(m) for path, m in nnx.iter_modules(model)
           if path and jax.tree.leaves(nnx.state(m, nnx.Param))}
  return repeated_blocks(calls)


def checkpoint_nnx_blocks(model: Any, paths: frozenset[Path], policy: Any) -> None:
  """Makes each module of ``model`` at one of ``paths`` compute under ``nnx.remat(policy)``, in
  place (``model`` is the copy a zerojax NNX step has just merged, traced once)."""
  for path, module in nnx.iter_modules(model):
    if tuple(path) in paths:
      object.__setattr__(module, "__class__", _block_class(type(module), policy))


_BLOCK_CLASSES: dict[tuple[type, Any], type] = {}


def _block_class(cls: type, policy: Any) -> type:
  if (cls, policy) not in _BLOCK_CLASSES:
    call = cls.__call__

    def checkpointed(self, *args, **kwargs):
      return nnx.remat(lambda m, *a, **kw: call(m, *a, **kw), policy=policy)(self, *args,
                                                                            **kwargs)

    _BLOCK_CLASSES[(cls, policy)] = type(cls.__name__, (cls,), {"__call__": checkpointed,
                                                                "__module__": cls.__module__})
  return _BLOCK_CLASSES[(cls, policy)]
