"""The real-GPU check: one script, one command, one GPU (issue 50).

Measures, on one H100 or H200, what zerojax's ahead-of-time figures promise, on a Llama-shaped
decoder of about 1B parameters written here in Flax linen as a user writes it (16 scanned,
rematerialised layers, d_model 2048, 16 query / 4 KV heads, SwiGLU 5632, vocab 32000; bf16
compute, fp32 master weights, AdamW):

  speed    zerojax's stage 3 over the one-device mesh against a hand-written ``jax.jit`` step:
           step time, tokens/s, MFU
  memory   stages 0-3, each in its own process: the real compile's ``memory_analysis()`` and
           ``memory_stats()['peak_bytes_in_use']`` after a few steps
  predict  the same stages compiled ahead of time for a one-GPU topology of the same GPU
           (``compile_for_topology(..., 'h100:1')``, what ``zerojax compile`` prints), on the
           host CPU beside the GPU parts; and the verdict's edge: the largest micro-batch it
           says fits and the next
  offload  ``offload_optimizer=True``, then with ``offload_params=True``: HBM peak against the
           in-HBM stage 3, memory kinds, losses, step time, host<->device bandwidth
  nvme     ZeRO-Infinity (``offload_optimizer='nvme'``, bf16 parameters, master weights on
           disk): peak RSS against parameters + gradient shards + buffer pool + 10%, and the
           host update's read/write throughput against ``dd`` on the same disk
  edge     the verdict's largest fitting micro-batch runs; the next one fails to allocate, or
           is named a margin case

Every part runs in its own subprocess with a timeout; a part that fails or runs out of memory
is recorded and the next runs. Writes ``results.json`` and ``results.md`` to ``--out``.

  PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out DIR         # on the GPU machine
  python3 benchmarks/gpu_check.py --dry-run --out DIR                  # tiny shapes on CPU

The orchestrating process never imports JAX, so it holds no GPU memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB, MiB = 2**30, 2**20

# Dense bf16 peak per GPU (NVIDIA's data sheets, without sparsity). Matched against the device
# kind JAX reports; a GPU not listed gets no MFU rather than a guessed peak.
PEAK_BF16 = (("H200", "H200 (SXM) dense bf16", 989e12),
             ("H100 80GB HBM3", "H100 SXM dense bf16", 989e12))
# zerojax's one-GPU topology names, by the device kind JAX reports.
TOPOLOGY = (("H200", "h200:1"), ("H100 80GB HBM3", "h100:1"))


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The model and the batch. ``batch`` is the micro-batch of the one device, in rows."""

  layers: int = 16
  d_model: int = 2048
  heads: int = 16
  kv_heads: int = 4
  ffn: int = 5632
  vocab: int = 32000
  seq: int = 2048
  batch: int = 8
  steps: int = 4  # per measured run; the first two are untimed (compile, retrace)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads


# On CPU: the same code at shapes that compile in seconds.
DRY = Shapes(layers=2, d_model=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32, batch=4,
             steps=3)
# Stage 0's peak in rows of 2048 tokens, as zerojax predicts it for h100:1 (compile_for_topology,
# jax 0.10.2, 2026-11-27: 17.34 GB at 4 rows, 21.37 GB at 8): the batch is the number of rows
# that makes it half the GPU's memory. The report gives the fill each part measured.
STAGE0_FIXED, STAGE0_PER_ROW = 13.32e9, 1.006e9


# ------------------------------------------------------------------------------------------
# The model, as a user writes it (nothing from zerojax in it)
# ------------------------------------------------------------------------------------------

def build_model(s: Shapes):
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  bf16, f32 = jnp.bfloat16, jnp.float32

  def rope(x):  # x: [batch, seq, heads, head_dim]
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=f32) / half))
    ang = jnp.arange(x.shape[1], dtype=f32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :half].astype(f32), x[..., half:].astype(f32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      dense = lambda f, name, **kw: nn.DenseGeneral(f, use_bias=False, dtype=bf16,
                                                    param_dtype=f32, name=name, **kw)
      h = nn.RMSNorm(dtype=bf16, param_dtype=f32, name="attn_norm")(x)
      q = rope(dense((s.heads, s.head_dim), "q")(h))
      k = rope(dense((s.kv_heads, s.head_dim), "k")(h))
      v = dense((s.kv_heads, s.head_dim), "v")(h)
      a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
      x = x + dense(s.d_model, "o", axis=(-2, -1))(a)
      h = nn.RMSNorm(dtype=bf16, param_dtype=f32, name="mlp_norm")(x)
      x = x + dense(s.d_model, "down")(nn.silu(dense(s.ffn, "gate")(h)) * dense(s.ffn, "up")(h))
      return x, None

  class Llama(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(s.vocab, s.d_model, dtype=bf16, param_dtype=f32, name="embed")(tokens)
      layers = nn.scan(nn.remat(Block, prevent_cse=False), variable_axes={"params": 0},
                       split_rngs={"params": True}, length=s.layers)
      x, _ = layers(name="layers")(x, None)
      x = nn.RMSNorm(dtype=bf16, param_dtype=f32, name="final_norm")(x)
      return nn.Dense(s.vocab, use_bias=False, dtype=bf16, param_dtype=f32, name="head")(x)

  return Llama()


def train_step(state, batch):
  """The user's step: plain ``jax.value_and_grad``, the same for zerojax and hand-written."""
  import jax
  import jax.numpy as jnp
  import optax

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["y"]).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def make_tx():
  import optax
  return optax.adamw(1e-4, weight_decay=0.1)


def param_count(s: Shapes) -> int:
  attn = s.d_model * s.head_dim * (2 * s.heads + 2 * s.kv_heads)
  layer = attn + 3 * s.d_model * s.ffn + 2 * s.d_model
  return s.layers * layer + 2 * s.vocab * s.d_model + s.d_model


def step_flops(s: Shapes, rows: int) -> float:
  """Training FLOPs of one step: 6·N·tokens plus attention, 12·layers·seq·d_model per token
  (PaLM's count: QK^T and AV forward and backward, the causal half not subtracted)."""
  tokens = rows * s.seq
  return 6 * param_count(s) * tokens + 12 * s.layers * s.seq * s.d_model * tokens


# ------------------------------------------------------------------------------------------
# Child parts (each in its own process)
# ------------------------------------------------------------------------------------------

def _jax():
  import jax
  return jax


def _device_info() -> dict:
  jax = _jax()
  d = jax.devices()[0]
  return {"platform": d.platform, "device_kind": d.device_kind, "jax": jax.__version__,
          "devices": jax.device_count()}


def _check_platform(spec: dict) -> None:
  jax = _jax()
  if not spec["dry_run"] and jax.devices()[0].platform != "gpu":
    raise RuntimeError(f"expected a GPU, JAX's default device is {jax.devices()[0]}: "
                       "is the CUDA plugin installed?")


def _batches(s: Shapes, rows: int, n: int) -> list:
  import jax
  import numpy as np
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):
    t = rng.integers(0, s.vocab, (rows, s.seq + 1), dtype=np.int32)
    out.append(jax.device_put({"x": t[:, :-1], "y": t[:, 1:]}, jax.devices()[0]))
  return out


def _memory_stats() -> dict:
  d = _jax().devices()[0]
  try:
    st = d.memory_stats()
  except Exception as e:  # noqa: BLE001 - backends without stats raise
    return {"peak_bytes_in_use": None, "why": f"memory_stats() raised: {e}"}
  if not st:
    return {"peak_bytes_in_use": None,
            "why": f"memory_stats() is {st!r} on {d.platform}: no allocator statistics"}
  keys = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit", "bytes_reserved",
          "largest_alloc_size")
  return {k: int(st[k]) for k in keys if k in st}


def _analysis(compiled) -> dict:
  ma = compiled.memory_analysis()
  f = lambda n: int(getattr(ma, n, 0) or 0)
  out = {"argument": f("argument_size_in_bytes"), "output": f("output_size_in_bytes"),
         "alias": f("alias_size_in_bytes"), "temp": f("temp_size_in_bytes"),
         "host_argument": f("host_argument_size_in_bytes"),
         "host_output": f("host_output_size_in_bytes"), "host_temp": f("host_temp_size_in_bytes")}
  # zerojax's peak: what `zerojax compile` prints as HBM peak (arguments + temp + outputs not
  # aliased), so measured and predicted are the same sum of the same fields.
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def _kinds(tree) -> dict:
  """Bytes per memory kind of a pytree's arrays."""
  jax = _jax()
  out: dict = {}
  for x in jax.tree.leaves(tree):
    if hasattr(x, "sharding"):
      k = str(x.sharding.memory_kind)
      out[k] = out.get(k, 0) + int(x.nbytes)
  return out


def _timed_steps(step, state, batches, sync):
  """Runs every batch; the first call compiles, the second is untimed too (a step whose
  output types differ from its input's traces again there). Returns the state, the losses,
  the first call's seconds and the steady step time (wall time of the rest over their count,
  one sync at the end, so dispatch overlaps the device as in a training loop)."""
  jax = _jax()
  losses = []
  t0 = time.perf_counter()
  state, m = step(state, batches[0])
  sync(state)
  losses.append(m["loss"])
  first = time.perf_counter() - t0
  state, m = step(state, batches[1])
  sync(state)
  losses.append(m["loss"])
  t0 = time.perf_counter()
  for b in batches[2:]:
    state, m = step(state, b)
    losses.append(m["loss"])
  sync(state)
  dt = (time.perf_counter() - t0) / max(1, len(batches) - 2)
  return state, [float(x) for x in jax.device_get(losses)], first, dt


def _sync(state):
  _jax().block_until_ready(state)


def _zero_config(spec: dict, **kw):
  import zerojax
  return zerojax.ZeroConfig.from_flat(dict(compute_dtype="bfloat16", **kw))


def _speed_numbers(s: Shapes, rows: int, step_s: float, peak: float | None) -> dict:
  flops = step_flops(s, rows)
  out = {"step_s": step_s, "tokens_per_s": rows * s.seq / step_s,
         "tflops_per_s": flops / step_s / 1e12}
  out["mfu"] = None if peak is None else flops / step_s / peak
  return out


def part_speed(spec: dict) -> dict:
  """(a) zerojax's default stage 3 against a hand-written jit step, one device."""
  import jax
  from flax.training import train_state

  _check_platform(spec)
  s = Shapes(**spec["shapes"])
  model, tx = build_model(s), make_tx()
  n = s.steps + 4  # a few more timed steps than the memory runs: the ratio is the figure
  out = {"device": _device_info(), "rows": s.batch, "seq": s.seq, "steps": n,
         "params": param_count(s), "flops_per_step": step_flops(s, s.batch)}
  peak = spec.get("peak_flops")
  out["peak_flops"], out["peak_name"] = peak, spec.get("peak_name")

  # zerojax first and alone in the process: its allocator peak is stage 3's for part b.
  z = run_config(spec, s.batch, n, stage=3)
  out["zerojax"] = {**z, **_speed_numbers(s, s.batch, z["step_s"], peak)}

  x = jax.ShapeDtypeStruct((s.batch, s.seq), "int32")
  params = jax.jit(model.init)(jax.random.key(0), jax.numpy.zeros(x.shape, x.dtype))["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  state = state.replace(step=jax.numpy.zeros((), "int32"))  # as the step returns it: one trace
  del params
  batches = _batches(s, s.batch, n)
  jstep = jax.jit(train_step, donate_argnums=0)
  state, losses, first, dt = _timed_steps(jstep, state, batches, _sync)
  out["hand_written"] = {"losses": losses, "first_call_s": first,
                         **_speed_numbers(s, s.batch, dt, peak)}
  z, h = out["zerojax"], out["hand_written"]
  out["step_time_ratio"] = z["step_s"] / h["step_s"]
  out["max_loss_diff"] = max(abs(a - b) for a, b in zip(z["losses"], h["losses"]))
  out["losses_equal"] = z["losses"] == h["losses"]
  return out


def run_config(spec: dict, rows: int, steps: int, bypass_check: bool = False,
               out: dict | None = None, **cfg) -> dict:
  """One zerojax configuration in this process: the real compile's memory analysis, the
  allocator's peak after ``steps`` steps, losses, step time and where the state lives.
  Fills ``out`` as it goes, so a step that fails leaves what came before it."""
  import jax

  import zerojax
  from zerojax.core import budget
  _check_platform(spec)
  s = Shapes(**spec["shapes"])
  model, tx = build_model(s), make_tx()
  batches = _batches(s, rows, steps)
  config = _zero_config(spec, **cfg)
  out = {} if out is None else out
  out.update(device=_device_info(), rows=rows, config=cfg)
  out["memory_stats_before_state"] = _memory_stats()
  state, plan = zerojax.create_train_state(model, tx, jax.random.key(0), batches[0]["x"],
                                           config=config)
  out["state_kinds"] = {"params": _kinds(state.params), "opt_state": _kinds(state.opt_state)}
  out["memory_stats_after_state"] = _memory_stats()
  step = zerojax.zero_step(plan)(train_step)
  t0 = time.perf_counter()
  compiled = step.jitted(state, batches[0]).lower(state, batches[0]).compile()
  out["compile_s"] = time.perf_counter() - t0
  # Before any step: what compiling (autotuning's scratch buffers) left in the peak.
  out["memory_stats_after_compile"] = _memory_stats()
  out["memory_analysis"] = _analysis(compiled)
  try:  # zerojax's own check before a step allocates (against memory_stats' bytes_limit)
    peak = budget.check_fits(compiled, jax.devices()[:1])
    out["zerojax_check"] = "no limit reported" if peak is None else f"fits: peak {peak}"
  except budget.DeviceMemoryError as e:
    out["zerojax_check"] = f"refused: {str(e)[:400]}"
  out["formulation"] = next(iter(step.formulation.values()), None)
  if bypass_check:  # the jitted function itself: no zerojax memory check before it allocates
    raw = step.jitted(state, batches[0])
    step = lambda st, b: raw(st, b)  # noqa: E731
  state, losses, first, dt = _timed_steps(step, state, batches, _sync)
  out.update(losses=losses, first_call_s=first, step_s=dt)
  out["memory_stats"] = _memory_stats()
  out["state_kinds_after"] = {"params": _kinds(state.params),
                              "opt_state": _kinds(state.opt_state)}
  return out


def part_memory(spec: dict) -> dict:
  s = Shapes(**spec["shapes"])
  return run_config(spec, s.batch, s.steps, stage=spec["stage"])


def _link_bandwidth(nbytes: int) -> dict:
  """Host (pinned_host) -> device and device -> host copy rate of one array, GB/s."""
  import jax
  import numpy as np
  from jax.sharding import SingleDeviceSharding
  d = jax.devices()[0]
  host, dev = (SingleDeviceSharding(d, memory_kind="pinned_host"),
               SingleDeviceSharding(d, memory_kind="device"))
  x = jax.device_put(np.ones(nbytes // 4, np.float32), host)
  x.block_until_ready()
  out = {"bytes": nbytes}
  for name, src, dst in (("h2d", x, dev), ("d2h", None, host)):
    src = src if src is not None else jax.device_put(x, dev).block_until_ready()
    jax.device_put(src, dst).block_until_ready()  # warm
    t0 = time.perf_counter()
    for _ in range(3):
      jax.device_put(src, dst).block_until_ready()
    out[f"{name}_gb_s"] = 3 * nbytes / (time.perf_counter() - t0) / 1e9
  return out


def part_offload(spec: dict) -> dict:
  s = Shapes(**spec["shapes"])
  cfg = {"stage": 3, "offload_optimizer": True}
  if spec["params"]:
    cfg["offload_params"] = True
  out = run_config(spec, s.batch, s.steps, **cfg)
  out["link"] = _link_bandwidth(spec["link_bytes"])
  return out


class RssSampler:
  """This process's resident set, sampled every 5 ms in a thread; peaks over time windows."""

  def __init__(self):
    self.samples: list[tuple[float, int]] = [(time.perf_counter(), self.now())]
    self._stop = threading.Event()
    self._t = threading.Thread(target=self._run, daemon=True)
    self._t.start()

  @staticmethod
  def now() -> int:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

  def _run(self) -> None:
    while not self._stop.is_set():
      self.samples.append((time.perf_counter(), self.now()))
      time.sleep(0.005)

  def stop(self) -> None:
    self._stop.set()
    self._t.join()
    self.samples.append((time.perf_counter(), self.now()))

  def peak(self, t0: float = 0.0, t1: float = float("inf")) -> int:
    return max((r for t, r in self.samples if t0 <= t <= t1), default=0)


def dd_throughput(directory: str, mib: int) -> dict:
  """Sequential write and read MB/s of ``directory``'s disk by dd, O_DIRECT (no page cache)."""
  path = os.path.join(directory, "gpu-check-dd.bin")
  out = {"mib": mib}
  try:
    for name, cmd in (
        ("write", ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct",
                   "conv=fdatasync"]),
        ("read", ["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])):
      p = subprocess.run(cmd, capture_output=True, text=True)
      m = re.search(r"(\d+) bytes .* copied, ([\d.e-]+) s", p.stderr)
      if p.returncode or not m:
        out[f"{name}_mb_s"] = None
        out[f"{name}_error"] = (p.stderr.strip().splitlines() or ["no output"])[-1]
        continue
      out[f"{name}_mb_s"] = int(m.group(1)) / MiB / float(m.group(2))
  finally:
    if os.path.exists(path):
      os.unlink(path)
  return out


def part_nvme(spec: dict) -> dict:
  """(d) ZeRO-Infinity: 2 + 2 bytes per parameter on the device, 12 on disk."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import zerojax
  _check_platform(spec)
  s = Shapes(**spec["shapes"])
  path = spec["nvme_dir"]
  os.makedirs(path, exist_ok=True)
  out: dict = {"device": _device_info(), "nvme_dir": path,
               "dd": dd_throughput(path, spec["dd_mib"])}
  jnp.zeros(8).block_until_ready()  # the runtime and its backends start here
  sampler = RssSampler()
  out["rss_baseline"] = RssSampler.now()
  model = build_model(s)
  batches = _batches(s, s.batch, 3)  # each step streams the whole state: two timed
  config = _zero_config(spec, stage=3, param_dtype="bfloat16", offload_optimizer="nvme",
                        nvme_path=path, nvme_chunk_size=spec["chunk"], nvme_buffer_count=4)
  state, plan = zerojax.create_train_state(
      model, zerojax.master_weights(make_tx()), jax.random.key(0), batches[0]["x"],
      config=config, overwrite=True)
  out["rss_after_state"] = RssSampler.now()
  opt, step = plan.nvme, zerojax.zero_step(plan)(train_step)
  # The first step compiles the device step and the host update: the compilers' own memory
  # is in the whole run's peak, not in the steady steps' after it.
  times, losses, t_steady = [], [], 0.0
  for b in batches:  # the host update is synchronous: each step is timed on its own
    t0 = time.perf_counter()
    state, m = step(state, b)
    _sync(state)
    losses.append(float(m["loss"]))
    times.append(time.perf_counter() - t0)
    t_steady = t_steady or time.perf_counter()
  first, dt = times[0], sum(times[1:]) / len(times[1:])
  sampler.stop()
  out["rss_peak"] = sampler.peak()
  out["rss_peak_steady"] = sampler.peak(t_steady)
  out["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  st = opt.stats
  out.update(losses=losses, first_call_s=first, step_s=dt)
  out["host_update"] = {"read_mb_s": st.read_mb_s, "write_mb_s": st.write_mb_s,
                        "read_s": st.read_s, "write_s": st.write_s + st.sync_s,
                        "update_s": st.update_s, "wait_s": st.wait_s, "wall_s": st.wall_s,
                        "bytes_read": st.bytes_read, "bytes_written": st.bytes_written}
  params = int(sum(np.size(p) for p in jax.tree.leaves(state.params)))
  param_bytes = int(sum(p.nbytes for p in jax.tree.leaves(state.params)))
  grad_bytes = int(sum(g.nbytes for g in jax.tree.leaves(state.opt_state["grads"])))
  pool = 4 * min(spec["chunk"], opt.size) * opt.state_bytes // max(1, opt.size)
  bound = int(1.1 * (param_bytes + grad_bytes + pool))
  above = out["rss_peak_steady"] - out["rss_baseline"]
  out["bound"] = {"params": params, "param_bytes": param_bytes, "grad_shard_bytes": grad_bytes,
                  "buffer_pool_bytes": pool, "bound_bytes": bound,
                  "state_on_disk_bytes": int(opt.state_bytes),
                  "disk_over_bound": opt.state_bytes / bound,
                  "rss_peak_above_baseline": above, "holds": above <= bound,
                  "whole_run_above_baseline": out["rss_peak"] - out["rss_baseline"],
                  "param_kinds": _kinds(state.params)}
  du = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
  out["bound"]["files_bytes"] = du
  shutil.rmtree(os.path.join(path, "zerojax-nvme"), ignore_errors=True)
  return out


def part_predict(spec: dict) -> dict:
  """(b) zerojax's ahead-of-time figure for one GPU of this kind, per stage in
  ``spec['stages']``: what ``zerojax compile`` prints. With ``spec['edge']``, also (e) the
  verdict's edge. Runs on the host CPU (compile-only GPU devices)."""
  from zerojax.runtime import gpu
  from zerojax.runtime.memory import compile_for_topology
  s = Shapes(**spec["shapes"])
  model, tx = build_model(s), make_tx()
  tried: dict[tuple[int, int], dict] = {}

  def verdict(stage: int, rows: int, report: bool = False) -> dict:
    if (stage, rows) not in tried:
      r = compile_for_topology(_zero_config(spec, stage=stage), model, (rows, s.seq),
                               spec["topology"], tx=tx, train_step=train_step,
                               memory_fraction=spec.get("memory_fraction"))
      tried[stage, rows] = _verdict(r, rows, report)
    return tried[stage, rows]

  out: dict = {"stages": {str(st): verdict(st, s.batch, True) for st in spec["stages"]}}
  if spec.get("edge"):
    spec_gpu = gpu.parse_gpu_topology(spec["topology"])[0]
    out["edge"] = _edge(spec, s, spec_gpu.memory, lambda rows: verdict(3, rows))
  return out


def _verdict(r, rows: int, report: bool) -> dict:
  m = r.measured
  out = {"rows": rows, "topology": r.topology, "device_kind": r.device_kind,
         "compile_s": r.compile_seconds, "usable_bytes": r.hbm_available,
         "memory_fraction": r.memory_fraction, "fits": r.fits}
  if report:
    out["report"] = r.table()
  if m is not None:
    out.update(peak=m.peak, argument=m.argument, output=m.output, alias=m.alias, temp=m.temp,
               host_argument=r.host_argument)
  else:
    out.update(peak=None, error=r.error)
  return out


def _edge(spec: dict, s: Shapes, gpu_memory: int, verdict) -> dict:
  """The verdict's edge at stage 3: the largest micro-batch it says fits, found from the
  peak's slope in rows and confirmed by compiling it and the next size."""
  seen: dict[int, dict] = {}
  usable = None  # the dry run's own usable memory, once set

  def judged(rows: int) -> dict:
    v = dict(verdict(rows))
    if usable is not None:  # the same rule as TopologyCompile.fits: peak <= usable
      v.update(usable_bytes=usable, memory_fraction=spec["memory_fraction"],
               fits=v["peak"] is not None and v["peak"] <= usable)
    v.pop("report", None)
    seen[rows] = v
    return v

  a = s.batch
  b = a + spec.get("edge_step", a)
  pa, pb = judged(a)["peak"], judged(b)["peak"]
  if pa is None or pb is None:
    return {"why": f"the compiler gave no peak at {a} or {b} rows: "
            f"{seen[a].get('error') or seen[b].get('error')}"}
  per_row = (pb - pa) / (b - a)
  if spec.get("dry_edge_rows") is not None:
    # The dry run's tiny step would fit an H100 at millions of rows: it is judged instead
    # against a usable memory that many rows above its peak at the dry batch, so that the
    # edge runs on CPU in seconds (edge_step - 0.5 rows puts it one row below the second size
    # compiled, when the peak grows with rows).
    usable = int(pa + spec["dry_edge_rows"] * max(per_row, 1.0))
    spec["memory_fraction"] = usable / gpu_memory
  limit = judged(a)["usable_bytes"]
  guess = max(1, int((limit - (pa - per_row * a)) // per_row)) if per_row > 0 else b
  fit, rows, budget = None, guess, spec.get("edge_compiles", 6)
  while budget > 0:  # walk from the guess to the edge
    budget -= (rows not in seen) + (rows + 1 not in seen)
    if judged(rows)["fits"]:
      if not judged(rows + 1)["fits"]:
        fit = rows
        break
      rows += 1
    elif rows == 1:
      break
    else:
      rows -= 1
  out = {"per_row_bytes": per_row, "guess": guess, "usable_bytes": limit,
         "memory_fraction": spec.get("memory_fraction"),
         "tried": [seen[k] for k in sorted(seen)]}
  if fit is not None:
    out.update(largest_fitting=fit, first_refused=fit + 1, refused_peak=seen[fit + 1]["peak"])
  else:
    out["why"] = f"no edge found within {spec.get('edge_compiles', 6)} compiles"
  return out


def part_edge(spec: dict) -> dict:
  """(e) on the device: run the micro-batch the verdict gave. ``bypass`` calls the jitted
  step directly, so an over-size step meets the allocator, not zerojax's own pre-check
  (whose answer is recorded as ``zerojax_check``)."""
  out: dict = {"rows": spec["rows"]}
  try:
    run_config(spec, spec["rows"], 3, bypass_check=spec["bypass"], out=out, stage=3)
    out["ran"] = True
  except Exception as e:  # noqa: BLE001 - an allocation failure is the result, recorded
    msg = f"{type(e).__name__}: {e}"
    out["ran"] = False
    out["error"] = msg[:2000]
    out["oom"] = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
    out["memory_stats"] = _memory_stats()
  return out


PARTS = {"speed": part_speed, "memory": part_memory, "offload": part_offload,
         "nvme": part_nvme, "predict": part_predict, "edge": part_edge}


def child_main(name: str, spec_path: str) -> None:
  with open(spec_path) as f:
    spec = json.load(f)
  sys.path.insert(0, ROOT)
  if spec["dry_run"]:
    import jax
    jax.config.update("jax_num_cpu_devices", spec.get("cpu_devices", 1))
  result = PARTS[name](spec)
  with open(spec["result_path"], "w") as f:
    json.dump(result, f, default=_json_default)


def _json_default(x):
  if hasattr(x, "item"):
    return x.item()
  return str(x)


# ------------------------------------------------------------------------------------------
# The orchestrator (no JAX here)
# ------------------------------------------------------------------------------------------

def _cmd_out(cmd: list[str]) -> str | None:
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    return p.stdout.strip() if p.returncode == 0 else None
  except (OSError, subprocess.SubprocessError):
    return None


def _versions() -> dict:
  from importlib import metadata
  out = {}
  for pkg in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "optax",
              "numpy"):
    try:
      out[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
      pass
  return out


def environment(dry: bool) -> dict:
  env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
         "host": socket.gethostname(), "python": platform.python_version(),
         "machine": f"{platform.system()} {platform.machine()}", "cpus": os.cpu_count(),
         "versions": _versions(), "dry_run": dry,
         "mem_fraction_env": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")}
  try:
    with open("/proc/meminfo") as f:
      env["host_memory_bytes"] = int(f.readline().split()[1]) * 1024
  except OSError:
    pass
  smi = None if dry else _cmd_out(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                   "--format=csv,noheader,nounits"])
  if smi:
    name, driver, mem = [x.strip() for x in smi.splitlines()[0].split(",")]
    env["gpu"] = {"name": name, "driver": driver, "memory_mib": int(float(mem)),
                  "source": "nvidia-smi"}
  elif not dry:
    env["gpu"] = _probe_gpu()
  return env


def _probe_gpu() -> dict:
  """Without nvidia-smi: the device kind from JAX in a child (this process stays off the GPU),
  its memory from the allocator's limit over the client's fraction, the driver from /proc."""
  code = ("import jax, os; d = jax.devices()[0]; st = d.memory_stats() or {}; "
          "print(d.platform, st.get('bytes_limit', 0), d.device_kind, sep='|')")
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  try:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    plat, limit, kind = p.stdout.strip().splitlines()[-1].split("|", 2)
  except (OSError, subprocess.SubprocessError, ValueError, IndexError):
    return {"name": "", "why": "neither nvidia-smi nor JAX named a GPU"}
  driver = None
  try:
    with open("/proc/driver/nvidia/version") as f:
      driver = (re.findall(r"\b(\d+\.\d+(?:\.\d+)?)\b", f.readline()) or [None])[0]
  except OSError:
    pass
  fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
  return {"name": kind if plat == "gpu" else "", "driver": driver,
          "memory_mib": int(int(limit) / fraction / MiB) if int(limit) else None,
          "source": "JAX (no nvidia-smi)"}


def gpu_facts(env: dict, dry: bool) -> dict:
  """The one-GPU topology to predict for and the named peak, from the GPU's name."""
  if dry:
    return {"topology": "h100:1", "peak_flops": None,
            "peak_name": "none: the dry run runs on CPU, which has no named bf16 peak"}
  name = env.get("gpu", {}).get("name", "")
  topo = next((t for key, t in TOPOLOGY if key in name), None)
  peak = next(((n, p) for key, n, p in PEAK_BF16 if key in name), None)
  return {"topology": topo, "peak_flops": peak[1] if peak else None,
          "peak_name": peak[0] if peak else f"none named for {name!r}"}


def choose_batch(env: dict, dry: bool) -> int:
  if dry:
    return DRY.batch
  mem = (env.get("gpu", {}).get("memory_mib") or 81559) * MiB
  return max(1, round((mem / 2 - STAGE0_FIXED) / STAGE0_PER_ROW))


class Runner:
  """Runs parts as subprocesses with timeouts under one overall time budget."""

  def __init__(self, args, out_dir: str, budget_s: float, base_spec: dict):
    self.args, self.out_dir, self.base = args, out_dir, base_spec
    self.deadline = time.monotonic() + budget_s
    self.budget_s = budget_s
    self.work = tempfile.mkdtemp(prefix="gpu-check-")
    self.cache = os.path.join(self.work, "jax-cache")
    self.background: dict[str, tuple] = {}
    self.queue: list = []
    self.killed: set[str] = set()
    self.ended: dict[str, float] = {}
    self.stopping = threading.Event()
    self.pump: threading.Thread | None = None

  def env(self, cpu: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # One compilation cache for the run (or the caller's): a program two parts compile is
    # compiled once.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", self.cache)
    if cpu or self.base["dry_run"]:
      env["JAX_PLATFORMS"] = "cpu"
      # Device counts come from the spec (jax_num_cpu_devices), not a caller's XLA_FLAGS.
      env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                                env.get("XLA_FLAGS", "")).strip()
    else:
      env["JAX_PLATFORMS"] = "cuda,cpu"  # the host update of the NVMe part runs on the CPU
    return env

  def _spec(self, key: str, spec: dict) -> tuple[str, str]:
    spec = {**self.base, **spec, "result_path": os.path.join(self.work, f"{key}.json")}
    path = os.path.join(self.work, f"{key}.spec.json")
    with open(path, "w") as f:
      json.dump(spec, f)
    return path, spec["result_path"]

  def start(self, key: str, part: str, spec: dict, timeout: float, cpu: bool = False):
    spec_path, result_path = self._spec(key, spec)
    log = open(os.path.join(self.work, f"{key}.log"), "w+")
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--part", part,
                          "--spec", spec_path], env=self.env(cpu), stdout=log,
                         stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    return (p, time.monotonic(), timeout, log, result_path)

  def finish(self, key: str, handle) -> dict:
    p, t0, timeout, log, result_path = handle
    left = min(timeout - (time.monotonic() - t0), self.deadline - time.monotonic())
    status = None
    try:
      p.wait(timeout=max(0.0, left))
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)  # the part's own process group
      p.wait()
      status = "timeout"
    if key in self.killed:
      status = "timeout"
    seconds = self.ended.get(key, time.monotonic()) - t0
    log.seek(0)
    text = log.read()
    log.close()
    tail = text[-3000:]
    os.makedirs(os.path.join(self.out_dir, "logs"), exist_ok=True)
    with open(os.path.join(self.out_dir, "logs", f"{key}.log"), "w") as f:
      f.write(text[-200_000:])  # the end of each part's output, for the first run's surprises
    rec: dict = {"seconds": round(seconds, 1)}
    if status == "timeout":
      over = "the run's time budget" if time.monotonic() >= self.deadline - 0.5 else \
          f"its {timeout:.0f} s timeout"
      rec.update(status="timeout", why=f"killed after {seconds:.0f} s: {over}", log_tail=tail)
    elif p.returncode == 0 and os.path.exists(result_path):
      with open(result_path) as f:
        rec.update(status="ok", result=json.load(f))
    else:
      oom = "RESOURCE_EXHAUSTED" in tail or "out of memory" in tail.lower()
      rec.update(status="oom" if oom else "failed", returncode=p.returncode,
                 why=_last_error(tail), log_tail=tail)
    print(f"[gpu_check] {key}: {rec['status']} in {seconds:.1f} s"
          + (f" ({rec['why'][:200]})" if rec.get("why") else ""), flush=True)
    return rec

  def run(self, key: str, part: str, spec: dict, timeout: float, cpu: bool = False) -> dict:
    left = self.deadline - time.monotonic()
    if left < 5:
      rec = {"status": "skipped",
             "why": f"the run's time budget of {self.budget_s:.0f} s was spent"}
      print(f"[gpu_check] {key}: skipped (time budget spent)", flush=True)
      return rec
    print(f"[gpu_check] {key}: running (timeout {min(timeout, left):.0f} s)", flush=True)
    return self.finish(key, self.start(key, part, spec, timeout, cpu))

  def cleanup(self) -> None:
    shutil.rmtree(self.work, ignore_errors=True)


def _last_error(tail: str) -> str:
  lines = [l for l in tail.strip().splitlines() if l.strip()]
  for l in reversed(lines):
    if re.match(r"^[\w.]*(Error|Exception|Exit)\b|^[\w.]+Error:|^F\d{4} |Check failed", l):
      return l.strip()[:500]
  return (lines[-1].strip() if lines else "no output")[:500]


def main_run(args) -> dict:
  dry = args.dry_run
  env = environment(dry)
  facts = gpu_facts(env, dry)
  shapes = DRY if dry else dataclasses.replace(Shapes(), batch=choose_batch(env, dry))
  if args.batch:
    shapes = dataclasses.replace(shapes, batch=args.batch)
  if args.layers:
    shapes = dataclasses.replace(shapes, layers=args.layers)
  budget = args.budget or (300 if dry else 345)
  out_dir = os.path.abspath(args.out)
  os.makedirs(out_dir, exist_ok=True)
  nvme_dir = args.nvme_dir or os.path.join(ROOT, ".gpu-check-nvme")
  base = {"dry_run": dry, "shapes": dataclasses.asdict(shapes), **facts}
  r = Runner(args, out_dir, budget, base)
  want = set(args.parts.split(",")) if args.parts else set(ALL_PARTS)
  unknown = want - set(ALL_PARTS)
  if unknown:
    raise SystemExit(f"--parts: unknown {sorted(unknown)}; parts are {', '.join(ALL_PARTS)}")
  res: dict = {"environment": env, "gpu": facts, "shapes": dataclasses.asdict(shapes),
               "params": param_count(shapes), "budget_s": budget, "complete": False}
  res["parts"] = _SavedParts(os.path.join(out_dir, "results.json"), res)
  parts = res["parts"]
  t_start = time.monotonic()
  try:
    # Ahead-of-time predictions compile on the host CPU, beside the GPU parts (the GPU host has
    # cores to spare); the dry run has two cores, so there they run first, one at a time.
    # Ahead-of-time predictions compile on the host CPU in the background, beside the device
    # parts: three processes at once on the GPU host, one at a time in a dry run (two cores).
    pending: list[tuple[str, str, dict, float]] = []
    if facts["topology"]:
      stages = list(range(4)) if "predict" in want else []
      # The edge search starts from stage 3's compile at the batch, so it shares its process;
      # the longest group goes first.
      groups = [("predict_stage3_edge", stages[3:], "edge" in want),
                ("predict_stages01", stages[:2], False), ("predict_stage2", stages[2:3], False)]
      for key, sts, e in groups:
        if sts or e:
          # A dry run's edge is placed just below its second compile (see _edge).
          spec = {"stages": sts, "edge": e,
                  **({"dry_edge_rows": 3.5, "edge_step": 4} if dry else {})}
          pending.append((key, "predict", spec, 300))
    elif want & {"predict", "edge"}:
      parts["predict"] = {"status": "skipped",
                          "why": f"zerojax has no one-GPU topology for {env.get('gpu')}"}
    _start_background(r, pending, concurrency=args.predict_jobs or (1 if dry else 3))

    if "speed" in want:
      parts["speed"] = r.run("speed", "speed", {}, 150)
    if "memory" in want:  # stage 3's run is the speed part's zerojax half
      for st in range(3):
        parts[f"memory_stage{st}"] = r.run(f"memory_stage{st}", "memory", {"stage": st}, 90)
    if "offload" in want:
      link = 8 * MiB if dry else 512 * MiB
      parts["offload_optimizer"] = r.run("offload_optimizer", "offload",
                                         {"params": False, "link_bytes": link}, 90)
      parts["offload_params"] = r.run("offload_params", "offload",
                                      {"params": True, "link_bytes": link}, 90)
    if "nvme" in want:
      parts["nvme"] = r.run("nvme", "nvme", {"nvme_dir": nvme_dir, "dd_mib": 64 if dry else 1024,
                                             "chunk": 1 << 12 if dry else 1 << 22}, 120)
    _collect_background(r, parts)
    if "edge" in want and facts["topology"]:
      pkey = "predict_stage3_edge"
      pe = parts.get(pkey, {})
      edge = pe.get("result", {}).get("edge", {}) if pe.get("status") == "ok" else {}
      if "largest_fitting" not in edge:
        parts["edge_fit"] = parts["edge_next"] = {
            "status": "skipped", "why": f"no verdict edge: {pkey} "
            + (f"{pe.get('status', 'not run')} {pe.get('why', '')}" if not edge
               else edge.get("why", ""))}
      else:
        parts["edge_fit"] = r.run("edge_fit", "edge", {"rows": edge["largest_fitting"],
                                                       "bypass": False}, 90)
        parts["edge_next"] = r.run("edge_next", "edge", {"rows": edge["first_refused"],
                                                         "bypass": True}, 90)
  finally:
    _collect_background(r, parts)  # never leave a compile running
    r.cleanup()
    shutil.rmtree(nvme_dir, ignore_errors=True)
  res["wall_s"] = round(time.monotonic() - t_start, 1)
  res["complete"] = True
  res["parts"] = dict(res["parts"])
  res["summary"] = summarise(res)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(res, f, indent=1, default=_json_default)
  md = markdown(res)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(md)
  print(md, flush=True)
  return res


ALL_PARTS = ("speed", "memory", "predict", "offload", "nvme", "edge")


class _SavedParts(dict):
  """The parts' records, written to ``results.json`` (``complete: false``) as each arrives, so
  a run killed from outside still leaves what it measured."""

  def __init__(self, path: str, res: dict):
    super().__init__()
    self.path, self.res = path, res

  def __setitem__(self, key, value):
    super().__setitem__(key, value)
    with open(self.path, "w") as f:
      json.dump({**self.res, "parts": dict(self)}, f, indent=1, default=_json_default)


def _start_background(r: Runner, pending: list, concurrency: int) -> None:
  """Starts the CPU compiles, at most ``concurrency`` at a time, from a thread that also
  kills any past its timeout (so it stops taking cores from the device parts)."""
  r.queue = list(pending)

  def pump():
    while not r.stopping.is_set():
      now = time.monotonic()
      running = 0
      for key, h in list(r.background.items()):
        if h[0].poll() is not None:
          r.ended.setdefault(key, now)
        elif now - h[1] > h[2] and key not in r.killed:
          os.killpg(h[0].pid, signal.SIGKILL)
          r.killed.add(key)
        else:
          running += 1
      if r.queue and running < concurrency and now < r.deadline - 5:
        key, part, spec, tmo = r.queue.pop(0)
        print(f"[gpu_check] {key}: started on the host CPU (timeout {tmo} s)", flush=True)
        r.background[key] = r.start(key, part, spec, tmo, cpu=True)
        continue
      if not r.queue and not running:
        return
      time.sleep(0.2)

  r.pump = threading.Thread(target=pump, daemon=True)
  r.pump.start()


def _collect_background(r: Runner, parts: dict) -> None:
  """Waits for the CPU compiles (within their timeouts and the budget); records those the
  budget left unstarted."""
  if r.pump is not None:
    r.pump.join(timeout=max(0.0, r.deadline - time.monotonic()))
  r.stopping.set()
  if r.pump is not None:
    r.pump.join()
  for key in list(r.background):
    parts[key] = r.finish(key, r.background.pop(key))
  for key, *_ in r.queue:
    parts[key] = {"status": "skipped",
                  "why": f"the run's time budget of {r.budget_s:.0f} s was spent"}
  r.queue = []


# ------------------------------------------------------------------------------------------
# Summary and markdown
# ------------------------------------------------------------------------------------------

def _res(parts: dict, key: str) -> dict | None:
  p = parts.get(key)
  return p["result"] if p and p.get("status") == "ok" else None


def _predictions(parts: dict) -> tuple[dict, dict | None, str]:
  """The ahead-of-time verdicts by stage, the edge search, and why any is missing."""
  stages, edge, why = {}, None, []
  for key, p in parts.items():
    if not key.startswith("predict"):
      continue
    if p.get("status") != "ok":
      why.append(f"{key} {p.get('status')}: {p.get('why', '')}")
      continue
    stages.update(p["result"]["stages"])
    edge = p["result"].get("edge", edge)
  return stages, edge, "; ".join(why)[:300] or "not run"


def _stage_run(parts: dict, stage: int) -> dict | None:
  """The device run of one stage: stage 3's is the speed part's zerojax run."""
  if stage == 3:
    sp = _res(parts, "speed")
    return sp["zerojax"] if sp else None
  return _res(parts, f"memory_stage{stage}")


def _ratio(a, b):
  return None if a is None or b in (None, 0) else a / b


def summarise(res: dict) -> dict:
  parts, out = res["parts"], {}
  sp = _res(parts, "speed")
  if sp:
    out["speed"] = {"zerojax_step_s": sp["zerojax"]["step_s"],
                    "hand_written_step_s": sp["hand_written"]["step_s"],
                    "ratio": sp["step_time_ratio"], "zerojax_mfu": sp["zerojax"]["mfu"],
                    "hand_written_mfu": sp["hand_written"]["mfu"],
                    "max_loss_diff": sp["max_loss_diff"]}
  mem = {}
  verdicts, pe, _ = _predictions(parts)
  for st in range(4):
    m, p = _stage_run(parts, st), verdicts.get(str(st))
    row = {"predicted_peak": p.get("peak") if p else None,
           "predicted_fits": p.get("fits") if p else None,
           "analysis_peak": m["memory_analysis"]["peak"] if m else None,
           "allocator_peak": m["memory_stats"].get("peak_bytes_in_use") if m else None}
    row["predicted_over_allocator"] = _ratio(row["predicted_peak"], row["allocator_peak"])
    row["predicted_over_analysis"] = _ratio(row["predicted_peak"], row["analysis_peak"])
    row["analysis_over_allocator"] = _ratio(row["analysis_peak"], row["allocator_peak"])
    # What each side takes as the memory a program may use: the verdict's share of the
    # documented size, and the allocator's pool.
    row["predicted_usable"] = p.get("usable_bytes") if p else None
    row["allocator_limit"] = m["memory_stats"].get("bytes_limit") if m else None
    row["allocator_peak_after_compile"] = (
        m.get("memory_stats_after_compile", {}).get("peak_bytes_in_use") if m else None)
    mem[f"stage{st}"] = row
  gpu_mib = res["environment"].get("gpu", {}).get("memory_mib")
  peak0 = mem["stage0"]["allocator_peak"]
  out["stage0_fill"] = None if not gpu_mib or peak0 is None else peak0 / (gpu_mib * MiB)
  out["memory"] = mem
  base = _stage_run(parts, 3)
  off = {}
  for key in ("offload_optimizer", "offload_params"):
    o = _res(parts, key)
    if not o:
      continue
    host = sum(v for k in ("params", "opt_state")
               for kind, v in o["state_kinds"][k].items() if kind == "pinned_host")
    kinds = {k: sorted(o["state_kinds_after"][k]) for k in ("params", "opt_state")}
    row = {"offloaded_bytes": host, "kinds_after_steps": kinds,
           "step_s": o["step_s"], "analysis_peak": o["memory_analysis"]["peak"],
           "allocator_peak": o["memory_stats"].get("peak_bytes_in_use")}
    if base:
      bp = base["memory_stats"].get("peak_bytes_in_use")
      row["allocator_drop"] = None if bp is None or row["allocator_peak"] is None else \
          bp - row["allocator_peak"]
      row["analysis_drop"] = base["memory_analysis"]["peak"] - row["analysis_peak"]
      row["drop_over_offloaded"] = _ratio(row["allocator_drop"], host)
      common = min(len(o["losses"]), len(base["losses"]))  # the same batches, in order
      row["losses_equal"] = o["losses"][:common] == base["losses"][:common]
      row["losses_compared"] = common
      row["max_loss_diff"] = max(abs(a - b) for a, b in zip(o["losses"], base["losses"]))
      row["step_time_ratio"] = _ratio(o["step_s"], base["step_s"])
      # Overlap: the step time offload adds, against the time its copies take at the measured
      # link rates (optimizer state in and out; parameters in for the forward and backward
      # passes and the update, out after it).
      opt_host = o["state_kinds"]["opt_state"].get("pinned_host", 0)
      par_host = o["state_kinds"]["params"].get("pinned_host", 0)
      link = o["link"]
      moved_s = ((opt_host + 2 * par_host) / (link["h2d_gb_s"] * 1e9)
                 + (opt_host + par_host) / (link["d2h_gb_s"] * 1e9))
      row["copy_s_at_link_rate"] = moved_s
      row["added_step_s"] = o["step_s"] - base["step_s"]
      row["hidden_share"] = None if moved_s <= 0 else 1 - row["added_step_s"] / moved_s
    off[key] = row
  out["offload"] = off
  nv = _res(parts, "nvme")
  if nv:
    b = nv["bound"]
    out["nvme"] = {"rss_peak_above_baseline": b["rss_peak_above_baseline"],
                   "bound": b["bound_bytes"], "holds": b["holds"],
                   "disk_over_bound": b["disk_over_bound"],
                   "read_vs_dd": _ratio(nv["host_update"]["read_mb_s"], nv["dd"].get("read_mb_s")),
                   "write_vs_dd": _ratio(nv["host_update"]["write_mb_s"],
                                         nv["dd"].get("write_mb_s"))}
  if pe and "largest_fitting" in pe:
    fit, nxt = parts.get("edge_fit", {}), parts.get("edge_next", {})
    nr = nxt.get("result", {})
    over = pe["refused_peak"] / pe["usable_bytes"] - 1
    if nxt.get("status") != "ok":
      verdict_next = f"part {nxt.get('status')}: {nxt.get('why', '')}"[:300]
    elif not nr.get("ran"):
      verdict_next = ("failed to allocate" if nr.get("oom")
                      else f"failed: {nr.get('error', '')[:200]}")
    elif res["environment"]["dry_run"]:
      verdict_next = "ran (CPU: no device memory limit to meet)"
    else:
      verdict_next = ("ran: a margin case, predicted " if over is not None and over < 0.05 else
                      "ran: THE VERDICT WAS WRONG, predicted ") + f"{over:+.1%} over the usable"
    fr = fit.get("result", {})
    out["edge"] = {"largest_fitting": pe["largest_fitting"],
                   "fit_ran": fit.get("status") == "ok" and fr.get("ran"),
                   "fit_error": None if fr.get("ran") else (fr.get("error") or fit.get("why")),
                   "first_refused": pe["first_refused"], "predicted_over": over,
                   "next": verdict_next, "next_zerojax_check": nr.get("zerojax_check")}
  out["targets"] = targets(out, res["environment"]["dry_run"])
  return out


def targets(sm: dict, dry: bool) -> list[tuple[str, str]]:
  """Issue 50's targets against this run: (target, what was measured). A dry run judges
  none: its figures are CPU's at tiny shapes."""
  def met(ok):
    return "n/a" if ok is None else "dry run" if dry else ("met" if ok else "NOT MET")
  rows = []
  sp = sm.get("speed")
  r = sp and sp["ratio"]
  rows.append(("zerojax step time within 3% of hand-written",
               f"{met(None if r is None else r <= 1.03)} ({_x(r)})"))
  for st in range(4):
    q = sm["memory"][f"stage{st}"]["predicted_over_allocator"]
    rows.append((f"stage {st}: predicted peak within 5% of peak_bytes_in_use",
                 f"{met(None if q is None else abs(q - 1) <= 0.05)} ({_x(q)})"))
  for key, o in sm["offload"].items():
    q = o.get("drop_over_offloaded")
    rows.append((f"{key}: HBM peak falls by the offloaded bytes, within 5%",
                 f"{met(None if q is None else abs(q - 1) <= 0.05)} ({_x(q)})"))
    rows.append((f"{key}: losses bit-equal to the in-HBM run",
                 f"{met(o.get('losses_equal'))} (largest difference "
                 f"{o.get('max_loss_diff', float('nan')):.3g})"))
  nv = sm.get("nvme")
  rows.append(("ZeRO-Infinity: peak RSS within params + grads + pool + 10%, state on disk >= 2x",
               "n/a" if not nv else f"{met(nv['holds'] and nv['disk_over_bound'] >= 2)} "
               f"({_g(nv['rss_peak_above_baseline'])} of {_g(nv['bound'])}; disk "
               f"{nv['disk_over_bound']:.2f}x)"))
  e = sm.get("edge")
  ok = e and bool(e["fit_ran"]) and not e["next"].startswith("ran: THE")
  rows.append(("the verdict's largest micro-batch runs; the next fails or is a margin case",
               "n/a" if not e else f"{met(ok)} ({e['largest_fitting']} rows ran: "
               f"{e['fit_ran']}; {e['first_refused']} rows: {e['next']})"))
  return rows


def _g(b) -> str:
  if b is None:
    return "n/a"
  return f"{b / GiB:.2f} GiB" if abs(b) >= GiB else f"{b / MiB:.1f} MiB"


def _x(r) -> str:
  return "n/a" if r is None else f"{r:.3f}x"


def _why(parts: dict, key: str) -> str:
  p = parts.get(key)
  if p is None:
    return "not run"
  return f"{p['status']}: {p.get('why', '')}"[:160].replace("|", "/")


def markdown(res: dict) -> str:
  env, parts, s = res["environment"], res["parts"], res["shapes"]
  sm = res["summary"]
  gpu = env.get("gpu", {})
  v = env["versions"]
  lines = [f"# gpu_check {'(DRY RUN on CPU: no GPU numbers)' if env['dry_run'] else ''}".strip(),
           "",
           f"{env['date_utc']} UTC, {env['host']}, {env['machine']}, {env['cpus']} CPUs, "
           f"Python {env['python']}, " + ", ".join(f"{k} {x}" for k, x in v.items())
           + (f"; GPU {gpu.get('name')}, driver {gpu.get('driver')}, "
              f"{gpu.get('memory_mib')} MiB" if gpu else "; no GPU"),
           f"Model: Llama-shaped, {s['layers']} layers, d_model {s['d_model']}, {s['heads']}/"
           f"{s['kv_heads']} heads, SwiGLU {s['ffn']}, vocab {s['vocab']}, "
           f"{res['params'] / 1e6:.1f}M parameters; batch {s['batch']} x {s['seq']}; "
           f"bf16 compute, fp32 params, AdamW. Wall {res['wall_s']} s of a {res['budget_s']} s "
           f"budget. Peak for MFU: {res['gpu']['peak_name']}.", "",
           "| part | status | seconds |", "|---|---|---|"]
  for k, p in parts.items():
    lines.append(f"| {k} | {p['status']}"
                 + (f": {p.get('why', '')[:120]}".replace("|", "/") if p["status"] != "ok"
                    else "") + f" | {p.get('seconds', '')} |")
  lines += ["", "## a. Speed, one device", ""]
  if "speed" in sm:
    sp, raw = sm["speed"], parts["speed"]["result"]
    mfu = lambda x: "n/a" if x is None else f"{x:.1%}"
    lines += ["| step | step time | tokens/s | TFLOP/s | MFU |", "|---|---|---|---|---|"]
    for name, key in (("zerojax stage 3", "zerojax"), ("hand-written jax.jit", "hand_written")):
      r = raw[key]
      lines.append(f"| {name} | {r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} | "
                   f"{r['tflops_per_s']:.1f} | {mfu(r['mfu'])} |")
    lines += ["", f"zerojax / hand-written step time: **{_x(sp['ratio'])}**; largest loss "
              f"difference over {raw['steps']} steps: {sp['max_loss_diff']:.3g}"]
  else:
    lines.append(_why(parts, "speed"))
  lines += ["", "## b. Memory: predicted (ahead of time), compiled, allocator", "",
            "| stage | predicted peak (verdict) | memory_analysis peak | peak_bytes_in_use | "
            "predicted / allocator | predicted / analysis | analysis / allocator |",
            "|---|---|---|---|---|---|---|"]
  for st in range(4):
    m = sm["memory"][f"stage{st}"]
    fits = {True: "FITS", False: "DOES NOT FIT", None: _predictions(parts)[2]}[
        m["predicted_fits"]]
    alloc, run = m["allocator_peak"], _stage_run(parts, st)
    if alloc is None and run:
      alloc_s = "null: " + run["memory_stats"].get("why", "")[:60]
    else:
      alloc_s = _g(alloc) if alloc is not None else _why(
          parts, "speed" if st == 3 else f"memory_stage{st}")
    lines.append(f"| {st} | {_g(m['predicted_peak'])} ({fits}) | {_g(m['analysis_peak'])} | "
                 f"{alloc_s} | {_x(m['predicted_over_allocator'])} | "
                 f"{_x(m['predicted_over_analysis'])} | {_x(m['analysis_over_allocator'])} |")
  lines += ["", "Stage 3's device run is part a's zerojax run (alone in its process until then)."]
  m0 = sm["memory"]["stage0"]
  if sm.get("stage0_fill") is not None:
    lines.append(f"Stage 0 fills {sm['stage0_fill']:.0%} of the GPU's memory (the batch aims "
                 "at half).")
  lines.append(f"Usable memory: the verdict's {_g(m0['predicted_usable'])}; the allocator's "
               f"bytes_limit {_g(m0['allocator_limit'])}. Allocator peak after compiling, "
               f"before any step (stage 0): {_g(m0['allocator_peak_after_compile'])}.")
  lines += ["", "## c. Offload (stage 3 against the in-HBM stage 3 of parts a and b)", "",
            "| run | offloaded | memory kinds (params / opt) | allocator peak drop | drop / "
            "offloaded | analysis peak drop | losses | step time ratio | step time added / "
            "copies at link rate |",
            "|---|---|---|---|---|---|---|---|---|"]
  for key in ("offload_optimizer", "offload_params"):
    o = sm["offload"].get(key)
    if not o:
      lines.append(f"| {key} | {_why(parts, key)} | | | | | | | |")
      continue
    kinds = " / ".join(",".join(o["kinds_after_steps"][k]) for k in ("params", "opt_state"))
    loss = ("bit-equal" if o.get("losses_equal") else
            f"differ by up to {o['max_loss_diff']:.3g}" if "max_loss_diff" in o else "n/a")
    lines.append(f"| {key} | {_g(o['offloaded_bytes'])} | {kinds} | {_g(o.get('allocator_drop'))} "
                 f"| {_x(o.get('drop_over_offloaded'))} | {_g(o.get('analysis_drop'))} | {loss} | "
                 f"{_x(o.get('step_time_ratio'))} | " + (
                     f"{o['added_step_s'] * 1e3:+.1f} ms / {o['copy_s_at_link_rate'] * 1e3:.1f} ms"
                     if "added_step_s" in o else "n/a: no in-HBM run") + " |")
  lines += ["", "## d. ZeRO-Infinity (optimizer state and fp32 master on disk)", ""]
  nv = _res(parts, "nvme")
  if nv:
    b, h, dd = nv["bound"], nv["host_update"], nv["dd"]
    f = lambda x: "n/a" if x is None else f"{x:,.0f}"
    lines += ["| quantity | value |", "|---|---|",
              f"| parameters (bf16, device) / gradient shards / buffer pool | "
              f"{_g(b['param_bytes'])} / {_g(b['grad_shard_bytes'])} / "
              f"{_g(b['buffer_pool_bytes'])} |",
              f"| bound: (params + grads + pool) x 1.1 | {_g(b['bound_bytes'])} |",
              f"| optimizer state on disk / bound | {_g(b['state_on_disk_bytes'])} / "
              f"{_g(b['bound_bytes'])} = {b['disk_over_bound']:.2f}x |",
              f"| peak RSS in the steps after the first, above the runtime's baseline "
              f"({_g(nv['rss_baseline'])}) | {_g(b['rss_peak_above_baseline'])}: bound "
              f"{'HOLDS' if b['holds'] else 'NOT MET'} |",
              f"| the same over the whole run (the first step compiles) | "
              f"{_g(b['whole_run_above_baseline'])} |",
              f"| host update read / write | {f(h['read_mb_s'])} / {f(h['write_mb_s'])} MB/s |",
              f"| dd O_DIRECT read / write, same disk, same run | {f(dd.get('read_mb_s'))} / "
              f"{f(dd.get('write_mb_s'))} MB/s |",
              f"| step time | {nv['step_s']:.2f} s |"]
    if env["dry_run"]:
      lines.append("| note | on CPU devices, device memory is process memory: the RSS bound "
                   "is only meaningful on a GPU |")
  else:
    lines.append(_why(parts, "nvme"))
  lines += ["", "## e. The verdict's edge (stage 3)", ""]
  e = sm.get("edge")
  if e:
    lines += [f"- largest micro-batch the verdict says fits: {e['largest_fitting']} rows; "
              f"ran: {e['fit_ran']}"
              + (f" ({str(e['fit_error'])[:300]})" if e.get("fit_error") else ""),
              f"- next size, {e['first_refused']} rows, predicted "
              f"{e['predicted_over']:+.1%} over the usable memory: {e['next']}"]
  else:
    why = (_predictions(parts)[1] or {}).get("why") or _predictions(parts)[2]
    lines.append(f"no edge: {why}")
  lines += ["", "## Targets (issue 50)", "", "| target | this run |", "|---|---|"]
  lines += [f"| {t} | {v} |".replace("\n", " ") for t, v in sm["targets"]]
  return "\n".join(lines) + "\n"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", help="directory for results.json and results.md")
  ap.add_argument("--dry-run", action="store_true",
                  help="every part at tiny shapes on one CPU device")
  ap.add_argument("--parts", help=f"comma-separated subset of {','.join(ALL_PARTS)}")
  ap.add_argument("--budget", type=float, help="overall seconds (default 345; dry run 300)")
  ap.add_argument("--batch", type=int, help="rows per step (default: by GPU memory)")
  ap.add_argument("--layers", type=int, help="decoder layers (default 16)")
  ap.add_argument("--nvme-dir", help="where ZeRO-Infinity's files go (default: "
                  ".gpu-check-nvme in the repository; removed afterwards)")
  ap.add_argument("--predict-jobs", type=int,
                  help="ahead-of-time compile processes at once on the host CPU (default 3; "
                  "dry run 1)")
  ap.add_argument("--part", help=argparse.SUPPRESS)
  ap.add_argument("--spec", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.part:
    child_main(args.part, args.spec)
    return
  if not args.out:
    ap.error("--out DIR is required")
  main_run(args)


if __name__ == "__main__":
  main()
