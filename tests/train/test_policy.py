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
