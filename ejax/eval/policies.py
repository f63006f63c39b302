"""Policies for closed-loop evaluation, and the interface every policy follows.

    act(obs: dict[str, np.ndarray], instructions: list[str], rng: jax.Array) -> actions [num_envs, horizon, 4]

obs holds batched observations ("observation.state" [N, 11], "observation.images.agentview" /
".wrist" [N, H, W, 3] uint8). The evaluator executes each chunk open-loop for up to
config.eval.replan_every steps, then asks again. A policy that sets `uses_privileged_state = True`
also gets the simulator's privileged state as "privileged.<name>" entries (scripted experts only).
Trained checkpoints load through `ejax.train.policy.load_policy(checkpoint_dir)`.
"""

from __future__ import annotations

import jax
import numpy as np

from ejax.sim import batched

PRIVILEGED_PREFIX = "privileged."


class RandomPolicy:
  """Uniform random actions in [-1, 1]: the floor any trained policy must beat."""

  uses_privileged_state = False

  def __init__(self, action_size: int = 4, horizon: int = 1):
    self.action_size, self.horizon = action_size, horizon

  def act(self, obs: dict[str, np.ndarray], instructions: list[str], rng: jax.Array) -> np.ndarray:
    num_envs = len(instructions)
    return np.asarray(jax.random.uniform(rng, (num_envs, self.horizon, self.action_size), minval=-1.0, maxval=1.0))


class ExpertPolicy:
  """The scripted expert (ejax/sim/expert.py) as a policy: the ceiling, and a test of the evaluator."""

  uses_privileged_state = True

  def act(self, obs: dict[str, np.ndarray], instructions: list[str], rng: jax.Array) -> np.ndarray:
    privileged = {key[len(PRIVILEGED_PREFIX):]: value for key, value in obs.items()
                  if key.startswith(PRIVILEGED_PREFIX)}
    if not privileged:
      raise ValueError("ExpertPolicy needs the simulator's privileged state: evaluate it with "
                       "ejax.eval.evaluate (which adds 'privileged.*' observations for it)")
    return np.asarray(batched._expert_actions(privileged))[:, None, :]
