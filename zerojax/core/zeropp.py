"""ZeRO++'s quantised collectives (qwZ, qgZ): the model per device inside ``jax.shard_map``.

Under XLA's partitioner a layer's gradient is a partial sum that only the partitioner sees,
so no code can quantise what each device sends. With ``quantize_weights`` or
``quantize_gradients`` the step therefore runs a linen model per device on its batch shard
(``jax.shard_map`` over the data axes) and writes out every collective of the parameters
(`zerojax.core.gather.ManualGather`): an all-gather of each stage-3 weight where its layer reads it
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

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zerojax.core.config import ConfigError
from zerojax.core.gather import ManualGather, ZeroParam
from zerojax.core.plan import ShardingPlan

__all__ = ["explain", "manual_gather", "shard_map_apply"]


def explain(config: Any) -> list[str]:
  """What ZeRO++ quantisation does under ``config`` (`zerojax config` prints it); ``[]`` if
  none is on."""
  c = config
  if not c.quantized:
    return []
  bs = c.quantize_block_size
  out = []
  if c.quantize_weights is not None:
    back = ("quantised too (quantize_weights_backward=true)" if c.quantize_weights_backward
            else "in full precision (quantize_weights_backward=false); each scanned layer is "
                 "then re-run whole in its backward pass")
    out.append(f"qwZ quantize_weights={c.quantize_weights!r}: each stage-3 forward all-gather "
               f"moves {c.quantize_weights} values plus one float32 scale per {bs} elements "
               f"and is dequantised to {c.compute_dtype} after the gather; the backward "
               f"re-gather moves {back}; master weights and the optimizer update stay "
               f"{c.param_dtype}")
  if c.quantize_gradients is not None:
    out.append(f"qgZ quantize_gradients={c.quantize_gradients!r}: each gradient is reduced by "
               f"quantising the chunk each device owns ({c.quantize_gradients}, one float32 "
               f"scale per {bs} elements), one all-to-all, and a float32 sum on the owner, in "
               "place of the reduce-scatter")
  out.append("the model runs per device on its batch shard inside jax.shard_map (a linen model "
             "called through state.apply_fn; `zerojax plan` shows the blocks and padding of "
             "each leaf)")
  return out


def manual_gather(plan: ShardingPlan) -> ManualGather:
  """The plan's quantisation settings as the boxes' collective."""
  c = plan.config
  return ManualGather("fsdp", c.quantize_weights, c.quantize_weights_backward,
                      c.quantize_gradients, c.quantize_block_size, jnp.dtype(c.compute_dtype))


def _pad(spec: P, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(tuple(spec)))


def shard_map_apply(body: Callable[[Any, tuple, dict], Any], plan: ShardingPlan, params: Any,
                    args: tuple, kwargs: dict, how: ManualGather | None = None) -> Any:
  """``body(boxed_params, args, kwargs)`` run per device over the plan's data axes, with every
  parameter in a `ZeroParam` box whose collective is ``how`` (default: `manual_gather`)."""
  mesh, axes = plan.mesh, plan.data_axes
  dp = plan.data_parallel_size
  how = how or manual_gather(plan)
  reduce_dtype = jnp.dtype(plan.config.reduce_dtype) if plan.config.reduce_dtype else None
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
  array_specs, is_key = [], []
  for i, x in enumerate(arrays):
    key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    is_key.append(key)
    if key or jnp.ndim(x) == 0:
      array_specs.append(P())
    elif np.shape(x)[0] % dp:
      raise ConfigError(
          f"quantize_weights/quantize_gradients run the model per device on its batch shard: "
          f"model argument {i} has shape {np.shape(x)}, whose leading (batch) dimension "
          f"{np.shape(x)[0]} does not divide by the data-parallel size {dp} (axes {axes})")
    else:
      array_specs.append(P(axes))

  def local(ins, arrays):
    boxes = []
    for v, r, c, g in zip(ins, rest, comp, grad):
      boxes.append(ZeroParam(v, mesh, r, c, g, reduce_dtype, manual=how))
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
