"""Export a sharded checkpoint to plain, unsharded parameters (zerojax's ``zero_to_fp32``).

The parameters are read from the checkpoint one leaf at a time into host memory, checked
against the checksums recorded at save time, converted to the output dtype and streamed into
the output file, so peak host memory stays near the size of the largest leaf (well under one
model size) and no device, mesh or training device count is needed.

Formats:

* ``npz``: one ``.npy`` entry per parameter, named by its path (``blocks/fc/kernel``), plus a
  ``__metadata__`` entry (JSON string). NumPy has no bfloat16, so bf16 arrays are stored as
  their ``uint16`` bit patterns; `load_npz` returns them as ``ml_dtypes.bfloat16``.
* ``safetensors``: the standard format (``F32``/``BF16``), readable by ``safetensors``' numpy,
  torch and flax loaders; the same JSON metadata sits in the header's ``__metadata__``.

* ``hf``: a Hugging Face model directory for the shipped Llama (`zerojax.models.llama`):
  ``model.safetensors`` under Hugging Face's names (layers unstacked, linear weights
  transposed back to PyTorch's ``(out, in)``, LoRA adapters merged into their kernels) and
  ``config.json``, which ``transformers``' ``LlamaForCausalLM.from_pretrained`` loads. It needs
  the model's Hugging Face config (``--hf-config``: the base checkpoint's ``config.json``).

Command line::

  python -m zerojax.tools.export CKPT_DIR OUT [--step N] [--dtype fp32|bf16] [--format npz|safetensors]
  python -m zerojax.tools.export CKPT_DIR OUT_DIR --hf-config BASE/config.json [--lora-alpha 16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import zipfile
from typing import Any, Sequence

import numpy as np

DTYPES = {"float32": "float32", "fp32": "float32", "f32": "float32",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
FORMATS = ("npz", "safetensors", "hf")
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
METADATA_KEY = "__metadata__"

__all__ = ["export", "main", "load_npz"]


def _np_dtype(name: str) -> np.dtype:
  if name == "bfloat16":
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


def export(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike, *,
           step: int | None = None, dtype: str = "float32",
           format: str | None = None, hf_config: Any = None,
           lora_alpha: float | None = None) -> dict[str, Any]:  # noqa: A002 - public name
  """Writes a checkpoint's parameters, unsharded, to ``out_path``.

  Args:
    checkpoint_dir: a `zerojax.runtime.checkpoint.Checkpointer` directory.
    out_path: the output file (written to a temporary name, then renamed into place).
    step: the step to export; ``None`` is the latest complete checkpoint.
    dtype: ``'float32'`` (``'fp32'``) or ``'bfloat16'`` (``'bf16'``); floating-point leaves
      are cast to it, integer leaves are kept.
    format: ``'npz'``, ``'safetensors'`` or ``'hf'``; ``None`` picks ``hf`` when
      ``hf_config`` is given, ``safetensors`` for a ``.safetensors`` path and ``npz`` otherwise.
    hf_config: for ``'hf'``: the Llama's Hugging Face config (dict, ``config.json`` or its
      directory); ``out_path`` is then the output directory.
    lora_alpha: for ``'hf'`` with LoRA adapters in the checkpoint: the adapters' alpha
      (merged as ``kernel + lora_a @ lora_b * alpha / rank``); required when adapters exist.

  Returns:
    a summary: ``{'path', 'step', 'format', 'dtype', 'num_params', 'num_leaves', 'bytes'}``.

  Raises:
    CheckpointNotFoundError: no such directory or step.
    CheckpointError: a leaf cannot be read or its checksum differs from the recorded one.
    ValueError: an unknown ``dtype`` or ``format``.
  """
  from zerojax.runtime.checkpoint import (STATE_ITEM, CheckpointError, Checkpointer, numpy_checksum,
                                  read_leaf)
  from zerojax.core.plan import path_str
  import jax

  out_path = os.fspath(out_path)
  if dtype not in DTYPES:
    raise ValueError(f"export(dtype={dtype!r}) is invalid: allowed are {sorted(DTYPES)}")
  dtype = DTYPES[dtype]
  if format is None:
    format = ("hf" if hf_config is not None else  # noqa: A001
              "safetensors" if out_path.endswith(".safetensors") else "npz")
  if format not in FORMATS:
    raise ValueError(f"export(format={format!r}) is invalid: allowed are {FORMATS}")
  if (format == "hf") != (hf_config is not None):
    raise ValueError(f"export(format={format!r}, hf_config={hf_config!r}) is invalid: the "
                     "'hf' format needs hf_config (the model's Hugging Face config.json), and "
                     "hf_config is only used by the 'hf' format")

  ckpt = Checkpointer(checkpoint_dir, read_only=True)
  try:
    step = ckpt._resolve_step(step)
    where = ckpt.step_dir(step)
    meta = ckpt.read_meta(step)
    md = ckpt._mgr.metadata(step).item_metadata[STATE_ITEM]
    tree = md.tree if hasattr(md, "tree") else md
  finally:
    ckpt.close()
  if not isinstance(tree, dict) or "params" not in tree:
    raise CheckpointError(f"checkpoint {where!r} holds no 'params' in its state item "
                          f"(it has {sorted(tree) if isinstance(tree, dict) else type(tree)})")
  item_dir = os.path.join(where, STATE_ITEM)
  leaves = []  # (name, keypath, stored shape, stored dtype, out dtype)
  for kp, m in jax.tree_util.tree_flatten_with_path(tree["params"])[0]:
    sdt = np.dtype(m.dtype)
    odt = _np_dtype(dtype) if np.issubdtype(sdt, np.floating) or sdt.name == "bfloat16" else sdt
    leaves.append((path_str(kp), (jax.tree_util.DictKey("params"),) + tuple(kp),
                   tuple(m.shape), sdt, odt))
  checksums = meta.get("checksums") or {}

  def load(name, kp, shape, sdt, odt) -> np.ndarray:
    try:
      x = read_leaf(item_dir, kp, tree)
    except Exception as e:
      raise CheckpointError(f"checkpoint {where!r}: leaf 'params/{name}' cannot be read "
                            f"(corrupted or truncated?): {type(e).__name__}: {str(e)[:500]}"
                            ) from e
    if x.shape != shape or x.dtype != sdt:
      raise CheckpointError(f"checkpoint {where!r}: leaf 'params/{name}' was read as shape "
                            f"{x.shape} {x.dtype}, its metadata says {shape} {sdt}")
    want = checksums.get(f"params/{name}")
    got = list(numpy_checksum(x))
    if want is None or list(want) != got:
      raise CheckpointError(
          f"checkpoint {where!r} is corrupted: leaf 'params/{name}' read back with checksum "
          f"{got[0]:08x}{got[1]:08x}, but "
          + (f"{want[0]:08x}{want[1]:08x}" if want else "none") + " was recorded when it was saved")
    return x.astype(odt, copy=False) if x.dtype != odt else x

  info = {"format": "zerojax-export", "checkpoint": where, "step": step, "dtype": dtype,
          "config": meta.get("config")}
  if format == "hf":
    out = _write_hf(out_path, leaves, load, info, hf_config, lora_alpha, dtype)
    return {"path": out_path, "step": step, "format": format, "dtype": dtype,
            "num_params": out["num_params"], "num_leaves": len(leaves), "bytes": out["bytes"]}
  tmp = out_path + ".tmp"
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  try:
    if format == "npz":
      _write_npz(tmp, leaves, load, info)
    else:
      _write_safetensors(tmp, leaves, load, info)
    os.replace(tmp, out_path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return {"path": out_path, "step": step, "format": format, "dtype": dtype,
          "num_params": sum(math.prod(s) for _, _, s, _, _ in leaves),
          "num_leaves": len(leaves), "bytes": os.path.getsize(out_path)}


def _write_npz(path, leaves, load, info) -> None:
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
    with zf.open(METADATA_KEY + ".npy", "w") as f:
      np.lib.format.write_array(f, np.asarray(json.dumps(info)), allow_pickle=False)
    for leaf in leaves:
      x = load(*leaf)
      if x.dtype.name == "bfloat16":
        x = x.view(np.uint16)
      with zf.open(leaf[0] + ".npy", "w", force_zip64=True) as f:
        np.lib.format.write_array(f, np.ascontiguousarray(x), allow_pickle=False)
      del x


def _write_safetensors(path, leaves, load, info) -> None:
  header: dict[str, Any] = {METADATA_KEY: {"zerojax": json.dumps(info)}}
  offset = 0
  for name, _, shape, _, odt in leaves:
    n = math.prod(shape) * odt.itemsize
    st = _ST_DTYPES.get(odt.name) or {"int32": "I32", "int64": "I64", "uint32": "U32",
                                      "int8": "I8", "uint8": "U8", "bool": "BOOL",
                                      "float16": "F16", "float64": "F64"}[odt.name]
    header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [offset, offset + n]}
    offset += n
  hb = json.dumps(header, separators=(",", ":")).encode()
  hb += b" " * (-len(hb) % 8)  # align the data section to 8 bytes
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(hb)))
    f.write(hb)
    for leaf in leaves:
      x = load(*leaf)
      f.write(np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<"), copy=False).tobytes())
      del x


def _write_hf(out_dir, leaves, load, info, hf_config, lora_alpha, dtype) -> dict:
  """Hugging Face Llama directory: merged, renamed, transposed tensors and ``config.json``."""
  from zerojax.models import llama
  from zerojax.runtime import weights
  cfg = llama.from_hf_config(hf_config)
  by_path = {leaf[0]: leaf for leaf in leaves}
  adapters = sorted({p.rsplit("/", 1)[0] for p in by_path if p.endswith("/lora_a")})
  if adapters and lora_alpha is None:
    raise ValueError(f"the checkpoint has LoRA adapters ({adapters[:3]}...): pass lora_alpha "
                     "(--lora-alpha) to merge them into their kernels")
  out = []
  for name, kp, shape, sdt, odt in leaves:
    if "/lora_" in name:
      continue
    base = name.rsplit("/", 1)[0]
    if name.endswith("/kernel") and base in adapters:
      a, b = by_path[base + "/lora_a"], by_path[base + "/lora_b"]

      def merged(leaf=(name, kp, shape, sdt, odt), a=a, b=b):
        w = load(*leaf[:4], np.dtype(np.float32))
        la, lb = load(*a[:4], np.dtype(np.float32)), load(*b[:4], np.dtype(np.float32))
        w += np.matmul(la, lb) * (lora_alpha / la.shape[-1])
        return w.astype(leaf[4], copy=False)
      out.append((name, merged, shape, odt))
    else:
      out.append((name, lambda leaf=(name, kp, shape, sdt, odt): load(*leaf), shape, odt))
  os.makedirs(out_dir, exist_ok=True)
  res = weights.save_hf(out, os.path.join(out_dir, "model.safetensors"), llama.hf_mapping(cfg),
                        metadata={"zerojax": json.dumps(info)})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(llama.hf_config(cfg, torch_dtype=dtype), f, indent=2)
  return {"num_params": sum(math.prod(s) for _, _, s, _ in out), "bytes": res["bytes"]}


def load_npz(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
  """Reads an exported ``.npz``: ``({name: array}, metadata)``, with bf16 arrays restored."""
  params, info = {}, {}
  with np.load(os.fspath(path), allow_pickle=False) as z:
    if METADATA_KEY in z.files:
      info = json.loads(str(z[METADATA_KEY]))
    for k in z.files:
      if k != METADATA_KEY:
        params[k] = z[k]
  if info.get("dtype") == "bfloat16":
    bf16 = _np_dtype("bfloat16")
    params = {k: v.view(bf16) if v.dtype == np.uint16 else v for k, v in params.items()}
  return params, info


def main(argv: Sequence[str] | None = None, prog: str = "python -m zerojax.tools.export") -> int:
  """Command line: ``python -m zerojax.tools.export CKPT_DIR OUT [--step N] [--dtype bf16]``.

  ``prog`` is the name usage and error lines show (``zerojax export`` from the console script).
  """
  p = argparse.ArgumentParser(
      prog=prog,
      description="Consolidate a sharded zerojax checkpoint into plain unsharded parameters "
                  "(.npz or .safetensors), on any machine, with no training devices.")
  p.add_argument("checkpoint_dir", help="the Checkpointer directory")
  p.add_argument("out", help="output file (.npz or .safetensors)")
  p.add_argument("--step", type=int, default=None, help="step to export (default: latest)")
  p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                 help="dtype of floating-point parameters (default float32)")
  p.add_argument("--format", default=None, choices=FORMATS,
                 help="output format (default: hf with --hf-config, else from the file "
                      "extension, else npz)")
  p.add_argument("--hf-config", default=None,
                 help="write a Hugging Face Llama directory (model.safetensors + config.json) "
                      "for this config.json (or the base model's directory)")
  p.add_argument("--lora-alpha", type=float, default=None,
                 help="LoRA alpha, to merge adapters into their kernels (with --hf-config)")
  args = p.parse_args(argv)
  from zerojax.runtime.checkpoint import CheckpointError
  try:
    info = export(args.checkpoint_dir, args.out, step=args.step, dtype=args.dtype,
                  format=args.format, hf_config=args.hf_config, lora_alpha=args.lora_alpha)
  except (CheckpointError, FileNotFoundError, ValueError) as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 1
  print(f"exported step {info['step']}: {info['num_leaves']} leaves, {info['num_params']:,} "
        f"parameters, {info['dtype']}, {info['format']} -> {info['path']} "
        f"({info['bytes'] / 2**20:.2f} MiB)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
