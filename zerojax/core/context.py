"""The step being traced: how `zerojax.value_and_grad` finds the plan of its `zero_step`.

`ZeroStep` sets a `StepContext` while it traces the user's train step. Code called from the
step (`zerojax.value_and_grad`) reads it to learn the plan (stage, mesh, gradient layout,
accumulation steps) and the traced loss scale of the step's input state; it also records that it
was called, so the step can refuse a configuration that the user's code silently ignored (e.g.
``gradient_accumulation_steps=4`` with a plain ``jax.value_and_grad``).

Outside a traced zerojax step there is no context and ``current()`` returns ``None``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

__all__ = ["StepContext", "current", "active"]

_ACTIVE: contextvars.ContextVar["StepContext | None"] = contextvars.ContextVar(
    "zerojax_step", default=None)


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
    rows_ahead: whether a pure function's row matmuls (``x @ params["w"][i]``) gathered
      their rows one row matmul ahead in this trace (`zerojax.core.rows`), which has options
      of its own.
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
  rows_ahead: bool = False
  formulation: Any = None
  scans: list = dataclasses.field(default_factory=list)


def current() -> StepContext | None:
  """The context of the zerojax step being traced, or ``None``."""
  return _ACTIVE.get()


@contextlib.contextmanager
def active(ctx: StepContext) -> Iterator[StepContext]:
  token = _ACTIVE.set(ctx)
  try:
    yield ctx
  finally:
    _ACTIVE.reset(token)
