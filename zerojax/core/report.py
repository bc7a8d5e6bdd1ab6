"""The plan as a readable table: per leaf its layouts, bytes per device and what the stage does
with it, then totals and the run's dtypes."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.core.config import ZeroConfig
from zerojax.core.leaves import LeafPlan, shard_bytes
from zerojax.core.memory_kinds import HOST

__all__ = ["table", "dtypes_line"]


def table(plan: Any) -> str:
  """The plan as a readable text table with totals."""
  rows = [("path", "shape", "dtype", "param spec", "opt spec", "bytes/device", "note")]
  opt_by_param = _opt_specs_by_param(plan)
  quant = plan.quantization() if plan.config.quantized else [{}] * len(plan.leaves)
  for lp, ps, qz in zip(plan.leaves, jax.tree.leaves(plan.params), quant):
    host = " (host)" if ps.memory_kind == HOST else ""
    opt = opt_by_param.get(lp.path)
    rows.append((lp.path, str(lp.shape), np.dtype(lp.dtype).name, _spec_str(ps.spec) + host,
                 "-" if opt is None else _spec_str(opt.spec)
                 + (" (host)" if opt.memory_kind == HOST else ""),
                 _fmt_bytes(shard_bytes(lp.shape, lp.dtype, ps.spec, plan.mesh)),
                 _table_note(lp, plan.config) + ("" if lp.trainable else ", frozen")
                 + _quant_note(qz, plan.config)))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
  out = [f"zerojax plan: {plan.config.label}, mesh {dict(plan.mesh.shape)}",
         line(rows[0]), line(tuple("-" * w for w in widths))]
  out += [line(r) for r in rows[1:]]
  b = plan.bytes_per_device()
  total = sum(lp.nbytes for lp in plan.leaves)
  nparams = sum(math.prod(lp.shape) for lp in plan.leaves)
  out.append("")
  out.append(f"parameters: {nparams:,} ({_fmt_bytes(total)} unsharded)")
  out.append("per device: " + ", ".join(
      f"{k} {_fmt_bytes(v)}" for k, v in b.items() if v or not k.endswith("_host")))
  out.append(plan.dtypes_line())
  frozen = [lp for lp in plan.leaves if not lp.trainable]
  if frozen:
    out.append(f"frozen: {len(frozen)} of {len(plan.leaves)} leaves, "
               f"{sum(math.prod(lp.shape) for lp in frozen):,} parameters (no gradient, no "
               "optimizer state; stored as the stage says)")
  uns = plan.unsharded_bytes()
  if uns:
    out.append("left replicated over fsdp: " + ", ".join(
        f"{_fmt_bytes(v)} ({k})" for k, v in sorted(uns.items())))
  if plan.nvme is not None:  # the opt_state above is the device part's gradient capture
    out.append(f"optimizer state: in files under {plan.nvme.offload.path!r} "
               f"(NvmeOffload), {_fmt_bytes(plan.nvme.state_bytes)} on this process's disk, "
               "streamed through host memory; the opt_state rows are the captured gradient")
  return "\n".join(out)


def dtypes_line(plan: Any) -> str:
  """The dtypes of the run as they are: master parameters and gradients (the gradient of a
  parameter has its dtype), compute (the Flax modules' ``dtype``, from the config), gradient
  reduction and optimizer state, read from the planned leaves."""
  name = lambda d: np.dtype(d).name
  params = sorted({name(lp.dtype) for lp in plan.leaves})
  opt = sorted({name(d) for _, _, d, _ in plan.opt_leaves
                if np.issubdtype(np.dtype(d), np.floating)})
  cfg = plan.config
  return (f"dtypes: params {'/'.join(params)}, compute {cfg.compute_dtype}, gradients "
          f"{'/'.join(params)}, reduced in {cfg.reduce_dtype or '/'.join(params)}, "
          f"optimizer state {'/'.join(opt) or '-'}")


def _spec_str(spec: P) -> str:
  return "P(" + ", ".join(repr(a) if a is not None else "None" for a in spec) + ")"


def _fmt_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  raise AssertionError


def _opt_specs_by_param(plan: Any) -> dict[str, NamedSharding]:
  """The first optimizer-state sharding that mirrors each parameter (`ShardingPlan.opt_param`)."""
  out: dict[str, NamedSharding] = {}
  if plan.opt_state is None:
    return out
  for i, sh in zip(plan.opt_param, jax.tree.leaves(plan.opt_state)):
    if i is not None:
      out.setdefault(plan.leaves[i].path, sh)
  return out


# (opt state, grads, params) sharded -> the table's note
_STAGE_NOTES = {(False, False, False): "replicated (stage 0)",
                (True, False, False): "opt state sharded",
                (True, True, False): "grads, opt state sharded", (True, True, True): "sharded"}


def _quant_note(qz: dict[str, tuple[int, int]], cfg: ZeroConfig) -> str:
  """The ZeRO++ part of a leaf's note: what travels quantised, in how many blocks, padded."""
  if not cfg.quantized:
    return ""
  parts = []
  for key, name, dtype in (("weights", "qwZ", cfg.quantize_weights),
                           ("gradients", "qgZ", cfg.quantize_gradients)):
    if dtype is None:
      continue
    if key in qz:
      blocks, pad = qz[key]
      parts.append(f"{name} {dtype} {blocks} block{'s' * (blocks != 1)}"
                   + (f" +{pad} pad" if pad else ""))
    else:
      parts.append(f"{name} off (not {'gathered' if key == 'weights' else 'reduce-scattered'})")
  return "; " + ", ".join(parts)


def _table_note(lp: LeafPlan, config: ZeroConfig) -> str:
  """What the stage does with a leaf: ``lp.reason`` says whether the leaf rule *can* shard it,
  and a stage below 3 still keeps some of its state replicated."""
  if not lp.is_sharded:
    return f"replicated ({lp.reason})"
  note = _STAGE_NOTES[(config.shards_opt_state, config.shards_grads, config.shards_params)]
  return note if lp.reason == "sharded" else f"{note} ({lp.reason})"
