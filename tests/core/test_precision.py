"""Mixed precision: bf16 compute through Flax ``dtype``, fp32 master params and optimizer state,
configurable gradient-reduction dtype; the plan and the memory estimate show the real dtypes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax.runtime.memory import estimate
from zerojax.models import GPT
from tests import prec_helpers as ph


@pytest.fixture(scope="module")
def lowered():
  run = ph.bf16_run()
  return run.step.lower(run.state, ph.data(1)[0])


@pytest.fixture(scope="module")
def hlo(lowered):
  return lowered.compile().as_text()  # served from JAX's cache: the run compiled it


@pytest.mark.slow
def test_precision_bf16_matches_unsharded_bf16():
  run, ref = ph.bf16_run(), ph.bf16_reference()
  np.testing.assert_allclose([m["loss"] for m in run.metrics],
                             [m["loss"] for m in ref.metrics], rtol=2e-3)
  # bf16 rounding differs with the rows per device and the bf16 reduction; the update must
  # agree to well within bf16's 2**-8 relative precision times a few steps.
  assert ph.relative_update_error(run, ref) < 2e-2


@pytest.mark.slow
def test_precision_master_params_and_optimizer_state_fp32():
  state = ph.bf16_run().state
  for x in jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state):
    assert x.dtype == jnp.float32, x.dtype


def _collectives(hlo, kind):
  pat = re.compile(r"=\s*(.*?)\s" + kind + r"(-start)?\(")
  return [m.group(1) for m in map(pat.search, hlo.splitlines()) if m]


@pytest.mark.slow
def test_precision_hlo_bf16_compute_and_bf16_gradient_reduction(lowered, hlo):
  mlir = lowered.as_text()
  # Compute: the model's matmuls take bf16 operands (the program handed to XLA).
  dots = [l for l in mlir.splitlines() if "dot_general" in l and "tensor<" in l]
  assert dots and all("bf16>" in l for l in dots), dots[:3]
  # Reduction: each parameter's gradient is constrained to its stage-2 layout (the
  # reduce-scatter) as a bf16 tensor: the fp32 gradient is cast to reduce_dtype first.
  cons = re.findall(r"sharding_constraint.*?tensor<([0-9x]*)x?(\w+)>", mlir)
  assert len(cons) >= len(ph.bf16_run().plan.leaves) and {d for _, d in cons} == {"bf16"}, cons
  # Compiled: XLA:CPU has no bf16 all-reduce, so it widens the collective to f32 *after*
  # rounding to bf16: every matrix operand of an all-reduce comes out of a fusion that converts
  # f32 -> bf16 -> f32. (On GPU/TPU the collective itself stays bf16.)
  rounded, total = _bf16_rounded_all_reduce_operands(hlo)
  assert total >= 5 and rounded == total, (rounded, total)


def _bf16_rounded_all_reduce_operands(hlo):
  """``(rounded, total)`` matrix operands of all-reduces whose producing fusion holds bf16."""
  comps = {m.group(1): m.group(2)
           for m in re.finditer(r"^%(\S+) \(.*?\n((?:.*\n)*?)\}", hlo, re.M)}
  calls = dict(re.findall(r"^\s*%(\S+) = .*?calls=%([\w.\-]+)", hlo, re.M))
  rounded = total = 0
  for line in hlo.splitlines():
    m = re.search(r"= (.*?) all-reduce(?:-start)?\((.*?)\)", line)
    if not m:
      continue
    shapes = re.findall(r"f32\[([0-9,]*)\]", m.group(1))
    for shape, arg in zip(shapes, re.sub(r"/\*.*?\*/", "", m.group(2)).split(",")):
      if "," in shape:
        total += 1
        rounded += "bf16[" in comps.get(calls.get(arg.strip().lstrip("%"), ""), "")
  return rounded, total


@pytest.mark.slow
def test_precision_plan_table_shows_dtypes():
  text = ph.bf16_run().plan.table()
  assert ("dtypes: params float32, compute bfloat16, gradients float32, reduced in bfloat16, "
          "optimizer state float32") in text
  assert " float32 " in text.splitlines()[3]  # the first leaf row: fp32 master parameter


def test_precision_memory_estimate_counts_param_dtype():
  shapes = jax.eval_shape(lambda: GPT(ph.BF16).init(jax.random.key(0),
                                                    jnp.zeros((2, 32), jnp.int32))["params"])
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  kw = dict(stage=0, num_devices=8)
  fp32 = estimate(shapes, optax.adam(1e-3), config=zerojax.ZeroConfig(stage=0), **kw)
  bf16 = estimate(shapes, optax.adam(1e-3),
                  config=zerojax.ZeroConfig(stage=0, precision=zerojax.Precision("bfloat16")),
                  **kw)
  assert fp32.params == 4 * n and fp32.grads == 4 * n and fp32.opt_state >= 8 * n
  assert bf16.params == 2 * n and bf16.grads == 2 * n and bf16.opt_state >= 4 * n


def test_precision_reduce_dtype_with_accumulation_stage1():
  # Stages 0-1 accumulate each device's unreduced gradient and reduce once, in reduce_dtype:
  # the traced program sums the leading data-parallel axis (8) of bf16 gradients.
  zc = zerojax.ZeroConfig(stage=1, precision=zerojax.Precision(reduce="bfloat16"),
                          gather=zerojax.Gather(persistence_threshold=64),
                          batch=zerojax.Batch(micro_per_device=1, accumulation_steps=2))
  state, plan = ph.abstract_state_and_plan(zc)
  mlir = zerojax.zero_step(plan)(ph.zero_train_step).lower(state, ph.data(1)[0]).as_text()
  sums = re.findall(r"stablehlo.reduce\(%\S+ init: %\S+\) applies stablehlo.add across "
                    r"dimensions = \[0\] : \(tensor<8x[0-9x]*bf16>", mlir)
  assert len(sums) == len(plan.leaves), len(sums)
