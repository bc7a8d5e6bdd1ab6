"""What runs beside the step: sharded `checkpoint`s, per-process `data`, `memory` measurement
of compiled steps (and TPU ahead-of-time compilation), and safetensors `weights`. Runtime
imports core, never `zerojax.models` or `zerojax.tools`."""

__all__: list[str] = []  # the modules are the API; `zerojax` re-exports the main names
