"""What a person drives: the `cli`, the local `launch`er, `export`, the `deepspeed` config
mapping, `config_file` loading, `estimate` (will it fit) and the `train`ing loop."""

__all__: list[str] = []  # the modules are the API; `zerojax` re-exports the main names
