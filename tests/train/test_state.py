"""The train state built from shapes (issue 31 point 3): the same values as tracing the whole model's
init, without one random-init computation per parameter; loaded weights are placed, not initialised."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.parallel import make_mesh
from ejax.train import state as state_lib
from ejax.train.optim import make_optimizer
from tests.train.helpers import load_config, tiny_config


def _bits(x):
  return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def _traced_state(config, shardings, seed):
  tx, _ = make_optimizer(config.train)
  return jax.jit(state_lib.make_init_fn(config.model, config.train, tx), out_shardings=shardings)(jax.random.key(seed))


def _setup(config):
  mesh = make_mesh(config.mesh.to_dict())
  rules = [tuple(r) for r in config.sharding_rules]
  tx, _ = make_optimizer(config.train)
  return mesh, rules, tx


def _groot():
  return load_config("configs/groot.py", "runlocal,dataset=synthetic")


@pytest.mark.optimised  # at -O0 (the suite's default) the two programs round 1 ulp apart
@pytest.mark.parametrize("which", ["tiny", "groot"])
def test_device_initialised_state_equals_the_traced_init_bit_for_bit(which, monkeypatch):
  """Initializers numpy does not know run on the device with the traced init's keys: the same values."""
  monkeypatch.setattr(state_lib.host_init, "host_initializer", lambda init: None)
  config = tiny_config() if which == "tiny" else _groot()
  config.train.ema_decay = 0.99  # the EMA copy too
  mesh, rules, tx = _setup(config)
  plan = state_lib.plan_train_state(config.model, config.train, tx, mesh, rules, seed=5)
  built = state_lib.materialize(plan)
  traced = _traced_state(config, plan.shardings, seed=5)
  assert jax.tree.structure(built) == jax.tree.structure(traced)
  # Parameters made outside layers.make_param (tiny's position table and nnx.Embed: values written in
  # the module) are computed op by op while the model is built: equal up to the fused program's rounding.
  for part in ("params", "frozen", "opt_state", "ema_params", "rest", "step", "rng"):
    ours, theirs = getattr(built, part), getattr(traced, part)
    deferred = None
    if part in ("params", "frozen", "ema_params"):
      variables = jax.tree.leaves(getattr(plan, "params" if part == "ema_params" else part),
                                  is_leaf=lambda x: isinstance(x, nnx.Variable))
      deferred = [id(v) in plan.deferred for v in variables]
    for i, (a, b) in enumerate(zip(jax.tree.leaves(ours), jax.tree.leaves(theirs))):
      assert a.shape == b.shape and a.dtype == b.dtype and a.sharding == b.sharding
      if deferred is not None and not deferred[i]:
        np.testing.assert_allclose(_bits(a), _bits(b), rtol=1e-6, atol=1e-7)
      else:
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{part} leaf {i}")
  if which == "groot":
    leaves = state_lib._sort_leaves(plan, {})
    assert len(leaves.groups) <= 0.25 * len(plan.deferred) and not leaves.values


def test_host_drawn_parameters_follow_the_initializers_distributions():
  config = _groot()
  mesh, rules, tx = _setup(config)
  plan = state_lib.plan_train_state(config.model, config.train, tx, mesh, rules, seed=2)
  host, device = state_lib._split_groups(state_lib._sort_leaves(plan, {}))
  assert host and not device  # every GR00T initializer is one numpy draws: no program to compile
  assert state_lib.compile_state_init(plan)["programs"] == 0
  fp8_model = config.model.copy_and_resolve_references()
  fp8_model.update(fp8=True, fp8_impl="xla_delayed")  # + the program priming the FP8 histories
  fp8 = state_lib.plan_train_state(fp8_model, config.train, tx, mesh, rules, seed=2)
  assert state_lib.compile_state_init(fp8)["programs"] == 1
  built, again = state_lib.materialize(plan), state_lib.materialize(plan)
  traced = _traced_state(config, plan.shardings, seed=2)
  other = state_lib.plan_train_state(config.model, config.train, tx, mesh, rules, seed=3)
  reseeded = state_lib.materialize(other)
  compared = 0
  for a, b, c, d in zip(*(jax.tree.leaves(s.params) for s in (built, again, traced, reseeded))):
    a, b, c, d = (np.asarray(x) for x in (a, b, c, d))
    np.testing.assert_array_equal(a, b)  # deterministic per seed
    assert a.dtype == c.dtype and a.shape == c.shape
    if np.all(c == c.flat[0]):  # zeros, ones: exactly
      np.testing.assert_array_equal(a, c)
    elif c.size >= 4096:
      assert not np.array_equal(a, d)  # another seed, other draws
      assert abs(a.std() / c.std() - 1) < 0.05 and abs(a.mean()) < 0.05 * c.std() + 1e-3
      assert np.abs(a).max() <= np.abs(c).max() * 1.6  # truncated where jax truncates
      compared += 1
  assert compared >= 10
  for x in jax.tree.leaves(built.opt_state):
    assert not np.any(np.asarray(x))


def test_the_compute_copy_starts_as_the_cast_weights_made_by_one_small_program():
  """train.compute_copy: the optimizer state's bf16 copy is the cast of the initial weights, in their
  shardings, made by the one program of the state that is not all zeros."""
  from ejax.train import optim
  config = tiny_config()
  config.train.update(compute_dtype="bfloat16", compute_copy=True)
  mesh, rules, tx = _setup(config)
  plan = state_lib.plan_train_state(config.model, config.train, tx, mesh, rules, seed=1)
  assert state_lib.compile_state_init(plan)["programs"] == 1
  built = state_lib.materialize(plan)
  copy = optim.compute_copy(built.opt_state)
  pairs = list(zip(jax.tree.leaves(copy), jax.tree.leaves(built.params)))
  assert pairs and len(pairs) == len(jax.tree.leaves(built.params))
  for kept, weight in pairs:
    assert kept.dtype == jnp.bfloat16 and kept.sharding == weight.sharding
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(weight.astype(jnp.bfloat16)))
  rest = [x for x in jax.tree.leaves(built.opt_state[:-1])]
  assert rest and not any(np.any(np.asarray(x)) for x in rest)  # Adam's moments and counts: zeros


def test_the_abstract_state_needs_no_computation_of_model_size():
  config = load_config("configs/groot.py")  # full size: 2.4B parameters, FSDP over the test's devices
  mesh, rules, tx = _setup(config)
  abstract, shardings = state_lib.abstract_train_state(config.model, config.train, tx, mesh, rules)
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves((abstract.params, abstract.frozen)))
  assert 2.2e9 < total < 2.6e9
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))


def test_loaded_weights_are_placed_and_the_rest_initialised():
  config = tiny_config()
  mesh, rules, tx = _setup(config)
  plan = state_lib.plan_train_state(config.model, config.train, tx, mesh, rules, seed=1)
  flat = nnx.to_flat_state(plan.abstract.params)
  path, target = next((p, v) for p, v in flat if len(v.shape) == 2)
  value = np.full(target.shape, 0.25, np.float32)
  pure = {}
  node = pure
  for key in path[:-1]:
    node = node.setdefault(key, {})
  node[path[-1]] = value
  built = state_lib.materialize(plan, pure)
  reference = state_lib.materialize(plan)
  got = dict(nnx.to_flat_state(built.params))
  np.testing.assert_array_equal(np.asarray(got[path].get_value()), value)
  for (p, a), (_, b) in zip(nnx.to_flat_state(built.params), nnx.to_flat_state(reference.params)):
    if p != path:
      np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))

  node[path[-1]] = np.zeros((3, 3), np.float32)
  with pytest.raises(ValueError, match=r"has shape \(3, 3\), the model needs"):
    state_lib.materialize(plan, pure)


def test_the_train_job_starts_from_imported_weights(tmp_path):
  """train.init_weights: the convert job's output is read straight into the state's shardings and
  trains from there; a checkpoint of another model is one line."""
  from ejax.errors import UserError
  from ejax.models.io.convert import save_params
  from ejax.train.loop import train
  from ejax.models.registry import get_model_spec

  config = tiny_config(steps=1)
  model = get_model_spec(config.model.name).create(config.model, nnx.Rngs(42))
  save_params(model, str(tmp_path / "imported"))
  imported = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

  mesh, rules, tx = _setup(config)
  plan = state_lib.plan_train_state(config.model, config.train, tx, mesh, rules, seed=0)
  state = state_lib.materialize(plan, state_lib.read_weights(str(tmp_path / "imported"), plan))
  got = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state.params)}
  assert got.keys() == imported.keys()
  for name, value in imported.items():
    np.testing.assert_array_equal(got[name], value)

  config.train.init_weights = str(tmp_path / "imported")
  result = train(config, str(tmp_path / "run"))
  assert result["final_step"] == 1

  # A train run's checkpoints start a new run from its newest weights (a LoRA fine-tune of a trained
  # policy, say): its trained part (EMA when kept) and its frozen part, nothing of its optimizer.
  import orbax.checkpoint as ocp
  from ejax.checkpoint.kinds import numbered
  step_dir = tmp_path / "run" / "checkpoints"
  saved = ocp.StandardCheckpointer().restore(str(step_dir / str(numbered(str(step_dir))[-1]) / "state"))
  trained = saved["ema_params"] if saved.get("ema_params") else saved["params"]
  state = state_lib.materialize(plan, state_lib.read_weights(str(tmp_path / "run"), plan))
  got = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state.params)}
  want = state_lib._flat_pure(state_lib._strip_values(trained))
  assert got.keys() == want.keys()
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], np.asarray(value))
  assert any(not np.array_equal(got[name], imported[name]) for name in got)  # the step moved them

  other = tiny_config()
  other.model.width = 64
  bigger = get_model_spec(other.model.name).create(other.model, nnx.Rngs(0))
  save_params(bigger, str(tmp_path / "other"))
  with pytest.raises(UserError, match=r"train.init_weights: tensor .* has shape .* config.model needs"):
    state_lib.read_weights(str(tmp_path / "other"), plan)
  with pytest.raises(UserError, match=r"is not a directory"):
    state_lib.read_weights(str(tmp_path / "nothing"), plan)
