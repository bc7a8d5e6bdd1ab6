"""zerojax.core.quantize: block quantisation and its collectives (qwZ all-gather, qgZ reduce-scatter)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from zerojax.core import quantize as q


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("shape, block", [((37, 5), 16), ((3,), 256), ((4, 64), 256),
                                          ((513,), 256)])
def test_round_trip_within_half_a_scale_per_block(dtype, shape, block):
  # (3,): a leaf below the block size; (37, 5) and (513,): sizes that do not divide into blocks.
  x = jnp.asarray(np.random.default_rng(0).standard_normal(shape) * 3, jnp.float32)
  qz = q.quantize(x, dtype, block)
  nb = q.num_blocks(x.size, block)
  per_byte = 2 if dtype == "int4" else 1
  assert qz.values.dtype == jnp.int8 and qz.values.shape == (nb, block // per_byte)
  assert qz.scales.dtype == jnp.float32 and qz.scales.shape == (nb,)
  y = q.dequantize(qz, x.shape, dtype=dtype)
  assert y.shape == x.shape
  err = np.abs(np.asarray(y) - np.asarray(x))
  bound = np.asarray(q.error_bound(x, dtype, block))
  assert np.all(err <= bound * (1 + 1e-6)), (err.max(), bound.max())
  # The bound is tight: round-to-nearest uses it (some element is off by more than a quarter).
  assert err.max() > bound.max() / 4


def test_blocks_and_padding():
  assert (q.num_blocks(3, 256), q.padding(3, 256)) == (1, 253)
  assert (q.num_blocks(512, 256), q.padding(512, 256)) == (2, 0)
  assert (q.num_blocks(513, 256), q.padding(513, 256)) == (3, 255)


def test_zero_blocks_and_extremes_are_exact():
  x = jnp.zeros((300,), jnp.float32).at[5].set(-2.5).at[290].set(7.0)
  for dtype in q.QUANTIZED_DTYPES:
    y = q.dequantize(q.quantize(x, dtype, 256), x.shape, dtype=dtype)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))  # max |x| maps to +-qmax


def test_int4_packs_two_values_per_byte():
  x = jnp.asarray([-7, -1, 0, 1, 3, 7, -4, 2], jnp.float32)
  qz = q.quantize(x, "int4", 8)
  assert qz.values.shape == (1, 4)
  np.testing.assert_array_equal(np.asarray(q.dequantize(qz, x.shape, dtype="int4")), x)


@pytest.mark.parametrize("bad", [dict(dtype="fp8"), dict(block_size=3), dict(block_size=0)])
def test_bad_settings_are_named(bad):
  with pytest.raises(ValueError, match="dtype|block_size"):
    q.quantize(jnp.ones(4), **{"dtype": "int8", "block_size": 256, **bad})


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 4), ("replica", "fsdp"), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather_concatenates_dequantised_shards(mesh, dtype, dim):
  w = jnp.asarray(np.random.default_rng(1).standard_normal((8, 12, 6)), jnp.float32)
  spec = [None, None, None]
  spec[dim] = "fsdp"
  f = jax.shard_map(lambda s: q.all_gather(s, "fsdp", dim, dtype, 16), mesh=mesh,
                    in_specs=P(*spec), out_specs=P(), check_vma=False)
  got = jax.jit(f)(w)
  assert got.shape == w.shape
  # Each shard is blocked on its own: the bound is per shard's blocks.
  shards = np.split(np.asarray(w), 4, axis=dim)
  bound = np.concatenate([np.asarray(q.error_bound(jnp.asarray(s), dtype, 16)) for s in shards],
                         axis=dim)
  assert np.all(np.abs(np.asarray(got) - np.asarray(w)) <= bound * (1 + 1e-6))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter_sums_dequantised_chunks_on_the_owner(mesh, dtype, dim):
  parts = np.random.default_rng(2).standard_normal((4, 8, 12, 6)).astype(np.float32)
  out_spec = [None, None, None]
  out_spec[dim] = "fsdp"
  f = jax.shard_map(lambda x: q.reduce_scatter(x[0], "fsdp", dim, dtype, 16), mesh=mesh,
                    in_specs=P("fsdp"), out_specs=P(*out_spec), check_vma=False)
  got = np.asarray(jax.jit(f)(jnp.asarray(parts)))
  want = parts.sum(0)
  assert got.shape == want.shape
  # Every device's chunk is quantised on its own: the error is at most the sum of their bounds.
  bound = np.zeros_like(want)
  for j in range(4):
    chunks = np.split(parts[j], 4, axis=dim)
    bound += np.concatenate([np.asarray(q.error_bound(jnp.asarray(c), dtype, 16))
                             for c in chunks], axis=dim)
  assert np.all(np.abs(got - want) <= bound * (1 + 1e-5) + 1e-6)
