"""A newcomer's first hour (issue 26): DeepSpeed "auto" values, README snippets, argument types,
a quiet and fast start, one throughput, the estimate's stage-3 peak, models with no or integer
parameters, a misspelled DeepSpeed key, and one exit-status convention."""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax.core.config import ConfigError
from zerojax.tools import cli
from zerojax.tools import deepspeed as ds

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _clean_env(**extra) -> dict:
  """A fresh shell's environment: none of this session's JAX settings."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  env.update(extra)
  return env


# -- 10. models with no or integer parameters ----------------------------------------------------


class _NoParams(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x * 2


class _IntParam(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(), (x.shape[-1], 8))
    n = self.param("count", lambda *_: jnp.zeros((), jnp.int32))
    return x @ w + n


@pytest.mark.parametrize("model, error, match", [
    (_NoParams(), ValueError, r"_NoParams\.init\(\.\.\.\) made no parameters"),
    (_IntParam(), TypeError, r"\['count'\] \(int32\[\]\) .*not floating point"),
])
def test_create_train_state_names_what_it_cannot_train(model, error, match):
  cfg = zerojax.ZeroConfig(stage=3)
  with pytest.raises(error, match=match):
    zerojax.create_train_state(model, optax.adamw(1e-3), jax.random.key(0),
                               jnp.zeros((8, 16)), config=cfg)


