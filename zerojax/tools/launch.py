"""Local multi-process launcher: ``python -m zerojax.tools.launch -n 2 -- SCRIPT ARGS...``.

Starts N copies of a program on this machine as one JAX multi-process run, the way a cluster
scheduler would on N hosts. Each child gets the environment `zerojax.core.distributed.initialize`
reads (``ZEROJAX_COORDINATOR_ADDRESS``, ``ZEROJAX_NUM_PROCESSES``, ``ZEROJAX_PROCESS_ID``, and
``ZEROJAX_CPU_DEVICES`` with ``--devices-per-process``; without it, 4 per process when no
accelerator is installed, so that a local run has something to shard). Their output is merged
line by line, each line prefixed with ``[pI]``. If any child fails, the others are given
``--grace`` seconds to fail on their own (zerojax's peer watch, `zerojax.core.peers`, stops
them within a second; JAX catches the launcher's SIGTERM as a preemption notice) and are then
terminated; the launcher exits with the first failing child's code. It never waits forever:
``--timeout`` bounds the whole run.

On a real cluster use the scheduler instead (see docs/multihost.md); the program is the same.

Examples::

  python -m zerojax.tools.launch -n 2 -- examples/multihost_train.py   # 2 x 4 CPU devices
  python -m zerojax.tools.launch -n 2 --devices-per-process 2 -- examples/multihost_train.py
  python -m zerojax.tools.launch -n 2 -- -m mypackage.train --steps 10
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pkgutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

from zerojax.core.launch_env import (ENV_COORDINATOR, ENV_CPU_DEVICES, ENV_HEARTBEAT_TIMEOUT,
                                     ENV_INIT_TIMEOUT, ENV_NUM_PROCESSES, ENV_PROCESS_ID)

__all__ = ["DEFAULT_CPU_DEVICES_PER_PROCESS", "free_port", "parse_args", "command_line",
           "resolve_devices_per_process", "child_env", "launch", "main"]


DEFAULT_CPU_DEVICES_PER_PROCESS = 4


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that is free on ``host`` right now."""
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="zerojax launch", description="Run N processes of a JAX program on this machine as "
      "one multi-process run.", formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="The command after '--' is a Python script (ending in .py), '-m module', or any "
      "executable.")
  p.add_argument("-n", "--num-processes", type=int, default=2, help="processes to start")
  p.add_argument("--devices-per-process", type=int, default=None,
                 help="simulated CPU devices per process (sets ZEROJAX_CPU_DEVICES and "
                 "XLA_FLAGS=--xla_force_host_platform_device_count); default "
                 f"{DEFAULT_CPU_DEVICES_PER_PROCESS} when no accelerator (CUDA/ROCm/TPU "
                 "plugin) is installed and neither is set in the environment")
  p.add_argument("--host", default="127.0.0.1", help="coordinator host (default 127.0.0.1)")
  p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
  p.add_argument("--heartbeat-timeout", type=float, default=None,
                 help="seconds before a silent process counts as dead (ZEROJAX_HEARTBEAT_TIMEOUT)")
  p.add_argument("--init-timeout", "--coordinator-timeout", dest="init_timeout", type=float,
                 default=None, metavar="SECONDS",
                 help="seconds each process waits at start-up for the coordinator and all "
                 "other processes, printing progress meanwhile (default 300; sets "
                 "ZEROJAX_INIT_TIMEOUT)")
  p.add_argument("--grace", type=float, default=10.0,
                 help="after a child fails, seconds the others get to exit before they are "
                 "terminated (default 10)")
  p.add_argument("--timeout", type=float, default=None,
                 help="terminate every child after this many seconds (default: none)")
  p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines")
  p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
  args = p.parse_args(argv)
  cmd = list(args.command)
  if cmd[:1] == ["--"]:
    cmd = cmd[1:]
  if not cmd:
    p.error("no program given; usage: zerojax launch -n 2 -- SCRIPT [ARGS...]")
  if args.num_processes < 1:
    p.error(f"-n must be >= 1, got {args.num_processes}")
  if args.devices_per_process is not None and args.devices_per_process < 1:
    p.error(f"--devices-per-process must be >= 1, got {args.devices_per_process}")
  args.command = cmd
  return args


def command_line(cmd: Sequence[str]) -> list[str]:
  """``script.py ...`` and ``-m module ...`` run with this Python; anything else as is."""
  cmd = list(cmd)
  if cmd[0] == "-m" or cmd[0].endswith(".py"):
    return [sys.executable, "-u"] + cmd
  return cmd


def _accelerator_plugins() -> list[str]:
  """Names of installed JAX accelerator plugins (``jax_plugins.*``, ``libtpu``).

  Read from the installed packages, not from JAX: the launcher must not start a backend (it
  would claim the devices its children need).
  """
  found = []
  if importlib.util.find_spec("jax_plugins") is not None:
    import jax_plugins  # namespace package of PJRT plugins (jax_cuda12_plugin, ...)
    found += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
  if importlib.util.find_spec("libtpu") is not None:
    found.append("libtpu")
  return found


def resolve_devices_per_process(requested: int | None, env: dict) -> tuple[int | None, str]:
  """``(devices, why)``: the simulated CPU devices each child gets (``None``: leave as is).

  An explicit ``--devices-per-process`` wins; then a count already in ``env``
  (``ZEROJAX_CPU_DEVICES`` or the XLA flag); then, when the children will run on CPU (no
  accelerator plugin installed, or ``JAX_PLATFORMS=cpu``), `DEFAULT_CPU_DEVICES_PER_PROCESS`:
  one CPU device per process would give a mesh with nothing to shard.
  """
  if requested is not None:
    if requested < 1:
      raise ValueError(f"--devices-per-process={requested} is invalid: an integer >= 1")
    return requested, "--devices-per-process"
  if env.get(ENV_CPU_DEVICES) or "xla_force_host_platform_device_count" in env.get(
      "XLA_FLAGS", ""):
    return None, "set in the environment"
  platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  plugins = [] if platforms == ["cpu"] else _accelerator_plugins()
  if plugins:
    return None, f"accelerator plugin(s) {', '.join(plugins)} installed"
  return DEFAULT_CPU_DEVICES_PER_PROCESS, "no accelerator plugin installed"


def child_env(base: dict, index: int, n: int, coordinator: str,
              devices_per_process: int | None = None, heartbeat_timeout: float | None = None,
              init_timeout: float | None = None) -> dict:
  env = dict(base)
  env[ENV_COORDINATOR] = coordinator
  env[ENV_NUM_PROCESSES] = str(n)
  env[ENV_PROCESS_ID] = str(index)
  env["PYTHONUNBUFFERED"] = "1"
  if devices_per_process is not None:
    env[ENV_CPU_DEVICES] = str(devices_per_process)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(
        flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
  if heartbeat_timeout is not None:
    env[ENV_HEARTBEAT_TIMEOUT] = str(heartbeat_timeout)
  if init_timeout is not None:
    env[ENV_INIT_TIMEOUT] = str(init_timeout)
  return env


def _pump(stream, prefix: str, out, lock: threading.Lock) -> None:
  for raw in iter(stream.readline, b""):
    line = raw.decode("utf-8", "replace")
    with lock:
      out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
      out.flush()
  stream.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
  if proc.poll() is not None:
    return
  try:
    os.killpg(proc.pid, sig)  # the child's own session: the child and what it started
  except (ProcessLookupError, PermissionError):
    try:
      proc.send_signal(sig)
    except ProcessLookupError:
      pass


def _stop(procs: list[subprocess.Popen], wait: float = 5.0) -> None:
  for p in procs:
    _signal_group(p, signal.SIGTERM)
  deadline = time.monotonic() + wait
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      _signal_group(p, signal.SIGKILL)
      p.wait()


def launch(command: Sequence[str], num_processes: int = 2, *,
           devices_per_process: int | None = None, host: str = "127.0.0.1", port: int = 0,
           heartbeat_timeout: float | None = None, init_timeout: float | None = None,
           grace: float = 10.0, timeout: float | None = None, prefix: bool = True,
           env: dict | None = None, out=None) -> int:
  """Runs ``command`` as ``num_processes`` processes; returns 0 or the first failing code.

  ``devices_per_process`` goes through `resolve_devices_per_process` (4 simulated CPU devices
  each when no accelerator is installed).

  A child killed by a signal counts as failing with code ``128 + signal``.
  """
  out = out or sys.stdout
  port = port or free_port(host)
  base = dict(os.environ if env is None else env)
  lock = threading.Lock()

  def note(msg: str) -> None:
    with lock:
      out.write(f"[launch] {msg}\n")
      out.flush()

  devices_per_process, why = resolve_devices_per_process(devices_per_process, base)
  if devices_per_process is not None:
    note(f"{num_processes} processes x {devices_per_process} simulated CPU device(s) ({why})")
  procs, pumps = [], []
  width = len(str(num_processes - 1))
  for i in range(num_processes):
    e = child_env(base, i, num_processes, f"{host}:{port}", devices_per_process,
                  heartbeat_timeout, init_timeout)
    p = subprocess.Popen(command_line(command), env=e, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    procs.append(p)
    t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i:0{width}d}] " if prefix else "",
                                             out, lock), daemon=True)
    t.start()
    pumps.append(t)
  code = _supervise(procs, note, grace, timeout)
  for t in pumps:
    t.join(timeout=5)
  if code == 0:
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
    # A child killed by a signal is the cause; the others' codes follow from it.
    failed.sort(key=lambda f: f[1] >= 0)
    for i, c in failed:
      note(f"process {i} {_how(c)}")
    if failed:
      code = _exit_code(failed[0][1])
  return code


def _supervise(procs: list[subprocess.Popen], note: Any, grace: float,
               timeout: float | None) -> int:
  """Waits for the children; on the first failure gives the others ``grace`` seconds, then
  stops them (also past ``timeout``, or on Ctrl-C). Returns the exit code so far."""
  start = time.monotonic()
  code = 0
  failed_at = None
  try:
    while True:
      codes = [p.poll() for p in procs]
      if all(c is not None for c in codes):
        break
      for i, c in enumerate(codes):
        if c not in (None, 0) and failed_at is None:
          code = _exit_code(c)
          failed_at = time.monotonic()
          note(f"process {i} {_how(c)}; giving the others {grace:g}s to stop")
      if failed_at is not None and time.monotonic() - failed_at > grace:
        note("terminating the remaining processes")
        _stop(procs)
        break
      if timeout is not None and time.monotonic() - start > timeout:
        note(f"run exceeded --timeout {timeout:g}s; terminating every process")
        _stop(procs)
        code = code or 124
        break
      time.sleep(0.05)
  except KeyboardInterrupt:
    note("interrupted; terminating every process")
    _stop(procs)
    code = code or 130
  return code


def _exit_code(c: int) -> int:
  return 128 - c if c < 0 else c


def _how(c: int) -> str:
  """How a child ended, from its return code: ``was killed by SIGKILL (code 137)``."""
  if c < 0:
    try:
      name = signal.Signals(-c).name
    except ValueError:
      name = f"signal {-c}"
    return f"was killed by {name} (code {_exit_code(c)})"
  return f"exited with code {c}"


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``python -m zerojax.tools.launch`` (and of ``zerojax launch``)."""
  a = parse_args(argv)
  return launch(a.command, a.num_processes, devices_per_process=a.devices_per_process,
                host=a.host, port=a.port, heartbeat_timeout=a.heartbeat_timeout,
                init_timeout=a.init_timeout, grace=a.grace, timeout=a.timeout,
                prefix=not a.no_prefix)


if __name__ == "__main__":
  sys.exit(main())
