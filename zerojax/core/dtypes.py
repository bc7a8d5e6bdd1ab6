"""Where the compute dtype is applied, and the check that it reached the model's matmuls.

Master parameters rest in ``param_dtype``; a layer reads them in ``compute_dtype``. The cast is
made where each parameter is read (or gathered), so stage-3 all-gathers move the compute dtype,
and its transpose brings each gradient back to the master dtype.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import jax
from flax import nnx
import jax.numpy as jnp
from flax.core import meta

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


_DOT = re.compile(r"(?:stablehlo|mhlo)\.dot(?:_general)?\b.*?:\s*\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)")


def check_compute_dtype(cfg: ZeroConfig, lowered: Any) -> None:
  """``compute_dtype`` must reach the model's matrix multiplications: counted in the lowered
  step (forward and backward). None of them in it is an error (the setting did nothing); some
  in float32 (a model that upcasts, or reads its parameters past zerojax) is a warning."""
  dots = [(a.rsplit("x", 1)[-1], b.rsplit("x", 1)[-1]) for a, b in _DOT.findall(lowered.as_text())]
  if not dots:
    return
  wide = sum(1 for a, b in dots if a in ("f32", "f64") and b in ("f32", "f64"))
  what = (f"compute_dtype={cfg.compute_dtype!r}: {wide} of the step's {len(dots)} matrix "
          "multiplications (forward and backward) still take float32 operands")
  if wide == len(dots):
    raise ConfigError(
        f"{what}, so the setting does nothing to this model. zerojax casts parameters where "
        "the model reads them (linen state.apply_fn, plain pytree models) and sets dtype on "
        "NNX layers that leave it None; a model that reads parameters another way must set "
        "its own dtype. Or drop compute_dtype")
  if wide:
    warnings.warn(f"zerojax: {what} (a model that upcasts on its own, or reads parameters past "
                  "zerojax, keeps them)", stacklevel=3)
