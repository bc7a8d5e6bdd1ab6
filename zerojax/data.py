"""`zerojax.data`: global batches whose rows each process reads for itself. `TextBatches` over a
byte corpus (`load_bytes`), `process_rows` for your own loader, and Hugging Face data for
fine-tuning: the checkpoint's tokenizer and chat template (`load_tokenizer`), documents packed
or padded into rows (`build_rows`) and their shuffled, resumable `Batches`.
"""

from zerojax.runtime.data import *  # noqa: F401,F403 - the public surface, re-exported
from zerojax.runtime.data import __all__ as _batches
from zerojax.tools.hf_data import *  # noqa: F401,F403
from zerojax.tools.hf_data import __all__ as _hf

__all__ = [*_batches, *_hf]
