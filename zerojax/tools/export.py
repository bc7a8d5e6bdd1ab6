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

* ``hf``: a Hugging Face model directory for the shipped Llama-like model
  (`zerojax.models.llama`: Llama, Qwen2, Qwen3, Mistral): ``model.safetensors`` under the
  family's names (layers unstacked, linear weights transposed back to PyTorch's ``(out, in)``,
  LoRA adapters merged into their kernels with the alpha recorded in the checkpoint). It starts
  from the base checkpoint (``--hf-config``: its ``config.json`` or directory): the base's
  ``config.json`` is kept field for field (bos/eos ids, fields zerojax does not model) with only
  the dtype changed, and its ``generation_config.json`` and tokenizer files are copied, so
  ``transformers``' ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer`` load it as
  the base, fine-tuned.

Command line::

  python -m zerojax.tools.export CKPT_DIR OUT [--step N] [--dtype fp32|bf16] [--format npz|safetensors]
  python -m zerojax.tools.export CKPT_DIR OUT_DIR --hf-config BASE/config.json [--lora-alpha A]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import zipfile
from typing import Any, Sequence

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from zerojax.core.plan import path_str
from zerojax.models import llama
from zerojax.runtime import weights
from zerojax.runtime.checkpoint import (STATE_ITEM, CheckpointError, Checkpointer,
                                        numpy_checksum, read_leaf)

DTYPES = {"float32": "float32", "fp32": "float32", "f32": "float32",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
FORMATS = ("npz", "safetensors", "hf")
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
METADATA_KEY = "__metadata__"

__all__ = ["export", "main", "load_npz"]


def _np_dtype(name: str) -> np.dtype:
  if name == "bfloat16":
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


def export(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike, *,
           step: int | None = None, dtype: str = "float32",
           format: str | None = None, hf_config: Any = None,
           lora_alpha: float | None = None) -> dict[str, Any]:  # noqa: A002 - public name
  """Writes a checkpoint's parameters, unsharded, to ``out_path``.

  Args:
    checkpoint_dir: a `zerojax.checkpoint.Checkpointer` directory.
    out_path: the output file (written to a temporary name, then renamed into place).
    step: the step to export; ``None`` is the latest complete checkpoint.
    dtype: ``'float32'`` (``'fp32'``) or ``'bfloat16'`` (``'bf16'``); floating-point leaves
      are cast to it, integer leaves are kept.
    format: ``'npz'``, ``'safetensors'`` or ``'hf'``; ``None`` picks ``hf`` when
      ``hf_config`` is given, ``safetensors`` for a ``.safetensors`` path and ``npz`` otherwise.
    hf_config: for ``'hf'``: the base model's Hugging Face config (``config.json`` or its
      directory, or a dict); ``out_path`` is then the output directory. The export starts
      from the base's own files: its ``config.json`` (every field kept, the dtype set), its
      ``generation_config.json`` and its tokenizer files are copied.
    lora_alpha: for ``'hf'`` with LoRA adapters in the checkpoint: the adapters' alpha
      (merged as ``kernel + lora_a @ lora_b * alpha / rank``). ``None`` uses the alpha the
      checkpoint records (``Checkpointer.save(..., model=llama.checkpoint_model(cfg))``); a
      value that differs from the recorded one is an error.

  Returns:
    a summary: ``{'path', 'step', 'format', 'dtype', 'num_params', 'num_leaves', 'bytes'}``.

  Raises:
    CheckpointNotFoundError: no such directory or step.
    CheckpointError: a leaf cannot be read or its checksum differs from the recorded one.
    ValueError: an unknown ``dtype`` or ``format``.
  """
  out_path = os.fspath(out_path)
  dtype, format = _check_args(out_path, dtype, format, hf_config)  # noqa: A001
  step, where, meta, tree = _read_params_tree(checkpoint_dir, step)
  leaves = _leaves(tree["params"], dtype)
  load = _leaf_loader(where, tree, meta.get("checksums") or {})
  info = {"format": "zerojax-export", "checkpoint": where, "step": step, "dtype": dtype,
          "config": meta.get("config")}
  if format == "hf":
    out = _write_hf(out_path, leaves, load, info, hf_config, lora_alpha, dtype,
                    meta.get("model"))
    return {"path": out_path, "step": step, "format": format, "dtype": dtype,
            "num_params": out["num_params"], "num_leaves": len(leaves), "bytes": out["bytes"],
            "copied": out["copied"], "lora_alpha": out["lora_alpha"]}
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


def _check_args(out_path: str, dtype: str, format: str | None,  # noqa: A002
                hf_config: Any) -> tuple[str, str]:
  """``(dtype, format)`` resolved from `export`'s arguments, or the error naming the bad one."""
  if dtype not in DTYPES:
    raise ValueError(f"export(dtype={dtype!r}) is invalid: allowed are {sorted(DTYPES)}")
  if format is None:
    format = ("hf" if hf_config is not None else  # noqa: A001
              "safetensors" if out_path.endswith(".safetensors") else "npz")
  if format not in FORMATS:
    raise ValueError(f"export(format={format!r}) is invalid: allowed are {FORMATS}")
  if (format == "hf") != (hf_config is not None):
    raise ValueError(f"export(format={format!r}, hf_config={hf_config!r}) is invalid: the "
                     "'hf' format needs hf_config (the model's Hugging Face config.json), and "
                     "hf_config is only used by the 'hf' format")
  return DTYPES[dtype], format


def _read_params_tree(checkpoint_dir: str | os.PathLike, step: int | None
                      ) -> tuple[int, str, dict, Any]:
  """``(step, its directory, its metadata, the state item's tree of leaf metadata)``."""
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
  return step, where, meta, tree


def _leaves(params: Any, dtype: str) -> list[tuple]:
  """``(name, keypath, stored shape, stored dtype, out dtype)`` of each parameter leaf."""
  leaves = []
  for kp, m in jax.tree_util.tree_flatten_with_path(params)[0]:
    sdt = np.dtype(m.dtype)
    odt = _np_dtype(dtype) if np.issubdtype(sdt, np.floating) or sdt.name == "bfloat16" else sdt
    leaves.append((path_str(kp), (jax.tree_util.DictKey("params"),) + tuple(kp),
                   tuple(m.shape), sdt, odt))
  return leaves


def _leaf_loader(where: str, tree: Any, checksums: dict):
  """``load(name, keypath, shape, stored dtype, out dtype) -> array``: one leaf read from the
  checkpoint, checked against its recorded checksum, in the out dtype."""
  item_dir = os.path.join(where, STATE_ITEM)

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
  return load


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


# The tokenizer's files in a Hugging Face model directory (copied unchanged by an export).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json")
_GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def _lora_alpha(adapters, given, model_meta, where) -> float | None:
  """The alpha to merge adapters with: the one recorded with the checkpoint, or ``given``."""
  lora = (model_meta or {}).get("lora") or {}
  recorded = lora.get("alpha")
  if not adapters:
    return None
  if given is None and recorded is None:
    raise ValueError(f"the checkpoint {where!r} has LoRA adapters ({adapters[:3]}...) and "
                     "records no alpha for them: pass lora_alpha (--lora-alpha) to merge them "
                     "into their kernels (save with Checkpointer.save(..., "
                     "model=llama.checkpoint_model(cfg)) to record it)")
  if given is not None and recorded is not None and float(given) != float(recorded):
    raise ValueError(f"lora_alpha={given!r} differs from the alpha {recorded!r} recorded with "
                     f"the adapters in {where!r}: leave lora_alpha out to use the recorded one")
  return float(recorded if given is None else given)


def _write_hf(out_dir, leaves, load, info, hf_config, lora_alpha, dtype, model_meta) -> dict:
  """A Hugging Face model directory from the base's own files: its ``config.json`` (only the
  dtype changed), its ``generation_config.json`` and tokenizer files (copied), and the trained
  tensors (LoRA merged) under the family's names in ``model.safetensors``."""
  base_dir, base, cfg = _read_base(hf_config)
  family = (model_meta or {}).get("family")
  if family is not None and family != cfg.model_type:
    raise ValueError(f"checkpoint {info['checkpoint']!r} records a {family!r} model, but the "
                     f"Hugging Face config {base_dir or 'given'} is model_type "
                     f"{cfg.model_type!r}: pass the base model the run started from")
  where = info["checkpoint"]
  _check_architecture(leaves, cfg, where, base_dir)
  by_path = {leaf[0]: leaf for leaf in leaves}
  adapters = sorted({p.rsplit("/", 1)[0] for p in by_path if p.endswith("/lora_a")})
  alpha = _lora_alpha(adapters, lora_alpha, model_meta, where)
  out = _merged(leaves, load, by_path, adapters, alpha)
  os.makedirs(out_dir, exist_ok=True)
  res = weights.save_hf(out, os.path.join(out_dir, "model.safetensors"), llama.hf_mapping(cfg),
                        metadata={"zerojax": json.dumps(info)})
  # What training changed: the weights, and their dtype. Everything else is the base's.
  config = dict(base)
  config["dtype"] = dtype
  if "torch_dtype" in base:
    config["torch_dtype"] = dtype
  config.setdefault("architectures", llama.hf_config(cfg)["architectures"])
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  copied = _copy_base_files(base_dir, out_dir, base)
  return {"num_params": sum(math.prod(s) for _, _, s, _ in out), "bytes": res["bytes"],
          "copied": copied, "lora_alpha": alpha}


def _read_base(hf_config: Any) -> tuple[str | None, dict, Any]:
  """``(the base's directory or None, a copy of its config.json, its LlamaConfig)``."""
  base_dir = None
  if not isinstance(hf_config, dict):
    p = os.fspath(hf_config)
    if not os.path.exists(p):
      raise FileNotFoundError(f"hf_config {p!r} does not exist (the base model's config.json "
                              "or its directory)")
    base_dir = p if os.path.isdir(p) else os.path.dirname(os.path.abspath(p))
  base = json.loads(json.dumps(llama.read_hf_config(hf_config)))  # a copy
  return base_dir, base, llama.from_hf_config(base)


def _check_architecture(leaves: list[tuple], cfg: Any, where: str, base_dir: str | None) -> None:
  """The checkpoint must be the base's architecture (anything else is a different model)."""
  want = {path_str(kp): tuple(x.shape) for kp, x in jax.tree_util.tree_flatten_with_path(
      nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: llama.Llama(cfg, nnx.Rngs(0))),
                                 nnx.Param)))[0]}
  have = {name: shape for name, _, shape, _, _ in leaves if "/lora_" not in name}
  problems = [f"leaf {n!r} has shape {have[n]}, the base config needs {want[n]}"
              for n in sorted(set(want) & set(have)) if want[n] != have[n]]
  problems += [f"the base config needs leaf {n!r}, which the checkpoint lacks"
               for n in sorted(set(want) - set(have))]
  problems += [f"the checkpoint's leaf {n!r} has no place in the base config's model"
               for n in sorted(set(have) - set(want))]
  if problems:
    raise ValueError(f"checkpoint {where!r} does not match the Hugging Face config "
                     f"{base_dir or 'given'} ({cfg.model_type}): " + "; ".join(problems[:6])
                     + (f"; and {len(problems) - 6} more" if len(problems) > 6 else ""))


def _merged(leaves, load, by_path, adapters, alpha) -> list[tuple]:
  """``(name, read, shape, dtype)`` of each base tensor, LoRA adapters merged into theirs."""
  out = []
  for name, kp, shape, sdt, odt in leaves:
    if "/lora_" in name:
      continue
    base_name = name.rsplit("/", 1)[0]
    if name.endswith("/kernel") and base_name in adapters:
      a, b = by_path[base_name + "/lora_a"], by_path[base_name + "/lora_b"]

      def merged(leaf=(name, kp, shape, sdt, odt), a=a, b=b):
        w = load(*leaf[:4], np.dtype(np.float32))
        la, lb = load(*a[:4], np.dtype(np.float32)), load(*b[:4], np.dtype(np.float32))
        w += np.matmul(la, lb) * (alpha / la.shape[-1])
        return w.astype(leaf[4], copy=False)
      out.append((name, merged, shape, odt))
    else:
      out.append((name, lambda leaf=(name, kp, shape, sdt, odt): load(*leaf), shape, odt))
  return out


def _copy_base_files(base_dir: str | None, out_dir: str, base: dict) -> list[str]:
  """Copies the base's tokenizer and generation config (or derives the latter from its
  config, as transformers does for a checkpoint without one); returns the names copied."""
  copied = []
  if base_dir is not None:
    names = [n for n in TOKENIZER_FILES + ("generation_config.json",)
             if os.path.isfile(os.path.join(base_dir, n))]
    names += sorted(n for n in os.listdir(base_dir) if n.endswith(".tiktoken"))
    for n in names:
      if os.path.abspath(os.path.join(base_dir, n)) != os.path.abspath(os.path.join(out_dir, n)):
        shutil.copyfile(os.path.join(base_dir, n), os.path.join(out_dir, n))
      copied.append(n)
  if "generation_config.json" not in copied:
    gen = {k: base[k] for k in _GENERATION_KEYS if base.get(k) is not None}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
      json.dump({**gen, "_from_model_config": True}, f, indent=2)
  return copied


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
                 help="write a Hugging Face model directory from this base model (its "
                      "config.json or directory): its config, generation config and tokenizer "
                      "files carried over, the trained weights under its names")
  p.add_argument("--lora-alpha", type=float, default=None,
                 help="LoRA alpha to merge adapters with (default: the alpha recorded in the "
                      "checkpoint)")
  args = p.parse_args(argv)
  try:
    info = export(args.checkpoint_dir, args.out, step=args.step, dtype=args.dtype,
                  format=args.format, hf_config=args.hf_config, lora_alpha=args.lora_alpha)
  except (CheckpointError, FileNotFoundError, ValueError) as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 1
  print(f"exported step {info['step']}: {info['num_leaves']} leaves, {info['num_params']:,} "
        f"parameters, {info['dtype']}, {info['format']} -> {info['path']} "
        f"({info['bytes'] / 2**20:.2f} MiB)")
  if info.get("copied"):
    print(f"copied from the base model: {', '.join(info['copied'])}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
