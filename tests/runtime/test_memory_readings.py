"""One reading of a compiled step's collectives: `collective_bytes`, `collective_schedule` and
the report (`TopologyCompile.table`) count each collective once per execution where it is
issued (#53.4), and a stage-3 step is the only compile `compile_for_topology` makes (#53.5).

XLA:TPU's own compiles are in tests/aot/test_tpu_aot.py; here a hand-written module of XLA:TPU's
printed form, and XLA:GPU compiles of a tiny GPT."""

import re
import warnings

import pytest

import zerojax
from zerojax.core.pipeline import LAYERS_SCOPE
from zerojax.models import GPT, GPTConfig
from zerojax.runtime import gpu, memory

MiB = 2**20

# XLA:TPU's printed form of a layer loop (3 trips, known) whose all-gather (channel 7, 1 MiB)
# starts and finishes in the layer body while its continuation fusion computes inside a
# windowed-einsum loop nested in it. That loop prints no trip count: its counter is element
# 2 of its state, starts at 0, steps by 2 and stops at 4 (2 trips), and each trip permutes a
# 128 KiB chunk both ways. The all-gather's channel sits in three computations' fusions; it
# was once counted once per computation holding a copy (2 MiB a layer), and the windowed loop
# once per layer.
WINDOWED_HLO = """\
%start_fused (p0: bf16[128,512]) -> (bf16[128,512], bf16[1024,512]) {
  %p0 = bf16[128,512]{1,0} parameter(0)
  %all-gather.1 = bf16[1024,512]{1,0} all-gather(%p0), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, metadata={op_name="jit(step)/layers/dot_general"}
  ROOT %cc.1 = (bf16[128,512]{1,0}, bf16[1024,512]{1,0}) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.1 (p1: (bf16[128,512], bf16[1024,512]), x1: bf16[64,512]) -> bf16[64,64] {
  %p1 = (bf16[128,512]{1,0}, bf16[1024,512]{1,0}) parameter(0)
  %x1 = bf16[64,512]{1,0} parameter(1)
  %g1 = bf16[128,512]{1,0} get-tuple-element(%p1), index=0
  %all-gather.2 = bf16[1024,512]{1,0} all-gather(%g1), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, metadata={op_name="jit(step)/layers/dot_general"}
  %s1 = bf16[64,512]{1,0} slice(%all-gather.2), slice={[0:64], [0:512]}
  ROOT %d1 = bf16[64,64]{1,0} dot(%x1, %s1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%done_fused (p2: (bf16[128,512], bf16[1024,512])) -> bf16[1024,512] {
  %p2 = (bf16[128,512]{1,0}, bf16[1024,512]{1,0}) parameter(0)
  %g2 = bf16[128,512]{1,0} get-tuple-element(%p2), index=0
  %all-gather.3 = bf16[1024,512]{1,0} all-gather(%g2), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, metadata={op_name="jit(step)/layers/dot_general"}
  ROOT %cc.3 = bf16[1024,512]{1,0} custom-call(%p2, %all-gather.3), custom_call_target="AsyncCollectiveDone"
}

%windowed_dot_general_cond (wc: (bf16[128,512], (bf16[128,512], bf16[1024,512]), u32[])) -> pred[] {
  %wc = (bf16[128,512]{1,0}, (bf16[128,512]{1,0}, bf16[1024,512]{1,0}), u32[]) parameter(0)
  %four = u32[] constant(4)
  %wi = u32[] get-tuple-element(%wc), index=2
  ROOT %lt = pred[] compare(%wi, %four), direction=LT
}

%windowed_dot_general_body (wb: (bf16[128,512], (bf16[128,512], bf16[1024,512]), u32[])) -> (bf16[128,512], (bf16[128,512], bf16[1024,512]), u32[]) {
  %wb = (bf16[128,512]{1,0}, (bf16[128,512]{1,0}, bf16[1024,512]{1,0}), u32[]) parameter(0)
  %two = u32[] constant(2)
  %chunk = bf16[128,512]{1,0} get-tuple-element(%wb), index=0
  %inflight = (bf16[128,512]{1,0}, bf16[1024,512]{1,0}) get-tuple-element(%wb), index=1
  %i = u32[] get-tuple-element(%wb), index=2
  %cps.1 = (bf16[128,512]{1,0}, bf16[128,512]{1,0}, u32[], u32[]) collective-permute-start(%chunk), channel_id=8, source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}
  %cps.2 = (bf16[128,512]{1,0}, bf16[128,512]{1,0}, u32[], u32[]) collective-permute-start(%chunk), channel_id=9, source_target_pairs={{1,0},{2,1},{3,2},{4,3},{5,4},{6,5},{7,6},{0,7}}
  %x = bf16[64,512]{1,0} slice(%chunk), slice={[0:64], [0:512]}
  %cont = bf16[64,64]{1,0} fusion(%inflight, %x), kind=kOutput, calls=%async_collective_fusion.1
  %cpd.1 = bf16[128,512]{1,0} collective-permute-done(%cps.1)
  %cpd.2 = bf16[128,512]{1,0} collective-permute-done(%cps.2)
  %next = u32[] add(%i, %two)
  ROOT %wt = (bf16[128,512]{1,0}, (bf16[128,512]{1,0}, bf16[1024,512]{1,0}), u32[]) tuple(%cpd.1, %inflight, %next)
}

%layer_body (lb: (s32[], bf16[128,512])) -> (s32[], bf16[128,512]) {
  %lb = (s32[], bf16[128,512]{1,0}) parameter(0)
  %one = s32[] constant(1)
  %zero = u32[] constant(0)
  %n = s32[] get-tuple-element(%lb), index=0
  %w = bf16[128,512]{1,0} get-tuple-element(%lb), index=1
  %async-collective-start = (bf16[128,512]{1,0}, bf16[1024,512]{1,0}) fusion(%w), kind=kCustom, calls=%start_fused
  %init = (bf16[128,512]{1,0}, (bf16[128,512]{1,0}, bf16[1024,512]{1,0}), u32[]) tuple(%w, %async-collective-start, %zero)
  %while.w = (bf16[128,512]{1,0}, (bf16[128,512]{1,0}, bf16[1024,512]{1,0}), u32[]) while(%init), condition=%windowed_dot_general_cond, body=%windowed_dot_general_body
  %async-collective-done = bf16[1024,512]{1,0} fusion(%async-collective-start), kind=kCustom, calls=%done_fused
  %m = s32[] add(%n, %one)
  ROOT %lt2 = (s32[], bf16[128,512]{1,0}) tuple(%m, %w)
}

%layer_cond (lc: (s32[], bf16[128,512])) -> pred[] {
  %lc = (s32[], bf16[128,512]{1,0}) parameter(0)
  %three = s32[] constant(3)
  %k = s32[] get-tuple-element(%lc), index=0
  ROOT %lt3 = pred[] compare(%k, %three), direction=LT
}

ENTRY %main (w0: bf16[128,512]) -> (s32[], bf16[128,512]) {
  %w0 = bf16[128,512]{1,0} parameter(0)
  %c0 = s32[] constant(0)
  %t0 = (s32[], bf16[128,512]{1,0}) tuple(%c0, %w0)
  ROOT %layers = (s32[], bf16[128,512]{1,0}) while(%t0), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_windowed_einsum_loops_count_each_collective_once_per_execution():
  got = memory.collective_bytes(WINDOWED_HLO)
  # the layer's all-gather once a layer, wherever its continuation computes
  assert got["all-gather"] == 3 * MiB
  # two 128 KiB permutes a windowed trip, two trips a layer, three layers
  assert got["collective-permute"] == 3 * 2 * 2 * 128 * 1024
  ag = memory.collective_schedule(WINDOWED_HLO, "all-gather")
  assert ag.total == ag.asynchronous == got["all-gather"]
  # the windowed loop, its dot included, runs between the gather's start and done
  assert ag.overlapped == ag.overlapped_matmul == ag.total
  scoped = memory.collective_bytes_by_dtype(WINDOWED_HLO, scope="layers")
  assert scoped == {("all-gather", "bf16"): 3 * MiB}
  assert memory.collective_schedule(WINDOWED_HLO, "all-gather", "layers").total == 3 * MiB


def _report_bytes(table: str) -> dict[str, str]:
  """``{kind: 'N MiB'}`` from the report's totals line and from its schedule lines."""
  totals = dict(re.findall(r"(all-gather|reduce-scatter) ([\d.,]+ [MG]iB)",
                           next(l for l in table.splitlines() if "collectives per step" in l)))
  sched = dict(re.findall(r"^  (all-gather|reduce-scatter): ([\d.,]+ [MG]iB),", table, re.M))
  return totals, sched


def assert_one_reading(r: memory.TopologyCompile) -> None:
  """`collective_bytes`, `collective_schedule` (whole step and the scanned layers' scope)
  and the report agree on a compiled step."""
  text = r.compiled.as_text()
  got = memory.collective_bytes(text)
  assert got == r.measured.collectives
  for kind in ("all-gather", "reduce-scatter"):
    assert memory.collective_schedule(text, kind).total == got[kind], kind
    scoped = sum(b for (k, _), b in memory.collective_bytes_by_dtype(text, LAYERS_SCOPE).items()
                 if k == kind)
    assert memory.collective_schedule(text, kind, LAYERS_SCOPE).total == scoped, kind
  totals, sched = _report_bytes(r.table())
  assert totals and totals == sched, (totals, sched)


class CompileCounter:
  """Names of the backend compiles made inside a ``with`` block (jax.monitoring)."""

  def __init__(self):
    self.names: list[str] = []

  def _on(self, event: str, secs: float, **kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      self.names.append(kw.get("fun_name", "?"))

  def __enter__(self):
    import jax
    jax.monitoring.register_event_duration_secs_listener(self._on)
    return self

  def __exit__(self, *exc):
    import jax
    jax.monitoring.unregister_event_duration_listener(self._on)


needs_gpu_compiler = pytest.mark.skipif(
    gpu.cuda_plugin() is None,
    reason='JAX\'s CUDA plugin is not installed (pip install -e ".[cuda13]"): no GPU compiler')
TINY = GPTConfig(vocab_size=256, seq_len=64, num_layers=2, num_heads=4, d_model=256)


@pytest.mark.slow
@needs_gpu_compiler
def test_gpu_stage3_one_reading_and_one_compile():
  config = zerojax.ZeroConfig(stage=3, precision=zerojax.Precision(compute="bfloat16"),
                              gather=zerojax.Gather(persistence_threshold=0))
  # The first compile of a process also compiles JAX's own CPU helpers (the model's RNG key).
  memory.compile_for_topology(config, GPT(TINY), (8, 64), "h100:8")
  # The same program again, with the test run's persistent cache on (tests/conftest.py): the
  # first compile stored nothing that this one would fail to load and warn about.
  with CompileCounter() as c, warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    r = memory.compile_for_topology(config, GPT(TINY), (8, 64), "h100:8")
  assert c.names == ["jit(step)"], c.names
  assert not [w for w in caught if "compilation cache" in str(w.message)], [
      str(w.message) for w in caught]
  assert r.measured.collectives["all-gather"] > 0
  assert_one_reading(r)
