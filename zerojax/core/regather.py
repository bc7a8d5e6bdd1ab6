"""Layer re-gathering: in a model without scans, each layer gathers its weights after its input
exists and again after its output's cotangent exists, so only the computing layer's weights are
gathered in either pass, whatever order XLA schedules the rest in (on XLA:GPU one matmul layer
ahead: `prefetching`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors
from flax import linen as nn
from flax import nnx
from jax.extend.core import get_opaque_trace_state

from zerojax._compat import checkpoint_trace
from zerojax.core import context
from zerojax.core.context import setting, tracing
from zerojax.core.gather import ZeroParam, token_of

__all__ = ["regather_layers", "regather_nnx_layers", "prefetching", "inside_checkpoints",
           "array_args"]


@contextlib.contextmanager
def inside_checkpoints(on: bool) -> Iterator[None]:
  """Entered where the model is traced. With ``on`` (the model's own checkpoints keep their
  policies under zerojax's: see `zerojax.core.remat.save_all_but_gathered`), a layer traced
  inside a model's own checkpoint (``nn.remat``) is not made a custom VJP: its gathers wait
  for its input, and the checkpoint's re-run of the forward pass gathers again for the
  backward pass, which uses those weights. A custom VJP there would gather a third time (its
  own backward re-gather): four collectives per weight instead of ZeRO-3's three."""
  with setting(model_trace=get_opaque_trace_state() if on else None):
    yield


def _in_own_checkpoint() -> bool:
  model = tracing().model_trace
  return model is not None and (trace := checkpoint_trace()) is not None and trace != model


def _checkpointed(call: Callable[[], Any], arrays: list, boxes: list) -> Any:
  """``call()``, a layer inside the model's own checkpoint (`inside_checkpoints`), as written:
  its gathers wait for its input (under `prefetching`, the previous matmul layer's in the same
  checkpoint, `_ahead_of`); the checkpoint's re-run orders them again in the backward pass."""
  wait = arrays
  if (held := tracing().previous) is not None:
    wait = _ahead_of(held[0] if held else None, arrays)
    if _has_matrix(boxes):
      held[:] = [_Previous(arrays, wait, [])]
      if (ctx := context.current()) is not None:
        ctx.layers_ahead = ctx.layers_in_checkpoints = True
  with setting(in_layer=True, wait_for=token_of(wait, boxes[0].barrier)):
    return call()


def regather_layers(next_fun: Callable, args: tuple, kwargs: dict,
                    context: nn.module.InterceptorContext) -> Any:
  """Flax method interceptor: each module that owns stage-3 parameters computes as one layer.

  Use as ``with nn.intercept_methods(regather_layers): model.apply(...)`` with `ZeroParam`-boxed
  parameters (the step does this). A module qualifies when every variable it owns directly is
  a `ZeroParam` and at least one is gathered for compute (``params`` only, no submodules with
  parameters, no other collections, not mutable); others run unchanged and their children are
  looked at in turn. Leaves left replicated (biases, norm scales under
  ``param_persistence_threshold``) pass through as they are, so a ``Dense`` with a replicated
  bias still computes as one layer.
  A qualifying call becomes a ``custom_vjp`` over the module's shards and array arguments:

  * forward: gather the shards after the first float argument exists (`after`; under
    `prefetching`, the previous matmul layer's), run the module; residuals are the shards and
    the arguments, never the gathered weights;
  * backward: gather again after the output cotangent exists (under `prefetching`, the next
    matmul layer's), and differentiate the module
    (its gradient is reduce-scattered by `gather`'s own backward).

  So at most the weights of the computing layer are gathered, in both passes, for any
  schedule; XLA drops what the recomputed forward does not feed.
  """
  module, method = context.module, context.method_name
  if (tracing().in_layer or method == "setup" or (method.startswith("_") and method != "__call__")
      or module.scope is None or module.scope.mutable):
    return next_fun(*args, **kwargs)
  variables = module.variables
  params = variables.get("params", {})
  if (set(variables) != {"params"} or not params
      or not all(isinstance(b, ZeroParam) for b in params.values())
      or not any(b.at_rest != b.compute for b in params.values())):
    return next_fun(*args, **kwargs)

  names, boxes = list(params), list(params.values())
  arrays, rebuild = array_args(args, kwargs)
  if _in_own_checkpoint():
    return _checkpointed(lambda: next_fun(*args, **kwargs), arrays, boxes)
  unbound = module.clone(parent=None)

  def run(shards, arrays, token):
    a, kw = rebuild(arrays)
    boxed = {n: b.replace(value=v) for n, b, v in zip(names, boxes, shards)}
    with setting(in_layer=True, wait_for=token):
      return unbound.apply({"params": boxed}, *a, method=method, **kw)

  try:
    return _layer(run, [b.value for b in boxes], arrays, boxes[0].barrier, _has_matrix(boxes))
  except (flax_errors.InvalidRngError, flax_errors.ScopeCollectionNotFound):
    # The module draws random numbers or writes a collection: run it as it is.
    return next_fun(*args, **kwargs)


# -- one layer ---------------------------------------------------------------------------------

class _Previous:
  """Under `prefetching`, a layer that gathered a matrix: its ``input`` (what the next layer's
  forward gathers wait for) and the ``trace`` it ran in (only a layer in the same trace may
  wait for it); whether a later matmul layer follows it (``next``); and, once that layer's
  backward pass has begun, its output ``cotangent`` (what this layer's re-gathers wait for)
  with the ``cotangent_trace`` it belongs to (per-block ``nn.remat`` traces each block's
  backward pass apart; in another trace a layer waits for its own)."""

  def __init__(self, input: list, waited: list, shards: list):
    self.input, self.trace, self.next = input, get_opaque_trace_state(), False
    self.waited = waited  # what its own forward gathers waited for
    self.shards = shards  # what it gathers (the next matmul layer's backward pass orders them)
    self.cotangent, self.cotangent_trace = None, None
    self.handed_shards = None  # its shards behind the next matmul layer's cotangent

  def input_here(self) -> list | None:
    """``input`` if this trace may read it, else None."""
    return self.input if self.trace == get_opaque_trace_state() else None


def _ahead_of(previous: _Previous | None, arrays: list) -> list:
  """What a matmul layer's forward gathers wait for under `prefetching`: the input of the
  previous matmul layer; where that layer read the same input (the key and value projections
  after the query's, a gated MLP's two input projections), what it waited for, so that siblings
  gather beside the matmul before them, not beside each other's (XLA:GPU often merges the
  siblings' matmuls into one). Where the previous one ran in another trace (the block before,
  inside its own ``nn.remat``), none of its values can be read here: the layer waits for its
  own input, or, under ``prefetching(across_checkpoints=True)``, for nothing."""
  if previous is None:
    return arrays
  before = previous.input_here()
  if before is None:  # another trace
    return [] if tracing().across_checkpoints else arrays
  if not before:
    return arrays
  if len(before) == len(arrays) and all(a is b for a, b in zip(before, arrays)):
    return previous.waited
  return before


@contextlib.contextmanager
def prefetching(on: bool, across_checkpoints: bool = False) -> Iterator[None]:
  """With ``on`` (`Backend.prefetches_next_layer`), each layer's gathers run one matmul
  layer ahead: forward, they wait for the input of the last layer before it that gathered a
  matrix, not for its own input (a layer reading that layer's own input waits for what that
  layer waited for: `_ahead_of`); backward, a matmul layer's re-gathers wait for the output
  cotangent of the next matmul layer, not for its own (except behind the last matmul layer,
  whose own re-gather runs then). So a layer's weights may arrive while its neighbour's
  matmuls run (two matmul layers' weights gathered at most, siblings counting as one);
  waiting for its own input or cotangent leaves nothing to run beside the gather.

  A layer whose previous matmul layer ran in another trace (the first of a block in its own
  ``nn.remat``, or the head after such blocks) cannot wait for that layer's input. With
  ``across_checkpoints`` (`Backend.prefetches_across_checkpoints`) its gathers wait for
  nothing and the scheduler places them, beside the block before's matmuls; without, they
  wait for its own input, with only a norm beside them."""
  # Inside: the `_Previous` layer ([] before one) links the layers, in `Tracing.previous`.
  with setting(previous=[] if on else None, across_checkpoints=on and across_checkpoints):
    yield


def array_args(args: tuple, kwargs: dict) -> tuple[list, Callable[[list], tuple]]:
  """A call's array arguments (what a layer differentiates), and ``rebuild(arrays)``: the call's
  ``(args, kwargs)`` with those arrays in their places."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]

  def rebuild(arrays: list) -> tuple:
    it = iter(arrays)
    return jax.tree.unflatten(treedef, [next(it) if a else x for x, a in zip(leaves, is_array)])

  return [x for x, a in zip(leaves, is_array) if a], rebuild


def _has_matrix(boxes: list) -> bool:
  return any(jnp.ndim(b.value) >= 2 and b.at_rest != b.compute for b in boxes)


def _layer(run: Callable, shards: list, arrays: list, barrier: bool, matrix: bool) -> Any:
  """``run(shards, arrays, token)`` as one layer: a ``custom_vjp`` whose forward pass gathers
  after its first float argument exists (`prefetching`: the previous matmul layer's), keeps the
  shards and arguments as residuals, and whose backward pass re-gathers after the output's
  cotangent exists (`prefetching`: the next matmul layer's) and differentiates ``run`` again."""
  held = tracing().previous
  ahead = held is not None  # `prefetching`
  if token_of(arrays, True) is None:
    held = None
  previous = held[0] if held else None
  wait = _ahead_of(previous, arrays)
  mine = _Previous(arrays, wait, shards) if held is not None and matrix else None
  # The previous matmul layer's shards, which this layer's backward pass hands back to it
  # behind its own cotangent (`layer_bwd`); residuals only, never differentiated.
  theirs = (previous.shards if barrier and mine is not None and previous is not None
            and previous.input_here() is not None else [])
  if mine is not None:
    if (ctx := context.current()) is not None:
      ctx.layers_ahead = True
    if previous is not None:
      previous.next = True
    held[:] = [mine]

  @jax.custom_vjp
  def layer(shards, arrays, wait, theirs):
    return run(shards, arrays, token_of(wait, barrier))

  def layer_fwd(shards, arrays, wait, theirs):
    return run(shards, arrays, token_of(wait, barrier)), (shards, arrays, theirs)

  def layer_bwd(res, ct):
    shards, arrays, theirs = res
    trace = get_opaque_trace_state()
    hands = previous is not None and mine is not None and mine.next
    if barrier and ahead:
      # A re-gather's barrier waits for a cotangent. XLA's algebraic simplifier drops a barrier
      # operand that nothing else reads, and the instruction holding a cotangent often is read
      # only there (the layer's matmuls read a reshape of it): through one barrier of its own,
      # the wait and this layer's backward pass read the same instruction. (XLA:TPU, which
      # does not prefetch, needed more temp with it on patterns c and e, the same elsewhere.)
      # The previous layer's shards go through the same barrier: its re-gathers then wait for
      # this layer's cotangent and nothing later, since this layer's matmuls read it. Behind
      # a barrier of their own (`after`), read by nothing else, XLA:GPU placed that barrier
      # after this layer's backward matmuls, and the re-gathers had nothing beside them.
      ct, theirs = jax.lax.optimization_barrier((ct, theirs))
      if hands and theirs:
        previous.handed_shards = theirs
    handed = (mine is not None and mine.cotangent is not None
              and mine.cotangent_trace == trace)
    if handed and mine.handed_shards is not None:
      token, shards = None, mine.handed_shards  # the same values, ordered by that barrier
    else:
      token = token_of(mine.cotangent if handed else ct, barrier)
    if hands:
      # The previous matmul layer may re-gather once this one's backward pass begins; not
      # behind the last one, whose own re-gather (often the largest, a head's) runs then.
      previous.cotangent, previous.cotangent_trace = ct, trace
    with setting(in_backward=True):
      _, vjp = jax.vjp(lambda s, a: run(s, a, token), shards, arrays)
      d_shards, d_arrays = vjp(ct)
      return d_shards, d_arrays, None, None  # the wait and their shards only order

  layer.defvjp(layer_fwd, layer_bwd)
  return layer(shards, arrays, wait, theirs)


# -- NNX ---------------------------------------------------------------------------------------

class _WritesState(Exception):
  """A layer run on its own changed its module's state (``sow``, a new attribute)."""


def regather_nnx_layers(model: Any) -> None:
  """`regather_layers` for a Flax NNX model: makes each module of ``model`` that computes as
  one layer do so, in place.

  ``model`` is the copy a zerojax NNX step has just merged, with `ZeroParam`-boxed
  ``nnx.Param`` values, and is traced once: NNX has no method interceptor, so a qualifying
  module's class becomes a subclass whose ``__call__`` is the layer's ``custom_vjp`` (gather
  after the first float argument, re-gather after the output's cotangent). A module qualifies
  as in `regather_layers`: every variable is an ``nnx.Param`` owned directly (no submodule has
  variables; no RNG streams or batch statistics), all boxed, at least one gathered for
  compute. A call that would change the module's state runs as written instead.
  """
  for _, module in nnx.iter_modules(model):
    _, state = nnx.split(module)
    flat = list(nnx.to_flat_state(state))
    if (flat and all(len(p) == 1 and isinstance(v, nnx.Param) for p, v in flat)
        and all(isinstance(v.get_value(), ZeroParam) for _, v in flat)
        and any(v.get_value().at_rest != v.get_value().compute for _, v in flat)):
      object.__setattr__(module, "__class__", _layer_class(type(module)))


_LAYER_CLASSES: dict[type, type] = {}


def _layer_class(cls: type) -> type:
  if cls not in _LAYER_CLASSES:
    _LAYER_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": _nnx_layer_call,
                                                      "__module__": cls.__module__})
  return _LAYER_CLASSES[cls]


def _nnx_layer_call(self: Any, *args: Any, **kwargs: Any) -> Any:
  call = type(self).__mro__[1].__call__
  if tracing().in_layer:
    return call(self, *args, **kwargs)
  graphdef, state = nnx.split(self)
  shards, state_def = jax.tree.flatten(state)
  boxes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ZeroParam))
  arrays, rebuild = array_args(args, kwargs)
  if _in_own_checkpoint():
    return _checkpointed(lambda: call(self, *args, **kwargs), arrays, boxes)
  paths = {p for p, _ in nnx.to_flat_state(state)}

  def run(shards, arrays, token):
    a, kw = rebuild(arrays)
    layer = nnx.merge(graphdef, jax.tree.unflatten(state_def, shards))
    with setting(in_layer=True, wait_for=token):
      out = call(layer, *a, **kw)
    if {p for p, _ in nnx.to_flat_state(nnx.state(layer))} != paths:
      raise _WritesState
    return out

  try:
    return _layer(run, shards, arrays, boxes[0].barrier, _has_matrix(boxes))
  except _WritesState:
    return call(self, *args, **kwargs)
