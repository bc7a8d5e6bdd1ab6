"""Reading a settings file: one mapping in JSON or YAML, strictly.

A key given twice in one mapping is refused (JSON and YAML would let the second silently win),
and every error names the file and, where the parser knows it, the line and column. Knows
nothing of `ZeroConfig`: `zerojax.core.config.read_config_file` raises these errors as
`ConfigError`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import yaml

__all__ = ["MappingFileError", "read_mapping"]


class MappingFileError(ValueError):
  """A settings file that is empty, malformed or not a mapping; the message names the file."""


def read_mapping(path: str | os.PathLike, *, allow_empty: bool = False) -> dict[str, Any]:
  """The mapping in a ``.json``, ``.yaml`` or ``.yml`` file.

  Raises:
    FileNotFoundError: the file does not exist.
    MappingFileError: naming the file (and the line where the parser knows it) when its
      extension is unknown, it is empty (unless ``allow_empty``: then ``{}``), is not valid
      JSON/YAML, repeats a key in one mapping, or does not hold a mapping.
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"zerojax config file {path!r} does not exist")
  if not path.endswith((".yaml", ".yml", ".json")):
    raise MappingFileError(f"config file {path!r}: unknown extension; use .json, .yaml or .yml")
  with open(path) as f:
    text = f.read()
  if not text.strip() or (path.endswith((".yaml", ".yml")) and _yaml_is_empty(text)):
    if allow_empty:
      return {}
    raise MappingFileError(f"config file {path!r} is empty; write the settings to use (e.g. "
                           "'stage: 2'), or pass no config file to run with the defaults")
  try:
    if path.endswith((".yaml", ".yml")):
      try:
        d = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
      except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        line = text.splitlines()[mark.line] if mark and mark.line < len(text.splitlines()) else ""
        hint = ("; YAML does not allow tab characters for indentation, use spaces"
                if "\t" in line or "'\\t'" in str(e.problem) else "")
        raise MappingFileError(f"config file {path!r}{where}: not valid YAML: {e.problem}"
                               + (f" ({e.context})" if e.context else "") + hint) from None
      except yaml.YAMLError as e:
        raise MappingFileError(f"config file {path!r}: not valid YAML: {e}") from None
    else:
      try:
        d = json.loads(text, object_pairs_hook=_json_pairs)
      except json.JSONDecodeError as e:
        raise MappingFileError(f"config file {path!r}, line {e.lineno}, column {e.colno}: "
                               f"not valid JSON: {e.msg}") from None
  except _Duplicate as e:
    lines = f" (lines {e.first} and {e.again})" if e.first else ""
    raise MappingFileError(f"config file {path!r}: key {e.key!r} is given twice in one mapping"
                           f"{lines}; each key may appear once (the second would silently replace "
                           "the first)") from None
  if not isinstance(d, Mapping):
    raise MappingFileError(f"config file {path!r} must hold a mapping of settings, got "
                           f"{type(d).__name__}")
  return dict(d)


class _Duplicate(Exception):
  def __init__(self, key: Any, first: int | None = None, again: int | None = None):
    super().__init__(key, first, again)
    self.key, self.first, self.again = key, first, again


class _StrictLoader(yaml.SafeLoader):
  """``SafeLoader`` that refuses a key given twice in one mapping (it would silently win)."""

  def construct_mapping(self, node, deep=False):
    if isinstance(node, yaml.MappingNode):
      seen: dict[Any, int] = {}
      for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
          continue  # `<<: *anchor` merges are meant to be overridden
        key = self.construct_object(key_node, deep=True)
        try:
          if key in seen:
            raise _Duplicate(key, seen[key] + 1, key_node.start_mark.line + 1)
        except TypeError:  # an unhashable key: SafeLoader reports it below
          continue
        seen[key] = key_node.start_mark.line
    return super().construct_mapping(node, deep)


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for k, v in pairs:
    if k in out:
      raise _Duplicate(k)
    out[k] = v
  return out


def _yaml_is_empty(text: str) -> bool:
  """Whether a YAML document has only comments, blank lines and document markers."""
  for line in text.splitlines():
    s = line.strip()
    if s and not s.startswith("#") and s not in ("---", "..."):
      return False
  return True
