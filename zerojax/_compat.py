"""Every use of JAX internals, in one place, each with a fallback or a clear error at import.

zerojax's correctness depends on recognising a few primitives in jaxprs (the stage-3 remat policy
and the scan-body analysis). JAX has no public names for them, so they are looked up here and
checked once at import: if a JAX release renames them, zerojax fails loudly instead of silently
keeping gathered weights alive.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from typing import Any, Callable, Iterator

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.compute_on import compute_on
from jax.experimental.xla_metadata import set_xla_metadata
from jax.extend.core import Literal, Var, get_opaque_trace_state

__all__ = ["JAX_VERSION", "xla_gpu_options", "ORIGINAL_SCAN", "REMAT_PRIMITIVE_NAMES", "name_p", "sharding_constraint_p",
           "jaxpr_has_primitive", "subjaxprs", "eval_jaxpr", "var_uses", "bind_dot_general",
           "eval_eqns", "bind_eqn", "scan_hook", "backends_initialized", "distributed_state",
           "detect_cluster", "checkpoint_trace", "compute_on_host", "collective_time",
           "without_cache_writes"]

# The installed JAX release as (major, minor, patch), for the per-release paths below.
JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:3])

# XLA:GPU options that the compiler of a JAX release cannot take, from that release on:
# {option: (first release, replacement option and value, or None to drop it)}. From jaxlib
# 0.11 on:
# * the boolean collective-pipelining options are gone ("No such compile option"); their
#   successors take a `CollectivePipeliningMode`, given by name (an int is not validated);
# * XLA:GPU's analytical latency estimator aborts the process while scheduling some programs
#   (`AnalyticalLatencyEstimator::NodeCost`: "Check failed: buffer != nullptr"), so it is
#   left out and the scheduler uses its default estimator.
_PIPELINE_ON = "COLLECTIVE_PIPELINING_MODE_ON"
_GPU_OPTIONS_FROM: dict[str, tuple[tuple[int, ...], tuple[str, Any] | None]] = {
    "xla_gpu_enable_pipelined_all_gather": ((0, 11), ("xla_gpu_pipeline_all_gather",
                                                      _PIPELINE_ON)),
    "xla_gpu_enable_pipelined_reduce_scatter": ((0, 11), ("xla_gpu_pipeline_reduce_scatter",
                                                          _PIPELINE_ON)),
    "xla_gpu_enable_analytical_latency_estimator": ((0, 11), None),
}


def xla_gpu_options(options: dict[str, Any]) -> dict[str, Any]:
  """``options`` as this JAX release's XLA:GPU takes them: each option its compiler cannot
  take is replaced or left out (`_GPU_OPTIONS_FROM`).

  Args:
    options: XLA:GPU compile options, by name.

  Returns:
    A new dict, in the same order.
  """
  out: dict[str, Any] = {}
  for k, v in options.items():
    since, replacement = _GPU_OPTIONS_FROM.get(k, ((1 << 30,), None))
    if JAX_VERSION < since:
      out[k] = v
    elif replacement is not None and v:
      out.setdefault(*replacement)
  return out


# ``jax.lax.scan`` as JAX defines it; zerojax's own loops and the dispatcher below call it
# directly.
ORIGINAL_SCAN = jax.lax.scan

_held_lock = threading.Lock()
_held_counts: dict[str, int] = {}
_held_saved: dict[str, Any] = {}


@contextlib.contextmanager
def _held(key: str, install: Callable[[], Any], restore: Callable[[Any], None]) -> Iterator[None]:
  """Installs a replacement while at least one zerojax step trace (in any thread) is inside the
  block, and puts back what was there when the last one leaves."""
  with _held_lock:
    if _held_counts.get(key, 0) == 0:
      _held_saved[key] = install()
    _held_counts[key] = _held_counts.get(key, 0) + 1
  try:
    yield
  finally:
    with _held_lock:
      _held_counts[key] -= 1
      if _held_counts[key] == 0:
        restore(_held_saved.pop(key))


def _attribute_held(key: str, owner: Any, name: str, dispatch: Callable[..., Any],
                    original: Callable[..., Any]) -> contextlib.AbstractContextManager[None]:
  """`_held` for ``owner.name``: ``dispatch`` (wrapped to look like ``original``) while held."""
  def install():
    saved = getattr(owner, name)
    setattr(owner, name, functools.update_wrapper(dispatch, original))
    return saved
  return _held(key, install, lambda saved: setattr(owner, name, saved))


def scan_hook(dispatch: Callable[..., Any]) -> contextlib.AbstractContextManager[None]:
  """While a step traces inside the block, ``jax.lax.scan`` is ``dispatch`` (same signature;
  it calls `ORIGINAL_SCAN` itself). JAX has no hook for rewriting scan bodies. Outside every
  such block ``jax.lax.scan`` is JAX's own object again.

  Args:
    dispatch: the replacement; outside zerojax's per-thread settings it must behave as
      `ORIGINAL_SCAN`, since another thread may call it while the block is open.

  Returns:
    A context manager.
  """
  return _attribute_held("scan", jax.lax, "scan", dispatch, ORIGINAL_SCAN)


def collective_time(seconds: float) -> contextlib.AbstractContextManager[None]:
  """Tells XLA how long the collectives traced inside the block take.

  XLA's latency-hiding scheduler reads an instruction's ``latency_metadata`` frontend attribute
  (nanoseconds) in place of its own estimate; XLA:GPU's default estimator gives every collective
  the same latency otherwise. Compilers and estimators that do not read it ignore it.

  Args:
    seconds: the collectives' duration.

  Returns:
    A context manager (``jax.experimental.xla_metadata.set_xla_metadata``).
  """
  return set_xla_metadata(latency_metadata=str(max(1, round(seconds * 1e9))))


def compute_on_host(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` computed on the host (XLA's ``device_host`` compute type) inside a step, its
  outputs in pinned host memory.

  ``jax.experimental.compute_on.compute_on`` was a context manager over a jitted call until
  jax 0.11, which made it a function transformation that also takes the outputs' memory space.

  Args:
    fn: the function, traced as it is called.

  Returns:
    A function of the same arguments.
  """
  if JAX_VERSION < (0, 11):
    def on_host(*args: Any) -> Any:
      with compute_on("device_host"):
        return jax.jit(fn)(*args)
    return on_host
  return compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(fn)


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


def source_line(eqn: Any) -> str:
  """Where the user's code bound ``eqn`` (``file:line (function)``), for a warning to name."""
  summarize = _FOUND["source_summary"]
  return summarize(eqn.source_info) if summarize is not None else "an unknown line"


def bind_dot_general(a: Any, b: Any, params: dict[str, Any]) -> Any:
  """``dot_general`` of ``a`` and ``b`` with a traced equation's own parameters (precision and
  preferred element type included, which ``jax.lax.dot_general``'s signature renames)."""
  return jax.lax.dot_general_p.bind(a, b, **params)


def without_cache_writes() -> contextlib.AbstractContextManager[Any]:
  """Compiles inside the block, in this thread, write nothing to JAX's persistent cache.

  An executable compiled for a compile-only topology cannot be loaded back without that
  accelerator's client: stored, it would only make the next run warn and compile again.
  JAX decides once per process whether it uses the cache, so its on/off switch cannot be
  scoped; the minimum compile time worth storing can.

  Returns:
    A context manager (JAX's thread-local ``jax_persistent_cache_min_compile_time_secs``
    set to infinity).
  """
  return _FOUND["persistent_cache_min_compile_time_secs"](float("inf"))


def _lookup(paths: tuple[str, ...]) -> tuple[Any, str | None]:
  """The first of ``paths`` (``"module:attr.attr"``) this JAX has, and that path; ``(None,
  None)`` if it has none. Modules are imported here, so a moved one is a miss, not an error."""
  import importlib
  for path in paths:
    module, _, attrs = path.partition(":")
    try:
      obj = importlib.import_module(module)
      for a in attrs.split("."):
        obj = getattr(obj, a)
    except (ImportError, AttributeError):
      continue
    return obj, path
  return None, None


# Every JAX internal zerojax uses, with where to find it on each supported release (0.10.2 to
# 0.12.x), public API first: the first path this JAX has is used (`INTERNALS` says which).
INTERNAL_PATHS: dict[str, tuple[str, ...]] = {
    "name_p": ("jax.extend.core.primitives:name_p", "jax._src.ad_checkpoint:name_p"),
    "sharding_constraint_p": ("jax.extend.core.primitives:sharding_constraint_p",
                              "jax._src.pjit:sharding_constraint_p"),
    "backends_are_initialized": ("jax._src.xla_bridge:backends_are_initialized",),
    "distributed_state": ("jax._src.distributed:global_state",),
    "auto_detect_cluster": (
        "jax._src.clusters:ClusterEnv.auto_detect_unset_distributed_params",),
    "trace_ctx": ("jax._src.core:trace_ctx",),
    "source_summary": ("jax._src.source_info_util:summarize",),
    "user_context": ("jax._src.source_info_util:user_context",),
    "current_name_stack": ("jax._src.source_info_util:current_name_stack",),
    "persistent_cache_min_compile_time_secs": (
        "jax._src.config:persistent_cache_min_compile_time_secs",),
}
# The path each internal was found at on this JAX, or None (`INTERNAL_PATHS`).
INTERNALS: dict[str, str | None] = {}
_FOUND: dict[str, Any] = {}
for _name, _paths in INTERNAL_PATHS.items():
  _FOUND[_name], INTERNALS[_name] = _lookup(_paths)

# The primitives the stage-3 remat policy looks at (the policy API hands it primitives): without
# them gathered weights would silently be kept, so a release that moves them fails here.
name_p, sharding_constraint_p = _FOUND["name_p"], _FOUND["sharding_constraint_p"]
if name_p is None or sharding_constraint_p is None:  # pragma: no cover - depends on the JAX
  raise ImportError(
      f"zerojax {__name__}: this JAX ({jax.__version__}) has the primitives zerojax's stage-3 "
      f"remat policy must recognise (name_p, sharding_constraint_p) at none of "
      f"{INTERNAL_PATHS['name_p'] + INTERNAL_PATHS['sharding_constraint_p']}; zerojax supports "
      "jax 0.10.2 to 0.12.x")

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
  query = _FOUND["backends_are_initialized"]
  return bool(query()) if query is not None else False


def distributed_state() -> Any:
  """JAX's distributed-runtime state (``process_id``, ``num_processes``,
  ``coordinator_address``, ``client``: the coordination service's key-value store), or
  ``None`` where this JAX keeps it elsewhere (callers then use public APIs only)."""
  return _FOUND["distributed_state"]


def detect_cluster(coordinator: Any, num_processes: Any, process_id: Any, local_device_ids: Any,
                   method: Any, timeout: Any) -> tuple[Any, Any, Any, Any]:
  """JAX's own scheduler detection (SLURM, Open MPI, Kubernetes, TPU) for the settings still
  unset, as ``jax.distributed.initialize`` does it; the settings unchanged where this JAX does
  not expose it."""
  detect = _FOUND["auto_detect_cluster"]
  if detect is None:  # pragma: no cover - depends on the installed JAX
    return coordinator, num_processes, process_id, local_device_ids
  return detect(coordinator, num_processes, process_id, local_device_ids, method, timeout)


def eval_jaxpr(closed: Any, args: list[Any],
               rewrite: Callable[[Any, list[Any]], list[Any] | None]) -> list[Any]:
  """Evaluates a closed jaxpr on ``args`` (tracers welcome), as ``jax.core.eval_jaxpr`` does,
  except that ``rewrite(eqn, invals)`` may answer an equation itself (its outputs as a list);
  ``None`` binds the equation as written. Only top-level equations are offered."""
  jaxpr = closed.jaxpr
  env: dict[Any, Any] = {}
  env.update(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, args))
  eval_eqns(jaxpr.eqns, env, rewrite)
  return [read_var(env, v) for v in jaxpr.outvars]


def read_var(env: dict[Any, Any], v: Any) -> Any:
  """A jaxpr variable's value in ``env``, or a literal's own."""
  return v.val if isinstance(v, Literal) else env[v]


def eval_eqns(eqns: Any, env: dict[Any, Any],
              rewrite: Callable[[Any, list[Any]], list[Any] | None] | None = None) -> None:
  """Evaluates ``eqns`` in order, reading their inputs from ``env`` (``{Var: value}``) and
  writing their outputs to it; ``rewrite`` as in `eval_jaxpr`."""
  for eqn in eqns:
    invals = [read_var(env, v) for v in eqn.invars]
    outs = rewrite(eqn, invals) if rewrite is not None else None
    if outs is None:
      outs = bind_eqn(eqn, invals)
    env.update(zip(eqn.outvars, outs))


def bind_eqn(eqn: Any, invals: list[Any], **changes: Any) -> list[Any]:
  """Binds ``eqn``'s primitive on ``invals`` with its own parameters, ``changes`` laid over
  them, as ``jax.core.eval_jaxpr`` binds it: under the equation's name stack (the model's
  module path, which names its operations in the compiled program and in profiles), source
  location and context. Returns the outputs as a list."""
  ctx = getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext()
  user, current = _FOUND["user_context"], _FOUND["current_name_stack"]
  source = getattr(eqn, "source_info", None)
  where = (user(source.traceback, name_stack=current() + source.name_stack)
           if user is not None and current is not None and source is not None
           else contextlib.nullcontext())
  with where, ctx:
    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(
        {**eqn.params, **changes}))
  return outs if eqn.primitive.multiple_results else [outs]


# -- checkpoints -------------------------------------------------------------------------------

def checkpoint_trace() -> Any | None:
  """The running trace (its ``jax.extend.core.get_opaque_trace_state``) when it traces the
  body of a ``jax.checkpoint`` (``nn.remat``), else ``None``. JAX names what a trace is for
  only in its internal debug info; without it this says ``None``."""
  try:
    traced_for = _FOUND["trace_ctx"].trace.frame.debug_info.traced_for
  except AttributeError:  # pragma: no cover - depends on the installed JAX
    return None
  if not isinstance(traced_for, str) or "checkpoint" not in traced_for:
    return None
  return get_opaque_trace_state()


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
