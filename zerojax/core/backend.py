"""`Backend`: every decision that depends on the compiler, as data.

A `zerojax.ShardingPlan` holds shardings and memory kinds. What differs between XLA:CPU,
XLA:GPU and XLA:TPU (how a gather waits for its input, whether layers are fetched ahead, how
many gathered layers may be live, the XLA options a stage needs, which leaves stay whole) is
one frozen `Backend`, chosen once per plan from its devices (`for_platform`) or passed to
`zerojax.ShardingPlan.create` to override. The reasons and measurements behind each value are
in ``docs/design.md`` and BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from zerojax._compat import xla_gpu_options
from zerojax.core.mesh import platform as mesh_platform
from zerojax.core.pipeline import OneAhead

__all__ = ["Backend", "CPU", "GPU", "TPU", "BACKENDS", "GPU_LINKS", "for_platform", "for_mesh"]


def _same(options: dict[str, Any]) -> dict[str, Any]:
  """The default `Backend.release_options`: a JAX release that needs no change.

  Args:
    options: the XLA options.

  Returns:
    ``options`` itself.
  """
  return options


@dataclasses.dataclass(frozen=True)
class Backend:
  """The compiler-dependent decisions of a plan.

  Attributes:
    name: the platform, as JAX names it (``'cpu'``, ``'gpu'``, ``'tpu'``).
    waits_by_barrier: a layer's gathers wait for its input by an optimization barrier
      (`zerojax.core.gather.after`); otherwise by a summed scalar of it, for compilers that
      remove barriers before they schedule.
    prefetches_next_layer: in a model without scans, each layer's gathers wait for the
      previous matmul layer's input, so they can run beside its matmuls
      (`zerojax.core.regather.prefetching`).
    prefetches_across_checkpoints: under ``prefetches_next_layer``, a layer whose previous
      matmul layer ran in another checkpoint gathers unordered rather than after its own input.
    model_checkpoint_prevents_cse: zerojax's checkpoint around a whole model without scans is a
      CSE barrier (``jax.checkpoint(prevent_cse=...)``).
    live_layers: how many gathered scanned layers may be live at once at stage 3 when
      ``max_live_layers`` is None.
    pipelines_layers: scanned layers may run one ahead (`zerojax.core.pipeline`) when two are
      live.
    per_use_from_stage: from this stage on, ``gather='auto'`` gathers every model per use (at
      stage 2 each parameter is read in place and its gradient reduce-scattered where the layer's
      backward pass makes it); None: only an unscanned linen model without its own remat is, at
      stage 3, and XLA's partitioner gathers the rest.
    orders_last_row_gradient: at stage 3 per use, a pure function's last row matmul of each
      stacked weight in the backward pass (`zerojax.core.rows`) makes the row's gradient
      before its input's, so that the row's reduce-scatter has that matmul to run beside.
    reads_rows_per_device: at stage 3 per use, a pure function's row of a stacked weight is
      sliced for its gather only once the row matmul's input exists on each device: the row
      index depends on that device's own first element of the input (`zerojax.core.rows`).
      An optimization barrier over the index orders nothing once the compiler removes the
      barrier and folds the index to a constant (XLA:GPU from jaxlib 0.12): every row is then
      sliced at the start and the first layers' gathers wait.
    finds_tables: at stages 2-3, a model's lookup tables are found and their gradients summed
      whole before they are sharded (`zerojax.core.formulation.lookup_tables`).
    shards_leading_dim: at stage 3, leaves of three or more dimensions shard their first
      dimension of at least a quarter the largest's size (`zerojax.core.leaves`).
    small_leaf_elements: the ``param_persistence_threshold`` a setting that gathers per use
      resolves ``None`` to.
    keeps_small_leaves_at_stage3: stage 3 resolves ``param_persistence_threshold=None`` to
      ``small_leaf_elements`` too.
    fused_attention: Llama attention in bfloat16 or float16 uses cuDNN's fused kernel by
      default (`zerojax.models.llama.fused_attention`).
    device_memory_is_host: device memory is host memory, so arrays can be read in place.
    compiler_options: XLA options every step on this compiler gets (None: none).
    sharded_optimizer_options: the options instead at stages 1-3, when set.
    layers_ahead_options: added for a model whose layers gathered one matmul layer ahead.
    layers_ahead_in_checkpoints_options: added instead when some of those layers ran inside the
      model's own checkpoints.
    rows_ahead_options: added for a pure function whose row matmuls gathered one ahead.
    wide_row_bytes: from this size of the largest row gathered ahead on, those options are
      `wide_rows_ahead_options` instead (None: never).
    wide_rows_ahead_options: the options for rows of at least `wide_row_bytes`.
    pipelined_options: the options instead for a step whose scanned layers ran one ahead; its
      combine thresholds are raised to the largest layer's collectives.
    gather_combine_option: the option naming the all-gather combine threshold in bytes.
    reduce_combine_option: the option naming the reduce-scatter combine threshold in bytes.
    flags_variable: the environment variable where a user sets this compiler's flags; a flag
      set there wins over the options here.
    release_options: maps options to what the installed JAX release's compiler takes.
    links: bytes/s per direction by device kind (``jax.Device.device_kind``): the link within
      a host and the network across hosts; for `link_bandwidth`.
  """

  name: str
  waits_by_barrier: bool = True
  prefetches_next_layer: bool = True
  prefetches_across_checkpoints: bool = False
  model_checkpoint_prevents_cse: bool = False
  live_layers: int = 1
  pipelines_layers: bool = True
  per_use_from_stage: int | None = 3
  orders_last_row_gradient: bool = False
  reads_rows_per_device: bool = True
  finds_tables: bool = True
  shards_leading_dim: bool = False
  small_leaf_elements: int = 4096
  keeps_small_leaves_at_stage3: bool = False
  fused_attention: bool = False
  device_memory_is_host: bool = False
  compiler_options: Mapping[str, Any] | None = None
  sharded_optimizer_options: Mapping[str, Any] | None = None
  layers_ahead_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  layers_ahead_in_checkpoints_options: Mapping[str, Any] = dataclasses.field(
      default_factory=dict)
  rows_ahead_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  wide_row_bytes: int | None = None
  wide_rows_ahead_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  pipelined_options: Mapping[str, Any] | None = None
  gather_combine_option: str | None = None
  reduce_combine_option: str | None = None
  flags_variable: str | None = None
  release_options: Callable[[dict[str, Any]], dict[str, Any]] = _same
  links: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.live_layers, int) or self.live_layers < 1:
      raise ValueError(f"Backend.live_layers={self.live_layers!r} is invalid: an int >= 1")
    if self.pipelined_options is not None and not (self.gather_combine_option
                                                   and self.reduce_combine_option):
      raise ValueError(f"Backend {self.name!r}: pipelined_options needs gather_combine_option "
                       "and reduce_combine_option")

  def persistence_threshold(self, config: Any) -> int:
    """``config.param_persistence_threshold``, with ``None`` resolved for this compiler.

    Args:
      config: a `zerojax.ZeroConfig`.

    Returns:
      The element count below which a leaf stays whole: the field when set; else
      ``small_leaf_elements`` where a setting gathers per use (or at stage 3 with
      ``keeps_small_leaves_at_stage3``), and 0 otherwise.
    """
    if config.param_persistence_threshold is not None:
      return config.param_persistence_threshold
    keeps = config.per_use_settings or (self.keeps_small_leaves_at_stage3
                                        and config.shards_params)
    return self.small_leaf_elements if keeps else 0

  def per_use_at(self, config: Any) -> bool:
    """Whether ``gather='auto'`` gathers every model per use at ``config.stage``
    (`per_use_from_stage`).

    Args:
      config: the run's `zerojax.ZeroConfig`.

    Returns:
      True where this compiler gathers per use from that stage on.
    """
    return self.per_use_from_stage is not None and config.stage >= self.per_use_from_stage

  def default_live_layers(self, config: Any) -> int:
    """Gathered scanned layers alive at once.

    Args:
      config: the run's `zerojax.ZeroConfig`.

    Returns:
      ``config.max_live_layers``, or this compiler's `live_layers` where it is None.
    """
    return config.max_live_layers if config.max_live_layers is not None else self.live_layers

  def link_bandwidth(self, mesh: Any, axis: str) -> float | None:
    """The bandwidth of the slowest link a group of devices along ``axis`` spans.

    Args:
      mesh: a ``jax.sharding.Mesh`` (an abstract mesh has no devices to read).
      axis: one of its axis names.

    Returns:
      bytes/s per direction from `links`: the network's where a group spans hosts
      (``jax.Device.process_index``), else the link's within a host; None where a device's kind
      is not in `links`.

    Raises:
      ValueError: ``axis`` is not one of the mesh's axis names.
    """
    if axis not in mesh.axis_names:
      raise ValueError(f"axis={axis!r} is invalid: one of the mesh's axes {list(mesh.axis_names)}")
    if not self.links or isinstance(mesh, jax.sharding.AbstractMesh):
      return None
    devices = mesh.devices
    figures = [self.links.get(getattr(d, "device_kind", None)) for d in devices.flat]
    if any(f is None for f in figures):
      return None
    along = list(mesh.axis_names).index(axis)
    groups = np.moveaxis(devices, along, -1).reshape(-1, devices.shape[along])
    spans_hosts = any(len({d.process_index for d in g}) > 1 for g in groups)
    return min(f[1] if spans_hosts else f[0] for f in figures)

  def options(self, config: Any, layers_ahead: bool = False, pipelined: Any = None,
              in_checkpoints: bool = False, rows_ahead: int = 0
              ) -> dict[str, Any] | None:
    """The XLA options a step compiles with on this compiler.

    Args:
      config: the step's `zerojax.ZeroConfig`.
      layers_ahead: the model (no scans) gathered its layers one matmul layer ahead.
      pipelined: for a step whose scanned layers ran one ahead, the largest layer's
        `zerojax.core.pipeline.OneAhead`; else None.
      in_checkpoints: some of the layers gathered ahead ran inside the model's own checkpoints.
      rows_ahead: the bytes of the largest row a pure function's row matmuls gathered one
        ahead, 0 for none (``True`` reads as a row under `wide_row_bytes`).

    Returns:
      The options, each option the user set in `flags_variable` left out, or None for none.

    Raises:
      TypeError: ``pipelined`` is neither None nor a ``OneAhead``.
    """
    if pipelined is not None and not isinstance(pipelined, OneAhead):
      raise TypeError(f"pipelined={pipelined!r} is invalid: the largest scanned layer's "
                      "zerojax.core.pipeline.OneAhead(gathered, reduced) bytes, or None")
    if config.shards_opt_state and self.sharded_optimizer_options is not None:
      return dict(self.sharded_optimizer_options)
    if self.compiler_options is None:
      return None
    if pipelined is not None and self.pipelined_options is not None:
      base = self.pipelined_options
      out = {**base,
             self.gather_combine_option: max(pipelined.gathered,
                                             base.get(self.gather_combine_option, 0)),
             self.reduce_combine_option: pipelined.reduced}
    elif rows_ahead and not layers_ahead:
      wide = self.wide_row_bytes is not None and rows_ahead >= self.wide_row_bytes
      out = {**self.compiler_options,
             **(self.wide_rows_ahead_options if wide else self.rows_ahead_options)}
    elif layers_ahead:
      out = {**self.compiler_options, **(self.layers_ahead_in_checkpoints_options
                                         if in_checkpoints else self.layers_ahead_options)}
    else:
      out = dict(self.compiler_options)
    out = self.release_options(out)
    user = set(re.findall(r"--(xla_\w+)", os.environ.get(self.flags_variable or "", "")))
    return {k: v for k, v in out.items() if k not in user} or None


CPU = Backend(
    name="cpu",
    # XLA:CPU removes optimization barriers before it schedules and runs nothing beside a
    # collective: fetching ahead would only hold a second layer.
    waits_by_barrier=False,
    reads_rows_per_device=False,
    prefetches_next_layer=False,
    model_checkpoint_prevents_cse=True,
    per_use_from_stage=None,
    finds_tables=False,
    device_memory_is_host=True,
    # Stages 1-3: each gradient is reduced as soon as it exists; XLA:CPU's combiner would hold
    # them all to the end of the backward pass, and it has no size threshold.
    sharded_optimizer_options={"xla_disable_hlo_passes": "cpu-all-reduce-combiner"},
)

# Per GPU and direction: NVLink within a host (the datasheets print both directions summed:
# H100 and H200 SXM 900 GB/s, A100 SXM 600 GB/s, HGX B200 1.8 TB/s); across hosts the reference
# system's NIC per GPU (DGX H100/H200/B200: one 400 Gb/s ConnectX-7 per GPU; DGX A100: one
# 200 Gb/s ConnectX-6).
GPU_LINKS: Mapping[str, tuple[float, float]] = types.MappingProxyType({
    "NVIDIA H100 80GB HBM3": (450e9, 50e9),
    "NVIDIA A100-SXM4-80GB": (300e9, 25e9),
    "NVIDIA H200 141GB HBM3e": (450e9, 50e9),
    "NVIDIA B200": (900e9, 50e9),
})

_GPU_DEFAULT = {"xla_gpu_enable_latency_hiding_scheduler": True,
                "xla_gpu_enable_pipelined_all_gather": True,
                "xla_gpu_enable_pipelined_reduce_scatter": True,
                "xla_gpu_enable_while_loop_double_buffering": True,
                "xla_gpu_reduce_scatter_combine_threshold_bytes": 1,
                "xla_gpu_all_gather_combine_threshold_bytes": 1 << 20}
_GPU_LAYERS_AHEAD = {"xla_gpu_enable_analytical_latency_estimator": True,
                     "xla_gpu_experimental_parallel_collective_overlap_limit": 8,
                     "xla_gpu_experimental_collective_start_as_early_as_possible": True}

GPU = Backend(
    name="gpu",
    prefetches_across_checkpoints=True,
    orders_last_row_gradient=True,
    live_layers=2,  # the next layer's gather beside the current layer's compute
    # Stage 2 per use: each layer's gradient is reduce-scattered inside the backward scan.
    per_use_from_stage=2,
    shards_leading_dim=True,
    fused_attention=True,
    compiler_options=_GPU_DEFAULT,
    layers_ahead_options=_GPU_LAYERS_AHEAD,
    # Inside a model's own checkpoints, starting collectives early held more re-gathers at once.
    layers_ahead_in_checkpoints_options={
        "xla_gpu_enable_analytical_latency_estimator": True,
        "xla_gpu_experimental_parallel_collective_overlap_limit": 32},
    # Small rows need five collectives in flight to keep the link busy. From 8 MiB a row moves
    # at link bandwidth, and more than two in flight only held more full-size gradients
    # waiting for their reduce-scatter.
    rows_ahead_options={"xla_gpu_experimental_parallel_collective_overlap_limit": 5},
    wide_row_bytes=8 << 20,
    wide_rows_ahead_options={"xla_gpu_experimental_parallel_collective_overlap_limit": 2},
    # The loops already hold each collective an iteration ahead: XLA's own pipelining and
    # double buffering would move them once more.
    pipelined_options={"xla_gpu_enable_latency_hiding_scheduler": True,
                       "xla_gpu_enable_analytical_latency_estimator": True,
                       "xla_gpu_reduce_scatter_combine_threshold_bytes": 1,
                       "xla_gpu_all_gather_combine_threshold_bytes": 1 << 20},
    gather_combine_option="xla_gpu_all_gather_combine_threshold_bytes",
    reduce_combine_option="xla_gpu_reduce_scatter_combine_threshold_bytes",
    flags_variable="XLA_FLAGS",
    release_options=xla_gpu_options,
    links=GPU_LINKS,
)

TPU = Backend(
    name="tpu",
    # ICI all-gather pipelining already issues a scanned layer's gather an iteration ahead.
    pipelines_layers=False,
    keeps_small_leaves_at_stage3=True,
    compiler_options={"xla_tpu_enable_ici_ag_pipelining": True},
    flags_variable="LIBTPU_INIT_ARGS",
)

BACKENDS: Mapping[str, Backend] = {b.name: b for b in (CPU, GPU, TPU)}


def for_platform(platform: str) -> Backend:
  """The `Backend` of a platform.

  Args:
    platform: a JAX platform name (``jax.Device.platform``); ``'cuda'`` and ``'rocm'`` name
      XLA:GPU.

  Returns:
    `CPU`, `GPU` or `TPU`.

  Raises:
    ValueError: the platform is none of these.
  """
  name = "gpu" if platform in ("cuda", "rocm") else platform
  if name not in BACKENDS:
    raise ValueError(f"platform={platform!r} is invalid: one of {sorted(BACKENDS)} "
                     "(or 'cuda', 'rocm')")
  return BACKENDS[name]


def for_mesh(mesh: Any) -> Backend:
  """The `Backend` of a mesh's devices (an abstract mesh's abstract device; without one, `CPU`).

  Args:
    mesh: a ``jax.sharding.Mesh`` or ``AbstractMesh``.

  Returns:
    `CPU`, `GPU` or `TPU`.
  """
  return for_platform(mesh_platform(mesh))
