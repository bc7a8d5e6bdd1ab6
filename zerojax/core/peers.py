"""The peer watch: in a multi-process run, every process learns within a second that another
one is gone (killed, crashed, or stopped on an error) and ends itself, naming that process.

Why not JAX's own health check: the coordination service declares a process dead only after
``heartbeat_timeout`` seconds without a heartbeat (100 by default), and a survivor then aborts
with a C++ ``tasks unhealthy`` message that does not say which process died. A collective
with a dead peer fails at once on some backends and waits on others; a survivor that is
saving, loading data or writing NVMe files notices nothing at all.

The watch is one TCP connection from each process to process 0 (the coordinator's host, which
every process already reaches), with TCP keep-alive probes answered by the kernel. A killed
process's kernel closes its connection at once, so its end is seen within milliseconds,
whatever the survivors are doing, and without any Python code of the dead process running.
Process 0 relays each end to the others. A process that finishes normally says so first
(at interpreter exit), so its closing connection is not taken for a death; a process that
stops on its own error says that instead, and the others stop after `FAILURE_GRACE`
seconds (time to print their own error when they have the same one).

``ZEROJAX_PEER_WATCH=0`` turns the watch off (JAX's heartbeat then is the only check).
"""

from __future__ import annotations

import atexit
import os
import secrets
import selectors
import socket
import sys
import threading
import time
from typing import Any, Callable

from zerojax.core.coordinator import split_address
from zerojax.core.launch_env import ENV_PEER_WATCH, first_line

__all__ = ["FAILURE_GRACE", "DEATH_SETTLE", "EXIT_PEER_GONE", "PeerWatch", "start", "current"]

# Seconds a survivor gives its own main thread to report the same error as a peer that
# stopped on one, before it stops itself naming that peer.
FAILURE_GRACE = 3.0
# Seconds a process about to report its own error first gives the watch to find a dead peer:
# a collective with a killed peer fails (Gloo: "Connection reset by peer") about when the
# peer's watch connection closes, and the death, not that error, is what to report.
DEATH_SETTLE = 2.0
# The exit status of a process ended by the watch (a peer is gone; nothing here failed).
EXIT_PEER_GONE = 1

_KEY = "zerojax/peer_watch/address"
# Kernel keep-alive: a peer whose host vanished (no FIN, no RST) is found after about
# IDLE + INTERVAL * COUNT seconds; the kernel answers the probes, so a busy process is never
# taken for a dead one.
_KEEPALIVE = (2, 1, 5)

_current: "PeerWatch | None" = None


class PeerWatch:
  """This process's end of the peer watch (see the module's docstring).

  Args:
    pid: this process's index.
    nproc: processes in the run.
    exit: ends this process (``os._exit`` by default); a test may pass its own.
  """

  def __init__(self, pid: int, nproc: int, exit: Callable[[int], None] = os._exit):
    self.pid, self.nproc, self._exit = pid, nproc, exit
    self._lock = threading.Lock()
    self._conns: dict[int, socket.socket] = {}  # process 0: every other process's connection
    self._said: dict[int, str] = {}  # process -> 'DONE' or 'FAIL' (process 0's record)
    self._left: set[int] = set()  # process 0: the processes whose connection closed
    self._exiting = False  # this process ends by itself: the watch no longer acts
    self._dying = False  # the watch found a dead peer and is ending this process
    self._heard_failure = False  # a peer said it stopped on an error of its own
    self._server: socket.socket | None = None
    self._token = ""
    self._sel = selectors.DefaultSelector()

  # -- setting up ------------------------------------------------------------------------------

  def listen(self, host: str, client: Any) -> None:
    """Process 0: listens on a free port and publishes ``host:port`` through the coordination
    service's key-value store (``client``)."""
    try:
      srv = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    except (OSError, ValueError):  # no IPv6 on this host
      srv = socket.create_server(("", 0))
    srv.setblocking(False)
    self._server = srv
    self._sel.register(srv, selectors.EVENT_READ, None)
    bracket = f"[{host}]" if ":" in host else host
    # Only the run's processes know the token: a stray connection to the port (a scanner)
    # can neither join nor be taken for a process that died.
    self._token = secrets.token_hex(8)
    client.key_value_set(_KEY, f"{bracket}:{srv.getsockname()[1]} {self._token}")
    threading.Thread(target=self._serve, daemon=True, name="zerojax-peer-watch").start()

  def wait_for_everyone(self, timeout: float) -> None:
    """Process 0: waits until every other process has connected (they are already registered
    with the coordination service, so it takes milliseconds); raises `TimeoutError` after
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      with self._lock:
        if len(self._conns) + len(self._left) >= self.nproc - 1:
          return
      time.sleep(0.01)
    with self._lock:
      missing = sorted(set(range(1, self.nproc)) - set(self._conns) - self._left)
    raise TimeoutError(f"process(es) {missing} did not connect within {timeout:g}s")

  def connect(self, client: Any, timeout: float) -> None:
    """Any other process: connects to process 0's watch (address from the key-value store)."""
    address, token = client.blocking_key_value_get(_KEY, int(timeout * 1000)).split()
    host, port = split_address(address)
    conn = socket.create_connection((host, port), timeout=timeout)
    _keepalive(conn)
    conn.sendall(f"HELLO {self.pid} {token}\n".encode())
    conn.settimeout(None)
    self._conns[0] = conn
    threading.Thread(target=self._follow, args=(conn,), daemon=True,
                     name="zerojax-peer-watch").start()

  # -- what this process says ------------------------------------------------------------------

  def done(self) -> None:
    """This process finished normally: its connection closing is not a death."""
    self._say("DONE")

  def failed(self) -> None:
    """This process is about to exit on an error of its own (already printed): the others
    stop after `FAILURE_GRACE`; the watch no longer ends this process itself."""
    self._exiting = True
    self._say("FAIL")

  def settle(self, timeout: float = DEATH_SETTLE) -> bool:
    """Waits at most ``timeout`` s for the watch to find another process dead.

    Call it before reporting an error that a peer's death may have caused.

    Args:
      timeout: seconds to wait.

    Returns:
      ``True`` when the watch found a death and is ending this process itself, naming the
      dead process; ``False`` when no death was seen (the error is this process's own), or
      at once when a peer said it stopped on an error (this one may be the same).
    """
    deadline = time.monotonic() + timeout
    while not (self._dying or self._heard_failure) and time.monotonic() < deadline:
      time.sleep(0.01)
    return self._dying

  def wait_for_others_to_leave(self, timeout: float = FAILURE_GRACE + 2.0) -> None:
    """Process 0, exiting on its own error: waits (at most ``timeout`` s) until every other
    process has ended. Its exit takes the coordination service down, and JAX aborts every
    process still connected with a C++ fatal error: they leave first, each with its own
    message. Other processes return at once."""
    if self.pid != 0:
      return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      with self._lock:
        if len(self._left) >= self.nproc - 1:
          return
      time.sleep(0.05)

  def _say(self, what: str) -> None:
    with self._lock:
      if self.pid == 0:
        self._said[0] = what
        for i, c in list(self._conns.items()):
          _send(c, f"{what} 0\n")
      elif 0 in self._conns:
        _send(self._conns[0], f"{what}\n")

  # -- process 0 -------------------------------------------------------------------------------

  def _serve(self) -> None:
    buffers: dict[socket.socket, bytes] = {}
    owners: dict[socket.socket, int | None] = {}
    while True:
      for key, _ in self._sel.select():
        sock = key.fileobj
        if sock is self._server:
          try:
            conn, _ = self._server.accept()
          except OSError:
            continue
          conn.setblocking(True)
          _keepalive(conn)
          buffers[conn], owners[conn] = b"", None
          self._sel.register(conn, selectors.EVENT_READ, None)
          continue
        try:
          data = sock.recv(4096)
        except OSError:
          data = b""
        if not data:  # the peer's connection closed
          self._sel.unregister(sock)
          i = owners.pop(sock, None)
          if i is not None:
            self._closed(i)
          continue
        buffers[sock] += data
        while b"\n" in buffers[sock]:
          line, buffers[sock] = buffers[sock].split(b"\n", 1)
          words = line.decode(errors="replace").split()
          if (words[:1] == ["HELLO"] and len(words) == 3 and words[1].isdigit()
              and words[2] == self._token):
            owners[sock] = int(words[1])
            with self._lock:
              self._conns[int(words[1])] = sock
              if 0 in self._said:  # process 0 already finished or failed
                _send(sock, f"{self._said[0]} 0\n")
          elif words[:1] in (["DONE"], ["FAIL"]) and owners.get(sock) is not None:
            i = owners[sock]
            self._said[i] = words[0]
            if words[0] == "FAIL":
              self._relay(f"FAIL {i}\n", but=i)
              threading.Thread(target=self._gone, args=(i, True), daemon=True).start()

  def _closed(self, i: int) -> None:
    with self._lock:
      self._conns.pop(i, None)
      self._left.add(i)
    if self._said.get(i) in ("DONE", "FAIL"):
      return  # said goodbye first: not a death
    self._relay(f"DIED {i}\n", but=i)
    # Not on this thread: it must go on seeing the others leave (`wait_for_others_to_leave`).
    threading.Thread(target=self._gone, args=(i, False), daemon=True).start()

  def _relay(self, line: str, but: int) -> None:
    with self._lock:
      for j, c in list(self._conns.items()):
        if j != but:
          _send(c, line)

  # -- the others ------------------------------------------------------------------------------

  def _follow(self, conn: socket.socket) -> None:
    buf, zero_said = b"", None
    while True:
      try:
        data = conn.recv(4096)
      except OSError:
        data = b""
      if not data:  # process 0's connection closed
        if zero_said is None:
          self._gone(0, failed=False)
        return
      buf += data
      while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        words = line.decode(errors="replace").split()
        if len(words) != 2 or not words[1].isdigit():
          continue
        what, i = words[0], int(words[1])
        if i == 0 and what in ("DONE", "FAIL"):
          zero_said = what
        if what in ("DIED", "FAIL"):
          threading.Thread(target=self._gone, args=(i, what == "FAIL"), daemon=True).start()

  # -- ending this process ---------------------------------------------------------------------

  def _gone(self, i: int, failed: bool) -> None:
    """Process ``i`` is gone: ends this process, at once for a death, after `FAILURE_GRACE`
    for a failure (the main thread may be reporting the same error)."""
    if failed:
      self._heard_failure = True
      time.sleep(FAILURE_GRACE)
    if self._exiting:
      return
    with self._lock:
      if self._exiting:
        return
      self._exiting = True
      self._dying = not failed
    who = f"process {i} of {self.nproc}" + (" (the coordinator)" if i == 0 else "")
    if failed:
      what = f"{who} stopped on an error (its own output names it); process {self.pid} stops too"
    else:
      what = (f"{who} is gone: killed, crashed or its host went down (its connection closed "
              f"without a goodbye); process {self.pid} stops now instead of waiting for it")
    _write_stderr(f"zerojax: {what} (exit code {EXIT_PEER_GONE})\n")
    if self.pid == 0:  # the others first: process 0's exit takes the coordinator down
      self.wait_for_others_to_leave()
    self._exit(EXIT_PEER_GONE)


def _keepalive(sock: socket.socket) -> None:
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
  idle, interval, count = _KEEPALIVE
  for opt, v in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
    if hasattr(socket, opt):  # Linux; elsewhere the system's keep-alive timing
      try:
        sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)
      except OSError:
        pass


def _send(conn: socket.socket, line: str) -> None:
  try:
    conn.sendall(line.encode())
  except OSError:
    pass  # that peer is gone too; its own end is reported by its closed connection


def _write_stderr(text: str) -> None:
  # os.write: no lock of sys.stderr's buffer, which the main thread may hold
  try:
    os.write(2, text.encode())
  except OSError:
    pass


def start(pid: int, nproc: int, coordinator: str, client: Any, timeout: float) -> PeerWatch | None:
  """Starts this process's peer watch (once per process); ``None`` when it is off
  (``ZEROJAX_PEER_WATCH=0``) or could not start (said on stderr: JAX's heartbeat then is the
  only check).

  Args:
    pid: this process's index.
    nproc: processes in the run.
    coordinator: ``host:port`` of the coordination service (process 0's host).
    client: JAX's distributed-runtime client (its key-value store carries the address).
    timeout: seconds to wait for process 0's address and connection.

  Returns:
    the `PeerWatch`, or ``None``.
  """
  global _current
  if _current is not None:
    return _current
  if os.environ.get(ENV_PEER_WATCH, "1").strip().lower() in ("0", "false", "no", "off"):
    return None
  watch = PeerWatch(pid, nproc)
  try:
    if pid == 0:
      watch.listen(split_address(coordinator)[0], client)
      watch.wait_for_everyone(timeout)
    else:
      watch.connect(client, timeout)
  except Exception as e:  # noqa: BLE001 - the run goes on with JAX's heartbeat alone
    print(f"zerojax: process {pid} of {nproc}: the peer watch did not start ({type(e).__name__}: "
          f"{first_line(e)}); a dead process is then found by JAX's heartbeat only "
          "(heartbeat_timeout, ZEROJAX_HEARTBEAT_TIMEOUT)", file=sys.stderr, flush=True)
    return None
  _current = watch
  atexit.register(watch.done)  # registered after JAX's clean-up, so it runs before it
  return watch


def current() -> PeerWatch | None:
  """This process's running `PeerWatch`, or ``None``."""
  return _current
