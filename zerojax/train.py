"""A reusable training loop for the GPT example: progress bar, metrics files and loss curve.

`train` runs ``ZeroConfig`` + `TrainOptions` end to end and leaves in ``out_dir``:

* ``metrics.jsonl``: one JSON object per optimizer step (``step``, ``loss``, ``grad_norm``,
  ``lr``, ``tokens_per_sec``, ``elapsed_sec``, and ``loss_scale`` under fp16); the timings are
  the step's own (`StepClock`: from the step's completion on the device), and the first step's
  ``tokens_per_sec`` is ``null`` (it carries compilation and warm-up);
* ``events.out.tfevents.*``: the same scalars as TensorBoard event files (``train/loss``, ...),
  written by a small built-in TFRecord/Event encoder, so neither TensorFlow nor TensorBoard is
  needed to write them (``tensorboard --logdir out_dir`` reads them);
* ``loss.png``: the loss curve, drawn at the end;
* ``run.json``: the resolved `ZeroConfig` and `TrainOptions`.

On multi-host runs only process 0 prints, shows the progress bar and writes files; every
process runs the same loop. The progress bar (tqdm) shows loss, tokens/s and the ETA.

The loop honours the config's batch sizes (``train = micro x accumulation x data parallel``),
``gradient_clipping`` and fp16 loss scaling through the step's own machinery
(`zerojax.value_and_grad` splits each global batch into micro-batches with one gradient
reduction per step; `zerojax.ZeroTrainState` clips, scales and skips overflowing steps on the
device). Metrics are fetched from the device only every ``log_every`` steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import queue
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from zerojax.config import ConfigError, ZeroConfig

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
DEFAULT_CORPUS = PACKAGE_DIR.parent / "examples" / "data" / "corpus.txt"


# -- options ----------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainOptions:
  """Options of the training loop (everything that is not a `ZeroConfig` field).

  Attributes:
    model: GPT preset (``tiny``, ``small``, ``gpt-89m``; see ``zerojax.models.PRESETS``); the
      vocabulary is always 256 (bytes).
    seq_len: tokens per row (``None``: the preset's).
    steps: optimizer steps.
    batch: global rows per optimizer step, used when the config sets no batch size.
    optimizer: ``adamw``, ``adam``, ``sgd``, ``lamb`` or ``adagrad``.
    lr: peak learning rate.
    warmup_steps: linear warmup steps.
    decay: ``constant`` or ``cosine`` (to 10% of ``lr`` at ``steps``).
    scheduler: a DeepSpeed scheduler mapping (from `zerojax.deepspeed`); overrides warmup/decay.
    b1, b2, eps, weight_decay, momentum: optimizer hyperparameters.
    seed: initialisation and data seed.
    corpus: text file to train on (bytes are tokens); default: the bundled corpus.
    out_dir: where metrics, event files, plot and run.json go.
    log_every: steps between metric fetches/progress-bar updates.
    progress: show the progress bar.
    tensorboard: write TensorBoard event files.
    plot: draw ``loss.png`` at the end.
    init_from: weights to start from (fine-tuning): a ``.npz`` of consolidated weights or a
      checkpoint directory (consolidated with ``zerojax.export``).
    cpu_devices: simulated CPU devices when no accelerator is present (set before JAX starts).
    show_plan: print the sharding table and the per-device memory XLA measured.
    save_weights: write the final parameters to ``out_dir/weights.npz`` (consolidated, float32
      keys as in `flat_params`), e.g. for ``examples/finetune.py --init``. Sharded,
      resumable checkpoints are `zerojax.checkpoint`'s job.
    checkpoint_dir: save sharded checkpoints there (`zerojax.checkpoint.Checkpointer`: async,
      each process writes its own shards) every ``checkpoint_every`` steps and at the end,
      with the data position; ``examples/finetune.py --init`` accepts the directory.
    checkpoint_every: steps between checkpoints (0: only at the end).
  """

  model: str = "small"
  seq_len: int | None = None
  steps: int = 30
  batch: int = 32
  optimizer: str = "adamw"
  lr: float = 3e-3
  warmup_steps: int = 0
  decay: str = "constant"
  scheduler: dict | None = None
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  momentum: float = 0.9
  seed: int = 0
  corpus: str | None = None
  out_dir: str = "runs/gpt"
  log_every: int = 10
  progress: bool = True
  tensorboard: bool = True
  plot: bool = True
  init_from: str | None = None
  cpu_devices: int = 8
  show_plan: bool = True
  save_weights: bool = False
  checkpoint_dir: str | None = None
  checkpoint_every: int = 0

  def __post_init__(self):
    for f in ("steps", "batch", "log_every", "cpu_devices"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"TrainOptions.{f}={v!r} is invalid: a positive integer")
    if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
        or self.checkpoint_every < 0:
      raise ConfigError(f"TrainOptions.checkpoint_every={self.checkpoint_every!r} is invalid: "
                        "an integer >= 0 (0: only at the end)")
    if self.decay not in ("constant", "cosine"):
      raise ConfigError(f"TrainOptions.decay={self.decay!r} is invalid: 'constant' or 'cosine'")
    if self.optimizer not in ("adamw", "adam", "sgd", "lamb", "adagrad"):
      raise ConfigError(f"TrainOptions.optimizer={self.optimizer!r} is invalid: one of adamw, "
                        "adam, sgd, lamb, adagrad")
    if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or self.lr <= 0:
      raise ConfigError(f"TrainOptions.lr={self.lr!r} is invalid: a positive number")

  @classmethod
  def fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def apply_deepspeed_train(opts: TrainOptions, train: Mapping[str, Any]) -> TrainOptions:
  """Folds a `DeepSpeedMapping.train` dict (optimizer, scheduler, ...) into ``opts``."""
  return dataclasses.replace(opts, **deepspeed_train_fields(train))


def deepspeed_train_fields(train: Mapping[str, Any]) -> dict[str, Any]:
  """`TrainOptions` fields of a `DeepSpeedMapping.train` dict."""
  changes: dict[str, Any] = {}
  o = train.get("optimizer")
  if o:
    changes["optimizer"] = o["name"]
    for k in ("lr", "eps", "weight_decay", "momentum"):
      if k in o:
        changes[k] = float(o[k])
    if "betas" in o:
      changes["b1"], changes["b2"] = (float(b) for b in o["betas"])
  if train.get("scheduler"):
    changes["scheduler"] = dict(train["scheduler"])
  for k in ("log_every", "tensorboard", "out_dir"):
    if k in train:
      changes[k] = train[k]
  return changes


# -- process-0 logging ------------------------------------------------------------------------


def is_main_process() -> bool:
  import jax
  return jax.process_index() == 0


def log(*args: Any, **kwargs: Any) -> None:
  """``print`` on process 0 only (multi-host logs stay readable)."""
  if is_main_process():
    print(*args, **kwargs, flush=True)


def setup_cpu_devices(n: int) -> None:
  """Simulates ``n`` CPU devices if JAX has not started yet and none were asked for.

  Only the CPU backend reads the setting, so it is harmless on accelerators.
  """
  from jax._src import xla_bridge
  if xla_bridge.backends_are_initialized():
    return
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  import jax
  jax.config.update("jax_num_cpu_devices", n)


# -- TensorBoard event files ------------------------------------------------------------------

_CRC_TABLE: list[int] = []


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), as TFRecord framing uses."""
  if not _CRC_TABLE:
    for i in range(256):
      c = i
      for _ in range(8):
        c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
      _CRC_TABLE.append(c)
  crc = 0xFFFFFFFF
  for b in data:
    crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  c = crc32c(data)
  return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  out = bytearray()
  n &= (1 << 64) - 1
  while True:
    b = n & 0x7F
    n >>= 7
    if n:
      out.append(b | 0x80)
    else:
      out.append(b)
      return bytes(out)


def _field(num: int, wire: int) -> bytes:
  return _varint((num << 3) | wire)


def _event(wall_time: float, step: int, *, file_version: str | None = None,
           scalars: Mapping[str, float] | None = None) -> bytes:
  """Serialises a ``tensorflow.Event`` protobuf (wall_time=1, step=2, file_version=3,
  summary=5 with Summary.value=1: Value.tag=1, Value.simple_value=2)."""
  msg = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
  if file_version is not None:
    v = file_version.encode()
    msg += _field(3, 2) + _varint(len(v)) + v
  if scalars:
    summary = b""
    for tag, value in scalars.items():
      t = tag.encode()
      val = _field(1, 2) + _varint(len(t)) + t + _field(2, 5) + struct.pack("<f", float(value))
      summary += _field(1, 2) + _varint(len(val)) + val
    msg += _field(5, 2) + _varint(len(summary)) + summary
  return msg


class EventWriter:
  """Writes scalar summaries to a TensorBoard event file (TFRecord of Event protos)."""

  def __init__(self, logdir: str | os.PathLike):
    os.makedirs(logdir, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
    self.path = os.path.join(os.fspath(logdir), name)
    self._f = open(self.path, "wb")
    self._write(_event(time.time(), 0, file_version="brain.Event:2"))

  def _write(self, data: bytes) -> None:
    header = struct.pack("<Q", len(data))
    self._f.write(header + struct.pack("<I", masked_crc32c(header)) + data
                  + struct.pack("<I", masked_crc32c(data)))

  def scalars(self, step: int, values: Mapping[str, float], wall_time: float | None = None):
    self._write(_event(time.time() if wall_time is None else wall_time, step, scalars=values))

  def flush(self) -> None:
    self._f.flush()

  def close(self) -> None:
    self._f.close()


def read_events(path: str | os.PathLike) -> list[tuple[int, str, float]]:
  """``(step, tag, value)`` of every scalar in an event file; checks both CRCs of each record.

  A minimal protobuf reader for what `EventWriter` writes (and TensorBoard's simple scalars).
  """
  out = []
  data = pathlib.Path(path).read_bytes()
  i = 0
  while i < len(data):
    header = data[i:i + 8]
    (n,) = struct.unpack("<Q", header)
    (hcrc,) = struct.unpack("<I", data[i + 8:i + 12])
    if hcrc != masked_crc32c(header):
      raise ValueError(f"{path}: bad length CRC at byte {i}")
    rec = data[i + 12:i + 12 + n]
    (dcrc,) = struct.unpack("<I", data[i + 12 + n:i + 16 + n])
    if dcrc != masked_crc32c(rec):
      raise ValueError(f"{path}: bad data CRC at byte {i}")
    i += 16 + n
    fields = _parse(rec)
    step = fields.get(2, [0])[0]
    for summary in fields.get(5, []):
      for val in _parse(summary).get(1, []):
        v = _parse(val)
        out.append((step, v[1][0].decode(), struct.unpack("<f", v[2][0])[0]))
  return out


def _parse(buf: bytes) -> dict[int, list]:
  fields: dict[int, list] = {}
  i = 0
  while i < len(buf):
    key, i = _read_varint(buf, i)
    num, wire = key >> 3, key & 7
    if wire == 0:
      v, i = _read_varint(buf, i)
    elif wire == 1:
      v, i = buf[i:i + 8], i + 8
    elif wire == 5:
      v, i = buf[i:i + 4], i + 4
    elif wire == 2:
      n, i = _read_varint(buf, i)
      v, i = buf[i:i + n], i + n
    else:
      raise ValueError(f"unsupported protobuf wire type {wire}")
    fields.setdefault(num, []).append(v)
  return fields


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
  shift = result = 0
  while True:
    b = buf[i]
    i += 1
    result |= (b & 0x7F) << shift
    if not b & 0x80:
      return result, i
    shift += 7


# -- metrics ----------------------------------------------------------------------------------


class MetricsWriter:
  """Appends per-step metrics to ``metrics.jsonl`` and TensorBoard event files (process 0)."""

  def __init__(self, out_dir: str | os.PathLike, tensorboard: bool = True):
    self.enabled = is_main_process()
    self.out_dir = os.fspath(out_dir)
    self.jsonl_path = os.path.join(self.out_dir, "metrics.jsonl")
    self.tb = None
    if self.enabled:
      os.makedirs(self.out_dir, exist_ok=True)
      self._f = open(self.jsonl_path, "w")
      self.tb = EventWriter(self.out_dir) if tensorboard else None

  def write(self, record: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    self._f.write(json.dumps(dict(record)) + "\n")
    if self.tb is not None:
      self.tb.scalars(int(record["step"]), {
          f"train/{k}": v for k, v in record.items()
          if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)})

  def flush(self) -> None:
    if self.enabled:
      self._f.flush()
      if self.tb is not None:
        self.tb.flush()

  def close(self) -> None:
    if self.enabled:
      self._f.close()
      if self.tb is not None:
        self.tb.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_loss(records: Iterable[Mapping[str, Any]], png_path: str | os.PathLike,
              title: str = "zerojax training loss") -> str:
  """Draws the loss curve of ``records`` (``step``/``loss``) to a PNG; returns its path."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  records = list(records)
  fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
  ax.plot([r["step"] for r in records],
          [r["loss"] if r["loss"] is not None else float("nan") for r in records], lw=1.5)
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(png_path)
  plt.close(fig)
  return os.fspath(png_path)


# -- plan notes ---------------------------------------------------------------------------------


def nothing_sharded_note(plan: Any) -> str | None:
  """Why a stage >= 1 plan shards no parameter leaf over ``fsdp`` (``None`` if it shards one).

  Such a run is plain data parallelism whatever its stage says; the line names the cause
  (leaves below ``param_persistence_threshold``, no dimension divisible by the ``fsdp`` size,
  an ``fsdp`` axis of size 1) and what to change.
  """
  if plan.config.stage < 1 or not plan.leaves or any(lp.is_sharded for lp in plan.leaves):
    return None
  from zerojax.mesh import axis_size
  counts: dict[str, int] = {}
  for lp in plan.leaves:
    counts[lp.reason] = counts.get(lp.reason, 0) + 1
  f, t = axis_size(plan.mesh, "fsdp"), plan.config.param_persistence_threshold
  largest = max(math.prod(lp.shape) for lp in plan.leaves)
  why = {"threshold": f"below param_persistence_threshold={t:,} elements (largest leaf: "
                      f"{largest:,})",
         "indivisible": f"with no dimension divisible by the fsdp size {f}",
         "fsdp=1": "on an fsdp axis of size 1"}
  parts = [f"{n} {why.get(r, f'replicated by {r}')}" for r, n in sorted(counts.items())]
  fixes = []
  if "threshold" in counts:
    fixes.append(f"param_persistence_threshold below {largest:,} or a larger model")
  if "fsdp=1" in counts:
    fixes.append("more devices on the fsdp axis")
  return (f"note: stage {plan.config.stage} shards nothing here: all {len(plan.leaves)} "
          f"parameter leaves stay replicated ({'; '.join(parts)}), so this run is plain data "
          "parallelism" + (f"; for ZeRO sharding use {' or '.join(fixes)}" if fixes else ""))


# -- per-step timing ---------------------------------------------------------------------------


class StepClock:
  """When each dispatched step finished on the device, without the loop waiting for it.

  A background thread waits, in step order, until one output of each step is ready and
  records the time. The interval between two completions is that step's own time: while the
  host dispatches ahead the device runs steps back to back, and a host-bound loop shows its
  own pace. The first step of a run has no previous completion (and carries compilation and
  warm-up), so it gets no step time.
  """

  def __init__(self):
    self._queue: queue.Queue = queue.Queue()
    self._done: dict[int, float] = {}
    self._cv = threading.Condition()
    self._thread = threading.Thread(target=self._run, name="zerojax-step-clock", daemon=True)
    self._thread.start()

  def add(self, step: int, output: Any) -> None:
    """Times ``step`` by ``output`` (any array the step returned)."""
    self._queue.put((step, output))

  def _run(self) -> None:
    import jax
    while (item := self._queue.get()) is not None:
      step, output = item
      try:
        jax.block_until_ready(output)
      except Exception:  # noqa: BLE001 - the loop's own fetch of the metrics raises it
        pass
      now = time.perf_counter()
      with self._cv:
        self._done[step] = now
        self._cv.notify_all()

  def done(self, step: int) -> float:
    """``time.perf_counter()`` when ``step`` finished (waits for it)."""
    with self._cv:
      self._cv.wait_for(lambda: step in self._done)
      return self._done[step]

  def step_time(self, step: int) -> float | None:
    """Seconds between the completions of ``step - 1`` and ``step``; ``None`` for the first."""
    end = self.done(step)
    with self._cv:
      start = self._done.get(step - 1)
    return None if start is None else end - start

  def close(self) -> None:
    self._queue.put(None)
    self._thread.join()


# -- optimizer ---------------------------------------------------------------------------------


def make_schedule(opts: TrainOptions, total_steps: int) -> Callable:
  """The learning-rate schedule of ``opts`` (or of its DeepSpeed ``scheduler``)."""
  import jax.numpy as jnp
  import optax
  s = opts.scheduler
  if s:
    name = s["name"]
    w = int(s.get("warmup_num_steps", 1000))
    if name == "WarmupCosineLR":
      lo, end = opts.lr * s.get("warmup_min_ratio", 0.0), opts.lr * s.get("cos_min_ratio", 1e-4)
      total = int(s.get("total_num_steps", total_steps))
      return optax.warmup_cosine_decay_schedule(lo, opts.lr, max(w, 1), max(total, w + 1), end)
    lo, hi = float(s.get("warmup_min_lr", 0.0)), float(s.get("warmup_max_lr", opts.lr))
    log_warmup = s.get("warmup_type", "log") == "log"
    total = int(s.get("total_num_steps", total_steps))

    def sched(count):
      c = jnp.asarray(count, jnp.float32)
      if log_warmup:
        frac = jnp.log(c + 1) / math.log(max(w, 2))
      else:
        frac = c / max(w, 1)
      warm = lo + (hi - lo) * jnp.clip(frac, 0.0, 1.0)
      if name == "WarmupDecayLR":
        decay = jnp.clip((total - c) / max(total - w, 1), 0.0, 1.0)
        return jnp.where(c < w, warm, hi * decay)
      return warm

    return sched
  if opts.decay == "cosine":
    return optax.warmup_cosine_decay_schedule(
        0.0, opts.lr, max(opts.warmup_steps, 1), max(total_steps, opts.warmup_steps + 1),
        opts.lr * 0.1)
  if opts.warmup_steps:
    return optax.linear_schedule(0.0, opts.lr, opts.warmup_steps)
  return optax.constant_schedule(opts.lr)


def make_optimizer(opts: TrainOptions, config: ZeroConfig, accumulation: int = 1):
  """``(tx, schedule)``: the optax optimizer and its learning-rate schedule."""
  import optax
  sched = make_schedule(opts, opts.steps)
  o = opts.optimizer
  if o == "adamw":
    base = optax.adamw(sched, b1=opts.b1, b2=opts.b2, eps=opts.eps,
                       weight_decay=opts.weight_decay)
  elif o == "adam":
    base = optax.adam(sched, b1=opts.b1, b2=opts.b2, eps=opts.eps)
  elif o == "lamb":
    base = optax.lamb(sched, b1=opts.b1, b2=opts.b2, eps=opts.eps,
                      weight_decay=opts.weight_decay)
  elif o == "adagrad":
    base = optax.adagrad(sched, eps=opts.eps)
  else:
    base = optax.sgd(sched, momentum=opts.momentum)
  # Clipping, loss scaling and accumulation happen in the step (`zerojax.ZeroTrainState`,
  # `zerojax.value_and_grad`), so the optimizer is the plain update rule.
  del accumulation
  return base, sched


# -- weights for fine-tuning ------------------------------------------------------------------


def flat_params(params: Any) -> dict[str, Any]:
  """``{'blocks/qkv/kernel': leaf, ...}``: the tree flattened with ``/``-joined keys."""
  import jax
  from zerojax.plan import _path_str
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return {_path_str(kp): x for kp, x in flat}


def save_weights(path: str | os.PathLike, params: Any) -> str:
  """Writes parameters to a ``.npz`` keyed by ``/``-joined paths (process 0 only)."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  arrays = {k: np.asarray(jax.device_get(
      multihost_utils.process_allgather(v, tiled=True)
      if jax.process_count() > 1 else v)) for k, v in flat_params(params).items()}
  if is_main_process():
    np.savez(path, **arrays)
  return os.fspath(path)


def _stored_shapes(path: str) -> dict[str, tuple[int, ...]]:
  """``{leaf path: shape}`` of the parameters in a ``.npz`` or a checkpoint directory, read
  from headers and metadata only (no array data)."""
  import zipfile
  import numpy as np
  if os.path.isdir(path):
    from zerojax.checkpoint import Checkpointer
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
      if key.startswith("__"):  # zerojax.export's __metadata__ entry
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
  shape (at vocabulary `zerojax.data.VOCAB_SIZE`) except the position table's length, which
  gives ``seq_len``.

  Raises:
    ConfigError: naming ``path`` when no preset matches, or when it holds no parameters.
  """
  import jax
  import jax.numpy as jnp
  from zerojax.data import VOCAB_SIZE
  from zerojax.models import GPT, PRESETS
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
  checkpoint directory, consolidated through ``zerojax.export.export`` into a temporary file.
  Errors name ``path`` (the checkpoint, not the temporary file).
  """
  import tempfile
  from zerojax import export  # lazily: it reads orbax checkpoints
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
  import jax
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


# -- the loop ---------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainResult:
  """What `train` returns."""

  state: Any
  plan: Any
  history: list[dict]
  out_dir: str
  files: dict[str, str]


def train(config: ZeroConfig, opts: TrainOptions | None = None, *,
          xla_notes: Iterable[str] = ()) -> TrainResult:
  """Trains the GPT preset ``opts.model`` on ``opts.corpus`` with ZeRO ``config``.

  Returns:
    a `TrainResult` with the final state, the plan, the per-step metrics and the files written.
  """
  opts = opts or TrainOptions()
  setup_cpu_devices(opts.cpu_devices)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import zerojax
  import zerojax.memory
  from zerojax.data import TextBatches, load_bytes, VOCAB_SIZE
  from zerojax.models import GPT, PRESETS, loss_fn

  if opts.model not in PRESETS:
    raise ConfigError(f"TrainOptions.model={opts.model!r} is invalid: one of {sorted(PRESETS)}")
  mcfg = dataclasses.replace(PRESETS[opts.model], vocab_size=VOCAB_SIZE,
                             dtype=jnp.dtype(config.compute_dtype))
  if opts.seq_len:
    mcfg = dataclasses.replace(mcfg, seq_len=opts.seq_len)
  mesh = zerojax.make_mesh(config)
  from zerojax.mesh import axis_size, data_axes
  dp = math.prod(axis_size(mesh, a) for a in data_axes(mesh))
  if (config.train_batch_size, config.micro_batch_per_device) == (None, None):
    config = config.replace(train_batch_size=opts.batch)
  total, micro, accum = config.batch_sizes(dp)
  rows = total  # rows per optimizer step; zerojax.value_and_grad splits them into micro-batches
  tx, sched = make_optimizer(opts, config, accum)

  corpus = opts.corpus or os.fspath(DEFAULT_CORPUS)
  if not os.path.isfile(corpus):
    raise ConfigError(f"TrainOptions.corpus={corpus!r} is not a file; pass corpus=PATH to a text "
                      "file (the bundled corpus is examples/data/corpus.txt in the repository)")
  tokens = load_bytes(corpus)
  model = GPT(mcfg)
  sample = jnp.zeros((rows, mcfg.seq_len), jnp.int32)
  state, plan = zerojax.create_train_state(model, tx, jax.random.key(opts.seed), sample,
                                           config=config, mesh=mesh)
  if opts.init_from:
    state = state.replace(params=load_weights(opts.init_from, state.params, plan.params))

  log(f"zerojax: {jax.device_count()} x {jax.devices()[0].platform} devices, "
      f"{jax.process_count()} process(es), mesh {dict(mesh.shape)}, stage {config.stage}")
  log(f"model {opts.model}: {zerojax.memory.num_params(state.params):,} parameters; batch "
      f"{total} rows x {mcfg.seq_len} tokens = {micro} per device x {accum} accumulation x {dp} data parallel")
  for n in xla_notes:
    log(n)
  if (note := nothing_sharded_note(plan)) is not None:
    log(note)

  @zerojax.zero_step(plan)
  def train_step(state, batch):
    def lf(params, batch):
      return loss_fn(state.apply_fn({"params": params}, batch["x"]), batch["y"])
    loss, grads = zerojax.value_and_grad(lf)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}

  batch_sh = plan.batch({"x": sample})["x"]
  batches = TextBatches(tokens, rows, mcfg.seq_len, seed=opts.seed, sharding=batch_sh)

  def next_batch():
    return next(batches)

  if opts.show_plan:
    log(plan.table())
    m = zerojax.memory.measure(train_step.lower(state, next_batch()).compile())
    batches.step = 0
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    log(f"per-device memory (XLA): arguments {mib(m.argument)}, temp {mib(m.temp)}, "
        f"peak {mib(m.peak)}; collectives/step {mib(m.collective_total)}")

  out_dir = opts.out_dir
  writer = MetricsWriter(out_dir, tensorboard=opts.tensorboard)
  if is_main_process():
    with open(os.path.join(out_dir, "run.json"), "w") as f:
      json.dump({"config": config.to_dict(), "options": dataclasses.asdict(opts)}, f, indent=1)

  bar = None
  if opts.progress and is_main_process():
    from tqdm.auto import tqdm
    bar = tqdm(total=opts.steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)

  history: list[dict] = []
  pending: list[tuple[int, Any]] = []
  tokens_per_step = total * mcfg.seq_len
  t_start = time.perf_counter()
  clock = StepClock()  # per-step completion times; the loop never waits for the device
  last_fetched = 0

  def drain():
    nonlocal last_fetched
    if not pending:
      return
    fetched = jax.device_get([m for _, m in pending])
    for (step, _), m in zip(pending, fetched):
      finite = lambda v: v if math.isfinite(v) else None  # JSON has no NaN/inf
      dt = clock.step_time(step)  # None for the run's first step (compilation, warm-up)
      rec = {"step": step, "loss": finite(float(np.mean(m["loss"]))),
             "grad_norm": finite(float(np.mean(m["grad_norm"]))),
             "lr": float(sched(step - 1)),
             "tokens_per_sec": None if not dt else round(tokens_per_step / dt, 1),
             "elapsed_sec": round(clock.done(step) - t_start, 6)}
      if config.loss_scale is not None:
        rec["loss_scale"] = float(m["loss_scale"])
        rec["skipped_steps"] = int(m["skipped_steps"])
      history.append(rec)
      writer.write(rec)
    writer.flush()
    if bar is not None:
      tps = history[-1]["tokens_per_sec"]
      bar.set_postfix(loss=f"{history[-1]['loss'] or float('nan'):.4f}",
                      tok_s="-" if tps is None else f"{tps:,.0f}", refresh=False)
      bar.update(history[-1]["step"] - last_fetched)
    last_fetched = history[-1]["step"]
    pending.clear()

  ckpt = None
  if opts.checkpoint_dir:
    from zerojax.checkpoint import Checkpointer
    ckpt = Checkpointer(opts.checkpoint_dir, config=config)
  for step in range(1, opts.steps + 1):
    state, m = train_step(state, next_batch())  # no host sync: metrics are fetched in drain()
    pending.append((step, m))
    clock.add(step, m["loss"])
    if ckpt is not None and (step == opts.steps or (
        opts.checkpoint_every and step % opts.checkpoint_every == 0)):
      ckpt.save(step, state, data={"batches_step": batches.step})  # async
    if step % opts.log_every == 0 or step == opts.steps or step == 1:
      drain()
  drain()
  clock.close()
  if bar is not None:
    bar.close()
  writer.close()
  if ckpt is not None:
    ckpt.wait()
    ckpt.close()

  files = {"metrics": writer.jsonl_path, "run": os.path.join(out_dir, "run.json")}
  if opts.save_weights:
    files["weights"] = save_weights(os.path.join(out_dir, "weights.npz"), state.params)
  if writer.tb is not None:
    files["tensorboard"] = writer.tb.path
  if ckpt is not None:
    files["checkpoint"] = opts.checkpoint_dir
  if opts.plot and is_main_process() and history:
    files["loss_png"] = plot_loss(history, os.path.join(out_dir, "loss.png"),
                                  f"{opts.model}, ZeRO-{config.stage}, {jax.device_count()} "
                                  "devices")
  if history:
    first, last = history[0], history[-1]
    nan = float("nan")
    timed = len(history) - 1  # steps after the first (which carries compilation)
    speed = (f"{tokens_per_step * timed / (last['elapsed_sec'] - first['elapsed_sec']):,.0f} "
             "tokens/s after the first step" if timed and last["elapsed_sec"] > first[
                 "elapsed_sec"] else "1 step: no throughput (compilation)")
    log(f"done: {opts.steps} steps, loss {first['loss'] or nan:.4f} -> {last['loss'] or nan:.4f}, "
        f"{speed}"
        + (f", {history[-1].get('skipped_steps', 0)} overflow step(s) skipped"
           if history[-1].get("skipped_steps") else ""))
    log("wrote " + ", ".join(files.values()))
  return TrainResult(state, plan, history, out_dir, files)
