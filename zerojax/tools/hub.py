"""Hugging Face Hub ids: a model named ``org/name`` read through ``huggingface_hub``, as the
Trainer takes it. Below the commands that use it (`zerojax.tools.finetune`,
`zerojax.tools.estimate`), so that neither imports the other."""

from __future__ import annotations

import os
import re

from zerojax.core.config import ConfigError

__all__ = ["resolve_model_dir"]

# A Hugging Face Hub id: "org/name" (not an existing path).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# What a fine-tuning run reads from a Hub repository (not PyTorch .bin/.pt weights).
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "tokenizer*"]


def resolve_model_dir(model: str) -> str:
  """A local checkpoint directory as it is; a Hub id (``Qwen/Qwen2.5-0.5B``) through
  ``huggingface_hub``: its snapshot in the local cache, downloaded first if missing (config,
  safetensors and tokenizer files only). ``HF_HUB_OFFLINE=1`` reads the cache only and
  ``HF_HUB_CACHE`` / ``HF_HOME`` say where it is, read when the run starts.

  Args:
    model: a directory, or a Hub id ``org/name``.

  Returns:
    the local directory holding the checkpoint.

  Raises:
    ConfigError: the id is in neither the cache nor (online) the Hub, or huggingface_hub is
      missing.
  """
  if os.path.isdir(model) or not _HUB_ID.match(model):
    return model
  try:
    import huggingface_hub  # optional: transformers brings it
    from huggingface_hub import errors
  except ImportError:
    raise ConfigError(f"model {model!r} is not a local directory; reading it as a Hugging Face "
                      "Hub id needs huggingface_hub (pip install huggingface_hub)") from None
  offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
  cache = os.environ.get("HF_HUB_CACHE") or (
      os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None)
  try:
    return huggingface_hub.snapshot_download(model, cache_dir=cache, local_files_only=offline,
                                             allow_patterns=_HUB_FILES)
  except errors.LocalEntryNotFoundError:
    where = cache or "the default Hugging Face cache"
    raise ConfigError(
        f"model {model!r} is not a local directory, and the Hub id is not in {where}"
        + (" (HF_HUB_OFFLINE=1: nothing is downloaded); download it once online "
           "(`huggingface-cli download " + model + "`), or pass the checkpoint directory"
           if offline else "; pass the checkpoint directory")) from None
  except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError,
          errors.HfHubHTTPError, OSError) as e:
    raise ConfigError(f"model {model!r} is not a local directory, and the Hugging Face Hub "
                      f"does not give it: {type(e).__name__}: {str(e).splitlines()[0]}") from None
