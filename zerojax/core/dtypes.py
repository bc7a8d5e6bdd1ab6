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
           "with_compute_dtype", "check_compute_dtype"]


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


def _dtype_unset(path: Any, mod: Any) -> bool:
  """Whether NNX layer ``mod`` leaves its compute dtype to its operands."""
  if not isinstance(mod, nnx.Module) or "dtype" not in vars(mod):
    return False
  # ``nnx.Embed`` stores an unset dtype as its table's (``dtype or embedding.dtype``), which
  # would start the residual stream in the master weights' dtype.
  return mod.dtype is None or (isinstance(mod, nnx.Embed) and mod.dtype == mod.param_dtype)


def with_compute_dtype(node: Any, dtype: Any) -> Any:
  """``node`` (NNX modules, or a graph holding them) as the step runs it: every layer that
  leaves its dtype unset computes in ``dtype``, casting its parameters and input where it
  reads them.

  Args:
    node: the NNX graph, e.g. ``(model, optimizer)``; it is not changed.
    dtype: the compute dtype, or None to keep every layer as written.

  Returns:
    A new graph sharing ``node``'s arrays (``nnx.with_attributes``), or ``node`` itself when
    ``dtype`` is None.
  """
  if dtype is None:
    return node
  return nnx.with_attributes(node, only=_dtype_unset, raise_if_not_found=False, dtype=dtype)


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
