"""Batch sizes: train = micro x accumulation x data-parallel; any two infer the third;
inconsistent values fail at start, naming all four numbers."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import zerojax
from zerojax import ConfigError, ZeroConfig
from tests import helpers, prec_helpers as ph


@pytest.mark.parametrize("given, want", [
    (dict(train_batch_size=64, micro_batch_per_device=2), (64, 2, 4)),
    (dict(train_batch_size=64, gradient_accumulation_steps=4), (64, 2, 4)),
    (dict(micro_batch_per_device=2, gradient_accumulation_steps=4), (64, 2, 4)),
    (dict(train_batch_size=64, micro_batch_per_device=2, gradient_accumulation_steps=4),
     (64, 2, 4)),
    (dict(train_batch_size=16), (16, 2, 1)),
    (dict(micro_batch_per_device=3), (24, 3, 1)),
])
def test_batch_any_two_infer_the_third(given, want):
  assert ZeroConfig.from_flat(given).batch_sizes(8) == want
  _, plan = ph.abstract_state_and_plan(ZeroConfig.from_flat(
      dict(stage=2, param_persistence_threshold=helpers.THRESHOLD, **given)))
  assert plan.batch_sizes == want and plan.accumulation_steps == want[2]


@pytest.mark.parametrize("given", [
    dict(train_batch_size=64, micro_batch_per_device=2, gradient_accumulation_steps=3),
    dict(train_batch_size=60, micro_batch_per_device=2),
    dict(train_batch_size=60, gradient_accumulation_steps=4),
])
def test_batch_inconsistent_names_all_four_numbers(given):
  with pytest.raises(ConfigError) as e:
    ZeroConfig.from_flat(given).batch_sizes(8)
  msg = str(e.value)
  for k in ("train_batch_size", "micro_batch_per_device", "gradient_accumulation_steps",
            "data-parallel size=8"):
    assert k in msg, msg
  for k, v in given.items():
    assert f"{k}={v}" in msg, msg


def test_batch_inconsistent_fails_at_start():
  zc = ZeroConfig(stage=3,
                  batch=zerojax.Batch(global_size=64, micro_per_device=2, accumulation_steps=3))
  with pytest.raises(ConfigError, match="gradient_accumulation_steps=3"):
    zerojax.create_train_state(ph.GPT(ph.CFG), ph.sgd(), jax.random.key(0),
                               jnp.zeros((16, ph.CFG.seq_len), jnp.int32), config=zc)
  _, plan = ph.abstract_state_and_plan(ZeroConfig(stage=3))
  plan = dataclasses.replace(plan, config=zc)  # a plan built without create_train_state
  with pytest.raises(ConfigError, match="train_batch_size=64"):
    zerojax.zero_step(plan)


def test_batch_global_batch_must_equal_train_batch_size():
  zc = ZeroConfig(stage=2, gather=zerojax.Gather(persistence_threshold=helpers.THRESHOLD),
                  batch=zerojax.Batch(global_size=32, micro_per_device=2))
  state, plan = ph.abstract_state_and_plan(zc)
  step = zerojax.zero_step(plan)(ph.zero_train_step)
  b = ph.data(1)[0]  # 16 rows
  with pytest.raises(ConfigError) as e:
    step.lower(state, b)
  msg = str(e.value)
  assert all(s in msg for s in ("16 rows", "train_batch_size=32", "micro_batch_per_device=2",
                                "gradient_accumulation_steps=2", "data-parallel size=8"))


def test_batch_accumulation_steps_alone_split_the_fed_batch():
  zc = ZeroConfig(stage=2, gather=zerojax.Gather(persistence_threshold=helpers.THRESHOLD),
                  batch=zerojax.Batch(accumulation_steps=4))
  state, plan = ph.abstract_state_and_plan(zc)
  assert plan.batch_sizes is None and plan.accumulation_steps == 4
  step = zerojax.zero_step(plan)(ph.zero_train_step)
  b = ph.data(1)[0]  # 16 rows cannot split into 4 micro-batches over 8 devices
  with pytest.raises(ConfigError, match="gradient_accumulation_steps=4 micro-batches over "
                     "data-parallel size=8"):
    step.lower(state, b)
