"""Reaching process 0's coordination service: its address, a TCP probe with progress, and
the report printed while JAX waits for every process to register.

JAX-free: `zerojax.core.distributed.initialize` runs these before JAX's own client, which
aborts the process (a C++ fatal error, not an exception) when the coordinator cannot be
reached.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

from zerojax.core.launch_env import ENV_COORDINATOR, ENV_INIT_TIMEOUT, DistributedInitError

__all__ = ["split_address", "wait_for_coordinator", "report_waiting"]


def split_address(address: str) -> tuple[str, int]:
  """``(host, port)`` of a ``host:port`` address; a `DistributedInitError` naming the form
  otherwise."""
  host, sep, port = str(address).rpartition(":")
  if not sep or not port.isdigit() or not 0 < int(port) < 65536 or host.endswith(":"):
    raise DistributedInitError(
        f"coordinator address {address!r} is invalid: expected host:port, e.g. "
        f"'10.0.0.1:1234' or 'localhost:1234' (the port process 0 listens on, 1-65535; "
        f"coordinator_address= or {ENV_COORDINATOR})")
  return host.strip("[]") or "127.0.0.1", int(port)


def wait_for_coordinator(address: str, timeout: float, pid: int, nproc: int) -> None:
  """Retries a TCP connection to the coordinator until it accepts or ``timeout`` passes."""
  host, port = split_address(address)
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


def report_waiting(done: threading.Event, t0: float, coord: str, pid: int, nproc: int,
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
