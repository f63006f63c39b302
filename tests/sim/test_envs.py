"""Every registered task on the MJX backend: jit, documented shapes, no NaNs, scripted experts.

All tasks share one scene, so one batched program (one compilation) covers every task: env i runs
task i % num_tasks. MJX on CPU can deadlock on newer jax (STACK.md), hence the timeouts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejax.sim import registry, scene
from ejax.sim.batched import make_batched

TASKS = registry.list_tasks()
NUM_ENVS = 2 * len(TASKS)
EXPERT_SEEDS = 100


@pytest.fixture(scope="module")
def batch():
  return make_batched(TASKS, NUM_ENVS, backend="mjx")


@pytest.mark.timeout(600)
def test_reset_and_step_have_documented_shapes(batch):
  state = batch.reset(jax.random.key(0))
  shapes = batch.observation_shapes()
  assert shapes == {"observation.state": ((11,), "float32"), "observation.environment_state": ((7,), "float32"),
                    "task_index": ((), "int32")}
  for name, (shape, dtype) in shapes.items():
    assert state.obs[name].shape == (NUM_ENVS, *shape) and state.obs[name].dtype == dtype
  state = batch.step(state, np.zeros((NUM_ENVS, 4), np.float32))
  assert state.reward.shape == (NUM_ENVS,) and state.reward.dtype == jnp.float32
  assert state.done.dtype == jnp.bool_ and state.success.dtype == jnp.bool_
  np.testing.assert_array_equal(state.info["step"], 1)
  np.testing.assert_array_equal(state.obs["task_index"], np.arange(NUM_ENVS) % len(TASKS))
  assert not np.any(np.asarray(state.success)), "no task may start solved"
  # The object state is the expert's privileged view of the task: target, goal, held flag.
  privileged = state.info["privileged"]
  np.testing.assert_array_equal(state.obs["observation.environment_state"][:, :3], privileged["target_pos"])
  np.testing.assert_array_equal(state.obs["observation.environment_state"][:, 3:6], privileged["goal"])
  np.testing.assert_array_equal(state.obs["observation.environment_state"][:, 6], privileged["holding"])


@pytest.mark.timeout(600)
def test_500_random_action_steps_stay_finite_and_in_workspace(batch):
  state = batch.reset(jax.random.key(1))
  rng = np.random.default_rng(0)
  for _ in range(500):
    state = batch.step(state, rng.uniform(-1, 1, (NUM_ENVS, 4)).astype(np.float32))
  leaves = jax.tree.leaves((state.obs, state.reward, state.metrics, state.data.qpos, state.data.qvel))
  for leaf in leaves:
    assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
  tcp = np.asarray(state.obs["observation.state"][:, 8:])
  assert np.all(tcp[:, 2] > -0.01) and np.all(tcp[:, 2] < 0.5)
  rewards = np.asarray(state.reward)
  assert np.all((rewards >= 0) & (rewards <= 1))
  # Objects stay on or above the table, and the hand's fingers do not sink into it.
  index = scene.scene_index()
  assert np.all(np.asarray(state.data.qpos)[:, index.object_qpos[:, 2]] > 0.0)
  assert np.all(tcp[:, 2] > scene.FINGER_PAD_RADIUS - 0.005)


@pytest.mark.timeout(300)
def test_single_env_api_jits():
  env = registry.make("goal_open_drawer")
  state = jax.jit(env.reset)(jax.random.key(3))
  assert env.action_size == 4 and env.state_size == 11 and env.control_hz == 10
  assert state.obs["observation.state"].shape == (11,)
  assert state.info["episode_length"] == env.episode_length
  assert state.obs["task_index"] == TASKS.index("goal_open_drawer")
  other = jax.jit(env.reset)(jax.random.key(4))
  assert not np.allclose(state.data.qpos, other.data.qpos), "seeds must give different layouts"


@pytest.mark.timeout(900)
def test_scripted_experts_succeed_on_95_percent_of_100_seeds(batch):
  """100 seeds per task, run as 50 batches of the module's batch size (no new compilation)."""
  successes = []
  for chunk in range(EXPERT_SEEDS * len(TASKS) // NUM_ENVS):
    state = batch.reset(jax.random.fold_in(jax.random.key(2024), chunk))
    for _ in range(batch.episode_length):
      state = batch.step(state, batch.expert_actions(state))
      if np.all(np.asarray(state.done)):
        break
    successes.append(np.asarray(state.success).reshape(-1, len(TASKS)))
  success = np.concatenate(successes)
  assert success.shape == (EXPERT_SEEDS, len(TASKS))
  rates = dict(zip(TASKS, success.mean(axis=0)))
  assert all(rate >= 0.95 for rate in rates.values()), rates
