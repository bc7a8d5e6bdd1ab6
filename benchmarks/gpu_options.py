"""XLA:GPU compile options one at a time on the issue's Llama at stage 3 (h100:8), ahead of time.

``python benchmarks/gpu_options.py`` compiles zerojax's default stage-3 step with each option
changed from zerojax's GPU defaults (`zerojax.core.backend.GPU.compiler_options`) and prints temp,
collective bytes and the schedule. DeepSpeed's bucket knobs map onto the combine thresholds:
``reduce_bucket_size`` (elements x gradient bytes) onto the reduce-scatter/all-reduce
thresholds, ``allgather_bucket_size`` and ``stage3_prefetch_bucket_size`` onto the all-gather
one. All are per-compile options (``jax.jit(..., compiler_options=...)``): no process-wide
``XLA_FLAGS`` is needed.
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

MiB = 2**20
VARIANTS = [
    ("zerojax GPU defaults", {}),
    ("reduce-scatter combine threshold 30 MiB (the same schedule as XLA's default; zerojax's "
     "default before 2026-11-24, evening)",
     {"xla_gpu_reduce_scatter_combine_threshold_bytes": 30 * MiB}),
    ("parallel collective overlap limit 4 (experimental)",
     {"xla_gpu_experimental_parallel_collective_overlap_limit": 4}),
    ("no latency-hiding scheduler / pipelining / double buffering",
     {"xla_gpu_enable_latency_hiding_scheduler": False,
      "xla_gpu_enable_pipelined_all_gather": False,
      "xla_gpu_enable_pipelined_reduce_scatter": False,
      "xla_gpu_enable_while_loop_double_buffering": False}),
    ("all-gather combine threshold 4 MiB (allgather_bucket_size 2M bf16)",
     {"xla_gpu_all_gather_combine_threshold_bytes": 4 * MiB}),
    ("all-gather combine threshold 256 MiB", {"xla_gpu_all_gather_combine_threshold_bytes": 256 * MiB}),
    ("reduce-scatter combine threshold 4 MiB (reduce_bucket_size 2M bf16)",
     {"xla_gpu_reduce_scatter_combine_threshold_bytes": 4 * MiB}),
    ("reduce-scatter combine threshold 256 MiB",
     {"xla_gpu_reduce_scatter_combine_threshold_bytes": 256 * MiB}),
]


def main() -> None:
  import zerojax
  from benchmarks.decoder import ISSUE_LLAMA, Decoder, zerojax_step
  from zerojax.core.backend import GPU
  from zerojax.runtime import memory
  print("| options | temp MiB | collectives MiB | all-gather ops | all-gather async / with matmul "
        "| reduce-scatter ops | reduce-scatter with matmul | compile s |\n|---|---|---|---|---|---|---|---|")
  for name, opts in VARIANTS:
    zc = zerojax.ZeroConfig(stage=3, precision=zerojax.Precision(compute="bfloat16"))
    r = memory.compile_for_topology(zc, Decoder(ISSUE_LLAMA), (16, 1024), "h100:8",
                                    train_step=zerojax_step,
                                    compiler_options={**GPU.compiler_options, **opts})
    m, ag, rs = r.measured, r.gathers, r.scatters
    print(f"| {name} | {m.temp / MiB:.1f} | {m.collective_total / MiB:.1f} | {ag.pairs} | "
          f"{ag.overlapped_share:.0%} / {ag.matmul_share:.0%} | {rs.pairs} | "
          f"{rs.matmul_share:.0%} | {r.compile_seconds:.0f} |", flush=True)


if __name__ == "__main__":
  main()
