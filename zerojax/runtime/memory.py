"""Memory: the ZeRO paper's estimate, generalised to real trees, and measurement of compiled steps.

Estimate
  `paper_bytes`, `estimate` and the fit checks live in `zerojax.core.budget` (the step refuses a
  state or step that does not fit) and are re-exported here.

Measure
  `measure` reads XLA's compiled memory analysis (argument, output, alias, temp bytes per
  device) and counts collective bytes in the compiled HLO, weighting ops inside ``while`` loops
  (scans) by their trip counts.

Compile for a TPU pod
  `compile_for_topology` compiles the real train step for a TPU slice (``'v5e:8x8'``) on any
  machine with libtpu installed (``pip install "zerojax[tpu]"``), from abstract state. XLA:TPU
  reports HBM and ``pinned_host`` bytes apart and refuses a step that does not fit the chip;
  `gather_schedule` reads from its schedule which all-gathers run beside computation.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np

from zerojax.core.budget import (PAPER_K, DeviceMemoryError, Estimate, bytes_limit,
                                 check_fits, check_state_fits, compiled_peak, estimate,
                                 num_params, paper_bytes)
from zerojax.core.config import ZeroConfig

__all__ = ["PAPER_K", "paper_bytes", "Estimate", "num_params", "estimate", "Measured",
           "measure", "collective_bytes", "collective_bytes_by_dtype", "GatherSchedule", "gather_schedule", "replica_groups",
           "reductions", "GiB", "HBM_PER_CHIP", "TOPOLOGY_EXAMPLES", "TPU_EXTRA",
           "tpu_topology", "hbm_available", "TopologyCompile", "lm_train_step",
           "compile_for_topology", "DeviceMemoryError", "bytes_limit", "compiled_peak",
           "check_fits", "check_state_fits"]

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
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_WHILE = re.compile(r"\swhile\(.*body=%?([\w.\-]+)")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
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
  out = {k: 0 for k in _KINDS}
  for (kind, _), b in collective_bytes_by_dtype(hlo_text).items():
    out[kind] += b
  return out


_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def collective_bytes_by_dtype(hlo_text: str, scope: str | None = None
                              ) -> dict[tuple[str, str], int]:
  """`collective_bytes` split by element type: ``{(kind, dtype): bytes}`` with HLO's dtype
  names (``'f32'``, ``'bf16'``, ``'s8'``, ...); e.g. ZeRO++'s int8 gathers are
  ``('all-gather', 's8')`` plus their ``f32`` scales. ``scope``: count only collectives whose
  metadata ``op_name`` contains it (a ``jax.named_scope``, e.g. `zerojax.core.gather.GATHER_SCOPE`)."""
  comps, mult = _parse_hlo(hlo_text)
  out: dict[tuple[str, str], int] = {}
  # XLA:TPU runs a collective asynchronously as a start fusion, continuation fusions that
  # compute while it is in flight, and a done fusion; each fused computation holds a copy of
  # the collective with the same channel_id. One channel is one collective: count it once.
  channels: dict[tuple[str, int, str, str], tuple[str, str, int]] = {}
  for name, lines in comps.items():
    k = mult.get(name, 0)
    if not k:
      continue
    here: dict[tuple[str, int, str, str], tuple[str, str, int]] = {}
    for line in lines:
      m = _OP.search(line)
      if not m:
        continue
      kind = m.group(2)
      ch = _CHANNEL.search(line)
      op = _OP_NAME.search(line)
      if scope is not None and (op is None or scope not in op.group(1)):
        continue
      if kind == "all-reduce":
        parts = []
        for n, sliced, dt in _all_reduce_parts(line, m.group(1), lines, comps):
          # CPU lowering of reduce-scatter: all-reduce, then each device keeps its slice.
          parts.append(("reduce-scatter", dt, k * n) if sliced else ("all-reduce", dt, k * 2 * n))
      else:
        scale = _group_size(line) if kind == "reduce-scatter" else 1
        parts = [(kind, dt, k * n * scale) for dt, n in _bytes_by_dtype(m.group(1)).items()]
      for i, (kind, dt, b) in enumerate(parts):
        if ch is None:
          out[(kind, dt)] = out.get((kind, dt), 0) + b
        else:
          # Collectives written out in shard_map may all carry channel_id=1, so within one
          # computation every op counts; a copy of one op in another (fused) computation
          # has the same channel, metadata name and element type.
          key = (ch.group(1), i, op.group(1) if op else "", dt)
          prev = here.get(key, (kind, dt, 0))
          here[key] = (kind, dt, prev[2] + b)
    for key, v in here.items():
      if key not in channels or channels[key][2] < v[2]:
        channels[key] = v
  for kind, dt, b in channels.values():
    out[(kind, dt)] = out.get((kind, dt), 0) + b
  return out


def _bytes_by_dtype(shapes: str) -> dict[str, int]:
  out: dict[str, int] = {}
  for dt, dims in _SHAPE.findall(shapes):
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    out[dt] = out.get(dt, 0) + n * _DTYPE_BYTES[dt]
  return out


def _parse_hlo(hlo_text: str) -> tuple[dict[str, list[str]], dict[str, int]]:
  """``(computations, runs)``: each computation's instruction lines, in the printed (for a
  scheduled module: the execution) order, and how often it runs per step (``while`` bodies
  once per iteration of their known trip count)."""
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
      n = int(trip.group(1)) if trip else (_trip_from_condition(line, comps, comps[name])
                                           if w else None)
      for callee in _CALLS.findall(line):
        factor = n if (w and n is not None and callee == w.group(1)) else 1
        visit(callee, k * factor, depth + 1)

  if entry is not None:
    visit(entry, 1)
  return comps, mult


_COND = re.compile(r"condition=%?([\w.\-]+)")
_LT = re.compile(r"ROOT .*compare\(%([\w.\-]+), %([\w.\-]+)\), direction=LT")


def _trip_from_condition(while_line: str, comps: dict[str, list[str]],
                         caller: list[str]) -> int | None:
  """Trip count of a ``while`` without ``known_trip_count`` (XLA:TPU prints none): its
  condition is ``counter < N`` with N a constant, and the counter starts at a constant
  (through copies) in the loop's initial tuple."""
  cond = _COND.search(while_line)
  lines = comps.get(cond.group(1), []) if cond else []
  root = next((_LT.search(l) for l in lines if _LT.search(l)), None)
  if root is None:
    return None
  bound = _constant(root.group(2), lines)
  if bound is None:
    return None
  init = re.search(r"\swhile\(%([\w.\-]+)\)", while_line)
  start = 0
  if init:
    tup = next((l for l in caller if _name_of(l) == init.group(1)), "")
    first = re.search(r"\stuple\(%([\w.\-]+)", tup)
    if first:
      start = _constant(first.group(1), caller)
      if start is None:
        return None
  return max(bound - start, 0)


def _constant(name: str, lines: list[str], depth: int = 0) -> int | None:
  """The integer value of instruction ``name`` if it is a constant (seen through copies)."""
  line = next((l for l in lines if _name_of(l) == name), "")
  m = re.search(r"\sconstant\((-?\d+)\)", line)
  if m:
    return int(m.group(1))
  c = re.search(r"\scopy\(%([\w.\-]+)\)", line)
  if c and depth < 4:
    return _constant(c.group(1), lines, depth + 1)
  return None


@dataclasses.dataclass(frozen=True)
class GatherSchedule:
  """How a compiled (scheduled) step issues its all-gathers; bytes per device per step.

  A schedule is the order the compiler will issue instructions in, so it tells which
  all-gathers are asynchronous (a start and a done with other instructions between) and
  which computations are issued while one is in flight. It does not tell how long either
  takes, so whether a transfer is fully hidden is a question for a profile on real chips.
  """

  total: int  # all-gather bytes (each collective once, loop bodies once per iteration)
  asynchronous: int  # issued as start/done pairs
  overlapped: int  # async, with at least one computation scheduled between start and done
  synchronous: int  # issued as one blocking op (nothing can run beside it)
  pairs: int  # async all-gathers in the program text (not weighted by loop trips)
  overlapped_pairs: int

  @property
  def overlapped_share(self) -> float:
    return self.overlapped / self.total if self.total else 0.0


_CALLEE = re.compile(r"calls=%?([\w.\-]+)")
_GATHER = re.compile(r"=\s*(.*?)\sall-gather\(")
_COMPUTE_OPS = (" convolution(", " dot(", " custom-call(", " while(", " call(", " reduce(",
                " sort(", " scatter(", " gather(")


def gather_schedule(hlo_text: str) -> GatherSchedule:
  """Reads the schedule of a compiled step's HLO (``compiled.as_text()``) for its all-gathers.

  XLA:TPU issues an asynchronous collective as an ``async-collective-start`` fusion, optional
  continuation fusions (``async_collective_fusion``: computation that runs while the
  collective progresses, e.g. a matmul over the chunks already received) and an
  ``async-collective-done``; XLA's generic form is ``all-gather-start``/``all-gather-done``.
  A start and its done are paired by channel id (or operand). A done scheduled before its
  start in a loop body means the gather for the next iteration is issued in this one
  (pipelined across the back edge); then the instructions after the start and before the
  done, around the back edge, are what runs beside it. Any fusion or other computation
  that is not itself a collective counts as compute.
  """
  comps, mult = _parse_hlo(hlo_text)
  fused = {c for lines in comps.values() for l in lines if " fusion(" in l
           for c in _CALLEE.findall(l)}

  def collectives(callee: str) -> list[tuple[str, str | None, int]]:
    out = []
    for l in comps.get(callee, []):
      m = _OP.search(l)
      if m:
        ch = _CHANNEL.search(l)
        out.append((m.group(2), ch.group(1) if ch else None, _bytes_of(m.group(1))))
    return out

  total = asynchronous = overlapped = synchronous = pairs = overlapped_pairs = 0
  for name, lines in comps.items():
    k = mult.get(name, 0)
    if name in fused or not k:
      continue
    seq = [l for l in lines if _name_of(l)]
    starts: dict[str, tuple[int, int]] = {}
    dones: dict[str, int] = {}
    compute: list[int] = []
    for i, l in enumerate(seq):
      nm = _name_of(l)
      if " all-gather-start(" in l:
        shapes = _SHAPE.findall(l.split(" all-gather-start(")[0])
        b = _bytes_of("{}[{}]".format(*shapes[-1])) if shapes else 0
        starts[nm] = (i, b)
      elif " all-gather-done(" in l:
        op = re.search(r"all-gather-done\(%([\w.\-]+)", l)
        if op:
          dones[op.group(1)] = i
      elif " all-gather(" in l:
        m = _GATHER.search(l)
        synchronous += k * _bytes_of(m.group(1)) if m else 0
      elif " fusion(" in l:
        callee = (_CALLEE.findall(l) or [""])[0]
        colls = collectives(callee)
        gathers = [(ch, b) for kind, ch, b in colls if kind == "all-gather"]
        if nm.startswith("async-collective-start"):
          for ch, b in gathers:
            starts[ch or nm] = (i, b)
        elif nm.startswith("async-collective-done"):
          for ch, _ in gathers:
            dones[ch or nm] = i
        elif callee.startswith("async_collective_fusion"):
          compute.append(i)  # computation issued while its collective progresses
        elif gathers:
          synchronous += k * sum(b for _, b in gathers)
        elif not colls:
          compute.append(i)
      elif any(op in l for op in _COMPUTE_OPS):
        compute.append(i)
    for key, (i, b) in starts.items():
      j = dones.get(key)
      if j is None:
        continue
      pairs += 1
      asynchronous += k * b
      between = [c for c in compute if ((i < c < j) if j > i else (c > i or c < j))]
      if between:
        overlapped += k * b
        overlapped_pairs += 1
  total = asynchronous + synchronous
  return GatherSchedule(total, asynchronous, overlapped, synchronous, pairs, overlapped_pairs)


def _all_reduce_parts(line, shapes, lines, comps):
  """``(bytes, only_sliced, dtype)`` per operand of a (possibly tuple-shaped, combined)
  all-reduce."""
  name = _name_of(line)
  parts = _SHAPE.findall(shapes)
  sizes = [math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dt]
           for dt, dims in parts]
  dts = [dt for dt, _ in parts]
  if len(sizes) <= 1:
    return [(sum(sizes), _only_sliced(name, lines, comps), dts[0] if dts else "f32")]
  ref = re.compile(r"get-tuple-element\(%" + re.escape(name) + r"\), index=(\d+)")
  gtes = {}
  for l in lines:
    g = ref.search(l)
    if g:
      gtes.setdefault(int(g.group(1)), []).append(_name_of(l))
  return [(n, bool(gtes.get(i)) and all(_only_sliced(v, lines, comps) for v in gtes[i]), dts[i])
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
  groups = replica_groups(line)
  return len(groups[0]) if groups else 1


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
  arr = np.arange(math.prod(dims)).reshape(dims)
  return (arr.transpose(perm) if perm else arr).reshape(-1)


def replica_groups(line: str) -> list[frozenset[int]] | None:
  """The device groups of one collective in an HLO line, in any of the forms XLA prints:
  ``mesh['a'=4,'b'=2], device_ids=(...) {'a'}``, ``[G,S]<=[dims]T(perm)`` or ``{{0,1},{2,3}}``.
  Group members are partition ids (positions in the mesh's flattened device array); ``None``
  when the line names no groups."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}",
                line)
  if m:
    names_sizes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names = [n for n, _ in names_sizes]
    sizes = [int(s) for _, s in names_sizes]
    ids = np.arange(math.prod(sizes))
    if m.group(2):
      d = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group(2))
      ids = _iota([int(x) for x in d.group(1).split(",")],
                  [int(x) for x in d.group(2).split(",")] if d.group(2) else None)
    reduced = re.findall(r"'([^']+)'", m.group(3))
    keep = [i for i, n in enumerate(names) if n not in reduced]
    red = [i for i, n in enumerate(names) if n in reduced]
    arr = ids.reshape(sizes).transpose(keep + red).reshape(-1, math.prod(sizes[i] for i in red))
    return [frozenset(int(v) for v in g) for g in arr]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    ids = _iota([int(x) for x in m.group(3).split(",")],
                [int(x) for x in m.group(4).split(",")] if m.group(4) else None)
    return [frozenset(int(v) for v in g) for g in ids.reshape(int(m.group(1)), int(m.group(2)))]
  m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
  if m:
    return [frozenset(int(v) for v in g.split(",") if v)
            for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  return None


def reductions(hlo_text: str) -> list[tuple[str, list[frozenset[int]] | None, int]]:
  """``(kind, replica groups, bytes)`` of every all-reduce and reduce-scatter in a compiled
  step's HLO (``compiled.as_text()``), in program order; bytes are the collective's result."""
  out = []
  for line in hlo_text.splitlines():
    m = re.search(r"=\s*(.*?)\s(all-reduce|reduce-scatter)(?:-start)?\(", line)
    if m:
      out.append((m.group(2), replica_groups(line), _bytes_of(m.group(1))))
  return out


# -- ahead-of-time compilation for TPU topologies ----------------------------------------------

GiB = 2**30

# HBM per chip from Google's Cloud TPU pages (docs.cloud.google.com/tpu/docs/v4, v5e, v5p, v6e).
# The pages write "GB" for v5e/v5p/v6e, but the compiler's own usable HBM on v5e is 15.75 GiB
# (`hbm_available`), more than 16e9 bytes: the figures are GiB.
HBM_PER_CHIP = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}
TOPOLOGY_EXAMPLES = ("v5e:2x4", "v5e:8x8", "v5e:16x16", "v5p:2x2x1", "v5p:4x4x4", "v5p:8x8x8",
                     "v4:2x2x1", "v4:8x8x8", "v6e:4x4", "v6e:16x16")
TPU_EXTRA = 'pip install "zerojax[tpu]"'
_TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})$")
_OOM = re.compile(r"\(([0-9.]+)([KMGT]?)\) exceeds available HBM \(([0-9.]+)([KMGT]?)\)")
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def tpu_topology(name: str) -> Any:
  """The ``jax.experimental.topologies.TopologyDescription`` of a TPU slice, e.g. ``'v5e:8x8'``.

  Needs ``libtpu`` (``pip install "zerojax[tpu]"``) but no TPU: the devices it describes can
  only be compiled for. CPU stays JAX's default backend.
  """
  import importlib.util
  if not isinstance(name, str) or not _TOPOLOGY.match(name):
    raise ValueError(f"topology={name!r} is invalid: GENERATION:SHAPE with generation one of "
                     f"{sorted(HBM_PER_CHIP)}, e.g. {', '.join(TOPOLOGY_EXAMPLES)}")
  if importlib.util.find_spec("libtpu") is None:
    raise ImportError(f"compiling for TPU topology {name!r} needs libtpu, which is not "
                      f"installed; install it with: {TPU_EXTRA}")
  import glob
  import os
  if not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):
    # No TPU chips here, so libtpu's one-process lock protects nothing; without this, two
    # processes compiling for topologies (tests beside a benchmark) fail on the lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  try:
    return topologies.get_topology_desc(platform="tpu", topology_name=name)
  except Exception as e:  # libtpu's message names what it could not build
    raise ValueError(f"topology={name!r} is not a TPU slice libtpu can describe ({e}); "
                     f"examples that work: {', '.join(TOPOLOGY_EXAMPLES)}") from None


_AVAILABLE: dict[str, int] = {}


def hbm_available(device: Any) -> int:
  """HBM bytes the TPU compiler lets one program use on ``device`` (a topology device).

  Measured, not looked up: a program needing far more than any chip has is compiled for the
  device, and the compiler's out-of-memory message states the available bytes (v5e: 15.75
  GiB of 16; v4 devices are single TensorCores: 15.25 GiB of a chip's 32).
  """
  kind = device.device_kind
  if kind not in _AVAILABLE:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    s = jax.ShapeDtypeStruct((2**40 // 4,), np.float32,
                             sharding=NamedSharding(Mesh(np.array([device]), ("d",)),
                                                    PartitionSpec()))
    try:
      jax.jit(lambda x: x + 1).lower(s).compile()
    except Exception as e:
      found = _oom_bytes(str(e))
      if found is None:
        raise RuntimeError(f"could not read the available HBM of {kind!r} from the compiler: "
                           f"{e}") from None
      _AVAILABLE[kind] = found[1]
    else:
      raise RuntimeError(f"the compiler accepted a 1 TiB program for {kind!r}: cannot measure "
                         "its HBM")
  return _AVAILABLE[kind]


def _oom_bytes(message: str) -> tuple[int, int] | None:
  """``(required, available)`` bytes from an XLA:TPU out-of-memory compile error."""
  m = _OOM.search(message)
  if not m:
    return None
  return (int(float(m.group(1)) * _UNIT[m.group(2)]), int(float(m.group(3)) * _UNIT[m.group(4)]))


@dataclasses.dataclass(frozen=True)
class TopologyCompile:
  """One train step compiled ahead of time for a TPU topology; bytes are per device.

  ``measured`` is None when the compiler did not produce the step: for lack of HBM
  (``required`` holds the bytes it said the step needs) or because the compiler itself failed
  (``compiler_failed``; ``required`` is None). ``error`` holds its message either way.
  """

  topology: str
  device_kind: str
  num_devices: int
  chip_hbm: int  # documented HBM per chip (`HBM_PER_CHIP`)
  hbm_available: int  # what the compiler lets one program use per device (`hbm_available`)
  estimate: Estimate  # `estimate` of the same tree, dtypes and plan
  compile_seconds: float
  measured: Measured | None = None  # HBM: argument, output, alias, temp; collective bytes
  host_argument: int = 0  # pinned_host bytes, as the compiler reports them
  host_output: int = 0
  host_temp: int = 0
  batch_bytes: int = 0  # the batch's share of the arguments
  error: str | None = None
  required: int | None = None
  formulation: str | None = None  # how the step gathers parameters (`ZeroStep.formulation`)
  compiled: Any = dataclasses.field(default=None, repr=False, compare=False)
  plan: Any = dataclasses.field(default=None, repr=False, compare=False)  # over the topology

  @property
  def compiler_failed(self) -> bool:
    """The compiler failed for a reason other than memory (not a verdict on fitting)."""
    return self.measured is None and self.required is None

  @property
  def fits(self) -> bool:
    """The compiler accepted the step and its HBM peak is within the available HBM."""
    return self.measured is not None and self.measured.peak <= self.hbm_available

  @property
  def persistent(self) -> int | None:
    """HBM arguments other than the batch: parameters, optimizer state, step counters."""
    return None if self.measured is None else self.measured.argument - self.batch_bytes

  def table(self) -> str:
    """The report `zerojax compile` prints."""
    g = _fmt
    e = self.estimate
    lines = [f"{self.topology}: {self.num_devices} x {self.device_kind}, stage {e.stage}; "
             f"compiled ahead of time in {self.compile_seconds:.1f} s (nothing allocated)",
             f"  HBM per chip {g(self.chip_hbm)} (documented); the compiler allows "
             f"{g(self.hbm_available)} per device"]
    if self.formulation is not None:
      lines.append(f"  parameters gathered: {self.formulation} (see ZeroConfig.gather)")
    if self.compiler_failed:
      lines += ["  COMPILER ERROR: XLA failed to compile the step for a reason other than "
                "memory, so this says nothing about whether it fits",
                f"  compiler: {self.error}"]
      return "\n".join(lines)
    if self.measured is None:
      need = f" it needs {g(self.required)}" if self.required is not None else ""
      lines += [f"  DOES NOT FIT: the compiler refused the step:{need}",
                f"  compiler: {self.error}",
                f"  estimate: params + optimizer state {g(e.persistent)} on device, "
                f"{g(e.host)} on host; gradients {g(e.grads)}"]
      return "\n".join(lines)
    m = self.measured
    rows = [("HBM arguments", m.argument, f"estimate {g(e.persistent)} params + optimizer "
             f"state, + {g(self.batch_bytes)} batch"),
            ("HBM outputs", m.output, f"{g(m.alias)} of them alias donated arguments"),
            ("HBM temp", m.temp, "gathered layers, gradients, activations"),
            ("HBM peak", m.peak, "arguments + temp + outputs not aliased"),
            ("host arguments", self.host_argument, f"pinned_host; estimate {g(e.host)}"),
            ("host outputs", self.host_output, ""),
            ("host temp", self.host_temp, "")]
    w = max(len(r[0]) for r in rows)
    lines += [f"  {name.ljust(w)}  {g(b):>14}  {note}".rstrip() for name, b, note in rows]
    coll = ", ".join(f"{k} {g(v)}" for k, v in m.collectives.items() if v) or "none"
    lines.append(f"  collectives per step: {g(m.collective_total)} ({coll})")
    verdict = "FITS" if self.fits else "DOES NOT FIT"
    lines.append(f"  {verdict}: peak {g(m.peak)} of {g(self.hbm_available)} usable "
                 f"({g(self.chip_hbm)} chip), {g(self.hbm_available - m.peak)} left")
    return "\n".join(lines)


def _fmt(b: float) -> str:
  return f"{b / GiB:,.2f} GiB" if abs(b) >= GiB else f"{b / 2**20:,.1f} MiB"


def lm_train_step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
  """The next-token step `compile_for_topology` compiles by default (``batch['x']`` tokens,
  ``batch['y']`` targets), with `zerojax.value_and_grad` as `zerojax train` uses."""
  from zerojax.core.grad import value_and_grad
  from zerojax.models import loss_fn

  def lf(params, batch):
    return loss_fn(state.apply_fn({"params": params}, batch["x"]), batch["y"])
  loss, grads = value_and_grad(lf)(state.params, batch)
  return state.apply_gradients(grads=grads), {"loss": loss}


def compile_for_topology(config: ZeroConfig | str | Any, model: Any, batch: Any,
                         topology: str, *, tx: Any = None, train_step: Any = None,
                         init_args: tuple | None = None,
                         compiler_options: dict[str, Any] | None = None) -> TopologyCompile:
  """Compiles the real zerojax train step for a TPU topology ahead of time, on any machine.

  State and batch are abstract (``jax.eval_shape``): nothing is allocated. The TPU compiler
  reports per-device HBM (arguments, outputs, temp) and ``pinned_host`` bytes separately, and
  refuses a step that does not fit the chip; both outcomes are returned.

  Args:
    config: a `ZeroConfig`, or the path of a zerojax or DeepSpeed config file.
    model: a GPT preset name (``zerojax.models.PRESETS``; compute dtype from
      ``config.compute_dtype``) or a Flax linen module.
    batch: ``(batch, seq_len)`` for a token model (global rows, tokens per row), or a pytree
      of ``jax.ShapeDtypeStruct`` for ``train_step``.
    topology: a TPU slice name such as ``'v5e:8x8'`` or ``'v5p:4x4x4'`` (`tpu_topology`).
    tx: the optax transformation (default ``optax.adamw(1e-4)``).
    train_step: ``(state, batch) -> (state, metrics)`` (default `lm_train_step`).
    init_args: arguments of ``model.init`` after the rng (default ``(batch['x'],)``).
    compiler_options: XLA options for the compile.
  """
  import time
  import optax
  from zerojax.runtime.checkpoint import abstract_train_state
  from zerojax.core.mesh import make_mesh
  from zerojax.core.step import zero_step
  if not isinstance(config, ZeroConfig):
    from zerojax.tools.config_file import load_config
    config = load_config(config, apply_xla_flags=False).config
  topo = tpu_topology(topology)
  devices = list(topo.devices)
  seq_len = batch[1] if isinstance(batch, tuple) and len(batch) == 2 else None
  model = _resolve_model(model, config, seq_len)
  tx = optax.adamw(1e-4) if tx is None else tx
  if isinstance(batch, tuple) and len(batch) == 2 and all(
      isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in batch):
    rows, seq = batch
    if rows < 1 or seq < 1:
      raise ValueError(f"batch={batch!r} is invalid: (rows, seq_len), both >= 1")
    tokens = jax.ShapeDtypeStruct((rows, seq), np.int32)
    batch = {"x": tokens, "y": tokens}
  if init_args is None:
    if not (isinstance(batch, dict) and "x" in batch):
      raise ValueError("init_args is needed when batch has no 'x' entry to initialise the "
                       "model with")
    init_args = (batch["x"],)
  mesh = make_mesh(config, devices=devices)
  state, plan = abstract_train_state(model, tx, jax.random.key(0), *init_args, config=config,
                                     mesh=mesh)
  n = len(devices)
  batch_sh = plan.batch(batch)
  batch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       batch, batch_sh)
  batch_bytes = sum(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                    for x, s in zip(jax.tree.leaves(batch), jax.tree.leaves(batch_sh)))
  est = estimate(state.params, tx, config=config, mesh=mesh)
  step = zero_step(plan)(train_step or lm_train_step)
  common = dict(topology=topology, device_kind=devices[0].device_kind, num_devices=n,
                chip_hbm=HBM_PER_CHIP[topology.split(":")[0]],
                hbm_available=hbm_available(devices[0]), estimate=est, batch_bytes=batch_bytes,
                plan=plan)
  t0 = time.perf_counter()
  lowered = step.lower(state, batch)
  common["formulation"] = next(iter(step.formulation.values()), None)
  try:
    compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
  except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses programs that exceed HBM
    found = _oom_bytes(str(e))
    # Anything else is the compiler's own failure (seen: a RET_CHECK in libtpu 0.0.42.1 for
    # one 512-chip case), reported as such, not as a memory verdict.
    return TopologyCompile(compile_seconds=time.perf_counter() - t0, error=str(e).strip(),
                           required=None if found is None else found[0], **common)
  dt = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  return TopologyCompile(
      compile_seconds=dt, measured=measure(compiled),
      host_argument=int(ma.host_argument_size_in_bytes),
      host_output=int(ma.host_output_size_in_bytes), host_temp=int(ma.host_temp_size_in_bytes),
      compiled=compiled, **common)


def _resolve_model(model: Any, config: ZeroConfig, seq_len: Any) -> Any:
  if not isinstance(model, str):
    return model
  from zerojax.models import GPT, PRESETS
  if model not in PRESETS:
    raise ValueError(f"model={model!r} is not a GPT preset; presets are {sorted(PRESETS)} "
                     "(or pass a Flax linen module)")
  import jax.numpy as jnp
  cfg = dataclasses.replace(PRESETS[model], dtype=jnp.dtype(config.compute_dtype))
  if isinstance(seq_len, (int, np.integer)) and seq_len > 0:  # position table = sequence
    cfg = dataclasses.replace(cfg, seq_len=int(seq_len))
  return GPT(cfg)
