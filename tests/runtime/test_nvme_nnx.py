"""The NVMe optimizer state (ZeRO-Infinity) with a Flax NNX model.

An NNX model goes through `zerojax.create_nnx`, as without NVMe: with
``config.offload=NvmeOffload(path)`` the plan's ``nvme`` is the `NvmeOptimizer`, and
``zerojax.zero_step(plan)(train_step)(model, optimizer, batch)`` runs the same NNX
``train_step`` as in memory.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest
from flax import nnx

import zerojax
from tests import helpers
from zerojax.core.config import ConfigError, ZeroConfig
from zerojax.models import nnx_gpt

CFG = dataclasses.replace(helpers.TINY, scan=False)  # nnx_gpt's blocks are unscanned
STEPS = 6
nnx_train_step = helpers.nnx_train_step  # the NNX step of tests/core/test_step.py


def _model():
  return nnx_gpt(CFG, nnx.Rngs(0))


def _params(model) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param)))]


def _runs(tmp_path, stage: int):
  """``(in-memory losses, params), (NVMe losses, params, NvmeOptimizer, nnx.Optimizer, last
  metrics)`` after `STEPS` steps of each."""
  data = helpers.batches(CFG, STEPS)
  zc = ZeroConfig(stage=stage, gather=zerojax.Gather(persistence_threshold=helpers.THRESHOLD))
  model, optimizer, plan = zerojax.create_nnx(_model, helpers.make_tx(), config=zc)
  step = zerojax.zero_step(plan)(nnx_train_step)
  ref = [np.float32(step(model, optimizer, b)["loss"]) for b in data]
  ref_params = _params(model)
  zn = zc.replace(offload=zerojax.NvmeOffload(str(tmp_path), chunk_size=20000, buffer_count=3))
  model, optimizer, plan = zerojax.create_nnx(_model, helpers.make_tx(), config=zn)
  opt, nstep = plan.nvme, zerojax.zero_step(plan)(nnx_train_step)
  got, metrics = [], {}
  for b in data:
    metrics = nstep(model, optimizer, b)
    got.append(np.float32(metrics["loss"]))
  return (ref, ref_params), (got, _params(model), opt, optimizer, metrics)


# About 20 s for the first stage on 2 cores, less for the next (the in-memory programs and the
# host update are compiled once).
# Stage 1 on NVMe is covered for linen (tests/runtime/test_nvme.py); here 2 and 3 keep CI's time.
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_nnx_bit_identical_to_in_memory(tmp_path, stage):
  (ref, ref_params), (got, params, opt, optimizer, metrics) = _runs(tmp_path, stage)
  assert [x.tobytes() for x in got] == [x.tobytes() for x in ref]
  assert len(params) == len(ref_params)
  for a, b in zip(ref_params, params):
    assert a.tobytes() == b.tobytes()
  assert ref[-1] < ref[0]  # it trains
  # The optimizer state is in this process's files, not in the NNX optimizer.
  assert opt.store.step == STEPS == int(optimizer.step[...]) and opt.stats.chunks > 1
  assert opt.directory.endswith(os.path.join("zerojax-nvme", "process-0"))
  assert set(nnx.as_pure(optimizer.opt_state)) == {"grads", "norm"}
  assert metrics["nvme_wall_s"] > 0 and np.isfinite(metrics["nvme_read_mb_s"])


@pytest.mark.parametrize("on_nvme", [False, True])
def test_create_train_state_points_an_nnx_model_to_create_nnx(tmp_path, on_nvme):
  zc = ZeroConfig(stage=3, offload=zerojax.NvmeOffload(str(tmp_path)) if on_nvme else None)
  x = np.zeros((8, CFG.seq_len), np.int32)
  with pytest.raises(ConfigError,
                     match=r"takes a linen model .*got NGPT.*zerojax\.create_nnx") as e:
    zerojax.create_train_state(_model(), helpers.make_tx(), jax.random.key(0), x, config=zc)
  assert (e.value.field, e.value.value) == ("model", "NGPT")
  assert not os.listdir(tmp_path)  # refused before any file


def test_nvme_create_nnx_refuses_loss_scaling(tmp_path):
  zn = ZeroConfig(stage=3, offload=zerojax.NvmeOffload(str(tmp_path)), loss_scale=0)
  with pytest.raises(ConfigError, match="loss_scale") as e:
    zerojax.create_nnx(_model, helpers.make_tx(), config=zn)
  assert e.value.field == "loss_scale"
  assert not os.listdir(tmp_path)


def test_create_nnx_refuses_restoring_and_overwrite_together(tmp_path):
  zn = ZeroConfig(stage=3, offload=zerojax.NvmeOffload(str(tmp_path)))
  with pytest.raises(ConfigError, match="restoring=True .* overwrite=True") as e:
    zerojax.create_nnx(_model, helpers.make_tx(), config=zn, overwrite=True, restoring=True)
  assert e.value.field == "restoring"
  assert not os.listdir(tmp_path)
