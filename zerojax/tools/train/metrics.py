"""What a training run reports: ``metrics.jsonl``, TensorBoard event files (tensorboardX),
the loss curve, per-step timing (`StepClock`), and logging on the main process.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import struct
import threading
import time
from typing import Any, Iterable, Mapping

import jax

from zerojax.runtime.extras import require  # re-exported: the train package's name for it

__all__ = ["is_main_process", "log", "require", "EventWriter", "read_run_events", "read_events",
           "MetricsWriter", "read_jsonl", "plot_loss", "StepClock", "throughput", "PEAK_FLOPS",
           "peak_flops", "device_memory", "log_line", "format_eta"]


def is_main_process() -> bool:
  """Whether this is process 0, the one that writes files and logs.

  Returns:
    True on process 0.
  """
  return jax.process_index() == 0


def log(*args: Any, **kwargs: Any) -> None:
  """``print`` on process 0 only (multi-host logs stay readable).

  Args:
    *args: as ``print``'s.
    **kwargs: as ``print``'s.
  """
  if is_main_process():
    print(*args, **kwargs, flush=True)


class EventWriter:
  """Scalar summaries in a TensorBoard event file, written by ``tensorboardX``.

  Args:
    logdir: the TensorBoard run directory (created if needed).
    purge_step: a resumed run's first step: TensorBoard drops the earlier files' events from
      there on.

  Raises:
    MissingPackageError: ``tensorboardX`` is not installed.
  """

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
    """Writes one event per value.

    Args:
      step: the training step.
      values: ``{tag: value}``.
      wall_time: the events' time (seconds since the epoch); default now.
    """
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
  files' events from step ``s`` on.

  Args:
    logdir: the TensorBoard run directory.

  Returns:
    ``(step, tag, value)`` per scalar.
  """
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
  """Every scalar in one TensorBoard event file (both CRCs of every record are checked).

  Args:
    path: the event file.

  Returns:
    ``(step, tag, value)`` per scalar, in file order.
  """
  return _scalars(_events(path))


def _scalars(events: Iterable[Any]) -> list[tuple[int, str, float]]:
  return [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value
          if v.HasField("simple_value")]


def _events(path: str | os.PathLike) -> Iterable[Any]:
  """The ``Event`` protos of a TFRecord event file, read with tensorboardX's own protobuf
  classes and CRC."""
  from tensorboardX.proto import event_pb2  # optional: the train extra
  from tensorboardX.record_writer import masked_crc32c  # optional: the train extra
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
    """Appends a step's record to ``metrics.jsonl`` and its numbers to TensorBoard (process 0
    only).

    Args:
      record: the step's metrics, with its ``step``.
    """
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
  """The records of a JSON-lines file (``metrics.jsonl``).

  Args:
    path: the file.

  Returns:
    One dict per non-empty line.
  """
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_loss(records: Iterable[Mapping[str, Any]], png_path: str | os.PathLike,
              title: str = "zerojax training loss") -> str:
  """Draws the loss curve of ``records`` to a PNG.

  Args:
    records: metric records with ``step`` and ``loss`` (and ``eval_loss`` where evaluated,
      drawn as a second curve).
    png_path: the image to write.
    title: the plot's title.

  Returns:
    ``png_path`` as a string.
  """
  matplotlib = require("matplotlib", "the loss plot")
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # optional: the train extra (`require` named it)
  records = list(records)
  fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
  ax.plot([r["step"] for r in records],
          [r["loss"] if r["loss"] is not None else float("nan") for r in records], lw=1.5,
          label="train loss")
  evals = [r for r in records if r.get("eval_loss") is not None]
  if evals:
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", lw=1.5,
            ms=3, label="eval loss")
    ax.legend()
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(png_path)
  plt.close(fig)
  return os.fspath(png_path)


def throughput(records: Iterable[Mapping[str, Any]], tokens_per_step: float) -> float | None:
  """Tokens per second, zerojax's one definition (the progress bar, the run's final line and,
  over a single step, each ``metrics.jsonl`` record's ``tokens_per_sec``): the tokens of the
  steps after the first of ``records`` divided by the wall time from the first's completion on
  the device to the last's (`StepClock`'s ``elapsed_sec``). The first step is left out: it
  carries compilation and warm-up. ``None`` with fewer than two timed steps.

  Args:
    records: one process's run, in step order (a resumed run's ``elapsed_sec`` restarts).
    tokens_per_step: tokens in one step's global batch.

  Returns:
    Tokens per second, or ``None`` with fewer than two timed steps.
  """
  recs = [r for r in records if r.get("elapsed_sec") is not None]
  if len(recs) < 2:
    return None
  steps = recs[-1]["step"] - recs[0]["step"]
  dt = recs[-1]["elapsed_sec"] - recs[0]["elapsed_sec"]
  return tokens_per_step * steps / dt if steps > 0 and dt > 0 else None


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
    """Times a step by when its output is ready, on the clock's thread.

    Args:
      step: the step.
      output: any array the step returned.
    """
    self._queue.put((step, output))

  def _run(self) -> None:
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
    """When a step finished (waits for it).

    Args:
      step: a step given to `add`.

    Returns:
      Its ``time.perf_counter()``.
    """
    with self._cv:
      self._cv.wait_for(lambda: step in self._done)
      return self._done[step]

  def step_time(self, step: int) -> float | None:
    """How long a step took (waits for it).

    Args:
      step: a step given to `add`.

    Returns:
      Seconds between the completions of ``step - 1`` and ``step``; ``None`` for the first
      step timed.
    """
    end = self.done(step)
    with self._cv:
      start = self._done.get(step - 1)
    return None if start is None else end - start

  def close(self) -> None:
    self._queue.put(None)
    self._thread.join()


# Dense bf16 peak FLOP/s per chip, from the vendors' data sheets, by `device_kind` (the first
# entry contained in it wins: the more specific names first). MFU is the step's model FLOPs
# over this; a device not listed (CPU) has no MFU.
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
              ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("TPU v6 lite", 918e12),
              ("TPU v6e", 918e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12),
              ("TPU v5p", 459e12), ("TPU v5", 459e12), ("TPU v4", 275e12))


def peak_flops(device: Any) -> float | None:
  """``device``'s dense bf16 peak FLOP/s (`PEAK_FLOPS`), or ``None`` where unknown (CPU)."""
  kind = str(getattr(device, "device_kind", ""))
  return next((f for name, f in PEAK_FLOPS if name.lower() in kind.lower()), None)


def device_memory(devices: Iterable[Any]) -> tuple[int, int, int | None] | None:
  """``(bytes in use, peak bytes in use, limit)`` of the fullest of ``devices`` from
  ``memory_stats()``, or ``None`` where the backend reports none (CPU)."""
  best = None
  for d in devices:
    try:
      st = d.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats raise or return None
      st = None
    if st and "bytes_in_use" in st:
      row = (int(st["bytes_in_use"]), int(st.get("peak_bytes_in_use", st["bytes_in_use"])),
             int(st["bytes_limit"]) if st.get("bytes_limit") else None)
      best = row if best is None or row[0] > best[0] else best
  return best


def format_eta(seconds: float) -> str:
  """``H:MM:SS`` (``MM:SS`` under an hour)."""
  s = max(0, int(round(seconds)))
  h, m = divmod(s // 60, 60)
  return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m:02d}:{s % 60:02d}"


def log_line(rec: Mapping[str, Any], total: int, tokens_per_sec: float | None,
             mfu: float | None, memory: tuple[int, int, int | None] | None,
             compiled_peak: int | None) -> str:
  """One log line of a step: ``step 10/100  loss 2.3456  tokens/s 12,345  MFU 41.2%  memory
  1.20 GiB live (peak 1.50 GiB of 80.00 GiB)  compiled peak 1.40 GiB``, with ``loss scale
  65536`` after the loss under fp16 loss scaling; what is unknown (the first step's
  throughput, MFU and live memory on CPU) reads ``-``."""
  size = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"
  loss = rec.get("loss")
  parts = [f"step {rec['step']}/{total}", "loss " + ("-" if loss is None else f"{loss:.4f}"),
           "tokens/s " + ("-" if tokens_per_sec is None else f"{tokens_per_sec:,.0f}"),
           "MFU " + ("-" if mfu is None else f"{100 * mfu:.1f}%")]
  if rec.get("eval_loss") is not None:
    parts.insert(2, f"eval_loss {rec['eval_loss']:.4f}")
  if rec.get("loss_scale") is not None:  # fp16: the scale the step left for the next one
    ls = rec["loss_scale"]  # powers of 2 up to 2**64 in full, not 1.67772e+07
    parts.insert(2, "loss scale " + (f"{ls:.0f}" if ls == int(ls) else f"{ls:g}") + (
        f" ({rec['skipped_steps']} skipped)" if rec.get("skipped_steps") else ""))
  if memory is None:
    parts.append("memory -")
  else:
    used, peak, limit = memory
    parts.append(f"memory {size(used)} live (peak {size(peak)}"
                 + (f" of {size(limit)})" if limit else ")"))
  parts.append("compiled peak " + ("-" if compiled_peak is None else size(compiled_peak)))
  return "  ".join(parts)
