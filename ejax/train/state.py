"""The training state, created straight into its shardings.

Parameters are split by a trainable filter: trainable ones get fp32 master weights, an optimizer
state and (optionally) an EMA copy; frozen ones (GR00T's LLM) are kept as they are and never
touched by the optimizer. The model is built with shape-only parameters (plan_train_state: seconds,
nothing of model size computed), the shardings come from the logical axis names, and materialize
makes the values straight into their shardings: imported weights where given (read_weights),
else each parameter's own initializer, drawn on the host where numpy knows it (see "Building the
state from shapes" below). make_init_fn, the whole init traced as one function, stays the
reference the tests compare against.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Hashable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict

from ejax.kernels.fp8 import Fp8History, prime_fp8_histories
from ejax.models import layers
from ejax.train import frozen_fp8 as frozen_fp8_lib
from ejax.train import host_init
from ejax.train.optim import cast_floats
from ejax.train import rows as embodiment_rows
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
  frozen_fp8: nnx.State | None = None  # train.frozen_fp8: FP8 copies of frozen kernels (frozen_fp8.py)


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


def compute_model(graphdef, params, frozen, rest, dtype, frozen_fp8=None) -> nnx.Module:
  """The model as the train step runs it: trained and frozen weights cast to the compute dtype (the
  gradients flow back through the cast to the fp32 master weights), and the frozen kernels with an
  FP8 copy (train.frozen_fp8) as that copy."""
  frozen = frozen_fp8_lib.substitute(cast_floats(frozen, dtype), frozen_fp8)
  return nnx.merge(graphdef, cast_floats(params, dtype), frozen, rest)


def optimizer_init(tx: optax.GradientTransformation, train: ConfigDict):
  """tx.init over what the train step updates: the parameters, their embodiment tables cut to
  train.embodiment_rows where it names rows (ejax/train/rows.py)."""
  rows = embodiment_rows.from_train(train)
  return (lambda params: tx.init(rows.view(params))) if rows else tx.init


def make_init_fn(model_config: ConfigDict, train: ConfigDict, tx: optax.GradientTransformation):
  spec = get_model_spec(model_config.name)
  trainable = trainable_filter(model_config)

  def init(rng: jax.Array) -> TrainState:
    init_rng, state_rng = jax.random.split(rng)
    model = spec.create(model_config, nnx.Rngs(init_rng))
    _, params, frozen, rest = nnx.split(model, nnx.All(nnx.Param, trainable), nnx.Param, ...)
    params = cast_floats(params, jnp.dtype(train.param_dtype))
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, frozen=frozen, rest=rest,
        opt_state=optimizer_init(tx, train)(params), ema_params=params if train.ema_decay > 0 else None,
        rng=state_rng)

  return init


def model_parts(model_config: ConfigDict) -> ModelParts:
  spec = get_model_spec(model_config.name)
  trainable = trainable_filter(model_config)
  abstract_model = nnx.eval_shape(lambda: spec.create(model_config, nnx.Rngs(0)))
  graphdef, *_ = nnx.split(abstract_model, nnx.All(nnx.Param, trainable), nnx.Param, ...)
  return ModelParts(graphdef=graphdef, spec=spec, config=model_config)


# --- Building the state from shapes -------------------------------------------------------------
#
# Tracing the whole model's creation under jit made XLA compile one random-init computation per
# parameter (1,500 for the full GR00T): 50 s on a 2-core CPU and 219 s on an H200 before the train
# step could even start compiling (one vmapped computation per kind of parameter still took over
# 200 s to compile on the H200). So the model is built with shape-only parameters
# (layers.deferred_init), each recording its initializer and the key the traced init would draw, and:
# - parameters whose initializer is one of jax.nn.initializers' are drawn with numpy on the host and
#   placed into their shardings (ejax.train.host_init): nothing to compile;
# - any other initializer runs on the device, one vmapped computation per group of parameters of the
#   same initializer, shape and dtype, with the traced init's keys (its values bit for bit);
# - the optimizer's state: the leaves tx.init gives as zeros (checked on a small stand-in of the
#   parameters) placed from the host, the others (train.compute_copy's bf16 weights) made by one
#   program of just them; the EMA as copies of the parameters;
# - loaded values (imported weights) are placed as they are and never initialised.


@dataclasses.dataclass
class StatePlan:
  """The train state's structure, shardings, and how to make every value, without any value yet."""
  abstract: TrainState      # jax.ShapeDtypeStructs
  shardings: TrainState     # NamedShardings
  params: nnx.State         # Variables holding ShapeDtypeStructs (deferred) or small concrete arrays
  frozen: nnx.State
  rest: nnx.State
  deferred: dict            # id(nnx.Param) -> (the Param, layers.DeferredInit)
  state_rng: jax.Array
  tx: optax.GradientTransformation
  opt_init: Any             # optimizer_init(tx, train)
  ema: bool
  graphdef: Any             # the model's nnx.GraphDef (split params, frozen, rest)


def _to_struct(x):
  return x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(x.shape, x.dtype)


def plan_train_state(model_config, train, tx, mesh: Mesh, rules: Rules, seed: int = 0) -> StatePlan:
  """Builds the model with shape-only parameters (nothing of model size is computed) and plans the state."""
  spec = get_model_spec(model_config.name)
  trainable = trainable_filter(model_config)
  init_rng, state_rng = jax.random.split(jax.random.key(seed))
  with layers.deferred_init() as deferred:
    model = spec.create(model_config, nnx.Rngs(init_rng))
  graphdef, params, frozen, rest = nnx.split(model, nnx.All(nnx.Param, trainable), nnx.Param, ...)
  param_dtype = jnp.dtype(train.param_dtype)

  def cast(x):
    x = _to_struct(x)
    return jax.ShapeDtypeStruct(x.shape, param_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

  abstract_params = jax.tree.map(cast, params)
  # train.frozen_dtype: store the frozen weights in this dtype (e.g. bfloat16 under LoRA, as openpi
  # does: half the memory of a frozen fp32 LLM); "" keeps the model's param_dtype.
  frozen_dtype = jnp.dtype(train.frozen_dtype) if train.get("frozen_dtype") else None

  def cast_frozen(x):
    x = _to_struct(x)
    floating = frozen_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
    return jax.ShapeDtypeStruct(x.shape, frozen_dtype) if floating else x

  ema = train.ema_decay > 0
  abstract = TrainState(
      step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
      frozen=jax.tree.map(cast_frozen, frozen), rest=jax.tree.map(_to_struct, rest),
      opt_state=jax.eval_shape(optimizer_init(tx, train), abstract_params),
      ema_params=abstract_params if ema else None,
      rng=_to_struct(state_rng),
      frozen_fp8=frozen_fp8_lib.plan(model, frozen) if train.get("frozen_fp8") else None)
  return StatePlan(abstract, tree_shardings(abstract, mesh, rules), params, frozen, rest, deferred, state_rng,
                   tx, optimizer_init(tx, train), ema, graphdef)


def abstract_train_state(model_config, train, tx, mesh: Mesh, rules: Rules):
  """(abstract TrainState, its shardings) without allocating anything."""
  plan = plan_train_state(model_config, train, tx, mesh, rules)
  return plan.abstract, plan.shardings


def _init_signature(init) -> Hashable:
  """Initializers are often closures made per layer (`normal(0.02)`); equal code and equal captured
  values are the same initializer."""
  if isinstance(init, functools.partial):
    signature = ("partial", _init_signature(init.func), init.args, tuple(sorted(init.keywords.items())))
  else:
    code = getattr(init, "__code__", None)
    if code is None:
      return ("object", id(init))
    cells = tuple(cell.cell_contents for cell in (init.__closure__ or ()))
    signature = ("function", code, cells, init.__defaults__, tuple(sorted((init.__kwdefaults__ or {}).items())))
  try:
    hash(signature)
  except TypeError:
    return ("object", id(init))
  return signature


@dataclasses.dataclass
class _Leaves:
  """Where each params / frozen leaf comes from: a group of same-kind initializers, or a value."""
  groups: dict          # group key -> list of (part, leaf index, DeferredInit)
  values: dict          # (part, leaf index) -> small concrete value made while building the model


def _sort_leaves(plan: StatePlan, skip) -> _Leaves:
  """Groups the deferred parameters by initializer, shape and dtype; `skip`: (part, index) to leave out."""
  is_var = lambda x: isinstance(x, nnx.Variable)
  groups, values = {}, {}
  for part in ("params", "frozen"):
    variables = jax.tree.leaves(getattr(plan, part), is_leaf=is_var)
    for index, variable in enumerate(variables):
      if (part, index) in skip:
        continue
      record = plan.deferred.get(id(variable))
      if record is None or record[0] is not variable:
        values[(part, index)] = variable.get_value()
        continue
      init = record[1]
      key = (_init_signature(init.init), init.shape, init.dtype, jax.random.key_impl(init.key))
      groups.setdefault(key, []).append((part, index, init))
  return _Leaves(groups, values)


def _device_program(plan: StatePlan, groups: list):
  """One jitted program making the parameters of `groups` (initializers numpy does not know): one
  vmapped init per group, with the traced init's keys. Returns (fn, abstract key inputs)."""
  targets = {part: jax.tree.leaves(getattr(plan.abstract, part)) for part in ("params", "frozen")}
  shardings = {part: jax.tree.leaves(getattr(plan.shardings, part)) for part in ("params", "frozen")}

  def build(keys_per_group):
    out = []
    for members, key_data in zip(groups, keys_per_group):
      first = members[0][2]
      make = lambda kd: first.init(jax.random.wrap_key_data(kd, impl=jax.random.key_impl(first.key)),
                                   first.shape, first.dtype)
      stacked = jax.vmap(make)(key_data)
      out += [stacked[row].astype(targets[part][index].dtype) for row, (part, index, _) in enumerate(members)]
    return out

  out_shardings = [shardings[part][index] for members in groups for part, index, _ in members]
  key_structs = [jax.ShapeDtypeStruct((len(members),) + jax.random.key_data(members[0][2].key).shape, jnp.uint32)
                 for members in groups]
  return jax.jit(build, out_shardings=out_shardings), key_structs


def _split_groups(leaves: _Leaves) -> tuple[list, list]:
  """(host jobs [(part, index, host init, DeferredInit)], device groups [members]) of the leaves."""
  host, device = [], []
  for members in leaves.groups.values():
    make = host_init.host_initializer(members[0][2].init)
    if make is None:
      device.append(members)
    else:
      host += [(part, index, make, init) for part, index, init in members]
  return host, device


def _zero_leaves(tx: optax.GradientTransformation, abstract_params) -> list[bool]:
  """Per leaf of tx.init's state, whether it starts as zeros (Adam's moments and counts; not a
  compute-dtype copy of the weights), tried on a one-element stand-in of the parameters."""
  stand_in = jax.tree.map(lambda x: jnp.ones((1,) * len(x.shape), x.dtype), abstract_params)
  return [not np.any(np.asarray(x)) for x in jax.tree.leaves(tx.init(stand_in))]


def _opt_init_program(plan: StatePlan):
  """(jitted fn of the parameters, indices) making the optimizer state's leaves that do not start
  as zeros; None when all do. XLA leaves the zero leaves out of the program."""
  keep = [i for i, zero in enumerate(_zero_leaves(plan.tx, plan.abstract.params)) if not zero]
  if not keep:
    return None
  shardings = jax.tree.leaves(plan.shardings.opt_state)

  def made(params):
    leaves = jax.tree.leaves(plan.opt_init(params))
    return [leaves[i] for i in keep]

  return jax.jit(made, out_shardings=[shardings[i] for i in keep]), keep


def _prime_fp8_program(plan: StatePlan):
  """A jitted program (params, frozen, rest) -> rest with every delayed-scaling FP8 history's kernel
  row primed from its kernel (ejax.kernels.fp8.prime_fp8_histories), so the first step quantises the
  weights as later ones do; None when the model keeps no history (FP8 off, or another route)."""
  if not jax.tree.leaves(nnx.filter_state(plan.abstract.rest, Fp8History)):
    return None

  def prime(parts):
    model = nnx.merge(plan.graphdef, *parts)
    prime_fp8_histories(model)
    return nnx.split(model, nnx.Param, ...)[2]

  return jax.jit(prime, out_shardings=plan.shardings.rest)


def compile_state_init(plan: StatePlan) -> dict[str, float]:
  """Compiles every program creating the state needs, from shapes (nothing is allocated); seconds."""
  start = time.perf_counter()
  host, device = _split_groups(_sort_leaves(plan, {}))
  lowered_seconds = compile_seconds = 0.0
  programs = []
  if device:
    fn, key_structs = _device_program(plan, device)
    programs.append((fn, key_structs))
  opt_init = _opt_init_program(plan)
  if opt_init is not None:
    programs.append((opt_init[0], plan.abstract.params))
  prime = _prime_fp8_program(plan)
  if prime is not None:
    programs.append((prime, (plan.abstract.params, plan.abstract.frozen, plan.abstract.rest)))
  for fn, args in programs:
    lowered_at = time.perf_counter()
    lowered = fn.lower(args)
    compiled_at = time.perf_counter()
    lowered.compile()
    lowered_seconds += compiled_at - lowered_at
    compile_seconds += time.perf_counter() - compiled_at
  fp8_programs = 0
  if plan.abstract.frozen_fp8 is not None:  # train.frozen_fp8's small programs, lowered and compiled
    compiled_at = time.perf_counter()
    fp8_programs = frozen_fp8_lib.compile_programs(plan.abstract.frozen_fp8, plan.abstract.frozen,
                                                   plan.shardings.frozen, plan.shardings.frozen_fp8)
    compile_seconds += time.perf_counter() - compiled_at
  return {"host_initialised": len(host), "device_initialised": sum(map(len, device)), "device_groups": len(device),
          "programs": len(programs) + fp8_programs, "lower_seconds": lowered_seconds, "compile_seconds": compile_seconds,
          "seconds": time.perf_counter() - start}


def materialize(plan: StatePlan, loaded: dict | None = None) -> TrainState:
  """The state's values. `loaded` is a pure dict of some of the model's parameters (imported weights,
  read_weights): those are put in place and never initialised; every other parameter comes from its
  own initializer."""
  flat = {part: [None] * len(jax.tree.leaves(getattr(plan.abstract, part))) for part in ("params", "frozen")}
  for (part, index), value in _loaded_leaves(plan, loaded or {}).items():
    flat[part][index] = value
  leaves = _sort_leaves(plan, {(p, i) for p in flat for i, v in enumerate(flat[p]) if v is not None})
  targets = {part: jax.tree.leaves(getattr(plan.abstract, part)) for part in flat}
  shardings = {part: jax.tree.leaves(getattr(plan.shardings, part)) for part in flat}
  host, device = _split_groups(leaves)
  jobs = [(make, init.key, init.shape, targets[part][index].dtype, shardings[part][index])
          for part, index, make, init in host]
  for (part, index, _, _), value in zip(host, host_init.make_all(jobs)):
    flat[part][index] = value
  if device:
    fn, _ = _device_program(plan, device)
    keys = [np.stack([np.asarray(jax.random.key_data(init.key)) for _, _, init in members]) for members in device]
    members = [(part, index) for group in device for part, index, _ in group]
    for (part, index), value in zip(members, fn(keys)):
      flat[part][index] = value
  for (part, index), value in leaves.values.items():
    flat[part][index] = host_init.place_value(np.asarray(value).astype(targets[part][index].dtype),
                                              shardings[part][index])
  params, frozen = (jax.tree.unflatten(jax.tree.structure(getattr(plan.abstract, part)), flat[part])
                    for part in ("params", "frozen"))
  opt_init = _opt_init_program(plan)
  made = dict(zip(opt_init[1], opt_init[0](params))) if opt_init else {}
  opt_leaves = [made[i] if i in made else host_init.zeros(x, sharding) for i, (x, sharding) in
                enumerate(zip(jax.tree.leaves(plan.abstract.opt_state), jax.tree.leaves(plan.shardings.opt_state)))]
  opt_state = jax.tree.unflatten(jax.tree.structure(plan.abstract.opt_state), opt_leaves)
  ema = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), params) if plan.ema else None
  copies = plan.abstract.frozen_fp8
  rest = jax.tree.map(host_init.place_value, plan.rest, plan.shardings.rest)
  prime = _prime_fp8_program(plan)
  if prime is not None:
    rest = prime((params, frozen, rest))
  return TrainState(step=host_init.zeros(plan.abstract.step, plan.shardings.step), params=params, frozen=frozen,
                    rest=rest, opt_state=opt_state,
                    ema_params=ema, rng=host_init.place_value(plan.state_rng, plan.shardings.rng),
                    frozen_fp8=None if copies is None else frozen_fp8_lib.make(copies, frozen, plan.shardings.frozen_fp8))


def _leaf_paths(plan: StatePlan) -> dict:
  """"a/b/0/kernel" -> (part, leaf index, target ShapeDtypeStruct, sharding) for every parameter."""
  out = {}
  for part in ("params", "frozen"):
    abstract = getattr(plan.abstract, part)
    shardings = jax.tree.leaves(getattr(plan.shardings, part))
    for index, ((path, _), target) in enumerate(zip(nnx.to_flat_state(abstract), jax.tree.leaves(abstract))):
      out["/".join(map(str, path))] = (part, index, target, shardings[index])
  return out


def _flat_pure(pure: dict, prefix: str = "") -> dict:
  out = {}
  for key, value in pure.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(_flat_pure(value, name + "/"))
    else:
      out[name] = getattr(value, "value", value)
  return out


def _loaded_leaves(plan: StatePlan, loaded: dict) -> dict:
  """(part, leaf index) -> value in its sharding, for every value of `loaded` (a pure dict of the
  model's parameters, trainable and frozen together, as the convert job writes them); checks each."""
  paths = _leaf_paths(plan)
  out = {}
  for name, value in _flat_pure(loaded).items():
    if name not in paths:
      raise ValueError(f"loaded value {name} has no parameter in the model")
    part, index, target, sharding = paths[name]
    if tuple(value.shape) != tuple(target.shape):
      raise ValueError(f"loaded value {name} has shape {tuple(value.shape)}, the model needs {tuple(target.shape)}")
    if isinstance(value, jax.Array) and value.sharding == sharding and value.dtype == target.dtype:
      out[(part, index)] = value
    else:
      out[(part, index)] = host_init.place(np.asarray(value, target.dtype), sharding)
  return out


def read_weights(directory: str, plan: StatePlan) -> dict:
  """Starting weights, restored straight into the plan's dtypes and shardings; a pure dict for
  materialize(plan, loaded). `directory` holds either the convert job's import (an orbax checkpoint
  of the model's nnx.Param state) or a train run's checkpoints (its newest step's weights, EMA ones
  if it kept them, start a new run: a LoRA fine-tune of a trained policy, say).

  Parameters the checkpoint lacks (new LoRA adapters, say) are left to their initializers (how many
  is logged); a tensor the model does not have, or of another shape, is a one-line error."""
  import orbax.checkpoint as ocp
  from absl import logging

  from ejax.errors import UserError
  path = os.path.abspath(os.path.expanduser(directory))
  if not os.path.isdir(path):
    raise UserError(f"train.init_weights={directory!r} is not a directory: give the destination of the convert "
                    "job (--config.job=convert --config.convert.direction=import) or a train run's checkpoints")
  train_state = _train_checkpoint_state(path)
  checkpointer = ocp.StandardCheckpointer()
  try:
    saved = checkpointer.metadata(train_state or path).item_metadata.tree
  except Exception as error:  # not an orbax checkpoint, or a damaged one
    raise UserError(f"train.init_weights={directory!r} is not an orbax checkpoint of imported weights ({error}): "
                    "write one with the convert job") from None
  paths = _leaf_paths(plan)

  def target(tree, prefix=""):
    out = {}
    for key, value in tree.items():
      name = f"{prefix}{key}"
      if isinstance(value, dict):
        out[key] = target(value, name + "/")
        continue
      if name not in paths and name.endswith("/value"):  # a train state keeps nnx Variables' {"value": ...}
        name = name[:-len("/value")]
      if name not in paths:
        raise UserError(f"train.init_weights: tensor {name} {tuple(value.shape)} has no parameter in config.model: "
                        "import weights of the same model and size")
      _, _, struct, sharding = paths[name]
      if tuple(value.shape) != tuple(struct.shape):
        raise UserError(f"train.init_weights: tensor {name} has shape {tuple(value.shape)}, config.model needs "
                        f"{tuple(struct.shape)}: import weights of the same model and size")
      out[key] = jax.ShapeDtypeStruct(struct.shape, struct.dtype, sharding=sharding)
    return out

  if train_state is None:
    restored = checkpointer.restore(path, target(saved))
  else:
    # A train state: the model's weights are its trained part (EMA when kept) plus its frozen part;
    # the optimizer state and the rest stay on disk.
    weights = "ema_params" if isinstance(saved.get("ema_params"), dict) and saved["ema_params"] else "params"
    wanted = {weights: target(saved[weights]), "frozen": target(saved.get("frozen") or {})}
    state = ocp.PyTreeCheckpointer().restore(train_state, args=ocp.args.PyTreeRestore(
        item=wanted, restore_args=ocp.checkpoint_utils.construct_restore_args(wanted), partial_restore=True))
    restored = _merge_trees(_strip_values(state[weights]), _strip_values(state["frozen"]))
  missing = len(paths) - len(_flat_pure(restored))
  logging.info("initial weights %s: %d parameters loaded, %d left to their initializers", directory,
               len(paths) - missing, missing)
  return restored


def _train_checkpoint_state(path: str) -> str | None:
  """The state item of the newest step when `path` is a train run's checkpoints (or its workdir)."""
  from ejax.checkpoint.kinds import TRAIN, checkpoint_kind, numbered
  for candidate in (path, os.path.join(path, "checkpoints")):
    if checkpoint_kind(candidate) == TRAIN:
      return os.path.join(candidate, str(numbered(candidate)[-1]), "state")
  return None


def _strip_values(tree):
  """{"kernel": {"value": x}} -> {"kernel": x} (nnx Variables in a saved state)."""
  if isinstance(tree, dict):
    if set(tree) == {"value"} and not isinstance(tree["value"], dict):
      return tree["value"]
    return {key: _strip_values(value) for key, value in tree.items()}
  return tree


def _merge_trees(a: dict, b: dict) -> dict:
  out = dict(a)
  for key, value in b.items():
    out[key] = _merge_trees(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
  return out


def create_train_state(model_config, train, tx, mesh: Mesh, rules: Rules, seed: int) -> tuple[TrainState, Any]:
  """Initialises the state directly into its shardings; returns (state, shardings)."""
  plan = plan_train_state(model_config, train, tx, mesh, rules, seed)
  state = materialize(plan)
  return state, plan.shardings


def count_params(tree) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(tree))
