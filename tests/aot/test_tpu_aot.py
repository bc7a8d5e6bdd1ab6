"""The real train step compiled ahead of time for a TPU topology (`zerojax compile`).

XLA:TPU shows what the CPU backend cannot: HBM and pinned_host bytes apart, the chip's
capacity (it refuses a step that does not fit) and its own collective schedule. libtpu
(``pip install -e ".[tpu]"``) compiles for a TPU slice on a machine without TPUs; the tests
that compile are skipped only when it is not installed. Each case compiles once (module
fixtures) with a tiny GPT on ``v5e:2x4`` (8 chips).
"""

import importlib.util

import pytest

import zerojax
from zerojax import _compat
from zerojax.runtime import memory
from zerojax.models import GPTConfig

pytestmark = pytest.mark.slow

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason='libtpu is not installed (pip install -e ".[tpu]"): no TPU compiler')

TOPOLOGY = "v5e:2x4"
# d_model 256 keeps every leaf divisible by 8 and the kernels large next to TPU tile padding;
# threshold 0 shards every leaf, so stage 3 shards everything but the step counters.
TINY = GPTConfig(vocab_size=256, seq_len=64, num_layers=2, num_heads=4, d_model=256)
BATCH = (8, 64)


# A vocabulary large next to a device's rows: left to itself, the partitioner computed a
# stage-2 embedding gradient in each device's shard from all-gathered cotangent rows and ids.
LOOKUP = GPTConfig(vocab_size=8192, seq_len=256, num_layers=2, num_heads=4, d_model=256)


def _compile(model_config=TINY, batch=BATCH, **kw):
  from zerojax.models import GPT
  config = zerojax.ZeroConfig.from_flat(dict(param_persistence_threshold=0, **kw))
  return memory.compile_for_topology(config, GPT(model_config), batch, TOPOLOGY)


@pytest.fixture(scope="module")
def stage0():
  return _compile(stage=0)


@pytest.fixture(scope="module")
def stage3():
  return _compile(stage=3)


@pytest.fixture(scope="module")
def stage3_offload():
  return _compile(stage=3, offload_optimizer=True)


@needs_libtpu
def test_tpu_stage3_arguments_are_an_eighth_of_stage0(stage0, stage3):
  assert stage0.fits and stage3.fits
  assert stage0.num_devices == stage3.num_devices == 8
  assert stage0.device_kind == "TPU v5 lite"
  ratio = stage3.measured.argument / stage0.measured.argument
  assert abs(ratio - 1 / 8) < 0.01, ratio
  for r in (stage0, stage3):
    # The compiler's HBM arguments are the plan's bytes up to TPU layout padding.
    est = r.estimate.persistent
    assert abs(r.persistent - est) <= 0.05 * est, (r.persistent, est)
    assert r.host_argument == 0


@needs_libtpu
def test_tpu_offload_moves_optimizer_bytes_from_hbm_to_host(stage3, stage3_offload):
  r, ref = stage3_offload, stage3
  assert r.fits
  drop = ref.measured.argument - r.measured.argument
  # The compiler's own accounting: HBM arguments fall by exactly what host arguments gain.
  assert r.host_argument > 0
  assert drop == r.host_argument - ref.host_argument
  # ... and that is the optimizer state the plan put on the host (TPU pads small arrays).
  assert r.estimate.host == ref.estimate.opt_state > 0
  assert abs(r.host_argument - r.estimate.host) <= 0.03 * r.estimate.host
  # The state goes back to the host: donated host outputs alias the host arguments.
  assert r.host_output == r.host_argument


@needs_libtpu
def test_tpu_collectives_and_schedule(stage0, stage3):
  c0 = stage0.measured.collectives
  p = stage0.estimate.params  # fp32 parameters, replicated at stage 0
  assert c0["all-gather"] == 0 and c0["reduce-scatter"] == 0
  assert 0.95 * 2 * p <= c0["all-reduce"] <= 1.05 * 2 * p  # gradient all-reduce: 2Ψ
  # The per-use schedule (gather='explicit') gathers every parameter and reduce-scatters every
  # gradient; XLA's partitioner, as hand-written FSDP does, may choose otherwise.
  explicit = _compile(stage=3, gather="explicit")
  c3 = explicit.measured.collectives
  # Every parameter gathered in both passes in bf16 (p/2 each). XLA:TPU unrolls this
  # two-layer scan; without a CSE barrier in the rematerialised body it merged backward
  # re-gathers into forward gathers and kept the weights (0.75 x p).
  assert c3["all-gather"] >= 0.95 * p
  assert c3["reduce-scatter"] >= 0.95 * p
  # On an accelerator stage 3 gathers per use by default, decided before compiling: weights
  # move, activations do not, at the textbook volume.
  assert stage3.formulation == explicit.formulation == "per use"
  assert stage3.activations == {}, stage3.activations
  assert stage3.measured.collective_total <= 1.1 * stage3.textbook
  for r in (stage3, explicit):
    g = memory.gather_schedule(r.compiled.as_text())
    assert g.total == r.measured.collectives["all-gather"]  # the reader and the counter agree
    assert g.asynchronous + g.synchronous == g.total
    assert 0 <= g.overlapped <= g.asynchronous


@needs_libtpu
@pytest.mark.parametrize("stage", [1, 2])
def test_tpu_stages_1_2_move_no_activations_at_textbook_volume(stage):
  r = _compile(LOOKUP, (16, 256), stage=stage, compute_dtype="bfloat16")
  assert r.activations == {}, r.activations
  # 2 psi: the gradient reduced in bf16, the updated fp32 parameters gathered
  assert r.measured.collective_total <= 1.1 * r.textbook, (r.measured.collectives, r.textbook)


@needs_libtpu
def test_tpu_refuses_a_step_that_does_not_fit():
  from zerojax.models import GPT
  big = GPTConfig(vocab_size=2**19, seq_len=64, num_layers=1, num_heads=4, d_model=2048)
  r = memory.compile_for_topology(zerojax.ZeroConfig(stage=0), GPT(big), BATCH, TOPOLOGY)
  assert r.measured is None and not r.fits
  assert r.required > r.hbm_available == int(15.75 * 2**30)
  assert r.estimate.persistent > r.hbm_available
  assert "DOES NOT FIT" in r.table()


@needs_libtpu
def test_tpu_hbm_available_is_the_compilers():
  t = memory.tpu_topology("v5p:2x2x1")
  # What the compiler allows one program: 95.74 GiB on libtpu 0.0.42.1, 10.2 MiB less on
  # 0.0.50.1 (jax 0.12.0.1's).
  assert abs(memory.hbm_available(t.devices[0], measure=True) - 95.74 * 2**30) <= 16 * 2**20
  assert memory.HBM_PER_CHIP["v5p"] == 95 * 2**30
  # The figures listed for the installed libtpu (read without a compile) are the compiler's.
  listed = {kind: b for (release, kind), b in memory.USABLE_HBM.items()
            if release == memory._libtpu_version()}
  for name in ("v4:2x2x1", "v5e:2x4", "v5p:2x2x1", "v6e:2x4"):
    d = memory.tpu_topology(name).devices[0]
    if d.device_kind in listed:
      assert memory.hbm_available(d, measure=True) == listed[d.device_kind], name


@needs_libtpu
def test_cli_compile_deepspeed_config(capsys):
  from zerojax.tools import cli
  rc = cli.main(["compile", "configs/ds_zero3_offload.json", "--model", "tiny", "--batch", "32",
                 "--seq", "64", "--topology", TOPOLOGY])
  out = capsys.readouterr().out
  assert rc == 0, out
  for text in ("HBM arguments", "HBM temp", "HBM peak", "host arguments", "FITS",
               "15.75 GiB usable (16.00 GiB per device)", "collectives per step", "compiled ahead"):
    assert text in out
  assert "DeepSpeed" in out  # what each DeepSpeed key became


@pytest.mark.parametrize("name", ["v5x:2x4", "v5e", "v5e:2x", 8, "tpu:v5e:2x4"])
def test_tpu_topology_rejects_bad_names(name):
  with pytest.raises(ValueError, match=r"topology=.*invalid.*v5e:8x8"):
    memory.tpu_topology(name)


def test_tpu_topology_without_libtpu_names_the_extra(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "libtpu" else real(name, *a))
  with pytest.raises(ImportError, match=r'pip install "zerojax\[tpu\]"'):
    memory.tpu_topology("v5e:2x4")


def test_cli_compile_without_libtpu(monkeypatch, capsys):
  from zerojax.tools import cli
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "libtpu" else real(name, *a))
  rc = cli.main(["compile", "--batch", "8", "--seq", "64", "--topology", "v5e:2x4"])
  assert rc == 2
  assert 'pip install "zerojax[tpu]"' in capsys.readouterr().err


@needs_libtpu
def test_tpu_compiler_failure_is_not_a_memory_verdict(monkeypatch, capsys):
  # libtpu 0.0.42.1 stops with an internal RET_CHECK on one 512-chip case (BENCHMARKS.md):
  # that is reported as the compiler's failure, not as "does not fit".
  import jax
  from zerojax.tools import cli

  def fail(self, *a, **k):
    raise jax.errors.JaxRuntimeError("INTERNAL: RET_CHECK failure (target.cc:2892) valid")

  # The chip's HBM is read by compiling a probe, which a real RET_CHECK on one step leaves
  # alone: read it before every compile fails (alone, this test failed on the probe).
  memory.hbm_available(memory.tpu_topology(TOPOLOGY).devices[0])
  monkeypatch.setattr(jax.stages.Lowered, "compile", fail)
  r = _compile(stage=3)
  assert r.compiler_failed and not r.fits and r.required is None
  assert "COMPILER ERROR" in r.table() and "RET_CHECK" in r.table()
  assert "DOES NOT FIT" not in r.table()
  rc = cli.main(["compile", "configs/zero3.json", "--model", "tiny", "--batch", "8", "--seq", "64",
                 "--topology", TOPOLOGY])
  assert rc == 2 and "COMPILER ERROR" in capsys.readouterr().out


@needs_libtpu
def test_tpu_zeropp_collectives_are_int8(stage3):
  """ZeRO++ on the TPU compiler: the forward gathers and the gradient reduction move s8."""
  from zerojax.core.zeropp import GATHER_SCOPE, REDUCE_SCOPE
  r = _compile(stage=3, quantize_weights="int8", quantize_gradients="int8")
  assert r.fits and r.formulation == "per use"
  assert r.activations == {}  # its scales and padded chunks run under zerojax's scopes
  text = r.compiled.as_text()
  fwd = memory.collective_bytes_by_dtype(text, GATHER_SCOPE)
  red = memory.collective_bytes_by_dtype(text, REDUCE_SCOPE)
  assert fwd.get(("all-gather", "s8"), 0) > 0 and red.get(("all-to-all", "s8"), 0) > 0
  assert not any(dt == "f32" and kind == "all-gather" and b > fwd[("all-gather", "s8")] / 32
                 for (kind, dt), b in fwd.items())  # float32 only for the scales
  # Against the unquantised per-use step: the gathered parameters move as int8 (a quarter of
  # their float32 bytes, plus scales and padding) twice, in the forward pass and in the
  # backward pass's re-gather (quantised by default, `ZeroConfig.quantizes_backward`).
  p = stage3.estimate.params * stage3.num_devices  # fp32 bytes of all sharded parameters
  assert 0.95 * 2 * p / 4 <= fwd[("all-gather", "s8")] <= 1.1 * 2 * p / 4


@needs_libtpu
def test_tpu_int4_weights_move_half_and_cost_no_memory():
  """int4 qwZ moves half of int8's bytes, and unpacking costs no more memory than int8: a
  trailing nibble-pair axis used to be padded to TPU tiles (this model: 1051 MiB of temp
  against 7 MiB; the 8192-row embedding is where it showed)."""
  from zerojax.core.zeropp import GATHER_SCOPE
  from zerojax.models import GPT
  cfg = GPTConfig(vocab_size=8192, seq_len=64, num_layers=2, num_heads=8, d_model=512)
  r = {q: memory.compile_for_topology(zerojax.ZeroConfig(stage=3, quantize=zerojax.Quantize(q)),
                                      GPT(cfg), (8, 64), TOPOLOGY) for q in ("int8", "int4")}
  s8 = {q: memory.collective_bytes_by_dtype(x.compiled.as_text(), GATHER_SCOPE)[
      ("all-gather", "s8")] for q, x in r.items()}
  assert 0.45 <= s8["int4"] / s8["int8"] <= 0.55, s8
  assert r["int4"].measured.temp <= r["int8"].measured.temp + 2**20, (
      r["int4"].measured.temp, r["int8"].measured.temp)


@needs_libtpu
def test_tpu_pytree_stage2_drops_the_gradient():
  """Pattern g (tests/model_patterns.py) at full size (a plain-pytree 12-layer MLP reading
  stacked weights as w[i], G = 96 MiB) holds the stage-2 bound on the TPU compiler too (15.5
  MiB of temp at stage 2 against 108.7 at stage 1): the row reads' formulation must suit both
  compilers (an ordering token that fixed a copy on XLA:CPU cost XLA:TPU 46 MiB here)."""
  from tests import model_patterns as pt
  devices = memory.tpu_topology(TOPOLOGY).devices
  temp = {}
  for stage in (1, 2):
    compiled, plan = pt.pytree_compiled(pt.FULL, stage, devices)
    temp[stage] = compiled.memory_analysis().temp_size_in_bytes
  g = sum(lp.nbytes for lp in plan.leaves)
  assert temp[1] >= g  # stage 1 holds the local gradient through the backward pass
  if _compat.JAX_VERSION < (0, 11):
    assert temp[2] <= temp[1] - 0.75 * g * 7 / 8, (temp, g)
  else:
    # libtpu 0.0.50.1 (jax 0.12.0.1) keeps more of the stage-2 gradient: 113.3 MB of temp
    # against stage 1's 163.6 MB, G = 100.8 MB (BENCHMARKS.md, "JAX releases"; open).
    assert temp[2] <= temp[1] - 0.45 * g, (temp, g)


@needs_libtpu
@pytest.mark.parametrize("pattern", ["e", "f", "g", "h"])
def test_tpu_nnx_pytree_and_bypassing_models_move_weights_not_activations(pattern):
  # As on XLA:GPU (test_gpu_aot): NNX, plain-pytree and bypassing linen models gather weights.
  from tests.model_patterns import check_weights_move
  check_weights_move(pattern, memory.tpu_topology(TOPOLOGY).devices)


@needs_libtpu
def test_tpu_pure_function_rows_gather_beside_matmuls():
  # Each row is sliced on each device once its input exists (`Backend.reads_rows_per_device`).
  # Ordered by an optimization barrier over the row's index instead, XLA:TPU put 72% of
  # these all-gather bytes beside a matmul (BENCHMARKS.md); 96% so sliced.
  from tests.model_patterns import FULL, target_zero
  compiled, _, _ = target_zero("g", FULL, 3, memory.tpu_topology(TOPOLOGY).devices)
  assert memory.collective_schedule(compiled.as_text(), "all-gather").matmul_share >= 0.9


@needs_libtpu
@pytest.mark.parametrize("kind, stage, lookup", [("nnx", 2, "index"), ("pure", 3, "index"),
                                                 ("pure", 3, "take")])
def test_tpu_nnx_and_pure_lookups_move_no_activations(kind, stage, lookup):
  # As on XLA:GPU (test_gpu_aot, every kind and spelling at both stages; here 50-66 s a
  # compile, so one each: NNX's stage-2 table boxes, the pure function's stage-3 gathered
  # lookup, and jnp.take's, whose gather sits in a jit of its own).
  from tests.model_patterns import check_lookups_move_weights
  check_lookups_move_weights(kind, stage, memory.tpu_topology(TOPOLOGY).devices, lookup)


@needs_libtpu
@pytest.mark.parametrize("pattern", ["d1", "d2"])
def test_tpu_stage2_tied_heads_move_no_activations(pattern):
  # As on XLA:GPU (test_gpu_aot): each use of a tied table sums its gradient whole, and
  # Embed.attend (d2) reads the table itself (through the lookup's read: 1.11x here).
  from tests.model_patterns import SMALL, target_zero
  compiled, plan, _ = target_zero(pattern, SMALL, 2, memory.tpu_topology(TOPOLOGY).devices)
  hlo = compiled.as_text()
  assert memory.activation_collectives(hlo, plan) == {}, memory.activation_collectives(hlo, plan)
  assert memory.measure(compiled).collective_total <= 1.05 * memory.textbook_bytes(plan)


@needs_libtpu
def test_tpu_stage3_keeps_small_leaves_whole_by_default():
  # Per use on XLA:TPU, leaves under 4096 elements stay replicated by default (the 220M
  # Llama's final norm scale, sharded, cost 178 MiB of temp); on CPU every divisible leaf is
  # sharded; an explicit threshold wins everywhere.
  import math
  import jax
  import jax.numpy as jnp
  import optax
  from zerojax.models import GPT
  from zerojax.checkpoint import abstract_train_state

  def reasons(devices, **kw):
    config = zerojax.ZeroConfig.from_flat(dict(stage=3, **kw))
    mesh = zerojax.make_mesh(config, devices=list(devices))
    _, plan = abstract_train_state(GPT(TINY), optax.adamw(1e-3), jax.random.key(0),
                                   jnp.zeros(BATCH, jnp.int32), config=config, mesh=mesh)
    return {lp.path: lp.reason for lp in plan.leaves if math.prod(lp.shape) < 4096}

  tpu = memory.tpu_topology(TOPOLOGY).devices
  assert reasons(tpu) and set(reasons(tpu).values()) == {"threshold"}
  assert "threshold" not in set(reasons(tpu, param_persistence_threshold=0).values())
  assert "threshold" not in set(reasons(jax.devices("cpu")[:8]).values())


@needs_libtpu
def test_tpu_unscanned_layers_gather_one_ahead(monkeypatch):
  # As on XLA:GPU (test_gpu_aot): pattern d1's layers (no scan, a tied head) gather one matmul
  # layer ahead, forward and backward, so more gathers run beside a matmul, at no more temp.
  # (Before zerojax's whole-model checkpoint stopped being a CSE barrier, XLA:TPU hoisted the
  # gathers further and the temp grew: d1 15.7 -> 29.5 MiB.)
  from tests.model_patterns import FULL, one_ahead_and_not
  (ahead, temp), (own, own_temp) = one_ahead_and_not(
      "d1", FULL, memory.tpu_topology(TOPOLOGY).devices, monkeypatch)
  assert ahead >= own + 0.1, (ahead, own)  # 62% against 43%
  assert temp <= own_temp, (temp, own_temp)  # 15.2 against 16.0 MiB


@needs_libtpu
@pytest.mark.parametrize("remat", ["auto", "full"])
def test_tpu_compiles_host_weights_in_scanned_layers(remat):
  # zerojax's scanned-layer checkpoint is a CSE barrier, except with offload_params: with the
  # weights on the host libtpu 0.0.42.1 failed to compile it ("Fusion must have backend
  # config": test_cli_compile_deepspeed_config) and, with max_live_layers=2, aborted the
  # process in host-offload normalization (both policies here).
  r = _compile(stage=3, offload_params=True, offload_optimizer=True, remat=remat,
               max_live_layers=2, compute_dtype="bfloat16")
  assert r.compiled is not None and r.fits, r.error
  assert r.host_argument > 0


# -- one reading of the bytes, one compile (#53.4, #53.5) ----------------------------------------

# Small enough to compile in seconds, large enough that XLA:TPU makes windowed-einsum loops: a
# one-layer scanned MLP, weights sharded on d_model (hand-written FSDP's rule), batch on the
# mesh. The loops print no trip count (their counter steps by 2) and one all-gather's
# continuation fusions compute inside one of them.
WINDOWED = dict(layers=1, d=512, f=1024, rows=16, seq=1024)


def _windowed_step():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(memory.tpu_topology(TOPOLOGY).devices), ("fsdp",))
  L, d, f, rows, seq = (WINDOWED[k] for k in ("layers", "d", "f", "rows", "seq"))

  def loss(ws, x):
    def layer(h, w):
      return jnp.tanh(h @ w[0].astype(jnp.bfloat16)) @ w[1].astype(jnp.bfloat16), None
    return jnp.mean(jax.lax.scan(layer, x, ws)[0].astype(jnp.float32) ** 2)

  def step(ws, x):
    return jax.tree.map(lambda w, g: w - 0.1 * g, ws, jax.grad(loss)(ws, x))

  w_sh = NamedSharding(mesh, P(None, "fsdp", None))
  x_sh = NamedSharding(mesh, P("fsdp"))
  ws = (jax.ShapeDtypeStruct((L, d, f), jnp.float32, sharding=w_sh),
        jax.ShapeDtypeStruct((L, f, d), jnp.float32, sharding=w_sh))
  x = jax.ShapeDtypeStruct((rows, seq, d), jnp.bfloat16, sharding=x_sh)
  return jax.jit(step, in_shardings=((w_sh, w_sh), x_sh), out_shardings=(w_sh, w_sh)).lower(
      ws, x).compile().as_text()


@needs_libtpu
def test_tpu_windowed_einsum_loops_one_reading():
  text = _windowed_step()
  comps, mult = memory._parse_hlo(text)
  loops = [n for n in comps if "windowed_dot_general_body" in n]
  assert loops, "XLA:TPU made no windowed-einsum loop of this step"
  # An all-gather whose continuation computes inside a windowed loop: its channel sits in
  # the loop body's fusions and in the start and done fusions outside it.
  assert any(" fusion(" in l and "async_collective_fusion" in l for n in loops
             for l in comps[n])
  weight = WINDOWED["d"] * WINDOWED["f"] * 2  # one layer's weight in bf16: 1 MiB
  got = memory.collective_bytes(text)
  # One weight gathered whole once (it was 2 MiB: once per computation holding a copy)
  assert got["all-gather"] == weight
  for kind in ("all-gather", "reduce-scatter"):
    assert memory.collective_schedule(text, kind).total == got[kind], kind
  # Each windowed loop's trip count is read from its counter (it steps by 2), and the loop
  # rings one weight's shards round the mesh: the whole weight a loop.
  for n in loops:
    trips = mult[n] // WINDOWED["layers"]
    assert trips >= 2, n
    per_trip = sum(memory._op_bytes(l) for l in comps[n] if " collective-permute-start(" in l)
    assert per_trip * trips == weight, n
  assert got["collective-permute"] >= len(loops) * weight


@needs_libtpu
def test_tpu_stage3_one_reading(stage3):
  from tests.runtime.test_memory_readings import assert_one_reading
  assert_one_reading(stage3)


@needs_libtpu
def test_tpu_stage3_compiles_once(monkeypatch, stage3):
  """One XLA:TPU compile: the step's. Reading the chip's usable HBM compiled a probe of its
  own once per process (#53.5); the figure is listed for this libtpu."""
  from tests.runtime.test_memory_readings import CompileCounter
  assert (memory._libtpu_version(), stage3.device_kind) in memory.USABLE_HBM
  monkeypatch.setattr(memory, "_AVAILABLE", {})  # as in a fresh process
  with CompileCounter() as c:
    r = _compile(stage=3)
  assert c.names == ["jit(step)"], c.names
  assert r.hbm_available == stage3.hbm_available == int(15.75 * 2**30)
  # the same step as the fixture's compile: memory, bytes and instructions (the module's
  # table of source locations names this test's frames)
  assert r.measured == stage3.measured
  assert _instructions(r.compiled.as_text()) == _instructions(stage3.compiled.as_text())


def _instructions(hlo_text: str) -> list[str]:
  """A compiled module's computations without metadata, nor its source-location tables."""
  import re
  return [re.sub(r", metadata=\{[^}]*\}", "", l) for l in hlo_text.splitlines()
          if l.startswith(("%", "ENTRY", " ", "}"))]
