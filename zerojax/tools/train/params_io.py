"""Parameters to and from ``.npz`` files and checkpoints: save, infer the model, load into a
plan's shardings.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import zipfile
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from zerojax.core.config import ConfigError
from zerojax.core.plan import path_str
from zerojax.models import GPT, PRESETS
from zerojax.runtime.checkpoint import Checkpointer
from zerojax.runtime.data import VOCAB_SIZE
from zerojax.tools import export
from zerojax.tools.train.metrics import is_main_process

__all__ = ["flat_params", "save_weights", "infer_model", "load_weights"]


def flat_params(params: Any) -> dict[str, Any]:
  """A parameter tree flattened with ``/``-joined keys.

  Args:
    params: the parameter tree.

  Returns:
    ``{'blocks/qkv/kernel': leaf, ...}``.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return {path_str(kp): x for kp, x in flat}


def save_weights(path: str | os.PathLike, params: Any) -> str:
  """Writes parameters to a ``.npz`` keyed by ``/``-joined paths (process 0 only).

  Args:
    path: the ``.npz`` file.
    params: the parameter tree (sharded arrays are gathered).

  Returns:
    ``path`` as a string.
  """
  arrays = {k: np.asarray(jax.device_get(
      multihost_utils.process_allgather(v, tiled=True)
      if jax.process_count() > 1 else v)) for k, v in flat_params(params).items()}
  if is_main_process():
    np.savez(path, **arrays)
  return os.fspath(path)


def _stored_shapes(path: str) -> dict[str, tuple[int, ...]]:
  """``{leaf path: shape}`` of the parameters in a ``.npz`` or a checkpoint directory, read
  from headers and metadata only (no array data)."""
  if os.path.isdir(path):
    ckpt = Checkpointer(path, read_only=True)
    try:
      return {k.removeprefix("params/"): shape for k, (shape, _) in ckpt.stored_leaves().items()
              if k.startswith("params/")}
    finally:
      ckpt.close()
  out = {}
  with zipfile.ZipFile(path) as zf:
    for name in zf.namelist():
      key = name.removesuffix(".npy").removeprefix("params/")
      if key.startswith("__"):  # zerojax.tools.export's __metadata__ entry
        continue
      with zf.open(name) as f:
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        out[key] = tuple(read(f)[0])
  return out


def infer_model(path: str | os.PathLike) -> tuple[str, int]:
  """``(preset, seq_len)`` of the GPT whose weights are at ``path``, from the stored shapes.

  ``path`` is a ``.npz`` or a checkpoint directory. Every parameter must match the preset's
  shape (at vocabulary `zerojax.runtime.data.VOCAB_SIZE`) except the position table's length, which
  gives ``seq_len``.

  Args:
    path: a ``.npz`` of weights or a checkpoint directory.

  Returns:
    ``(preset, seq_len)``.

  Raises:
    ConfigError: naming ``path`` when no preset matches, or when it holds no parameters.
  """
  path = os.fspath(path)
  what = f"checkpoint {path!r}" if os.path.isdir(path) else f"weights file {path!r}"
  stored = _stored_shapes(path)
  if not stored:
    raise ConfigError(f"{what} holds no parameters")
  pos = "wpe/embedding"
  seq_len = stored.get(pos, (None,))[0]
  for name, preset in PRESETS.items():
    mcfg = dataclasses.replace(preset, vocab_size=VOCAB_SIZE, seq_len=seq_len or preset.seq_len)
    tokens = jax.ShapeDtypeStruct((1, mcfg.seq_len), jnp.int32)
    shapes = jax.eval_shape(lambda t: GPT(mcfg).init(jax.random.key(0), t)["params"], tokens)
    want = {k: tuple(x.shape) for k, x in flat_params(shapes).items()}
    if want == stored:
      return name, mcfg.seq_len
  example = next(iter(sorted(stored.items())))
  raise ConfigError(f"cannot tell which model preset {what} holds: its {len(stored)} "
                    f"parameters (e.g. {example[0]!r} {example[1]}) match none of "
                    f"{sorted(PRESETS)}; pass the preset it was trained with (--preset for "
                    "examples/finetune.py, model= for zerojax train)")


def load_weights(path: str | os.PathLike, params: Any, shardings: Any) -> Any:
  """Loads consolidated weights into ``params``' structure, placed with ``shardings``.

  ``path`` is a ``.npz`` (keys are leaf paths, with or without a leading ``params/``) or a
  checkpoint directory, consolidated through ``zerojax.tools.export.export`` into a temporary file.
  Errors name ``path`` (the checkpoint, not the temporary file).

  Args:
    path: a ``.npz`` or a checkpoint directory.
    params: the parameter tree (or its shapes) whose structure the weights fill.
    shardings: the shardings to place each leaf with.

  Returns:
    The loaded parameter tree.

  Raises:
    KeyError: the weights lack parameters of the model.
    ValueError: a weight's shape differs from the model's.
  """
  path = os.fspath(path)
  if os.path.isdir(path):
    with tempfile.TemporaryDirectory(prefix="zerojax_init_") as tmp:
      npz = os.path.join(tmp, "weights.npz")
      export.export(path, npz, dtype="float32", format="npz")
      stored, _ = export.load_npz(npz)
    what = f"checkpoint {path!r}"
  else:
    stored, _ = export.load_npz(path)  # also an exported bf16 .npz (stored as uint16 bits)
    what = f"weights file {path!r}"
  stored = {k.removeprefix("params/"): v for k, v in stored.items()}
  return _place_weights(what, stored, params, shardings)


def _place_weights(what: str, stored: Mapping[str, Any], params: Any, shardings: Any) -> Any:
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  names = list(flat_params(params))
  hint = ("; the weights are of another model: pass the preset they were trained with "
          "(--preset for examples/finetune.py, model= for zerojax train)")
  missing = [n for n in names if n not in stored]
  if missing:
    raise KeyError(f"{what} lacks {len(missing)} parameters, e.g. {missing[0]!r}; "
                   f"it holds {sorted(stored)[:5]}...{hint}")
  out = []
  for name, (_, x), sh in zip(names, flat, jax.tree.leaves(shardings)):
    a = stored[name]
    if tuple(a.shape) != tuple(x.shape):
      raise ValueError(f"{what}: {name!r} has shape {a.shape}, the model needs "
                       f"{x.shape}{hint}")
    out.append(jax.device_put(a.astype(x.dtype), sh))
  return jax.tree_util.tree_unflatten(treedef, out)
