"""The environment of a multi-process run: the variables a launcher sets and
`zerojax.core.distributed.initialize` reads, their defaults, and reading them.

JAX-free, so that the launcher (``zerojax launch``) starts without importing JAX.

The timeouts' variables and defaults are tabled in `zerojax.core.distributed`;
``ZEROJAX_AGREEMENT_TIMEOUT`` (default 120) bounds how long
`zerojax.core.agreement.check_agreement` waits for the other processes.
"""

from __future__ import annotations

import os

__all__ = ["ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "ENV_CPU_DEVICES",
           "ENV_INIT_TIMEOUT", "ENV_HEARTBEAT_TIMEOUT", "ENV_SHUTDOWN_TIMEOUT",
           "ENV_AGREEMENT_TIMEOUT", "ENV_PEER_WATCH", "DEFAULT_INIT_TIMEOUT",
           "DEFAULT_HEARTBEAT_TIMEOUT", "DEFAULT_SHUTDOWN_TIMEOUT", "DEFAULT_AGREEMENT_TIMEOUT",
           "DistributedInitError"]

ENV_COORDINATOR = "ZEROJAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "ZEROJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZEROJAX_PROCESS_ID"
ENV_CPU_DEVICES = "ZEROJAX_CPU_DEVICES"
ENV_INIT_TIMEOUT = "ZEROJAX_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "ZEROJAX_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "ZEROJAX_SHUTDOWN_TIMEOUT"
ENV_AGREEMENT_TIMEOUT = "ZEROJAX_AGREEMENT_TIMEOUT"
ENV_PEER_WATCH = "ZEROJAX_PEER_WATCH"  # 0: no peer watch (`zerojax.core.peers`)

DEFAULT_INIT_TIMEOUT = 300
DEFAULT_HEARTBEAT_TIMEOUT = 100
DEFAULT_SHUTDOWN_TIMEOUT = 300
DEFAULT_AGREEMENT_TIMEOUT = 120


class DistributedInitError(RuntimeError):
  """The distributed runtime could not start (unreachable coordinator, bad settings)."""


def env_int(name: str) -> int | None:
  """The integer in an environment variable.

  Args:
    name: the variable's name.

  Returns:
    Its value as an ``int``; ``None`` when it is unset or empty.

  Raises:
    DistributedInitError: the value is not an integer.
  """
  v = os.environ.get(name)
  if v is None or v == "":
    return None
  try:
    return int(v)
  except ValueError:
    raise DistributedInitError(f"environment variable {name}={v!r} is not an integer") from None


def timeout_seconds(value: float | None, env: str, default: float) -> float:
  """A timeout: ``value``, else environment variable ``env``, else ``default``.

  Args:
    value: the timeout given as an argument, in seconds, or ``None``.
    env: the environment variable to read when ``value`` is ``None``.
    default: the timeout when neither is set.

  Returns:
    The timeout in seconds, as a float.

  Raises:
    DistributedInitError: the variable is not a number, or the timeout is not > 0.
  """
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


def first_line(e: BaseException) -> str:
  """The first line of an exception's message, as an error quotes its cause.

  Args:
    e: the exception.

  Returns:
    The first line of ``str(e)``, at most 500 characters (empty for an empty message).
  """
  s = str(e).strip()
  return s.splitlines()[0][:500] if s else ""
