"""ZeRO++'s quantised collectives (qwZ, qgZ): the model per device inside ``jax.shard_map``.

Under XLA's partitioner a layer's gradient is a partial sum that only the partitioner sees,
so no code can quantise what each device sends. With ``quantize_weights`` or
``quantize_gradients`` the step therefore runs a linen model per device on its batch shard
(``jax.shard_map`` over the data axes) and writes out every collective of the parameters
(`ManualGather`): an all-gather of each stage-3 weight where its layer reads it
(qwZ: int8 values plus a float32 scale per block, `zerojax.core.quantize.all_gather`), and a
reduce-scatter of its gradient where the backward pass makes it (qgZ: a quantised all-to-all
summed in float32, `zerojax.core.quantize.reduce_scatter`). Outside the model, the loss and the
optimizer run as before; the master parameters and the update stay in full precision.

The model's array arguments are split over the data axes on their leading (batch) dimension,
and every output must be batch-leading, as a per-example model's logits are. PRNG keys are
passed whole, folded with the device's data-parallel index so each batch shard draws its own
numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from zerojax.core import quantize as q
from zerojax.core.config import ConfigError
from zerojax.core.dtypes import reduce_dtype_of, to_compute
from zerojax.core.context import tracing
from zerojax.core.gather import GATHERED, ZeroParam, after
from zerojax.core.plan import ShardingPlan

__all__ = ["explain", "manual_gather", "shard_map_apply"]


def _fsdp_dim(spec: tuple, axis: str) -> int | None:
  for d, s in enumerate(spec):
    if s == axis or (isinstance(s, tuple) and axis in s):
      return d
  return None


# Name scopes of `ManualGather`'s collectives (in the HLO's op_name metadata).
GATHER_SCOPE, REGATHER_SCOPE, REDUCE_SCOPE = "zerojax_gather", "zerojax_regather", "zerojax_reduce"


@dataclasses.dataclass(frozen=True)
class ManualGather:
  """How a `ZeroParam` reaches its layer inside ``jax.shard_map`` (the quantised formulation,
  `zerojax.core.zeropp`), where each device computes on its own batch shard and every collective
  is written out. By the box's layouts:

  * sharded at rest (stage 3): all-gather over ``axis`` (qwZ: quantised), and its gradient
    reduce-scattered back to the shard (qgZ: quantised all-to-all, summed in float32);
  * replicated at rest, sharded gradient (stage 2; stage-3 leaves under the persistence
    threshold): the box holds ``(weight, sink)``, the sink being the gradient's shard; the
    gradient is reduce-scattered into the sink (qgZ: quantised);
  * replicated gradient: used as it is; ``shard_map`` sums its gradient over the devices.
  """

  axis: str = "fsdp"
  weights: str | None = None
  weights_backward: bool = False
  gradients: str | None = None
  block_size: int = 256
  compute_dtype: Any = None  # what a quantised gather dequantises to (None: the param's)

  def __call__(self, box: "ZeroParam") -> jax.Array:
    rest_dim = _fsdp_dim(box.at_rest, self.axis)
    grad_dim = _fsdp_dim(box.grad, self.axis)
    if rest_dim is not None and _fsdp_dim(box.compute, self.axis) is None:
      if grad_dim != rest_dim:
        raise ValueError(f"zerojax: a parameter sharded at rest as {box.at_rest} needs its "
                         f"gradient sharded on the same dimension, not {box.grad}")
      backward = tracing().in_backward
      quantize = self.weights if (self.weights_backward or not backward) else None
      v = after(box.value, tracing().wait_for)
      if quantize is None:  # full precision is the compute dtype, as the forward pass computed
        v = to_compute(v, self.compute_dtype or box.compute_dtype)
      # Named so that HLO metadata tells the forward gather from the backward re-gather.
      with jax.named_scope(REGATHER_SCOPE if backward else GATHER_SCOPE):
        out = _manual_gather(v, self, rest_dim, quantize, box.reduce_dtype,
                             jnp.dtype(v.dtype))
      return checkpoint_name(out, GATHERED)
    if isinstance(box.value, tuple):
      w, sink = box.value
      cd = self.compute_dtype or box.compute_dtype
      return _into_sink(to_compute(w, cd), sink, self, grad_dim, box.reduce_dtype)
    return to_compute(box.value, self.compute_dtype or box.compute_dtype)

  def reduce(self, ct: jax.Array, dim: int, reduce_dtype: Any, sum_dtype: Any = None
             ) -> jax.Array:
    """This device's shard of the sum of every device's ``ct``; qgZ's float32 sum is returned
    in ``sum_dtype`` (default: ``ct``'s)."""
    dtype = ct.dtype
    with jax.named_scope(REDUCE_SCOPE):
      if self.gradients is not None:
        return q.reduce_scatter(ct, self.axis, dim, self.gradients, self.block_size,
                                sum_dtype or dtype)
      if reduce_dtype is not None:
        ct = ct.astype(reduce_dtype)
      return jax.lax.psum_scatter(ct, self.axis, scatter_dimension=dim,
                                  tiled=True).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _manual_gather(w, how: ManualGather, dim: int, quantize: str | None, reduce_dtype,
                   dtype: Any):
  """All-gather of ``w`` (of ``dtype``) along ``dim``: in full precision, or quantised and
  dequantised straight to ``how.compute_dtype`` (no full-size copy in ``dtype``)."""
  if quantize is None:
    return jax.lax.all_gather(w, how.axis, axis=dim, tiled=True)
  return q.all_gather(w, how.axis, dim, quantize, how.block_size, how.compute_dtype or dtype)


def _manual_gather_fwd(w, how, dim, quantize, reduce_dtype, dtype):
  return _manual_gather(w, how, dim, quantize, reduce_dtype, dtype), None


def _manual_gather_bwd(how, dim, quantize, reduce_dtype, dtype, _, ct):
  # Reduced in the dtype the weight was used in (the compute dtype a quantised gather
  # dequantised to; reduce_dtype if set), as a full-precision gather's gradient is: reducing
  # in the parameter's float32 moved twice the bytes. qgZ sums in float32 whatever it gets.
  return (how.reduce(ct, dim, reduce_dtype, dtype).astype(dtype),)


_manual_gather.defvjp(_manual_gather_fwd, _manual_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _into_sink(w, sink, how: ManualGather, dim: int, reduce_dtype):
  return w


def _into_sink_fwd(w, sink, how, dim, reduce_dtype):
  return w, None


def _into_sink_bwd(how, dim, reduce_dtype, _, ct):
  return None, how.reduce(ct, dim, reduce_dtype)


_into_sink.defvjp(_into_sink_fwd, _into_sink_bwd)


def explain(config: Any) -> list[str]:
  """What ZeRO++ quantisation does under ``config`` (`zerojax config` prints it); ``[]`` if
  none is on."""
  if config.quantize is None:
    return []
  q, p = config.quantize, config.precision
  bs = q.block_size
  out = []
  if q.weights is not None:
    why = ("quantize.weights_backward=True" if q.weights_backward is not None
           else "quantize.weights_backward=None: the same as quantize.weights")
    back = (f"{q.weights} values too ({why})" if config.quantizes_backward
            else f"full-precision {p.compute} weights (quantize.weights_backward=False); "
                 "each scanned layer is then re-run whole in its backward pass")
    out.append(f"qwZ quantize.weights={q.weights!r}: each stage-3 forward all-gather "
               f"moves {q.weights} values plus one float32 scale per {bs} elements "
               f"and is dequantised to {p.compute} after the gather; the backward "
               f"re-gather moves {back}; master weights and the optimizer update stay "
               f"{p.param}")
  if q.gradients is not None:
    out.append(f"qgZ quantize.gradients={q.gradients!r}: each gradient is reduced by "
               f"quantising the chunk each device owns ({q.gradients}, one float32 "
               f"scale per {bs} elements), one all-to-all, and a float32 sum on the owner, in "
               "place of the reduce-scatter")
  out.append("the model runs per device on its batch shard inside jax.shard_map (a linen model "
             "called through state.apply_fn; `zerojax plan` shows the blocks and padding of "
             "each leaf)")
  return out


def manual_gather(plan: ShardingPlan) -> ManualGather:
  """The plan's quantisation settings as the boxes' collective."""
  c = plan.config
  return ManualGather("fsdp", c.quantize_weights, c.quantizes_backward,
                      c.quantize_gradients, c.quantize_block_size, jnp.dtype(c.compute_dtype))


def _pad(spec: P, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(tuple(spec)))


def _array_specs(arrays: list, dp: int, axes: tuple) -> tuple[list, list]:
  """The model's array arguments split on their leading (batch) dimension over ``axes``; PRNG
  keys and scalars whole. Also which arguments are keys."""
  specs, is_key = [], []
  for i, x in enumerate(arrays):
    key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    is_key.append(key)
    if key or jnp.ndim(x) == 0:
      specs.append(P())
    elif np.shape(x)[0] % dp:
      raise ConfigError(
          f"quantize_weights/quantize_gradients run the model per device on its batch shard: "
          f"model argument {i} has shape {np.shape(x)}, whose leading (batch) dimension "
          f"{np.shape(x)[0]} does not divide by the data-parallel size {dp} (axes {axes})")
    else:
      specs.append(P(axes))
  return specs, is_key


def shard_map_apply(body: Callable[[Any, tuple, dict], Any], plan: ShardingPlan, params: Any,
                    args: tuple, kwargs: dict, how: ManualGather | None = None) -> Any:
  """``body(boxed_params, args, kwargs)`` run per device over the plan's data axes, with every
  parameter in a `ZeroParam` box whose collective is ``how`` (default: `manual_gather`)."""
  mesh, axes = plan.mesh, plan.data_axes
  dp = plan.data_parallel_size
  how = how or manual_gather(plan)
  reduce_dtype = reduce_dtype_of(plan.config)
  leaves, treedef = jax.tree.flatten(params)
  rest = [_pad(s.spec, jnp.ndim(x)) for s, x in zip(jax.tree.leaves(plan.params), leaves)]
  comp = [_pad(s.spec, jnp.ndim(x)) for s, x in
          zip(jax.tree.leaves(plan.params_gathered), leaves)]
  grad = [_pad(s.spec, jnp.ndim(x)) for s, x in zip(jax.tree.leaves(plan.grads), leaves)]
  sharded = lambda spec: any(s is not None for s in spec)
  ins, in_specs = [], []
  for x, r, g in zip(leaves, rest, grad):
    if sharded(r) or not sharded(g) or not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      ins.append(x)
      in_specs.append(P(*r))
    else:  # replicated weight, sharded gradient: the gradient's shard arrives in a sink
      ins.append((jax.lax.stop_gradient(x), x))
      in_specs.append((P(*r), P(*g)))

  flat, argdef = jax.tree.flatten((args, kwargs))
  dyn = [isinstance(x, (jax.Array, np.ndarray)) for x in flat]
  arrays = [x for x, d in zip(flat, dyn) if d]
  array_specs, is_key = _array_specs(arrays, dp, axes)

  def local(ins, arrays):
    boxes = []
    for v, r, c, g in zip(ins, rest, comp, grad):
      boxes.append(ZeroParam(v, mesh, r, c, g, reduce_dtype, manual=how,
                             barrier=plan.backend.waits_by_barrier))
    index = jax.lax.axis_index(axes)
    vals = [jax.random.fold_in(a, index) if k else a for a, k in zip(arrays, is_key)]
    it = iter(vals)
    a, kw = jax.tree.unflatten(argdef, [next(it) if d else x for x, d in zip(flat, dyn)])
    return body(jax.tree.unflatten(treedef, boxes), a, kw)

  def checked(ins, arrays):
    out = local(ins, arrays)
    for path, y in jax.tree_util.tree_leaves_with_path(out):
      if jnp.ndim(y) == 0:
        raise ConfigError(
            f"quantize_weights/quantize_gradients run the model per device on its batch "
            f"shard, so each output must be batch-leading; output "
            f"{jax.tree_util.keystr(path) or '(the output)'} is a scalar. Return per-example "
            "values and reduce them in the loss")
    return out

  return jax.shard_map(checked, mesh=mesh, in_specs=(in_specs, array_specs),
                       out_specs=P(axes), check_vma=False)(ins, arrays)
