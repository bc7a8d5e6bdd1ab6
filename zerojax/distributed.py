"""Multi-process start-up: a thin, safe layer over ``jax.distributed.initialize``.

zerojax runs on JAX's own multi-controller runtime: every process runs the same program, owns
its local devices, and XLA's collectives (NCCL on GPU, ICI on TPU, gloo on CPU) connect them.
Nothing else in zerojax changes with the process count: `zerojax.make_mesh` builds the mesh
over all devices of all processes and the decorated step is the same program everywhere.

`initialize` resolves where the coordinator is and who this process is, in this order:

1. explicit arguments;
2. zerojax's environment variables (set by ``python -m zerojax.launch`` or by hand):
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
import os
import socket
import sys
import threading
import time
from typing import Sequence

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


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None,
               *,
               local_device_ids: int | Sequence[int] | None = None,
               cluster_detection_method: str | None = None,
               initialization_timeout: float | None = None,
               heartbeat_timeout: float | None = None,
               shutdown_timeout: float | None = None,
               cpu_devices: int | None = None,
               cpu_collectives: str | None = "gloo") -> DistributedInfo:
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

  Returns:
    The `DistributedInfo` of this process.

  Raises:
    DistributedInitError: the coordinator was not reached within ``initialization_timeout``,
      the settings are inconsistent, or JAX's backend was already started by an earlier call.
  """
  global _info
  import jax
  from jax._src import distributed as jdist
  from jax._src import xla_bridge

  if _info is not None or jax.distributed.is_initialized():
    info = _info or _running_info(jdist)
    _check_same(info, coordinator_address, num_processes, process_id)
    _info = info
    return info

  coord, nproc, pid, source = _resolve(coordinator_address, num_processes, process_id,
                                       cluster_detection_method)
  if local_device_ids is None and source == "cluster":
    local_device_ids = _detected_local_device_ids(cluster_detection_method)
  init_t = _timeout(initialization_timeout, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT)
  beat_t = _timeout(heartbeat_timeout, ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT)
  down_t = _timeout(shutdown_timeout, ENV_SHUTDOWN_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT)
  cpu_devices = cpu_devices if cpu_devices is not None else _env_int(ENV_CPU_DEVICES)

  if nproc is None or nproc <= 1:  # single process: nothing to start
    if cpu_devices is not None and not xla_bridge.backends_are_initialized():
      jax.config.update("jax_num_cpu_devices", cpu_devices)
    _info = DistributedInfo(0, 1, None, "single")
    return _info

  if pid is None:
    raise DistributedInitError(
        f"zerojax.distributed.initialize: {nproc} processes but no process id; pass "
        f"process_id= or set {ENV_PROCESS_ID}")
  if coord is None:
    raise DistributedInitError(
        f"zerojax.distributed.initialize: {nproc} processes but no coordinator address; pass "
        f"coordinator_address='host:port' or set {ENV_COORDINATOR}")
  _split_address(coord)  # JAX itself fails on a missing port with a bare IndexError
  if not 0 <= pid < nproc:
    raise DistributedInitError(f"process id {pid} is not in 0..{nproc - 1}")
  if xla_bridge.backends_are_initialized():
    raise DistributedInitError(
        "zerojax.distributed.initialize must run before JAX starts its backend (before "
        "jax.devices(), any computation, or zerojax.make_mesh); move the call to the top of "
        "the program")

  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  if cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", cpu_devices)

  t0 = time.monotonic()
  if pid != 0:
    # JAX's client aborts the process (a C++ fatal error, not an exception) when the
    # coordinator cannot be reached: probe it first so the failure is a Python error.
    _wait_for_coordinator(coord, init_t, pid, nproc)
  # Past the probe, a peer that never shows up still makes JAX abort at the deadline; say why
  # just before that happens.
  remaining = max(1.0, init_t - (time.monotonic() - t0))
  watchdog = threading.Timer(max(0.5, remaining - 1.0), _warn_stuck, (coord, pid, nproc, init_t))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
        coordinator_address=coord, num_processes=nproc, process_id=pid,
        local_device_ids=local_device_ids,
        cluster_detection_method="deactivate",  # already resolved above
        initialization_timeout=max(1, int(round(remaining))),
        heartbeat_timeout_seconds=max(1, int(round(beat_t))),
        shutdown_timeout_seconds=max(1, int(round(down_t))))
  except Exception as e:  # noqa: BLE001 - re-raised with the address and the knobs
    _reset(jdist)
    waited = time.monotonic() - t0
    raise DistributedInitError(
        f"zerojax: process {pid} of {nproc} could not join the coordinator at {coord!r} "
        f"(gave up after {waited:.1f}s; initialization_timeout={init_t:g}s, set by argument or "
        f"{ENV_INIT_TIMEOUT}). Check that process 0 is running and that {coord!r} is reachable "
        f"from this host. Cause: {type(e).__name__}: {_first_line(e)}") from e
  finally:
    watchdog.cancel()
  _info = DistributedInfo(pid, nproc, coord, source)
  return _info


def info() -> DistributedInfo:
  """This process's `DistributedInfo` (single-process if `initialize` was never called)."""
  if _info is not None:
    return _info
  import jax
  from jax._src import distributed as jdist
  if jax.distributed.is_initialized():
    return _running_info(jdist)
  return DistributedInfo(0, 1, None, "single")


def shutdown() -> None:
  """Stops the distributed runtime if this module started it (safe to call always)."""
  global _info
  import jax
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
    from jax._src import clusters
    c, n, i, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        coord, nproc, pid, None, method, _timeout(None, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT))
    if (c, n, i) != (coord, nproc, pid) and source is None:
      source = "cluster"
    coord, nproc, pid = c, n, i
  if nproc is None and coord is not None:
    raise DistributedInitError(
        f"zerojax.distributed.initialize: a coordinator ({coord!r}) is set but not the number "
        f"of processes; pass num_processes= or set {ENV_NUM_PROCESSES}")
  return coord, nproc, pid, source or "single"


def _detected_local_device_ids(method):
  """JAX's rule under a detected scheduler (SLURM, Open MPI): one device per process, the one
  of its local rank; ``None`` (all devices) elsewhere or when ``JAX_LOCAL_DEVICE_IDS`` is set."""
  if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
    return None
  from jax._src import clusters
  _, _, _, ids = clusters.ClusterEnv.auto_detect_unset_distributed_params(
      "unused:0", 0, 0, None, method, 1)
  return ids


def _running_info(jdist) -> DistributedInfo:
  s = jdist.global_state
  return DistributedInfo(s.process_id, s.num_processes, s.coordinator_address,
                         "already-initialized")


def _check_same(info: DistributedInfo, coord, nproc, pid) -> None:
  for name, want, have in (("coordinator_address", coord, info.coordinator_address),
                           ("num_processes", nproc, info.num_processes),
                           ("process_id", pid, info.process_id)):
    if want is not None and want != have:
      raise DistributedInitError(
          f"zerojax.distributed.initialize was already called with {name}={have!r}; it cannot "
          f"be changed to {want!r} in a running process")


def _reset(jdist) -> None:
  """Forgets a half-started runtime so the error is the only effect of a failed call."""
  s = jdist.global_state
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
  deadline = time.monotonic() + timeout
  last: Exception | None = None
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      break
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


def _warn_stuck(coord: str, pid: int, nproc: int, timeout: float) -> None:
  print(f"zerojax: process {pid} of {nproc} is still waiting for the other processes at "
        f"coordinator {coord!r} after ~{timeout:g}s (initialization_timeout); JAX will now abort "
        f"this process. Are all {nproc} processes started with the same coordinator address?",
        file=sys.stderr, flush=True)


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
