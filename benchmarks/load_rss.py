"""Peak host memory of loading a Hugging Face checkpoint straight into ZeRO-3 shards.

Generates a random Llama-layout safetensors checkpoint (sharded files +
``model.safetensors.index.json``, default ~1.2 GB fp32) in a temporary directory, then loads
it at stage 3 on an 8-device mesh made of 8 processes with one CPU device each
(``zerojax.tools.launch``, as 8 hosts would), with `zerojax.runtime.weights.load_safetensors`. Each process
measures, in a fresh interpreter:

* its idle baseline: RSS after JAX, the distributed runtime and the plan are set up;
* its peak RSS during the load (the kernel's high-water mark, reset after the baseline via
  ``/proc/self/clear_refs``), minus the baseline.

The target of issue 13 is ``peak - baseline <= 1.25 * (checkpoint / 8 + largest tensor)``.
The temporary checkpoint is deleted at the end. Usage::

  python benchmarks/load_rss.py                 # ~1.2 GB checkpoint, 8 processes
  python benchmarks/load_rss.py --layers 8      # bigger
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
              num_attention_heads=16, num_key_value_heads=4, rms_norm_eps=1e-5,
              rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False,
              model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu")


def _status(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"/proc/self/status has no {field}")


def hf_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
  """Hugging Face Llama tensor names and shapes (PyTorch layout)."""
  d, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
  hd = d // cfg["num_attention_heads"]
  q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
  out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
         "lm_head.weight": (v, d)}
  for n in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{n}."
    out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (i, d), p + "mlp.up_proj.weight": (i, d),
                p + "mlp.down_proj.weight": (d, i)})
  return out


def generate(directory: str, cfg: dict, shard_bytes: int = 400 << 20) -> tuple[int, int]:
  """Writes a random checkpoint, one shard file at a time; returns (total, largest) bytes."""
  import numpy as np
  from safetensors.numpy import save_file
  rng = np.random.default_rng(0)
  files, current, size, total, largest = {}, {}, 0, 0, 0

  def flush():
    nonlocal current, size
    if current:
      name = f"model-{len(files) + 1:05d}.safetensors"
      save_file(current, os.path.join(directory, name), metadata={"format": "pt"})
      files.update({k: name for k in current})
      current, size = {}, 0

  for name, shape in hf_tensors(cfg).items():
    x = rng.standard_normal(shape, dtype=np.float32) * 0.02
    if size and size + x.nbytes > shard_bytes:
      flush()
    current[name] = x
    size += x.nbytes
    total += x.nbytes
    largest = max(largest, x.nbytes)
  flush()
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": files}, f)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(cfg, f)
  return total, largest


def child(directory: str) -> None:
  """One process of the 8: set up, take the idle baseline, load, report its peak."""
  import zerojax.core.distributed
  zerojax.core.distributed.initialize()
  import jax
  from flax import nnx
  import zerojax
  from zerojax.runtime import weights
  from zerojax.models import llama
  import safetensors  # noqa: F401 - loaded before the baseline, as in any process that loads
  cfg = llama.from_hf_config(directory)
  config = zerojax.ZeroConfig(stage=3)
  mesh = zerojax.make_mesh(config)
  abstract = nnx.eval_shape(lambda: llama.Llama(cfg, nnx.Rngs(0)))
  plan = zerojax.ShardingPlan.create(config, mesh, nnx.state(abstract, nnx.Param))
  baseline = _status("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
  tree = weights.load_safetensors(directory, plan, llama.hf_mapping(cfg))
  jax.block_until_ready(tree)
  peak = _status("VmHWM")
  held = sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)
  print("RESULT " + json.dumps({"process": jax.process_index(), "devices": jax.device_count(),
                                "baseline": baseline, "peak": peak, "held": held}), flush=True)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
  p.add_argument("--processes", type=int, default=8)
  p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp "
                 "directory under /tmp, deleted afterwards)")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    child(args.child)
    return 0
  if args.layers < 1 or args.processes < 1:
    p.error(f"--layers={args.layers} and --processes={args.processes} must be positive")
  cfg = dict(CONFIG, num_hidden_layers=args.layers)
  directory = args.dir or tempfile.mkdtemp(prefix="zerojax_load_rss_", dir="/tmp")
  os.makedirs(directory, exist_ok=True)
  try:
    total, largest = generate(directory, cfg)
    cmd = [sys.executable, "-m", "zerojax.tools.launch", "-n", str(args.processes),
           "--devices-per-process", "1", "--timeout", "1200", "--",
           os.path.abspath(__file__), "--child", directory]
    run = subprocess.run(cmd, capture_output=True, text=True)
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in run.stdout.splitlines()
               if "RESULT " in line]
    if run.returncode or len(results) != args.processes:
      print(run.stdout[-4000:], run.stderr[-4000:], file=sys.stderr)
      return run.returncode or 1
  finally:
    if args.dir is None:
      shutil.rmtree(directory, ignore_errors=True)
  mib = lambda n: f"{n / 2**20:.1f}"
  n = args.processes
  target = 1.25 * (total / n + largest)
  print(f"checkpoint: {mib(total)} MiB in safetensors shards (fp32), largest tensor "
        f"{mib(largest)} MiB; stage 3 on {n} processes x 1 CPU device")
  print(f"target per process: 1.25 x (checkpoint/{n} + largest tensor) = {mib(target)} MiB")
  print()
  print("process  baseline MiB  peak MiB  peak-baseline MiB  shards held MiB  within target")
  worst = 0
  for r in sorted(results, key=lambda r: r["process"]):
    over = r["peak"] - r["baseline"]
    worst = max(worst, over)
    print(f"{r['process']:>7}  {mib(r['baseline']):>12}  {mib(r['peak']):>8}  {mib(over):>17}"
          f"  {mib(r['held']):>15}  {'yes' if over <= target else 'NO'}")
  print()
  print(f"worst peak above baseline: {mib(worst)} MiB = {worst / target:.2f} x target "
        f"({worst / (total / n):.2f} x checkpoint/{n})")
  return 0 if worst <= target else 1


if __name__ == "__main__":
  sys.exit(main())
