"""Host offload (ZeRO-Offload) through JAX memory kinds.

Offloaded state keeps its stage's sharding and only changes ``memory_kind`` to
``pinned_host``. Inside the step, XLA moves it to the device where it is used and back to the
host where the output sharding says so.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import optax
from jax.sharding import AbstractMesh, Mesh

from zerojax.core.config import ConfigError, ZeroConfig

from zerojax.core.plan import HOST

__all__ = ["DEVICE", "supported_memory_kinds", "memory_kinds", "on_device", "on_host",
           "put_like", "wrap_tx"]

DEVICE = "device"


def supported_memory_kinds(mesh: Mesh) -> frozenset[str]:
  """Memory kinds every device of ``mesh`` can address (local devices only are queried)."""
  kinds = None
  for d in mesh.devices.flat:
    if d.process_index != jax.process_index():
      continue
    try:
      ks = {m.kind for m in d.addressable_memories()}
    except Exception:  # backends without the memories API
      ks = {DEVICE}
    kinds = ks if kinds is None else kinds & ks
  return frozenset(kinds or ())


def memory_kinds(config: ZeroConfig, mesh: Mesh) -> tuple[str | None, str | None]:
  """``(param_kind, opt_kind)`` for the plan; ``None`` means the default (device) memory."""
  if config.optimizer_on_nvme:
    # A memory kind cannot say "in files": a plan of device or host memory for this config
    # would silently keep the optimizer state there.
    raise ConfigError(
        f"offload_optimizer='nvme' (nvme_path={config.nvme_path!r}) keeps the optimizer state "
        "in files, which zerojax.runtime.nvme streams through a host update: create the state "
        "with zerojax.runtime.nvme.create_train_state and step with the NvmeOptimizer it "
        "returns (nvme.step(train_step)); zerojax.create_train_state, zero_step and "
        "ShardingPlan.create place state in device or pinned_host memory only "
        "(offload_optimizer=True or False)")
  wants = config.offload_params or config.offload_optimizer
  if not wants:
    return None, None
  if isinstance(mesh, AbstractMesh):  # planning for devices that are not here
    return (HOST if config.offload_params else None, HOST if config.offload_optimizer else None)
  if HOST not in supported_memory_kinds(mesh):
    backend = mesh.devices.flat[0].platform
    msg = (f"offload asked for (offload_params={config.offload_params}, offload_optimizer="
           f"{config.offload_optimizer}) but the {backend!r} backend has no {HOST!r} memory; "
           f"it offers {sorted(supported_memory_kinds(mesh))}")
    if config.offload_fallback == "warn":
      warnings.warn(msg + "; keeping the state on device (offload_fallback='warn')")
      return None, None
    raise ConfigError(msg + "; set offload_fallback='warn' to fall back to device memory")
  return (HOST if config.offload_params else None, HOST if config.offload_optimizer else None)


def on_device(shardings: Any) -> Any:
  """The same shardings in device memory."""
  return jax.tree.map(lambda s: s.with_memory_kind(DEVICE), shardings)


def on_host(shardings: Any) -> Any:
  """The same shardings in ``pinned_host`` memory."""
  return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)


def _constrain_like(tree: Any, shardings: Any) -> Any:
  """``tree`` constrained leaf by leaf to ``shardings`` where it is the plan's parameter tree
  (same number of leaves, same shapes; an NNX ``State`` or a plain dict alike), else as is."""
  leaves, treedef = jax.tree.flatten(tree)
  specs = jax.tree.leaves(shardings)
  if len(leaves) != len(specs) or not all(
      hasattr(x, "shape") and len(s.spec) <= len(x.shape) for x, s in zip(leaves, specs)):
    return tree
  return jax.tree.unflatten(treedef, [jax.lax.with_sharding_constraint(x, s)
                                      for x, s in zip(leaves, specs)])


def put_like(tree: Any, shardings: Any) -> Any:
  """``jax.device_put`` of ``tree`` onto the plan's ``shardings``, matched leaf by leaf (an NNX
  ``State`` against the plan's tree of the same leaves)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [jax.device_put(x, s) for x, s in
                                      zip(leaves, jax.tree.leaves(shardings), strict=True)])


def wrap_tx(tx: optax.GradientTransformation, plan: Any, clip: float | None = None,
            params_fetched: bool = False) -> optax.GradientTransformation:
  """``tx`` whose update moves offloaded state to where the update runs, and back.

  * ``offload_optimizer``: the optimizer state comes from ``pinned_host`` to the device for the
    update and the new state goes back to the host; or, with ``optimizer_on_host``, gradients
    (and parameters) go to the host and the update itself runs there (``compute_on``).
  * ``offload_params``: updates are returned in host memory, where the parameters they are
    added to live; parameters used by the update (weight decay) are brought to the device.

  Whatever the offload, the gradients the update receives are first laid out as the plan's
  reduced gradients (`ShardingPlan.grads_reduced`): the partitioner then reduce-scatters each
  layer's gradient where the backward pass produces it (stages 2-3) instead of choosing a
  layout of its own, for any model and however the gradient was computed.

  ``params_fetched``: host-resident parameters were already brought to the device for the
  whole step (NNX), so updates stay on the device.

  ``clip`` clips the gradient to that global norm first (``optax.clip_by_global_norm``, which
  keeps no state, so the optimizer state is the one ``tx`` made): an NNX step's
  ``gradient_clipping``; linen states clip in `ZeroTrainState.apply_gradients`.

  Called inside the jitted step only; the state's own ``tx`` is left untouched.
  """
  cfg = plan.config

  def constrain(grads):
    if not plan.gathers_per_use:  # per use, each use's backward already laid its gradient out
      grads = _constrain_like(grads, plan.grads_reduced)
    if clip is not None:
      grads, _ = optax.clip_by_global_norm(clip).update(grads, optax.EmptyState())
    return grads

  opt_host = plan.opt_state_on_host
  params_host = plan.params_on_host and not params_fetched
  if not (cfg.offload_optimizer or cfg.offload_params) or not (opt_host or params_host):
    # No offload (or it fell back to device memory): only the gradient layout.
    return optax.GradientTransformationExtraArgs(
        tx.init, lambda grads, state, params=None, **kw: tx.update(
            constrain(grads), state, params, **kw))
  put = jax.device_put

  def update(grads, state, params=None):
    if not params_host:
      grads = constrain(grads)
    if cfg.optimizer_on_host and opt_host:
      from jax.experimental.compute_on import compute_on
      grads = put(grads, on_host(plan.grads))
      if params is not None:
        params = put(params, on_host(plan.params))
      with compute_on("device_host"):
        updates, new_state = jax.jit(tx.update)(grads, state, params)
      updates = put(updates, plan.params if params_host else on_device(plan.grads))
      return updates, new_state
    if opt_host:
      state = put(state, on_device(plan.opt_state))
    if params_host:
      # Gradients of host-resident parameters arrive typed as host memory (the transpose of
      # the per-layer fetch); the update reads them, and the parameters, on the device.
      grads = put(grads, on_device(plan.grads))
      if params is not None:
        params = put(params, on_device(plan.params))
    updates, new_state = tx.update(grads, state, params)
    if opt_host:
      new_state = put(new_state, plan.opt_state)
    if params_host:
      updates = put(updates, plan.params)
    return updates, new_state

  return optax.GradientTransformation(tx.init, update)
