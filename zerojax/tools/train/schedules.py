"""Learning-rate schedules (optax's, and DeepSpeed's WarmupLR/WarmupDecayLR where optax has
none) and the optimizer a run's options describe.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax.numpy as jnp
import optax

from zerojax.tools.options import TrainOptions

__all__ = ["make_schedule", "stretch_schedule", "run_schedule", "depends_on_steps",
           "warmup_steps", "make_optimizer"]


def make_schedule(opts: TrainOptions, total_steps: int) -> Callable:
  """The learning-rate schedule of ``opts`` (or of its DeepSpeed ``scheduler``).

  Args:
    opts: the run's options (``lr``, ``warmup``, ``decay``, ``scheduler``).
    total_steps: the steps the schedule spans.

  Returns:
    An optax schedule, ``step -> learning rate``.
  """
  s = opts.scheduler
  if s:
    name = s["name"]
    w = int(s.get("warmup_num_steps", 1000))
    if name == "WarmupCosineLR":
      lo, end = opts.lr * s.get("warmup_min_ratio", 0.0), opts.lr * s.get("cos_min_ratio", 1e-4)
      total = int(s.get("total_num_steps", total_steps))
      return optax.warmup_cosine_decay_schedule(lo, opts.lr, max(w, 1), max(total, w + 1), end)
    lo, hi = float(s.get("warmup_min_lr", 0.0)), float(s.get("warmup_max_lr", opts.lr))
    log_warmup = s.get("warmup_type", "log") == "log"
    total = int(s.get("total_num_steps", total_steps))

    def sched(count):
      c = jnp.asarray(count, jnp.float32)
      if log_warmup:
        frac = jnp.log(c + 1) / math.log(max(w, 2))
      else:
        frac = c / max(w, 1)
      warm = lo + (hi - lo) * jnp.clip(frac, 0.0, 1.0)
      if name == "WarmupDecayLR":
        decay = jnp.clip((total - c) / max(total - w, 1), 0.0, 1.0)
        return jnp.where(c < w, warm, hi * decay)
      return warm

    return sched
  if opts.decay == "cosine":
    return optax.warmup_cosine_decay_schedule(
        0.0, opts.lr, max(opts.warmup_steps, 1), max(total_steps, opts.warmup_steps + 1),
        opts.lr * 0.1)
  if opts.warmup_steps:
    return optax.linear_schedule(0.0, opts.lr, opts.warmup_steps)
  return optax.constant_schedule(opts.lr)


def stretch_schedule(sched: Callable, at: int, old_steps: int, new_steps: int) -> Callable:
  """``sched`` as it was up to step ``at``; after it, the rest of its ``old_steps`` curve
  spread over ``new_steps``, so the learning rate goes on from its value at ``at``.

  A run resumed with another ``steps`` continues this way: a schedule that decays to its end
  at the last step (cosine, WarmupDecayLR, WarmupCosineLR) neither jumps back up nor ends
  early. A run resumed after its last step holds its final rate.

  Args:
    sched: the schedule the run was saved with (optimizer step count -> learning rate).
    at: the step the run resumes from.
    old_steps, new_steps: the run's length before and after.

  Returns:
    The schedule of the resumed run.
  """
  if new_steps <= at or new_steps == old_steps:
    return sched
  scale = max(old_steps - at, 0) / (new_steps - at)

  def stretched(count):
    c = jnp.asarray(count, jnp.float32)
    return jnp.where(c < at, sched(count), sched(at + (c - at) * scale))

  return stretched


def run_schedule(opts: TrainOptions, lengths: Sequence[tuple[int, int]] = ()) -> Callable:
  """The learning-rate schedule of a run whose length changed when it was resumed.

  Args:
    opts: the run's options.
    lengths: ``(step, steps)`` pairs, oldest first: from ``step`` on the run was ``steps``
      long (the first pair's step is 0). Empty: ``opts.steps`` throughout.

  Returns:
    The schedule, `stretch_schedule` applied at each change of length.
  """
  lengths = list(lengths) or [(0, opts.steps)]
  sched = make_schedule(opts, lengths[0][1])
  if not depends_on_steps(opts):
    return sched
  for (_, old), (at, new) in zip(lengths, lengths[1:]):
    # Warmup does not depend on the length: a run resumed before its decay began simply has
    # the new length's schedule, equal to the old one up to there.
    sched = (make_schedule(opts, new) if at <= warmup_steps(opts)
             else stretch_schedule(sched, at, old, new))
  return sched


def depends_on_steps(opts: TrainOptions) -> bool:
  """Whether the schedule of ``opts`` is shaped by the run's length (``steps``): cosine decay,
  and DeepSpeed's decaying schedulers without their own ``total_num_steps``."""
  s = opts.scheduler
  if s:
    return s["name"] in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in s
  return opts.decay == "cosine"


def warmup_steps(opts: TrainOptions) -> int:
  """The warmup length of the schedule of ``opts``."""
  s = opts.scheduler
  return int(s.get("warmup_num_steps", 1000)) if s else opts.warmup_steps


def make_optimizer(opts: TrainOptions, lengths: Sequence[tuple[int, int]] = ()):
  """``(tx, schedule)``: the optax optimizer and its learning-rate schedule.

  Args:
    opts: the run's options.
    lengths: the run's lengths when it was resumed with another ``steps`` (`run_schedule`).

  Returns:
    ``(tx, schedule)``: the optax optimizer and its learning-rate schedule.
  """
  sched = run_schedule(opts, lengths)
  o = opts.optimizer
  if o == "adamw":
    base = optax.adamw(sched, b1=opts.b1, b2=opts.b2, eps=opts.eps,
                       weight_decay=opts.weight_decay)
  elif o == "adam":
    base = optax.adam(sched, b1=opts.b1, b2=opts.b2, eps=opts.eps)
  elif o == "lamb":
    base = optax.lamb(sched, b1=opts.b1, b2=opts.b2, eps=opts.eps,
                      weight_decay=opts.weight_decay)
  elif o == "adagrad":
    base = optax.adagrad(sched, eps=opts.eps)
  else:
    base = optax.sgd(sched, momentum=opts.momentum)
  # Clipping, loss scaling and accumulation happen in the step (`zerojax.ZeroTrainState`,
  # `zerojax.value_and_grad`), so the optimizer is the plain update rule.
  return base, sched
