"""RL env shards on native MuJoCo (rl.env.backend="native"): the chunk step's contract and a run."""

import jax
import numpy as np
import pytest
from flax import nnx

from ejax.rl.env_shard import NativeSimEnv
from ejax.rl.pipeline import RLPipeline, default_config
from ejax.rl.policy import mlp_flow_policy
from ejax.sim import registry
from ejax.sim.batched import make_batched

pytestmark = pytest.mark.timeout(300)

TASK, ENVS, HORIZON = "goal_lift_green_block", 4, 4


def test_chunk_step_is_the_batch_stepped_action_by_action_with_auto_reset():
  reset, chunk_step = NativeSimEnv(TASK, num_threads=1).functions(ENVS, actions_per_step=3, auto_reset=True)
  reference = make_batched(TASK, ENVS, backend="native", num_threads=1)
  keys = jax.random.split(jax.random.key(0), ENVS)
  state, expected = reset(keys), reference.reset(keys=keys)
  np.testing.assert_array_equal(state.obs["observation.state"], expected.obs["observation.state"])
  rng = np.random.default_rng(0)
  episode_length = registry.get_spec(TASK).episode_length
  ended_any = False
  for chunk_index in range(-(-episode_length // 3) + 1):  # long enough for every episode to time out once
    chunks = rng.uniform(-1, 1, (ENVS, HORIZON, 4)).astype(np.float32)
    new_keys = jax.random.split(jax.random.key(chunk_index + 1), ENVS)
    state, reward, done, success = chunk_step(state, chunks, new_keys)
    rewards = np.zeros((ENVS,), np.float32)
    ended = np.zeros((ENVS,), bool)
    for k in range(3):  # the reference: step every env, count rewards until its episode ends
      stepped = reference.step(expected, chunks[:, k])
      rewards += np.where(ended, 0.0, stepped.reward)
      expected = jax.tree.map(lambda old, new: np.where(ended.reshape((-1,) + (1,) * (np.ndim(new) - 1)), old, new),
                              expected, stepped)
      ended |= stepped.done
    np.testing.assert_allclose(reward, rewards, atol=1e-6)
    np.testing.assert_array_equal(done, ended)
    if ended.any():
      ended_any = True
      # Ended envs start a new episode from their key; the others carry on exactly.
      fresh = make_batched(TASK, ENVS, backend="native", num_threads=1).reset(keys=new_keys)
      for i in range(ENVS):
        source = fresh if ended[i] else expected
        np.testing.assert_allclose(state.obs["observation.state"][i], source.obs["observation.state"][i], atol=1e-6)
        np.testing.assert_allclose(state.obs["observation.environment_state"][i],
                                   source.obs["observation.environment_state"][i], atol=1e-6)
        assert not state.done[i]
      expected = reference.reset(keys=new_keys, state=expected, where=ended)
  assert ended_any


def test_pipeline_runs_on_native_shards(tmp_path):
  config = default_config()
  config.update(num_shards=2, envs_per_shard=4, segment_length=3, actions_per_step=4, segments_per_update=2,
                num_updates=2, num_minibatches=2, num_epochs=1, eta=1, inference_full_batch_only=True, queue_size=4)
  policy = mlp_flow_policy(state_dim=18, action_dim=4, horizon=4, num_tasks=len(registry.list_tasks()), num_steps=2,
                           hidden=16, rngs=nnx.Rngs(0))
  pipeline = RLPipeline(config, NativeSimEnv(TASK, num_threads=1), policy, checkpoint_dir=str(tmp_path / "ckpt"))
  summary = pipeline.run()
  assert summary["version"] == 2 and summary["lag_max"] <= 1
  assert summary["env_steps"] == 2 * 2 * 3 * 4 * 4
  assert not [thread.name for thread in pipeline.threads if thread.is_alive()]
