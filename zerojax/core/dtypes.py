"""Where the compute dtype is applied, and the check that it reached the model's matmuls.

Master parameters rest in ``param_dtype``; a layer reads them in ``compute_dtype``. The cast is
made where each parameter is read (or gathered), so stage-3 all-gathers move the compute dtype,
and its transpose brings each gradient back to the master dtype.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import jax
from flax import nnx
import jax.numpy as jnp
from flax.core import meta

from zerojax._compat import subjaxprs
from zerojax.core.config import ConfigError, ZeroConfig

__all__ = ["compute_dtype_of", "reduce_dtype_of", "to_compute", "cast", "cast_shapes",
           "set_nnx_dtype", "check_compute_dtype"]


def compute_dtype_of(cfg: Any) -> Any:
  """The dtype parameters and floating inputs are cast to where the model reads them, or None
  when the config computes in the parameters' own dtype."""
  cd = jnp.dtype(cfg.compute_dtype)
  return None if cd == jnp.dtype(cfg.param_dtype) else cd


def reduce_dtype_of(cfg: Any) -> Any:
  """The dtype the config names for gradient reductions, or None to keep the gradient's."""
  return jnp.dtype(cfg.reduce_dtype) if cfg.reduce_dtype else None


def to_compute(tree: Any, dtype: Any) -> Any:
  """``tree`` with its floating arrays cast to ``dtype`` (None: unchanged). The cast's
  transpose brings each gradient back to its parameter's dtype (the master weights')."""
  if dtype is None:
    return tree

  def one(x):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
      return jnp.asarray(x).astype(dtype)
    return x
  return jax.tree.map(one, tree)


def cast(tree, dtype):
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def cast_shapes(tree, dtype):
  def one(x):
    if isinstance(x, meta.AxisMetadata):
      return x.replace_boxed(one(x.unbox()))
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jax.ShapeDtypeStruct(x.shape, dtype)
    return x
  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))


def set_nnx_dtype(model: Any, dtype: Any) -> None:
  """Sets ``dtype`` on every NNX layer of ``model`` that leaves it unset (``None``: promote
  the operands), so the layer casts its parameters and input to the compute dtype where it
  reads them. ``model`` is the step's own merged copy, so the user's module is unchanged."""
  if dtype is None:
    return
  for _, mod in nnx.iter_modules(model):
    if "dtype" not in vars(mod):
      continue
    # ``nnx.Embed`` stores an unset dtype as its table's (``dtype or embedding.dtype``), which
    # would start the residual stream in the master weights' dtype.
    unset = mod.dtype is None or (isinstance(mod, nnx.Embed) and mod.dtype == mod.param_dtype)
    if unset:
      mod.dtype = dtype


def _dot_operands(jaxpr: Any) -> Iterator[tuple[Any, Any]]:
  """The operand dtypes of every ``dot_general`` in ``jaxpr`` and the jaxprs nested in it."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      yield eqn.invars[0].aval.dtype, eqn.invars[1].aval.dtype
    for inner in subjaxprs(eqn.params):
      yield from _dot_operands(inner)


def check_compute_dtype(cfg: ZeroConfig, traced: Any) -> None:
  """The compute dtype must reach the model's matrix multiplications: counted in the traced
  step (``jax.jit(...).trace(...)``: its jaxpr holds forward and backward). None of them in it
  is an error (the setting did nothing); some in float32 (a model that upcasts, or reads its
  parameters past zerojax) is a warning.

  Args:
    cfg: the config; its ``precision.compute`` is checked.
    traced: the traced step.

  Raises:
    ConfigError: every matrix multiplication of the step takes float32 operands.
  """
  wide_types = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))
  dots = list(_dot_operands(traced.jaxpr.jaxpr))
  if not dots:
    return
  wide = sum(1 for a, b in dots if a in wide_types and b in wide_types)
  what = (f"precision.compute={cfg.precision.compute!r}: {wide} of the step's {len(dots)} "
          "matrix multiplications (forward and backward) still take float32 operands")
  if wide == len(dots):
    raise ConfigError(
        f"{what}, so the setting does nothing to this model. zerojax casts parameters where "
        "the model reads them (linen state.apply_fn, plain pytree models) and sets dtype on "
        "NNX layers that leave it None; a model that reads parameters another way must set "
        "its own dtype. Or drop precision.compute")
  if wide:
    warnings.warn(f"zerojax: {what} (a model that upcasts on its own, or reads parameters past "
                  "zerojax, keeps them)", stacklevel=3)
