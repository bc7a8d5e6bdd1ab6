"""Memory: the ZeRO paper's estimate, generalised to real trees, and measurement of compiled steps.

Estimate
  The paper (Rajbhandari et al. 2019) counts model-state bytes per device for Ψ parameters on
  N data-parallel devices with mixed-precision Adam (K = 12 optimizer bytes per parameter):

  ======  ==========================
  stage   bytes per device
  ======  ==========================
  0       (2 + 2 + K) Ψ
  1       2Ψ + 2Ψ + KΨ / N
  2       2Ψ + (2 + K) Ψ / N
  3       (2 + 2 + K) Ψ / N
  ======  ==========================

  `paper_bytes` is that formula. `estimate` generalises it: it sums the real leaves of the
  parameter tree and of the optimizer state (any optax transformation, any dtypes), each
  divided by the number of devices its plan shards it over. Leaves the plan leaves replicated
  (small or indivisible) are counted whole. Only shapes are needed: it runs on an
  ``AbstractMesh`` of any size with no devices.

Measure
  `measure` reads XLA's compiled memory analysis (argument, output, alias, temp bytes per
  device) and counts collective bytes in the compiled HLO, weighting ops inside ``while`` loops
  (scans) by their known trip counts.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from zerojax.config import ZeroConfig
from zerojax.plan import ShardingPlan

PAPER_K = 12


def paper_bytes(num_params: float, stage: int, num_devices: int, k: int = PAPER_K) -> float:
  """Bytes of model state per device from the ZeRO paper (mixed-precision Adam)."""
  _check_args(stage=stage, num_devices=num_devices)
  if not num_params >= 0:
    raise ValueError(f"num_params={num_params!r} is invalid: a number of parameters >= 0")
  psi, n = float(num_params), num_devices
  return {0: (2 + 2 + k) * psi,
          1: 2 * psi + 2 * psi + k * psi / n,
          2: 2 * psi + (2 + k) * psi / n,
          3: (2 + 2 + k) * psi / n}[stage]


def _check_args(stage: Any = None, num_devices: Any = None) -> None:
  if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
    raise ValueError(f"stage={stage!r} is invalid: allowed stages are 0, 1, 2 and 3")
  if num_devices is not None and (isinstance(num_devices, bool) or
                                  not isinstance(num_devices, (int, np.integer)) or
                                  num_devices < 1):
    raise ValueError(f"num_devices={num_devices!r} is invalid: a positive integer")


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Analytic per-device bytes of one stage (device- and host-resident)."""

  stage: int
  num_devices: int
  params: int
  grads: int
  opt_state: int
  params_host: int = 0
  opt_state_host: int = 0

  @property
  def persistent(self) -> int:
    """Device-resident bytes that live across steps: parameters and optimizer state."""
    return self.params + self.opt_state

  @property
  def total(self) -> int:
    """Device-resident model state: parameters, gradients and optimizer state."""
    return self.params + self.grads + self.opt_state

  @property
  def host(self) -> int:
    return self.params_host + self.opt_state_host


def num_params(tree: Any) -> int:
  """Parameters (elements) in a tree of arrays, ``ShapeDtypeStruct``s or Flax-boxed leaves.

  The one count zerojax prints: run headers, ``zerojax plan``/``estimate`` and
  `ShardingPlan.table` all count the leaves of the real tree.
  """
  from flax.core import meta
  return sum(math.prod(np.shape(x)) for x in jax.tree.leaves(meta.unbox(tree)))


def estimate(params: Any, tx: Any = None, *, config: ZeroConfig | None = None,
             stage: int | None = None, num_devices: int | None = None,
             opt_state: Any = None, mesh: Any = None) -> Estimate:
  """Per-device bytes of params, grads and optimizer state for one stage.

  Args:
    params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``).
    tx: the optax transformation (its state shapes come from ``eval_shape``).
    config: a `ZeroConfig` (defaults to one with ``stage``). When given, floating parameters
      are counted in ``config.param_dtype`` (the dtype `create_train_state` stores them in),
      and the optimizer state in whatever dtypes ``tx`` derives from those.
    stage: overrides ``config.stage``.
    num_devices: size of the ``fsdp`` axis to plan for (devices need not exist).
    opt_state: the optimizer state or its shapes, instead of ``tx``.
    mesh: a mesh to plan on instead of an abstract ``(num_devices,)`` fsdp mesh.
  """
  if config is not None:
    # `create_train_state` stores floating parameters in config.param_dtype: count that.
    from zerojax.step import _cast_shapes
    params = _cast_shapes(params, np.dtype(config.param_dtype))
  _check_args(stage=stage, num_devices=num_devices)
  config = config or ZeroConfig(stage=stage if stage is not None else 3)
  if stage is not None and stage != config.stage:
    config = config.replace(stage=stage)
  if mesh is None:
    n = num_devices if num_devices is not None else jax.device_count()
    shape = config.mesh_shape
    if len(shape) == 1 or -1 in shape:
      shape = tuple(-1 if a == "fsdp" else (1 if s == -1 else s)
                    for a, s in zip(config.mesh_axes, shape))
      if -1 in config.mesh_shape and config.mesh_shape[config.mesh_axes.index("fsdp")] != -1:
        shape = config.mesh_shape
    shape = config.replace(mesh_shape=shape).resolved_mesh_shape(n) if -1 in shape else shape
    mesh = AbstractMesh(tuple(shape), config.mesh_axes,
                        axis_types=(AxisType.Auto,) * len(shape))
  plan = ShardingPlan.create(config, mesh, params, tx=tx, opt_state=opt_state)
  b = plan.bytes_per_device()
  return Estimate(config.stage, math.prod(mesh.shape.values()), b["params"], b["grads"],
                  b["opt_state"], b["params_host"], b["opt_state_host"])


# -- measurement ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measured:
  """Per-device bytes of a compiled step, from XLA's memory analysis and HLO."""

  argument: int
  output: int
  alias: int
  temp: int
  collectives: dict[str, int]  # op kind -> bytes per device per step (see `collective_bytes`)

  @property
  def peak(self) -> int:
    """Arguments + temporaries + outputs that do not reuse (alias) a donated argument."""
    return self.argument + self.temp + self.output - self.alias

  @property
  def collective_total(self) -> int:
    return sum(self.collectives.values())


def measure(compiled: Any) -> Measured:
  """Measures a ``jax.stages.Compiled`` step (e.g. ``step.lower(state, batch).compile()``)."""
  ma = compiled.memory_analysis()
  return Measured(int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
                  int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes),
                  collective_bytes(compiled.as_text()))


_DTYPE_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "s64": 8, "s32": 4, "s16": 2, "s8": 1,
                "u64": 8, "u32": 4, "u16": 2, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*(.*?)\s(all-gather|all-reduce|reduce-scatter|all-to-all|"
                 r"collective-permute)(-start)?\(")
_WHILE = re.compile(r"\swhile\(.*body=%?([\w.\-]+)")
_TRIP = re.compile(r'known_trip_count":\{"n":"(\d+)"')
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations|"
                    r"true_computation|false_computation)=\{?%?([\w.\-]+)")


def _bytes_of(shapes: str) -> int:
  total = 0
  for dt, dims in _SHAPE.findall(shapes):
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += n * _DTYPE_BYTES[dt]
  return total


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes per device per step moved by each kind of collective in compiled HLO text.

  Counting follows the ZeRO paper's volumes, in bytes of the full (unsharded) tensor:

  * all-gather: its result size (each device ends with the whole tensor);
  * reduce-scatter: its operand size;
  * all-reduce: twice its operand size (a reduce-scatter plus an all-gather). XLA's CPU
    backend lowers reduce-scatter as all-reduce followed by a slice, so on CPU a stage-2
    gradient reduce-scatter shows up here as all-reduce at twice its ideal volume;
  * all-to-all, collective-permute: their result size.

  An op inside a ``while`` body counts once per iteration (the loop's known trip count).
  """
  comps: dict[str, list[str]] = {}
  cur, entry = None, None
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m and not line.startswith(" "):
      cur = m.group(1)
      comps[cur] = []
      if line.startswith("ENTRY"):
        entry = cur
      continue
    if cur is not None:
      comps[cur].append(line)
  mult: dict[str, int] = {}

  def visit(name: str, k: int, depth: int = 0) -> None:
    if name not in comps or depth > 64:
      return
    mult[name] = mult.get(name, 0) + k
    for line in comps[name]:
      w = _WHILE.search(line)
      trip = _TRIP.search(line)
      for callee in _CALLS.findall(line):
        factor = int(trip.group(1)) if (w and trip and callee == w.group(1)) else 1
        visit(callee, k * factor, depth + 1)

  if entry is not None:
    visit(entry, 1)
  out = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0, "all-to-all": 0,
         "collective-permute": 0}
  for name, lines in comps.items():
    k = mult.get(name, 0)
    if not k:
      continue
    for line in lines:
      m = _OP.search(line)
      if not m:
        continue
      kind = m.group(2)
      if kind == "all-reduce":
        for n, sliced in _all_reduce_parts(line, m.group(1), lines, comps):
          # CPU lowering of reduce-scatter: all-reduce, then each device keeps its slice.
          if sliced:
            out["reduce-scatter"] += k * n
          else:
            out["all-reduce"] += k * 2 * n
        continue
      n = _bytes_of(m.group(1))
      if kind == "reduce-scatter":
        n *= _group_size(line)
      out[kind] += k * n
  return out


def _all_reduce_parts(line, shapes, lines, comps):
  """``(bytes, only_sliced)`` per operand of a (possibly tuple-shaped, combined) all-reduce."""
  name = _name_of(line)
  parts = _SHAPE.findall(shapes)
  sizes = [math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dt]
           for dt, dims in parts]
  if len(sizes) <= 1:
    return [(sum(sizes), _only_sliced(name, lines, comps))]
  ref = re.compile(r"get-tuple-element\(%" + re.escape(name) + r"\), index=(\d+)")
  gtes = {}
  for l in lines:
    g = ref.search(l)
    if g:
      gtes.setdefault(int(g.group(1)), []).append(_name_of(l))
  return [(n, bool(gtes.get(i)) and all(_only_sliced(v, lines, comps) for v in gtes[i]))
          for i, n in enumerate(sizes)]


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")


def _name_of(line: str) -> str:
  m = _INSTR.match(line)
  return m.group(1) if m else ""


def _only_sliced(value: str, lines: list[str], comps: dict[str, list[str]], depth: int = 0
                 ) -> bool:
  """Whether every use of ``value`` keeps only a dynamic slice of it (so an all-reduce of it
  is a reduce-scatter in effect)."""
  if not value or depth > 4:
    return False
  ref = re.compile(r"%" + re.escape(value) + r"(?![\w.\-])")
  users = [l for l in lines if ref.search(l) and _name_of(l) != value]
  if not users:
    return False
  for u in users:
    if " get-tuple-element(" in u:
      if not _only_sliced(_name_of(u), lines, comps, depth + 1):
        return False
    elif " dynamic-slice(" in u:
      continue
    elif " fusion(" in u:
      callee = re.search(r"calls=%?([\w.\-]+)", u)
      args = u[u.index(" fusion(") + 8:].split(")")[0].split(",")
      idx = [i for i, a in enumerate(args) if ref.search(a)]
      body = comps.get(callee.group(1), []) if callee else []
      for i in idx:
        param = next((_name_of(l) for l in body if f" parameter({i})" in l), "")
        pref = re.compile(r"%" + re.escape(param) + r"(?![\w.\-])")
        puses = [l for l in body if param and pref.search(l) and _name_of(l) != param]
        if not puses or not all(" dynamic-slice(" in l and
                                pref.search(l[l.index(" dynamic-slice("):].split(",")[0])
                                for l in puses):
          return False
    else:
      return False
  return True


def _group_size(line: str) -> int:
  """Devices per replica group of a collective, in any of XLA's printed forms."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=\{\{([^}]*)\}", line)
  if m:
    return len(m.group(1).split(","))
  return 1
