"""Child of `tests/core/test_compat.py`: prints, as JSON, what ``jax.lax.scan``,
``flax.linen.Module.apply`` and ``jax.checkpoint`` compute (jaxprs and values, forward and
under ``jax.grad``) for code outside any zerojax step. With ``zerojax`` as its argument it first
runs zerojax steps that trace a scan, a linen model's own ``apply`` and nested checkpoints."""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
import flax.linen as nn  # noqa: E402

FLAX_APPLY = nn.Module.apply  # Flax's own, taken before zerojax is imported
from jax._src.interpreters import partial_eval as pe  # noqa: E402
from jax.extend.core.primitives import remat_p  # noqa: E402

REMAT_RULE = pe.partial_eval_jaxpr_custom_rules[remat_p]  # JAX's own, likewise
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(16)(nn.LayerNorm()(x))
    return x + nn.Dense(8)(jax.nn.gelu(h)), None


class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    layers = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                     length=3)
    x, _ = layers()(x, None)
    inner = jax.checkpoint(lambda y: jnp.tanh(y @ y.T) @ y,
                           policy=jax.checkpoint_policies.dots_saveable)
    return jnp.mean(jax.checkpoint(lambda y: jnp.sin(inner(y)))(x))


def run_zerojax_steps(model, x) -> dict:
  import optax
  import zerojax
  from zerojax import _compat
  out, live = {}, {}
  for stage in (0, 3):
    config = zerojax.ZeroConfig(stage=stage, gather=zerojax.Gather(persistence_threshold=0))
    state, plan = zerojax.create_train_state(model, optax.adam(1e-2), jax.random.key(0), x,
                                             config=config)

    @zerojax.zero_step(plan)
    def step(state, batch):
      # While the step traces, zerojax's scan interceptor is in place; a linen model's own
      # apply is seen through Flax's scoped method interceptor, its own checkpoints are
      # rewritten in the traced model (`zerojax.core.remat.keeping_nested`).
      live.update(scan=jax.lax.scan is not _compat.ORIGINAL_SCAN,
                  apply=nn.Module.apply is not FLAX_APPLY,
                  remat_rule=pe.partial_eval_jaxpr_custom_rules[remat_p] is not REMAT_RULE)
      # The model's own apply, called by the step (zerojax intercepts it inside the step).
      loss, grads = jax.value_and_grad(lambda p: model.apply({"params": p}, batch))(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}

    for _ in range(2):
      state, metrics = step(state, x)
    out[f"zerojax_loss_stage{stage}"] = float(metrics["loss"])
  # After the steps, nothing of JAX's or Flax's is replaced: the objects are their own.
  out["live"] = live
  out["hooks"] = {"scan": jax.lax.scan is not _compat.ORIGINAL_SCAN,
                  "apply": nn.Module.apply is not FLAX_APPLY,
                  "remat_rule": pe.partial_eval_jaxpr_custom_rules[remat_p] is not REMAT_RULE}
  return out


def probes(model, x) -> dict:
  out = {}
  f = lambda c, v: (c * v + 1.0, jnp.sin(c) * v)
  scan = lambda v: jax.lax.scan(f, jnp.ones(()), v)
  xs = jnp.linspace(0.1, 0.9, 5)
  out["scan"] = str(jax.make_jaxpr(scan)(xs))
  out["scan_grad"] = str(jax.make_jaxpr(jax.grad(lambda v: scan(v)[0]))(xs))
  out["scan_value"] = np.asarray(jax.grad(lambda v: scan(v)[0])(xs)).tolist()
  variables = model.init(jax.random.key(1), x)
  out["apply"] = str(jax.make_jaxpr(model.apply)(variables, x))
  out["apply_grad"] = str(jax.make_jaxpr(jax.grad(model.apply))(variables, x))
  grads = jax.jit(jax.grad(model.apply))(variables, x)
  out["apply_grad_value"] = [np.asarray(g).tolist() for g in jax.tree.leaves(grads)]
  nested = jax.checkpoint(
      lambda y: jnp.sum(jax.checkpoint(lambda z: jnp.sin(z @ z), policy=(
          jax.checkpoint_policies.dots_saveable))(y) ** 2),
      policy=jax.checkpoint_policies.nothing_saveable)
  y = jnp.arange(16.0).reshape(4, 4) / 16
  out["checkpoint_grad"] = str(jax.make_jaxpr(jax.grad(nested))(y))
  out["checkpoint_value"] = np.asarray(jax.grad(nested)(y)).tolist()
  return out


def main() -> None:
  model = Model()
  x = jnp.linspace(-1, 1, 8 * 4).reshape(8, 4)
  out = run_zerojax_steps(model, x) if sys.argv[1:] == ["zerojax"] else {}
  out.update(probes(model, x))
  print(json.dumps(out))


if __name__ == "__main__":
  main()
