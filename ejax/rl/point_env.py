"""PointReach: a small pure-JAX task with the simulator interface, for RL tests and benchmarks.

A point in the plane must reach the goal of its task (one of `num_tasks` goals on a circle). The
observation holds only the point's position; the goal is known through `task_index`, so a policy
has to condition on the task, as a VLA conditions on its instruction. It follows the interface of
`ejax.sim` (pure `reset(rng)` / `step(state, action)` on a struct EnvState) so the RL pipeline runs
it and the MuJoCo tasks alike; it is cheap enough to make throughput measurements about the
pipeline rather than the physics.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class EnvState:
  obs: dict          # "observation.state" [state_dim], "task_index" [] int32
  reward: jax.Array  # [] float32, of the last step
  done: jax.Array    # [] bool: the episode ended at the last step
  success: jax.Array  # [] bool: the goal was reached (sticky within an episode)
  metrics: dict
  info: dict         # "position" [2], "goal" [2], "steps" [] int32


class PointReach:
  """Reach the task's goal within `max_steps` actions; reward = progress towards it, +1 on success."""

  def __init__(self, *, num_tasks: int = 4, state_dim: int = 8, action_dim: int = 2, max_steps: int = 32,
               max_speed: float = 0.1, goal_radius: float = 0.1, goal_distance: float = 0.6):
    if action_dim < 2 or state_dim < 2:
      raise ValueError(f"PointReach moves in 2-D: action_dim ({action_dim}) and state_dim ({state_dim}) must be >= 2")
    self.num_tasks, self.state_dim, self.action_dim = num_tasks, state_dim, action_dim
    self.max_steps, self.max_speed, self.goal_radius = max_steps, max_speed, goal_radius
    angles = 2 * math.pi * jnp.arange(num_tasks) / num_tasks
    self.goals = goal_distance * jnp.stack([jnp.cos(angles), jnp.sin(angles)], axis=-1)  # [tasks, 2]

  def _observation(self, position, task_index):
    state = jnp.zeros((self.state_dim,), jnp.float32).at[:2].set(position)
    return {"observation.state": state, "task_index": task_index.astype(jnp.int32)}

  def reset(self, rng: jax.Array) -> EnvState:
    task_rng, position_rng = jax.random.split(rng)
    task_index = jax.random.randint(task_rng, (), 0, self.num_tasks)
    position = jax.random.uniform(position_rng, (2,), minval=-0.1, maxval=0.1)
    zero = jnp.zeros((), jnp.float32)
    return EnvState(obs=self._observation(position, task_index), reward=zero, done=jnp.zeros((), bool),
                    success=jnp.zeros((), bool), metrics={},
                    info={"position": position, "goal": self.goals[task_index], "steps": jnp.zeros((), jnp.int32)})

  def step(self, state: EnvState, action: jax.Array) -> EnvState:
    """action [action_dim]: the first two entries are a velocity command, clipped to max_speed."""
    position, goal = state.info["position"], state.info["goal"]
    move = jnp.clip(action[:2].astype(jnp.float32), -1.0, 1.0) * self.max_speed
    new_position = position + move
    distance_before = jnp.linalg.norm(goal - position)
    distance_after = jnp.linalg.norm(goal - new_position)
    success = distance_after < self.goal_radius
    steps = state.info["steps"] + 1
    reward = (distance_before - distance_after) + success.astype(jnp.float32)
    return EnvState(obs=self._observation(new_position, state.obs["task_index"]), reward=reward,
                    done=success | (steps >= self.max_steps), success=success, metrics={},
                    info={"position": new_position, "goal": goal, "steps": steps})

  def expert_action(self, state: EnvState) -> jax.Array:
    """A scripted expert (for demonstrations): head straight for the goal at full speed."""
    direction = state.info["goal"] - state.info["position"]
    command = direction / jnp.maximum(jnp.linalg.norm(direction), 1e-6)
    scale = jnp.minimum(1.0, jnp.linalg.norm(direction) / self.max_speed)
    return jnp.zeros((self.action_dim,), jnp.float32).at[:2].set(command * scale)
