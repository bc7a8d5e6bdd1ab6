"""What a training run is asked to do: `TrainOptions` (and DeepSpeed's training keys),
the bundled corpus, and the error a non-finite gradient stops the loop with.

Beside `config_file` and `deepspeed`, which read these options from files, and apart from the
loop in `zerojax.tools.train`: reading options needs no JAX (`zerojax --help` lists them).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Mapping

from zerojax.core.config import ConfigError
from zerojax.runtime.extras import NOT_INSTALLED, check, unavailable
from zerojax.tools.bounds import SCHEDULER_BOUNDS, TRAIN_BOUNDS, check_values

__all__ = ["PACKAGE_DIR", "DEFAULT_CORPUS", "NonFiniteGradientsError", "TrainOptions",
           "OUTPUT_PACKAGES", "resolve_outputs", "SCHEDULERS", "check_scheduler",
           "apply_deepspeed_train", "deepspeed_train_fields"]


PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]  # zerojax/


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


# The options whose output needs a package of the ``train`` extra: ``(module, what it makes)``.
OUTPUT_PACKAGES = {"progress": ("tqdm", "the progress bar"),
                   "tensorboard": ("tensorboardX", "TensorBoard event files"),
                   "plot": ("matplotlib", "the loss plot")}


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
    scheduler: a DeepSpeed scheduler mapping (from `zerojax.tools.deepspeed`); overrides warmup/decay.
    b1, b2, eps, weight_decay, momentum: optimizer hyperparameters.
    seed: initialisation and data seed.
    corpus: text file to train on (bytes are tokens); default: the bundled corpus.
    out_dir: where metrics, event files, plot and run.json go.
    log_every: steps between metric fetches/progress-bar updates.
    progress: show the progress bar (``tqdm``).
    tensorboard: write TensorBoard event files (``tensorboardX``).
    plot: draw ``loss.png`` at the end (``matplotlib``).
      For these three, ``None`` (the default) means "when its package is installed": the run's
      first lines say which is off for want of it. ``True`` asks for it: the run stops before
      it starts if the package is missing (`zerojax.runtime.extras.MissingPackageError`).
    init_from: weights to start from (fine-tuning): a ``.npz`` of consolidated weights or a
      checkpoint directory (consolidated with ``zerojax.tools.export``).
    cpu_devices: simulated CPU devices when no accelerator is present (set before JAX starts).
    show_plan: print the sharding table and the per-device memory XLA measured.
    save_weights: write the final parameters to ``out_dir/weights.npz`` (consolidated, float32
      keys as in `flat_params`), e.g. for ``examples/finetune.py --init``. Sharded,
      resumable checkpoints are `zerojax.runtime.checkpoint`'s job.
    checkpoint_dir: save sharded checkpoints there (`zerojax.runtime.checkpoint.Checkpointer`: async,
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
  progress: bool | None = None
  tensorboard: bool | None = None
  plot: bool | None = None
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
      v = getattr(self, f)
      if not isinstance(v, bool) and not (v is None and f in OUTPUT_PACKAGES):
        auto = ", or null (when its package is installed)" if f in OUTPUT_PACKAGES else ""
        raise ConfigError(f"TrainOptions.{f}={v!r} is invalid: true or false{auto} (a "
                          "boolean; strings such as 'false' are not booleans)")
    check_values({f: getattr(self, f) for f in TRAIN_BOUNDS}, TRAIN_BOUNDS, "TrainOptions.{}")
    if self.scheduler:
      check_scheduler(self.scheduler, "TrainOptions.scheduler[{!r}]")
    if self.decay not in ("constant", "cosine"):
      raise ConfigError(f"TrainOptions.decay={self.decay!r} is invalid: 'constant' or 'cosine'")
    if self.optimizer not in ("adamw", "adam", "sgd", "lamb", "adagrad"):
      raise ConfigError(f"TrainOptions.optimizer={self.optimizer!r} is invalid: one of adamw, "
                        "adam, sgd, lamb, adagrad")

  @classmethod
  def fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def resolve_outputs(opts: TrainOptions) -> tuple[TrainOptions, list[str]]:
  """Decides ``progress``, ``tensorboard`` and ``plot`` before a run starts.

  Args:
    opts: the training options.

  Returns:
    ``(options, notes)``: ``opts`` with each of the three that is ``None`` set to whether its
    package is installed, and a line for the run's header per output left off for want of
    its package.

  Raises:
    MissingPackageError: an output set to ``True`` lacks its package.
  """
  needs, changes, notes = {}, {}, []
  for field, (module, what) in OUTPUT_PACKAGES.items():
    value = getattr(opts, field)
    if value is None:
      reason = unavailable(module)
      changes[field] = reason is None
      if reason is not None:
        state = reason if reason == NOT_INSTALLED else f"failing to import ({reason})"
        notes.append(f"note: {field} is off, so no {what}: {module!r} is {state} "
                     f"(pip install {module}; {field}=false leaves out this note)")
    elif value:
      needs[module] = f"{field}=true: {what}"
  check(needs, "this run")
  return dataclasses.replace(opts, **changes), notes


SCHEDULERS: dict[str, frozenset[str]] = {
    "WarmupLR": frozenset({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}),
    "WarmupDecayLR": frozenset({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                "total_num_steps", "warmup_type"}),
    "WarmupCosineLR": frozenset({"warmup_min_ratio", "cos_min_ratio", "warmup_num_steps",
                                 "total_num_steps", "warmup_type"}),
}
"""DeepSpeed's learning-rate schedulers zerojax runs, and the parameters each takes."""


def check_scheduler(params: Mapping[str, Any], key: str = "scheduler.params.{}") -> None:
  """Checks a DeepSpeed scheduler's parameters (``name`` and its params, as
  `TrainOptions.scheduler` holds them, or a file's ``scheduler.params``).

  Args:
    params: parameter values by name (``name``, the scheduler type, is skipped).
    key: how the error names a parameter, ``{}`` standing for its name.
  """
  check_values(params, SCHEDULER_BOUNDS, key)
  wt = params.get("warmup_type", "log")
  if wt not in ("log", "linear"):
    raise ConfigError(f"{key.format('warmup_type')}={wt!r} is invalid: 'log' or 'linear'")


def apply_deepspeed_train(opts: TrainOptions, train: Mapping[str, Any]) -> TrainOptions:
  """Folds a `DeepSpeedMapping.train` dict (optimizer, scheduler, ...) into ``opts``.

  Args:
    opts: the training options.
    train: the DeepSpeed mapping's training settings.

  Returns:
    A copy of ``opts`` with those settings applied.
  """
  return dataclasses.replace(opts, **deepspeed_train_fields(train))


def deepspeed_train_fields(train: Mapping[str, Any]) -> dict[str, Any]:
  """`TrainOptions` fields of a `DeepSpeedMapping.train` dict.

  Args:
    train: the DeepSpeed mapping's training settings (optimizer, scheduler, ...).

  Returns:
    ``{field: value}`` of the `TrainOptions` they set.
  """
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
