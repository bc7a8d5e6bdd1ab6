"""Predicted step time (`zerojax.runtime.step_time`) beside published measurements on the same
shapes, compiled ahead of time for H100 pods on a CPU machine (no GPU is run).

Run as ``python benchmarks/step_time.py [--only titan,maxtext,hosts]``; needs JAX's CUDA plugin.

Sections (markdown tables on stdout):
  titan    torchtitan's Llama 3.1 8B row: h100:8, local batch 2 x 8192, bf16, FSDP; published
           5,762 tokens/s per GPU (docs/performance.md)
  maxtext  MaxText's Llama 2 7B on one A3 (h100:8), 4 x 4096 tokens per device; published 492
           TFLOP/s per chip (configs/a3/llama_2_7b/README.md), in MaxText's own FLOP count
  hosts    the same on 16 A3 hosts (h100:16x8); published 375 TFLOP/s per chip. A3 High's GPU
           network is 4 x 200 Gb/s per VM (GCP "Networking and GPU machines"): 100 Gb/s per GPU

Each row is predicted twice: at the devices' published peaks (a lower bound on the step), and
with matmuls and attention at the measured matmul ceiling (`step_time.MEASURED_MATMUL`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTIONS = ("titan", "maxtext", "hosts")
TITAN_TOKENS = 5762  # tokens/s per GPU, torchtitan docs/performance.md (8 x H100, FSDP, bf16)
MAXTEXT_TFLOPS = {1: 492, 16: 375}  # TFLOP/s per chip by A3 hosts, MaxText's a3 README
A3_HIGH_NETWORK = 100e9 / 8  # bytes/s per GPU: 800 Gb/s of GPU NICs over 8 GPUs


def _compile(cfg, topology, batch, **config):
  import zerojax
  from benchmarks.decoder import Decoder, zerojax_step
  from zerojax.runtime import memory, step_time
  zc = zerojax.ZeroConfig.from_flat(dict(compute_dtype="bfloat16", **config))
  return memory.compile_for_topology(zc, Decoder(cfg), batch, topology, train_step=zerojax_step,
                                     predictor=step_time.predict_compiled)


def _predict(r, rates=None, ceiling=False):
  """`predict_step_time` of a compiled row, at peaks or at the measured matmul ceiling."""
  from zerojax.runtime import step_time as st
  rates = rates or st.device_rates(r.topology)
  eff = st.MEASURED_MATMUL.get(rates.name, 1.0) if ceiling else 1.0
  return st.predict_step_time(
      r.compiled.as_text(), rates, num_devices=r.num_devices,
      host_of=[d.process_index for d in r.plan.mesh.devices.flat],
      tokens=r.step_time.tokens, model_flops=r.step_time.model_flops,
      efficiency={"matmul": eff, "attention": eff})


def _terms(p) -> str:
  k = p.by_kind
  return (f"{p.seconds * 1e3:,.0f} | {k.get('matmul', 0) * 1e3:,.0f} | "
          f"{k.get('attention', 0) * 1e3:,.0f} | {k.get('memory', 0) * 1e3:,.0f} | "
          f"{p.comm_seconds * 1e3:,.0f} | {p.exposed_comm_seconds * 1e3:,.1f}")


HEAD = ("| row | prediction | step ms | matmul ms | attention ms | memory-bound ms | "
        "communication ms | exposed ms | {unit} | published | predicted / published |")


def section_titan(args):
  from benchmarks.decoder import LLAMA3_8B, num_params
  cfg = dataclasses.replace(LLAMA3_8B, attention="cudnn")
  r = _compile(cfg, "h100:8", (16, 8192), stage=3)
  print(r.table(), flush=True)
  n = num_params(cfg)
  # torchtitan's own count: 6 (N - embedding) + 12 l h q t per token
  per_token = 6 * (n - cfg.vocab * cfg.d_model) + 12 * cfg.layers * cfg.heads * cfg.head_dim * 8192
  print(f"\n### torchtitan's Llama 3.1 8B row: h100:8, local batch 2 x 8192, bf16, stage 3 "
        f"({n / 1e9:.2f}B parameters; {r.step_time.flops / 1e12:,.0f} TFLOP executed per GPU "
        f"per step, {per_token * 16384 / 1e12:,.0f} of them model FLOPs by torchtitan's count)\n")
  print(HEAD.format(unit="tokens/s per GPU"))
  print("|" + "---|" * 11)
  for label, p in (("published peaks", _predict(r)),
                   ("matmul at measured ceiling", _predict(r, ceiling=True))):
    tok = p.tokens_per_second_per_device
    print(f"| zerojax stage 3 | {label} | {_terms(p)} | {tok:,.0f} (MFU "
          f"{tok * per_token / 989.4e12:.0%}) | {TITAN_TOKENS:,} | {tok / TITAN_TOKENS:.2f}x |")


def _llama2_7b(layout="scan"):
  from benchmarks.decoder import DecoderConfig
  return DecoderConfig(vocab=32000, d_model=4096, layers=32, heads=32, kv_heads=32, ffn=11008,
                       attention="cudnn", layout=layout)


def _maxtext_tflops(cfg, rows_per_device, seq, causal):
  """MaxText's per-device TFLOPs of one step (maxtext_utils.calculate_tflops_training_per_device
  for a dense Llama): weights' matmuls and the logits, 3x for forward and backward, plus
  attention's two matmuls, halved for causality in releases after mid-2024."""
  b, t, e, h, k, d = rows_per_device, seq, cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim
  ffn = 2 * b * t * cfg.ffn * e * 3
  qkv = 2 * b * t * e * (h + 2 * k) * d
  proj = 2 * b * t * e * h * d
  attn = 4 * b * t * t * h * d * (0.5 if causal else 1.0)
  logits = 2 * b * t * e * cfg.vocab
  return (3 * ((ffn + qkv + proj) * cfg.layers + logits) + 3 * attn * cfg.layers) / 1e12


def _maxtext_rows(r, cfg, hosts, rates=None, name="zerojax stage 3"):
  """Rows in MaxText's TFLOP count: attention counted whole / halved for causality (its
  count changed between releases; the README does not say which produced its figures)."""
  for label, p in (("published peaks", _predict(r, rates)),
                   ("matmul at measured ceiling", _predict(r, rates, ceiling=True))):
    full, causal = (_maxtext_tflops(cfg, 4, 4096, c) / p.seconds for c in (False, True))
    pub = MAXTEXT_TFLOPS[hosts]
    print(f"| {name} | {label} | {_terms(p)} | {full:,.0f} / {causal:,.0f} "
          f"({p.tokens_per_second_per_device:,.0f} tokens/s) | {pub} | "
          f"{full / pub:.2f}x / {causal / pub:.2f}x |", flush=True)


def section_maxtext(args):
  rows = []
  for layout, name in (("scan", "zerojax stage 3, nn.scan(nn.remat)"),
                       ("loop", "zerojax stage 3, layers unrolled, no remat")):
    cfg = _llama2_7b(layout)
    t0 = time.perf_counter()
    r = _compile(cfg, "h100:8", (32, 4096), stage=3)
    print(r.table(), f"\n({time.perf_counter() - t0:.0f} s)", flush=True)
    rows.append((r, cfg, name))
  print("\n### MaxText's Llama 2 7B on one A3 (h100:8), 4 x 4096 tokens per device, bf16\n")
  print(HEAD.format(unit="model TFLOP/s per chip, MaxText's count: full / causal attention"))
  print("|" + "---|" * 11)
  for r, cfg, name in rows:
    _maxtext_rows(r, cfg, 1, name=name)


def section_hosts(args):
  from zerojax.runtime import step_time as st
  cfg = _llama2_7b("scan")
  a3 = dataclasses.replace(st.device_rates("h100:16x8"), network_bandwidth=A3_HIGH_NETWORK)
  runs = []
  # MaxText's 16vm.sh: dcn_data_parallelism=16 ici_fsdp_parallelism=8 (replicas across hosts,
  # FSDP within); flat FSDP over all 128 GPUs beside it.
  for mesh, kw in (("HSDP 16 x 8 (MaxText's)", dict(mesh_axes=("replica", "fsdp"),
                                                    mesh_shape=(16, 8))),
                   ("flat FSDP over 128", dict(mesh_axes=("fsdp",), mesh_shape=(-1,)))):
    t0 = time.perf_counter()
    r = _compile(cfg, "h100:16x8", (512, 4096), stage=3, **kw)
    print(r.table(), f"\n({time.perf_counter() - t0:.0f} s)", flush=True)
    runs.append((mesh, r))
  print("\n### MaxText's Llama 2 7B on 16 A3 hosts (h100:16x8), 4 x 4096 tokens per device, "
        "nn.scan(nn.remat)\n")
  print(HEAD.format(unit="model TFLOP/s per chip, MaxText's count: full / causal attention"))
  print("|" + "---|" * 11)
  for mesh, r in runs:
    _maxtext_rows(r, cfg, 16, name=f"{mesh}, DGX network 400 Gb/s per GPU")
    _maxtext_rows(r, cfg, 16, a3, name=f"{mesh}, A3 High network 100 Gb/s per GPU")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--only", default=",".join(SECTIONS))
  args = p.parse_args(argv)
  for s in [s.strip() for s in args.only.split(",") if s.strip()]:
    if s not in SECTIONS:
      p.error(f"--only {s!r} is invalid: sections are {', '.join(SECTIONS)}")
    t0 = time.perf_counter()
    globals()[f"section_{s}"](args)
    print(f"\n({s}: {time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
