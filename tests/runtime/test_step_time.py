"""The step time predicted from a compiled schedule (`zerojax.runtime.step_time`).

Hand-written modules in XLA:GPU's and XLA:TPU's printed forms check the arithmetic exactly and
run without a GPU compiler; the compiled ones check that XLA:GPU's real output reads the same
(JAX's CUDA plugin, no GPU).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax.runtime import gpu, step_time
from zerojax.runtime.step_time import device_rates, predict_step_time

H100 = device_rates("h100:8")
needs_gpu_compiler = pytest.mark.skipif(
    gpu.cuda_plugin() is None,
    reason='JAX\'s CUDA plugin is not installed (pip install -e ".[cuda13]"): no GPU compiler')

M, K, N = 4096, 8192, 2048
DOT = (f"%dot = bf16[{M},{N}]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, "
       "rhs_contracting_dims={0}")


def _module(body: str, params: str = "", extra: str = "") -> str:
  return (f"HloModule m, is_scheduled=true, num_partitions=8\n\n{extra}\n"
          f"ENTRY %main ({params}) -> f32[] {{\n{body}\n}}\n")


def _dot_module(middle: str = "", before: str = "", after: str = "") -> str:
  return _module(
      f"  %a = bf16[{M},{K}]{{1,0}} parameter(0)\n"
      f"  %b = bf16[{K},{N}]{{1,0}} parameter(1)\n"
      f"  %p = bf16[1024,1024]{{1,0}} parameter(2)\n{before}  {DOT}\n{middle}{after}"
      "  ROOT %c = f32[] constant(0)", "a: bf16[], b: bf16[], p: bf16[]")


GATHERED = 8 * 1024 * 1024 * 2  # bf16[8192,1024]: the all-gather's result
START = ("  %ags = (bf16[1024,1024]{1,0}, bf16[8192,1024]{1,0}) all-gather-start(%p), "
         "channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true, "
         'backend_config={"collective_backend_config":{"is_sync":false}}\n')
DONE = "  %agd = bf16[8192,1024]{1,0} all-gather-done(%ags)\n"


def test_a_matmul_takes_2mnk_flops_at_the_bf16_peak():
  r = predict_step_time(_dot_module(), H100)
  assert r.flops == 2 * M * N * K
  nbytes = 2 * (M * K + K * N + M * N)
  assert r.hbm_bytes == nbytes
  assert r.seconds == pytest.approx(max(2 * M * N * K / 989.4e12, nbytes / 3.35e12))
  assert r.by_kind == {"matmul": pytest.approx(r.seconds)}
  assert r.comm_seconds == r.exposed_comm_seconds == 0


def test_an_all_gather_takes_its_ring_time_over_nvlink():
  ring = 7 / 8 * GATHERED / 450e9
  blocking = _module("  %p = bf16[1024,1024]{1,0} parameter(0)\n"
                     "  %ag = bf16[8192,1024]{1,0} all-gather(%p), channel_id=1, "
                     "replica_groups=[1,8]<=[8], dimensions={0}\n  ROOT %c = f32[] constant(0)",
                     "p: bf16[]")
  r = predict_step_time(blocking, H100)
  assert r.comm_seconds == pytest.approx(ring)
  assert r.exposed_comm_seconds == pytest.approx(ring)  # blocking: all of it exposed
  assert r.seconds == pytest.approx(ring)
  assert r.by_link == {"link": pytest.approx(ring)}


def test_an_all_gather_across_hosts_runs_at_the_network_bandwidth():
  text = _dot_module(before=START, after=DONE).replace("num_partitions=8", "num_partitions=16")
  text = text.replace("replica_groups=[1,8]<=[8]", "replica_groups={{0,8}}")
  r = predict_step_time(text, device_rates("h100:2x8"))
  assert r.by_link == {"network": pytest.approx(1 / 2 * GATHERED / 50e9)}
  # a group within a host stays on NVLink
  r = predict_step_time(text.replace("{{0,8}}", "{{0,1}}"), device_rates("h100:2x8"))
  assert r.by_link == {"link": pytest.approx(1 / 2 * GATHERED / 450e9)}


def test_a_collective_hidden_by_a_matmul_is_not_exposed():
  alone = predict_step_time(_dot_module(), H100).seconds
  ring = 7 / 8 * GATHERED / 450e9
  assert ring < alone  # the matmul is long enough to hide it
  hidden = predict_step_time(_dot_module(before=START, after=DONE), H100)
  assert hidden.exposed_comm_seconds == 0
  assert hidden.comm_seconds == pytest.approx(ring)
  assert hidden.seconds == pytest.approx(alone)
  # the same pair with nothing between start and done waits for all of it
  bare = predict_step_time(_dot_module(after=START + DONE), H100)
  assert bare.exposed_comm_seconds == pytest.approx(ring)
  assert bare.seconds == pytest.approx(alone + ring)
  # XLA:GPU's is_sync pairs block whatever sits between them
  sync = predict_step_time(_dot_module(before=START.replace('"is_sync":false', '"is_sync":true'),
                                       after=DONE), H100)
  assert sync.exposed_comm_seconds == pytest.approx(ring)


def _loop(condition_with_trip: bool) -> str:
  trip = '' if condition_with_trip else ', backend_config={"known_trip_count":{"n":"5"}}'
  extra = (
      f"%body (s: (s32[], bf16[{M},{K}], bf16[{K},{N}])) -> (s32[], bf16[{M},{K}], "
      f"bf16[{K},{N}]) {{\n"
      f"  %s = (s32[], bf16[{M},{K}]{{1,0}}, bf16[{K},{N}]{{1,0}}) parameter(0)\n"
      "  %i = s32[] get-tuple-element(%s), index=0\n"
      f"  %a = bf16[{M},{K}]{{1,0}} get-tuple-element(%s), index=1\n"
      f"  %b = bf16[{K},{N}]{{1,0}} get-tuple-element(%s), index=2\n"
      f"  {DOT}\n  %one = s32[] constant(1)\n  %j = s32[] add(%i, %one)\n"
      f"  ROOT %t = (s32[], bf16[{M},{K}]{{1,0}}, bf16[{K},{N}]{{1,0}}) tuple(%j, %a, %b)\n}}\n\n"
      f"%cond (s: (s32[], bf16[{M},{K}], bf16[{K},{N}])) -> pred[] {{\n"
      f"  %s = (s32[], bf16[{M},{K}]{{1,0}}, bf16[{K},{N}]{{1,0}}) parameter(0)\n"
      "  %i = s32[] get-tuple-element(%s), index=0\n  %n = s32[] constant(5)\n"
      "  ROOT %lt = pred[] compare(%i, %n), direction=LT\n}\n")
  body = (f"  %a = bf16[{M},{K}]{{1,0}} parameter(0)\n  %b = bf16[{K},{N}]{{1,0}} parameter(1)\n"
          "  %zero = s32[] constant(0)\n"
          f"  %init = (s32[], bf16[{M},{K}]{{1,0}}, bf16[{K},{N}]{{1,0}}) tuple(%zero, %a, %b)\n"
          f"  %w = (s32[], bf16[{M},{K}]{{1,0}}, bf16[{K},{N}]{{1,0}}) while(%init), "
          f"condition=%cond, body=%body{trip}\n  ROOT %c = f32[] constant(0)")
  return _module(body, "a: bf16[], b: bf16[]", extra)


@pytest.mark.parametrize("condition_with_trip", [False, True], ids=["known_trip_count", "condition"])
def test_a_loop_body_counts_once_per_trip(condition_with_trip):
  one = predict_step_time(_dot_module(), H100)
  r = predict_step_time(_loop(condition_with_trip), H100)
  assert r.flops == 5 * one.flops
  assert r.by_kind["matmul"] == pytest.approx(5 * one.seconds)
  assert r.unknown_trips == 0


def test_a_gather_issued_for_the_next_iteration_is_carried_across_the_back_edge():
  # The body waits (done) at its top for the gather the previous iteration started before its
  # matmul: the matmul between them (around the back edge) hides it.
  extra = (
      "%body (s: (s32[], bf16[8192,1024], ((bf16[1024,1024]), bf16[8192,1024]))) -> "
      "(s32[], bf16[8192,1024], ((bf16[1024,1024]), bf16[8192,1024])) {\n"
      "  %s = (s32[], bf16[8192,1024]{1,0}, (bf16[1024,1024]{1,0}, bf16[8192,1024]{1,0})) "
      "parameter(0)\n"
      "  %i = s32[] get-tuple-element(%s), index=0\n"
      "  %prev = (bf16[1024,1024]{1,0}, bf16[8192,1024]{1,0}) get-tuple-element(%s), index=2\n"
      "  %agd = bf16[8192,1024]{1,0} all-gather-done(%prev)\n"
      f"  %a = bf16[{M},{K}]{{1,0}} parameter(1)\n  %b = bf16[{K},{N}]{{1,0}} parameter(2)\n"
      "  %p = bf16[1024,1024]{1,0} parameter(3)\n" + START + f"  {DOT}\n"
      "  ROOT %t = (s32[], bf16[8192,1024]{1,0}, (bf16[1024,1024]{1,0}, bf16[8192,1024]{1,0})) "
      "tuple(%i, %agd, %ags)\n}\n")
  body = ("  %init = (s32[]) parameter(0)\n"
          "  %w = (s32[]) while(%init), condition=%cond, body=%body, "
          'backend_config={"known_trip_count":{"n":"4"}}\n  ROOT %c = f32[] constant(0)')
  r = predict_step_time(_module(body, "init: s32[]", extra), H100)
  ring = 7 / 8 * GATHERED / 450e9
  assert r.comm_seconds == pytest.approx(4 * ring)
  assert r.exposed_comm_seconds == 0
  # without the matmul the gather is exposed on every trip after the first
  bare = predict_step_time(_module(body, "init: s32[]", extra.replace(f"  {DOT}\n", "")), H100)
  assert bare.exposed_comm_seconds == pytest.approx(3 * ring)


def test_tokens_per_second_and_mfu():
  r = predict_step_time(_dot_module(), H100, tokens=1000, model_flops=2 * M * N * K * 8)
  assert r.tokens_per_second == pytest.approx(1000 / r.seconds)
  assert r.tokens_per_second_per_device == pytest.approx(1000 / r.seconds / 8)
  assert r.mfu == pytest.approx(2 * M * N * K / r.seconds / 989.4e12)
  assert step_time.model_flops(10, 3, layers=2, heads=4, head_dim=8, seq_len=16) == \
      3 * (60 + 12 * 2 * 4 * 8 * 16)


def test_device_rates_are_the_published_figures():
  assert (H100.peak, H100.hbm_bandwidth, H100.link_bandwidth, H100.network_bandwidth) == (
      989.4e12, 3.35e12, 450e9, 50e9)
  v5e = device_rates("v5e:2x4")
  assert (v5e.peak, v5e.hbm_bandwidth, v5e.link_bandwidth) == (197e12, 819e9, 200e9)
  with pytest.raises(ValueError, match="no published rates"):
    device_rates("v3:2x2")


def test_xla_tpu_async_collective_fusions_pair_by_channel():
  fused = ("%ag_body (p: bf16[1024,1024]) -> bf16[8192,1024] {\n"
           "  %p = bf16[1024,1024]{1,0} parameter(0)\n"
           "  ROOT %ag = bf16[8192,1024]{1,0} all-gather(%p), channel_id=7, "
           "replica_groups=[1,8]<=[8], dimensions={0}\n}\n")
  start = ("  %async-collective-start = bf16[8192,1024]{1,0} fusion(%p), kind=kCustom, "
           "calls=%ag_body\n")
  done = ("  %async-collective-done = bf16[8192,1024]{1,0} fusion(%async-collective-start), "
          "kind=kCustom, calls=%ag_body\n")
  v5e = device_rates("v5e:2x4")
  text = _dot_module(before=start, after=done)
  r = predict_step_time(fused + text.replace("HloModule m, is_scheduled=true, num_partitions=8",
                                             "HloModule m, is_scheduled=true, num_partitions=8\n"),
                        v5e)
  assert r.comm_seconds == pytest.approx(7 / 8 * GATHERED / 200e9)
  assert r.exposed_comm_seconds == 0


def test_an_async_fusion_is_one_fusion_updating_in_place():
  # XLA:GPU from jaxlib 0.11 issues a scan's write of one layer's gradient into the stacked
  # buffer as fusion-start / fusion-done (printed form of jax 0.12.0.1's compile): one fusion
  # that reads and writes the layer, not the stack, twice.
  fused = ("%fused_dus (p0: f32[12,256,8192], p1: f32[256,8192], p2: s32[]) -> "
           "f32[12,256,8192] {\n"
           "  %p0 = f32[12,256,8192]{2,1,0} parameter(0)\n"
           "  %p1 = f32[256,8192]{1,0} parameter(1)\n"
           "  %b = f32[1,256,8192]{2,1,0} bitcast(%p1)\n"
           "  %p2 = s32[] parameter(2)\n  %z = s32[] constant(0)\n"
           "  ROOT %dus = f32[12,256,8192]{2,1,0} dynamic-update-slice(%p0, %b, %p2, %z, %z)\n"
           "}\n")
  body = ("  %s = f32[12,256,8192]{2,1,0} parameter(0)\n"
          "  %g = f32[256,8192]{1,0} parameter(1)\n  %i = s32[] parameter(2)\n"
          "  %fs = ((f32[12,256,8192]{2,1,0}, f32[256,8192]{1,0}, s32[]), "
          "f32[12,256,8192]{2,1,0}, u32[]) fusion-start(%s, %g, %i), kind=kLoop, "
          "calls=%fused_dus\n"
          "  %fd = f32[12,256,8192]{2,1,0} fusion-done(%fs)\n  ROOT %c = f32[] constant(0)")
  text = _module(body, "s: f32[], g: f32[], i: s32[]", fused)
  r = predict_step_time(text, H100)
  layer = 256 * 8192 * 4
  assert r.hbm_bytes == 2 * layer + 4  # the layer read and written, and the index
  assert r.seconds == pytest.approx(r.hbm_bytes / 3.35e12)
  assert [c.name for c in step_time.op_costs(text, H100)] == ["fs"]


# -- compiled by XLA:GPU --------------------------------------------------------------------------


def _mesh(n=8):
  from jax.sharding import Mesh
  return Mesh(np.array(list(gpu.gpu_topology(f"h100:{n}").devices)), ("d",))


@needs_gpu_compiler
def test_compiled_matmul_reads_2mnk_flops():
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = _mesh()
  rep = NamedSharding(mesh, P())
  a = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=rep)
  b = jax.ShapeDtypeStruct((K, N), jnp.bfloat16, sharding=rep)
  text = jax.jit(lambda a, b: a @ b).lower(a, b).compile().as_text()
  r = predict_step_time(text, "h100:8")
  assert r.flops == 2 * M * N * K
  assert r.num_devices == 8 and r.comm_seconds == 0
  assert r.seconds >= 2 * M * N * K / 989.4e12


@needs_gpu_compiler
def test_compiled_all_gather_takes_its_ring_time():
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = _mesh()
  w = jax.ShapeDtypeStruct((8192, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("d")))
  f = jax.jit(lambda w: jnp.tanh(jax.lax.with_sharding_constraint(
      w, NamedSharding(mesh, P()))).sum())
  r = predict_step_time(f.lower(w).compile().as_text(), "h100:8")
  assert r.comm_seconds == pytest.approx(7 / 8 * GATHERED / 450e9)
  assert r.exposed_comm_seconds == pytest.approx(r.comm_seconds)  # nothing to hide behind


@needs_gpu_compiler
def test_compile_for_topology_predicts_the_step():
  import zerojax
  from zerojax.models import GPT, GPTConfig
  from zerojax.runtime import memory
  cfg = GPTConfig(vocab_size=256, seq_len=64, num_layers=2, num_heads=4, d_model=256)
  r = memory.compile_for_topology(zerojax.ZeroConfig(
                                      stage=3, precision=zerojax.Precision(compute="bfloat16")),
                                  GPT(cfg), (8, 64), "h100:8",
                                  predictor=step_time.predict_compiled)
  st = r.step_time
  assert st.tokens == 8 * 64 and st.num_devices == 8
  assert st.seconds == pytest.approx(st.compute_seconds + st.exposed_comm_seconds)
  assert 0 < st.exposed_comm_seconds <= st.comm_seconds
  # model FLOPs: 6N per token plus attention over 2 layers x 4 heads x 64 dims x 64 tokens
  assert st.model_flops == st.tokens * (6 * cfg.num_params() + 12 * 2 * 4 * 64 * 64)
  assert "predicted step" in r.table() and "exposed" in r.table()
  assert r.step_time_ceiling.seconds >= st.seconds  # matmuls below their peak
