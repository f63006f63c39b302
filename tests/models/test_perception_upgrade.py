"""A GR00T with every perception aid, written before ejax/models/perception/ existed
(fixtures/groot_perception_v0.npz, made by fixtures/make_groot_perception_v0.py at the commit before
the move): its config and parameters upgraded to today's layout give the same actions and losses."""

import json
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from ejax.models import groot, perception

FIXTURE = pathlib.Path(__file__).with_name("fixtures") / "groot_perception_v0.npz"


@pytest.fixture(scope="module")
def saved():
  with np.load(FIXTURE) as f:
    return {k: f[k] for k in f.files}


def restored(saved):
  old = ml_collections.ConfigDict(json.loads(str(saved["config"])))
  config = perception.upgrade_config(old)
  params = perception.upgrade_params({k[len("param/"):]: v for k, v in saved.items() if k.startswith("param/")})
  model = nnx.eval_shape(lambda: groot.create(config, nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  flat = {"/".join(str(k) for k in path): v for path, v in nnx.to_flat_state(state)}
  assert sorted(flat) == sorted(params)   # every parameter has its place, none is left over
  for path, variable in nnx.to_flat_state(state):
    variable.set_value(jnp.asarray(params["/".join(str(k) for k in path)]))
  nnx.update(model, state)
  return model, old, config


def test_the_old_config_upgrades_to_the_perception_groups(saved):
  _, old, config = restored(saved)
  assert not [k for k in config if k.startswith("aux_")] and "state_dims" not in config
  settings = perception.read(config)
  assert settings.image_size == 64 and settings.estimate.dim == 7 and settings.teacher.noise == 0.05
  assert (settings.detectors.free, settings.detectors.points, settings.detectors.context_layers,
          settings.detectors.context_dilation, settings.detectors.position_scale) == (1, 2, 2, 2, 40.0)
  assert sorted(settings.geometry.cameras) == ["agentview", "wrist"] and settings.geometry.active
  # the state's last 15 slots: the estimate (7), then 2 points x 2 cameras x (x, y)
  assert (settings.layout.estimate, settings.layout.keypoints) == (slice(11, 18), slice(18, 26))
  assert perception.upgrade_config(config) is config   # today's layout: unchanged


def test_the_upgraded_checkpoint_acts_and_learns_as_before(saved):
  model, _, _ = restored(saved)
  batch = {k[len("batch/"):]: jnp.asarray(v) for k, v in saved.items() if k.startswith("batch/")}
  unlabelled = {k: v for k, v in batch.items() if k not in ("aux_state", "aux_mask", "aux_pixels")}
  unlabelled.update(aux_state=jnp.zeros_like(batch["aux_state"]), aux_mask=jnp.zeros_like(batch["aux_mask"]))
  # Jitted: op by op, GR00T's sampling and loss took ~150 s of CI on 2 cores.
  actions = nnx.jit(lambda m, b, noise: m.sample_actions(b, jax.random.key(2), noise=noise))(
      model, unlabelled, jnp.asarray(saved["noise"]))
  np.testing.assert_allclose(actions, saved["actions"], rtol=1e-5, atol=1e-5)
  # training has no statistics for the geometry (the head is teacher-forced): as the fixture's loss
  model.perception.config = perception.read(dict(model.config, perception=dict(
      model.config.perception, geometry=dict(model.config.perception.geometry, norm={}))))
  loss, metrics = nnx.jit(lambda m, b, time, noise: m.compute_loss(b, jax.random.key(1), time=time, noise=noise,
                                                                    train=False))(
      model, batch, jnp.asarray(saved["time"]), jnp.asarray(saved["noise"]))
  for name in ("loss", "aux_state_loss", "aux_heatmap_loss"):
    value = loss if name == "loss" else metrics[name]
    np.testing.assert_allclose(value, saved[name], rtol=1e-5)


def test_experiments_that_were_not_kept_are_refused():
  for key, value in (("state_dims", (7,)), ("aux_proprio_dims", (0, 1)), ("aux_geometry_relation_margin", 4.0)):
    old = groot.model_config("runlocal")
    old[key] = value
    with pytest.raises(ValueError, match=key):
      perception.upgrade_config(old)


def test_a_train_checkpoint_written_before_the_move_acts_the_same_through_load_policy(saved, tmp_path):
  """The fixture's weights saved as the train job saved them before the move (the old parameter names,
  the old flat model config) load through load_policy, which hands the geometry the checkpoint's
  statistics, and sample the fixture's actions."""
  from ml_collections import ConfigDict

  from configs import common
  from ejax.checkpoint import Checkpointer
  from ejax.parallel import make_mesh
  from ejax.train.optim import make_optimizer
  from ejax.train.policy import _renamed, load_policy
  from ejax.train.state import materialize, plan_train_state

  old = json.loads(str(saved["config"]))
  norm = old.pop("aux_geometry_norm")   # what the policy computes from the checkpoint's statistics
  key = "observation.environment_state"
  # the data's own state fills the first 11 of the 26 slots (the module's 15 follow): its statistics cover those
  norm["state"] = [values[:11] for values in norm["state"]]
  stats = {"observation.state": {"mean": norm["state"][0], "std": norm["state"][1]},
           key: {"mean": norm["estimate"][0], "std": norm["estimate"][1]},
           "action": {"mean": [0.0] * old["max_action_dim"], "std": [1.0] * old["max_action_dim"]}}
  config = common.base_config()
  config.model = ConfigDict(old)
  config.data.update(name="sim_demos", aux_state_key=key, normalization="mean_std", image_size=(64, 64))
  new_model = perception.upgrade_config(config.model)
  params = perception.upgrade_params({k[len("param/"):]: v for k, v in saved.items() if k.startswith("param/")})
  nested = {}
  for path, value in params.items():
    *parents, leaf = path.split("/")
    node = nested
    for name in parents:
      node = node.setdefault(name, {})
    node[leaf] = value
  tx, _ = make_optimizer(config.train)
  rules = [tuple(rule) for rule in config.sharding_rules]
  state = materialize(plan_train_state(new_model, config.train, tx, make_mesh(dict(data=-1)), rules), nested)
  back = {new: old_name for old_name, new in perception.upgrade.PARAM_RENAMES.items()}
  checkpointer = Checkpointer(str(tmp_path), async_save=False, for_writing=True)
  checkpointer.save(1, _renamed(state, back), meta={"config": json.loads(config.to_json_best_effort()),
                                                     "norm_stats": stats})
  checkpointer.close()
  policy = load_policy(str(tmp_path), use_ema=False)
  given = perception.read(policy.config.model).geometry.norm
  for name in ("state", "estimate"):
    np.testing.assert_allclose(np.asarray(given[name], np.float64), norm[name], rtol=1e-6)
  batch = {k[len("batch/"):]: v for k, v in saved.items() if k.startswith("batch/")}
  batch.update(aux_state=np.zeros_like(batch["aux_state"]), aux_mask=np.zeros_like(batch["aux_mask"]))
  actions = policy._sample(policy._state, batch, jax.random.key(2), jnp.asarray(saved["noise"]))
  np.testing.assert_allclose(actions, saved["actions"], rtol=1e-5, atol=1e-5)
