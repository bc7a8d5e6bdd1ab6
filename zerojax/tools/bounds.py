"""The numbers each training setting takes, as data: one `Bound` per numeric field of the
training options, the fine-tuning options and DeepSpeed's scheduler parameters.

Every place a number enters (a ``key=value`` override, a zerojax file's ``train:`` section, a
DeepSpeed ``optimizer.params`` or ``scheduler.params`` entry, an ``"auto"`` resolved from the
run) checks it against the same `Bound`, and the error names the key as it was given there.
JAX-free, like the option classes that use it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

from zerojax.core.config import ConfigError

__all__ = ["Bound", "TRAIN_BOUNDS", "FINETUNE_BOUNDS", "SCHEDULER_BOUNDS", "check_values"]


@dataclasses.dataclass(frozen=True)
class Bound:
  """The values one numeric setting takes.

  Attributes:
    integer: only integers (``True``/``False`` are never numbers here).
    low, high: the range's ends, ``None`` for unbounded; values are always finite.
    low_open, high_open: whether ``low`` / ``high`` themselves are excluded.
    none: what ``None`` (``null``) means, when it is allowed; ``""`` when it is not.
  """

  integer: bool = False
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  none: str = ""

  def allowed(self) -> str:
    """The allowed values in words, e.g. ``'a finite number in [0, 1)'``."""
    what = "an integer" if self.integer else "a finite number"
    if self.low is not None and self.high is not None:
      what += (f" in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
               f"{')' if self.high_open else ']'}")
    elif self.low is not None:
      what += f" {'>' if self.low_open else '>='} {self.low:g}"
    elif self.high is not None:
      what += f" {'<' if self.high_open else '<='} {self.high:g}"
    return what + (f", or null ({self.none})" if self.none else "")

  def accepts(self, value: Any) -> bool:
    """Whether ``value`` is one of the allowed values."""
    if value is None:
      return bool(self.none)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      return False
    if self.integer and not isinstance(value, numbers.Integral):
      return False
    if not math.isfinite(value):
      return False
    if self.low is not None and (value <= self.low if self.low_open else value < self.low):
      return False
    return self.high is None or (value < self.high if self.high_open else value <= self.high)

  def check(self, key: str, value: Any) -> Any:
    """``value`` when allowed; else a `ConfigError` naming ``key``, the value and the range.

    Args:
      key: the setting as the user gave it: ``'lr'``, ``'optimizer.params.betas[1]'``.
      value: the value given.

    Returns:
      ``value``, unchanged.
    """
    if not self.accepts(value):
      raise ConfigError(f"{key}={value!r} is invalid: {self.allowed()}")
    return value


_POSITIVE = Bound(low=0, low_open=True)
_NONNEGATIVE = Bound(low=0)
_COUNT = Bound(integer=True, low=1)
_STEPS = Bound(integer=True, low=0)
_UNIT = Bound(low=0, high=1)
_BETA = Bound(low=0, high=1, high_open=True)

# `zerojax.tools.options.TrainOptions`' numeric fields. A test checks that every int or float
# field of the class is here, so a new one cannot go unchecked.
TRAIN_BOUNDS: dict[str, Bound] = {
    "seq_len": Bound(integer=True, low=1, none="the model's"),
    "steps": _COUNT, "batch": _COUNT, "lr": _POSITIVE, "warmup_steps": _STEPS,
    "b1": _BETA, "b2": _BETA, "eps": _POSITIVE, "weight_decay": _NONNEGATIVE,
    "momentum": _BETA, "seed": _STEPS,
    "log_every": _COUNT, "cpu_devices": _COUNT, "checkpoint_every": _STEPS,
}

# `zerojax.tools.finetune.FinetuneOptions`' numeric fields.
FINETUNE_BOUNDS: dict[str, Bound] = {
    "eval_every": _STEPS, "lora": _STEPS, "lora_alpha": _POSITIVE,
}

# DeepSpeed's scheduler parameters, under ``scheduler.params``.
SCHEDULER_BOUNDS: dict[str, Bound] = {
    "warmup_min_lr": _NONNEGATIVE, "warmup_max_lr": _POSITIVE, "warmup_num_steps": _STEPS,
    "total_num_steps": _COUNT, "warmup_min_ratio": _UNIT, "cos_min_ratio": _UNIT,
}


def check_values(values: Mapping[str, Any], bounds: Mapping[str, Bound],
                 key: str = "{}") -> None:
  """Checks every entry of ``values`` that ``bounds`` covers.

  Args:
    values: settings by name.
    bounds: their `Bound` by name (names it lacks are not numbers and are left alone).
    key: how the error names a setting, ``{}`` standing for its name, e.g.
      ``'scheduler.params.{}'``.
  """
  for name, value in values.items():
    if name in bounds:
      bounds[name].check(key.format(name), value)
