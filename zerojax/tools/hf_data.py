"""A Hugging Face checkpoint's own tokenizer and the user's local data, as training batches.

* `load_tokenizer`: the checkpoint directory's ``tokenizer.json`` through ``tokenizers`` (its
  ``tokenizer_config.json`` gives the special tokens and the chat template), or
  ``transformers.AutoTokenizer`` offline when there is no ``tokenizer.json``.
* `read_documents`: JSONL (``{"text": ...}``, chat ``{"messages": [{"role", "content"}]}`` or
  ShareGPT ``{"conversations": [{"from", "value"}]}``), Parquet (the same columns) and plain
  text (documents separated by a blank line).
* `ChatTemplate`: the checkpoint's chat template rendered as transformers'
  ``tokenizer.apply_chat_template`` renders it (a sandboxed jinja2 environment with
  ``raise_exception`` and ``strftime_now``, ``tools``/``documents`` None, the
  ``{% generation %}`` block); an error names the template's file and line and the record.
* `tokenize_documents`: ids and a loss mask per document (for chat: the assistant's tokens
  only: the template's ``{% generation %}`` spans where it has them, as transformers'
  ``return_assistant_tokens_mask``, else found through the rendered template's character
  offsets).
* `pack` / `pad`: rows of ``seq_len`` next-token pairs with segment ids (a packed row's
  documents do not see each other; `zerojax.models.llama.Llama` reads ``segment_ids``) and
  positions, or one document per row.
* `Batches`: global batches, shuffled per epoch by ``grain`` (``grain.MapDataset``): batch ``i``
  depends only on ``(seed, i)``, so a checkpoint stores ``step`` and a restart resumes at the
  exact position; each process builds only its own rows of each batch.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import sys
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from zerojax.runtime.data import process_rows
from zerojax.runtime.extras import require

__all__ = ["Tokenizer", "ChatTemplate", "load_tokenizer", "read_documents", "Documents",
           "tokenize_documents", "Rows", "pack", "pad", "build_rows", "Batches", "eval_batches",
           "loss_norm", "SHAREGPT_ROLES", "packages"]

FIELDS = ("x", "y", "mask", "segment_ids", "positions")

# What each reader imports, with why, as `zerojax.runtime.extras.require` takes it: the readers
# and `packages` (the check before a run starts) share them.
_BATCH_ORDER = ("grain", "the shuffled, resumable batch order")
_PARQUET = ("pyarrow.parquet", "reading Parquet data")


def _tokenizer_package(model_dir: str) -> tuple[str, str]:
  """What reads ``model_dir``'s tokenizer: ``tokenizers`` where it has a ``tokenizer.json``,
  else ``transformers`` (e.g. a SentencePiece model only)."""
  if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
    return "tokenizers", "the checkpoint's tokenizer.json"
  return "transformers", "a checkpoint without tokenizer.json"


def _extension(path: str) -> str:
  return os.path.splitext(path)[1].lower()


def packages(model_dir: str, data: Sequence[str | None]) -> dict[str, str]:
  """The packages that tokenizing ``model_dir``'s way and reading and batching ``data`` need.

  Args:
    model_dir: a Hugging Face checkpoint directory.
    data: the data files (``None`` entries are skipped).

  Returns:
    ``{top-level module: what needs it}``, as `zerojax.runtime.extras.check` takes it.
  """
  needs = dict([_tokenizer_package(model_dir), _BATCH_ORDER])
  if any(f is not None and _extension(os.fspath(f)) == ".parquet" for f in data):
    needs[_PARQUET[0].split(".")[0]] = _PARQUET[1]
  return needs


def _token_text(v: Any) -> str | None:
  return v.get("content") if isinstance(v, dict) else v


class TemplateRenderError(ValueError):
  """A chat template failed: names its file and line, and the record being rendered."""


@dataclasses.dataclass(frozen=True)
class Rendered:
  """A rendered conversation: its text and the ``(start, end)`` character spans of its
  ``{% generation %}`` blocks (empty where the template has none)."""

  text: str
  generation: tuple[tuple[int, int], ...] = ()


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _environment():
  """A sandboxed jinja2 environment as transformers' ``apply_chat_template`` builds it: blocks
  trimmed, ``loopcontrols``, a ``tojson`` that keeps non-ASCII characters and takes
  ``indent``/``separators``/``sort_keys``, the globals ``raise_exception`` and
  ``strftime_now`` (today's date, as a Llama 3.1 template prints it), and the
  ``{% generation %}`` block, whose output spans are recorded in ``env.zerojax_spans``."""
  jinja2 = require("jinja2", "a chat template")
  from jinja2 import nodes
  from jinja2.ext import Extension
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body and records where it lands
    in the output (the chunks yielded so far, `ChatTemplate.render` counts them)."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
      out = caller()
      rec = self.environment.zerojax_spans
      if rec is not None:
        start = rec["emitted"]()
        rec["spans"].append((start, start + len(out)))
      return out

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, "jinja2.ext.loopcontrols"])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  env.zerojax_spans = None
  return env


def _template_line(tb) -> int | None:
  """The template line of the innermost template frame in a traceback (jinja2 maps its
  generated code's frames to ``<template>`` lines)."""
  line = None
  while tb is not None:
    if tb.tb_frame.f_code.co_filename == "<template>":
      line = tb.tb_lineno
    tb = tb.tb_next
  return line


class ChatTemplate:
  """A checkpoint's chat template, compiled once, rendered as transformers renders it.

  Args:
    source: the template text.
    where: the file it came from (``tokenizer_config.json``, ``chat_template.jinja``), for
      error messages.
    special: the tokenizer's special tokens (``bos_token``, ``eos_token``, ...), passed to
      the template as transformers passes its ``special_tokens_map``.
  """

  def __init__(self, source: str, where: str, special: dict[str, str | None]):
    jinja2 = require("jinja2", "a chat template")
    self.source, self.where = source, where
    self.special = {k: v for k, v in special.items() if v is not None}
    self.has_generation = bool(_GENERATION_TAG.search(source))
    self._env = _environment()
    self._template_error = jinja2.exceptions.TemplateError  # render's, once per record
    try:
      self._template = self._env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
      raise TemplateRenderError(f"chat template in {where}, line {e.lineno}: {e.message} "
                                "(a jinja2 syntax error)") from None

  def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False,
             tools: Any = None, documents: Any = None, record: str = "") -> Rendered:
    """Renders ``messages`` (keys whose value is None dropped, as transformers drops them).

    Args:
      messages: ``[{"role", "content", ...}]``.
      add_generation_prompt: as ``apply_chat_template``'s.
      tools: as ``apply_chat_template``'s.
      documents: as ``apply_chat_template``'s.
      record: where the conversation comes from (``file:line``), for error messages.

    Returns:
      The `Rendered` text and its ``{% generation %}`` spans.

    Raises:
      TemplateRenderError: the template raised (``raise_exception``) or failed; the message
        names the template's file and line and the record.
    """
    msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
    chunks: list[str] = []
    rec = {"spans": [], "emitted": lambda: sum(map(len, chunks))}
    self._env.zerojax_spans = rec
    try:
      for chunk in self._template.generate(
          messages=msgs, tools=tools, documents=documents,
          add_generation_prompt=add_generation_prompt, **self.special):
        chunks.append(chunk)
    except self._template_error as e:
      line = _template_line(sys.exc_info()[2])
      at = f", line {line}" if line is not None else ""
      raise TemplateRenderError(f"{record or 'a record'}: the chat template in {self.where}"
                                f"{at} failed: {e}") from None
    finally:
      self._env.zerojax_spans = None
    return Rendered("".join(chunks), tuple(rec["spans"]))

  def roles(self) -> set[str]:
    """The roles the template names.

    Returns:
      The quoted words of the template (``'ipython'``, ``"tool"``, ...).
    """
    return set(re.findall(r"""['"]([A-Za-z_][\w-]*)['"]""", self.source))


class Tokenizer:
  """The few things training needs from a tokenizer.

  These are ``encode`` (ids and character offsets), ``eos_id``, ``pad_id`` and ``render_chat``
  (the checkpoint's chat template). It reads ``tokenizer.json`` with ``tokenizers``, else the
  directory with ``transformers.AutoTokenizer`` offline.

  Args:
    model_dir: the checkpoint directory.

  Attributes:
    dir: the checkpoint directory.
    chat_template: the chat template text, or ``None``.
    special: the special tokens' texts (``bos_token``, ``eos_token``, ``pad_token``,
      ``unk_token``).
    vocab_size: the tokenizer's vocabulary size.
    eos_id: the end-of-sequence id (from the config files where the tokenizer has none), or
      ``None``.
    pad_id: the padding id: the pad token's, else ``eos_id``, else 0.

  Raises:
    ValueError: without ``tokenizer.json``, ``transformers`` cannot read the directory
      offline.
  """

  def __init__(self, model_dir: str | os.PathLike):
    self.dir = os.fspath(model_dir)
    cfg_path = os.path.join(self.dir, "tokenizer_config.json")
    cfg = {}
    if os.path.isfile(cfg_path):
      with open(cfg_path) as f:
        cfg = json.load(f)
    self.chat_template = cfg.get("chat_template")
    self.template_file = cfg_path
    tj = os.path.join(self.dir, "chat_template.jinja")
    if self.chat_template is None and os.path.isfile(tj):
      with open(tj) as f:
        self.chat_template = f.read()
      self.template_file = tj
    if isinstance(self.chat_template, list):  # named templates: transformers uses "default"
      named = {t.get("name"): t.get("template") for t in self.chat_template
               if isinstance(t, dict)}
      self.chat_template = named.get("default")
    self.special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token",
                                                         "pad_token", "unk_token")}
    self._tok = self._hf = None
    module, what = _tokenizer_package(self.dir)
    if module == "tokenizers":
      self._tok = require(module, what).Tokenizer.from_file(
          os.path.join(self.dir, "tokenizer.json"))
      self.vocab_size = self._tok.get_vocab_size()
      ids = {k: (self._tok.token_to_id(v) if v else None) for k, v in self.special.items()}
    else:  # e.g. a SentencePiece model only: transformers reads it, offline
      transformers = require(module, what)
      try:
        self._hf = transformers.AutoTokenizer.from_pretrained(self.dir, local_files_only=True)
      except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: {self.dir!r} has no tokenizer.json and "
                         f"transformers.AutoTokenizer cannot read it offline ({e}); a "
                         "checkpoint directory with its tokenizer files is needed") from None
      self.vocab_size = len(self._hf)
      self.chat_template = self.chat_template or getattr(self._hf, "chat_template", None)
      ids = {k: getattr(self._hf, k.replace("token", "token_id"), None) for k in self.special}
      self.special = {k: getattr(self._hf, k, None) for k in self.special}
    self.eos_id = ids["eos_token"]
    if self.eos_id is None:
      self.eos_id = _config_eos(self.dir)
    self.pad_id = ids["pad_token"] if ids["pad_token"] is not None else self.eos_id
    if self.pad_id is None:
      self.pad_id = 0
    self._template = None

  def encode(self, text: str, special: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and each token's character span.

    Args:
      text: the text to encode.
      special: add the tokenizer's own added tokens (e.g. a BOS), as ``from_pretrained``
        adds them.

    Returns:
      ``(ids, offsets)``: the token ids and each token's ``(start, end)`` character span.

    Raises:
      ValueError: a slow (Python) tokenizer, which gives no character offsets.
    """
    if self._tok is not None:
      enc = self._tok.encode(text, add_special_tokens=special)
      return list(enc.ids), list(enc.offsets)
    if not getattr(self._hf, "is_fast", False):
      raise ValueError(f"tokenizer in {self.dir!r} is a slow (Python) tokenizer; character "
                       "offsets need a fast one (a tokenizer.json)")
    enc = self._hf(text, add_special_tokens=special, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

  def decode(self, ids: Sequence[int]) -> str:
    """The text of token ids, special tokens included.

    Args:
      ids: token ids.

    Returns:
      The decoded text.
    """
    return (self._tok.decode(list(ids), skip_special_tokens=False) if self._tok is not None
            else self._hf.decode(list(ids)))

  @property
  def template(self) -> ChatTemplate:
    """The checkpoint's `ChatTemplate` (compiled on first use).

    Raises:
      ValueError: the checkpoint has no chat template.
      TemplateRenderError: the template is not valid jinja2.
    """
    if not self.chat_template:
      raise ValueError(f"tokenizer in {self.dir!r} has no chat_template (tokenizer_config.json "
                       "or chat_template.jinja); chat data {\"messages\": [...]} needs one, or "
                       "give the data as {\"text\": ...}")
    if self._template is None:
      self._template = ChatTemplate(self.chat_template, self.template_file, self.special)
    return self._template

  def render_chat(self, messages: list[dict], add_generation_prompt: bool = False,
                  record: str = "") -> str:
    """The chat template applied to ``messages``.

    Rendered as transformers' ``apply_chat_template(..., tokenize=False)`` renders it.

    Args:
      messages: ``[{"role", "content", ...}]``.
      add_generation_prompt: end with the prompt for the assistant's next turn.
      record: where the conversation comes from, for errors.

    Returns:
      The rendered text.

    Raises:
      ValueError: the checkpoint has no chat template.
      TemplateRenderError: the template failed on ``messages``.
    """
    return self.template.render(messages, add_generation_prompt=add_generation_prompt,
                                record=record).text


def _config_eos(model_dir: str) -> int | None:
  for name in ("generation_config.json", "config.json"):
    p = os.path.join(model_dir, name)
    if os.path.isfile(p):
      with open(p) as f:
        e = json.load(f).get("eos_token_id")
      if isinstance(e, list):
        e = e[0] if e else None
      if e is not None:
        return int(e)
  return None


def load_tokenizer(model_dir: str | os.PathLike) -> Tokenizer:
  """The checkpoint directory's own tokenizer (nothing is downloaded).

  Args:
    model_dir: the Hugging Face checkpoint directory.

  Returns:
    Its `Tokenizer`.

  Raises:
    FileNotFoundError: ``model_dir`` is not a directory.
    ValueError: the directory's tokenizer cannot be read offline.
  """
  if not os.path.isdir(model_dir):
    raise FileNotFoundError(f"tokenizer: model directory {os.fspath(model_dir)!r} does not exist")
  return Tokenizer(model_dir)


# -- documents --------------------------------------------------------------------------------


# ShareGPT's speakers ("from") and the roles chat templates know them by.
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user",
                  "assistant": "assistant", "tool": "tool", "function_call": "assistant",
                  "observation": "tool"}
_RECORD_FIELDS = ("text", "messages", "conversations")


class Documents(list):
  """The list of documents `read_documents` returns, with where each came from.

  Args:
    docs: the documents.
    where: per document, its ``file:line`` (or ``file row n``).

  Attributes:
    where: ``where[i]`` is document ``i``'s ``file:line`` (or ``file row n``).
  """

  def __init__(self, docs=(), where=()):
    super().__init__(docs)
    self.where = list(where)


def _sharegpt(conv: Any, where: str) -> list[dict]:
  """A ShareGPT ``conversations`` list as ``messages`` (``from`` -> role, ``value`` ->
  content); a speaker ShareGPT does not have is refused by name."""
  if not isinstance(conv, (list, tuple)) or not conv:
    raise ValueError(f"{where}: field 'conversations'={conv!r:.60} is invalid: a non-empty list "
                     "of {'from': ..., 'value': ...} (ShareGPT)")
  out = []
  for i, t in enumerate(conv):
    if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(
        t.get("value"), str):
      raise ValueError(f"{where}: field 'conversations[{i}]'={t!r:.80} is invalid: a dict with "
                       "a string 'from' (system, human, gpt) and a string 'value' (ShareGPT)")
    role = SHAREGPT_ROLES.get(t["from"])
    if role is None:
      raise ValueError(f"{where}: field 'conversations[{i}].from'={t['from']!r} is an unknown "
                       f"ShareGPT speaker: allowed are {sorted(SHAREGPT_ROLES)} (human -> user, "
                       "gpt -> assistant)")
    out.append({"role": role, "content": t["value"]})
  return out


def _check_doc(doc: Any, where: str) -> dict:
  if not isinstance(doc, dict) or sum(k in doc for k in _RECORD_FIELDS) != 1:
    keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
    raise ValueError(f"{where}: a record needs exactly one of the fields 'text' (a string), "
                     "'messages' (a list of {'role', 'content'}) or 'conversations' (ShareGPT: "
                     f"a list of {{'from', 'value'}}); got {keys}")
  if "conversations" in doc:
    return {"messages": _sharegpt(doc["conversations"], where)}
  if "text" in doc:
    if not isinstance(doc["text"], str):
      raise ValueError(f"{where}: field 'text'={doc['text']!r:.60} is invalid: a string")
    return {"text": doc["text"]}
  msgs = doc["messages"]
  if not isinstance(msgs, (list, tuple)) or not msgs:
    raise ValueError(f"{where}: field 'messages'={msgs!r:.60} is invalid: a non-empty list "
                     "of {'role': ..., 'content': ...}")
  out = []
  for i, m in enumerate(msgs):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
        m.get("content"), str):
      raise ValueError(f"{where}: field 'messages[{i}]'={m!r:.80} is invalid: a dict with a "
                       "string 'role' (system, user, assistant, ...) and a string 'content'")
    out.append({"role": m["role"], "content": m["content"]})
  return {"messages": out}


def read_documents(path: str | os.PathLike) -> list[dict]:
  """The documents of a local data file: ``.jsonl``/``.json`` (one JSON object per line),
  ``.parquet`` (a ``text`` or ``messages`` column) or ``.txt`` (documents separated by a
  blank line). Each is ``{"text": str}`` or ``{"messages": [{"role", "content"}, ...]}``.

  Args:
    path: the data file.

  Returns:
    A `Documents` list of those dicts (ShareGPT ``conversations`` become ``messages``).

  Raises:
    FileNotFoundError: ``path`` is not a file.
    ValueError: a line is not a JSON object or not a valid document, a Parquet file lacks
      exactly one of the text or messages columns, the extension is not read, or the file
      holds no documents.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data file {path!r} does not exist")
  ext = _extension(path)
  docs = Documents()
  if ext in (".jsonl", ".json"):
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          rec = json.loads(line)
        except ValueError as e:
          raise ValueError(f"{path}:{n}: not a JSON object ({e}); JSONL data has one "
                           "object per line") from None
        docs.append(_check_doc(rec, f"{path}:{n}"))
        docs.where.append(f"{path}:{n}")
  elif ext == ".parquet":
    pq = require(*_PARQUET)
    table = pq.read_table(path)
    cols = [c for c in _RECORD_FIELDS if c in table.column_names]
    if len(cols) != 1:
      raise ValueError(f"{path}: a Parquet file needs exactly one of the columns 'text', "
                       f"'messages' or 'conversations'; it has {table.column_names}")
    for n, v in enumerate(table.column(cols[0]).to_pylist()):
      docs.append(_check_doc({cols[0]: v}, f"{path} row {n}"))
      docs.where.append(f"{path} row {n}")
  elif ext in (".txt", ".text", ".md"):
    with open(path, encoding="utf-8") as f:
      text = f.read()
    parts = [d.strip("\n") for d in text.split("\n\n") if d.strip()]
    docs = Documents([{"text": d} for d in parts],
                     [f"{path} document {i}" for i in range(len(parts))])
  else:
    raise ValueError(f"data file {path!r}: extension {ext!r} is not read; allowed are .jsonl, "
                     ".json (JSON lines), .parquet and .txt")
  if not docs:
    raise ValueError(f"data file {path!r} holds no documents")
  return docs


def _chat_ids(tok: Tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
  """Ids of the rendered conversation and a mask of the assistant's tokens.

  A template with ``{% generation %}`` blocks marks them itself: as transformers'
  ``return_assistant_tokens_mask``, a block covers the tokens from the one holding its first
  character to the one holding its last. Otherwise the template is rendered for each prefix
  of the conversation, so message ``i`` owns the characters its prefix adds; a token is the
  assistant's when its first character is."""
  template = tok.template
  if template.has_generation:
    r = template.render(messages, record=where)
    ids, offsets = tok.encode(r.text, special=False)
    return ids, _span_mask(offsets, r.generation)
  text, spans, prev = "", [], ""
  for i in range(len(messages)):
    text = template.render(messages[:i + 1], record=where).text
    if not text.startswith(prev):
      raise ValueError(f"{where}: the chat template renders messages[:{i + 1}] as a text that "
                       "does not extend the render of the earlier messages; the assistant's "
                       "tokens cannot be told apart")
    spans.append((len(prev), len(text), messages[i]["role"] == "assistant"))
    prev = text
  ids, offsets = tok.encode(text, special=False)
  mask = []
  for (s, e) in offsets:
    mask.append(int(any(a and lo <= s < hi for lo, hi, a in spans) and e > s))
  return ids, mask


def _span_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
               ) -> list[int]:
  """1 for the tokens from the one holding each span's first character to the one holding its
  last (the span's tokens, boundary tokens included, as transformers marks them)."""
  def token_at(c):
    for t, (s, e) in enumerate(offsets):
      if s <= c < e:
        return t
    return None

  mask = [0] * len(offsets)
  for lo, hi in spans:
    if hi <= lo:
      continue
    first, last = token_at(lo), token_at(hi - 1)
    if first is None:  # past the text's tokens (transformers stops there too)
      break
    for t in range(first, (last if last is not None else len(offsets) - 1) + 1):
      mask[t] = 1
  return mask


_STANDARD_ROLES = {"system", "user", "assistant", "tool", "developer"}


def _check_roles(tok: Tokenizer, messages: Sequence[dict], where: str) -> None:
  """A role neither the standard set nor the template names is refused (ShareGPT's ``human``/
  ``gpt`` under ``messages`` would otherwise render and train on nothing)."""
  known = _STANDARD_ROLES | tok.template.roles()
  for i, m in enumerate(messages):
    if m["role"] not in known:
      hint = (f" (ShareGPT's {m['role']!r} is {SHAREGPT_ROLES[m['role']]!r}: write the record "
              "as {\"conversations\": [{\"from\", \"value\"}]} or use that role)"
              if m["role"] in SHAREGPT_ROLES else "")
      raise ValueError(f"{where}: field 'messages[{i}].role'={m['role']!r} is a role neither "
                       f"the chat template ({tok.template_file}) nor the standard set knows: "
                       f"allowed are {sorted(known)}{hint}")


def tokenize_documents(tok: Tokenizer, docs: Sequence[dict], where: str = "data",
                       no_loss: list[str] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
  """``(ids, loss mask)`` per document: text documents end with the EOS token and train on
  every token; chat documents train on the assistant's tokens only.

  Args:
    tok: the checkpoint's `Tokenizer`.
    docs: `read_documents`' documents (its ``where`` names each in errors).
    where: the data file, for documents without a ``where``.
    no_loss: a list that receives the ``where`` of every chat document whose assistant turns
      contribute no token to the loss.

  Returns:
    One ``(ids, mask)`` per document of two tokens or more.

  Raises:
    ValueError: no document has two tokens or more, a chat document has a role the template
      does not know or does not render turn by turn, or the checkpoint has no chat template
      for chat documents.
  """
  out = []
  wheres = getattr(docs, "where", None) or [f"{where} document {n}" for n in range(len(docs))]
  for d, w in zip(docs, wheres):
    if "text" in d:
      ids, _ = tok.encode(d["text"])
      if tok.eos_id is not None:
        ids = ids + [tok.eos_id]
      mask = [1] * len(ids)
    else:
      _check_roles(tok, d["messages"], w)
      ids, mask = _chat_ids(tok, d["messages"], w)
      if no_loss is not None and not any(mask[1:]):  # mask[0] is never a target
        no_loss.append(w)
    if len(ids) >= 2:
      out.append((np.asarray(ids, np.int32), np.asarray(mask, np.int32)))
  if not out:
    raise ValueError(f"{where}: no document has two tokens or more")
  return out


# -- rows -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Rows:
  """Training rows, each array ``(n, seq_len)``.

  Attributes:
    x: input ids.
    y: next-token targets.
    mask: 1 for a target that counts in the loss.
    segment_ids: the document of each token within its row (0: padding).
    positions: each token's position within its document.
    truncated: documents cut at ``seq_len`` (padded rows only).
    no_loss: chat records whose assistant turns count no token.
  """

  x: np.ndarray
  y: np.ndarray
  mask: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  truncated: int = 0  # documents cut at seq_len (padded rows only)
  no_loss: tuple[str, ...] = ()  # chat records whose assistant turns count no token

  def __len__(self) -> int:
    return len(self.x)

  def take(self, idx: np.ndarray) -> dict[str, np.ndarray]:
    """Some rows as a batch.

    Args:
      idx: row indices.

    Returns:
      ``{'x', 'y', 'mask', 'segment_ids', 'positions'}`` of those rows.
    """
    return {f: getattr(self, f)[idx] for f in FIELDS}


def _pairs(docs):
  """Each document as next-token pairs: inputs ids[:-1], targets ids[1:], the target's mask."""
  for ids, mask in docs:
    yield ids[:-1], ids[1:], mask[1:]


def pack(docs: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> Rows:
  """Documents one after another, cut into rows of ``seq_len`` (a document may continue in the
  next row, its positions continuing); each row numbers its documents 1, 2, ... in
  ``segment_ids``, the last row is padded (segment 0, mask 0).

  Args:
    docs: ``(ids, loss mask)`` per document (`tokenize_documents`).
    seq_len: tokens per row.
    pad_id: the padding token id.

  Returns:
    The packed `Rows`.
  """
  xs, ys, ms, docid, pos = [], [], [], [], []
  for k, (x, y, m) in enumerate(_pairs(docs)):
    xs.append(x), ys.append(y), ms.append(m)
    docid.append(np.full(len(x), k, np.int64)), pos.append(np.arange(len(x), dtype=np.int32))
  x, y, m, d, p = (np.concatenate(a) for a in (xs, ys, ms, docid, pos))
  n = -(-len(x) // seq_len)
  padn = n * seq_len - len(x)
  x = np.concatenate([x, np.full(padn, pad_id, np.int32)]).reshape(n, seq_len)
  y = np.concatenate([y, np.full(padn, pad_id, np.int32)]).reshape(n, seq_len)
  m = np.concatenate([m, np.zeros(padn, np.int32)]).reshape(n, seq_len)
  p = np.concatenate([p, np.zeros(padn, np.int32)]).reshape(n, seq_len)
  d = np.concatenate([d, np.full(padn, -1, np.int64)]).reshape(n, seq_len)
  # segment ids 1, 2, ... within each row, in order of the documents there; padding 0
  new = np.ones_like(d, bool)
  new[:, 1:] = d[:, 1:] != d[:, :-1]
  seg = np.cumsum(new, axis=1).astype(np.int32)
  seg[d < 0] = 0
  return Rows(x, y, m, seg, p)


def pad(docs: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> Rows:
  """One document per row, cut at ``seq_len`` (counted in ``truncated``) and padded.

  Args:
    docs: ``(ids, loss mask)`` per document (`tokenize_documents`).
    seq_len: tokens per row.
    pad_id: the padding token id.

  Returns:
    The padded `Rows`, one per document.
  """
  n = len(docs)
  rows = Rows(np.full((n, seq_len), pad_id, np.int32), np.full((n, seq_len), pad_id, np.int32),
              np.zeros((n, seq_len), np.int32), np.zeros((n, seq_len), np.int32),
              np.zeros((n, seq_len), np.int32))
  for i, (x, y, m) in enumerate(_pairs(docs)):
    if len(x) > seq_len:
      rows.truncated += 1
    k = min(len(x), seq_len)
    rows.x[i, :k], rows.y[i, :k], rows.mask[i, :k] = x[:k], y[:k], m[:k]
    rows.segment_ids[i, :k], rows.positions[i, :k] = 1, np.arange(k)
  return rows


def build_rows(path: str | os.PathLike, tok: Tokenizer, seq_len: int, packing: str = "pack"
               ) -> Rows:
  """`read_documents`, then `tokenize_documents`, then `pack` or `pad`.

  Args:
    path: the data file.
    tok: the checkpoint's `Tokenizer`.
    seq_len: tokens per row.
    packing: ``'pack'`` (documents packed into rows, kept apart by segment ids) or ``'pad'``
      (one document per row).

  Returns:
    The `Rows`, with ``no_loss`` set.

  Raises:
    ValueError: an invalid ``packing`` or ``seq_len``, no token counts in the loss, or an
      error of `read_documents` or `tokenize_documents`.
    FileNotFoundError: ``path`` does not exist.
  """
  if packing not in ("pack", "pad"):
    raise ValueError(f"packing={packing!r} is invalid: 'pack' (documents packed into rows, "
                     "kept apart by segment ids) or 'pad' (one document per row)")
  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
    raise ValueError(f"seq_len={seq_len!r} is invalid: a positive integer")
  no_loss: list[str] = []
  docs = tokenize_documents(tok, read_documents(path), os.fspath(path), no_loss)
  rows = (pack if packing == "pack" else pad)(docs, seq_len, tok.pad_id)
  rows.no_loss = tuple(no_loss)
  if not rows.mask.any():
    raise ValueError(f"{os.fspath(path)}: no token counts in the loss (chat data without an "
                     f"assistant message? {len(no_loss)} records have no assistant token, e.g. "
                     f"{', '.join(no_loss[:3])})")
  return rows


# -- batches ----------------------------------------------------------------------------------


class Batches:
  """Global batches of ``global_batch`` rows, each epoch in a new order (``grain``'s
  ``MapDataset.shuffle``): batch ``step`` depends only on ``(seed, step)``.

  ``sharding``: the plan's batch sharding (``plan.batch()``); each process takes only its
  own rows (`zerojax.runtime.data.process_rows`) and the global arrays are assembled from
  them. ``step`` (the position) is plain data, saved with a checkpoint.

  Args:
    rows: the training `Rows`.
    global_batch: rows per step over all processes.
    seed: the shuffling seed.
    sharding: the plan's batch sharding, or ``None`` for numpy arrays of every row.
    step: the position (batch index) to start from.
  """

  def __init__(self, rows: Rows, global_batch: int, seed: int = 0, sharding: Any = None,
               step: int = 0):
    grain = require(*_BATCH_ORDER)
    self.rows, self.global_batch, self.sharding, self.step = rows, global_batch, sharding, step
    self._index = grain.MapDataset.range(len(rows)).shuffle(seed=seed).repeat().batch(
        global_batch)
    self._local = None
    if sharding is not None:
      self._local = process_rows(sharding, global_batch)

  def batch(self, step: int) -> dict:
    """One batch, by position.

    Args:
      step: the batch index.

    Returns:
      This process's rows of batch ``step`` (global arrays with a sharding) and a
      ``loss_norm`` column (see `loss_norm`).
    """
    idx = np.asarray(self._index[step])
    return _to_global(self.rows, idx, self._local, self.sharding, self.global_batch,
                      loss_norm(self.rows.mask[idx], self.global_batch))

  def __iter__(self) -> Iterator[dict]:
    return self

  def __next__(self) -> dict:
    out = self.batch(self.step)
    self.step += 1
    return out


def loss_norm(mask: np.ndarray, global_batch: int) -> float:
  """``global_batch / targets counted in the whole global batch``: every row carries it, so a
  loss ``sum(ce * mask * loss_norm) / rows`` over any part of the batch (a micro-batch, one
  device's rows) averages, over the parts, to the global batch's per-token mean. Gradient
  accumulation then equals the full batch (as the HF Trainer normalises by the tokens of the
  whole accumulated batch), where a mean per micro-batch would weight short ones more.

  Args:
    mask: the loss mask of the whole global batch.
    global_batch: its rows.

  Returns:
    ``global_batch`` over the number of counted targets (at least 1).
  """
  return global_batch / max(float(np.sum(mask)), 1.0)


def _to_global(rows: Rows, idx: np.ndarray, local, sharding, global_batch: int,
               norm: float | None = None) -> dict:
  if local is not None:
    idx = idx[local]
  data = rows.take(idx)
  if norm is not None:
    data["loss_norm"] = np.full((len(idx), 1), norm, np.float32)
  if sharding is None:
    return data
  return {k: jax.make_array_from_process_local_data(sharding, v, (global_batch,) + v.shape[1:])
          for k, v in data.items()}


def eval_batches(rows: Rows, global_batch: int, sharding: Any = None) -> list[dict]:
  """Every row of ``rows`` once, in order, in batches of ``global_batch``.

  Args:
    rows: the evaluation `Rows`.
    global_batch: rows per batch; the last batch is filled with masked-out rows.
    sharding: the plan's batch sharding, or ``None`` for numpy arrays.

  Returns:
    The batches, as `Batches.batch` gives them but without ``loss_norm``.
  """
  local = None
  if sharding is not None:
    local = process_rows(sharding, global_batch)
  n = len(rows)
  nb = -(-n // global_batch)
  ext = Rows(*(np.concatenate([getattr(rows, f), np.zeros(
      (nb * global_batch - n,) + getattr(rows, f).shape[1:], getattr(rows, f).dtype)])
      for f in FIELDS))
  return [_to_global(ext, np.arange(b * global_batch, (b + 1) * global_batch), local, sharding,
                     global_batch) for b in range(nb)]
