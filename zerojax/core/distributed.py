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
4. torchrun's variables: ``MASTER_ADDR``, ``MASTER_PORT`` (the coordinator takes the next
   port: torchrun's store holds this one), ``WORLD_SIZE``, ``RANK`` (and ``LOCAL_RANK``:
   one device per process where a host runs several);
5. JAX's cluster auto-detection (SLURM, Open MPI, Kubernetes indexed Jobs, Cloud TPU), which
   also fills whatever 1-4 left unset.

Once the processes have joined, the peer watch (`zerojax.core.peers`) ends every survivor
within a second of another process's death, naming it.

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

The variables' names are in `zerojax.core.launch_env`. That a run's processes agree on their
config and plan is checked by `zerojax.core.agreement.check_agreement`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Any, Sequence

import jax

from zerojax._compat import backends_initialized, detect_cluster, distributed_state
from zerojax.core import peers
from zerojax.core.agreement import ProcessMismatchError, wait_for_peers_to_report
from zerojax.core.coordinator import report_waiting, split_address, wait_for_coordinator
from zerojax.core.launch_env import (DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_INIT_TIMEOUT,
                                     DEFAULT_SHUTDOWN_TIMEOUT, ENV_COORDINATOR, ENV_CPU_DEVICES,
                                     ENV_HEARTBEAT_TIMEOUT, ENV_INIT_TIMEOUT, ENV_NUM_PROCESSES,
                                     ENV_PROCESS_ID, ENV_SHUTDOWN_TIMEOUT, DistributedInitError,
                                     env_int, first_line, timeout_seconds)

__all__ = ["DistributedInfo", "initialize", "info", "shutdown"]


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
  """Who this process is in the run.

  Attributes:
    process_id: this process's index, ``0 .. num_processes - 1``.
    num_processes: processes in the run (1: the distributed runtime is not started).
    coordinator_address: ``host:port`` of the coordination service (``None`` when single).
    source: where the settings came from: ``'arguments'``, ``'zerojax-env'``, ``'jax-env'``,
      ``'torchrun-env'``, ``'cluster'`` (JAX auto-detection), ``'single'`` or
      ``'already-initialized'``.
  """

  process_id: int
  num_processes: int
  coordinator_address: str | None
  source: str

  @property
  def is_multiprocess(self) -> bool:
    """Whether the run has more than one process."""
    return self.num_processes > 1

  @property
  def is_coordinator(self) -> bool:
    """Whether this is process 0, which hosts the coordination service."""
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
  # JAX's heartbeat finds a dead process only after heartbeat_timeout (100 s by default):
  # the peer watch finds it within a second, whatever this process is doing.
  peers.start(s.pid, s.nproc, s.coord, getattr(distributed_state(), "client", None), s.init_t)
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
  elif local_device_ids is None and source == "torchrun-env":
    local_device_ids = _torchrun_local_device_ids()
  init_t = timeout_seconds(initialization_timeout, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT)
  beat_t = timeout_seconds(heartbeat_timeout, ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT)
  down_t = timeout_seconds(shutdown_timeout, ENV_SHUTDOWN_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT)
  cpu_devices = cpu_devices if cpu_devices is not None else env_int(ENV_CPU_DEVICES)
  return _Settings(coord, nproc, pid, source, local_device_ids, init_t, beat_t, down_t,
                   cpu_devices)


def _single_process(cpu_devices: int | None) -> DistributedInfo:
  """A single-process run: nothing to start, only the CPU device count to set."""
  if cpu_devices is not None and not backends_initialized():
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  return DistributedInfo(0, 1, None, "single")


def _check_can_start(s: _Settings) -> None:
  """Refuses settings JAX would fail on later or less clearly."""
  if s.pid is None:
    raise DistributedInitError(
        f"zerojax.core.distributed.initialize: {s.nproc} processes but no process id; pass "
        f"process_id= or set {ENV_PROCESS_ID}")
  if s.coord is None:
    raise DistributedInitError(
        f"zerojax.core.distributed.initialize: {s.nproc} processes but no coordinator address; "
        f"pass coordinator_address='host:port' or set {ENV_COORDINATOR}")
  split_address(s.coord)  # JAX itself fails on a missing port with a bare IndexError
  if not 0 <= s.pid < s.nproc:
    raise DistributedInitError(f"process id {s.pid} is not in 0..{s.nproc - 1}")
  if backends_initialized():
    raise DistributedInitError(
        "zerojax.core.distributed.initialize must run before JAX starts its backend (before "
        "jax.devices(), any computation, or zerojax.make_mesh); move the call to the top of "
        "the program")


def _configure_cpu_backend(cpu_collectives: str | None, cpu_devices: int | None) -> None:
  """The CPU backend's cross-process collectives and device count, set before it starts."""
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  if cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", cpu_devices)


def _join(s: _Settings) -> None:
  """Starts JAX's distributed runtime; a failure is a `DistributedInitError` naming why."""
  t0 = time.monotonic()
  if s.pid != 0:
    # JAX's client aborts the process (a C++ fatal error, not an exception) when the
    # coordinator cannot be reached: probe it first so the failure is a Python error.
    wait_for_coordinator(s.coord, s.init_t, s.pid, s.nproc)
  # Past the probe, a peer that never shows up still makes JAX abort at the deadline; say why
  # just before that happens.
  remaining = max(1.0, s.init_t - (time.monotonic() - t0))
  done = threading.Event()
  watchdog = threading.Thread(target=report_waiting,
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
        f"reachable from this host. Cause: {type(e).__name__}: {first_line(e)}") from e
  finally:
    done.set()


def info() -> DistributedInfo:
  """Who this process is in the run.

  Returns:
    This process's `DistributedInfo`: the one `initialize` returned, that of a runtime JAX
    started otherwise, or a single-process one if neither happened.
  """
  if _info is not None:
    return _info
  if jax.distributed.is_initialized():
    return _running_info()
  return DistributedInfo(0, 1, None, "single")


def shutdown() -> None:
  """Stops the distributed runtime if this module started it (safe to call always)."""
  global _info
  if jax.distributed.is_initialized():
    jax.distributed.shutdown()
  _info = None


# -- resolution ---------------------------------------------------------------------------------


def _resolve(coord, nproc, pid, method):
  source = "arguments" if coord is not None or nproc is not None or pid is not None else None
  for prefix, name in (("ZEROJAX", "zerojax-env"), ("JAX", "jax-env")):
    c = os.environ.get(f"{prefix}_COORDINATOR_ADDRESS") or None
    n = env_int(f"{prefix}_NUM_PROCESSES")
    i = env_int(f"{prefix}_PROCESS_ID")
    if (c, n, i) != (None, None, None) and source is None:
      source = name
    coord = coord if coord is not None else c
    nproc = nproc if nproc is not None else n
    pid = pid if pid is not None else i
  c, n, i = _torchrun_env()
  if (c, n, i) != (None, None, None) and source is None:
    source = "torchrun-env"
  coord, nproc, pid = (coord if coord is not None else c, nproc if nproc is not None else n,
                       pid if pid is not None else i)
  if method != "deactivate" and (nproc is None or nproc > 1) and None in (coord, nproc, pid):
    # JAX's own detectors (SLURM, Open MPI, Kubernetes, TPU) fill what is still unset.
    c, n, i, _ = detect_cluster(coord, nproc, pid, None, method,
                                timeout_seconds(None, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT))
    if (c, n, i) != (coord, nproc, pid) and source is None:
      source = "cluster"
    coord, nproc, pid = c, n, i
  if nproc is None and coord is not None:
    raise DistributedInitError(
        f"zerojax.core.distributed.initialize: a coordinator ({coord!r}) is set but not the number "
        f"of processes; pass num_processes= or set {ENV_NUM_PROCESSES}")
  return coord, nproc, pid, source or "single"


def _torchrun_env() -> tuple[str | None, int | None, int | None]:
  """``(coordinator, processes, process id)`` from torchrun-style variables (``MASTER_ADDR``,
  ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``; all ``None`` unless the last three name a run).

  torchrun's own store listens on ``MASTER_PORT``, so the coordinator takes the port after it
  (``JAX_COORDINATOR_PORT`` picks another, as it does for JAX's cluster detection).
  """
  addr, n, i = os.environ.get("MASTER_ADDR"), env_int("WORLD_SIZE"), env_int("RANK")
  if not addr or n is None or i is None:
    return None, None, None
  port = os.environ.get("JAX_COORDINATOR_PORT") or None
  if port is None:
    base = env_int("MASTER_PORT")
    if base is None:
      raise DistributedInitError(
          f"MASTER_ADDR={addr!r}, WORLD_SIZE={n} and RANK={i} are set but not MASTER_PORT; set "
          "MASTER_PORT (torchrun does) or JAX_COORDINATOR_PORT")
    port = base + 1
  host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
  return f"{host}:{port}", n, i


def _torchrun_local_device_ids():
  """One device per process, the one of its ``LOCAL_RANK``, where torchrun starts several
  processes per host (``LOCAL_WORLD_SIZE`` > 1) and ``JAX_LOCAL_DEVICE_IDS`` is unset."""
  if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
    return None
  local, per_host = env_int("LOCAL_RANK"), env_int("LOCAL_WORLD_SIZE")
  return [local] if local is not None and per_host is not None and per_host > 1 else None


def _detected_local_device_ids(method):
  """JAX's rule under a detected scheduler (SLURM, Open MPI): one device per process, the one
  of its local rank; ``None`` (all devices) elsewhere or when ``JAX_LOCAL_DEVICE_IDS`` is set."""
  if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
    return None
  return detect_cluster("unused:0", 0, 0, None, method, 1)[3]


def _running_info() -> DistributedInfo:
  s = distributed_state()
  if s is None:  # pragma: no cover - depends on the installed JAX
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


def _install_exit_on_error(pid: int, nproc: int) -> None:
  """Makes an uncaught exception end this process at once, after its traceback is printed.

  Python would otherwise run JAX's exit handler, whose shutdown barrier waits for every other
  process: a dead peer makes the survivor hang there until the barrier times out and aborts."""
  previous = sys.excepthook
  if getattr(previous, "_zerojax", False):
    return

  def hook(kind, value, tb):
    try:
      if (watch := peers.current()) is not None:
        # A peer that died makes this error its echo: the watch then ends this process,
        # naming that peer, and the sleep only backs it up.
        if watch.settle():
          time.sleep(peers.FAILURE_GRACE + 5.0)
        watch.failed()  # the others stop too, after a grace to print their own error
      previous(kind, value, tb)
      if isinstance(value, ProcessMismatchError):
        wait_for_peers_to_report(pid, nproc)
      elif (watch := peers.current()) is not None:
        watch.wait_for_others_to_leave()
      print(f"zerojax: process {pid} of {nproc} failed with {kind.__name__}; exiting now "
            "(code 1) without waiting for the other processes at JAX's shutdown barrier",
            file=sys.stderr, flush=True)
      sys.stdout.flush()
    finally:
      os._exit(1)

  hook._zerojax = True  # type: ignore[attr-defined]
  sys.excepthook = hook
