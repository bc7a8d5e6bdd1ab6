"""Every numeric setting is checked wherever it is given (#52): the cases are generated from
the schema (`zerojax.tools.bounds`), each through every way the setting can be given."""

import dataclasses
import json
import math
import typing

import pytest

from zerojax.core.config import ConfigError
from zerojax.tools import bounds
from zerojax.tools.config_file import load_config
from zerojax.tools.options import SCHEDULERS, TrainOptions


def _invalid(b: bounds.Bound) -> list:
  """Values ``b`` must refuse, derived from ``b`` itself."""
  out = [math.nan, math.inf, -math.inf, True, "x"]
  if not b.none:
    out.append(None)
  if b.integer:
    out.append((b.low or 0) + 0.5)
  if b.low is not None:
    out.append(b.low if b.low_open else b.low - 1)
  if b.high is not None:
    out.append(b.high if b.high_open else b.high + 1)
  return out


def _valid(b: bounds.Bound) -> list:
  """Edge values ``b`` must take."""
  out = []
  if b.low is not None:
    out.append(b.low + (1 if b.integer else 1e-3) if b.low_open else b.low)
  if b.high is not None:
    out.append(b.high - (1 if b.integer else 1e-3) if b.high_open else b.high)
  return [int(v) if b.integer else float(v) for v in out] + ([None] if b.none else [])


def _text(v) -> str:
  """``v`` as an override writes it (YAML: null, true, .nan, .inf)."""
  return {None: "null", True: "true"}.get(v, repr(v)) if not isinstance(v, float) or \
      math.isfinite(v) else {math.inf: ".inf", -math.inf: "-.inf"}.get(v, ".nan")


def _cases(table):
  return [(name, b, v) for name, b in table.items() for v in _invalid(b)]


def test_every_numeric_option_has_a_bound():
  """A new int or float field of the option classes cannot go unchecked."""
  from zerojax.tools.finetune import FinetuneOptions
  for cls, table in ((TrainOptions, bounds.TRAIN_BOUNDS),
                     (FinetuneOptions, bounds.FINETUNE_BOUNDS)):
    hints = typing.get_type_hints(cls)
    numeric = {f.name for f in dataclasses.fields(cls)
               if set(typing.get_args(hints[f.name]) or (hints[f.name],)) & {int, float}}
    assert numeric == set(table), (cls.__name__, numeric ^ set(table))
  params = set().union(*SCHEDULERS.values()) - {"warmup_type"}
  assert params == set(bounds.SCHEDULER_BOUNDS)


@pytest.mark.parametrize("name, bound, value", _cases(bounds.TRAIN_BOUNDS))
def test_override_refused_naming_the_key(name, bound, value):
  with pytest.raises(ConfigError) as e:
    load_config(None, [f"{name}={_text(value)}"], apply_xla_flags=False)
  msg = str(e.value)
  assert msg.startswith(f"{name}=") and bound.allowed() in msg and "\n" not in msg


@pytest.mark.parametrize("name, bound, value", _cases(bounds.TRAIN_BOUNDS))
def test_zerojax_file_refused_naming_file_and_key(name, bound, value, tmp_path):
  p = tmp_path / "z.json"
  p.write_text(json.dumps({"stage": 3, "train": {name: value}}, allow_nan=True))
  with pytest.raises(ConfigError) as e:
    load_config(p, apply_xla_flags=False)
  msg = str(e.value)
  assert str(p) in msg and f"TrainOptions.{name}=" in msg and bound.allowed() in msg


_OPTIMIZER_KEYS = {"lr": "lr", "eps": "eps", "weight_decay": "weight_decay",
                   "momentum": "momentum", "betas[0]": "b1", "betas[1]": "b2"}


@pytest.mark.parametrize("key, value", [(k, v) for k, f in _OPTIMIZER_KEYS.items()
                                        for v in _invalid(bounds.TRAIN_BOUNDS[f])
                                        if v is not None])
def test_deepspeed_optimizer_params_refused_naming_the_key(key, value, tmp_path):
  params = {"lr": 1e-3}
  if key.startswith("betas"):
    betas = [0.9, 0.999]
    betas[int(key[6])] = value
    params["betas"] = betas
  else:
    params[key] = value
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({"zero_optimization": {"stage": 3},
                           "optimizer": {"type": "AdamW", "params": params}}))
  with pytest.raises(ConfigError) as e:
    load_config(p, apply_xla_flags=False)
  msg = str(e.value)
  assert f"optimizer.params.{key}=" in msg and str(p) in msg
  assert bounds.TRAIN_BOUNDS[_OPTIMIZER_KEYS[key]].allowed() in msg


@pytest.mark.parametrize("kind, name, value", [
    (kind, name, v) for kind, names in SCHEDULERS.items() for name in sorted(names)
    if name != "warmup_type" for v in _invalid(bounds.SCHEDULER_BOUNDS[name])
    if v is not None])
def test_deepspeed_scheduler_params_refused_naming_the_key(kind, name, value, tmp_path):
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({"zero_optimization": {"stage": 3},
                           "scheduler": {"type": kind, "params": {name: value}}}))
  with pytest.raises(ConfigError) as e:
    load_config(p, apply_xla_flags=False)
  msg = str(e.value)
  assert f"scheduler.params.{name}=" in msg and str(p) in msg
  assert bounds.SCHEDULER_BOUNDS[name].allowed() in msg


def test_deepspeed_scheduler_warmup_type_refused(tmp_path):
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({"zero_optimization": {"stage": 3},
                           "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}}))
  with pytest.raises(ConfigError, match=r"scheduler.params.warmup_type='exp' is invalid: "
                                        r"'log' or 'linear'"):
    load_config(p, apply_xla_flags=False)


@pytest.mark.parametrize("name, bound, value", [
    c for c in _cases(bounds.TRAIN_BOUNDS) if c[0] in ("lr", "b1", "b2", "eps", "weight_decay",
                                                      "warmup_steps", "steps")])
def test_auto_resolved_from_a_bad_override_names_the_override(name, bound, value, tmp_path):
  """A DeepSpeed "auto" copies the run's setting: a bad one is named as the run gave it."""
  p = tmp_path / "ds.json"
  p.write_text(json.dumps({
      "zero_optimization": {"stage": 3},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                "weight_decay": "auto"}},
      "scheduler": {"type": "WarmupDecayLR", "params": {
          "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}}}))
  with pytest.raises(ConfigError) as e:
    load_config(p, [f"{name}={_text(value)}"], apply_xla_flags=False)
  assert str(e.value).startswith(f"{name}=") and bound.allowed() in str(e.value)


@pytest.mark.parametrize("table", ["TRAIN_BOUNDS", "SCHEDULER_BOUNDS", "FINETUNE_BOUNDS"])
def test_edge_values_are_taken(table):
  for name, b in getattr(bounds, table).items():
    for v in _valid(b):
      assert b.check(name, v) == v


@pytest.mark.parametrize("name, bound, value", _cases(bounds.TRAIN_BOUNDS))
def test_python_api_refuses_too(name, bound, value):
  with pytest.raises(ConfigError, match=f"TrainOptions.{name}="):
    TrainOptions(**{name: value})


@pytest.mark.parametrize("name, bound, value", _cases(bounds.FINETUNE_BOUNDS))
def test_finetune_options_refused_naming_the_flag(name, bound, value, tmp_path):
  from zerojax.tools.finetune import FinetuneOptions
  with pytest.raises(ConfigError) as e:
    FinetuneOptions(model_dir=str(tmp_path), data=str(tmp_path / "d.jsonl"), **{name: value})
  assert str(e.value).startswith(f"--{name.replace('_', '-')}=") and bound.allowed() in str(
      e.value)
