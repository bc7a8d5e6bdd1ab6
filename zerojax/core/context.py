"""The step being traced: how `zerojax.value_and_grad` finds the plan of its `zero_step`.

`ZeroStep` sets a `StepContext` while it traces the user's train step. Code called from the
step (`zerojax.value_and_grad`) reads it to learn the plan (stage, mesh, gradient layout,
accumulation steps) and the traced loss scale of the step's input state; it also records that it
was called, so the step can refuse a configuration that the user's code silently ignored (e.g.
``gradient_accumulation_steps=4`` with a plain ``jax.value_and_grad``).

Outside a traced zerojax step there is no context and ``current()`` returns ``None``.

Everything code called from a traced step reads without being handed it is one frozen record,
`Tracing`, in one context variable: `tracing` reads it and `setting` changes fields of it for a
block. A reader finds every such setting here, with what sets it and what reads it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

from jax.extend.core import get_opaque_trace_state

__all__ = ["StepContext", "Tracing", "MadeGrads", "tracing", "setting", "current", "active"]


@dataclasses.dataclass
class StepContext:
  """What the traced step knows.

  Attributes:
    plan: the step's `ShardingPlan`.
    accumulation_steps: micro-batches per optimizer step (from the config's batch sizes).
    loss_scale: the traced loss scale of the input state, or ``None`` without loss scaling.
    grad_calls: how often `zerojax.value_and_grad` ran in this trace.
    apply_calls: how often the model ran through the state's ``apply_fn`` in this trace.
    linen: whether the step takes a state with an ``apply_fn`` (not an NNX step).
    boxed_calls: how often `zerojax.value_and_grad` ran an NNX model with its parameters in
      per-use gather boxes in this trace.
    layers_ahead: whether a model's layers (no scans) gathered one matmul layer ahead in this
      trace (`zerojax.core.regather.prefetching`), as custom VJPs or inside the model's own
      checkpoints; the step then compiles with the options for layers ahead
      (`ShardingPlan.compiler_options_for`).
    layers_in_checkpoints: whether some of them ran inside the model's own checkpoints
      (`zerojax.core.regather.inside_checkpoints`), which changes those options.
    rows_ahead: the bytes of the largest row a pure function's row matmuls
      (``x @ params["w"][i]``) gathered one row matmul ahead in this trace
      (`zerojax.core.rows`), 0 for none; such a step has options of its own.
    formulation: the `zerojax.core.formulation.Formulation` `zerojax.value_and_grad` chose
      for an NNX model in this trace (``None`` if none was traced).
    scans: per scan traced with the plan's `zerojax.core.pipeline.Pipeline`, a
      `zerojax.core.pipeline.OneAhead` where its layers ran one ahead, else the reason they
      could not
      (`zerojax.core.remat.scanned_layers`).
  """

  plan: Any
  accumulation_steps: int = 1
  loss_scale: Any = None
  grad_calls: int = 0
  apply_calls: int = 0
  linen: bool = True
  boxed_calls: int = 0
  layers_ahead: bool = False
  layers_in_checkpoints: bool = False
  rows_ahead: int = 0
  formulation: Any = None
  scans: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Tracing:
  """What code called from a traced zerojax step reads without being handed it.

  Attributes:
    step: the step being traced (`active`), or None outside one.
    scan: how each ``jax.lax.scan`` traced here wraps its body
      (`zerojax.core.remat.scanned_layers`), or None: as written.
    scan_outcomes: the list `zerojax.core.remat.scanned_layers` collects what became of each
      scan into, or None.
    linen_applies: the linen models a step applies itself (`zerojax.core.apply.linen_applies`),
      or None.
    in_model: a `zerojax.core.apply.ModelApply` is running (its model's own ``apply`` is not
      routed again).
    in_block: a checkpointed block runs (`zerojax.core.blocks`); blocks inside it run as
      written.
    in_layer: a layer's re-gathering call runs (`zerojax.core.regather`); its sub-layers run
      as written.
    model_trace: the trace of the model whose layers re-gather (`zerojax.core.regather`), or
      None.
    previous: the layers gathered one matmul layer ahead link through this list
      (`zerojax.core.regather.prefetching`), or None: each layer waits for its own input.
    across_checkpoints: layers gathered ahead across the model's own checkpoints gather
      unordered (`zerojax.core.regather.prefetching`).
    wait_for: the token a layer's gathers wait for (`zerojax.core.gather.token_of`), or None.
    in_backward: a layer's backward pass re-runs it (`zerojax.core.regather`,
      `zerojax.core.remat.recompute_in_backward`): a quantised re-gather may then move full
      precision weights (``quantize_weights_backward=False``).
    made_grads: where per-use gathers' backward rules record the gradients they are handed
      (`zerojax.core.gather`), for a scan of layers one ahead to wait for
      (`zerojax.core.pipeline`); None: not recorded.
  """

  step: "StepContext | None" = None
  scan: Any = None
  scan_outcomes: list | None = None
  linen_applies: Any = None
  in_model: bool = False
  in_block: bool = False
  in_layer: bool = False
  model_trace: Any = None
  previous: list | None = None
  across_checkpoints: bool = False
  wait_for: Any = None
  in_backward: bool = False
  made_grads: "MadeGrads | None" = None


class MadeGrads:
  """The gradients the backward pass has made so far, each with the trace it was made in.

  The backward pass reaches a model's layers last of all that runs after them in the forward
  pass (a head, a final norm). A scan of layers one ahead waits for those parameters'
  gradients (`take`), so the cotangents they are made from are freed before the layers' backward
  pass starts, not kept through it for a weight-gradient matmul scheduled at the end.
  """

  def __init__(self):
    self._made: list[tuple[Any, Any]] = []

  def add(self, grad: Any) -> None:
    """Records ``grad``, made in the current trace."""
    self._made.append((get_opaque_trace_state(), grad))

  def take(self) -> list:
    """The gradients recorded in the current trace since the last `take`, which forgets them."""
    here = get_opaque_trace_state()
    out = [g for t, g in self._made if t == here]
    self._made = [(t, g) for t, g in self._made if t != here]
    return out


_TRACING: contextvars.ContextVar[Tracing] = contextvars.ContextVar("zerojax_tracing",
                                                                   default=Tracing())


def tracing() -> Tracing:
  """The `Tracing` record of this thread and context."""
  return _TRACING.get()


@contextlib.contextmanager
def setting(**changes: Any) -> Iterator[Tracing]:
  """Inside the block, `tracing` returns the record with ``changes``; after it, as before.

  Args:
    **changes: `Tracing` fields and their values.

  Yields:
    The changed record.

  Raises:
    TypeError: a name is not a `Tracing` field.
  """
  token = _TRACING.set(dataclasses.replace(_TRACING.get(), **changes))
  try:
    yield _TRACING.get()
  finally:
    _TRACING.reset(token)


def current() -> StepContext | None:
  """The context of the zerojax step being traced, or ``None``."""
  return _TRACING.get().step


@contextlib.contextmanager
def active(ctx: StepContext) -> Iterator[StepContext]:
  """Makes ``ctx`` the step being traced inside the block (`current`).

  Args:
    ctx: the step's context.

  Yields:
    ``ctx``.
  """
  with setting(step=ctx):
    yield ctx
