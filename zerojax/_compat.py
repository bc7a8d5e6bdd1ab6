"""Every use of JAX internals, in one place, each with a fallback or a clear error at import.

zerojax's correctness depends on recognising a few primitives in jaxprs (the stage-3 remat policy
and the scan-body analysis). JAX has no public names for them, so they are looked up here and
checked once at import: if a JAX release renames them, zerojax fails loudly instead of silently
keeping gathered weights alive.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Literal, Var
from flax import linen as nn

__all__ = ["ORIGINAL_SCAN", "REMAT_PRIMITIVE_NAMES", "name_p", "sharding_constraint_p",
           "jaxpr_has_primitive", "subjaxprs", "eval_jaxpr", "var_uses", "bind_dot_general",
           "install_scan_hook", "ORIGINAL_LINEN_APPLY", "install_linen_apply_hook",
           "backends_initialized", "distributed_state", "detect_cluster"]

# ``jax.lax.scan`` as JAX defines it, captured before zerojax installs its per-thread dispatcher
# (`install_scan_hook`); zerojax's own loops call this one directly.
ORIGINAL_SCAN = jax.lax.scan
_scan_hook_lock = threading.Lock()


def install_scan_hook(dispatch: Callable[..., Any]) -> None:
  """Replaces ``jax.lax.scan``, once per process, with ``dispatch`` (same signature), which must
  call `ORIGINAL_SCAN` itself. JAX has no hook for rewriting scan bodies; code that bound
  ``scan`` before zerojax was imported (``from jax.lax import scan``) is not reached."""
  with _scan_hook_lock:
    if jax.lax.scan is not dispatch:
      functools.update_wrapper(dispatch, ORIGINAL_SCAN)
      jax.lax.scan = dispatch


# ``flax.linen.Module.apply`` as Flax defines it (see `install_linen_apply_hook`).
ORIGINAL_LINEN_APPLY = nn.Module.apply


def install_linen_apply_hook(dispatch: Callable[..., Any]) -> None:
  """Replaces ``flax.linen.Module.apply``, once per process, with ``dispatch`` (same signature,
  calling `ORIGINAL_LINEN_APPLY` itself). Flax has no hook for the variables a model is
  applied to; a method bound before the hook (``state.apply_fn = model.apply``) keeps
  Flax's own."""
  with _scan_hook_lock:
    if nn.Module.apply is not dispatch:
      functools.update_wrapper(dispatch, ORIGINAL_LINEN_APPLY)
      nn.Module.apply = dispatch


def var_uses(jaxpr: Any) -> dict[Any, list[tuple[Any, int]]]:
  """``{var: [(eqn, operand position), ...]}`` over a jaxpr's equations; a use as one of the
  jaxpr's outputs is ``(None, -1)``. Literals are left out."""
  uses: dict[Any, list[tuple[Any, int]]] = {}
  for eqn in jaxpr.eqns:
    for pos, v in enumerate(eqn.invars):
      if isinstance(v, Var):
        uses.setdefault(v, []).append((eqn, pos))
  for v in jaxpr.outvars:
    if isinstance(v, Var):
      uses.setdefault(v, []).append((None, -1))
  return uses


def bind_dot_general(a: Any, b: Any, params: dict[str, Any]) -> Any:
  """``dot_general`` of ``a`` and ``b`` with a traced equation's own parameters (precision and
  preferred element type included, which ``jax.lax.dot_general``'s signature renames)."""
  return jax.lax.dot_general_p.bind(a, b, **params)

try:  # The primitives the stage-3 remat policy looks at (the policy API hands it primitives).
  from jax._src.ad_checkpoint import name_p
  from jax._src.pjit import sharding_constraint_p
except ImportError as e:  # pragma: no cover - depends on the installed JAX
  raise ImportError(
      f"zerojax {__name__}: this JAX ({jax.__version__}) moved the internal primitives zerojax's "
      "stage-3 remat policy must recognise (name_p, sharding_constraint_p); install the JAX "
      "version pinned in zerojax's pyproject.toml") from e

# The primitive `jax.checkpoint` binds has been called "checkpoint", "remat" and "remat2".
REMAT_PRIMITIVE_NAMES = frozenset({"checkpoint", "remat", "remat2"})


def subjaxprs(params: dict[str, Any]) -> Iterator[Any]:
  """The jaxprs an equation's parameters hold (scan/while/cond/pjit/remat/custom_vjp bodies)."""
  for v in params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      inner = getattr(x, "jaxpr", x)  # ClosedJaxpr -> Jaxpr
      if hasattr(inner, "eqns"):
        yield inner


def jaxpr_has_primitive(jaxpr: Any, names: frozenset[str]) -> bool:
  """Whether ``jaxpr`` (or any jaxpr nested in it) binds a primitive named in ``names``."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names:
      return True
    if any(jaxpr_has_primitive(j, names) for j in subjaxprs(eqn.params)):
      return True
  return False


def backends_initialized() -> bool:
  """Whether JAX has started its backends (device counts and XLA flags are fixed from then on).
  JAX has no public query; without the internal one this says ``False`` and the checks that
  ask are skipped (JAX then raises its own, later error)."""
  try:
    from jax._src import xla_bridge  # internal: looked up late, it may move
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # pragma: no cover - depends on the installed JAX
    return False


def distributed_state() -> Any:
  """JAX's distributed-runtime state (``process_id``, ``num_processes``,
  ``coordinator_address``, ``client``: the coordination service's key-value store), or
  ``None`` where this JAX keeps it elsewhere (callers then use public APIs only)."""
  try:
    from jax._src import distributed  # internal: looked up late, it may move
    return distributed.global_state
  except (ImportError, AttributeError):  # pragma: no cover - depends on the installed JAX
    return None


def detect_cluster(coordinator: Any, num_processes: Any, process_id: Any, local_device_ids: Any,
                   method: Any, timeout: Any) -> tuple[Any, Any, Any, Any]:
  """JAX's own scheduler detection (SLURM, Open MPI, Kubernetes, TPU) for the settings still
  unset, as ``jax.distributed.initialize`` does it; the settings unchanged where this JAX does
  not expose it."""
  try:
    from jax._src import clusters  # internal: looked up late, it may move
    detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
  except (ImportError, AttributeError):  # pragma: no cover - depends on the installed JAX
    return coordinator, num_processes, process_id, local_device_ids
  return detect(coordinator, num_processes, process_id, local_device_ids, method, timeout)


def eval_jaxpr(closed: Any, args: list[Any],
               rewrite: Callable[[Any, list[Any]], list[Any] | None]) -> list[Any]:
  """Evaluates a closed jaxpr on ``args`` (tracers welcome), as ``jax.core.eval_jaxpr`` does,
  except that ``rewrite(eqn, invals)`` may answer an equation itself (its outputs as a list);
  ``None`` binds the equation as written. Only top-level equations are offered."""
  jaxpr = closed.jaxpr
  env: dict[Any, Any] = {}
  read = lambda v: v.val if isinstance(v, Literal) else env[v]
  env.update(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    outs = rewrite(eqn, invals)
    if outs is None:
      ctx = getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext()
      with ctx:
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
      if not eqn.primitive.multiple_results:
        outs = [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _self_check() -> None:
  """The checks that keep the remat machinery honest on the installed JAX."""
  body = jax.checkpoint(lambda x: jax.numpy.sin(x))
  if not jaxpr_has_primitive(jax.make_jaxpr(body)(1.0), REMAT_PRIMITIVE_NAMES):
    raise ImportError(f"zerojax: jax.checkpoint on JAX {jax.__version__} binds none of "
                      f"{sorted(REMAT_PRIMITIVE_NAMES)}; zerojax cannot tell rematerialised "
                      "layers apart. Install the JAX version pinned in zerojax's pyproject.toml")
  named = jax.make_jaxpr(lambda x: checkpoint_name(x, "zerojax_probe"))(1.0)
  if not any(e.primitive is name_p for e in named.jaxpr.eqns):
    raise ImportError(f"zerojax: checkpoint_name on JAX {jax.__version__} no longer binds the "
                      "primitive zerojax's stage-3 remat policy looks for; gathered weights "
                      "would silently be kept. Install the JAX version pinned in pyproject.toml")
  # Re-evaluating a jaxpr under autodiff must give the same derivative (traced only: no
  # backend may start at import, the device count is set after it).
  f = lambda x: jax.numpy.sin(x[1]) * 2.0
  x = jax.ShapeDtypeStruct((3,), jax.numpy.float32)
  closed = jax.make_jaxpr(f)(x)
  want = jax.make_jaxpr(jax.grad(f))(x)
  got = jax.make_jaxpr(jax.grad(lambda x: eval_jaxpr(closed, [x], lambda *_: None)[0]))(x)
  prims = lambda j: [e.primitive.name for e in j.jaxpr.eqns]
  if prims(got) != prims(want):
    raise ImportError(f"zerojax: re-evaluating a jaxpr on JAX {jax.__version__} changed its "
                      "derivative; install the JAX version pinned in pyproject.toml")


_self_check()
