"""Camera reliance (a policy that reads its cameras moves differently when shown another layout) and
approach errors (where a policy's hand goes, against the instructed object)."""

import jax
import numpy as np
import pytest

from ejax.eval.policies import ExpertPolicy
from ejax.eval.probes import _same_task_permutation, approach_errors, camera_reliance
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


class _Down:
  """Goes straight down from wherever the hand starts: low, but near no object in particular."""

  def act(self, obs, instructions, rng):
    return np.tile(np.array([0.0, 0.0, -1.0, -1.0], np.float32), (len(instructions), 2, 1))


@pytest.mark.timeout(300)
def test_approach_errors_tell_the_expert_from_a_policy_that_goes_anywhere():
  env = make_batched(["goal_lift_green_block", "object_lift_cylinder", "goal_open_drawer"], 12, backend="native")
  expert = approach_errors(ExpertPolicy(), env, jax.random.key(0))
  assert set(expert) == {"goal_lift_green_block", "object_lift_cylinder"}        # drawers have no object target
  for row in expert.values():
    assert row["success"] >= 0.75 and row["went_low"] == 1.0 and row["nearest_is_target"] == 1.0
    assert row["min_target_xy_cm"] < 1.2                                         # expert.GRASP_TOLERANCE
  down = approach_errors(_Down(), env, jax.random.key(0))
  for row in down.values():
    assert row["success"] == 0.0 and row["went_low"] == 1.0 and row["min_target_xy_cm"] > 5.0
