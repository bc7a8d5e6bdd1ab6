"""Multi-process start-up: a thin, safe layer over ``jax.distributed.initialize``.

zerojax runs on JAX's own multi-controller runtime: every process runs the same program, owns
its local devices, and XLA's collectives (NCCL on GPU, ICI on TPU, gloo on CPU) connect them.
Nothing else in zerojax changes with the process count: `zerojax.make_mesh` builds the mesh
over all devices of all processes and the decorated step is the same program everywhere.

`initialize` resolves where the coordinator is and who this process is, in this order:

1. explicit arguments;
2. zerojax's environment variables (set by ``python -m zerojax.tools.launch`` or by hand):
   ``ZEROJAX_COORDINATOR_ADDRESS``, ``ZEROJAX_NUM_PROCESSES``, ``ZEROJAX_PROCESS_ID``;
3. JAX's own variables: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
   ``JAX_PROCESS_ID``;
4. JAX's cluster auto-detection (SLURM, Open MPI, Kubernetes indexed Jobs, Cloud TPU), which
   also fills whatever 1-3 left unset.

If nothing names more than one process, the run is single-process and `initialize` does not
start the distributed runtime at all, so the same script runs with 1 process and with N.

Timeouts (seconds; argument, else environment variable, else default):

============================  ===============================  =======  =======================
argument                      environment                      default  JAX parameter
============================  ===============================  =======  =======================
``initialization_timeout``    ``ZEROJAX_INIT_TIMEOUT``         300      initialization_timeout
``heartbeat_timeout``         ``ZEROJAX_HEARTBEAT_TIMEOUT``    100      heartbeat_timeout_seconds
``shutdown_timeout``          ``ZEROJAX_SHUTDOWN_TIMEOUT``     300      shutdown_timeout_seconds
============================  ===============================  =======  =======================

``initialization_timeout`` bounds the wait for the coordinator (an unreachable one raises
`DistributedInitError` naming its address); ``heartbeat_timeout`` is how long the coordination
service waits for a silent process before it declares the process dead and fails every other
process, so a crashed peer never leaves the others hanging.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import numbers
import os
import socket
import sys
import threading
import time
from typing import Any, Sequence

import numpy as np

# JAX, and zerojax._compat which imports it, are imported inside the functions that use them:
# the launcher (zerojax.tools.launch) imports this module's ENV_* names and starts without JAX.

__all__ = ["ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "ENV_CPU_DEVICES",
           "ENV_INIT_TIMEOUT", "ENV_HEARTBEAT_TIMEOUT", "ENV_SHUTDOWN_TIMEOUT",
           "DEFAULT_INIT_TIMEOUT", "DEFAULT_HEARTBEAT_TIMEOUT", "DEFAULT_SHUTDOWN_TIMEOUT",
           "DistributedInitError", "DistributedInfo", "initialize", "ProcessMismatchError",
           "ENV_AGREEMENT_TIMEOUT", "DEFAULT_AGREEMENT_TIMEOUT", "fingerprint",
           "check_agreement", "info", "shutdown"]

ENV_COORDINATOR = "ZEROJAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "ZEROJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROJAX_PROCESS_ID"
ENV_CPU_DEVICES = "ZEROJAX_CPU_DEVICES"
ENV_INIT_TIMEOUT = "ZEROJAX_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "ZEROJAX_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "ZEROJAX_SHUTDOWN_TIMEOUT"

DEFAULT_INIT_TIMEOUT = 300
DEFAULT_HEARTBEAT_TIMEOUT = 100
DEFAULT_SHUTDOWN_TIMEOUT = 300


class DistributedInitError(RuntimeError):
  """The distributed runtime could not start (unreachable coordinator, bad settings)."""


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
  """Who this process is in the run.

  Attributes:
    process_id: this process's index, ``0 .. num_processes - 1``.
    num_processes: processes in the run (1: the distributed runtime is not started).
    coordinator_address: ``host:port`` of the coordination service (``None`` when single).
    source: where the settings came from: ``'arguments'``, ``'zerojax-env'``, ``'jax-env'``,
      ``'cluster'`` (JAX auto-detection), ``'single'`` or ``'already-initialized'``.
  """

  process_id: int
  num_processes: int
  coordinator_address: str | None
  source: str

  @property
  def is_multiprocess(self) -> bool:
    return self.num_processes > 1

  @property
  def is_coordinator(self) -> bool:
    return self.process_id == 0


_info: DistributedInfo | None = None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *,
               local_device_ids: int | Sequence[int] | None = None,
               cluster_detection_method: str | None = None,
               initialization_timeout: float | None = None, heartbeat_timeout: float | None = None,
               shutdown_timeout: float | None = None, cpu_devices: int | None = None,
               cpu_collectives: str | None = "gloo", timeout: float | None = None,
               exit_on_error: bool = True) -> DistributedInfo:
  """Starts JAX's distributed runtime for this process (or notes a single-process run).

  Call it first, before anything that touches devices (``jax.devices()``, any computation).
  Calling it again returns the same `DistributedInfo` and does nothing else.

  Args:
    coordinator_address: ``host:port`` of process 0's coordination service.
    num_processes: number of processes in the run.
    process_id: this process's index.
    local_device_ids: restrict this process to these local devices (GPU: one per process).
    cluster_detection_method: force one of JAX's cluster detectors (``'slurm'``, ``'ompi'``,
      ``'mpi4py'``, ``'k8s'``...), or ``'deactivate'`` to disable auto-detection.
    initialization_timeout: seconds to wait for the coordinator and all processes to connect.
    heartbeat_timeout: seconds without a heartbeat after which a process counts as dead and
      the others fail.
    shutdown_timeout: seconds a finishing process waits for the others at exit.
    cpu_devices: number of CPU devices of this process (CPU backend only; also
      ``ZEROJAX_CPU_DEVICES``).
    cpu_collectives: cross-process collectives of the CPU backend (``'gloo'`` or ``'mpi'``);
      ``None`` keeps JAX's setting.
    timeout: the same as ``initialization_timeout`` (seconds to wait at start-up; progress is
      printed meanwhile).
    exit_on_error: in a multi-process run, an uncaught exception prints its traceback and ends
      the process at once (``os._exit(1)``) instead of waiting at JAX's shutdown barrier for
      peers that may be dead (up to ``shutdown_timeout``, then an abort).

  Returns:
    The `DistributedInfo` of this process.

  Raises:
    DistributedInitError: the coordinator was not reached within ``initialization_timeout``,
      the settings are inconsistent, or JAX's backend was already started by an earlier call.
  """
  global _info
  import jax  # late: see the note at the imports
  if _info is not None or jax.distributed.is_initialized():
    info = _info or _running_info()
    _check_same(info, coordinator_address, num_processes, process_id)
    _info = info
    return info
  s = _settings(coordinator_address, num_processes, process_id, local_device_ids,
                cluster_detection_method, initialization_timeout, heartbeat_timeout,
                shutdown_timeout, cpu_devices, timeout)
  if s.nproc is None or s.nproc <= 1:
    _info = _single_process(s.cpu_devices)
    return _info
  _check_can_start(s)
  _configure_cpu_backend(cpu_collectives, s.cpu_devices)
  _join(s)
  _info = DistributedInfo(s.pid, s.nproc, s.coord, s.source)
  if exit_on_error:
    _install_exit_on_error(s.pid, s.nproc)
  return _info


# -- start-up steps -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Settings:
  """What `initialize` resolved: the coordinator, this process, its devices and timeouts."""

  coord: str | None
  nproc: int | None
  pid: int | None
  source: str
  local_device_ids: Any
  init_t: float
  beat_t: float
  down_t: float
  cpu_devices: int | None


def _settings(coordinator_address, num_processes, process_id, local_device_ids,
              cluster_detection_method, initialization_timeout, heartbeat_timeout,
              shutdown_timeout, cpu_devices, timeout) -> _Settings:
  """Resolves `initialize`'s arguments against the environment and the cluster."""
  if timeout is not None:
    if initialization_timeout is not None and initialization_timeout != timeout:
      raise DistributedInitError(f"zerojax.core.distributed.initialize: timeout={timeout!r} and "
                                 f"initialization_timeout={initialization_timeout!r} differ; "
                                 "they are the same setting, pass one")
    initialization_timeout = timeout
  coord, nproc, pid, source = _resolve(coordinator_address, num_processes, process_id,
                                       cluster_detection_method)
  if local_device_ids is None and source == "cluster":
    local_device_ids = _detected_local_device_ids(cluster_detection_method)
  init_t = _timeout(initialization_timeout, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT)
  beat_t = _timeout(heartbeat_timeout, ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT)
  down_t = _timeout(shutdown_timeout, ENV_SHUTDOWN_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT)
  cpu_devices = cpu_devices if cpu_devices is not None else _env_int(ENV_CPU_DEVICES)
  return _Settings(coord, nproc, pid, source, local_device_ids, init_t, beat_t, down_t,
                   cpu_devices)


def _single_process(cpu_devices: int | None) -> DistributedInfo:
  """A single-process run: nothing to start, only the CPU device count to set."""
  import jax  # late: see the note at the imports
  from zerojax._compat import backends_initialized  # late: see the note at the imports
  if cpu_devices is not None and not backends_initialized():
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  return DistributedInfo(0, 1, None, "single")


def _check_can_start(s: _Settings) -> None:
  """Refuses settings JAX would fail on later or less clearly."""
  from zerojax._compat import backends_initialized  # late: see the note at the imports
  if s.pid is None:
    raise DistributedInitError(
        f"zerojax.core.distributed.initialize: {s.nproc} processes but no process id; pass "
        f"process_id= or set {ENV_PROCESS_ID}")
  if s.coord is None:
    raise DistributedInitError(
        f"zerojax.core.distributed.initialize: {s.nproc} processes but no coordinator address; "
        f"pass coordinator_address='host:port' or set {ENV_COORDINATOR}")
  _split_address(s.coord)  # JAX itself fails on a missing port with a bare IndexError
  if not 0 <= s.pid < s.nproc:
    raise DistributedInitError(f"process id {s.pid} is not in 0..{s.nproc - 1}")
  if backends_initialized():
    raise DistributedInitError(
        "zerojax.core.distributed.initialize must run before JAX starts its backend (before "
        "jax.devices(), any computation, or zerojax.make_mesh); move the call to the top of "
        "the program")


def _configure_cpu_backend(cpu_collectives: str | None, cpu_devices: int | None) -> None:
  """The CPU backend's cross-process collectives and device count, set before it starts."""
  import jax  # late: see the note at the imports
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  if cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", cpu_devices)


def _join(s: _Settings) -> None:
  """Starts JAX's distributed runtime; a failure is a `DistributedInitError` naming why."""
  import jax  # late: see the note at the imports
  t0 = time.monotonic()
  if s.pid != 0:
    # JAX's client aborts the process (a C++ fatal error, not an exception) when the
    # coordinator cannot be reached: probe it first so the failure is a Python error.
    _wait_for_coordinator(s.coord, s.init_t, s.pid, s.nproc)
  # Past the probe, a peer that never shows up still makes JAX abort at the deadline; say why
  # just before that happens.
  remaining = max(1.0, s.init_t - (time.monotonic() - t0))
  done = threading.Event()
  watchdog = threading.Thread(target=_report_waiting,
                              args=(done, t0, s.coord, s.pid, s.nproc, s.init_t),
                              daemon=True, name="zerojax-init-progress")
  watchdog.start()
  try:
    jax.distributed.initialize(
        coordinator_address=s.coord, num_processes=s.nproc, process_id=s.pid,
        local_device_ids=s.local_device_ids,
        cluster_detection_method="deactivate",  # already resolved by _settings
        initialization_timeout=max(1, int(round(remaining))),
        heartbeat_timeout_seconds=max(1, int(round(s.beat_t))),
        shutdown_timeout_seconds=max(1, int(round(s.down_t))))
  except Exception as e:  # noqa: BLE001 - re-raised with the address and the knobs
    _reset()
    waited = time.monotonic() - t0
    raise DistributedInitError(
        f"zerojax: process {s.pid} of {s.nproc} could not join the coordinator at {s.coord!r} "
        f"(gave up after {waited:.1f}s; initialization_timeout={s.init_t:g}s, set by argument "
        f"or {ENV_INIT_TIMEOUT}). Check that process 0 is running and that {s.coord!r} is "
        f"reachable from this host. Cause: {type(e).__name__}: {_first_line(e)}") from e
  finally:
    done.set()


class ProcessMismatchError(RuntimeError):
  """The processes of one run disagree on the config, the plan, the optimizer or versions.

  Attributes:
    fields: ``{field: [value of process 0, value of process 1, ...]}`` of the differing fields.
  """

  def __init__(self, message: str, fields: dict[str, list[Any]]):
    super().__init__(message)
    self.fields = fields


ENV_AGREEMENT_TIMEOUT = "ZEROJAX_AGREEMENT_TIMEOUT"
DEFAULT_AGREEMENT_TIMEOUT = 120
_agreement_calls = 0


def fingerprint(config: Any = None, plan: Any = None, *, tx: Any = None, state: Any = None,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
  """``{field: value}``: what every process of a run must agree on (JSON-able values).

  Holds the process count, the jax/jaxlib/flax/optax/zerojax versions, every `ZeroConfig`
  field, the plan's mesh and every leaf's path, shape, dtype, spec and memory kind, the
  optimizer's hyperparameters that can be read (``optax.inject_hyperparams`` values in
  ``state.opt_state``, and the numbers and strings ``tx``'s functions close over, such as a
  constant learning rate), and ``extra``.
  """
  import jax  # late: see the note at the imports
  fp: dict[str, Any] = {"process_count": jax.process_count()}
  for mod in ("jax", "jaxlib", "flax", "optax", "zerojax"):
    try:
      fp[f"version.{mod}"] = getattr(__import__(mod), "__version__", "?")
    except ImportError:
      fp[f"version.{mod}"] = None
  if config is not None:
    for k, v in config.to_dict().items():
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
  return fp


def check_agreement(config: Any = None, plan: Any = None, *, tx: Any = None,
                    state: Any = None, extra: dict[str, Any] | None = None,
                    timeout: float | None = None) -> dict[str, Any]:
  """Checks that every process of the run has the same `fingerprint`; call it before the
  first step (`zerojax.zero_step` does on its first call, and so does the training loop).

  The fingerprints go through the distributed runtime's key-value store, never through a
  device collective: processes with different shardings would hang in one. A single-process
  run returns at once.

  Args:
    config, plan, tx, state, extra: what to compare (see `fingerprint`).
    timeout: seconds to wait for the other processes' fingerprints (default
      ``ZEROJAX_AGREEMENT_TIMEOUT`` or 120).

  Returns:
    this process's fingerprint.

  Raises:
    ProcessMismatchError: on every process, naming each differing field and its value per
      process.
    DistributedInitError: a process did not send its fingerprint within ``timeout``.
  """
  global _agreement_calls
  import jax  # late: see the note at the imports
  fp = fingerprint(config, plan, tx=tx, state=state, extra=extra)
  if jax.process_count() == 1:
    return fp
  timeout = _timeout(timeout, ENV_AGREEMENT_TIMEOUT, DEFAULT_AGREEMENT_TIMEOUT)
  _agreement_calls += 1
  key = f"zerojax/agreement/{_agreement_calls}"
  me, n = jax.process_index(), jax.process_count()
  everyone = _exchange(key, json.dumps(fp, sort_keys=True), me, n, timeout)
  fps = [json.loads(v) for v in everyone]
  diff = {}
  for field in sorted(set().union(*fps), key=_field_order):
    values = [f.get(field, "<missing>") for f in fps]
    if any(v != values[0] for v in values[1:]):
      diff[field] = values
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


def _field_order(field: str) -> tuple[int, str]:
  for i, prefix in enumerate(("process_count", "version.", "config.", "mesh", "optimizer.",
                              "plan.params/", "plan.opt_state/", "extra.")):
    if field.startswith(prefix):
      return i, field
  return 99, field


def _exchange(key: str, value: str, me: int, n: int, timeout: float) -> list[str]:
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
            f"same step? Cause: {type(e).__name__}: {_first_line(e)}") from e
    return out

  client.key_value_set(f"{key}/{me}", value)
  out = get_all("", "config fingerprint", range(n))
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
  from zerojax._compat import distributed_state  # late: see the note at the imports
  client = getattr(distributed_state(), "client", None)
  if client is None or not all(hasattr(client, m) for m in ("key_value_set",
                                                              "blocking_key_value_get")):
    return None
  return client


def _exchange_by_allgather(value: str, n: int) -> list[str]:
  from jax.experimental import multihost_utils  # late: see the note at the imports
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
  import jax  # late: see the note at the imports
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


def info() -> DistributedInfo:
  """This process's `DistributedInfo` (single-process if `initialize` was never called)."""
  if _info is not None:
    return _info
  import jax  # late: see the note at the imports
  if jax.distributed.is_initialized():
    return _running_info()
  return DistributedInfo(0, 1, None, "single")


def shutdown() -> None:
  """Stops the distributed runtime if this module started it (safe to call always)."""
  global _info
  import jax  # late: see the note at the imports
  if jax.distributed.is_initialized():
    jax.distributed.shutdown()
  _info = None


# -- resolution ---------------------------------------------------------------------------------


def _resolve(coord, nproc, pid, method):
  source = "arguments" if coord is not None or nproc is not None or pid is not None else None
  for prefix, name in (("ZEROJAX", "zerojax-env"), ("JAX", "jax-env")):
    c = os.environ.get(f"{prefix}_COORDINATOR_ADDRESS") or None
    n = _env_int(f"{prefix}_NUM_PROCESSES")
    i = _env_int(f"{prefix}_PROCESS_ID")
    if (c, n, i) != (None, None, None) and source is None:
      source = name
    coord = coord if coord is not None else c
    nproc = nproc if nproc is not None else n
    pid = pid if pid is not None else i
  if method != "deactivate" and (nproc is None or nproc > 1) and None in (coord, nproc, pid):
    # JAX's own detectors (SLURM, Open MPI, Kubernetes, TPU) fill what is still unset.
    from zerojax._compat import detect_cluster  # late: see the note at the imports
    c, n, i, _ = detect_cluster(coord, nproc, pid, None, method,
                                _timeout(None, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT))
    if (c, n, i) != (coord, nproc, pid) and source is None:
      source = "cluster"
    coord, nproc, pid = c, n, i
  if nproc is None and coord is not None:
    raise DistributedInitError(
        f"zerojax.core.distributed.initialize: a coordinator ({coord!r}) is set but not the number "
        f"of processes; pass num_processes= or set {ENV_NUM_PROCESSES}")
  return coord, nproc, pid, source or "single"


def _detected_local_device_ids(method):
  """JAX's rule under a detected scheduler (SLURM, Open MPI): one device per process, the one
  of its local rank; ``None`` (all devices) elsewhere or when ``JAX_LOCAL_DEVICE_IDS`` is set."""
  if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
    return None
  from zerojax._compat import detect_cluster  # late: see the note at the imports
  return detect_cluster("unused:0", 0, 0, None, method, 1)[3]


def _running_info() -> DistributedInfo:
  from zerojax._compat import distributed_state  # late: see the note at the imports
  s = distributed_state()
  if s is None:  # pragma: no cover - depends on the installed JAX
    import jax  # late: see the note at the imports
    return DistributedInfo(jax.process_index(), jax.process_count(), None,
                           "already-initialized")
  return DistributedInfo(s.process_id, s.num_processes, s.coordinator_address,
                         "already-initialized")


def _check_same(info: DistributedInfo, coord, nproc, pid) -> None:
  for name, want, have in (("coordinator_address", coord, info.coordinator_address),
                           ("num_processes", nproc, info.num_processes),
                           ("process_id", pid, info.process_id)):
    if want is not None and want != have:
      raise DistributedInitError(
          f"zerojax.core.distributed.initialize was already called with {name}={have!r}; it cannot "
          f"be changed to {want!r} in a running process")


def _reset() -> None:
  """Forgets a half-started runtime so the error is the only effect of a failed call."""
  from zerojax._compat import distributed_state  # late: see the note at the imports
  s = distributed_state()
  if s is None:  # pragma: no cover - depends on the installed JAX
    return
  for attr in ("preemption_sync_manager", "client", "service"):
    obj = getattr(s, attr, None)
    if obj is not None and attr == "service":
      try:
        obj.shutdown()
      except Exception:  # noqa: BLE001
        pass
    setattr(s, attr, None)


def _split_address(address: str) -> tuple[str, int]:
  host, sep, port = str(address).rpartition(":")
  if not sep or not port.isdigit() or not 0 < int(port) < 65536 or host.endswith(":"):
    raise DistributedInitError(
        f"coordinator address {address!r} is invalid: expected host:port, e.g. "
        f"'10.0.0.1:1234' or 'localhost:1234' (the port process 0 listens on, 1-65535; "
        f"coordinator_address= or {ENV_COORDINATOR})")
  return host.strip("[]") or "127.0.0.1", int(port)


def _wait_for_coordinator(address: str, timeout: float, pid: int, nproc: int) -> None:
  """Retries a TCP connection to the coordinator until it accepts or ``timeout`` passes."""
  host, port = _split_address(address)
  start = time.monotonic()
  deadline = start + timeout
  next_note = start + _progress_interval(timeout)
  last: Exception | None = None
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      break
    if time.monotonic() >= next_note:
      next_note += _progress_interval(timeout)
      print(f"zerojax: process {pid} of {nproc}: waiting for the coordinator at {address!r} "
            f"({time.monotonic() - start:.0f}s of {timeout:g}s; set the limit with "
            f"initialize(timeout=...), {ENV_INIT_TIMEOUT} or zerojax.tools.launch --init-timeout); "
            f"last error: {last}", file=sys.stderr, flush=True)
    try:
      with socket.create_connection((host, port), timeout=min(2.0, left)):
        return
    except OSError as e:
      last = e
      time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
  raise DistributedInitError(
      f"zerojax: process {pid} of {nproc} could not reach the coordinator at {address!r} "
      f"within {timeout:g}s (initialization_timeout, also {ENV_INIT_TIMEOUT}). Check that "
      f"process 0 is running, that {address!r} is its address and port, and that this host can "
      f"reach it. Last error: {last}")


def _progress_interval(timeout: float) -> float:
  return max(1.0, min(10.0, timeout / 3))


def _report_waiting(done: threading.Event, t0: float, coord: str, pid: int, nproc: int,
                    timeout: float) -> None:
  """Prints progress while JAX waits for every process to register, and the likely causes
  just before JAX aborts the process at the deadline."""
  interval = _progress_interval(timeout)
  while not done.wait(min(interval, max(0.1, t0 + timeout - 1.0 - time.monotonic()))):
    waited = time.monotonic() - t0
    last = waited >= timeout - 1.5
    print(f"zerojax: process {pid} of {nproc} "
          + ("gives up" if last else "is still waiting")
          + f" after {waited:.0f}s of {timeout:g}s (initialization_timeout, {ENV_INIT_TIMEOUT}, "
          f"zerojax.tools.launch --init-timeout) for the other processes at coordinator {coord!r}. "
          f"Check that all {nproc} processes are started with num_processes={nproc}, the same "
          "coordinator address, and each process id 0.."
          f"{nproc - 1} exactly once: with a duplicate process id the coordinator drops the "
          "earlier process ('ALREADY_EXISTS: Aborted connect attempt as there is a request from "
          "a newer incarnation') and the others wait for the missing id"
          + ("; JAX will now abort this process." if last else "."),
          file=sys.stderr, flush=True)
    if last:
      return


def _install_exit_on_error(pid: int, nproc: int) -> None:
  """Makes an uncaught exception end this process at once, after its traceback is printed.

  Python would otherwise run JAX's exit handler, whose shutdown barrier waits for every other
  process: a dead peer makes the survivor hang there until the barrier times out and aborts."""
  previous = sys.excepthook
  if getattr(previous, "_zerojax", False):
    return

  def hook(kind, value, tb):
    try:
      previous(kind, value, tb)
      if isinstance(value, ProcessMismatchError):
        _wait_for_peers_to_report(pid, nproc)
      print(f"zerojax: process {pid} of {nproc} failed with {kind.__name__}; exiting now "
            "(code 1) without waiting for the other processes at JAX's shutdown barrier",
            file=sys.stderr, flush=True)
      sys.stdout.flush()
    finally:
      os._exit(1)

  hook._zerojax = True  # type: ignore[attr-defined]
  sys.excepthook = hook


_REPORTED_GRACE = 30.0


def _wait_for_peers_to_report(pid: int, nproc: int) -> None:
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


def _env_int(name: str) -> int | None:
  v = os.environ.get(name)
  if v is None or v == "":
    return None
  try:
    return int(v)
  except ValueError:
    raise DistributedInitError(f"environment variable {name}={v!r} is not an integer") from None


def _timeout(value, env, default) -> float:
  if value is None:
    v = os.environ.get(env)
    if v:
      try:
        value = float(v)
      except ValueError:
        raise DistributedInitError(f"environment variable {env}={v!r} is not a number") from None
    else:
      value = default
  if value <= 0:
    raise DistributedInitError(f"timeout {value!r} (from argument or {env}) must be > 0")
  return float(value)


def _first_line(e: BaseException) -> str:
  s = str(e).strip()
  return s.splitlines()[0][:500] if s else ""
