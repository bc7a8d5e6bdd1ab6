"""State creation: a linen train state or an NNX (model, optimizer) built directly in its
sharded layout, from the model's init or from existing parameters.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax.core import meta
from flax.training import train_state as ts

from flax import nnx

from zerojax.core import budget
from zerojax.core.backend import Backend
from zerojax.core.config import ConfigError, ZeroConfig
from zerojax.core.dtypes import cast, cast_shapes
from zerojax.core.mesh import make_mesh
from zerojax.core.placement import place
from zerojax.core.plan import ShardingPlan, path_str
from zerojax.core.train_state import ZeroTrainState, nnx_loss_scaling

__all__ = ["create_train_state", "abstract_train_state", "state_initializer", "create_nnx",
           "abstract_nnx", "existing_params"]

PyTree = Any


def create_train_state(model: Any, tx: Any, rng: jax.Array, *init_args: Any,
                       config: ZeroConfig, mesh: jax.sharding.Mesh | None = None,
                       state_cls: type | None = None, params: Any = None,
                       backend: Backend | None = None, **init_kwargs: Any
                       ) -> tuple[ts.TrainState, ShardingPlan]:
  """Initialises a linen model's train state directly in its sharded layout.

  The init function is jitted with the plan's output shardings, so each device only ever
  computes and holds its own shards: the full parameters never exist on one device (the
  equivalent of ``deepspeed.zero.Init``).

  ``state_cls`` defaults to `zerojax.ZeroTrainState` (gradient clipping, loss scaling and step
  metrics from ``config``); a `ZeroTrainState` subclass gets ``config=config`` at creation.
  Inconsistent batch sizes in ``config`` fail here, before any device work.

  Args:
    model: the linen module.
    tx: the optax transformation.
    rng: the init's random key.
    *init_args: example inputs for ``model.init`` (arrays or ``jax.ShapeDtypeStruct``).
    config: the zerojax configuration.
    mesh: the device mesh; default ``make_mesh(config)``.
    state_cls: the train-state class; default `ZeroTrainState`.
    params: existing parameters instead of the model's init: see `existing_params`.
    backend: the compiler-dependent decisions (`zerojax.core.backend.Backend`); default the
      mesh's devices'.
    **init_kwargs: keyword arguments for ``model.init``.

  Returns:
    ``(state, plan)``: the sharded train state and its `ShardingPlan`.

  Raises:
    ValueError: ``model.init`` makes no ``'params'``.
    WeightsError: ``params`` does not match the model's parameters (a `ValueError`).
    TypeError: a parameter leaf is not floating point.
    ConfigError: ``model`` is not a linen module, ``config``'s batch sizes are inconsistent,
      or the plan cannot be made.
    DeviceMemoryError: the sharded state does not fit in the devices' memory.
  """
  make_state, plan, abstract = state_initializer(model, tx, rng, *init_args, config=config,
                                                 mesh=mesh, state_cls=state_cls,
                                                 backend=backend, **init_kwargs)
  # A state too big for the devices fails here, named, not as RESOURCE_EXHAUSTED in the init.
  budget.check_state_fits(plan, params=getattr(abstract, "params", None), tx=tx)
  if params is not None:
    return _state_from_params(make_state, plan, abstract, params, rng, init_args), plan
  state = jax.jit(make_state, out_shardings=plan.state(abstract))(rng, *init_args)
  return state, plan


def state_initializer(model: Any, tx: Any, rng: jax.Array, *init_args: Any,
                      config: ZeroConfig, mesh: jax.sharding.Mesh | None = None,
                      state_cls: type | None = None, backend: Backend | None = None,
                      **init_kwargs: Any):
  """The pieces `create_train_state` and a checkpoint restore target share; allocates nothing.

  Args:
    model: the linen module.
    tx: the optax transformation.
    rng: the init's random key.
    *init_args: example inputs for ``model.init``.
    config: the zerojax configuration.
    mesh: the device mesh; default ``make_mesh(config)``.
    state_cls: the train-state class; default `ZeroTrainState`.
    backend: the compiler-dependent decisions; default the mesh's devices'.
    **init_kwargs: keyword arguments for ``model.init``.

  Returns:
    ``(make_state, plan, abstract_state)``: ``make_state(rng, *init_args)`` builds the state,
    ``plan`` is its `ShardingPlan`, ``abstract_state`` its ``jax.ShapeDtypeStruct`` tree.

  Raises:
    ValueError: ``model.init`` makes no ``'params'``.
    TypeError: a parameter leaf is not floating point.
    ConfigError: ``model`` is not a linen module, ``config``'s batch sizes are inconsistent,
      or the plan cannot be made.
  """
  if isinstance(model, nnx.Module) or not callable(getattr(model, "init", None)):
    raise ConfigError(
        f"create_train_state takes a linen model (with .init); got {type(model).__name__}. "
        "For a Flax NNX model use zerojax.create_nnx(model_fn, tx, config=config)",
        field="model", value=type(model).__name__, allowed="a flax.linen.Module")
  mesh = make_mesh(config) if mesh is None else mesh
  pdtype = jnp.dtype(config.param_dtype)
  state_cls = ZeroTrainState if state_cls is None else state_cls
  extra = {"config": config} if issubclass(state_cls, ZeroTrainState) else {}

  def init_params(rng, *args):
    variables = model.init(rng, *args, **init_kwargs)
    if not jax.tree.leaves((variables or {}).get("params", {})):
      raise ValueError(
          f"create_train_state: {type(model).__name__}.init(...) made no parameters (its "
          f"collections: {sorted(variables or {})}); zerojax shards and trains a model's "
          "'params' collection, and this model has none. Check that its layers are called "
          "(an `nn.compact` method, or submodules used in __call__)")
    return variables["params"]

  boxed = jax.eval_shape(init_params, rng, *init_args)
  # A parameter leaf that is not floating point (an int counter, a bool mask) fails here,
  # named: jax.grad of the step would fail on it later, deep inside the trace.
  bad = []
  for path, x in jax.tree_util.tree_flatten_with_path(
      boxed, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))[0]:
    x = x.unbox() if isinstance(x, meta.AxisMetadata) else x
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      bad.append(f"{jax.tree_util.keystr(path)} ({x.dtype}{list(x.shape)})")
  if bad:
    raise TypeError(
        f"create_train_state: parameter leaves {', '.join(bad[:8])}"
        f"{f' and {len(bad) - 8} more' if len(bad) > 8 else ''} are not floating point; a "
        "train step differentiates every leaf of 'params' and jax.grad takes only float (or "
        "complex) leaves. Keep integer or boolean state in another collection (e.g. "
        "self.variable('state', ...)) or a constant, or make the leaf float")
  plan = ShardingPlan.create(config, mesh, cast_shapes(boxed, pdtype), tx, backend=backend)
  plan.accumulation_steps  # inconsistent batch sizes fail here

  def make_state(rng, *args):
    params = cast(meta.unbox(init_params(rng, *args)), pdtype)
    return state_cls.create(apply_fn=model.apply, params=params, tx=tx, **extra)

  return make_state, plan, jax.eval_shape(make_state, rng, *init_args)


def abstract_nnx(model_fn: Callable[[], Any], tx: Any, *, config: ZeroConfig,
                 mesh: jax.sharding.Mesh | None = None, wrt: Any = None):
  """`create_nnx` without allocating.

  For ``zero_step(plan)(...).lower`` on devices that can only be compiled for (a TPU or GPU
  topology).

  Args:
    model_fn: a no-argument function returning the ``nnx.Module`` (traced, not run).
    tx: the optax transformation.
    config: the zerojax configuration.
    mesh: the device mesh (abstract or real); default ``make_mesh(config)``.
    wrt: the NNX filter of the trained parameters (``nnx.Param`` by default).

  Returns:
    ``(model, optimizer, plan)`` whose variables are ``jax.ShapeDtypeStruct`` in the plan's
    sharded layout.
  """
  mesh = make_mesh(config) if mesh is None else mesh
  graphdef, abs_state, shardings, plan = _nnx_layout(model_fn, tx, config, mesh, wrt)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       abs_state, shardings)
  model, optimizer = nnx.merge(graphdef, state)
  return model, optimizer, plan


def _nnx_layout(model_fn, tx, config, mesh, wrt, backend=None):
  """``(graphdef, abstract state, shardings, plan)`` of an NNX model and its optimizer."""
  wrt = nnx.Param if wrt is None else wrt

  def build():
    model = model_fn()
    return model, nnx.Optimizer(model, tx, wrt=wrt)

  with jax.set_mesh(mesh):  # lets nnx.with_partitioning metadata resolve its mesh
    abs_model, abs_opt = nnx.eval_shape(build)
  planned, trainable = _nnx_planned(abs_model, wrt)
  plan = ShardingPlan.create(config, mesh, planned, opt_state=_nnx_values(abs_opt.opt_state),
                             trainable=trainable, backend=backend)
  graphdef, abs_state = nnx.split((abs_model, abs_opt))
  return graphdef, abs_state, plan.nnx_state(abs_state), plan


def abstract_train_state(model: Any, tx: Any, rng: jax.Array, *init_args: Any,
                         config: ZeroConfig, mesh: jax.sharding.Mesh | None = None,
                         state_cls: type | None = None, backend: Backend | None = None,
                         **init_kwargs: Any) -> tuple[Any, ShardingPlan]:
  """The restore target of `zerojax.create_train_state`, without allocating anything.

  Args:
    model: the linen module.
    tx: the optax transformation.
    rng: a random key (only its shape matters).
    *init_args: example inputs for ``model.init``.
    config: the zerojax configuration.
    mesh: the device mesh; default ``make_mesh(config)``.
    state_cls: the train-state class; default `zerojax.ZeroTrainState`.
    backend: the compiler-dependent decisions (`zerojax.core.backend.Backend`); default the
      mesh's devices'.
    **init_kwargs: keyword arguments for ``model.init``.

  Returns:
    ``(abstract_state, plan)``: a train state of ``jax.ShapeDtypeStruct`` leaves carrying the
    plan's shardings, and the plan. Pass both to `Checkpointer.restore`.

  Raises:
    ValueError: ``model.init`` makes no ``'params'``.
    TypeError: a parameter leaf is not floating point.
    ConfigError: ``model`` is not a linen module, ``config``'s batch sizes are inconsistent,
      or the plan cannot be made.
  """
  _, plan, abstract = state_initializer(model, tx, rng, *init_args, config=config, mesh=mesh,
                                        state_cls=state_cls, backend=backend,
                                        **init_kwargs)
  shardings = plan.state(abstract)
  with_sh = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         abstract, shardings)
  return with_sh, plan


def create_nnx(model_fn: Callable[[], Any], tx: Any, *, config: ZeroConfig,
               mesh: jax.sharding.Mesh | None = None, wrt: Any = None, params: Any = None,
               backend: Backend | None = None):
  """Builds an NNX ``(model, optimizer)`` directly in its sharded layout.

  Args:
    model_fn: a no-argument function returning the ``nnx.Module`` (it is traced, not run
      eagerly, so the full parameters never materialise on one device).
    tx: the optax transformation.
    config: the zerojax configuration.
    mesh: the device mesh; default ``make_mesh(config)``.
    wrt: the NNX filter of the trained parameters (``nnx.Param`` by default; e.g.
      ``nnx.LoRAParam`` trains adapters only). The other ``nnx.Param`` leaves are frozen: they
      are planned and sharded like the rest, but get no optimizer state (and no gradient when
      the step differentiates with the same filter); ``plan.table()`` marks them.
    params: existing parameters instead of the model's init: see `existing_params`.
    backend: the compiler-dependent decisions (`zerojax.core.backend.Backend`); default the
      mesh's devices'.

  Returns:
    ``(model, optimizer, plan)``; with ``config.loss_scale`` set, the optimizer carries the
    loss-scaling state as ``optimizer.loss_scaling``.

  Raises:
    WeightsError: ``params`` does not match the model's parameters (a `ValueError`).
    ConfigError: the plan cannot be made for ``config`` and the model.
  """
  mesh = make_mesh(config) if mesh is None else mesh
  wrt = nnx.Param if wrt is None else wrt

  def build():
    model = model_fn()
    return model, nnx.Optimizer(model, tx, wrt=wrt)

  graphdef, _, shardings, plan = _nnx_layout(model_fn, tx, config, mesh, wrt, backend)
  if params is not None:
    with jax.set_mesh(mesh):
      model, optimizer = nnx.merge(graphdef, _nnx_from_params(
          model_fn, tx, wrt, plan, shardings, params))
    return model, _with_loss_scaling(optimizer, config), plan

  @functools.partial(jax.jit, out_shardings=shardings)
  def init():
    return nnx.state(build())

  with jax.set_mesh(mesh):
    model, optimizer = nnx.merge(graphdef, init())
  return model, _with_loss_scaling(optimizer, config), plan


def _with_loss_scaling(optimizer: Any, config: ZeroConfig) -> Any:
  if config.loss_scale is not None:
    optimizer.loss_scaling = nnx_loss_scaling(config)
  return optimizer


def _nnx_values(tree):
  return jax.tree.map(lambda x: x.get_value() if isinstance(x, nnx.Variable) else x, tree,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def existing_params(params: Any, plan: ShardingPlan) -> tuple[list[jax.Array], tuple[bool, ...]]:
  """``params=`` of `create_train_state` / `create_nnx`, placed into ``plan.params``' layout.

  ``params`` is a pytree of numpy or jax arrays shaped like the model's parameters, or a lazy
  source with ``load(plan)`` (e.g. `zerojax.runtime.weights.safetensors_source`); each leaf goes
  straight into its shards (`zerojax.core.placement.place`). ``jax.ShapeDtypeStruct`` leaves mark
  parameters to take from the model's init (e.g. new LoRA adapters). The optimizer state is
  initialised from the given parameters, in its sharded layout, inside one jitted function
  whose random init of the given leaves is dead code that XLA removes (the model is only
  traced: ``eval_shape`` gives the structure). Given jax arrays are donated to the new state.

  Args:
    params: the parameters: a pytree of arrays (``jax.ShapeDtypeStruct`` for leaves to take
      from the init), or a source with ``load(plan)``.
    plan: the `ShardingPlan` whose ``params`` layout they go into.

  Returns:
    ``(arrays, given)``: the placed arrays, and per plan leaf whether it was given.

  Raises:
    WeightsError: a leaf is missing, extra, or of the wrong shape (raised by
      `zerojax.core.placement.place`).
  """
  leaves = jax.tree.leaves(place(params, plan))
  given = tuple(not isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  return [x for x, g in zip(leaves, given) if g], given


def _merge_given(init_leaves: list, arrays: list, given: tuple[bool, ...]) -> list:
  if len(init_leaves) != len(given):
    raise ValueError(f"the model has {len(init_leaves)} parameter leaves, the plan "
                     f"{len(given)}: was the plan made for this model?")
  it = iter(arrays)
  return [next(it) if g else x for x, g in zip(init_leaves, given)]


def _state_from_params(make_state, plan, abstract, params, rng, init_args):
  arrays, given = existing_params(params, plan)

  def make(arrays, rng, *args):
    state = make_state(rng, *args)
    leaves, treedef = jax.tree.flatten(state.params)
    new = jax.tree.unflatten(treedef, _merge_given(leaves, arrays, given))
    return state.replace(params=new, opt_state=state.tx.init(new))

  return jax.jit(make, out_shardings=plan.state(abstract), donate_argnums=0)(
      arrays, rng, *init_args)


def _nnx_planned(abs_model, wrt):
  """Every parameter (trained or frozen) is planned; ``trainable`` marks the ``wrt`` ones."""
  planned = nnx.state(abs_model, nnx.Any(nnx.Param, wrt))
  trained = {path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(
      _nnx_values(nnx.state(abs_model, wrt)))[0]}
  return planned, lambda path: path in trained


def _nnx_from_params(model_fn, tx, wrt, plan, shardings, params):
  arrays, given = existing_params(params, plan)

  @functools.partial(jax.jit, out_shardings=shardings, donate_argnums=0)
  def init(arrays):
    model = model_fn()
    state = nnx.state(model, nnx.Any(nnx.Param, wrt))
    leaves, treedef = jax.tree.flatten(_nnx_values(state))
    values = jax.tree.unflatten(treedef, _merge_given(leaves, arrays, given))
    nnx.update(model, values)
    return nnx.state((model, nnx.Optimizer(model, tx, wrt=wrt)))

  return init(arrays)
