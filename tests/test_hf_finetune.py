"""Fine-tuning what users bring (#27 items 2-5): segment-aware attention, the checkpoint's own
tokenizer and chat template, local data files (packed or padded, loss masks, per-process rows,
resumable), and ``zerojax finetune``."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax.models import llama


def test_packed_segments_equal_separate_documents():
  """A row packing two documents (segment ids) gives each document the logits it has alone:
  attention stays within a document and positions restart at its start."""
  cfg = llama.LlamaConfig(model_type="qwen2", qkv_bias=True, vocab_size=50)
  model = llama.Llama(cfg, nnx.Rngs(3))
  rs = np.random.RandomState(0)
  a, b = rs.randint(0, 50, (1, 5)), rs.randint(0, 50, (1, 7))
  packed = jnp.asarray(np.concatenate([a, b], axis=1))
  seg = jnp.asarray([[1] * 5 + [2] * 7])
  np.testing.assert_array_equal(llama.segment_positions(seg), [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4,
                                                                5, 6]])
  out = np.asarray(model(packed, segment_ids=seg))
  np.testing.assert_allclose(out[:, :5], np.asarray(model(jnp.asarray(a))), atol=1e-5)
  np.testing.assert_allclose(out[:, 5:], np.asarray(model(jnp.asarray(b))), atol=1e-5)
  # without segment ids the second document would see the first
  assert np.abs(np.asarray(model(packed))[:, 5:] - out[:, 5:]).max() > 1e-3
