"""The error every bad setting raises, and the wording of unknown-key errors.

Its own module so that `zerojax.core.config` and the policies it is built from
(`zerojax.core.policies`) raise the same `ConfigError` without importing each other.
"""

from __future__ import annotations

import difflib
from typing import Any

__all__ = ["ConfigError", "invalid_setting", "did_you_mean", "unknown_key_error"]


class ConfigError(ValueError):
  """A setting zerojax does not allow.

  Raised by `ZeroConfig` for a field whose value is not allowed (the message names the field,
  the value and what is allowed), and by config files and mappings that cannot be read as one
  (unknown keys, inconsistent batch sizes, a file that is not a mapping).

  Attributes:
    field: the setting refused, as the message spells it (``'offload.params'``,
      ``'LossScale.window'``, a flat keyword), or ``None`` where the error is not about one
      setting's value. `zerojax.core.config.setting_of` turns any spelling into the dotted one.
    value: the value refused (with ``field``).
    allowed: what is allowed instead (with ``field``).
  """

  def __init__(self, message: str, *, field: str | None = None, value: Any = None,
               allowed: str | None = None):
    super().__init__(message)
    self.field, self.value, self.allowed = field, value, allowed


def invalid_setting(field: str, value: Any, allowed: str) -> ConfigError:
  """The error for one setting's refused value.

  Args:
    field: the setting, as the message names it (``'mesh_shape'``, ``'offload.params'``).
    value: the value refused.
    allowed: what is allowed instead.

  Returns:
    A `ConfigError` (not raised): ``ZeroConfig.<field>=<value> is invalid: <allowed>``, with
    the three as its attributes.
  """
  return ConfigError(f"ZeroConfig.{field}={value!r} is invalid: {allowed}", field=field,
                     value=value, allowed=allowed)


def did_you_mean(key: str, allowed: Any) -> str:
  """The suggestion for a mistyped key.

  Args:
    key: the unknown key.
    allowed: the keys allowed there.

  Returns:
    `` (did you mean 'stage'?)`` for the closest allowed key, or ``''`` if none is close.
  """
  close = difflib.get_close_matches(str(key), [str(a) for a in allowed], n=1, cutoff=0.6)
  return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key_error(what: str, unknown: Any, allowed: Any, where: str = "",
                      allowed_text: str = "allowed keys are",
                      suggest_from: Any = None) -> ConfigError:
  """The error for keys outside ``allowed``.

  Args:
    what: the message's start, e.g. ``'ZeroConfig has no field'``.
    unknown: the unknown keys (at least one).
    allowed: the keys allowed there.
    where: where the first unknown key is, appended to it.
    allowed_text: the words before the list of allowed keys.
    suggest_from: the keys a suggestion is drawn from, when more than ``allowed`` (default:
      ``allowed``).

  Returns:
    A `ConfigError` (not raised) that names the first unknown key, suggests the closest allowed
    key, names the other unknown keys and lists the allowed ones.
  """
  unknown = sorted(unknown, key=str)
  more = f" (unknown keys: {unknown})" if len(unknown) > 1 else ""
  hint = did_you_mean(unknown[0], allowed if suggest_from is None else suggest_from)
  return ConfigError(f"{what} {unknown[0]!r}{where}{hint}{more}; "
                     f"{allowed_text} {sorted(allowed)}")
