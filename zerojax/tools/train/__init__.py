"""The training loop behind ``zerojax train`` and ``examples/train_gpt.py``, in pieces:

* `zerojax.tools.options` (beside this package: reading options needs no JAX): what a run is
  asked to do (`TrainOptions`, DeepSpeed's training keys, the bundled corpus);
* `zerojax.tools.train.loop`: the loop itself (`train`) and its run directory;
* `zerojax.tools.train.metrics`: ``metrics.jsonl``, TensorBoard event files, the loss curve, per-step
  timing and logging;
* `zerojax.tools.train.schedules`: learning-rate schedules and the optimizer;
* `zerojax.tools.train.params_io`: weights to and from ``.npz`` files and checkpoints.

The progress bar, plot and TensorBoard writer come with the ``train`` extra
(``pip install 'zerojax[train]'``).
"""

from zerojax.tools.options import (DEFAULT_CORPUS, PACKAGE_DIR, NonFiniteGradientsError,
                                   TrainOptions, apply_deepspeed_train, deepspeed_train_fields)
from zerojax.tools.train.metrics import (EventWriter, MetricsWriter, StepClock, is_main_process, log,
                                   plot_loss, read_events, read_jsonl, read_run_events, require,
                                   throughput)
from zerojax.tools.train.schedules import make_optimizer, make_schedule
from zerojax.tools.train.params_io import flat_params, infer_model, load_weights, save_weights
from zerojax.tools.train.loop import (Hook, ProgressBar, SaveCheckpoints, Task, TrainResult,
                                     WriteMetrics, nothing_sharded_note, resolve_config,
                                     setup_cpu_devices, train)

__all__ = ["PACKAGE_DIR", "DEFAULT_CORPUS", "NonFiniteGradientsError", "TrainOptions",
           "apply_deepspeed_train", "deepspeed_train_fields", "is_main_process", "log",
           "setup_cpu_devices", "require", "EventWriter", "read_run_events", "read_events",
           "MetricsWriter", "read_jsonl", "plot_loss", "nothing_sharded_note", "StepClock",
           "make_schedule", "make_optimizer", "flat_params", "save_weights", "infer_model",
           "load_weights", "Hook", "WriteMetrics", "ProgressBar", "SaveCheckpoints", "TrainResult",
           "Task", "resolve_config", "train", "throughput"]
