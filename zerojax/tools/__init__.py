"""What a person drives: the `cli`, the local `launch`er, `export`, the `deepspeed` config
mapping, `config_file` loading, `estimate` (will it fit) and the `train`ing loop."""
