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
  actions = model.sample_actions(unlabelled, jax.random.key(2), noise=jnp.asarray(saved["noise"]))
  np.testing.assert_allclose(actions, saved["actions"], rtol=1e-5, atol=1e-5)
  # training has no statistics for the geometry (the head is teacher-forced): as the fixture's loss
  model.perception.config = perception.read(dict(model.config, perception=dict(
      model.config.perception, geometry=dict(model.config.perception.geometry, norm={}))))
  loss, metrics = model.compute_loss(batch, jax.random.key(1), time=jnp.asarray(saved["time"]),
                                     noise=jnp.asarray(saved["noise"]), train=False)
  for name in ("loss", "aux_state_loss", "aux_heatmap_loss"):
    value = loss if name == "loss" else metrics[name]
    np.testing.assert_allclose(value, saved[name], rtol=1e-5)


def test_experiments_that_were_not_kept_are_refused():
  for key, value in (("state_dims", (7,)), ("aux_proprio_dims", (0, 1)), ("aux_geometry_relation_margin", 4.0)):
    old = groot.model_config("runlocal")
    old[key] = value
    with pytest.raises(ValueError, match=key):
      perception.upgrade_config(old)
