"""What a person drives: the `cli`, the local `launch`er, `export`, the `deepspeed` config
mapping, `config_file` loading and the training `options` they read, `estimate` (will it
fit), the `train`ing loop and `finetune` (with its `hf_data`). The top layer: it may import
every other, and nothing below imports it."""

__all__: list[str] = []  # the modules are the API; `zerojax` re-exports the main names
