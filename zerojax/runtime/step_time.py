"""A predicted step time, read from a compiled (scheduled) step before any hardware is rented.

The model is a roofline per instruction, walked in the compiler's schedule:

* each fusion, GEMM or attention kernel takes ``max(flops / peak FLOP/s, bytes / HBM bandwidth)``.
  FLOPs are the matrix multiplications' (``2 * |result| * K`` per dot, the same per
  convolution; cuDNN flash attention ``4 * B * H * Tq * Tk * d`` forward and 2.5 times that
  backward, halved under a causal mask); other arithmetic is taken as free beside its bytes.
  Bytes are the operands read and results written, a sliced operand counted as its slice and a
  buffer updated in place as its update. A fusion issued asynchronously (``fusion-start`` /
  ``fusion-done``) is one fusion, costed at its start;
* each collective takes ``(n - 1) / n * bytes / bandwidth`` (a ring: all-gather and all-to-all
  over their result, reduce-scatter over its operand, all-reduce twice; a collective-permute
  moves its result once), ``bandwidth`` that of the slowest link its device group spans: NVLink
  within a host, the network per GPU across hosts, ICI on a TPU slice;
* compute runs in schedule order on one stream, collectives in issue order on another; an
  asynchronous collective runs from its start, and its done waits for it: the wait is the
  *exposed* communication. A blocking collective is exposed whole. A ``while`` loop costs its
  body per iteration (its known trip count); a collective a loop body issues for the next
  iteration is carried across the back edge.

Peaks are the devices' published figures (`zerojax.runtime.gpu.GPUS`, the TPU tables in
`zerojax.runtime.memory`), so the prediction is a lower bound on the step time: kernels below
peak, launch gaps and collectives slowed by the compute beside them all come on top.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

from zerojax.runtime import gpu
from zerojax.runtime import memory as mem

__all__ = ["DeviceRates", "device_rates", "OpCost", "op_costs", "StepTime", "predict_step_time",
           "predict_compiled", "model_flops", "attention_shape", "MEASURED_MATMUL"]


@dataclasses.dataclass(frozen=True)
class DeviceRates:
  """What a prediction needs of one device: published peaks, bytes/s per direction.

  Attributes:
    name: the device, e.g. ``'NVIDIA H100 80GB HBM3'`` or ``'TPU v5e'``.
    flops: peak dense FLOP/s by peak class (``'bf16'``, ``'tf32'``, ``'f32'``).
    hbm_bandwidth: HBM bytes/s.
    link_bandwidth: bytes/s within a host (NVLink) or a TPU slice (ICI).
    network_bandwidth: bytes/s per device across hosts (GPU); a TPU slice has no second tier.
    per_host: devices per host, where partition ids are host-major.
  """

  name: str
  flops: dict
  hbm_bandwidth: float
  link_bandwidth: float
  network_bandwidth: float
  per_host: int

  @property
  def peak(self) -> float:
    """The bf16 peak, against which MFU is stated."""
    return self.flops["bf16"]


def device_rates(topology: str) -> DeviceRates:
  """The published rates of a topology's devices.

  Args:
    topology: a GPU pod (``'h100:8'``, ``'h100:16x8'``) or a TPU slice (``'v5e:2x4'``).

  Returns:
    The device's `DeviceRates`.

  Raises:
    ValueError: a GPU topology name is malformed, or a TPU generation has no published rates.
  """
  if gpu.is_gpu_topology(topology):
    spec, _, per_host = gpu.parse_gpu_topology(topology)
    return DeviceRates(spec.device_kind, {"bf16": spec.bf16_flops, "tf32": spec.tf32_flops,
                                          "f32": spec.fp32_flops},
                       spec.hbm_bandwidth, spec.nvlink_bandwidth, spec.network_bandwidth,
                       per_host)
  gen = topology.split(":")[0]
  if gen not in mem.PEAK_FLOPS_PER_CHIP:
    raise ValueError(f"topology={topology!r}: no published rates for {gen!r}; known: "
                     f"{sorted(gpu.GPUS) + sorted(mem.PEAK_FLOPS_PER_CHIP)}")
  peak = mem.PEAK_FLOPS_PER_CHIP[gen]
  ici = mem.ICI_BANDWIDTH_PER_CHIP[gen]
  # f32 matmuls at the bf16 peak: XLA:TPU's default precision runs them as one bf16 MXU pass.
  return DeviceRates(f"TPU {gen}", {"bf16": peak, "tf32": peak, "f32": peak},
                     mem.HBM_BANDWIDTH_PER_CHIP[gen], ici, ici, 1 << 30)


# The largest bf16 matmul throughput measured on the GPU, over its dense peak: Stas Bekman's
# Maximum Achievable Matmul FLOPS finder (ml-engineering, compute/accelerator), as published in
# mag-/gpu_benchmark's README: H100 SXM 792.1 TFLOPS (6144x17920x2816), A100 SXM 267.9.
MEASURED_MATMUL = {"NVIDIA H100 80GB HBM3": 792.1e12 / 989.4e12,
                   "NVIDIA A100-SXM4-80GB": 267.9e12 / 312e12}


# -- parsing --------------------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_DIMS = {a: re.compile(a + r"=\{([\d,]*)\}") for a in ("lhs_contracting_dims",)}
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "iota",
         "get-dimension-size", "copy-done", "send-done", "recv-done",
         "fusion-done"}  # an async fusion is costed once, at its start (mem._FUSION_OPS)
_SLICING = {"dynamic-slice", "slice", "gather"}
_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  opcode: str
  operands: list
  attrs: str
  line: str


def _parse_line(line: str) -> _Instr | None:
  """``name = shape opcode(operands), attributes`` of one printed instruction."""
  m = _INSTR.match(line)
  if not m:
    return None
  name, rest = m.group(1), m.group(2)
  # The shape: a parenthesised tuple, or one token (layouts print without spaces).
  end = _matching(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
  if end <= 0:
    return None
  op = re.match(r"\s*([a-z][\w\-]*)\(", rest[end:])
  if op is None:
    return None
  open_at = end + op.end() - 1
  close = _matching(rest, open_at)
  return _Instr(name, rest[:end].strip(), op.group(1), _OPERAND.findall(rest[open_at:close]),
                rest[close + 1:], line)


def _matching(s: str, i: int) -> int:
  """Index of the parenthesis closing the one at ``s[i]``."""
  depth = 0
  for j in range(i, len(s)):
    if s[j] == "(":
      depth += 1
    elif s[j] == ")":
      depth -= 1
      if depth == 0:
        return j
  return len(s)


def _dims(shape: str) -> list[int]:
  m = mem._SHAPE.search(shape)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _dtype(shape: str) -> str:
  m = mem._SHAPE.search(shape)
  return m.group(1) if m else "f32"


def _peak_class(dtype: str, attrs: str) -> str:
  """Which published peak a matmul over ``dtype`` runs at."""
  if dtype in ("bf16", "f16") or dtype.startswith("f8") or dtype in ("s8", "u8"):
    return "bf16"  # no separate fp8/int8 peak is shipped: the bf16 one (a lower bound on speed)
  if "highest" in attrs.lower():
    return "f32"
  return "tf32"  # XLA:GPU's default precision lets f32 matmuls use TF32 tensor cores


class _Module:
  """A compiled module's computations, parsed once."""

  def __init__(self, hlo_text: str):
    self.comps, _ = mem._parse_hlo(hlo_text)
    self.instrs: dict[str, list[_Instr]] = {}
    self.shapes: dict[str, dict[str, str]] = {}
    for name, lines in self.comps.items():
      parsed = [p for p in map(_parse_line, lines) if p is not None]
      self.instrs[name] = parsed
      self.shapes[name] = {p.name: p.shape for p in parsed}
    self.entry = next((m.group(1) for l in hlo_text.splitlines()
                       if l.startswith("ENTRY") and (m := mem._COMP.match(l))), None)
    self._flops: dict[str, list] = {}

  # FLOPs ---------------------------------------------------------------------------------------

  def matmul_flops(self, comp: str, depth: int = 0) -> list[tuple[float, str]]:
    """``[(flops, peak class)]`` of the matmuls in a fused computation (nested ones too)."""
    if comp in self._flops or depth > 8:
      return self._flops.get(comp, [])
    out = []
    shapes = self.shapes.get(comp, {})
    for ins in self.instrs.get(comp, []):
      f = self.instr_flops(ins, shapes)
      if f:
        out.append(f)
      elif ins.opcode == "fusion":
        for c in mem._CALLEE.findall(ins.attrs):
          out.extend(self.matmul_flops(c, depth + 1))
    self._flops[comp] = out
    return out

  def instr_flops(self, ins: _Instr, shapes: dict[str, str]) -> tuple[float, str] | None:
    """``(flops, peak class)`` of one dot, convolution or GEMM / attention custom call."""
    if ins.opcode == "dot" and ins.operands:
      lhs = shapes.get(ins.operands[0], "")
      m = _DIMS["lhs_contracting_dims"].search(ins.attrs)
      k = math.prod(_dims(lhs)[int(d)] for d in m.group(1).split(",") if d) if m else 1
      return 2.0 * math.prod(_dims(ins.shape)) * k, _peak_class(_dtype(lhs), ins.attrs)
    if ins.opcode == "convolution" and len(ins.operands) > 1:
      kernel = _dims(shapes.get(ins.operands[1], ""))
      labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
      out_feat = kernel[labels.group(1).index("o")] if labels and "o" in labels.group(1) else 1
      return (2.0 * math.prod(_dims(ins.shape)) * math.prod(kernel) / max(out_feat, 1),
              _peak_class(_dtype(shapes.get(ins.operands[0], "")), ins.attrs))
    if ins.opcode == "custom-call":
      target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
      t = target.group(1) if target else ""
      if "fmha" in t or "flash" in t.lower():
        return self._attention_flops(ins, t)
      if "gemm" in t.lower() or "matmul" in t.lower():
        return self._gemm_flops(ins, shapes)
    return None

  def _attention_flops(self, ins: _Instr, target: str) -> tuple[float, str] | None:
    """cuDNN fused attention: two matmuls of ``[B, H, Tq, Tk]`` by ``d`` forward, five
    backward (FlashAttention's recompute of the scores plus four gradients); a causal mask
    skips about half of the blocks."""
    inter = re.search(r'"intermediate_tensor_shape":\s*\{"element_type":\s*"\w+",\s*'
                      r'"dimensions":\s*\[([^\]]*)\]', ins.attrs)
    q = re.search(r"operand_layout_constraints=\{\s*(\w+\[[\d,]*\])", ins.attrs)
    if not inter or not q:
      return None
    b, h, tq, tk = (int(x.strip().strip('"')) for x in inter.group(1).split(","))
    d = _dims(q.group(1))[-1]
    per = 2.0 * b * h * tq * tk * d
    f = per * (5 if "Backward" in target else 2)
    if '"mask_type": "CAUSAL"' in ins.attrs or '"mask_type":"CAUSAL"' in ins.attrs:
      f /= 2
    return f, "bf16"

  def _gemm_flops(self, ins: _Instr, shapes: dict[str, str]) -> tuple[float, str] | None:
    """cuBLAS / cuBLASLt GEMM custom calls: the dot dimension numbers in their config."""
    if not ins.operands:
      return None
    lhs = shapes.get(ins.operands[0], "")
    m = re.search(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]', ins.attrs)
    dims = _dims(lhs)
    k = math.prod(dims[int(x.strip().strip('"'))] for x in m.group(1).split(",") if x.strip()
                  ) if m else 1
    out = mem._top_level(ins.shape)[0] if ins.shape.startswith("(") else ins.shape
    return 2.0 * math.prod(_dims(out)) * k, _peak_class(_dtype(lhs), ins.attrs)

  # bytes ---------------------------------------------------------------------------------------

  def fusion_bytes(self, ins: _Instr, comp_shapes: dict[str, str]) -> float:
    """HBM bytes a fusion reads and writes: a parameter only sliced inside counts as its
    slices, a buffer updated in place (dynamic-update-slice) as the update."""
    callee = (mem._CALLEE.findall(ins.attrs) or [""])[0]
    body = self.instrs.get(callee)
    if not body:
      return mem._bytes_of(ins.shape) + sum(mem._bytes_of(comp_shapes.get(o, ""))
                                            for o in ins.operands)
    users: dict[str, list[_Instr]] = {}
    for b in body:
      for o in b.operands:
        users.setdefault(o, []).append(b)
    params = {int(re.search(r"parameter\((\d+)\)", b.line).group(1)): b for b in body
              if b.opcode == "parameter"}
    in_place = set()
    total = 0.0
    for root in self._roots(body):
      if root.opcode == "dynamic-update-slice" and len(root.operands) > 1:
        total += mem._bytes_of(self.shapes[callee].get(root.operands[1], ""))
        in_place.add(self._through_bitcast(root.operands[0], body))
      else:
        total += mem._bytes_of(root.shape)
    for i, p in params.items():
      if p.name in in_place:
        continue
      total += self._read_bytes(p.name, p.shape, users)
    return total

  def _roots(self, body: list[_Instr]) -> list[_Instr]:
    root = next((b for b in body if b.line.lstrip().startswith("ROOT")), body[-1])
    by_name = {b.name: b for b in body}
    if root.opcode == "tuple":
      return [by_name[o] for o in root.operands if o in by_name]
    return [root]

  def _through_bitcast(self, name: str, body: list[_Instr]) -> str:
    by_name = {b.name: b for b in body}
    while name in by_name and by_name[name].opcode in ("bitcast", "copy") and \
        by_name[name].operands:
      name = by_name[name].operands[0]
    return name

  def _read_bytes(self, name: str, shape: str, users: dict, depth: int = 0) -> float:
    """Bytes of ``name`` its users read: all of it, unless every use slices it."""
    us = users.get(name, [])
    if not us or depth > 4:
      return mem._bytes_of(shape)
    total = 0.0
    for u in us:
      if u.opcode in _SLICING and u.operands and u.operands[0] == name:
        total += mem._bytes_of(u.shape)
      elif u.opcode == "bitcast":
        total += self._read_bytes(u.name, u.shape, users, depth + 1)
      elif u.opcode == "dynamic-update-slice" and u.operands and u.operands[0] == name:
        continue  # updated in place: counted as the update, at the root
      else:
        return mem._bytes_of(shape)
    return min(total, mem._bytes_of(shape))


@dataclasses.dataclass(frozen=True)
class OpCost:
  """One scheduled instruction's roofline: FLOPs, HBM bytes and the seconds they take.

  Attributes:
    name: the instruction's name in the HLO.
    kind: ``'matmul'``, ``'attention'`` (compute-bound) or ``'memory'`` (bandwidth-bound).
    flops: its matmul FLOPs.
    bytes: the HBM bytes it reads and writes.
    seconds: the larger of its FLOPs' and its bytes' time at the device's peaks.
  """

  name: str
  kind: str
  flops: float
  bytes: float
  seconds: float


def _op_cost(mod: _Module, ins: _Instr, comp: str, rates: DeviceRates,
             efficiency: dict | None = None) -> OpCost | None:
  """The roofline of one compute instruction, or None for one that costs nothing."""
  shapes = mod.shapes[comp]
  if ins.opcode in _FREE:
    return None
  flops: list[tuple[float, str]] = []
  attention = False
  if ins.opcode in mem._FUSION_OPS:
    callee = (mem._CALLEE.findall(ins.attrs) or [""])[0]
    flops = mod.matmul_flops(callee)
    nbytes = mod.fusion_bytes(ins, shapes)
  else:
    f = mod.instr_flops(ins, shapes)
    if f:
      flops = [f]
      target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
      attention = bool(target) and ("fmha" in target.group(1) or
                                    "flash" in target.group(1).lower())
    if ins.opcode == "copy":
      nbytes = 2.0 * mem._bytes_of(ins.shape)
    elif ins.opcode in _SLICING:
      nbytes = 2.0 * mem._bytes_of(ins.shape)
    elif ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
      nbytes = 2.0 * mem._bytes_of(shapes.get(ins.operands[1], ""))
    else:
      nbytes = mem._bytes_of(ins.shape) + sum(mem._bytes_of(shapes.get(o, ""))
                                              for o in ins.operands)
  eff = efficiency or {}
  flop_s = sum(f / rates.flops.get(c, rates.peak) for f, c in flops) / eff.get(
      "attention" if attention else "matmul", 1.0)
  byte_s = nbytes / rates.hbm_bandwidth / eff.get("memory", 1.0)
  kind = ("attention" if attention else "matmul") if flop_s >= byte_s and flops else "memory"
  return OpCost(ins.name, kind, sum(f for f, _ in flops), nbytes, max(flop_s, byte_s))


def op_costs(hlo_text: str, rates: DeviceRates) -> list[OpCost]:
  """Every compute instruction of a compiled module, once each (not weighted by loop trips),
  with its roofline cost; fused computations are folded into their fusion.

  Args:
    hlo_text: ``compiled.as_text()``.
    rates: the device's `DeviceRates`.

  Returns:
    One `OpCost` per instruction that costs anything, computations in printed order.
  """
  mod = _Module(hlo_text)
  fused = set(mem._fusion_owners(mod.comps))
  out = []
  for comp, instrs in mod.instrs.items():
    if comp in fused:
      continue
    for ins in instrs:
      if _collective_kind(ins) or ins.opcode in ("while", "call", "conditional"):
        continue
      c = _op_cost(mod, ins, comp, rates)
      if c is not None:
        out.append(c)
  return out


# -- collectives ----------------------------------------------------------------------------------


def _collective_kind(ins: _Instr) -> tuple[str, str] | None:
  """``(kind, 'start'|'done'|'sync')`` of a collective instruction (XLA:GPU's forms)."""
  for k in _KINDS:
    if ins.opcode == k:
      return k, "sync"
    if ins.opcode == f"{k}-start":
      return k, ("sync" if mem._SYNC.search(ins.attrs) else "start")
    if ins.opcode == f"{k}-done":
      return k, "done"
  return None


def _link(line: str, rates: DeviceRates, host_of: Sequence[int] | None, n_devices: int
          ) -> tuple[int, float, str]:
  """``(group size, bandwidth, link name)`` of one collective."""
  groups = mem.replica_groups(line) or [frozenset(range(n_devices))]
  size = max(len(g) for g in groups)
  where = (lambda p: host_of[p] if host_of is not None and p < len(host_of)
           else p // max(rates.per_host, 1))
  spans = any(len({where(p) for p in g}) > 1 for g in groups)
  if spans:
    return size, rates.network_bandwidth, "network"
  return size, rates.link_bandwidth, "link"


def _collective_seconds(kind: str, full_bytes: float, size: int, bw: float) -> float:
  """Ring time of one collective moving ``full_bytes`` (`memory.collective_bytes`'s counting:
  all-reduce already doubled) over ``size`` devices."""
  if size <= 1 or full_bytes <= 0:
    return 0.0
  moved = full_bytes if kind == "collective-permute" else full_bytes * (size - 1) / size
  return moved / bw


def _fused_collective(mod: _Module, callee: str) -> tuple[str, float, str] | None:
  """XLA:TPU: ``(kind, bytes, line)`` of the collective inside a fusion."""
  colls = mem._collectives(mod.comps, callee)
  if not colls:
    return None
  kind = colls[0][0]
  line = next((l for l in mod.comps.get(callee, []) if mem._OP.search(l)), "")
  return kind, float(sum(b for _, _, b in colls)), line


# -- the schedule ---------------------------------------------------------------------------------


@dataclasses.dataclass
class _Acc:
  """Seconds and counts accumulated over a computation's schedule."""

  total: float = 0.0
  compute: float = 0.0
  exposed: float = 0.0
  comm: float = 0.0
  flops: float = 0.0
  bytes: float = 0.0
  by_kind: dict = dataclasses.field(default_factory=dict)
  by_link: dict = dataclasses.field(default_factory=dict)
  unknown_trips: int = 0

  def add(self, o: "_Acc", k: float = 1.0) -> None:
    for f in ("total", "compute", "exposed", "comm", "flops", "bytes"):
      setattr(self, f, getattr(self, f) + k * getattr(o, f))
    for d, od in ((self.by_kind, o.by_kind), (self.by_link, o.by_link)):
      for key, v in od.items():
        d[key] = d.get(key, 0.0) + k * v
    self.unknown_trips += o.unknown_trips


class _Schedule:
  """Walks computations in schedule order (see the module docstring)."""

  def __init__(self, mod: _Module, rates: DeviceRates, host_of, n_devices: int,
               efficiency: dict | None = None):
    self.mod, self.rates, self.host_of, self.n = mod, rates, host_of, n_devices
    self.eff = efficiency or {}
    self._memo: dict[str, _Acc] = {}

  def run(self, comp: str, carry: dict | None = None) -> tuple[_Acc, dict]:
    """``(totals, in flight at the end)`` of one pass over ``comp``; ``carry``: collectives
    in flight from the previous iteration (end times relative to this pass's start)."""
    mod, acc = self.mod, _Acc()
    instrs = mod.instrs.get(comp, [])
    t = comm_free = 0.0
    inflight: dict[str, float] = dict(carry or {})
    carried = self._back_edges(instrs)
    for ins in instrs:
      ck = _collective_kind(ins)
      fused = None
      if ins.opcode in ("async-start", "async-done"):
        wrapped = self._wrapped_collective(ins, instrs)
        if wrapped is not None:  # XLA:GPU's generic async wrapper around a collective
          fused, ck = wrapped
      if ck is None and ins.opcode == "fusion":
        callee = (mem._CALLEE.findall(ins.attrs) or [""])[0]
        fused = _fused_collective(mod, callee)
        if fused is not None:  # XLA:TPU's collective fusions
          if ins.name.startswith("async-collective-start"):
            ck = (fused[0], "start")
          elif ins.name.startswith("async-collective-done"):
            ck = (fused[0], "done")
          elif not callee.startswith("async_collective_fusion"):
            ck = (fused[0], "sync")
      if ck is not None:
        kind, phase = ck
        key = self._key(ins, fused, carried)
        if phase == "done":
          end = inflight.pop(key, None)
          if end is not None and end > t:
            acc.exposed += end - t
            t = end
          continue
        if fused is not None:
          full, line = fused[1], fused[2]
        else:
          full, line = float(mem._op_bytes(ins.line)), ins.line
        size, bw, link = _link(line, self.rates, self.host_of, self.n)
        dur = _collective_seconds(kind, full, size, bw) / self.eff.get(link, 1.0)
        acc.comm += dur
        acc.by_link[link] = acc.by_link.get(link, 0.0) + dur
        begin = max(t, comm_free)
        comm_free = begin + dur
        if phase == "sync":
          acc.exposed += comm_free - t
          t = comm_free
        else:
          inflight[key] = comm_free
        continue
      if ins.opcode == "while":
        sub = self._while(ins, comp)
      elif ins.opcode in ("call", "async-start"):
        sub = _Acc()
        for c in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", ins.attrs):
          sub.add(self.memo(c))
      elif ins.opcode == "conditional":
        branches = [self.memo(c) for c in re.findall(
            r"(?:branch_computations=\{|true_computation=|false_computation=|, )%([\w.\-]+)",
            ins.attrs) if c in mod.instrs]
        sub = max(branches, key=lambda a: a.total) if branches else _Acc()
      else:
        cost = _op_cost(mod, ins, comp, self.rates, self.eff)
        if cost is None:
          continue
        sub = _Acc(total=cost.seconds, compute=cost.seconds, flops=cost.flops,
                   bytes=cost.bytes, by_kind={cost.kind: cost.seconds})
      # A nested computation's own waits are its exposed time; the rest is compute here.
      t += sub.total
      acc.add(sub)
    end = dict(inflight)
    acc.total = t
    return acc, {k: v - t for k, v in end.items()}

  def _wrapped_collective(self, ins: _Instr, instrs: list[_Instr]):
    """``((kind, bytes, line), (kind, phase))`` of an ``async-start``/``-done`` around a
    collective, or None."""
    start = ins
    if ins.opcode == "async-done":
      start = next((i for i in instrs if ins.operands and i.name == ins.operands[0]), None)
      if start is None:
        return None
    for c in re.findall(r"calls=%?([\w.\-]+)", start.attrs):
      for w in self.mod.instrs.get(c, []):
        ck = _collective_kind(w)
        if ck is not None:
          info = (ck[0], float(mem._op_bytes(w.line)), w.line)
          return info, (ck[0], "start" if ins.opcode == "async-start" else "done")
    return None

  def memo(self, comp: str) -> _Acc:
    if comp not in self._memo:
      self._memo[comp] = _Acc()  # guards against recursion
      self._memo[comp] = self.run(comp)[0]
    return self._memo[comp]

  def _while(self, ins: _Instr, comp: str) -> _Acc:
    body = re.search(r"body=%?([\w.\-]+)", ins.attrs)
    trip_m = mem._TRIP.search(ins.line)
    trip = int(trip_m.group(1)) if trip_m else mem._trip_from_condition(
        ins.line, self.mod.comps, self.mod.comps.get(comp, []))
    out = _Acc()
    if body is None:
      return out
    if trip is None:
      trip, out.unknown_trips = 1, 1
    if trip <= 0:
      return out
    first, left = self.run(body.group(1))
    out.add(first)
    if trip > 1:
      steady = self.run(body.group(1), left)[0] if left else first
      out.add(steady, trip - 1)
    return out

  def _back_edges(self, instrs: list[_Instr]) -> dict[str, str]:
    """``{get-tuple-element of the loop parameter: the start it carries}``: a done at the top
    of a loop body waits for the start the previous iteration put in the loop state."""
    root = next((i for i in instrs if i.line.lstrip().startswith("ROOT")), None)
    param = next((i.name for i in instrs if i.opcode == "parameter"), None)
    if root is None or root.opcode != "tuple" or param is None:
      return {}
    out = {}
    for i in instrs:
      if i.opcode == "get-tuple-element" and i.operands == [param]:
        idx = re.search(r"index=(\d+)", i.attrs)
        if idx and int(idx.group(1)) < len(root.operands):
          out[i.name] = root.operands[int(idx.group(1))]
    return out

  def _key(self, ins: _Instr, fused, carried: dict[str, str]) -> str:
    """What pairs a start with its done: the start's name (XLA:GPU) or channel (XLA:TPU)."""
    if ins.opcode in ("async-start", "async-done"):
      return ins.operands[0] if ins.opcode == "async-done" and ins.operands else ins.name
    if fused is not None:
      ch = mem._CHANNEL.search(fused[2])
      return "ch" + ch.group(1) if ch else ins.name
    if ins.opcode.endswith("-done") and ins.operands:
      op = ins.operands[0]
      return carried.get(op, op)
    return ins.name


# -- the prediction -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepTime:
  """A step's predicted time on its target, per device; seconds unless named otherwise.

  Attributes:
    device: the device's name (`DeviceRates.name`).
    num_devices: devices the step spans.
    seconds: the step: compute plus exposed communication.
    compute_seconds: the compute stream's busy time.
    exposed_comm_seconds: time compute waits on collectives.
    comm_seconds: all collectives' time, hidden or not.
    flops: matmul FLOPs each device executes (rematerialisation included).
    hbm_bytes: HBM bytes each device reads and writes.
    peak_flops: bf16 peak per device.
    by_kind: compute seconds by ``'matmul'``, ``'attention'`` (compute-bound), ``'memory'``.
    by_link: communication seconds by ``'link'`` (NVLink / ICI), ``'network'``.
    tokens: tokens per step, all devices, or None.
    model_flops: model FLOPs per step, all devices (`model_flops`), or None.
    unknown_trips: loops whose trip count was not known, each counted once.
  """

  device: str
  num_devices: int
  seconds: float
  compute_seconds: float
  exposed_comm_seconds: float
  comm_seconds: float
  flops: float
  hbm_bytes: float
  peak_flops: float
  by_kind: dict
  by_link: dict
  tokens: int | None = None
  model_flops: float | None = None
  unknown_trips: int = 0

  @property
  def tokens_per_second(self) -> float | None:
    """Tokens per second over all devices, or None without ``tokens``."""
    return self.tokens / self.seconds if self.tokens and self.seconds else None

  @property
  def tokens_per_second_per_device(self) -> float | None:
    """`tokens_per_second` per device, or None."""
    t = self.tokens_per_second
    return t / self.num_devices if t is not None else None

  @property
  def model_flops_per_second_per_device(self) -> float | None:
    """Model FLOPs per second per device, or None without ``model_flops``."""
    if not self.model_flops or not self.seconds:
      return None
    return self.model_flops / self.num_devices / self.seconds

  @property
  def mfu(self) -> float | None:
    """Model FLOPs per second per device over the device's bf16 peak, or None."""
    f = self.model_flops_per_second_per_device
    return f / self.peak_flops if f is not None and self.peak_flops else None

  def lines(self) -> list[str]:
    """What `zerojax compile` prints.

    Returns:
      The prediction as lines of text: the step, tokens/s and MFU where known, compute,
      communication and loops of unknown trip count.
    """
    k = self.by_kind
    head = (f"predicted step {self.seconds * 1e3:,.1f} ms on {self.device} at published peaks "
            "(a lower bound: kernels below peak and launch gaps come on top)")
    rate = ""
    if self.tokens_per_second:
      rate = (f"{self.tokens_per_second:,.0f} tokens/s ({self.tokens_per_second_per_device:,.0f}"
              " per device)")
    if self.mfu is not None:
      rate += (f", MFU {self.mfu:.0%} ({self.model_flops_per_second_per_device / 1e12:,.0f} "
               "model TFLOP/s per device)")
    out = [head]
    if rate:
      out.append(rate.lstrip(", "))
    out.append(f"compute {self.compute_seconds * 1e3:,.1f} ms (matmul "
               f"{k.get('matmul', 0) * 1e3:,.1f}, attention {k.get('attention', 0) * 1e3:,.1f}, "
               f"memory-bound {k.get('memory', 0) * 1e3:,.1f}); {self.flops / 1e12:,.1f} TFLOP "
               "per device")
    links = ", ".join(f"{'NVLink/ICI' if n == 'link' else n} {v * 1e3:,.1f}"
                      for n, v in sorted(self.by_link.items()) if v) or "none"
    out.append(f"communication {self.comm_seconds * 1e3:,.1f} ms ({links}); exposed "
               f"{self.exposed_comm_seconds * 1e3:,.1f} ms (not hidden behind compute)")
    if self.unknown_trips:
      out.append(f"{self.unknown_trips} loop(s) of unknown trip count counted once")
    return out


def predict_step_time(hlo_text: str, rates: DeviceRates | str, *, num_devices: int | None = None,
                      host_of: Sequence[int] | None = None, tokens: int | None = None,
                      model_flops: float | None = None, efficiency: dict | None = None
                      ) -> StepTime:
  """Predicts a compiled step's time from its scheduled HLO (see the module docstring).

  Args:
    hlo_text: ``compiled.as_text()`` of the step (after optimisation, scheduled).
    rates: the device's `DeviceRates`, or a topology name for `device_rates`.
    num_devices: devices the program spans (default: the module's ``num_partitions``).
    host_of: the host of each partition id (the mesh's devices in order); default: host-major,
      ``rates.per_host`` devices per host.
    tokens: tokens per step over all devices, for tokens/s.
    model_flops: the model's FLOPs per step over all devices (`model_flops`), for MFU.
    efficiency: the share of each peak that is reached, by ``'matmul'``, ``'attention'``,
      ``'memory'`` (HBM), ``'link'`` and ``'network'`` (default 1: the published peaks). Give
      only measured shares with their source, e.g. `MEASURED_MATMUL`.

  Returns:
    The `StepTime`.

  Raises:
    ValueError: ``hlo_text`` has no ENTRY computation, or ``rates`` names an unknown topology.
  """
  if isinstance(rates, str):
    rates = device_rates(rates)
  if num_devices is None:
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    num_devices = int(m.group(1)) if m else 1
  mod = _Module(hlo_text)
  if mod.entry is None:
    raise ValueError("hlo_text has no ENTRY computation: pass compiled.as_text()")
  acc = _Schedule(mod, rates, host_of, num_devices, efficiency).memo(mod.entry)
  return StepTime(rates.name, num_devices, acc.total, acc.compute, acc.exposed, acc.comm,
                  acc.flops, acc.bytes, rates.peak, dict(acc.by_kind), dict(acc.by_link),
                  tokens, model_flops, acc.unknown_trips)


def model_flops(num_params: int, tokens: int, *, layers: int = 0, heads: int = 0,
                head_dim: int = 0, seq_len: int = 0) -> float:
  """A step's model FLOPs, PaLM's count (Chowdhery et al. 2022, appendix B), which
  torchtitan also uses: ``6 * N`` per token for the weights (forward and backward) plus
  ``12 * layers * heads * head_dim * seq_len`` per token for attention's two matmuls, the
  causal mask not discounted. Rematerialisation is not model FLOPs.

  Args:
    num_params: parameters N whose matmuls each token meets (leave out an input embedding
      table, which a lookup reads without multiplying, to match torchtitan).
    tokens: tokens per step.
    layers, heads, head_dim, seq_len: the attention shape (0: attention not counted).

  Returns:
    FLOPs per step.
  """
  return float(tokens) * (6.0 * num_params + 12.0 * layers * heads * head_dim * seq_len)


def attention_shape(model: Any) -> dict[str, int] | None:
  """Attention's shape, read from a Flax module's config.

  Args:
    model: a module with a ``cfg`` or ``config`` in zerojax's GPT, Hugging Face or the
      benchmarks' field names.

  Returns:
    ``{'layers', 'heads', 'head_dim'}``, or None where the config does not give all three.
  """
  cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
  if cfg is None:
    return None
  pick = lambda *names: next((int(getattr(cfg, n)) for n in names
                              if isinstance(getattr(cfg, n, None), int)), 0)
  layers = pick("num_layers", "num_hidden_layers", "layers", "n_layer")
  heads = pick("num_heads", "num_attention_heads", "heads", "n_head")
  head_dim = pick("head_dim")
  if not head_dim and heads:
    head_dim = pick("d_model", "hidden_size", "n_embd") // heads
  return (dict(layers=layers, heads=heads, head_dim=head_dim)
          if layers and heads and head_dim else None)


def predict_compiled(hlo_text: str, topology: str, devices: Sequence[Any], model: Any,
                     params: Any, batch: Any, plan: Any, flops: float | None = None
                     ) -> tuple[StepTime, StepTime | None]:
  """The predicted step of a step compiled by `zerojax.runtime.memory.compile_for_topology`
  (its ``predictor``): at published peaks, and at the measured matmul ceiling where one is
  known (`MEASURED_MATMUL`).

  Args:
    hlo_text: the compiled step's ``as_text()``.
    topology: the topology it was compiled for.
    devices: its devices.
    model: the module (its config gives attention's shape, `attention_shape`).
    params: its parameters (for the model FLOPs, `model_flops`).
    batch: its abstract batch (``'x'`` of ``(rows, seq)`` tokens gives tokens per step).
    plan: its `zerojax.ShardingPlan` (each partition's host).
    flops: the model's FLOPs per step over all devices, or None for `model_flops`'s.

  Returns:
    ``(at peaks, at the matmul ceiling or None)``.
  """
  x = batch.get("x") if isinstance(batch, dict) else None
  tokens = math.prod(x.shape) if x is not None and len(x.shape) == 2 else None
  if flops is None and tokens is not None:
    shape = attention_shape(model) or {}
    flops = model_flops(mem.num_params(params), tokens,
                        seq_len=x.shape[1] if shape else 0, **shape)
  host_of = ([d.process_index for d in plan.mesh.devices.flat]
             if gpu.is_gpu_topology(topology) else None)
  rates = device_rates(topology)
  kw = dict(num_devices=len(devices), tokens=tokens, model_flops=flops, host_of=host_of)
  at_peak = predict_step_time(hlo_text, rates, **kw)
  ceiling = MEASURED_MATMUL.get(rates.name)
  at_ceiling = None if ceiling is None else predict_step_time(
      hlo_text, rates, efficiency={"matmul": ceiling, "attention": ceiling}, **kw)
  return at_peak, at_ceiling
