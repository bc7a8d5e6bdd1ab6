"""What a train step needs, in the order data flows: `distributed` set-up -> `config` -> `mesh`
-> `plan` -> `gather` (with `quantize` and `zeropp` for ZeRO++) -> `grad` -> `step`, with
`train_state`, `offload`, `placement`, `budget` and `context` beside them. Core imports nothing
from `zerojax.runtime` or `zerojax.tools` (tests/test_layout.py)."""

__all__: list[str] = []  # the modules are the API; `zerojax` re-exports the main names
