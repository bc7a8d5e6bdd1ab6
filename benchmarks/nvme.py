"""ZeRO-Infinity benchmark: the optimizer state on NVMe against in memory and host offload.

Trains the same GPT (Adam, stage 2) three ways, each in its own process (so each peak RSS is
its own): optimizer state in device memory, in ``pinned_host`` memory (``offload_optimizer=
True``), and in files (``offload_optimizer='nvme'``). In the same run, ``dd`` measures the
disk's sequential write and read bandwidth (O_DIRECT, 1 MiB blocks) where the files live.

Prints a table: optimizer-state bytes, chunk and buffer settings, the host update's read and
write MB/s against dd's, its update compute, I/O and wait time, its wall time against
max(I/O, update), the step time of each mode, and peak RSS.

  python benchmarks/nvme.py                       # defaults: ~29M parameters, 2 CPU devices
  python benchmarks/nvme.py --d-model 256 --layers 2 --steps 3   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dd_bandwidth(directory: str, mib: int) -> dict[str, float]:
  """Sequential write and read MB/s of ``directory``'s disk, measured with dd (O_DIRECT, so
  the page cache is out of it)."""
  path = os.path.join(directory, "zerojax-dd.bin")
  out = {}
  try:
    for name, cmd in (
        ("write", ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct",
                   "conv=fdatasync"]),
        ("read", ["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])):
      p = subprocess.run(cmd, capture_output=True, text=True, check=True)
      m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", p.stderr)
      out[name] = int(m.group(1)) / 2**20 / float(m.group(2))
  finally:
    if os.path.exists(path):
      os.unlink(path)
  return out


class RssSampler:
  """The process's resident set, sampled every 5 ms in a thread: peaks over time windows."""

  def __init__(self):
    import threading
    self.samples: list[tuple[float, int]] = []
    threading.Thread(target=self._run, daemon=True).start()

  @staticmethod
  def now() -> int:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

  def _run(self) -> None:
    while True:
      self.samples.append((time.perf_counter(), self.now()))
      time.sleep(0.005)

  def peak(self, t0: float, t1: float) -> int:
    return max((r for t, r in self.samples if t0 <= t <= t1), default=0)


def child(args: argparse.Namespace) -> dict:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.devices}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, ROOT)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import zerojax
  from zerojax.models import GPT, GPTConfig, loss_fn

  cfg = GPTConfig(vocab_size=args.vocab, seq_len=64, num_layers=args.layers, num_heads=8,
                  d_model=args.d_model)
  rng = np.random.default_rng(0)
  data = []
  for _ in range(args.steps + 1):
    t = rng.integers(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), dtype=np.int32)
    data.append({"x": t[:, :-1], "y": t[:, 1:]})

  def train_step(state, batch):
    def lf(params):
      return loss_fn(state.apply_fn({"params": params}, batch["x"]), batch["y"])
    loss, grads = jax.value_and_grad(lf)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  tx = optax.adamw(1e-4)
  base = zerojax.ZeroConfig(stage=args.stage)
  if args.master:  # ZeRO-Infinity's accounting: bf16 on the devices, 12 bytes/param on disk
    tx = zerojax.master_weights(tx)
    base = base.replace(precision=zerojax.Precision(param="bfloat16", compute="bfloat16"))
  x = jnp.asarray(data[0]["x"])
  out: dict = {"mode": args.mode}
  offload = {"nvme": zerojax.NvmeOffload(args.nvme_path, chunk_size=args.chunk,
                                         buffer_count=args.buffers),
             "host": zerojax.HostOffload()}.get(args.mode)
  state, plan = zerojax.create_train_state(GPT(cfg), tx, jax.random.key(0), x,
                                           config=base.replace(offload=offload),
                                           overwrite=args.mode == "nvme")
  step, opt = zerojax.zero_step(plan)(train_step), plan.nvme
  if opt is not None:
    out["state_bytes"] = opt.state_bytes
    out["chunks"] = len(opt.bounds)
  out["params"] = int(sum(np.size(p) for p in jax.tree.leaves(state.params)))
  times, stats, losses = [], [], []
  rss = RssSampler()
  out["rss_start"] = rss.now()
  phases = []
  for i, b in enumerate(data):
    t = time.perf_counter()
    state, m = step(state, b)
    jax.block_until_ready(state.params)
    times.append(time.perf_counter() - t)
    if i > 0:  # the host update is the step's last nvme_wall_s seconds
      split = time.perf_counter() - float(m.get("nvme_wall_s", 0.0))
      phases.append((rss.peak(t, split), rss.peak(split, time.perf_counter()), rss.now()))
    losses.append(float(m["loss"]))
    if args.mode == "nvme" and i > 0:
      s = opt.stats
      stats.append({"read_mb_s": s.read_mb_s, "write_mb_s": s.write_mb_s,
                    "read_s": s.read_s, "write_s": s.write_s + s.sync_s, "update_s": s.update_s,
                    "wait_s": s.wait_s, "wall_s": s.wall_s, "bytes": s.bytes_read})
  out["step_s"] = float(np.median(times[1:]))  # the first step compiles
  out["losses"] = losses
  out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  out["rss_device_step"], out["rss_host_update"], out["rss_between"] = (
      max(p[k] for p in phases) for k in range(3))
  out["param_bytes"] = int(sum(p.nbytes for p in jax.tree.leaves(state.params)))
  if stats:
    out["nvme"] = {k: float(np.median([s[k] for s in stats])) for k in stats[0]}
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--d-model", type=int, default=512)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--devices", type=int, default=2)
  ap.add_argument("--stage", type=int, default=2)
  ap.add_argument("--master", action="store_true",
                  help="bf16 parameters, zerojax.master_weights(adamw): float32 master, mu, nu "
                       "on disk (12 bytes/parameter)")
  ap.add_argument("--chunk", type=int, default=1 << 22, help="nvme_chunk_size (parameters)")
  ap.add_argument("--buffers", type=int, default=4, help="nvme_buffer_count")
  ap.add_argument("--nvme-path", default=os.path.join(ROOT, ".nvme-bench"))
  ap.add_argument("--dd-mib", type=int, default=1024)
  ap.add_argument("--mode", help=argparse.SUPPRESS)
  ap.add_argument("--json", help="also write the results here")
  args = ap.parse_args()
  if args.mode:
    print("RESULT " + json.dumps(child(args)))
    return
  os.makedirs(args.nvme_path, exist_ok=True)
  shutil.rmtree(os.path.join(args.nvme_path, "zerojax-nvme"), ignore_errors=True)  # other runs'
  results = {"dd": dd_bandwidth(args.nvme_path, args.dd_mib)}
  for mode in ("memory", "host", "nvme"):
    cmd = [sys.executable, __file__, "--mode", mode] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k not in ("mode", "json", "master") and v is not None] + (
            ["--master"] if args.master else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode or not line:
      results[mode] = {"error": (p.stderr or p.stdout)[-2000:]}
      continue
    results[mode] = json.loads(line[0][7:])
  shutil.rmtree(os.path.join(args.nvme_path, "zerojax-nvme"), ignore_errors=True)
  print(table(results, args))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


def table(r: dict, args: argparse.Namespace) -> str:
  nv = r.get("nvme", {})
  s = nv.get("nvme", {})
  mib = lambda b: f"{b / 2**20:.0f} MiB"
  lines = [f"GPT d_model={args.d_model} layers={args.layers} vocab={args.vocab}, "
           f"{nv.get('params', 0) / 1e6:.1f}M parameters, "
           f"{'master_weights(adamw), bf16 parameters' if args.master else 'adamw'}, "
           f"stage {args.stage} on {args.devices} CPU "
           f"devices, batch {args.batch}",
           "| quantity | value |", "|---|---|"]
  rows = [
      ("optimizer state on disk (this process)", mib(nv.get("state_bytes", 0))),
      ("chunk size / chunks / buffers", f"{args.chunk:,} parameters / {nv.get('chunks')} / "
       f"{args.buffers}"),
      ("dd sequential write / read (O_DIRECT)", f"{r['dd']['write']:.0f} / "
       f"{r['dd']['read']:.0f} MB/s"),
      ("host update read / write", f"{s.get('read_mb_s', 0):.0f} / {s.get('write_mb_s', 0):.0f} "
       "MB/s"),
      ("  as a share of dd's", f"{s.get('read_mb_s', 0) / r['dd']['read']:.0%} / "
       f"{s.get('write_mb_s', 0) / r['dd']['write']:.0%}"),
      ("host update: update compute / read / write+sync / wait",
       f"{s.get('update_s', 0):.2f} / {s.get('read_s', 0):.2f} / {s.get('write_s', 0):.2f} / "
       f"{s.get('wait_s', 0):.2f} s"),
      ("host update wall / max(I/O, update)",
       f"{s.get('wall_s', 0):.2f} s / "
       f"{max(s.get('read_s', 0) + s.get('write_s', 0), s.get('update_s', 0)):.2f} s = "
       f"{s.get('wall_s', 0) / max(s.get('read_s', 0) + s.get('write_s', 0), s.get('update_s', 1e-9)):.2f}x"),
  ]
  for mode in ("memory", "host", "nvme"):
    m = r.get(mode, {})
    if "error" in m:
      rows.append((f"step time, {mode}", "failed: " + m["error"].splitlines()[-1][:80]))
    else:
      rows.append((f"step time / peak RSS, {mode}", f"{m['step_s']:.2f} s / "
                   f"{mib(m['peak_rss'])}"))
  for mode in ("memory", "host", "nvme"):
    m = r.get(mode, {})
    if "rss_between" in m:
      host = mib(m["rss_host_update"]) if mode == "nvme" else "-"
      rows.append((f"RSS {mode}: between steps / device-step peak / host-update peak",
                   f"{mib(m['rss_between'])} / {mib(m['rss_device_step'])} / {host}"))
  if "rss_between" in nv and nv.get("params"):
    pool = args.buffers * args.chunk * nv["state_bytes"] / nv["params"]
    rows.append(("NVMe host update above the between-steps RSS / buffer pool",
                 f"{mib(nv['rss_host_update'] - nv['rss_between'])} / {mib(pool)}"))
    rows.append(("parameters on the devices / optimizer state on disk",
                 f"{mib(nv['param_bytes'])} / {mib(nv['state_bytes'])}"))
  if "losses" in r.get("memory", {}) and "losses" in nv:
    same = r["memory"]["losses"] == nv["losses"]
    rows.append(("losses NVMe vs in memory", "identical" if same else
                 f"differ: {r['memory']['losses']} vs {nv['losses']}"))
  lines += [f"| {a} | {b} |" for a, b in rows]
  return "\n".join(lines)


if __name__ == "__main__":
  main()
