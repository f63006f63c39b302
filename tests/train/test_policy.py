"""A training checkpoint loads as a policy whose actions equal the model's own samples."""

import jax
import numpy as np
from flax import nnx

from ejax.train.loop import train
from ejax.train.policy import load_policy
from tests.train.helpers import tiny_config


def test_checkpoint_acts_like_the_trained_model(tmp_path):
  config = tiny_config(steps=2)
  result = train(config, str(tmp_path))
  policy = load_policy(str(tmp_path / "checkpoints"))
  rng = np.random.default_rng(0)
  obs = {"observation.state": rng.standard_normal((6, config.model.state_dim)).astype(np.float32),
         "task_index": np.arange(6, dtype=np.int32) % config.model.num_tasks,
         "privileged.block_position": np.zeros((6, 3), np.float32)}
  actions = policy.act(obs, ["pick"] * 6, jax.random.key(3))
  assert actions.shape == (6, config.model.horizon, config.model.action_dim)
  assert np.isfinite(actions).all()

  # The same numbers straight from the trained parameters (no normalisation on synthetic data).
  from ejax.train.state import model_parts
  state = result["state"]
  model = nnx.merge(model_parts(config.model).graphdef, state.params, state.frozen, state.rest)
  batch = {"observation.state": obs["observation.state"], "task_index": obs["task_index"]}
  expected = model.sample_actions(batch, jax.random.key(3))
  np.testing.assert_allclose(actions, np.asarray(expected), rtol=1e-5, atol=1e-5)

  # eval.num_inference_steps: the flow's steps replace the saved config's (4 in the tiny model)
  one = load_policy(str(tmp_path / "checkpoints"), num_inference_steps=1).act(obs, ["pick"] * 6, jax.random.key(3))
  np.testing.assert_allclose(one, np.asarray(model.sample_actions(batch, jax.random.key(3), num_steps=1)),
                             rtol=1e-5, atol=1e-5)
  assert not np.allclose(one, actions, atol=1e-3)


def test_true_estimate_acts_on_the_simulators_object_state_in_place_of_the_estimate():
  """eval.true_estimate (CheckpointPolicy.use_true_estimate): a GR00T policy trained with a
  teacher-forced estimate acts on the observations' true object state, normalised as in training,
  where it would act on its estimate; a checkpoint without one is refused with the reason."""
  import pytest
  from ml_collections import ConfigDict

  from ejax.models import groot, layers
  from ejax.train.policy import CheckpointPolicy
  from tests.models.test_groot import tiny_config as tiny_groot

  from ejax.models import perception
  c = tiny_groot()
  c.perception = perception.default_config()
  c.perception.update(image_size=0)
  c.perception.estimate.update(dim=2, width=32)
  c.perception.detectors.update(points=0, to_state=False)
  c.packing.update(row_length=512, samples_per_row=2)
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  key, size, n = "observation.environment_state", c.vision.image_size, 3
  data = ConfigDict(dict(state_key="observation.state", aux_state_key=key, normalization="mean_std", image_size=(size, size)))
  action_dim = int(c.get("action_dim", 0)) or c.max_action_dim
  stats = {name: {"mean": np.full(d, m, np.float32), "std": np.full(d, s, np.float32)}
           for name, d, m, s in (("observation.state", 4, 0.0, 1.0), ("action", action_dim, 0.0, 1.0), (key, 2, 0.5, 2.0))}
  policy = CheckpointPolicy(model, ConfigDict(dict(model=c, data=data)), stats)
  rng = np.random.default_rng(0)
  truth = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
  obs = {"observation.state": rng.standard_normal((n, 4)).astype(np.float32), key: truth,
         "observation.images.cam": rng.integers(0, 255, (n, size, size, 3), dtype=np.uint8)}
  own = policy.act(obs, ["lift"] * n, jax.random.key(0))
  assert key not in policy._samples(obs, ["lift"] * n)[0]   # by default the true state never reaches the model
  policy.use_true_estimate()
  samples = policy._samples(obs, ["lift"] * n)
  np.testing.assert_allclose(np.stack([s[key] for s in samples]), (truth - 0.5) / 2.0, rtol=1e-6)
  true = policy.act(obs, ["lift"] * n, jax.random.key(0))
  assert not np.allclose(own, true)
  # the same as the model sampling with the estimate's slots teacher-forced to that state
  batch = policy.collate(samples)
  batch = {k: v for k, v in batch.items() if isinstance(v, np.ndarray) and v.dtype != object}
  assert batch["aux_mask"].min() > 0
  sampled = nnx.jit(lambda m, b: m.sample_actions(b, jax.random.key(0)))(model, batch)
  np.testing.assert_allclose(true, policy.env_actions(np.asarray(sampled)), rtol=1e-4, atol=1e-5)
  plain = c.copy_and_resolve_references()
  plain.perception.teacher.forcing = False
  refused = CheckpointPolicy(groot.create(plain, nnx.Rngs(0)), ConfigDict(dict(model=plain, data=data)), stats)
  with pytest.raises(ValueError, match="teacher-forced estimate"):
    refused.use_true_estimate()


def test_keypoint_geometry_gets_the_checkpoints_statistics_and_can_be_switched():
  """perception.with_statistics (load_policy; eval.keypoint_geometry): a calibrated model is handed the
  statistics that map its estimate and state to metres; "sim" (the cameras given) calibrates a keypoint
  model trained before geometry existed, saved in the layout before model.perception, with today's
  decoding; "off" leaves the readout alone, and a model without a keypoint estimate is refused."""
  import pytest
  from ml_collections import ConfigDict

  from ejax.models import perception
  from ejax.sim.scene import camera_calibration

  key = "observation.environment_state"
  stats = {"observation.state": {"mean": np.arange(11, dtype=np.float32), "std": np.full(11, 2.0, np.float32)},
           key: {"mean": np.full(7, 0.5, np.float32), "std": np.full(7, 0.25, np.float32)}}
  data = dict(state_key="observation.state", aux_state_key=key, normalization="mean_std")
  model = dict(name="groot", num_cameras=2, max_state_dim=26, perception=perception.default_config().to_dict())
  with_cameras = ConfigDict(dict(model=model, data=data))
  with_cameras.model.perception.geometry.cameras = camera_calibration()
  calibrated = perception.with_statistics(with_cameras, stats)
  norm = calibrated.model.perception.geometry.norm
  np.testing.assert_allclose(norm["state"][0], np.arange(11))
  np.testing.assert_allclose(norm["estimate"][1], np.full(7, 0.25))
  assert not perception.with_statistics(ConfigDict(dict(model=model, data=data)), stats).model.perception.geometry.norm
  # saved before model.perception existed, and before the geometry's keys did
  old = dict(name="groot", num_cameras=2, max_state_dim=26, aux_state_input=True, aux_heatmaps=2, aux_state_dim=7,
             aux_keypoints=1, aux_geometry_radius=(2, 0), aux_geometry_tolerance=0.04)
  today = perception.with_statistics(ConfigDict(dict(model=old, data=data)), stats, camera_calibration()).model
  settings = perception.read(today)
  assert sorted(settings.geometry.cameras) == ["agentview", "wrist"] and settings.geometry.active
  assert settings.geometry.radius == (2, 2) and settings.geometry.tolerance == (0.04, 0.0)   # today's defaults
  as_trained = perception.read(perception.with_statistics(ConfigDict(dict(model=old, data=data)), stats).model)
  assert as_trained.geometry.tolerance == 0.04 and not as_trained.geometry.active
  off = perception.with_statistics(calibrated, stats, False)
  assert not off.model.perception.geometry.cameras
  with pytest.raises(ValueError, match="keypoint estimate"):
    perception.with_statistics(ConfigDict(dict(model=dict(name="groot"), data=data)), stats, camera_calibration())