"""Host offload (ZeRO-Offload) through JAX memory kinds.

Offloaded state keeps its stage's sharding and only changes ``memory_kind`` to
``pinned_host``. Inside the step, XLA moves it to the device where it is used and back to the
host where the output sharding says so.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from zerojax._compat import compute_on_host
from zerojax.core.layout import apply_before, prepared
from zerojax.core.memory_kinds import on_device, on_host

__all__ = ["put_like", "wrap_tx"]


def put_like(tree: Any, shardings: Any) -> Any:
  """``jax.device_put`` of ``tree`` onto the plan's ``shardings``, matched leaf by leaf (an NNX
  ``State`` against the plan's tree of the same leaves)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [jax.device_put(x, s) for x, s in
                                      zip(leaves, jax.tree.leaves(shardings), strict=True)])


def wrap_tx(tx: optax.GradientTransformation, plan: Any,
            prepare: optax.GradientTransformation, params_fetched: bool = False
            ) -> optax.GradientTransformation:
  """``tx`` whose update moves offloaded state to where the update runs, and back, with the
  stateless ``prepare`` (`zerojax.core.layout.prepare`) applied to the gradients first.

  * ``offload_optimizer``: the optimizer state comes from ``pinned_host`` to the device for the
    update and the new state goes back to the host; or, with ``optimizer_on_host``, gradients
    (and parameters) go to the host and the update itself runs there (``compute_on``).
  * ``offload_params``: updates are returned in host memory, where the parameters they are
    added to live; parameters used by the update (weight decay) are brought to the device.

  ``params_fetched``: host-resident parameters were already brought to the device for the
  whole step (NNX), so updates stay on the device.

  Called inside the jitted step only; the state's own ``tx`` is left untouched.
  """
  cfg = plan.config
  opt_host = plan.opt_state_on_host
  params_host = plan.params_on_host and not params_fetched
  if not (cfg.offload_optimizer or cfg.offload_params) or not (opt_host or params_host):
    # No offload (or it fell back to device memory): only the gradients' preparation.
    return apply_before(prepare, tx)
  put = jax.device_put

  def update(grads, state, params=None):
    if not params_host:
      grads = prepared(prepare, grads, params)
    if cfg.optimizer_on_host and opt_host:
      return _update_on_host(tx, plan, grads, state, params, params_host)
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


def _update_on_host(tx, plan, grads, state, params, params_host):
  """``optimizer_on_host``: the update runs on the host, next to the optimizer state."""
  put = jax.device_put
  grads = put(grads, on_host(plan.grads))
  if params is not None:
    params = put(params, on_host(plan.params))
  updates, new_state = compute_on_host(tx.update)(grads, state, params)
  updates = put(updates, plan.params if params_host else on_device(plan.grads))
  return updates, new_state
