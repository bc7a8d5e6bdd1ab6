"""Shared test models and training runs (imported by conftest and tests)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import zerojax
from zerojax.models import GPT, GPTConfig, loss_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def all_eqns(jaxpr: Any):
  """Every equation of ``jaxpr`` and of the jaxprs its equations hold, depth first."""
  for e in jaxpr.eqns:
    yield e
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      yield from all_eqns(sub)


def child_env(devices: int | None = 8, **overrides: str | None) -> dict[str, str]:
  """The environment of a Python subprocess a test starts: this process's, with its XLA flags
  (the -O0 of tests/conftest.py included: a child compiles as the parent does, so results match
  bit for bit) and its compilation cache, and the repository root on PYTHONPATH.

  ``devices`` replaces the device-count flag (8, the parent's, by default); ``None`` leaves the
  count out, for a child that sets its own or whose launcher does. ``overrides`` set variables,
  or remove them where the value is None.
  """
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
  if devices is not None:
    flags.append(f"{_DEVICE_COUNT_FLAG}={devices}")
  env["XLA_FLAGS"] = " ".join(flags)
  env.pop("JAX_NUM_CPU_DEVICES", None)  # the count is the flag's alone
  paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
  env["PYTHONPATH"] = os.pathsep.join([ROOT] + paths)
  for k, v in overrides.items():
    if v is None:
      env.pop(k, None)
    else:
      env[k] = v
  return env


# vocab 250 does not divide by 8: the head bias stays replicated (indivisible).
TINY = GPTConfig(vocab_size=250, seq_len=32, num_layers=2, num_heads=4, d_model=64)
STEPS = 10
BATCH = 16
THRESHOLD = 64


def make_tx():
  # Adam divides by sqrt(v): for an element whose gradient is near zero, fp32 reduction-order
  # noise (which differs between any two device layouts) becomes an lr-sized update. eps=1e-6
  # bounds that amplification to lr * noise / eps, so a 1e-5 parity bound tests zerojax, not
  # the order of floating-point sums.
  return optax.adamw(1e-3, eps=1e-6, weight_decay=0.1)


def batches(cfg: GPTConfig, n: int = STEPS, batch: int = BATCH, seed: int = 1):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    t = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len + 1), dtype=np.int32)
    out.append({"x": t[:, :-1], "y": t[:, 1:]})
  return out


def train_step(state, batch):
  """A plain Flax train step, written as without zerojax."""
  def lf(params):
    return loss_fn(state.apply_fn({"params": params}, batch["x"]), batch["y"])
  loss, grads = jax.value_and_grad(lf)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def nnx_train_step(model, optimizer, batch):
  """The same step for Flax NNX: ``(model, optimizer, batch) -> metrics``."""
  from flax import nnx

  def lf(m):
    return loss_fn(m(batch["x"]), batch["y"])
  loss, grads = nnx.value_and_grad(lf)(model)
  optimizer.update(model, grads)
  return {"loss": loss}


@dataclasses.dataclass
class Run:
  losses: list
  params: Any  # numpy tree
  state: Any = None
  plan: Any = None
  step: Any = None


def reference_run(cfg: GPTConfig, steps: int = STEPS) -> Run:
  dev = jax.devices()[0]
  model = GPT(cfg)
  data = batches(cfg, steps)
  with jax.default_device(dev):
    params = model.init(jax.random.key(0), jnp.asarray(data[0]["x"]))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=make_tx())
    step = jax.jit(train_step)
    losses = []
    for b in data:
      state, m = step(state, jax.device_put(b, dev))
      losses.append(float(m["loss"]))
  return Run(losses, jax.tree.map(np.asarray, state.params))


def zero_run(cfg: GPTConfig, stage: int, steps: int = STEPS, **config_kw) -> Run:
  model = GPT(cfg)
  data = batches(cfg, steps)
  zc = zerojax.ZeroConfig.from_flat(dict(stage=stage, param_persistence_threshold=THRESHOLD,
                                         **config_kw))
  state, plan = zerojax.create_train_state(model, make_tx(), jax.random.key(0),
                                           jnp.asarray(data[0]["x"]), config=zc)
  step = zerojax.zero_step(plan)(train_step)
  losses = []
  for b in data:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return Run(losses, jax.tree.map(np.asarray, state.params), state, plan, step)


def assert_parity(run: Run, ref: Run, tol: float = 1e-5):
  np.testing.assert_allclose(run.losses, ref.losses, rtol=tol, atol=tol)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=tol, atol=tol),
               run.params, ref.params)
