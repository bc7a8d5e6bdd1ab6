"""Memory: the ZeRO paper's estimate, generalised to real trees, and measurement of compiled steps.

Estimate
  `paper_bytes`, `estimate` and the fit checks live in `zerojax.core.budget` (the step refuses a
  state or step that does not fit) and are re-exported here.

Measure
  `measure` reads XLA's compiled memory analysis (argument, output, alias, temp bytes per
  device) and counts collective bytes in the compiled HLO, weighting ops inside ``while`` loops
  (scans) by their trip counts.

Compile for a TPU or GPU pod
  `compile_for_topology` compiles the real train step of a `ZeroConfig` and a Flax module for a
  TPU slice (``'v5e:8x8'``, with libtpu: ``pip install "zerojax[tpu]"``) or a GPU pod
  (``'h100:8'``) on any machine, from abstract state, and reports HBM and ``pinned_host``
  bytes apart; `gather_schedule` reads from its schedule which all-gathers run beside
  computation. (Config files and GPT preset names are
  resolved above this layer: `zerojax.memory.compile_for_topology` takes them.)
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import importlib.util
import itertools
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zerojax._compat import without_cache_writes
from zerojax.core.budget import (PAPER_K, DeviceMemoryError, Estimate, bytes_limit,
                                 check_fits, check_state_fits, compiled_peak, estimate,
                                 num_params, paper_bytes, suggest_option)
from zerojax.core.config import ZeroConfig
from zerojax.core.grad import value_and_grad
from zerojax.core.mesh import make_mesh
from zerojax.core.pipeline import LAYERS_SCOPE
from zerojax.core import zeropp
from zerojax.core.step import zero_step
from zerojax.runtime import gpu
from zerojax.core.create import abstract_train_state

__all__ = ["PAPER_K", "paper_bytes", "Estimate", "num_params", "estimate", "Measured", "measure",
           "collective_bytes", "collective_bytes_by_dtype", "GatherSchedule", "gather_schedule",
           "collective_schedule", "replica_groups", "reductions", "activation_collectives",
           "textbook_bytes", "GiB", "HBM_PER_CHIP", "PEAK_FLOPS_PER_CHIP",
           "HBM_BANDWIDTH_PER_CHIP", "ICI_BANDWIDTH_PER_CHIP", "TOPOLOGY_EXAMPLES", "TPU_EXTRA",
           "tpu_topology", "topology_size", "hbm_available", "USABLE_HBM", "TopologyCompile",
           "lm_train_step", "next_token_loss", "nnx_lm_train_step", "compile_for_topology",
           "DeviceMemoryError", "bytes_limit", "compiled_peak", "check_fits", "check_state_fits"]


@dataclasses.dataclass(frozen=True)
class Measured:
  """Per-device bytes of a compiled step, from XLA's memory analysis and HLO.

  Attributes:
    argument: bytes of the step's arguments.
    output: bytes of its outputs.
    alias: bytes of outputs that reuse (alias) a donated argument.
    temp: bytes of temporaries.
    collectives: bytes per device per step by collective kind (see `collective_bytes`).
  """

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
    """Bytes per device per step of all collectives together."""
    return sum(self.collectives.values())


def measure(compiled: Any) -> Measured:
  """Measures a compiled step's memory and collective bytes per device.

  Args:
    compiled: a ``jax.stages.Compiled`` (e.g. ``step.lower(state, batch).compile()``).

  Returns:
    The `Measured` bytes.
  """
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
  * all-reduce: twice its operand size (a reduce-scatter plus an all-gather);
  * all-to-all, collective-permute: their result size.

  Each op counts once per execution where it is issued (see `collective_bytes_by_dtype`):
  inside a ``while`` body once per iteration, by the loop's known trip count or, where the
  HLO prints none, the one its counter gives (`_trip_from_condition`). How each backend's
  HLO shows these ops is in ``docs/design.md``.

  Args:
    hlo_text: ``compiled.as_text()``.

  Returns:
    ``{kind: bytes}`` for all-gather, reduce-scatter, all-reduce, all-to-all and
    collective-permute (0 where absent).
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
  ``('all-gather', 's8')`` plus their ``f32`` scales.

  Each collective counts where it is issued: a synchronous op, or the start of an
  asynchronous one (XLA:GPU's ``*-start`` or ``async-start``, XLA:TPU's
  ``async-collective-start`` fusion), once per run of the computation issuing it (`_sites`).
  Dones and XLA:TPU's continuation fusions hold copies of the same collective and count
  nothing, wherever they sit (XLA:TPU puts continuations inside its windowed-einsum loops);
  `collective_schedule` reads the same sites.

  Args:
    hlo_text: ``compiled.as_text()``.
    scope: count only collectives whose metadata ``op_name`` contains it (a
      ``jax.named_scope``, e.g. `zerojax.core.zeropp.GATHER_SCOPE`).

  Returns:
    Bytes per device per step by ``(kind, dtype)``.
  """
  comps, mult = _parse_hlo(hlo_text)
  out: dict[tuple[str, str], int] = {}
  for _, k, site in _issued(comps, mult, scope):
    for kind, dt, b in site.parts:
      out[(kind, dt)] = out.get((kind, dt), 0) + k * b
  return out


@dataclasses.dataclass(frozen=True)
class _Site:
  """One collective instruction as the computation running it issues or awaits it."""

  index: int  # position in that computation's schedule (its named instructions)
  phase: str  # 'start', 'done' or 'sync'
  key: str  # pairs a start with its done: the start's name (XLA:GPU), channel (XLA:TPU)
  line: str  # the collective's own instruction (inside a fusion or async wrapper)
  op_name: str | None  # its JAX operation (metadata), else its wrapper's
  parts: tuple[tuple[str, str, int], ...] = ()  # (kind, dtype, bytes); starts and syncs only


_DONE = re.compile(r"\s(?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute|"
                   r"async)-done\(%([\w.\-]+)")
_ASYNC_START = re.compile(r"\sasync-start\(")


def _runners(comps: dict[str, list[str]]) -> set[str]:
  """Computations whose instructions run as such: not fused computations nor the bodies of
  XLA:GPU's ``async-start`` wrappers (their instruction issues what they hold)."""
  wrapped = {c for lines in comps.values() for l in lines if _ASYNC_START.search(l)
             for c in _CALLEE.findall(l)}
  return set(comps) - set(_fusion_owners(comps)) - wrapped


def _inner_collectives(comps: dict[str, list[str]], callee: str, depth: int = 0
                       ) -> list[tuple[str, list[str]]]:
  """``(instruction, its computation's lines)`` of each collective in a fused or wrapped
  computation, through nested fusions."""
  out = []
  body = comps.get(callee, [])
  for l in body:
    if _OP.search(l):
      out.append((l, body))
    elif " fusion(" in l and depth < 8:
      for c in _CALLEE.findall(l):
        out.extend(_inner_collectives(comps, c, depth + 1))
  return out


def _parts(line: str, lines: list[str], comps: dict[str, list[str]]
           ) -> tuple[tuple[str, str, int], ...]:
  """``(kind, dtype, bytes)`` of one collective instruction in the paper's convention. A
  synchronous all-reduce whose result is only sliced (XLA:CPU's reduce-scatter, XLA:TPU's
  ``all-reduce-scatter`` fusions) is a reduce-scatter."""
  m = _OP.search(line)
  kind, start = m.group(2), bool(m.group(3))
  if kind == "all-reduce" and not start:
    return tuple(("reduce-scatter", dt, n) if sliced else ("all-reduce", dt, 2 * n)
                 for n, sliced, dt in _all_reduce_parts(line, m.group(1), lines, comps))
  return tuple((kind, dt, n) for dt, n in _paper_bytes(kind, start, m.group(1), line).items())


def _op_name(line: str) -> str | None:
  m = _OP_NAME.search(line)
  return m.group(1) if m else None


def _sites(comps: dict[str, list[str]], name: str, has_matmul: Any = None
           ) -> tuple[list[_Site], list[tuple[int, bool]]]:
  """The collectives one running computation issues and awaits, in schedule order, and
  (with ``has_matmul``) its computations ``(index, has a matmul)``.

  A start is XLA:GPU's ``<kind>-start`` (synchronous where its backend config says
  ``"is_sync": true``) or ``async-start`` around a collective, or XLA:TPU's
  ``async-collective-start`` fusion (its ``AsyncCollectiveStart``); a done pairs with it by
  the start's name (XLA:GPU) or channel (XLA:TPU). XLA:TPU's continuation fusions
  (``async_collective_fusion``) compute while their collective is in flight: computation
  here, no collective. Any other fusion holding a collective issues it synchronously."""
  lines = [l for l in comps.get(name, []) if _name_of(l)]
  sites: list[_Site] = []
  compute: list[tuple[int, bool]] = []
  for i, l in enumerate(lines):
    nm = _name_of(l)
    m = _OP.search(l)
    if m:
      phase = "start" if m.group(3) and not _SYNC.search(l) else "sync"
      sites.append(_Site(i, phase, nm, l, _op_name(l), _parts(l, comps[name], comps)))
      continue
    done = _DONE.search(l)
    if done:
      sites.append(_Site(i, "done", done.group(1), l, _op_name(l)))
      continue
    if _ASYNC_START.search(l) or " fusion(" in l:
      callee = (_CALLEE.findall(l) or [""])[0]
      inner = _inner_collectives(comps, callee)
      if inner:
        body = "\n".join(comps.get(callee, []))
        if callee.startswith("async_collective_fusion"):
          if has_matmul is not None:
            compute.append((i, has_matmul(l)))  # runs while its collective progresses
          continue
        if "AsyncCollectiveDone" in body or nm.startswith("async-collective-done"):
          phase = "done"
        elif (_ASYNC_START.search(l) or "AsyncCollectiveStart" in body
              or nm.startswith("async-collective-start")):
          phase = "start"
        else:
          phase = "sync"
        for il, ilines in inner:
          ch = _CHANNEL.search(il)
          key = nm if _ASYNC_START.search(l) or ch is None else "ch" + ch.group(1)
          sites.append(_Site(i, phase, key, il, _op_name(il) or _op_name(l),
                             () if phase == "done" else _parts(il, ilines, comps)))
        continue
    if has_matmul is not None and (" fusion(" in l or any(op in l for op in _COMPUTE_OPS)):
      compute.append((i, has_matmul(l)))
  return sites, compute


def _issued(comps: dict[str, list[str]], mult: dict[str, int], scope: str | None = None):
  """``(computation, runs per step, site)`` of every collective issued (a start or a
  synchronous op) by a running computation, under ``scope`` where given."""
  for name in _runners(comps):
    k = mult.get(name, 0)
    if not k:
      continue
    for site in _sites(comps, name)[0]:
      if site.phase != "done" and _in_scope(site, scope):
        yield name, k, site


def _in_scope(site: _Site, scope: str | None) -> bool:
  return scope is None or (site.op_name is not None and scope in site.op_name)


def _fusion_owners(comps: dict[str, list[str]]) -> dict[str, str]:
  """``{fused computation: the computation whose instructions run it}``, through nested
  fusions."""
  caller = {c: name for name, lines in comps.items() for l in lines
            if any(f" {op}(" in l for op in _FUSION_OPS) for c in _CALLEE.findall(l)}

  def top(c: str, depth: int = 0) -> str:
    return top(caller[c], depth + 1) if c in caller and depth < 16 else c

  return {c: top(c) for c in caller}


def _bytes_by_dtype(shapes: str) -> dict[str, int]:
  out: dict[str, int] = {}
  for dt, dims in _SHAPE.findall(shapes):
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    out[dt] = out.get(dt, 0) + n * _DTYPE_BYTES[dt]
  return out


def _top_level(shapes: str) -> list[str]:
  """The elements of a printed HLO tuple shape ``(a, (b, c), d)``; ``[shapes]`` if not a tuple."""
  s = shapes.strip()
  if not s.startswith("("):
    return [s]
  out, depth, cur = [], 0, ""
  for ch in s[1:-1]:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      out.append(cur.strip())
      cur = ""
    else:
      cur += ch
  if cur.strip():
    out.append(cur.strip())
  return out


def _async_halves(kind: str, shapes: str) -> tuple[str | None, str]:
  """``(operands, results)`` of a collective's printed shape. XLA:GPU prints an asynchronous
  ``*-start`` as ``((operands), (results))`` (or ``(operand, result)``, plus context scalars for
  a permute); an ``all-reduce-start`` prints only its results, which equal its operands."""
  parts = _top_level(shapes)
  if kind == "all-reduce" or len(parts) < 2 or not shapes.strip().startswith("("):
    return None, shapes
  return parts[0], parts[1]


def _paper_bytes(kind: str, start: bool, shapes: str, line: str) -> dict[str, int]:
  """Bytes by dtype of one collective in the paper's convention (see `collective_bytes`)."""
  operands, results = _async_halves(kind, shapes) if start else (None, shapes)
  if kind == "reduce-scatter":
    if operands is not None:
      return _bytes_by_dtype(operands)
    k = _group_size(line)  # the synchronous form prints only the (scattered) result
    return {dt: n * k for dt, n in _bytes_by_dtype(results).items()}
  scale = 2 if kind == "all-reduce" else 1
  return {dt: n * scale for dt, n in _bytes_by_dtype(results).items()}


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
  condition is ``state[i] < N`` with N a constant, ``state[i]`` starts at a constant
  (through copies) in the loop's initial tuple and the body adds a constant step to it (1
  where the body's update is not that form). XLA:TPU's windowed-einsum loops keep their
  counter past the operands and step it by 2 (two chunks an iteration)."""
  cond = _COND.search(while_line)
  lines = comps.get(cond.group(1), []) if cond else []
  root = next((_LT.search(l) for l in lines if _LT.search(l)), None)
  if root is None:
    return None
  bound = _constant(root.group(2), lines)
  if bound is None:
    return None
  counter = next((l for l in lines if _name_of(l) == root.group(1)), "")
  idx = re.search(r"\sget-tuple-element\(.*index=(\d+)", counter)
  index = int(idx.group(1)) if idx else 0
  init = re.search(r"\swhile\(%([\w.\-]+)\)", while_line)
  start = 0
  if init:
    tup = next((l for l in caller if _name_of(l) == init.group(1)), "")
    operands = _tuple_operands(tup)
    if index < len(operands):
      start = _constant(operands[index], caller)
      if start is None:
        return None
  body = _WHILE.search(while_line)
  step = _step(comps.get(body.group(1), []) if body else [], index)
  return max(-(-(bound - start) // step), 0)


def _tuple_operands(line: str) -> list[str]:
  """The operand names of a ``tuple(...)`` instruction."""
  m = re.search(r"\stuple\((.*?)\)(?:,|$)", line)
  return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []


def _step(body: list[str], index: int) -> int:
  """What a loop body adds to its state's element ``index`` each iteration: the constant of
  ``add(get-tuple-element(param, index), constant)`` at that place of its root tuple, else 1."""
  root = next((l for l in body if l.lstrip().startswith("ROOT") and " tuple(" in l), "")
  operands = _tuple_operands(root)
  if index >= len(operands):
    return 1
  update = next((l for l in body if _name_of(l) == operands[index]), "")
  add = re.search(r"\sadd\(%([\w.\-]+), %([\w.\-]+)\)", update)
  if not add:
    return 1
  for counter, c in ((add.group(1), add.group(2)), (add.group(2), add.group(1))):
    gte = next((l for l in body if _name_of(l) == counter), "")
    if re.search(rf"\sget-tuple-element\(.*index={index}\b", gte):
      step = _constant(c, body)
      if step is not None and step > 0:
        return step
  return 1


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
  """How a compiled (scheduled) step issues one kind of collective; bytes per device per step.

  A schedule is the order the compiler will issue instructions in, so it tells which
  collectives are asynchronous (a start and a done with other instructions between) and
  which computations are issued while one is in flight. It does not tell how long either
  takes, so whether a transfer is fully hidden is a question for a profile on real chips.

  Attributes:
    total: bytes (each collective once, loop bodies once per iteration).
    asynchronous: bytes issued as start/done pairs the runtime may overlap.
    overlapped: asynchronous bytes with at least one computation scheduled between start
      and done.
    synchronous: blocking bytes: one op, or a pair the compiler marks ``is_sync``.
    pairs: asynchronous collectives in the program text (not weighted by loop trips).
    overlapped_pairs: those of them with a computation between start and done.
    overlapped_matmul: asynchronous bytes with a matrix multiplication between start and done.
    kind: the collective kind, ``'all-gather'`` or ``'reduce-scatter'``.
  """

  total: int  # bytes (each collective once, loop bodies once per iteration)
  asynchronous: int  # issued as start/done pairs the runtime may overlap
  overlapped: int  # async, with at least one computation scheduled between start and done
  synchronous: int  # blocking: one op, or a pair XLA:GPU marks ``is_sync``
  pairs: int  # async collectives in the program text (not weighted by loop trips)
  overlapped_pairs: int
  overlapped_matmul: int = 0  # async, with a matrix multiplication between start and done
  kind: str = "all-gather"

  @property
  def overlapped_share(self) -> float:
    """Share of the bytes issued asynchronously with a computation between start and done."""
    return self.overlapped / self.total if self.total else 0.0

  @property
  def matmul_share(self) -> float:
    """Share of the bytes issued asynchronously with a matmul (a dot, a GEMM custom call or
    a fusion or loop containing one) scheduled between start and done."""
    return self.overlapped_matmul / self.total if self.total else 0.0


_CALLEE = re.compile(r"calls=%?([\w.\-]+)")
# A fusion's opcodes: XLA:GPU (jaxlib 0.11 on) can also issue one asynchronously, as
# ``fusion-start`` / ``fusion-done``.
_FUSION_OPS = ("fusion", "fusion-start")
_COMPUTE_OPS = (" convolution(", " dot(", " custom-call(", " while(", " call(", " reduce(",
                " sort(", " scatter(", " gather(")
_MATMUL_OPS = (" dot(", " convolution(")
_GEMM_TARGET = re.compile(r'custom_call_target="[^"]*(?:gemm|matmul|Gemm|MatMul)[^"]*"')
_SYNC = re.compile(r'"is_sync":\s*true')


def _matmul_finder(comps: dict[str, list[str]]):
  """``has(line)``: whether an instruction is, or calls a computation holding, a matmul."""
  memo: dict[str, bool] = {}

  def comp_has(name: str, depth: int = 0) -> bool:
    if name not in memo:
      memo[name] = False  # cycles cannot occur in HLO; this also bounds the recursion
      memo[name] = any(line_has(l, depth + 1) for l in comps.get(name, []))
    return memo[name]

  def line_has(line: str, depth: int = 0) -> bool:
    if any(op in line for op in _MATMUL_OPS) or _GEMM_TARGET.search(line):
      return True
    return depth < 8 and any(comp_has(c, depth) for c in _CALLS.findall(line))

  return line_has


def collective_schedule(hlo_text: str, kind: str = "all-gather",
                        scope: str | None = None) -> GatherSchedule:
  """Reads the schedule of a compiled step's HLO for one kind of collective.

  Each collective is issued synchronously or as an asynchronous start/done pair; a pair
  counts as overlapped when a computation is scheduled between its start and its done
  (around a loop's back edge where the done comes first: the collective for the next
  iteration is issued in this one). Any fusion or other computation that is not itself a
  collective counts as compute; `GatherSchedule.matmul_share` counts only matrix
  multiplications. Bytes follow `collective_bytes`. The XLA:GPU and XLA:TPU forms it reads
  are described in ``docs/design.md``.

  Args:
    hlo_text: ``compiled.as_text()`` of a scheduled (compiled) step.
    kind: ``'all-gather'`` or ``'reduce-scatter'``.
    scope: count only collectives whose metadata ``op_name`` contains it (a
      ``jax.named_scope``, e.g. the scanned layers' own, `zerojax.core.pipeline.LAYERS_SCOPE`).

  Returns:
    The `GatherSchedule` of ``kind``.

  Raises:
    ValueError: ``kind`` is neither ``'all-gather'`` nor ``'reduce-scatter'``.
  """
  if kind not in ("all-gather", "reduce-scatter"):
    raise ValueError(f"kind={kind!r} is invalid: 'all-gather' or 'reduce-scatter'")
  comps, mult = _parse_hlo(hlo_text)
  has_matmul = _matmul_finder(comps)
  asynchronous = overlapped = overlapped_mm = synchronous = pairs = overlapped_pairs = 0
  for name in _runners(comps):
    k = mult.get(name, 0)
    if not k:
      continue
    sites, compute = _sites(comps, name, has_matmul)
    starts: dict[str, list[tuple[int, int]]] = {}
    dones: dict[str, list[int]] = {}
    for s in sites:
      if not _in_scope(s, scope) and s.phase != "done":
        continue
      b = sum(n for kd, _, n in s.parts if kd == kind)
      if s.phase == "sync":
        synchronous += k * b
      elif s.phase == "start" and b:
        starts.setdefault(s.key, []).append((s.index, b))
      elif s.phase == "done":
        dones.setdefault(s.key, []).append(s.index)
    for key, issued in starts.items():
      for n, (i, b) in enumerate(issued):
        pairs += 1
        asynchronous += k * b
        awaited = dones.get(key, [])
        # A done before its start in a loop body awaits the next iteration's (pipelined
        # across the back edge): what runs beside it wraps around. A start awaited in
        # another computation is in flight at least until this one ends.
        j = awaited[n] if n < len(awaited) else None
        between = [mm for c, mm in compute
                   if (c > i if j is None else (i < c < j) if j > i else (c > i or c < j))]
        if between:
          overlapped += k * b
          overlapped_pairs += 1
          if any(between):
            overlapped_mm += k * b
  return GatherSchedule(asynchronous + synchronous, asynchronous, overlapped, synchronous,
                        pairs, overlapped_pairs, overlapped_mm, kind)


def _op_bytes(line: str) -> int:
  m = _OP.search(line)
  return sum(_paper_bytes(m.group(2), bool(m.group(3)), m.group(1), line).values()) if m else 0


def _collectives(comps: dict[str, list[str]], callee: str) -> list[tuple[str, str | None, int]]:
  """``(kind, channel id, bytes)`` of each collective inside a fused computation, as
  `collective_bytes` counts it (`_parts`)."""
  out = []
  for l, lines in _inner_collectives(comps, callee):
    ch = _CHANNEL.search(l)
    for kind, _, n in _parts(l, lines, comps):
      out.append((kind, ch.group(1) if ch else None, n))
  return out


def gather_schedule(hlo_text: str) -> GatherSchedule:
  """`collective_schedule` of the all-gathers.

  Args:
    hlo_text: ``compiled.as_text()`` of a scheduled (compiled) step.

  Returns:
    The `GatherSchedule` of the all-gathers.
  """
  return collective_schedule(hlo_text, "all-gather")


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
  """The device groups of one collective in an HLO line.

  Reads any of the forms XLA prints: ``mesh['a'=4,'b'=2], device_ids=(...) {'a'}``,
  ``[G,S]<=[dims]T(perm)`` or ``{{0,1},{2,3}}``.

  Args:
    line: one HLO instruction line.

  Returns:
    The groups as frozensets of partition ids (positions in the mesh's flattened device
    array); ``None`` when the line names no groups.
  """
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
  """Every all-reduce and reduce-scatter of a compiled step, in program order.

  Args:
    hlo_text: ``compiled.as_text()``.

  Returns:
    ``(kind, replica groups, bytes)`` per collective (groups as `replica_groups` gives them);
    bytes are the collective's result.
  """
  out = []
  for line in hlo_text.splitlines():
    m = re.search(r"=\s*(.*?)\s(all-reduce|reduce-scatter)(?:-start)?\(", line)
    if m:
      out.append((m.group(2), replica_groups(line), _bytes_of(m.group(1))))
  return out


def _param_shapes(plan: Any, shards: bool = False) -> set[tuple[int, ...]]:
  """Shapes a collective moving parameters (or their gradients or layers) has: a leaf, or any
  trailing part of it (one layer of a stacked leaf); with ``shards``, its at-rest shard too.
  Shards are for collective-permutes and all-to-alls: XLA:TPU may gather a weight as a ring of
  collective-permutes of its shard, each beside a slice of the matmul that reads it. (An
  all-gather's result and a reduce-scatter's operand are whole tensors, and a batch shard can
  have a weight shard's size.)"""
  shapes: set[tuple[int, ...]] = set()
  for lp in plan.leaves:
    for shape in ((tuple(lp.shape), _shard_shape(lp, plan.mesh)) if shards
                  else (tuple(lp.shape),)):
      shapes.update(shape[j:] for j in range(len(shape)))
  return shapes


def _padded(dims: tuple[int, ...], shapes: set[tuple[int, ...]]) -> bool:
  """Whether ``dims`` is a parameter shape with dimensions padded up by less than 1/64 (XLA:TPU
  reduces a 32000-row embedding gradient as 32256 rows, to split it in tile-aligned blocks)."""
  return any(len(p) == len(dims) and len(p) > 1 and dims != p
             and all(p_ <= d < p_ + max(1, p_ // 64) for d, p_ in zip(dims, p))
             for p in shapes)


_PAD_OF = re.compile(r"\spad\(%([\w.\-]+),")


def _unpadded(line: str, defs: dict[str, str]) -> str | None:
  """The result type of what an all-reduce's operand pads, if it is a ``pad``: XLA:TPU's
  reduce-scatter fusions all-reduce a gradient padded by up to a few percent per device
  (a ``[8192, 2048]`` one as ``[8512, 2048]``), then slice each device's rows."""
  operand = re.search(r"\sall-reduce\(%([\w.\-]+)", line)
  pad = defs.get(operand.group(1), "") if operand else ""
  inner = _PAD_OF.search(pad)
  src = defs.get(inner.group(1), "") if inner else ""
  m = re.match(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+)", src)
  return m.group(1) if m else None


def _regrouped(dims: tuple[int, ...], shapes: set[tuple[int, ...]]) -> bool:
  """Whether ``dims``, its dimensions in some order, is a parameter shape with some of its
  dimensions split (a kernel's heads, or its sharded axis as devices by rows) or some
  adjacent whole ones merged, not both: the layouts XLA gives a weight. A batch of
  activations can have a stacked kernel's element count (Llama-3-8B's ``[16, 8192, 4096]``
  and its 32 stacked ``[4096, 4096]`` query kernels), but not such a layout."""
  cuts = lambda d: {math.prod(d[i:]) for i in range(len(d))}
  n = math.prod(dims)
  same = [cuts(p) for p in shapes if math.prod(p) == n]
  return any(mine <= theirs or theirs <= mine
             for mine in map(cuts, set(itertools.permutations(dims))) for theirs in same)


def _row_block(dims: tuple[int, ...], shapes: set[tuple[int, ...]]) -> bool:
  """Whether ``dims`` is a block of leading rows of a parameter shape or shard: XLA:TPU
  realigns a gradient shard padded to its tiles (a 32000-row embedding's 4000-row shards as
  4032) by collective-permutes of such blocks, which carry no JAX operation's name."""
  return any(len(p) == len(dims) > 1 and dims[1:] == p[1:] and 0 < dims[0] < p[0]
             for p in shapes)


def _shard_shape(lp: Any, mesh: Any) -> tuple[int, ...]:
  """One device's block of ``lp`` in its at-rest (sharded) layout."""
  spec = tuple(lp.sharded) + (None,) * (len(lp.shape) - len(tuple(lp.sharded)))
  ways = lambda e: math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e or ()))
  return tuple(d // ways(e) for d, e in zip(lp.shape, spec))


def activation_collectives(hlo_text: str, plan: Any) -> dict[tuple[str, str, str], int]:
  """Collectives of a compiled step that move something other than parameters, their
  gradients or shards: ``{(kind, 'dtype[shape]', op): bytes per step}``, ``op`` the JAX
  operation the partitioner placed it for (its metadata name, e.g. ``'dot_general'``, or
  ``'scatter-add'`` for an embedding lookup's gradient) (the paper's convention,
  loop bodies by trip count). A tensor counts as a parameter's when its element count is a
  parameter leaf's or a trailing part of one and its shape that shape, in some order, with
  dimensions split or merged (`_regrouped`: a kernel's heads), for a collective-permute or
  all-to-all also its at-rest shard's;
  when its shape is one of those padded by XLA by less than 1/64 per dimension; or when it is
  a flat buffer no larger than all parameters together (XLA's combiner concatenates gradients
  into one 1-D buffer); or, for a collective-permute XLA made itself (no JAX operation's
  name), when it is a block of a parameter shard's leading rows (`_row_block`). A collective
  of one element (a loss, a norm) is neither, nor is a collective under zerojax's own ZeRO++
  scopes (`_zerojax_own`: quantised weights, their scales, gradient chunks). What is left
  moves the model's activations: the partitioner chose to reshard them instead of gathering a
  weight.

  Args:
    hlo_text: ``compiled.as_text()``.
    plan: the step's `ShardingPlan` (its leaves' shapes and at-rest shards).

  Returns:
    ``{(kind, 'dtype[shape]', op): bytes per step}`` of the collectives left.
  """
  # (shapes, element counts) a parameter's collective has; shards only for permutes.
  known = {k: (p, {math.prod(x) for x in p})
           for k, p in ((False, _param_shapes(plan)), (True, _param_shapes(plan, shards=True)))}
  total = sum(math.prod(lp.shape) for lp in plan.leaves)
  comps, mult = _parse_hlo(hlo_text)
  defs = {m.group(1): line for lines in comps.values() for line in lines
          if (m := _INSTR.match(line))}
  out: dict[tuple[str, str], int] = {}
  # Each collective where it is issued, as `collective_bytes` reads it (`_issued`).
  for _, k, site in _issued(comps, mult):
    line = site.line
    m = _OP.search(line)
    kind, start = m.group(2), bool(m.group(3))
    operands, results = _async_halves(kind, m.group(1)) if start else (None, m.group(1))
    tensors = operands if (kind == "reduce-scatter" and operands is not None) else results
    if kind == "all-reduce" and not start:
      tensors = _unpadded(line, defs) or tensors
    group = _group_size(line) if (kind == "reduce-scatter" and operands is None) else 1
    for dt, dims in _SHAPE.findall(tensors):
      n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
      flat = dims.count(",") == 0 and n * group <= total
      shape = tuple(int(d) for d in dims.split(",") if d)
      shapes, sizes = known[kind in ("collective-permute", "all-to-all")]
      if (n <= 1 or flat or _padded(shape, shapes)
          or (n * group in sizes and (group > 1 or _regrouped(shape, shapes)))):
        continue
      op = _OP_NAME.search(line)
      if kind == "collective-permute" and op is None and _row_block(shape, shapes):
        continue
      if op is not None and _zerojax_own(op.group(1)):
        continue
      b = n * group * _DTYPE_BYTES[dt] * (2 if kind == "all-reduce" else 1)
      tag = (kind, f"{dt}[{dims}]", op.group(1).rsplit("/", 1)[-1].rstrip(")") if op else "")
      out[tag] = out.get(tag, 0) + k * b
  return out


_OWN_SCOPE = re.compile(r"(?:^|[/(:])(?:%s)/" % "|".join(
    (zeropp.GATHER_SCOPE, zeropp.REGATHER_SCOPE, zeropp.REDUCE_SCOPE)))


def _zerojax_own(op_name: str) -> bool:
  """Whether every JAX operation in ``op_name`` (XLA joins a combined collective's as
  ``prefix/(a:b)``) ran under a scope of zerojax's own collectives of parameters and
  gradients (ZeRO++'s), whose scales and padded chunks have no parameter's element count."""
  parts = op_name[op_name.rindex("/(") + 2:-1].split(":") if op_name.endswith(")") and \
      "/(" in op_name else [op_name]
  return all(_OWN_SCOPE.search(p) for p in parts)


def textbook_bytes(plan: Any) -> int:
  """The ZeRO paper's collective volume per step for ``plan``, in the counting of
  `collective_bytes` (full tensors): stage 3 gathers every sharded parameter twice in the
  compute dtype and reduce-scatters its gradient once (3 psi); stages 1-2 reduce-scatter the
  gradient and all-gather the updated parameters (2 psi); stage 0 all-reduces it (2 psi).
  Gradients count in ``reduce_dtype``, else the compute dtype; stage 1-2 gathers move the
  parameters' own dtype (they rest replicated in it).

  Args:
    plan: the `ShardingPlan` (its config's stage and dtypes, its leaves).

  Returns:
    Bytes per step.
  """
  cfg = plan.config
  cd = np.dtype(cfg.compute_dtype).itemsize
  rd = np.dtype(cfg.reduce_dtype).itemsize if cfg.reduce_dtype else cd
  total = 0
  for lp in plan.leaves:
    n = math.prod(lp.shape)
    if not np.issubdtype(np.dtype(lp.dtype), np.floating):
      continue
    pd = np.dtype(lp.dtype).itemsize
    grad = rd * n if lp.trainable else 0
    if cfg.shards_params:
      total += (2 * cd * n if lp.is_sharded else 0) + grad
    elif not cfg.shards_opt_state:
      total += 2 * grad
    else:
      total += grad + (pd * n if lp.trainable else 0)
  return total


# -- ahead-of-time compilation for TPU topologies ----------------------------------------------

GiB = 2**30

# HBM per chip from Google's Cloud TPU pages (docs.cloud.google.com/tpu/docs/v4, v5e, v5p, v6e).
# The pages write "GB" for v5e/v5p/v6e, but the compiler's usable HBM on a v5e
# (`hbm_available`, BENCHMARKS.md) exceeds 16e9 bytes: the figures are GiB.
HBM_PER_CHIP = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}
# Peak bf16 FLOP/s, HBM bytes/s and the collective bandwidth per chip, from the same pages
# (`zerojax.runtime.step_time`). The pages give v5e/v5p/v6e's bidirectional ICI bandwidth per
# chip (400, 1200, 800 GB/s); a ring collective moves data one way round, so half of it
# counts, which is also each pod's "all-reduce bandwidth per Pod" over its chips (v5e 51.2
# TB/s / 256, v6e 102.4 / 256). v4's page gives only the pod's 1.1 PB/s over 4096 chips.
PEAK_FLOPS_PER_CHIP = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}
HBM_BANDWIDTH_PER_CHIP = {"v4": 1200e9, "v5e": 819e9, "v5p": 2765e9, "v6e": 1638e9}
ICI_BANDWIDTH_PER_CHIP = {"v4": 1.1e15 / 4096, "v5e": 200e9, "v5p": 600e9, "v6e": 400e9}
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

  Args:
    name: ``GENERATION:SHAPE`` with generation ``v4``, ``v5e``, ``v5p`` or ``v6e``.

  Returns:
    The topology description; its ``devices`` are the slice's devices.

  Raises:
    ValueError: ``name`` is not such a slice, or libtpu cannot describe it.
    ImportError: libtpu is not installed.
  """
  if not isinstance(name, str) or not _TOPOLOGY.match(name):
    raise ValueError(f"topology={name!r} is invalid: a TPU slice GENERATION:SHAPE with "
                     f"generation one of {sorted(HBM_PER_CHIP)}, e.g. "
                     f"{', '.join(TOPOLOGY_EXAMPLES)}; or a GPU pod such as h100:8, h100:2x8, "
                     "a100-80g:8, h200:8, b200:8")
  if importlib.util.find_spec("libtpu") is None:
    raise ImportError(f"compiling for TPU topology {name!r} needs libtpu, which is not "
                      f"installed; install it with: {TPU_EXTRA}")
  if not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):
    # No TPU chips here, so libtpu's one-process lock protects nothing; without this, two
    # processes compiling for topologies (tests beside a benchmark) fail on the lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    return topologies.get_topology_desc(platform="tpu", topology_name=name)
  except Exception as e:  # libtpu's message names what it could not build
    raise ValueError(f"topology={name!r} is not a TPU slice libtpu can describe ({e}); "
                     f"examples that work: {', '.join(TOPOLOGY_EXAMPLES)}") from None


_AVAILABLE: dict[str, int] = {}
# What XLA:TPU lets one program use per device (`hbm_available`) as its out-of-memory message
# states it, by libtpu release and device kind, measured with ``measure=True``. Reading it
# costs a compile of its own (a second XLA:TPU compile beside the step's); a release or kind
# not listed is measured so, once per process.
USABLE_HBM = {
    ("0.0.42.1", "TPU v4"): 16374562816,  # 15.25 GiB
    ("0.0.42.1", "TPU v5 lite"): 16911433728,  # 15.75 GiB
    ("0.0.42.1", "TPU v5"): 102800042229,  # 95.74 GiB
    ("0.0.42.1", "TPU v6 lite"): 33554432000,  # 31.25 GiB
    ("0.0.50.1", "TPU v5 lite"): 16911433728,
}


def _libtpu_version() -> str | None:
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


def hbm_available(device: Any, *, measure: bool = False) -> int:
  """HBM bytes the TPU compiler lets one program use on ``device`` (a topology device).

  The compiler's own figure, not the chip's: a program needing far more than any chip has is
  compiled for the device, and the compiler's out-of-memory message states the available
  bytes (less than the chip's HBM; BENCHMARKS.md lists them). `USABLE_HBM` holds those
  already measured for the installed libtpu, so that compiling a step for a listed chip is
  the only XLA:TPU compile.

  Args:
    device: a device of a `tpu_topology`.
    measure: compile the probe even when `USABLE_HBM` lists the device (to check it).

  Returns:
    Bytes per device.

  Raises:
    RuntimeError: the compiler's message did not state the available HBM, or it accepted
      the oversized probe program.
  """
  kind = device.device_kind
  if not measure:
    listed = USABLE_HBM.get((_libtpu_version(), kind))
    if listed is not None:
      return listed
  if measure or kind not in _AVAILABLE:
    s = jax.ShapeDtypeStruct((2**40 // 4,), np.float32,
                             sharding=NamedSharding(Mesh(np.array([device]), ("d",)),
                                                    PartitionSpec()))
    try:
      with without_cache_writes():
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
  """One train step compiled ahead of time for a TPU or GPU topology; bytes are per device.

  ``measured`` is None when the compiler did not produce the step: for lack of HBM
  (``required`` holds the bytes it said the step needs) or because the compiler itself failed
  (``compiler_failed``; ``required`` is None). ``error`` holds its message either way.

  Attributes:
    topology: the topology name compiled for.
    device_kind: the devices' kind.
    num_devices: the devices of the topology.
    chip_hbm: documented HBM per chip (`HBM_PER_CHIP`, or the GPU's memory).
    hbm_available: what one program may use per device (`hbm_available`; on GPU the JAX
      client's share of ``chip_hbm``).
    estimate: `estimate` of the same tree, dtypes and plan.
    compile_seconds: how long the compile took.
    measured: HBM argument, output, alias and temp bytes and collective bytes, or ``None``.
    host_argument: ``pinned_host`` argument bytes, as the compiler reports them.
    host_output: ``pinned_host`` output bytes.
    host_temp: ``pinned_host`` temporary bytes.
    batch_bytes: the batch's share of the arguments.
    error: the compiler's message when it did not produce the step.
    required: the bytes the compiler said the step needs, when it refused it for memory.
    formulation: how the step gathers parameters (`ZeroStep.formulation`).
    remat: where the config's remat acted (`ZeroStep.remat`).
    layers: whether scanned layers ran one ahead (`ZeroStep.layers`).
    layer_gathers: the schedule of the scanned layers' own all-gathers.
    layer_scatters: the schedule of the scanned layers' own reduce-scatters.
    memory_fraction: GPU only: the share of device memory the JAX client allocates from.
    suggestion: what would fit, when the step does not.
    textbook: `textbook_bytes` of the plan.
    gathers: `collective_schedule` of the all-gathers.
    scatters: `collective_schedule` of the reduce-scatters.
    activations: `activation_collectives` of the step.
    step_time: the step time predicted from the schedule at published peaks
      (`zerojax.runtime.step_time.StepTime`), with a predictor.
    step_time_ceiling: the same with matmuls at their measured ceiling, where one is
      published.
    compiled: the ``jax.stages.Compiled`` step.
    plan: the `ShardingPlan` over the topology's devices.
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
  remat: str | None = None  # where the config's remat acted (`ZeroStep.remat`)
  layers: str | None = None  # whether scanned layers ran one ahead (`ZeroStep.layers`)
  # The schedules of the scanned layers' own collectives (`zerojax.core.pipeline.LAYERS_SCOPE`)
  layer_gathers: GatherSchedule | None = None
  layer_scatters: GatherSchedule | None = None
  # GPU only: the share of device memory the JAX client allocates from (`hbm_available` is
  # that share of `chip_hbm`); the GPU compiler does not refuse a step, so the verdict is ours.
  memory_fraction: float | None = None
  suggestion: str | None = None  # what would fit, when the step does not
  textbook: int | None = None  # `textbook_bytes` of the plan
  gathers: GatherSchedule | None = None  # `collective_schedule` of the all-gathers
  scatters: GatherSchedule | None = None  # ... and of the reduce-scatters
  activations: dict = dataclasses.field(default_factory=dict)  # `activation_collectives`
  # `zerojax.runtime.step_time.StepTime`: the schedule's predicted step at published peaks,
  # and with matmuls at their measured ceiling where one is published (`MEASURED_MATMUL`)
  step_time: Any = None
  step_time_ceiling: Any = None
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
    """The report ``zerojax compile`` prints.

    Returns:
      Multi-line text: memory, collectives, predicted step time and the verdict.
    """
    lines = self._head()
    if self.compiler_failed:
      return "\n".join(lines + [
          "  COMPILER ERROR: XLA failed to compile the step for a reason other than memory, "
          "so this says nothing about whether it fits", f"  compiler: {self.error}"])
    if self.measured is None:
      g, e = _fmt, self.estimate
      need = f" it needs {g(self.required)}" if self.required is not None else ""
      return "\n".join(lines + [
          f"  DOES NOT FIT: the compiler refused the step:{need}", f"  compiler: {self.error}",
          f"  estimate: params + optimizer state {g(e.persistent)} on device, "
          f"{g(e.host)} on host; gradients {g(e.grads)}"])
    return "\n".join(lines + self._memory_rows() + self._collective_lines()
                     + self._step_time_lines() + self._verdict())

  def _step_time_lines(self) -> list[str]:
    if self.step_time is None:
      return []
    out = [f"  {l}" for l in self.step_time.lines()]
    c = self.step_time_ceiling
    if c is not None:
      rate = (f": {c.tokens_per_second_per_device:,.0f} tokens/s per device"
              if c.tokens_per_second else "")
      out.append(f"  with matmuls at their measured ceiling (step_time.MEASURED_MATMUL): "
                 f"{c.seconds * 1e3:,.1f} ms{rate}"
                 + (f", MFU {c.mfu:.0%}" if c.mfu is not None else ""))
    return out

  def _config(self) -> ZeroConfig:
    """The config compiled for (a bare one of the estimate's stage without a plan)."""
    return self.plan.config if self.plan is not None else ZeroConfig(stage=self.estimate.stage)

  def _head(self) -> list[str]:
    g = _fmt
    lines = [f"{self.topology}: {self.num_devices} x {self.device_kind}, "
             f"{self._config().label}; compiled ahead of time in {self.compile_seconds:.1f} s "
             "(nothing allocated)"]
    if self.memory_fraction is None:
      lines.append(f"  HBM per chip {g(self.chip_hbm)} (documented); the compiler allows "
                   f"{g(self.hbm_available)} per device")
    else:
      lines.append(f"  memory per GPU {g(self.chip_hbm)}; the JAX GPU client allocates "
                   f"{self.memory_fraction:g} of it, {g(self.hbm_available)} "
                   "(XLA_PYTHON_CLIENT_MEM_FRACTION; e.g. =.95 to allow more). XLA:GPU "
                   "compiles steps that do not fit: this verdict is zerojax's")
    if self.formulation is not None:
      lines.append(f"  parameters gathered: {self.formulation} (see ZeroConfig.gather)")
    if self.remat is not None:
      lines.append(f"  {self.remat}")
    if self.layers is not None:
      lines.append(f"  {self.layers}")
    return lines

  def _memory_rows(self) -> list[str]:
    g, m, e = _fmt, self.measured, self.estimate
    rows = [("HBM arguments", m.argument, f"estimate {g(e.persistent)} params + optimizer "
             f"state, + {g(self.batch_bytes)} batch"),
            ("HBM outputs", m.output, f"{g(m.alias)} of them alias donated arguments"),
            ("HBM temp", m.temp, "gathered layers, gradients, activations"),
            ("HBM peak", m.peak, "arguments + temp + outputs not aliased"),
            ("host arguments", self.host_argument, f"pinned_host; estimate {g(e.host)}"),
            ("host outputs", self.host_output, ""),
            ("host temp", self.host_temp, "")]
    w = max(len(r[0]) for r in rows)
    return [f"  {name.ljust(w)}  {g(b):>14}  {note}".rstrip() for name, b, note in rows]

  def _collective_lines(self) -> list[str]:
    g, m = _fmt, self.measured
    coll = ", ".join(f"{k} {g(v)}" for k, v in m.collectives.items() if v) or "none"
    lines = [f"  collectives per step: {g(m.collective_total)} ({coll})"]
    if self.textbook:
      psi = 3 if self._config().shards_params else 2
      lines.append(f"  textbook ZeRO volume {g(self.textbook)} ({psi} psi "
                   f"in the dtypes moved): {m.collective_total / self.textbook:.2f}x")
    for sched in (self.gathers, self.scatters):
      if sched is not None and sched.total:
        # The schedule's bytes beside the totals above: the same reading (`_issued`).
        lines.append(f"  {sched.kind}: {g(sched.total)}, {sched.overlapped_share:.0%} of bytes "
                     "async with compute between start and done, "
                     f"{sched.matmul_share:.0%} with a matmul; {g(sched.synchronous)} blocking")
    ag, rs = self.layer_gathers, self.layer_scatters
    if ag is not None and rs is not None and ag.total:
      lines.append(f"  scanned layers one ahead: {g(ag.total)} of all-gathers, "
                   f"{ag.matmul_share:.0%} with a matmul; {g(rs.total)} of reduce-scatters, "
                   f"{rs.matmul_share:.0%} with a matmul (the rest of the step: embeddings, "
                   "heads, layers outside a scan)")
    if self.activations:
      top = sorted(self.activations.items(), key=lambda kv: -kv[1])
      lines.append(f"  activation collectives: {g(sum(self.activations.values()))} per step "
                   "(the partitioner moves activations, not weights): " + ", ".join(
                       f"{k} {shape} for {op or '?'} {g(b)}" for (k, shape, op), b in top[:4])
                   + (", ..." if len(top) > 4 else ""))
    else:
      lines.append("  activation collectives: none (only parameters, gradients and their "
                   "shards move)")
    return lines

  def _verdict(self) -> list[str]:
    g, m = _fmt, self.measured
    left = self.hbm_available - m.peak
    if self.fits:
      return [f"  FITS: peak {g(m.peak)} of {g(self.hbm_available)} usable "
              f"({g(self.chip_hbm)} per device), {g(left)} left"]
    lines = [f"  DOES NOT FIT: peak {g(m.peak)} is {g(-left)} over the "
             f"{g(self.hbm_available)} usable ({g(self.chip_hbm)} per device)"]
    if self.suggestion:
      lines.append(f"  {self.suggestion}")
    return lines


def _fmt(b: float) -> str:
  return f"{b / GiB:,.2f} GiB" if abs(b) >= GiB else f"{b / 2**20:,.1f} MiB"


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross entropy in fp32 (`zerojax.models.loss_fn` is this function).

  Args:
    logits: ``[..., vocab]`` logits.
    targets: integer targets shaped as ``logits`` without its last dimension.

  Returns:
    The mean cross entropy, a float32 scalar.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def lm_train_step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
  """The next-token step `compile_for_topology` compiles by default.

  It differentiates with `zerojax.value_and_grad`, as ``zerojax train`` does.

  Args:
    state: a linen train state.
    batch: ``{'x': tokens, 'y': targets}``.

  Returns:
    ``(new_state, {'loss': loss})``.
  """
  def lf(params, batch):
    return next_token_loss(state.apply_fn({"params": params}, batch["x"]), batch["y"])
  loss, grads = value_and_grad(lf)(state.params, batch)
  return state.apply_gradients(grads=grads), {"loss": loss}


def nnx_lm_train_step(model: Any, optimizer: Any, batch: Any) -> dict[str, Any]:
  """`lm_train_step` for an NNX model and its ``nnx.Optimizer`` (as ``zerojax finetune``
  trains one).

  Args:
    model: the NNX model, updated in place.
    optimizer: its ``nnx.Optimizer``, updated in place.
    batch: ``{'x': tokens, 'y': targets}``.

  Returns:
    ``{'loss': loss}``.
  """
  loss, grads = value_and_grad(lambda m, b: next_token_loss(m(b["x"]), b["y"]))(model, batch)
  optimizer.update(model, grads)
  return {"loss": loss}


def compile_for_topology(config: ZeroConfig, model: Any, batch: Any,
                         topology: str, *, tx: Any = None, train_step: Any = None,
                         init_args: tuple | None = None,
                         compiler_options: dict[str, Any] | None = None,
                         memory_fraction: float | None = None,
                         model_flops: float | None = None,
                         predictor: Any = None) -> TopologyCompile:
  """Compiles the real zerojax train step for a TPU or GPU topology ahead of time, on any
  machine.

  State and batch are abstract (``jax.eval_shape``): nothing is allocated. The compiler
  reports per-device HBM (arguments, outputs, temp) and ``pinned_host`` bytes separately. A
  TPU compile refuses a step that does not fit the chip; for GPUs, whose compiler does not,
  the peak is compared with the memory the JAX GPU client will allocate from
  (``memory_fraction`` of the device, `zerojax.runtime.gpu.usable_memory`). Either outcome is
  returned, with what would fit when the step does not. (`zerojax.memory.compile_for_topology`
  also takes a config file path and a GPT preset name.)

  Args:
    config: the `ZeroConfig`.
    model: a Flax linen module, or a function making an NNX module (built abstractly,
      `zerojax.core.create.abstract_nnx`).
    batch: ``(batch, seq_len)`` for a token model (global rows, tokens per row), or a pytree
      of ``jax.ShapeDtypeStruct`` for ``train_step``.
    topology: a TPU slice name such as ``'v5e:8x8'`` or ``'v5p:4x4x4'`` (`tpu_topology`), or
      a GPU pod such as ``'h100:8'`` or ``'h100:2x8'`` (`zerojax.runtime.gpu.gpu_topology`).
    tx: the optax transformation (default ``optax.adamw(1e-4)``).
    train_step: ``(state, batch) -> (state, metrics)`` (default `lm_train_step`); for an NNX
      model ``(model, optimizer, batch) -> metrics`` (default `nnx_lm_train_step`).
    init_args: arguments of ``model.init`` after the rng (default ``(batch['x'],)``).
    compiler_options: XLA options for the compile.
    memory_fraction: GPUs only: the share of device memory the JAX client allocates from
      (default: ``XLA_PYTHON_CLIENT_MEM_FRACTION``, else 0.75).
    model_flops: the model's FLOPs per step over all devices, for the predicted MFU (default:
      `zerojax.runtime.step_time.model_flops` of all parameters, plus attention where the
      module's config names its layers and heads).
    predictor: predicts the step time from the compiled schedule,
      `zerojax.runtime.step_time.predict_compiled` (which ``zerojax.memory``'s
      `compile_for_topology` and ``zerojax compile`` pass); None: no prediction.

  Returns:
    The `TopologyCompile`; ``step_time`` holds the step time predicted from the compiled
    schedule, with a ``predictor``.

  Raises:
    TypeError: ``config`` is not a `ZeroConfig`, or ``model`` is neither a linen module nor
      a callable.
    ValueError: ``topology`` is not a known TPU slice or GPU pod, ``batch`` is an invalid
      ``(rows, seq_len)``, or a linen model has no ``init_args`` and no ``batch['x']``.
    ImportError: a TPU topology without libtpu installed.
  """
  linen = isinstance(model, nn.Module)
  if not isinstance(config, ZeroConfig) or not (linen or callable(model)):
    raise TypeError("compile_for_topology(config, model, ...) takes a ZeroConfig and a Flax "
                    "linen module or a function making an NNX module; "
                    "zerojax.memory.compile_for_topology also reads a config file path and a "
                    "preset name")
  devices, memory = _topology_devices(topology, memory_fraction)
  tx = optax.adamw(1e-4) if tx is None else tx
  batch = _abstract_batch(batch)
  mesh = make_mesh(config, devices=devices)
  if linen:
    if init_args is None:
      if not (isinstance(batch, dict) and "x" in batch):
        raise ValueError("init_args is needed when batch has no 'x' entry to initialise the "
                         "model with")
      init_args = (batch["x"],)
    state, plan = abstract_train_state(model, tx, jax.random.key(0), *init_args, config=config,
                                       mesh=mesh)
    params, module = state.params, model
    step = zero_step(plan)(train_step or lm_train_step)
    lower = lambda b: step.lower(state, b)
  else:  # NNX: abstract model and optimizer, as `zerojax.create_nnx` would make them
    from zerojax.core.create import abstract_nnx  # lazy: flax.nnx
    module, opt, plan = abstract_nnx(model, tx, config=config, mesh=mesh)
    params = nnx.state(module, nnx.Param)
    step = zero_step(plan)(train_step or nnx_lm_train_step)
    lower = lambda b: step.lower(module, opt, b)
  batch_sh = plan.batch(batch)
  batch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       batch, batch_sh)
  batch_bytes = sum(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                    for x, s in zip(jax.tree.leaves(batch), jax.tree.leaves(batch_sh)))
  common = dict(topology=topology, device_kind=devices[0].device_kind,
                num_devices=len(devices), batch_bytes=batch_bytes, plan=plan,
                estimate=estimate(params, tx, config=config, mesh=mesh),
                textbook=textbook_bytes(plan), **memory)
  predict = None
  if predictor is not None:
    predict = lambda text: predictor(text, topology, devices, module, params, batch, plan,
                                     model_flops)
  return _compile(lower, step, params, batch, tx, config, devices, compiler_options, common,
                  predict)


def topology_size(topology: str) -> int:
  """The number of devices of a TPU slice or GPU pod name (``'v5e:2x4'``: 8, ``'h100:2x8'``: 16).

  Args:
    topology: a name `compile_for_topology` takes.

  Returns:
    How many devices a program compiled for it spans.
  """
  if gpu.is_gpu_topology(topology):
    _, hosts, per_host = gpu.parse_gpu_topology(topology)
    return hosts * per_host
  return len(tpu_topology(topology).devices)


def _topology_devices(topology: str, memory_fraction: float | None
                      ) -> tuple[list[Any], dict[str, Any]]:
  """The devices of a TPU slice or GPU pod, and what memory one program may use on each."""
  if gpu.is_gpu_topology(topology):
    spec = gpu.parse_gpu_topology(topology)[0]
    fraction = gpu.memory_fraction() if memory_fraction is None else memory_fraction
    usable = gpu.usable_memory(spec, fraction)  # validates the fraction before compiling
    devices = list(gpu.gpu_topology(topology).devices)
    return devices, dict(chip_hbm=spec.memory, hbm_available=usable, memory_fraction=fraction)
  devices = list(tpu_topology(topology).devices)
  return devices, dict(chip_hbm=HBM_PER_CHIP[topology.split(":")[0]],
                       hbm_available=hbm_available(devices[0]))


def _abstract_batch(batch: Any) -> Any:
  """``(rows, seq_len)`` as abstract token and target batches; any other batch as it is."""
  if isinstance(batch, tuple) and len(batch) == 2 and all(
      isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in batch):
    rows, seq = batch
    if rows < 1 or seq < 1:
      raise ValueError(f"batch={batch!r} is invalid: (rows, seq_len), both >= 1")
    tokens = jax.ShapeDtypeStruct((rows, seq), np.int32)
    return {"x": tokens, "y": tokens}
  return batch


def _compile(lower: Any, step: Any, params: Any, batch: Any, tx: Any, config: ZeroConfig,
             devices: list[Any], compiler_options: dict[str, Any] | None, common: dict[str, Any],
             predict: Any = None) -> TopologyCompile:
  """Compiles ``step`` (``lower(batch)`` lowers it) and reads the result: memory,
  collectives, schedule, what would fit."""
  t0 = time.perf_counter()
  lowered = lower(batch)
  common["formulation"] = next(iter(step.formulation.values()), None)
  common["remat"] = next(iter(step.remat.values()), None)
  common["layers"] = next(iter(step.layers.values()), None)
  try:
    # Not stored in JAX's persistent cache: no client here could load it back.
    with without_cache_writes():
      compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
  except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses programs that exceed HBM
    found = _oom_bytes(str(e))
    # Anything else is the compiler's own failure, reported as such, not as a memory verdict.
    return TopologyCompile(compile_seconds=time.perf_counter() - t0, error=str(e).strip(),
                           required=None if found is None else found[0], **common)
  dt = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  measured, text = measure(compiled), compiled.as_text()
  suggestion = None
  if measured.peak > common["hbm_available"]:
    suggestion = suggest_option(measured.peak, common["hbm_available"], config, params,
                                tx, None, devices)
  at_peak, at_ceiling = predict(text) if predict is not None else (None, None)
  return TopologyCompile(
      step_time=at_peak, step_time_ceiling=at_ceiling,
      compile_seconds=dt, measured=measured,
      host_argument=int(ma.host_argument_size_in_bytes),
      host_output=int(ma.host_output_size_in_bytes), host_temp=int(ma.host_temp_size_in_bytes),
      suggestion=suggestion, gathers=collective_schedule(text, "all-gather"),
      scatters=collective_schedule(text, "reduce-scatter"),
      layer_gathers=collective_schedule(text, "all-gather", LAYERS_SCOPE),
      layer_scatters=collective_schedule(text, "reduce-scatter", LAYERS_SCOPE),
      activations=activation_collectives(text, common["plan"]), compiled=compiled, **common)
