"""`ShardingPlan`: one `NamedSharding` for every leaf of params, grads, optimizer state and batch.

The plan is derived from leaf shapes alone, so it needs no per-model rules:

* the **leaf rule** shards the largest dimension that divides evenly by the ``fsdp`` axis size
  (ties go to the later dimension, which keeps a scanned layer axis whole); a leaf with fewer
  than ``param_persistence_threshold`` elements, or no divisible dimension, stays replicated
  and the plan reports those bytes;
* user **rules** (regex on the leaf path -> PartitionSpec) and Flax **partitioning metadata**
  (``nn.Partitioned``, ``nnx.with_partitioning``) fix dimensions first; mesh axes named there
  (e.g. ``tensor``) are kept and ``fsdp`` goes on a remaining dimension.

Each parameter leaf gets two specs: ``sharded`` (with ``fsdp``) and ``gathered`` (``fsdp``
removed: the layout a layer computes with). A stage picks per state kind:

==========  ==========  ==========  ==========
stage       params      grads       opt state
==========  ==========  ==========  ==========
0           gathered    gathered    gathered
1           gathered    local (1)   sharded
2           gathered    sharded     sharded
3           sharded     sharded     sharded
==========  ==========  ==========  ==========

(1) At stage 1 each device holds its *local* (unreduced) gradient, full size (``gathered``),
through the backward pass, as the paper's and DeepSpeed's stage 1 do; `zerojax.value_and_grad`
reduces it once per optimizer step, straight into the optimizer's shards
(`ShardingPlan.grads_reduced`: a reduce-scatter). Stage 2 reduce-scatters each layer's gradient
during the backward pass instead.

Optimizer-state leaves that mirror a parameter (Adam's ``mu``/``nu``, ``MultiSteps``'
accumulators, anything found by path suffix with the same shape) take that parameter's plan;
other leaves (step counts, injected hyperparameters) go through the leaf rule.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.core import quantize as q
from zerojax.core.config import ConfigError, ZeroConfig
from zerojax.core.dtypes import reduce_dtype_of
from zerojax.core.memory_kinds import HOST, memory_kinds
from zerojax.core.backend import Backend, for_mesh
from zerojax.core.mesh import data_axes
from zerojax.core.pipeline import Pipeline
from zerojax.core import formulation as fm, report
from zerojax.core.leaves import (LeafPlan, LeafRule, as_shape, axes_of, flatten,
                                 metadata_specs, opt_param_index, path_str, plan_leaf,
                                 plan_opt_state, shard_bytes, unbox)

__all__ = ["LeafPlan", "ShardingPlan", "path_str", "state_fields"]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
  """Shardings of every piece of training state, for one config, mesh and model.

  Attributes:
    config: the `ZeroConfig`.
    mesh: the device mesh.
    params: `NamedSharding` tree of the parameters at rest.
    params_gathered: `NamedSharding` tree of the parameters as a layer computes with them.
    grads: `NamedSharding` tree of the gradients leaving the backward pass.
    opt_state: `NamedSharding` tree of the optimizer state at rest.
    leaves: one `LeafPlan` per parameter leaf, in tree order.
    opt_leaves: ``(path, shape, dtype, spec)`` per optimizer-state leaf.
    opt_param: per optimizer-state leaf, the index in ``leaves`` of the parameter it mirrors
      (same shape: Adam's moments, momentum), or ``None`` (step counts, factored statistics).
    backend: the compiler-dependent decisions (`zerojax.core.backend.Backend`), by default the
      mesh's devices'.
    nvme: with ``offload=NvmeOffload(...)``, the `zerojax.runtime.nvme.NvmeOptimizer` that
      streams the optimizer state from its files (`zerojax.create_train_state` sets it, and
      `zerojax.zero_step` steps through it); ``None`` otherwise. The plan's shardings and
      ``config`` are then the device part's, which keeps no optimizer state.
  """

  config: ZeroConfig
  mesh: Mesh
  params: PyTree
  params_gathered: PyTree
  grads: PyTree
  opt_state: PyTree
  leaves: tuple[LeafPlan, ...]
  opt_leaves: tuple[tuple[str, tuple[int, ...], Any, P], ...]
  opt_param: tuple[int | None, ...] = ()
  backend: Backend | None = None
  nvme: Any = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    if self.backend is None:  # frozen: set once, here
      object.__setattr__(self, "backend", for_mesh(self.mesh))

  # -- construction ---------------------------------------------------------------------------

  @classmethod
  def create(cls, config: ZeroConfig, mesh: Mesh, params: PyTree,
             tx: Any = None, opt_state: PyTree = None,
             trainable: Callable[[str], bool] | None = None,
             backend: Backend | None = None) -> "ShardingPlan":
    """Plans ``params`` (arrays, ShapeDtypeStructs, or Flax-boxed/NNX-Variable leaves).

    Args:
      config: the run's `ZeroConfig`.
      mesh: a mesh with an ``fsdp`` axis (see `zerojax.make_mesh`).
      params: the parameter tree; Flax partitioning metadata is read and stripped.
      tx: an optax ``GradientTransformation``; its state shapes are found with ``eval_shape``.
      opt_state: the optimizer state (or its shapes) if there is no ``tx``.
      trainable: ``path -> bool``; leaves it rejects are frozen (`LeafPlan.trainable`): laid
        out as the stage says, but counted with no gradient (the table marks them).
      backend: the compiler-dependent decisions; None: those of the mesh's devices
        (`zerojax.core.backend.for_mesh`).

    Returns:
      The plan.

    Raises:
      ConfigError: the mesh has no ``fsdp`` axis, a rule or partitioning metadata names a
        dimension that does not divide, or offload asks for a memory the devices lack.
      TypeError: ``backend`` is not a `zerojax.Backend`.
    """
    if "fsdp" not in mesh.axis_names:
      raise ConfigError(f"mesh axes {mesh.axis_names} have no 'fsdp' axis to shard over")
    if backend is not None and not isinstance(backend, Backend):
      raise TypeError(f"backend={backend!r} is invalid: a zerojax.Backend or None (the mesh's "
                      "devices')")
    _warn_nothing_to_shard(config, mesh)
    backend = backend if backend is not None else for_mesh(mesh)  # decided once, here
    rule = LeafRule(backend.persistence_threshold(config),
                    backend.shards_leading_dim and config.shards_params)
    param_kind, opt_kind = memory_kinds(config, mesh)
    meta_specs = metadata_specs(params, mesh)
    params = unbox(params)
    paths, flat, treedef = flatten(params)
    leaves = tuple(plan_leaf(config, mesh, p, x, meta_specs.get(p), rule)
                   for p, x in zip(paths, flat))
    if trainable is not None:
      leaves = tuple(lp if trainable(lp.path) else dataclasses.replace(lp, trainable=False)
                     for lp in leaves)

    def tree(specs, kind=None):
      return jax.tree.unflatten(treedef, [NamedSharding(mesh, s, memory_kind=kind)
                                          for s in specs])

    sharded = [lp.sharded for lp in leaves]
    gathered = [lp.gathered for lp in leaves]
    params_sh = tree(sharded if config.shards_params else gathered, param_kind)
    params_gathered = tree(gathered)
    grads_sh = tree(sharded if config.shards_grads else gathered)

    if opt_state is None and tx is not None:
      opt_state = jax.eval_shape(tx.init, jax.tree.map(as_shape, params))
    opt_sh, opt_leaves, opt_param = (None, (), ())
    if opt_state is not None:
      opt_param = opt_param_index(tx, opt_state, params, leaves)
      opt_sh, opt_leaves = plan_opt_state(config, mesh, opt_state, leaves, opt_param, opt_kind,
                                          rule)
    return cls(config, mesh, params_sh, params_gathered, grads_sh, opt_sh, leaves, opt_leaves,
               opt_param, backend)

  # -- shardings for other trees --------------------------------------------------------------

  @property
  def replicated(self) -> NamedSharding:
    """The `NamedSharding` that replicates a value on every device of the mesh."""
    return NamedSharding(self.mesh, P())

  @property
  def data_axes(self) -> tuple[str, ...]:
    """The mesh axes the batch is split over (``replica`` and ``fsdp``, those the mesh has)."""
    return data_axes(self.mesh)

  @property
  def data_parallel_size(self) -> int:
    """The number of batch shards: the product of the `data_axes`' sizes."""
    return math.prod(self.mesh.shape[a] for a in self.data_axes)

  @property
  def batch_sizes(self) -> tuple[int, int, int] | None:
    """``(train_batch_size, micro_batch_per_device, gradient_accumulation_steps)`` over this
    plan's data-parallel size, or ``None`` when the config sets no batch size (the batch fed
    to the step then does)."""
    c = self.config
    if c.train_batch_size is None and c.micro_batch_per_device is None:
      return None
    return c.batch_sizes(self.data_parallel_size)

  @property
  def accumulation_steps(self) -> int:
    """Micro-batches per optimizer step: from the batch rule when a batch size is given, else
    ``gradient_accumulation_steps`` (default 1) with the micro-batch taken from the batch."""
    b = self.batch_sizes
    return b[2] if b is not None else (self.config.gradient_accumulation_steps or 1)

  def batch(self, batch: PyTree = None) -> Any:
    """The batch's shardings: the leading (batch) dimension over all data-parallel axes.

    ``plan.batch()``: the ``NamedSharding`` of a batch's rows, as a data loader takes it
    (``TextBatches(..., sharding=plan.batch())``). ``plan.batch(tree)``: one sharding per leaf
    of a batch pytree (arrays or ``jax.ShapeDtypeStruct``s; scalars replicated), for
    ``jax.device_put`` or ``in_shardings``.

    Args:
      batch: a batch pytree, or ``None`` for the sharding of a batch's rows.

    Returns:
      A `NamedSharding` (``batch`` None), else a tree of them shaped like ``batch``.

    Raises:
      ConfigError: a leaf's leading dimension does not divide by the data-parallel size (the
        message names the leaf).
    """
    dp, spec = self.data_parallel_size, P(self.data_axes)
    if batch is None:
      return NamedSharding(self.mesh, spec)

    def one(path, x):
      shape = np.shape(x) if not hasattr(x, "shape") else x.shape
      if len(shape) == 0:
        return self.replicated
      if shape[0] % dp:
        raise ConfigError(f"batch leaf {path_str(path)!r} has leading dimension {shape[0]}, "
                          f"which does not divide by the data-parallel size {dp} "
                          f"(axes {self.data_axes}); use a multiple of {dp}")
      return NamedSharding(self.mesh, spec)

    return jax.tree_util.tree_map_with_path(one, batch)

  def state(self, state: PyTree) -> PyTree:
    """Shardings for a train state: ``.params`` and ``.opt_state`` from the plan, the rest
    (step counter, RNG keys, loss scale, ...) replicated.

    Args:
      state: a ``flax.training.train_state.TrainState``, any subclass or flax struct with
        ``params``/``opt_state`` fields, or a dict with those keys (a checkpoint item).

    Returns:
      The same kind of object as ``state``, each field replaced by its shardings.

    Raises:
      ValueError: ``state`` has ``opt_state`` but the plan was made without an optimizer.
      TypeError: ``state`` is neither a flax struct dataclass nor a dict.
    """
    changes = {}
    for name, value in state_fields(state).items():
      if name == "params":
        changes[name] = self.params
      elif name == "opt_state":
        if self.opt_state is None:
          raise ValueError("this ShardingPlan was created without an optimizer (tx)")
        changes[name] = self.opt_state
      else:
        changes[name] = jax.tree.map(lambda _: self.replicated, value)
    return changes if isinstance(state, Mapping) else state.replace(**changes)

  def nnx_state(self, state: PyTree) -> PyTree:
    """Shardings for ``nnx.state((model, optimizer))``: the model's ``nnx.Param`` variables
    take the plan's parameter shardings and the optimizer's ``opt_state`` variables the plan's
    optimizer-state shardings, both in tree order (the plan was made from the same trees;
    shapes are checked leaf for leaf); everything else (step counters, RNG state, batch
    statistics) is replicated.

    Args:
      state: ``nnx.state((model, optimizer))``.

    Returns:
      An ``nnx.State`` of `NamedSharding`s shaped like ``state``.

    Raises:
      TypeError: ``state`` is not an ``nnx.State``.
      ValueError: its parameters or optimizer state are not the trees the plan was made for.
    """
    if not isinstance(state, nnx.State):
      raise TypeError(f"nnx_state: state must be nnx.state((model, optimizer)), an nnx.State; "
                      f"got {type(state).__name__}")
    flat = list(nnx.to_flat_state(state))
    leaves, treedef = jax.tree.flatten(state)
    if len(flat) != len(leaves):
      raise ValueError(f"nnx_state: {len(flat)} variables but {len(leaves)} leaves")
    is_param = [p[0] == 0 and isinstance(v, nnx.Param) for p, v in flat]
    is_opt = [p[0] == 1 and len(p) > 1 and p[1] == "opt_state" for p, _ in flat]
    out = [self.replicated] * len(leaves)
    for mask, shardings, what in ((is_param, self.params, "parameters"),
                                  (is_opt, self.opt_state, "optimizer state")):
      want = jax.tree.leaves(shardings) if shardings is not None else []
      at = [i for i, m in enumerate(mask) if m]
      shapes = [tuple(jnp.shape(leaves[i])) for i in at]
      planned = ([tuple(lp.shape) for lp in self.leaves] if what == "parameters"
                 else [tuple(o[1]) for o in self.opt_leaves])
      if len(at) != len(want) or shapes != planned:
        raise ValueError(
            f"nnx_state: the state's {what} ({len(at)} leaves) are not the tree the plan was "
            f"made for ({len(want)} leaves); build the plan from the same model and optimizer "
            "(zerojax.create_nnx)")
      for i, sh in zip(at, want):
        out[i] = sh
    return jax.tree.unflatten(treedef, out)

  @property
  def params_on_host(self) -> bool:
    """Whether any parameter rests in host memory (``offload_params``)."""
    return any(s.memory_kind == HOST for s in jax.tree.leaves(self.params))

  @property
  def opt_state_on_host(self) -> bool:
    """Whether any optimizer-state leaf rests in host memory (``offload_optimizer``)."""
    return self.opt_state is not None and any(
        s.memory_kind == HOST for s in jax.tree.leaves(self.opt_state))

  # -- the decisions every other module reads ---------------------------------------------

  @property
  def params_sharded(self) -> bool:
    """Whether parameters rest sharded and are gathered where they are used (stage 3)."""
    return self.config.shards_params

  @property
  def live_layers(self) -> int:
    """How many of a scanned model's gathered layers may be live at once at stage 3:
    ``max_live_layers``, or where it is ``None`` the backend's (`Backend.live_layers`)."""
    return self.backend.default_live_layers(self.config)

  @property
  def pipeline(self) -> Pipeline | None:
    """How scanned layers gathered per use run one ahead (`zerojax.core.pipeline`): at stage 3
    with two live layers (`live_layers`) and a ``remat`` that re-runs each layer whole
    (``'auto'``, ``'full'``), on a mesh whose other axes than the data axes have size 1, without
    ZeRO++ (its own per-device collectives) or parameters on the host, on a backend that
    pipelines layers (`Backend.pipelines_layers`). ``None``: scanned
    layers gather inside their own iteration (``max_live_layers`` > 1 then unrolls the loop)."""
    c = self.config
    others = [a for a in self.mesh.axis_names if a not in self.data_axes]
    if (not self.backend.pipelines_layers or not self.params_sharded or self.live_layers < 2
        or c.remat.policy not in ("auto", "full") or c.quantized or c.offload_params
        or self.mesh.shape["fsdp"] < 2 or any(self.mesh.shape[a] > 1 for a in others)):
      return None
    return Pipeline(self.mesh, self.data_axes, reduce_dtype=reduce_dtype_of(c),
                    own_policies=c.remat.policy == "auto",
                    link_bandwidth=self.backend.link_bandwidth(self.mesh, "fsdp"))

  @property
  def local_grads(self) -> bool:
    """Whether each device keeps its local, unreduced gradient through the backward pass and
    reduces it once per optimizer step into the optimizer's shards (stage 1)."""
    return self.config.shards_opt_state and not self.config.shards_grads

  @property
  def gathers_per_use(self) -> bool:
    """Whether every model gathers each parameter where a layer reads it (`zerojax.core.gather`
    boxes), whatever the model: a setting that acts at each use
    (`ZeroConfig.per_use_settings`). For ``gather='auto'`` the model decides too
    (`zerojax.core.formulation.choose`)."""
    return self.config.per_use_settings

  def formulation(self, jaxpr: Any, linen: bool = True,
                  blocks: frozenset[tuple] = frozenset()) -> fm.Formulation:
    """How a traced model reaches its parameters on this plan's target.

    Args:
      jaxpr: the model's trace; ``None`` for an NNX model.
      linen: whether the trace is a linen model's (else a plain function's).
      blocks: the repeated blocks the linen trace found.

    Returns:
      The `zerojax.core.formulation.Formulation` that `zerojax.core.formulation.choose` picks.
    """
    return fm.choose(self, jaxpr, linen, blocks)

  @property
  def compiler_options(self) -> dict[str, Any] | None:
    """XLA options the stage needs on this backend, for the model a step expects before it is
    traced: at stage 3 on XLA:GPU, layers without scans gathered one matmul layer ahead. A
    step whose trace shows otherwise compiles with `compiler_options_for` its model."""
    return self.compiler_options_for(self.backend.prefetches_next_layer and self.params_sharded)

  def compiler_options_for(self, layers_ahead: bool, pipelined: Any = None,
                           in_checkpoints: bool = False, rows_ahead: int = 0
                           ) -> dict[str, Any] | None:
    """XLA options the stage needs on this backend for a step as its trace found it.

    Args:
      layers_ahead: whether the model's layers gathered one matmul layer ahead.
      pipelined: the largest scanned layer's `zerojax.core.pipeline.OneAhead` when scanned
        layers ran one ahead, else ``None``.
      in_checkpoints: whether some of the layers gathered ahead are inside the model's own
        checkpoints.
      rows_ahead: the bytes of the largest row a pure function's row matmuls gathered one
        ahead, 0 for none.

    Returns:
      The per-compile options (`Backend.options`), or ``None`` for none.
    """
    return self.backend.options(self.config, layers_ahead, pipelined, in_checkpoints,
                                rows_ahead)

  @property
  def grads_reduced(self) -> PyTree:
    """Where a step's gradient reduction lands: ``grads``, except with `local_grads`, which
    reduce-scatters once per optimizer step into the optimizer's sharded layout."""
    if not self.local_grads:
      return self.grads
    treedef = jax.tree.structure(self.grads)
    return jax.tree.unflatten(treedef, [NamedSharding(self.mesh, lp.sharded)
                                        for lp in self.leaves])

  def quantization(self) -> list[dict[str, tuple[int, int]]]:
    """Per parameter leaf, what ZeRO++ quantises (`zerojax.core.quantize`): ``{"weights": (blocks,
    padding), "gradients": (blocks, padding)}`` with the entries that apply (qwZ: the leaf is
    gathered; qgZ: its gradient is reduce-scattered). Blocks and padding are per device: the
    shard each device sends (qwZ), or each chunk it sends to its owner (qgZ), is blocked on its
    own and its last block zero-padded; a leaf smaller than a block is one padded block. This
    counts a leaf gathered whole; a stacked leaf that ``nn.scan`` gathers one layer at a time
    is blocked per layer (the compiled HLO's s8 bytes say what moved).

    Returns:
      One dict per parameter leaf, in tree order; empty where nothing is quantised.
    """
    c = self.config
    bs, n = c.quantize_block_size, self.mesh.shape["fsdp"]
    out = []
    for lp, gs in zip(self.leaves, jax.tree.leaves(self.grads)):
      d: dict[str, tuple[int, int]] = {}
      per_device = math.prod(lp.shape) // n
      if c.quantize_weights is not None and lp.is_sharded and c.shards_params:
        d["weights"] = (q.num_blocks(per_device, bs), q.padding(per_device, bs))
      if c.quantize_gradients is not None and lp.trainable and "fsdp" in axes_of(gs.spec):
        d["gradients"] = (q.num_blocks(per_device, bs), q.padding(per_device, bs))
      out.append(d)
    return out

  # -- reporting ------------------------------------------------------------------------------

  def bytes_per_device(self) -> dict[str, int]:
    """Per-device bytes of the training state.

    Returns:
      ``{"params", "grads", "opt_state", "params_host", "opt_state_host"}``: bytes per device
      resident in device memory, and those of params and optimizer state in host memory (a
      frozen leaf has no gradient).
    """
    out = {"params": 0, "grads": 0, "opt_state": 0, "params_host": 0, "opt_state_host": 0}
    for lp, ps, gs in zip(self.leaves, jax.tree.leaves(self.params),
                          jax.tree.leaves(self.grads)):
      key = "params_host" if ps.memory_kind == HOST else "params"
      out[key] += shard_bytes(lp.shape, lp.dtype, ps.spec, self.mesh)
      if lp.trainable:  # a frozen leaf has no gradient
        out["grads"] += shard_bytes(lp.shape, lp.dtype, gs.spec, self.mesh)
    if self.opt_state is not None:
      for (_, shape, dtype, spec), s in zip(self.opt_leaves, jax.tree.leaves(self.opt_state)):
        key = "opt_state_host" if s.memory_kind == HOST else "opt_state"
        out[key] += shard_bytes(shape, dtype, spec, self.mesh)
    return out

  def unsharded_bytes(self) -> dict[str, int]:
    """Bytes of parameter leaves left replicated over ``fsdp``.

    Returns:
      ``{reason: bytes}`` (`LeafPlan.reason`), the leaves' whole sizes.
    """
    out: dict[str, int] = {}
    for lp in self.leaves:
      if not lp.is_sharded:
        out[lp.reason] = out.get(lp.reason, 0) + lp.nbytes
    return out

  def table(self) -> str:
    """The plan as a readable table (`zerojax.core.report.table`).

    Returns:
      The text: one row per leaf group with its sharding and memory kind, and the totals.
    """
    return report.table(self)

  def dtypes_line(self) -> str:
    """The run's dtypes as they are (`zerojax.core.report.dtypes_line`).

    Returns:
      One line: the stored, compute and reduction dtypes.
    """
    return report.dtypes_line(self)

  def __str__(self) -> str:  # pragma: no cover - convenience
    return self.table()


_warned_nothing_to_shard = False


def state_fields(state: PyTree) -> dict[str, Any]:
  """The pytree fields of a train state.

  Args:
    state: a flax.struct dataclass train state, or a dict (a checkpoint item).

  Returns:
    ``{field name: value}`` of its pytree fields; a dict as it is (copied).

  Raises:
    TypeError: ``state`` is neither.
  """
  if isinstance(state, Mapping):
    return dict(state)
  if dataclasses.is_dataclass(state) and not isinstance(state, type):
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
            if f.metadata.get("pytree_node", True)}
  raise TypeError(f"zerojax expects a flax.struct dataclass train state (e.g. "
                  f"flax.training.train_state.TrainState) or a dict, got {type(state).__name__}")


def _warn_nothing_to_shard(config: ZeroConfig, mesh: Mesh) -> None:
  """Warns once per process when stage >= 1 is planned over an ``fsdp`` axis of size 1.

  Such a plan is valid (it is plain data parallelism) but shards nothing, which on a CPU-only
  machine usually means JAX started with its default single device.
  """
  global _warned_nothing_to_shard
  if not config.shards_opt_state or mesh.shape["fsdp"] > 1 or _warned_nothing_to_shard:
    return
  _warned_nothing_to_shard = True
  if mesh.size == 1:
    why = ("there is 1 device. On a CPU-only machine, simulate devices before JAX starts: "
           "jax.config.update('jax_num_cpu_devices', 8) or "
           "XLA_FLAGS=--xla_force_host_platform_device_count=8")
  else:
    why = (f"the mesh's {mesh.size} devices are on other axes; give 'fsdp' a size > 1 with "
           "mesh_shape")
  warnings.warn(f"zerojax: {config.label} planned over mesh {dict(mesh.shape)}: the "
                f"'fsdp' axis has size 1, so nothing is sharded; {why}", stacklevel=3)
