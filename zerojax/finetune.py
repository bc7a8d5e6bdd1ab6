"""`zerojax.finetune`: ``zerojax finetune`` in Python. `finetune(FinetuneOptions(model_dir,
data, ...), config_path, overrides)` fine-tunes a Hugging Face checkpoint directory (Llama,
Qwen2, Qwen3, Mistral) on local data and exports the result; `finetune_task` is its model and
data as a `zerojax.train.Task`.
"""

from zerojax.tools.finetune import *  # noqa: F401,F403 - the public surface, re-exported
from zerojax.tools.finetune import __all__  # noqa: F401
