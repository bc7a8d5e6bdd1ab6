"""The cross-process agreement check: every process of a run must hold the same config, plan,
optimizer and versions, or the first collective hangs or computes garbage.

`fingerprint` is what one process holds; `check_agreement` exchanges the fingerprints through
the distributed runtime's key-value store (never a device collective) and raises
`ProcessMismatchError` on every process, naming each differing field.
"""

from __future__ import annotations

import functools
import json
import numbers
import time
from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from zerojax._compat import distributed_state
from zerojax.core.launch_env import (DEFAULT_AGREEMENT_TIMEOUT, ENV_AGREEMENT_TIMEOUT,
                                     DistributedInitError, first_line, timeout_seconds)

# `wait_for_peers_to_report` is for `zerojax.core.distributed`'s exit hook, not public.
__all__ = ["ProcessMismatchError", "fingerprint", "check_agreement", "mismatches", "exchange"]


class ProcessMismatchError(RuntimeError):
  """The processes of one run disagree on the config, the plan, the optimizer or versions.

  Attributes:
    fields: ``{field: [value of process 0, value of process 1, ...]}`` of the differing fields.
  """

  def __init__(self, message: str, fields: dict[str, list[Any]]):
    super().__init__(message)
    self.fields = fields


_agreement_calls = 0


def fingerprint(config: Any = None, plan: Any = None, *, tx: Any = None, state: Any = None,
                extra: dict[str, Any] | None = None,
                fields: dict[str, Any] | None = None) -> dict[str, Any]:
  """``{field: value}``: what every process of a run must agree on (JSON-able values).

  Holds the process count, the jax/jaxlib/flax/optax/zerojax versions, every `ZeroConfig`
  field, the plan's mesh and every leaf's path, shape, dtype, spec and memory kind, the
  optimizer's hyperparameters that can be read (``optax.inject_hyperparams`` values in
  ``state.opt_state``, and the numbers and strings ``tx``'s functions close over, such as a
  constant learning rate), ``extra`` (as ``extra.KEY``) and ``fields`` (under their own names,
  e.g. ``train.steps``).

  Args:
    config: the run's `ZeroConfig` (each field becomes ``config.NAME``).
    plan: the run's `ShardingPlan` (its mesh and every leaf's layout).
    tx: the optax transformation, whose closed-over numbers and strings are compared.
    state: a train state (or optimizer state) whose ``inject_hyperparams`` values are
      compared.
    extra: further values, compared as ``extra.KEY``.
    fields: further values, compared under their own names.

  Returns:
    ``{field: value}`` with JSON-able values.
  """
  fp: dict[str, Any] = {"process_count": jax.process_count()}
  for mod in ("jax", "jaxlib", "flax", "optax", "zerojax"):
    try:
      fp[f"version.{mod}"] = getattr(__import__(mod), "__version__", "?")
    except ImportError:
      fp[f"version.{mod}"] = None
  if config is not None:
    for k, v in _dotted(config.to_dict()).items():  # each policy field on its own
      fp[f"config.{k}"] = _jsonable(v)
  if plan is not None:
    fp["mesh"] = [[str(k), int(v)] for k, v in plan.mesh.shape.items()]  # ordered
    for lp, s, g in zip(plan.leaves, jax.tree.leaves(plan.params),
                        jax.tree.leaves(plan.grads)):
      fp[f"plan.params/{lp.path}"] = (
          f"{tuple(lp.shape)} {_dtype_name(lp.dtype)} {s.spec} "
          f"{getattr(s, 'memory_kind', None) or 'device'}, grads {g.spec}")
    for (path, shape, dtype, _), s in zip(plan.opt_leaves, jax.tree.leaves(plan.opt_state)):
      fp[f"plan.opt_state/{path}"] = (f"{tuple(shape)} {_dtype_name(dtype)} {s.spec} "
                                      f"{getattr(s, 'memory_kind', None) or 'device'}")
  if tx is not None:
    for k, v in _closure_values(tx).items():
      fp[f"optimizer.{k}"] = v
  if state is not None:
    for k, v in _injected_hyperparams(getattr(state, "opt_state", state)).items():
      fp[f"optimizer.hyperparams.{k}"] = v
  for k, v in (extra or {}).items():
    fp[f"extra.{k}"] = _jsonable(v)
  for k, v in (fields or {}).items():
    fp[k] = _jsonable(v)
  return fp


def check_agreement(config: Any = None, plan: Any = None, *, tx: Any = None,
                    state: Any = None, extra: dict[str, Any] | None = None,
                    fields: dict[str, Any] | None = None,
                    timeout: float | None = None) -> dict[str, Any]:
  """Checks that every process of the run has the same `fingerprint`; call it before the
  first step (`zerojax.zero_step` does on its first call, and so does the training loop).

  The fingerprints go through the distributed runtime's key-value store, never through a
  device collective: processes with different shardings would hang in one. A single-process
  run returns at once.

  Args:
    config: the run's `ZeroConfig` (see `fingerprint`).
    plan: the run's `ShardingPlan`.
    tx: the optax transformation.
    state: the train state (or optimizer state).
    extra: further values, compared as ``extra.KEY``.
    fields: further values, compared under their own names.
    timeout: seconds to wait for the other processes' fingerprints (default
      ``ZEROJAX_AGREEMENT_TIMEOUT`` or 120).

  Returns:
    This process's fingerprint.

  Raises:
    ProcessMismatchError: on every process, naming each differing field and its value per
      process.
    DistributedInitError: a process did not send its fingerprint within ``timeout``.
  """
  global _agreement_calls
  fp = fingerprint(config, plan, tx=tx, state=state, extra=extra, fields=fields)
  if jax.process_count() == 1:
    return fp
  timeout = timeout_seconds(timeout, ENV_AGREEMENT_TIMEOUT, DEFAULT_AGREEMENT_TIMEOUT)
  _agreement_calls += 1
  key = f"zerojax/agreement/{_agreement_calls}"
  me, n = jax.process_index(), jax.process_count()
  everyone = _exchange(key, json.dumps(fp, sort_keys=True), me, n, timeout)
  diff = mismatches([json.loads(v) for v in everyone])
  if diff:
    shown = list(diff.items())[:8]
    more = f"\n  ... and {len(diff) - 8} more fields" if len(diff) > 8 else ""
    lines = "\n".join(f"  {field}: " + ", ".join(f"process {i}: {v!r}"
                                                   for i, v in enumerate(values))
                       for field, values in shown)
    raise ProcessMismatchError(
        f"zerojax: the {n} processes of this run disagree on {len(diff)} field(s) (process "
        f"{me} reporting; every process raises this); they must run the same config, model, "
        f"optimizer and versions:\n{lines}{more}", diff)
  return fp


def mismatches(fingerprints: list[dict[str, Any]]) -> dict[str, list[Any]]:
  """The fields on which the processes' fingerprints differ.

  Args:
    fingerprints: one `fingerprint` per process, in process order.

  Returns:
    ``{field: [value of process 0, value of process 1, ...]}`` (``'<missing>'`` where a
    process lacks the field), in the order the error lists them.
  """
  diff = {}
  for field in sorted(set().union(*fingerprints), key=_field_order):
    values = [f.get(field, "<missing>") for f in fingerprints]
    if any(v != values[0] for v in values[1:]):
      diff[field] = values
  return diff


_exchange_calls: dict[str, int] = {}


def exchange(name: str, value: str, timeout: float | None = None) -> list[str]:
  """Every process's ``value``, in process order, through the coordination service's
  key-value store (never a device collective); call it on every process, in the same order.
  Process 0 returns only after every other process has read every value, so it may act on
  them (and exit) at once. A single-process run returns ``[value]``.

  Args:
    name: what is exchanged (a key prefix; each call under one name gets its own key).
    value: this process's value.
    timeout: seconds to wait for the others (default ``ZEROJAX_AGREEMENT_TIMEOUT`` or 120).

  Returns:
    The values of processes ``0 .. n - 1``.

  Raises:
    DistributedInitError: a process did not send its value within ``timeout``.
  """
  if jax.process_count() == 1:
    return [value]
  timeout = timeout_seconds(timeout, ENV_AGREEMENT_TIMEOUT, DEFAULT_AGREEMENT_TIMEOUT)
  _exchange_calls[name] = _exchange_calls.get(name, 0) + 1
  return _exchange(f"zerojax/exchange/{name}/{_exchange_calls[name]}", value,
                   jax.process_index(), jax.process_count(), timeout, what=repr(name))


def _field_order(field: str) -> tuple[int, str]:
  for i, prefix in enumerate(("process_count", "version.", "config.", "mesh", "optimizer.",
                              "plan.params/", "plan.opt_state/", "extra.")):
    if field.startswith(prefix):
      return i, field
  return 99, field


def _exchange(key: str, value: str, me: int, n: int, timeout: float,
              what: str = "config fingerprint") -> list[str]:
  """Every process's ``value`` (in process order), through the coordination service's
  key-value store: a blocking get with a deadline, so a mismatch cannot hang it."""
  client = _kv_client()
  if client is None:  # no key-value store: a small replicated all-gather of the bytes
    return _exchange_by_allgather(value, n)
  def get_all(suffix: str, what: str, ids) -> list[str]:
    out = []
    for i in ids:
      try:
        out.append(client.blocking_key_value_get(f"{key}/{suffix}{i}", int(timeout * 1000)))
      except Exception as e:  # noqa: BLE001 - a deadline or a dead peer
        raise DistributedInitError(
            f"zerojax: process {me} of {n} waited {timeout:g}s ({ENV_AGREEMENT_TIMEOUT}) for "
            f"process {i}'s {what}: did it start with num_processes={n}, and does it call the "
            f"same step? Cause: {type(e).__name__}: {first_line(e)}") from e
    return out

  client.key_value_set(f"{key}/{me}", value)
  out = get_all("", what, range(n))
  # Process 0 hosts the coordination service: it acts on the result (an error may end it at
  # once) only after every other process has read every fingerprint.
  if me != 0:
    try:
      client.key_value_set(f"{key}/read/{me}", "1")
    except Exception:  # noqa: BLE001 - process 0 may act on the acknowledgement, and exit,
      pass  # before its reply arrives ("Socket closed"); every fingerprint is already read
  else:
    get_all("read/", "acknowledgement", range(1, n))
  return out


def _kv_client():
  """JAX's distributed-runtime client (`zerojax._compat.distributed_state`), or ``None`` if
  this JAX does not expose it."""
  client = getattr(distributed_state(), "client", None)
  if client is None or not all(hasattr(client, m) for m in ("key_value_set",
                                                              "blocking_key_value_get")):
    return None
  return client


def _exchange_by_allgather(value: str, n: int) -> list[str]:
  data = np.frombuffer(value.encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64)))
  buf = np.zeros(int(sizes.max()), np.uint8)
  buf[:data.size] = data
  every = np.asarray(multihost_utils.process_allgather(buf))
  return [bytes(every[i, :int(sizes.reshape(-1)[i])]).decode() for i in range(n)]


def _dtype_name(dtype: Any) -> str:
  try:
    return np.dtype(dtype).name
  except TypeError:
    return str(dtype)


def _dotted(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """A nested mapping with dotted keys: ``{'precision': {'param': x}}`` -> ``{'precision.param': x}``."""
  out: dict[str, Any] = {}
  for k, v in d.items():
    if isinstance(v, Mapping):
      out.update(_dotted(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _jsonable(v: Any) -> Any:
  try:
    json.dumps(v)
    return v
  except (TypeError, ValueError):
    return repr(v)


def _closure_values(obj: Any, prefix: str = "", depth: int = 0, seen: set | None = None
                    ) -> dict[str, Any]:
  """Numbers, strings and small arrays reachable from an optax transformation's functions
  (closure cells, ``functools.partial`` arguments, nested transformations), by path."""
  seen = set() if seen is None else seen
  out: dict[str, Any] = {}
  if depth > 12 or id(obj) in seen:
    return out
  if isinstance(obj, bool) or obj is None or isinstance(obj, str):
    out[prefix or "value"] = obj
    return out
  if isinstance(obj, numbers.Number):
    out[prefix or "value"] = float(obj) if isinstance(obj, numbers.Real) else repr(obj)
    return out
  if isinstance(obj, np.ndarray) or type(obj).__module__.startswith("jax"):
    try:
      a = np.asarray(obj)
      if a.size <= 16 and a.dtype.kind in "biuf":
        out[prefix or "value"] = a.tolist()
    except Exception:  # noqa: BLE001 - not addressable here: not compared
      pass
    return out
  seen.add(id(obj))
  join = (lambda k: f"{prefix}.{k}" if prefix else str(k))
  if isinstance(obj, functools.partial):
    out.update(_closure_values(obj.func, join("func"), depth + 1, seen))
    for i, a in enumerate(obj.args):
      out.update(_closure_values(a, join(i), depth + 1, seen))
    for k, a in obj.keywords.items():
      out.update(_closure_values(a, join(k), depth + 1, seen))
  elif isinstance(obj, dict):
    for k, a in obj.items():
      out.update(_closure_values(a, join(k), depth + 1, seen))
  elif isinstance(obj, (tuple, list)):
    names = getattr(obj, "_fields", None) or range(len(obj))
    for k, a in zip(names, obj):
      out.update(_closure_values(a, join(k), depth + 1, seen))
  elif callable(obj) and hasattr(obj, "__code__"):
    cells = obj.__closure__ or ()
    for name, cell in zip(obj.__code__.co_freevars, cells):
      try:
        v = cell.cell_contents
      except ValueError:  # an empty cell
        continue
      out.update(_closure_values(v, join(name), depth + 1, seen))
  return out


def _injected_hyperparams(opt_state: Any) -> dict[str, Any]:
  """``optax.inject_hyperparams`` values found in an optimizer state, by path."""
  out: dict[str, Any] = {}

  def visit(x, path):
    hp = getattr(x, "hyperparams", None)
    if isinstance(hp, dict):
      for k, v in hp.items():
        try:
          a = v.addressable_data(0) if hasattr(v, "addressable_data") else v
          out[f"{path}{k}"] = np.asarray(jax.device_get(a)).tolist()
        except Exception:  # noqa: BLE001 - not readable here: not compared
          pass
    if isinstance(x, (tuple, list)):
      for i, y in enumerate(x):
        visit(y, f"{path}{i}.")

  visit(opt_state, "")
  return out


_REPORTED_GRACE = 30.0


def wait_for_peers_to_report(pid: int, nproc: int) -> None:
  """A `ProcessMismatchError` is raised on every process. Process 0 hosts the coordination
  service, and when it exits JAX aborts every other process at once, so process 0 waits (at
  most ``_REPORTED_GRACE`` s) until the others have printed their own error."""
  client = _kv_client()
  if client is None:
    return
  try:
    if pid != 0:
      client.key_value_set(f"zerojax/reported/{pid}", "1")
      return
    deadline = time.monotonic() + _REPORTED_GRACE
    for i in range(1, nproc):
      left = deadline - time.monotonic()
      if left <= 0:
        return
      client.blocking_key_value_get(f"zerojax/reported/{i}", int(left * 1000))
  except Exception:  # noqa: BLE001 - a peer already gone: nothing left to wait for
    return
