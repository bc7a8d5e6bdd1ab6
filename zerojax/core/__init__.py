"""What a train step needs, in the order data flows:

* set-up and decisions: `distributed` (start-up, with `launch_env`, the launcher's variables,
  `coordinator`, reaching process 0, `agreement`, the check that processes agree, and `peers`,
  the watch that stops every process when one is gone) ->
  `config` (with `validation`, what each field allows, and `mapping_file`, reading a settings
  file) -> `mesh` -> `plan` (with `leaves`, the leaf rule, `memory_kinds`, where state rests,
  and `report`, the plan as a table);
* the step: `formulation` (which of the two ways a model reaches its parameters, chosen
  through the plan) and `apply` (the model run that way) over `gather`
  (per-use boxes), `regather` (layer re-gathering), `rows` (row reads), `remat` (what a layer
  keeps), `pipeline` with `batchwise` (scanned layers one ahead, per device where a layer
  computes each batch row on its own), `zeropp` with `quantize` (ZeRO++ collectives) and
  `dtypes` (the compute dtype);
  `layout` (the gradient as the stage lays it out), `offload` (host-resident state), `grad`
  (accumulation) and `train_state`; `step` (the decorator) and `create` (sharded state);
* `budget` (does it fit), `placement` (existing parameters into the plan), `context`.

Core imports nothing from `zerojax.runtime`, `zerojax.tools` or `zerojax.models`
(tests/test_layout.py). Users import from `zerojax`.
"""

__all__: list[str] = []  # the modules are the API; `zerojax` re-exports the main names
