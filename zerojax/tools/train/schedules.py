"""Learning-rate schedules (optax's, and DeepSpeed's WarmupLR/WarmupDecayLR where optax has
none) and the optimizer a run's options describe.
"""

from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp
import optax

from zerojax.tools.options import TrainOptions

__all__ = ["make_schedule", "make_optimizer"]


def make_schedule(opts: TrainOptions, total_steps: int) -> Callable:
  """The learning-rate schedule of ``opts`` (or of its DeepSpeed ``scheduler``)."""
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


def make_optimizer(opts: TrainOptions):
  """``(tx, schedule)``: the optax optimizer and its learning-rate schedule."""
  sched = make_schedule(opts, opts.steps)
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
