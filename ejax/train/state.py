"""The training state, created straight into its shardings.

Parameters are split by a trainable filter: trainable ones get fp32 master weights, an optimizer
state and (optionally) an EMA copy; frozen ones (GR00T's LLM) are kept as they are and never
touched by the optimizer. Full-size models are built abstractly first (nnx.eval_shape), their
shardings derived from the logical axis names, and then initialised by one jitted call whose
out_shardings place every shard directly on its device: no host ever holds the full model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict

from ejax.models.registry import ModelSpec, get_model_spec
from ejax.parallel import tree_shardings
from ejax.parallel.rules import Rules


@flax.struct.dataclass
class TrainState:
  step: jax.Array          # int32 scalar: optimizer updates applied
  params: nnx.State        # trainable parameters (master dtype)
  frozen: nnx.State        # non-trainable parameters
  rest: nnx.State          # other module state (RNG streams of dropout, counters)
  opt_state: optax.OptState
  ema_params: nnx.State | None
  rng: jax.Array           # base key; each step folds in its step number


@dataclasses.dataclass(frozen=True)
class ModelParts:
  """Everything static about the model that the step needs next to the state."""
  graphdef: nnx.GraphDef
  spec: ModelSpec
  config: ConfigDict


def trainable_filter(model_config: ConfigDict):
  """The model's own filter when it defines one (e.g. GR00T freezes its LLM), else all Params."""
  spec = get_model_spec(model_config.name)
  return spec.trainable_filter(model_config) if spec.trainable_filter else nnx.Param


def _cast_floats(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def make_init_fn(model_config: ConfigDict, train: ConfigDict, tx: optax.GradientTransformation):
  spec = get_model_spec(model_config.name)
  trainable = trainable_filter(model_config)

  def init(rng: jax.Array) -> TrainState:
    init_rng, state_rng = jax.random.split(rng)
    model = spec.create(model_config, nnx.Rngs(init_rng))
    _, params, frozen, rest = nnx.split(model, nnx.All(nnx.Param, trainable), nnx.Param, ...)
    params = _cast_floats(params, jnp.dtype(train.param_dtype))
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, frozen=frozen, rest=rest,
        opt_state=tx.init(params), ema_params=params if train.ema_decay > 0 else None,
        rng=state_rng)

  return init


def model_parts(model_config: ConfigDict) -> ModelParts:
  spec = get_model_spec(model_config.name)
  trainable = trainable_filter(model_config)
  abstract_model = nnx.eval_shape(lambda: spec.create(model_config, nnx.Rngs(0)))
  graphdef, *_ = nnx.split(abstract_model, nnx.All(nnx.Param, trainable), nnx.Param, ...)
  return ModelParts(graphdef=graphdef, spec=spec, config=model_config)


def abstract_train_state(model_config, train, tx, mesh: Mesh, rules: Rules):
  """(abstract TrainState, its shardings) without allocating anything."""
  init = make_init_fn(model_config, train, tx)
  abstract = jax.eval_shape(init, jax.random.key(0))
  return abstract, tree_shardings(abstract, mesh, rules)


def create_train_state(model_config, train, tx, mesh: Mesh, rules: Rules, seed: int) -> tuple[TrainState, Any]:
  """Initialises the state directly into its shardings; returns (state, shardings)."""
  _, shardings = abstract_train_state(model_config, train, tx, mesh, rules)
  init = jax.jit(make_init_fn(model_config, train, tx), out_shardings=shardings)
  with mesh:
    state = init(jax.random.key(seed))
  return state, shardings


def count_params(tree) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(tree))
