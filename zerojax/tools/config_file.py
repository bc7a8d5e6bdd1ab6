"""Config files, for the library and the CLI alike: one loader for zerojax and DeepSpeed files.

``zerojax.load_config(path, overrides)`` reads a ``.json``/``.yaml`` file, tells DeepSpeed's
format (``zero_optimization``) from zerojax's, and returns everything the file says: the
`ZeroConfig`, training options (a zerojax file's ``train:`` section, DeepSpeed's optimizer,
scheduler and ``steps_per_print``), the XLA flags DeepSpeed keys map to, and a note per
DeepSpeed key. `ZeroConfig.from_file` reads zerojax files only and sends DeepSpeed files here,
so nothing a file says is dropped silently.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Mapping, Sequence

import yaml

from zerojax.core.config import (ConfigError, ZeroConfig, did_you_mean, in_file, read_config_file,
                                 unknown_key_error)
from zerojax.core import validation
from zerojax.core.policies import POLICIES
from zerojax.tools import deepspeed
from zerojax.tools.bounds import TRAIN_BOUNDS, check_values
from zerojax.tools.options import TrainOptions, deepspeed_train_fields

__all__ = ["LoadedConfig", "load_config", "parse_overrides", "parse_value"]


@dataclasses.dataclass
class LoadedConfig:
  """A config file resolved for a run.

  Attributes:
    config: the `ZeroConfig` (overrides applied).
    train: `zerojax.tools.options.TrainOptions` fields from the file (a ``train:`` section of a
      zerojax file, or DeepSpeed's optimizer/scheduler/steps_per_print) and the overrides.
    notes: what each DeepSpeed key became (empty for zerojax files).
    xla_flags: XLA flags set for DeepSpeed keys.
    deepspeed: whether the file was in DeepSpeed format.
  """

  config: ZeroConfig
  train: dict[str, Any]
  notes: list[str]
  xla_flags: list[str]
  deepspeed: bool = False


def parse_value(text: str) -> Any:
  """An override's value: int, float, or YAML (``[2,4]``, ``true``, ``null``, strings).

  ``None`` is null too: the command's help prints the defaults as Python writes them.
  """
  if text.strip() == "None":
    return None
  for conv in (int, float):
    try:
      return conv(text)
    except ValueError:
      pass
  try:
    return yaml.safe_load(text)
  except yaml.YAMLError:
    return text


def parse_overrides(pairs: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
  """Splits ``key=value`` pairs into (`ZeroConfig` fields, `TrainOptions` fields)."""
  zfields = set(validation.FLAT_DEFAULTS)  # the flat spelling: one key per setting
  tfields = set(TrainOptions.fields())
  zc, tr = {}, {}
  for pair in pairs:
    if "=" not in pair:
      raise ConfigError(f"override {pair!r} is not key=value (e.g. stage=2 or steps=100)")
    key, _, text = pair.partition("=")
    key = key.strip().lstrip("-").replace("-", "_")
    value = parse_value(text)
    if key.startswith("train."):
      key = key[len("train."):]
      if key not in tfields:
        raise ConfigError(f"override {pair!r}: unknown training option {key!r}"
                          f"{did_you_mean(key, tfields)}; allowed are {sorted(tfields)}")
      tr[key] = value
    elif key in zfields:
      zc[key] = value
    elif key in tfields:
      tr[key] = value
    else:
      raise ConfigError(f"override {pair!r}: unknown key {key!r}"
                        f"{did_you_mean(key, zfields | tfields)}; allowed are ZeroConfig fields "
                        f"{sorted(zfields)} and training options {sorted(tfields)}")
  check_values(tr, TRAIN_BOUNDS)  # named as given, before a DeepSpeed "auto" copies one
  return zc, tr


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = (), *,
                apply_xla_flags: bool = True, for_training: bool = True) -> LoadedConfig:
  """Loads a zerojax or DeepSpeed config file (or defaults when ``path`` is None).

  A zerojax file holds `ZeroConfig` fields and optionally a ``train:`` section of
  `TrainOptions`; a file with ``zero_optimization`` is a DeepSpeed config. DeepSpeed keys that
  map to XLA flags are added to ``XLA_FLAGS`` when ``apply_xla_flags`` (call before JAX starts).

  A DeepSpeed ``"auto"`` takes the run's own setting (``overrides``, and the training
  options' defaults where those are the run's: see `zerojax.tools.deepspeed.map_deepspeed`);
  each choice is a note. With ``for_training`` (a run is about to start), an ``"auto"`` that
  nothing resolves is a `ConfigError` naming the key and how to set it; without (planning,
  showing a config), it stays a note and the `ZeroConfig` keeps its default there.

  Args:
    path: the YAML or JSON config file, or ``None`` for the defaults.
    overrides: ``KEY=VALUE`` settings applied over the file (config fields or training
      options).
    apply_xla_flags: add the XLA flags of DeepSpeed keys to ``XLA_FLAGS``.
    for_training: a run is about to start: an unresolved DeepSpeed ``"auto"`` is an error.

  Returns:
    The `LoadedConfig`: the `ZeroConfig`, the training options, notes and XLA flags.

  Raises:
    ConfigError: the file cannot be read or parsed, a key or override is unknown or invalid
      (the message names a close match), or an ``"auto"`` is unresolved for training.
  """
  d: dict[str, Any] = {}
  if path is not None:
    try:
      d = read_config_file(path)
    except FileNotFoundError as e:  # the CLI reports config problems as ConfigError
      raise ConfigError(str(e)) from None
  zover, tover = parse_overrides(overrides)
  notes, flags, train = [], [], {}
  with in_file(path):  # errors from the file's contents name the file
    if deepspeed.is_deepspeed(d):
      m = deepspeed.map_deepspeed(d, given={**tover, **zover})
      if for_training:
        m.require_resolved()
      config, notes, flags = m.config, list(m.notes), list(m.xla_flags)
      train = deepspeed_train_fields(m.train)
    else:
      train = d.pop("train", None)
      if train is None:
        train = {}
      if not isinstance(train, Mapping):
        raise ConfigError(f"'train'={train!r} is invalid: a mapping of training options")
      train = dict(train)
      unknown = set(train) - set(TrainOptions.fields())
      if unknown:
        raise unknown_key_error("unknown training option", unknown, TrainOptions.fields(),
                                " in 'train'")
      _deepspeed_lookalike(d)
      config = ZeroConfig.from_dict(d)
    TrainOptions(**train)  # a bad value in the file is reported against the file
  if deepspeed.is_deepspeed(d) and apply_xla_flags:
    m.apply_xla_flags()
  if zover:
    config = ZeroConfig.from_flat({**config.to_flat(), **zover})
  train.update(tover)
  return LoadedConfig(config, train, notes, flags, bool(notes or flags) or
                      deepspeed.is_deepspeed(d))


def _deepspeed_lookalike(d: Mapping[str, Any]) -> None:
  """A file read as a zerojax config (it has no top-level ``zero_optimization``) whose keys
  are DeepSpeed's, or closer to a DeepSpeed key than to any `ZeroConfig` field (e.g. the
  British ``zero_optimisation``), fails naming the DeepSpeed key: ``ZeroConfig has no field``
  would send the user to the wrong list."""
  fields = set(validation.FLAT_DEFAULTS) | set(POLICIES)
  ds_keys = sorted(deepspeed.TOP_LEVEL_KEYS - fields)
  score = lambda a, b: difflib.SequenceMatcher(None, a, b).ratio()
  exact, near = [], {}
  for key in (k for k in d if isinstance(k, str) and k not in fields):
    if key in ds_keys:
      exact.append(key)
      continue
    close = difflib.get_close_matches(key, ds_keys, n=1, cutoff=0.75)
    if close and score(key, close[0]) > max((score(key, f) for f in fields), default=0):
      near[key] = close[0]
  how = ("a file is read as a DeepSpeed config when it has a top-level 'zero_optimization' "
         "section")
  if near:
    key, ds_key = next(iter(near.items()))
    raise ConfigError(f"{key!r} is not a zerojax setting; did you mean DeepSpeed's {ds_key!r}? "
                      f"({how}; without one the file is a zerojax config, whose keys are "
                      "ZeroConfig fields)")
  if exact:
    what = "is a DeepSpeed key" if len(exact) == 1 else "are DeepSpeed keys"
    raise ConfigError(f"{', '.join(map(repr, exact))} {what}"
                      f", but this file has no top-level 'zero_optimization' ({how}): add "
                      "\"zero_optimization\": {\"stage\": N} (DeepSpeed's default stage is 0), or "
                      "write zerojax's ZeroConfig fields instead")
