"""A reusable training loop for the GPT example: progress bar, metrics files and loss curve.

`train` runs ``ZeroConfig`` + `TrainOptions` end to end and leaves in ``out_dir``:

* ``metrics.jsonl``: one JSON object per optimizer step (``step``, ``loss``, ``grad_norm``,
  ``lr``, ``tokens_per_sec``, ``elapsed_sec``, and ``loss_scale`` under fp16); the timings are
  the step's own (`StepClock`: from the step's completion on the device), and the first step's
  ``tokens_per_sec`` is ``null`` (it carries compilation and warm-up);
* ``tb/<run id>/events.out.tfevents.*``: the same scalars as TensorBoard event files
  (``train/loss``, ...), one run directory per training run, written by ``tensorboardX`` (no
  TensorFlow needed; ``tensorboard --logdir out_dir`` reads them);
* ``loss.png``: the loss curve, drawn at the end;
* ``run.json``: the run id, the resolved `ZeroConfig` and `TrainOptions`.

With a ``checkpoint_dir`` that holds checkpoints, the same command resumes the run exactly
(`TrainOptions.resume`): ``metrics.jsonl`` and the TensorBoard run are continued. Two runs are
never mixed in one ``out_dir``: a previous run without a checkpoint is refused unless
``resume=False`` (``--no-resume``: its ``metrics.jsonl`` is moved aside) or
``overwrite=True`` (``--overwrite``: its files and checkpoints are deleted).

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
import struct
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from zerojax.config import ConfigError, ZeroConfig

__all__ = ["PACKAGE_DIR", "DEFAULT_CORPUS", "NonFiniteGradientsError", "TrainOptions",
           "apply_deepspeed_train", "deepspeed_train_fields", "is_main_process", "log",
           "setup_cpu_devices", "require", "EventWriter", "read_run_events",
           "read_events", "MetricsWriter", "read_jsonl", "plot_loss", "nothing_sharded_note",
           "StepClock", "make_schedule", "make_optimizer", "flat_params", "save_weights",
           "infer_model", "load_weights", "TrainResult", "train"]

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
# Shipped as package data, so a non-editable install finds it too.
DEFAULT_CORPUS = PACKAGE_DIR / "assets" / "corpus.txt"


class NonFiniteGradientsError(RuntimeError):
  """A step's gradient had a NaN or infinity under ``nonfinite_grads='halt'``.

  Attributes:
    step: the optimizer step (1-based) whose gradient was not finite; it was not applied.
    checkpoint: the directory of the last checkpoint saved before it, or ``None``.
  """

  def __init__(self, message: str, step: int, checkpoint: str | None):
    super().__init__(message)
    self.step, self.checkpoint = step, checkpoint


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
    resume: continue the run found in ``out_dir``/``checkpoint_dir`` from its latest complete
      checkpoint (params, optimizer, step, RNG, data position, learning-rate schedule;
      ``metrics.jsonl`` and the TensorBoard run are continued). ``False`` (``--no-resume``):
      start a new run at step 1; a previous run's ``metrics.jsonl`` is moved aside, and
      existing checkpoints are refused (they would be mixed with the new run's).
    overwrite: delete the previous run's files in ``out_dir`` and its checkpoints in
      ``checkpoint_dir`` first, then start a new run (``--overwrite``).
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
  resume: bool = True
  overwrite: bool = False

  def __post_init__(self):
    for f in ("progress", "tensorboard", "plot", "show_plan", "save_weights", "resume",
              "overwrite"):
      if not isinstance(getattr(self, f), bool):
        raise ConfigError(f"TrainOptions.{f}={getattr(self, f)!r} is invalid: true or false (a "
                          "boolean; strings such as 'false' are not booleans)")
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
  from zerojax._compat import backends_initialized
  if backends_initialized():
    return
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  import jax
  jax.config.update("jax_num_cpu_devices", n)


# -- TensorBoard event files ------------------------------------------------------------------

def require(module: str, what: str) -> Any:
  """``import module``, or an error that names the extra that installs it."""
  import importlib
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(f"{what} needs the {module!r} package, which the train extra installs: "
                      "pip install 'zerojax[train]'") from e


class EventWriter:
  """Scalar summaries in a TensorBoard event file, written by ``tensorboardX``."""

  def __init__(self, logdir: str | os.PathLike, purge_step: int | None = None):
    tbx = require("tensorboardX", "writing TensorBoard event files")
    logdir = os.fspath(logdir)
    os.makedirs(logdir, exist_ok=True)
    before = set(_event_files(logdir))
    # Files are named by the second they were opened; a numbered suffix keeps a resumed run
    # restarted within the same second apart, in order (see `read_run_events`).
    # ``purge_step``: a resumed run redoes the steps after its checkpoint; the SessionLog START
    # tensorboardX writes at that step makes TensorBoard drop the earlier files' events from it.
    self._w = tbx.SummaryWriter(logdir=logdir, purge_step=purge_step, flush_secs=10,
                                filename_suffix=f".{len(before):04d}")
    self._w.flush()
    new = sorted(set(_event_files(logdir)) - before)
    self.path = os.path.join(logdir, new[-1]) if new else None

  def scalars(self, step: int, values: Mapping[str, float], wall_time: float | None = None):
    for tag, v in values.items():
      self._w.add_scalar(tag, float(v), int(step), walltime=wall_time)

  def flush(self) -> None:
    self._w.flush()

  def close(self) -> None:
    self._w.close()


def _event_files(logdir: str | os.PathLike) -> list[str]:
  return [f for f in os.listdir(logdir) if f.startswith("events.out.tfevents.")]


def read_run_events(logdir: str | os.PathLike) -> list[tuple[int, str, float]]:
  """``(step, tag, value)`` of a TensorBoard run directory, as TensorBoard shows it: its event
  files in order, where a ``SessionLog START`` at step ``s`` (a resumed run) drops the earlier
  files' events from step ``s`` on."""
  out: list[tuple[int, str, float]] = []
  files = sorted(_event_files(logdir), key=lambda f: (int(f.split(".")[3]), f))
  for f in files:
    events = list(_events(os.path.join(logdir, f)))
    for e in events:
      if e.HasField("session_log") and e.session_log.status == e.session_log.START:
        out = [x for x in out if x[0] < e.step]
    out += _scalars(events)
  return out


def read_events(path: str | os.PathLike) -> list[tuple[int, str, float]]:
  """``(step, tag, value)`` of every scalar in one event file (both CRCs of every record are
  checked)."""
  return _scalars(_events(path))


def _scalars(events: Iterable[Any]) -> list[tuple[int, str, float]]:
  return [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value
          if v.HasField("simple_value")]


def _events(path: str | os.PathLike) -> Iterable[Any]:
  """The ``Event`` protos of a TFRecord event file, read with tensorboardX's own protobuf
  classes and CRC."""
  from tensorboardX.proto import event_pb2
  from tensorboardX.record_writer import masked_crc32c
  data = pathlib.Path(path).read_bytes()
  i = 0
  while i < len(data):
    header = data[i:i + 8]
    if len(header) < 8:
      raise ValueError(f"{path}: truncated record at byte {i}")
    (n,) = struct.unpack("<Q", header)
    (hcrc,) = struct.unpack("<I", data[i + 8:i + 12])
    if hcrc != masked_crc32c(header):
      raise ValueError(f"{path}: bad length CRC at byte {i}")
    rec = data[i + 12:i + 12 + n]
    (dcrc,) = struct.unpack("<I", data[i + 12 + n:i + 16 + n])
    if dcrc != masked_crc32c(rec):
      raise ValueError(f"{path}: bad data CRC at byte {i}")
    i += 16 + n
    yield event_pb2.Event.FromString(rec)


# -- metrics ----------------------------------------------------------------------------------


class MetricsWriter:
  """Writes per-step metrics to ``metrics.jsonl`` and TensorBoard event files (process 0).

  Args:
    out_dir: the run's output directory.
    tensorboard: write event files, into ``tb_dir``.
    tb_dir: the run's own TensorBoard run directory (default: ``out_dir``).
    resume_after: continue a run resumed from the checkpoint of this step: ``metrics.jsonl``
      keeps its records up to this step and is appended to, and the event files' later steps
      are dropped by TensorBoard (`EventWriter` ``purge_step``). ``None``: a new file.
  """

  def __init__(self, out_dir: str | os.PathLike, tensorboard: bool = True,
               tb_dir: str | os.PathLike | None = None, resume_after: int | None = None):
    self.enabled = is_main_process()
    self.out_dir = os.fspath(out_dir)
    self.jsonl_path = os.path.join(self.out_dir, "metrics.jsonl")
    self.tb = None
    self.previous: list[dict] = []
    if self.enabled:
      os.makedirs(self.out_dir, exist_ok=True)
      if resume_after is not None and os.path.exists(self.jsonl_path):
        self.previous = [r for r in read_jsonl(self.jsonl_path) if r["step"] <= resume_after]
        tmp = self.jsonl_path + ".tmp"
        with open(tmp, "w") as f:  # the records up to the checkpoint, then appended to
          f.writelines(json.dumps(r) + "\n" for r in self.previous)
        os.replace(tmp, self.jsonl_path)
        self._f = open(self.jsonl_path, "a")
      else:
        self._f = open(self.jsonl_path, "w")
      if tensorboard:
        self.tb = EventWriter(tb_dir if tb_dir is not None else self.out_dir,
                              purge_step=None if resume_after is None else resume_after + 1)

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
  matplotlib = require("matplotlib", "the loss plot")
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
  f, t = axis_size(plan.mesh, "fsdp"), plan.config.persistence_threshold
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


def make_optimizer(opts: TrainOptions):
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
  return base, sched


# -- weights for fine-tuning ------------------------------------------------------------------


def flat_params(params: Any) -> dict[str, Any]:
  """``{'blocks/qkv/kernel': leaf, ...}``: the tree flattened with ``/``-joined keys."""
  import jax
  from zerojax.plan import path_str
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return {path_str(kp): x for kp, x in flat}


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


# -- run directories: resume, new run, overwrite ---------------------------------------------

# Options that may change when a run is resumed; any other difference is another run.
_RESUMABLE_CHANGES = {"steps", "log_every", "progress", "show_plan", "plot", "save_weights",
                      "checkpoint_every", "cpu_devices", "resume", "overwrite", "tensorboard"}


@dataclasses.dataclass
class _RunDirs:
  run_id: str
  tb_dir: str
  resume_step: int | None  # the checkpoint step to resume from
  notes: list[str]


def _previous_run(out_dir: str) -> tuple[dict | None, list[dict]]:
  run_json = os.path.join(out_dir, "run.json")
  run = None
  if os.path.isfile(run_json):
    try:
      with open(run_json) as f:
        run = json.load(f)
    except ValueError:
      run = None
  metrics = os.path.join(out_dir, "metrics.jsonl")
  records = read_jsonl(metrics) if os.path.isfile(metrics) else []
  return run, records


def _prepare_run(opts: TrainOptions, config: ZeroConfig) -> _RunDirs:
  """Decides whether this run resumes, starts beside a previous one or overwrites it, and
  arranges ``out_dir`` and ``checkpoint_dir`` for it (process 0 moves or deletes files; every
  process decides from the same files before anything changes)."""
  import jax
  out_dir, ckdir = opts.out_dir, opts.checkpoint_dir
  latest = None
  if ckdir and os.path.isdir(ckdir):
    from zerojax.checkpoint import Checkpointer
    with Checkpointer(ckdir, read_only=True) as ck:
      latest = ck.latest_step()
  run, records = _previous_run(out_dir)
  flags = ("pass --no-resume (resume=false) to start a new run beside it, or --overwrite "
           "(overwrite=true) to delete it first")
  notes: list[str] = []
  if jax.process_count() > 1:  # nobody changes a file before every process has read them
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("zerojax.train: run directories read")

  if opts.overwrite:
    if is_main_process():
      _delete_previous(out_dir, ckdir, run)
    notes.append(f"--overwrite: deleted the previous run's files in {out_dir!r}"
                 + (f" and its checkpoints in {ckdir!r}" if ckdir else ""))
    run, records, latest = None, [], None
  elif opts.resume and latest is not None:
    if run is not None:
      old = run.get("options", {})
      new = json.loads(json.dumps(dataclasses.asdict(opts)))
      diff = sorted(k for k in set(old) | set(new)
                    if k not in _RESUMABLE_CHANGES and old.get(k) != new.get(k))
      if diff:
        what = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff[:6])
        raise ConfigError(
            f"checkpoint_dir {ckdir!r} holds a run (latest step {latest}) with other training "
            f"options than this one ({what}); resuming it would mix two runs. Pass "
            "--no-resume (resume=false) with another checkpoint_dir to start a new run, or "
            "--overwrite (overwrite=true) to delete the old one first")
      old_cfg, new_cfg = run.get("config") or {}, json.loads(json.dumps(config.to_dict()))
      changed = sorted(k for k in set(old_cfg) | set(new_cfg) if old_cfg.get(k) != new_cfg.get(k))
      if changed:  # e.g. another stage or mesh: the checkpoint restores into the new plan
        notes.append("resuming with a changed ZeroConfig: " + ", ".join(
            f"{k}: {old_cfg.get(k)!r} -> {new_cfg.get(k)!r}" for k in changed))
    run_id = (run or {}).get("run_id") or _new_run_id()
    notes.append(f"resuming from checkpoint step {latest} in {ckdir!r} (run {run_id}; "
                 "--no-resume or --overwrite for a new run)")
    return _RunDirs(run_id, os.path.join(out_dir, "tb", run_id), latest, notes)
  elif latest is not None:  # --no-resume with checkpoints: the new run's would mix with them
    raise ConfigError(
        f"checkpoint_dir {ckdir!r} holds checkpoints of a previous run (latest step {latest}); "
        "--no-resume (resume=false) would mix this run's checkpoints with them. Resume it "
        "(drop --no-resume), delete it with --overwrite (overwrite=true), or choose another "
        "checkpoint_dir")
  elif records:
    if opts.resume:
      steps = f"steps {records[0].get('step')}..{records[-1].get('step')}"
      raise ConfigError(
          f"out_dir {opts.out_dir!r} holds the metrics of a previous run ({steps}"
          + (f", run {run['run_id']}" if run and run.get("run_id") else "")
          + ") and there is no checkpoint to resume it from"
          + (f" in checkpoint_dir {ckdir!r}" if ckdir else " (checkpoint_dir is not set)")
          + "; " + flags)
    old_id = (run or {}).get("run_id") or time.strftime(
        "%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(os.path.join(out_dir, "metrics.jsonl"))))
    moved = os.path.join(out_dir, f"metrics.{old_id}.jsonl")
    if is_main_process():
      os.replace(os.path.join(out_dir, "metrics.jsonl"), moved)
    notes.append(f"--no-resume: the previous run's metrics were moved to {moved!r}")
  run_id, n = _new_run_id(), 1
  base = run_id
  while os.path.exists(os.path.join(out_dir, "tb", run_id)) or (
      run is not None and run.get("run_id") == run_id):  # two runs within a second
    run_id, n = f"{base}-{n}", n + 1
  return _RunDirs(run_id, os.path.join(out_dir, "tb", run_id), None, notes)


def _new_run_id() -> str:
  return time.strftime("%Y%m%d-%H%M%S")


def _delete_previous(out_dir: str, ckdir: str | None, run: dict | None) -> None:
  import shutil
  if os.path.isdir(out_dir):
    for name in os.listdir(out_dir):
      path = os.path.join(out_dir, name)
      ours = name in ("metrics.jsonl", "run.json", "loss.png", "weights.npz") or (
          name.startswith("events.out.tfevents.")) or (
          name.startswith("metrics.") and name.endswith(".jsonl"))  # moved-aside runs
      if ours and os.path.isfile(path):
        os.remove(path)
    shutil.rmtree(os.path.join(out_dir, "tb"), ignore_errors=True)
  if ckdir and os.path.isdir(ckdir):
    for name in os.listdir(ckdir):  # only what zerojax.checkpoint writes: numbered steps
      if name.split(".")[0].isdigit():
        path = os.path.join(ckdir, name)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


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
  if (config.train_batch_size, config.micro_batch_per_device) == (None, None):
    config = config.replace(train_batch_size=opts.batch)
  tx, sched = make_optimizer(opts)

  corpus = opts.corpus or os.fspath(DEFAULT_CORPUS)
  if not os.path.isfile(corpus):
    raise ConfigError(f"TrainOptions.corpus={corpus!r} is not a file; pass corpus=PATH to a text "
                      f"file (the bundled corpus is {DEFAULT_CORPUS})")
  tokens = load_bytes(corpus)
  model = GPT(mcfg)
  sample = jnp.zeros((1, mcfg.seq_len), jnp.int32)  # shapes for init; the plan sets the batch
  dirs = _prepare_run(opts, config)
  rng = jax.random.key(opts.seed)
  start, data_step = 0, 0
  if dirs.resume_step is None:
    state, plan = zerojax.create_train_state(model, tx, rng, sample, config=config, mesh=mesh)
    if opts.init_from:
      state = state.replace(params=load_weights(opts.init_from, state.params, plan.params))
  else:  # read straight into the plan's layout: nothing is initialised
    from zerojax.checkpoint import Checkpointer, abstract_train_state
    state, plan = abstract_train_state(model, tx, rng, sample, config=config, mesh=mesh)
    with Checkpointer(opts.checkpoint_dir, read_only=True) as ck:
      state, extras = ck.restore(state, plan, step=dirs.resume_step)
    start = int(extras.step)
    data_step = int((extras.data or {}).get("batches_step", start))
    if int(state.step) != start:
      raise ConfigError(f"checkpoint {opts.checkpoint_dir!r} step {start} holds a state at "
                        f"optimizer step {int(state.step)}; it was not written by this loop")

  # Rows per optimizer step; zerojax.value_and_grad splits them into micro-batches.
  total, micro, accum = plan.batch_sizes
  rows, dp = total, plan.data_parallel_size
  log(f"zerojax: {jax.device_count()} x {jax.devices()[0].platform} devices, "
      f"{jax.process_count()} process(es), mesh {dict(mesh.shape)}, stage {config.stage}")
  log(f"model {opts.model}: {zerojax.memory.num_params(state.params):,} parameters; batch "
      f"{total} rows x {mcfg.seq_len} tokens = {micro} per device x {accum} accumulation x "
      f"{dp} data parallel")
  for n in list(xla_notes) + dirs.notes:
    log(n)
  if (note := nothing_sharded_note(plan)) is not None:
    log(note)

  @zerojax.zero_step(plan)
  def train_step(state, batch):
    def lf(params, batch):
      return loss_fn(state.apply_fn({"params": params}, batch["x"]), batch["y"])
    loss, grads = zerojax.value_and_grad(lf)(state.params, batch)
    return state.apply_gradients(grads=grads), {"loss": loss}

  batch_sh = plan.batch({"x": jax.ShapeDtypeStruct((rows, mcfg.seq_len), jnp.int32)})["x"]
  batches = TextBatches(tokens, rows, mcfg.seq_len, seed=opts.seed, sharding=batch_sh,
                        step=data_step)

  def next_batch():
    return next(batches)

  if opts.show_plan:
    log(plan.table())
    m = zerojax.memory.measure(train_step.lower(state, next_batch()).compile())
    batches.step = data_step
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    log(f"per-device memory (XLA): arguments {mib(m.argument)}, temp {mib(m.temp)}, "
        f"peak {mib(m.peak)}; collectives/step {mib(m.collective_total)}")

  out_dir = opts.out_dir
  writer = MetricsWriter(out_dir, tensorboard=opts.tensorboard, tb_dir=dirs.tb_dir,
                         resume_after=dirs.resume_step)
  if is_main_process():
    run_json = os.path.join(out_dir, "run.json")
    resumes = []
    if dirs.resume_step is not None and os.path.isfile(run_json):
      with open(run_json) as f:
        resumes = json.load(f).get("resumed_from", [])
      resumes.append(dirs.resume_step)
    with open(run_json, "w") as f:
      json.dump({"run_id": dirs.run_id, "config": config.to_dict(),
                 "options": dataclasses.asdict(opts), "resumed_from": resumes}, f, indent=1)

  bar = None
  if opts.progress and is_main_process():
    tqdm = require("tqdm.auto", "the progress bar (progress=False goes without)").tqdm
    bar = tqdm(total=opts.steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
               file=sys.stdout)

  history: list[dict] = list(writer.previous)
  pending: list[tuple[int, Any]] = []
  scaling = config.loss_scale is not None
  policy = config.nonfinite_policy
  count_skips = policy == "skip"
  warned_skip = False
  tokens_per_step = total * mcfg.seq_len
  t_start = time.perf_counter()
  clock = StepClock()  # per-step completion times; the loop never waits for the device
  last_fetched = start

  def drain():
    nonlocal last_fetched, warned_skip
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
      if scaling:
        rec["loss_scale"] = float(m["loss_scale"])
      if count_skips:
        rec["skipped_steps"] = int(m["skipped_steps"])
      if not scaling and count_skips and bool(m["overflow"]) and not warned_skip:
        # fp16 overflows are routine while the loss scale settles; a NaN without loss scaling
        # is not, and must not go unnoticed.
        warned_skip = True
        log(f"zerojax: WARNING: step {step}: the gradient is not finite (loss "
            f"{float(np.mean(m['loss'])):g}, grad_norm {float(np.mean(m['grad_norm'])):g}); the "
            "step was skipped: params and optimizer state are unchanged "
            "(nonfinite_grads='skip'). Further skipped steps are counted in "
            "skipped_steps (metrics.jsonl); nonfinite_grads='halt' stops the run instead.")
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
  halt = policy == "halt"
  try:
    if opts.checkpoint_dir:
      from zerojax.checkpoint import Checkpointer
      ckpt = Checkpointer(opts.checkpoint_dir, config=config)
    for step in range(start + 1, opts.steps + 1):
      state, m = train_step(state, next_batch())  # no host sync: metrics are fetched in drain()
      pending.append((step, m))
      clock.add(step, m["loss"])
      if halt and bool(jax.device_get(m["overflow"])):  # the one per-step sync 'halt' costs
        drain()
        _halt(step, history[-1], ckpt, bar, writer)
      if ckpt is not None and (step == opts.steps or (
          opts.checkpoint_every and step % opts.checkpoint_every == 0)):
        # metrics up to a checkpoint are on disk before it exists: a resumed run's
        # metrics.jsonl then has every step
        drain()
        ckpt.save(step, state, rng=rng, data={"batches_step": batches.step})  # async
      if step % opts.log_every == 0 or step == opts.steps or step == start + 1:
        drain()
    drain()
  finally:  # also on an error: what was written stays consistent and is closed
    clock.close()
    if bar is not None:
      bar.close()
    writer.close()
    if ckpt is not None:
      ckpt.close()  # waits for the pending save

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
        + (f", {history[-1].get('skipped_steps', 0)} "
           f"{'overflow' if scaling else 'non-finite'} step(s) skipped"
           if history[-1].get("skipped_steps") else ""))
    log("wrote " + ", ".join(files.values()))
  return TrainResult(state, plan, history, out_dir, files)


def _num(v: float | None) -> str:
  return "nan or inf" if v is None else f"{v:g}"  # records hold None for non-finite values


def _halt(step: int, rec: Mapping[str, Any], ckpt: Any, bar: Any, writer: MetricsWriter
          ) -> None:
  """Stops the loop at a non-finite step (``nonfinite_grads='halt'``), naming the last
  checkpoint that holds finite state (the caller's ``finally`` closes the writers)."""
  where = None
  if ckpt is not None:
    ckpt.wait()
    steps = [s for s in ckpt.all_steps() if s < step]
    where = ckpt.step_dir(max(steps)) if steps else None
  resume = (f"the last good checkpoint is {where!r}" if where else
            "no checkpoint was saved before it" + ("" if ckpt is not None else
                                                   " (checkpoint_dir is not set)"))
  raise NonFiniteGradientsError(
      f"step {step}: the gradient is not finite (loss {_num(rec.get('loss'))}, grad_norm "
      f"{_num(rec.get('grad_norm'))}); nonfinite_grads='halt' stops the run here (its update "
      f"made the parameters non-finite); {resume}. Lower the learning rate, enable gradient_clipping, or check the "
      "data; nonfinite_grads='skip' skips such steps instead", step, where)
