"""Camera reliance: a policy that reads its cameras moves differently when shown another layout."""

import jax
import numpy as np
import pytest

from ejax.eval.probes import _same_task_permutation, camera_reliance
from ejax.sim.batched import make_batched


class _Policy:
  """Moves by the mean colour of its agentview image (looks) or by its state only (does not)."""

  noise_shape = (2, 4)

  def __init__(self, looks: bool):
    self.looks = looks

  def act(self, obs, instructions, rng, noise=None):
    if self.looks:
      source = obs["observation.images.agentview"].reshape(len(instructions), -1).astype(np.float32).mean(1) / 255
    else:
      source = obs["observation.state"][:, 8]
    move = np.tanh(100 * (source - source.mean()))[:, None]
    return np.broadcast_to(np.concatenate([move, -move, 0 * move, 0 * move], 1)[:, None], (len(instructions), 2, 4))


def test_permutation_stays_within_each_task_and_moves_every_env():
  tasks = ["a", "b", "a", "b", "a"]
  permutation = _same_task_permutation(tasks)
  assert [tasks[j] for j in permutation] == tasks
  assert all(permutation != np.arange(5))


@pytest.mark.timeout(300)
def test_a_policy_that_looks_changes_its_move_and_one_that_does_not_stays():
  env = make_batched(["goal_lift_green_block", "goal_open_drawer"], 8, backend="native", cameras=True,
                     image_size=(32, 32))
  looking = camera_reliance(_Policy(True), env, jax.random.key(0))
  blind = camera_reliance(_Policy(False), env, jax.random.key(0))
  assert set(looking) == {"goal_lift_green_block", "goal_open_drawer"}
  assert all(row["move_change"] > 0.05 for row in looking.values()), looking
  assert all(row["move_change"] == 0.0 for row in blind.values()), blind
  assert looking["goal_lift_green_block"]["expert_spread"] > 0.1   # layouts send the expert different ways
