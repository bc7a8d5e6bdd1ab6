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


# -- 5. argument types are checked where they enter --------------------------------------------


def _plan():
  cfg = zerojax.ZeroConfig(stage=3)
  return zerojax.ShardingPlan.create(cfg, zerojax.make_mesh(cfg), {"w": jnp.zeros((64, 64))})


def test_text_batches_refuses_the_method_and_takes_the_plans_batch_sharding():
  from zerojax.runtime.data import TextBatches
  plan = _plan()
  tokens = np.arange(1000, dtype=np.int32) % 256
  with pytest.raises(TypeError) as e:
    TextBatches(tokens, 16, 8, sharding=plan.batch)
  msg = str(e.value)
  assert "sharding=" in msg and "(method)" in msg and "jax.sharding.Sharding" in msg
  assert "plan.batch()" in msg
  with pytest.raises(TypeError, match=r"global_batch='16' \(str\)"):
    TextBatches(tokens, "16", 8)
  with pytest.raises(ValueError, match=r"seq_len=0 is invalid"):
    TextBatches(tokens, 16, 0)
  with pytest.raises(TypeError, match="tokens must be a 1-D numpy array"):
    TextBatches(list(tokens), 16, 8)
  b = next(TextBatches(tokens, 16, 8, sharding=plan.batch()))
  assert b["x"].shape == (16, 8) and b["x"].sharding == plan.batch()
  assert b["x"].sharding == plan.batch({"x": b["x"]})["x"]
  from zerojax.runtime import data
  assert "plan.batch()" in data.TextBatches.__doc__
  assert "from ``plan.batch``)" not in data.TextBatches.__doc__


# -- 6. import and --help start nothing -------------------------------------------------------


def test_import_and_help_load_no_jax_backend():
  code = ("import sys, zerojax\n"
          "assert 'jax' not in sys.modules, 'import zerojax imported jax'\n"
          "from zerojax.tools import cli\n"
          "try:\n  cli.main(['--help'])\nexcept SystemExit:\n  pass\n"
          "assert 'jax' not in sys.modules, '--help imported jax'\n"
          "print('ok')\n")
  r = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stdout + r.stderr
  assert r.stderr == "", r.stderr  # libtpu's "Failed to find host bounds" block, for one


def test_commands_on_shapes_start_only_the_cpu_backend():
  code = ("from zerojax.tools import cli\n"
          "import contextlib, io\n"
          "with contextlib.redirect_stdout(io.StringIO()):\n"
          "  assert cli.main(['plan', '--model', 'tiny', '--devices', '8']) == 0\n"
          "import jax\n"
          "print(sorted({d.platform for d in jax.devices()}), jax.device_count())\n")
  r = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip() == "['cpu'] 8", r.stdout
  assert "host bounds" not in r.stderr and "TPU" not in r.stderr, r.stderr


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


