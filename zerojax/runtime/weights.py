"""Existing weights in and out: Hugging Face safetensors read straight into a plan's shards.

`load_safetensors` reads single-file and sharded (``model.safetensors.index.json``) checkpoints.
Every leaf is built with `jax.make_array_from_callback` on the plan's sharding (device or
``pinned_host`` memory): the callback runs once per addressable device and reads only that
device's slice with safetensors' ``safe_open(...).get_slice(...)``, so a process reads only the
bytes its own devices hold and no device or process ever holds a full copy of a sharded leaf.
Each file is opened (memory-mapped) for one tensor at a time, so mapped pages never add up to
more than one tensor.

A **mapping** ``{leaf path: TensorMap}`` names the tensor behind each leaf. ``"{i}"`` in a
name stacks per-layer tensors (``model.layers.{i}.mlp.up_proj.weight``) on the leaf's leading
(scanned layer) axis: a device's shard is assembled from the slices of the layers it covers.
``transpose=True`` reverses the tensor's axes (PyTorch ``Linear`` stores ``(out, in)``, Flax
``(in, out)``). Without a mapping a leaf's tensor is named by its path (``blocks/fc/kernel``,
as `zerojax.tools.export` writes).

`save_hf` writes leaves back under the mapping's names (layers unstacked, transposed back),
one leaf in memory at a time.

Errors are named: `WeightsError` says which leaf, which tensor, which file, and both shapes
(or dtypes) for a mismatch; a tensor the mapping needs that is missing, and a checkpoint
tensor nothing uses (unless ``allow_extra``), are errors too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import jax
import ml_dtypes
import numpy as np

__all__ = ["TensorMap", "WeightsError", "SafetensorsSource", "load_safetensors",
           "safetensors_source", "place", "save_hf", "checkpoint_index"]

from zerojax.core.placement import WeightsError, make_array, place
from zerojax.runtime.extras import require

INDEX_FILE = "model.safetensors.index.json"
_ST_TO_NP = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
             "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
             "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64"}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}


@dataclasses.dataclass(frozen=True)
class TensorMap:
  """Where one parameter leaf lives in a checkpoint.

  Attributes:
    name: the tensor name; with ``"{i}"`` the leaf is stacked over layers on its first axis
      and ``name.format(i=layer)`` names layer ``i``'s tensor.
    transpose: the stored tensor has the leaf's (per-layer) axes reversed (PyTorch linear
      ``(out, in)`` vs Flax ``(in, out)``).
  """

  name: str
  transpose: bool = False

  @property
  def stacked(self) -> bool:
    return "{i}" in self.name

  def names(self, leaf_shape: Sequence[int]) -> list[str]:
    """The stored tensors behind one leaf.

    Args:
      leaf_shape: the leaf's shape (a stacked leaf's first dimension counts its layers).

    Returns:
      Their names: one per layer of a stacked leaf, else ``[name]``.
    """
    return [self.name.format(i=i) for i in range(leaf_shape[0])] if self.stacked else [self.name]

  def tensor_shape(self, leaf_shape: Sequence[int]) -> tuple[int, ...]:
    """The stored shape of one tensor behind a leaf.

    Args:
      leaf_shape: the leaf's shape.

    Returns:
      The tensor's shape, without a stacked leaf's layer dimension, reversed where the
      checkpoint stores it transposed.
    """
    s = tuple(leaf_shape[1:]) if self.stacked else tuple(leaf_shape)
    return s[::-1] if self.transpose else s


def _np_dtype(name: str) -> np.dtype:
  if name == "bfloat16":
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


# -- the checkpoint's tensors ---------------------------------------------------------------------


def _read_header(path: str) -> dict[str, dict]:
  """The safetensors header of ``path``: ``{name: {"dtype", "shape", ...}}`` (no data read)."""
  try:
    with open(path, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(n))
  except (OSError, struct.error, ValueError) as e:
    raise WeightsError(f"{path!r} is not a readable safetensors file: {e}") from e
  header.pop("__metadata__", None)
  return header


def checkpoint_index(paths_or_dir: str | os.PathLike | Sequence[str | os.PathLike]
                     ) -> dict[str, tuple[str, tuple[int, ...], str]]:
  """``{tensor name: (file, shape, dtype name)}`` of a checkpoint, from the headers only.

  Args:
    paths_or_dir: a directory (with ``model.safetensors.index.json``, or its
      ``*.safetensors`` files), one ``.safetensors`` file, an index file, or a list of files.

  Returns:
    ``{tensor name: (file, shape, dtype name)}``.

  Raises:
    WeightsError: a path does not exist or is not a readable safetensors file, a directory
      holds none, an index lacks its ``weight_map`` or names missing files, a tensor is in two
      files, or a tensor's dtype is not supported.
  """
  if isinstance(paths_or_dir, (str, os.PathLike)):
    p = os.fspath(paths_or_dir)
    if os.path.isdir(p):
      idx = os.path.join(p, INDEX_FILE)
      if os.path.exists(idx):
        files = _files_of_index(idx)
      else:
        files = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".safetensors"))
        if not files:
          raise WeightsError(f"checkpoint directory {p!r} holds no {INDEX_FILE} and no "
                             "*.safetensors file")
    elif p.endswith(".json"):
      files = _files_of_index(p)
    elif os.path.exists(p):
      files = [p]
    else:
      raise WeightsError(f"checkpoint {p!r} does not exist")
  else:
    files = [os.fspath(f) for f in paths_or_dir]
  out: dict[str, tuple[str, tuple[int, ...], str]] = {}
  for f in files:
    for name, info in _read_header(f).items():
      if name in out:
        raise WeightsError(f"tensor {name!r} is in two files: {out[name][0]!r} and {f!r}")
      dt = _ST_TO_NP.get(info["dtype"])
      if dt is None:
        raise WeightsError(f"tensor {name!r} in {f!r} has dtype {info['dtype']!r}, which "
                           f"zerojax cannot read (readable: {sorted(_ST_TO_NP)})")
      out[name] = (f, tuple(info["shape"]), dt)
  return out


def _files_of_index(index_path: str) -> list[str]:
  with open(index_path) as f:
    weight_map = json.load(f).get("weight_map")
  if not isinstance(weight_map, dict):
    raise WeightsError(f"{index_path!r} has no 'weight_map' object")
  base = os.path.dirname(index_path)
  files = sorted(set(weight_map.values()))
  missing = [f for f in files if not os.path.exists(os.path.join(base, f))]
  if missing:
    raise WeightsError(f"{index_path!r} names shard files that do not exist: {missing}")
  return [os.path.join(base, f) for f in files]


# Bytes of a stored tensor's rows mapped at once. A shard of columns touches every row's pages,
# so a tensor is read a block of rows at a time, each block's mapping released before the next:
# a process never holds more than this of a file besides its own shard.
_BLOCK_BYTES = 8 << 20


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
  """``np.empty`` on an ``align``-byte boundary: JAX's CPU client can then use the array as the
  device buffer instead of copying it (malloc's large blocks start 16 bytes into a page)."""
  dtype = np.dtype(dtype)
  n = math.prod(shape) * dtype.itemsize
  buf = np.empty(n + align, np.uint8)
  off = (-buf.ctypes.data) % align
  return buf[off:off + n].view(dtype).reshape(shape)


def _read_blocks(file: str, name: str, index: tuple[slice, ...]
                 ) -> Iterator[tuple[int, np.ndarray]]:
  """``(row offset, tensor[index]'s rows from there)``, a block of stored rows at a time."""
  from safetensors import safe_open  # optional: `SafetensorsSource.load` required it
  shape = tuple(_read_header(file)[name]["shape"])
  if not shape:
    with safe_open(file, framework="numpy") as f:
      yield 0, np.asarray(f.get_slice(name)[...])
    return
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  rows = range(shape[0])[index[0]]
  step = max(1, _BLOCK_BYTES // (8 * max(1, math.prod(shape[1:]))))  # 8: the widest dtype
  for b in range(0, len(rows), step):
    r = rows[b:b + step]
    with safe_open(file, framework="numpy") as f:
      yield b, np.asarray(f.get_slice(name)[(slice(r.start, r.stop, r.step),) + index[1:]])


# -- mappings -----------------------------------------------------------------------------------


def _resolve_mapping(mapping: Mapping[str, TensorMap | str] | None, paths: Iterable[str]
                     ) -> dict[str, TensorMap]:
  if mapping is None:
    return {p: TensorMap(p) for p in paths}
  out = {}
  for k, v in mapping.items():
    if isinstance(v, str):
      v = TensorMap(v)
    if not isinstance(v, TensorMap):
      raise TypeError(f"mapping[{k!r}] must be a TensorMap or a tensor name, got {v!r}")
    out[k] = v
  return out


def _allowed(name: str, allow: bool | Sequence[str] | str) -> bool:
  if isinstance(allow, bool):
    return allow
  pats = [allow] if isinstance(allow, str) else list(allow)
  return any(re.search(p, name) for p in pats)


@dataclasses.dataclass(frozen=True)
class _LeafSource:
  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  tmap: TensorMap
  files: tuple[str, ...]  # per stored tensor (one per layer when stacked)

  def read(self, index: tuple[slice, ...]) -> np.ndarray:
    """The leaf's ``[index]`` (a device's shard), read slice by slice."""
    index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
    names = self.tmap.names(self.shape)
    if self.tmap.stacked:
      layers = range(self.shape[0])[index[0]]
      rest = index[1:]
    else:
      layers, rest = [0], index
    tindex = rest[::-1] if self.tmap.transpose else rest
    lead = (len(layers),) if self.tmap.stacked else ()
    out = _aligned_empty(lead + tuple(len(range(n)[i]) for n, i in zip(self.shape[len(lead):],
                                                                       rest)), self.dtype)
    for j, i in enumerate(layers):
      dst = out[j] if self.tmap.stacked else out
      # Each block is cast (and transposed: a stored row is the leaf's last axis) into place.
      for r0, part in _read_blocks(self.files[i], names[i], tindex):
        if part.ndim == 0:
          dst[...] = part
        elif self.tmap.transpose:
          dst[..., r0:r0 + len(part)] = part.transpose()
        else:
          dst[r0:r0 + len(part)] = part
    return out


def _plan_sources(index: dict, leaves: Sequence[tuple[str, tuple[int, ...], np.dtype]],
                  mapping: dict[str, TensorMap], *, allow_extra: bool | Sequence[str],
                  cast: bool, skip: str | None, where: str) -> dict[str, _LeafSource]:
  """Checks every leaf against the checkpoint's headers; returns a reader per loaded leaf."""
  problems, used, out = [], set(), {}
  for path, shape, dtype in leaves:
    if skip is not None and re.search(skip, path):
      continue
    tm = mapping.get(path)
    if tm is None:
      problems.append(f"leaf {path!r} (shape {shape}) has no entry in the name mapping "
                      "(pass skip=... to initialise it from the model instead)")
      continue
    if tm.stacked and not shape:
      problems.append(f"leaf {path!r} is a scalar but its tensor name {tm.name!r} is stacked")
      continue
    files = []
    want = tm.tensor_shape(shape)
    for name in tm.names(shape):
      if name not in index:
        problems.append(f"tensor {name!r} (for leaf {path!r}, shape {want}) is missing from "
                        f"the checkpoint {where}")
        continue
      used.add(name)
      f, tshape, tdt = index[name]
      files.append(f)
      if tshape != want:
        problems.append(f"leaf {path!r}: tensor {name!r} in {f!r} has shape {tshape}, the "
                        f"leaf needs {want}" + (" (transposed from the leaf's axes)"
                                                if tm.transpose else "")
                        + (f" for each of its {shape[0]} layers (leaf shape {shape})"
                           if tm.stacked else ""))
      elif np.dtype(_np_dtype(tdt)) != np.dtype(dtype) and not cast:
        problems.append(f"leaf {path!r}: tensor {name!r} in {f!r} has dtype {tdt}, the "
                        f"leaf is {np.dtype(dtype).name} (pass cast=True to convert)")
    if len(files) == len(tm.names(shape)):
      out[path] = _LeafSource(path, tuple(shape), np.dtype(dtype), tm, tuple(files))
  unmapped_names = [m for p, m in mapping.items() if p not in {l[0] for l in leaves}]
  if unmapped_names:
    problems.append(f"the mapping names leaves the parameters do not have: "
                    f"{sorted(unmapped_names)[:5]}")
  extra = sorted(n for n in index if n not in used and not _allowed(n, allow_extra))
  if extra:
    problems.append(f"{len(extra)} tensors in the checkpoint are not used by any leaf: "
                    f"{extra[:8]}{' ...' if len(extra) > 8 else ''} (pass allow_extra=True, "
                    "or a list of regexes, to ignore them)")
  if problems:
    more = f"; and {len(problems) - 6} more" if len(problems) > 6 else ""
    raise WeightsError(f"checkpoint {where} does not match the parameters ({len(problems)} "
                       "problems; nothing was loaded): " + "; ".join(problems[:6]) + more)
  return out


def _plan_leaves(plan) -> list[tuple[str, tuple[int, ...], np.dtype]]:
  return [(lp.path, tuple(lp.shape), np.dtype(lp.dtype)) for lp in plan.leaves]


def load_safetensors(paths_or_dir: str | os.PathLike | Sequence[str | os.PathLike], plan: Any,
                     mapping: Mapping[str, TensorMap | str] | None = None, *,
                     allow_extra: bool | Sequence[str] = False, cast: bool = False,
                     skip: str | None = None) -> Any:
  """Reads a safetensors checkpoint into ``plan.params``' shardings, shard by shard.

  Args:
    paths_or_dir: a Hugging Face model directory (``model.safetensors`` or sharded with
      ``model.safetensors.index.json``), a file, an index file, or a list of files.
    plan: the `zerojax.ShardingPlan` (its leaves' paths, shapes, dtypes and shardings).
    mapping: ``{leaf path: TensorMap or name}`` (e.g. `zerojax.models.llama.hf_mapping`);
      ``None`` names each tensor by its leaf path.
    allow_extra: ``True`` ignores checkpoint tensors no leaf uses; a list of regexes ignores
      the matching ones; ``False`` (default) makes any unused tensor an error.
    cast: convert tensors whose dtype differs from the leaf's (e.g. a bf16 checkpoint into
      fp32 master parameters); ``False`` makes a dtype difference an error.
    skip: a regex of leaf paths not to load (e.g. ``"lora_"`` adapters): they come back as
      ``jax.ShapeDtypeStruct`` placeholders that `zerojax.create_nnx` and
      `zerojax.create_train_state` initialise from the model.

  Returns:
    A tree shaped like ``plan.params`` of ``jax.Array`` on the plan's shardings.

  Raises:
    WeightsError: a leaf's tensor is missing, has another shape or dtype, a leaf has no
      mapping, or the checkpoint has unused tensors; nothing is loaded then.
    MissingPackageError: the ``safetensors`` package (the ``train`` extra) is not installed.
  """
  return safetensors_source(paths_or_dir, mapping, allow_extra=allow_extra, cast=cast,
                            skip=skip).load(plan)


@dataclasses.dataclass(frozen=True)
class SafetensorsSource:
  """A lazy safetensors checkpoint: nothing is read until `load` gets the plan.

  Pass it as ``params=`` to `zerojax.create_train_state` or `zerojax.create_nnx`: they plan the
  model first, then each leaf is read straight into its shards.

  Attributes:
    paths: the checkpoint, as ``paths_or_dir`` of `load_safetensors`.
    mapping: ``{leaf path: TensorMap or name}``, or ``None`` for names by leaf path.
    allow_extra: which unused checkpoint tensors to ignore (see `load_safetensors`).
    cast: whether to convert tensors whose dtype differs from the leaf's.
    skip: a regex of leaf paths not to load.
  """

  paths: Any
  mapping: Mapping[str, TensorMap | str] | None = None
  allow_extra: bool | Sequence[str] = False
  cast: bool = False
  skip: str | None = None

  def load(self, plan: Any) -> Any:
    """Reads the checkpoint into ``plan.params``' shardings.

    Args:
      plan: the `zerojax.ShardingPlan`.

    Returns:
      The tree of `load_safetensors` for ``plan``.

    Raises:
      WeightsError: as `load_safetensors`.
      MissingPackageError: the ``safetensors`` package is not installed.
    """
    require("safetensors", "reading safetensors weights")  # before any file or device work
    index = checkpoint_index(self.paths)
    where = repr(os.fspath(self.paths) if isinstance(self.paths, (str, os.PathLike))
                 else [os.fspath(p) for p in self.paths])
    leaves = _plan_leaves(plan)
    mapping = _resolve_mapping(self.mapping, [p for p, _, _ in leaves])
    sources = _plan_sources(index, leaves, mapping, allow_extra=self.allow_extra,
                            cast=self.cast, skip=self.skip, where=where)
    shardings = jax.tree.leaves(plan.params)
    treedef = jax.tree.structure(plan.params)
    out = []
    for (path, shape, dtype), sh in zip(leaves, shardings):
      src = sources.get(path)
      if src is None:
        out.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sh))
      else:
        out.append(make_array(src.read, shape, dtype, sh))
    return jax.tree.unflatten(treedef, out)


def safetensors_source(paths_or_dir: Any, mapping: Mapping[str, TensorMap | str] | None = None,
                       *, allow_extra: bool | Sequence[str] = False, cast: bool = False,
                       skip: str | None = None) -> SafetensorsSource:
  """A lazy `SafetensorsSource` for ``params=``; nothing is read until the plan exists.

  Args:
    paths_or_dir: the checkpoint, as in `load_safetensors`.
    mapping: as in `load_safetensors`.
    allow_extra: as in `load_safetensors`.
    cast: as in `load_safetensors`.
    skip: as in `load_safetensors`.

  Returns:
    The `SafetensorsSource`.
  """
  return SafetensorsSource(paths_or_dir, mapping, allow_extra, cast, skip)


# -- in-memory trees ------------------------------------------------------------------------------


def save_hf(leaves: Iterable[tuple[str, Callable[[], np.ndarray], tuple[int, ...], np.dtype]],
            out_path: str | os.PathLike, mapping: Mapping[str, TensorMap | str] | None = None, *,
            metadata: Mapping[str, str] | None = None, skip: str | None = None) -> dict:
  """Writes leaves to one safetensors file under the mapping's names, one leaf in memory at a
  time (stacked leaves are split per layer, transposed leaves transposed back).

  Args:
    leaves: ``(path, load, shape, dtype)`` per leaf; ``load()`` returns the full leaf.
    out_path: the ``.safetensors`` file (written to a temporary name, then renamed).
    mapping: as in `load_safetensors`; ``None`` names tensors by leaf path.
    metadata: string metadata for the header (``{"format": "pt"}`` is always set, as
      ``transformers`` expects).
    skip: a regex of leaf paths not to write (e.g. adapters with no Hugging Face name).

  Returns:
    ``{"path", "num_tensors", "bytes"}``.

  Raises:
    WeightsError: a leaf has no mapping entry or a dtype safetensors cannot store, two leaves
      map to one name, or a loaded leaf has another shape than declared.
    TypeError: a mapping value is neither a `TensorMap` nor a name.
  """
  leaves = [l for l in leaves if skip is None or not re.search(skip, l[0])]
  maps = _resolve_mapping(mapping, [l[0] for l in leaves])
  missing = [l[0] for l in leaves if l[0] not in maps]
  if missing:
    raise WeightsError(f"leaves {missing[:8]} have no entry in the name mapping (pass skip=...)")
  header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
  offset = 0
  for path, _, shape, dtype in leaves:
    tm = maps[path]
    dt = np.dtype(dtype)
    st = _NP_TO_ST.get(dt.name)
    if st is None:
      raise WeightsError(f"leaf {path!r} has dtype {dt.name}, which safetensors cannot store")
    tshape = list(tm.tensor_shape(shape))
    n = math.prod(tshape) * dt.itemsize
    for name in tm.names(shape):
      if name in header:
        raise WeightsError(f"two leaves map to the tensor name {name!r}")
      header[name] = {"dtype": st, "shape": tshape, "data_offsets": [offset, offset + n]}
      offset += n
  hb = json.dumps(header, separators=(",", ":")).encode()
  hb += b" " * (-len(hb) % 8)
  out_path = os.fspath(out_path)
  tmp = out_path + ".tmp"
  try:
    with open(tmp, "wb") as f:
      f.write(struct.pack("<Q", len(hb)))
      f.write(hb)
      for path, load, shape, dtype in leaves:
        tm = maps[path]
        x = np.asarray(load())
        if tuple(x.shape) != tuple(shape):
          raise WeightsError(f"leaf {path!r} was read with shape {x.shape}, expected {shape}")
        for part in (x if tm.stacked else [x]):
          part = part.transpose() if tm.transpose else part
          f.write(np.ascontiguousarray(part).tobytes())
        del x
    os.replace(tmp, out_path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return {"path": out_path, "num_tensors": len(header) - 1, "bytes": os.path.getsize(out_path)}
