"""`zerojax.train`: the training loop behind ``zerojax train``. `train(config, TrainOptions(...))`
trains a GPT preset on a text file, or any model given as a `Task`; `Hook`s run beside it; a
run leaves ``metrics.jsonl``, TensorBoard event files, the loss curve and resumable
checkpoints.
"""

from zerojax.tools.train import *  # noqa: F401,F403 - the public surface, re-exported
from zerojax.tools.train import __all__  # noqa: F401
