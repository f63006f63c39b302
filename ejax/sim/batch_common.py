"""What both batched backends share (ejax.sim.batched's MJX runner, ejax.sim.native's): task
assignment, shapes, the scripted expert and the compiled MJX reset / step (the native backend resets
through MJX too). Its own module so that batched.make_batched can choose native without a cycle."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ejax.sim import env as env_lib
from ejax.sim import expert, registry, scene


@functools.lru_cache(maxsize=None)
def _mjx_functions(cameras: env_lib.CameraConfig | None):
  reset = jax.jit(jax.vmap(lambda rng, row: env_lib.mjx_reset(rng, row, cameras)))
  step = jax.jit(jax.vmap(lambda state, action: env_lib.mjx_step(state, action, cameras)))
  return reset, step


@jax.jit
def _expert_actions(privileged: dict) -> jax.Array:
  return jax.vmap(lambda p: expert.expert_action(p, jnp))(privileged)


class BatchedEnv:
  """Common bookkeeping of both backends: task assignment, shapes, the expert."""

  action_size = env_lib.Env.action_size
  state_size = env_lib.STATE_SIZE
  control_hz = scene.CONTROL_HZ

  def __init__(self, task_names: Sequence[str] | str, num_envs: int, *, cameras: bool = False,
               image_size: tuple[int, int] = (64, 64), episode_length: int | None = None):
    task_names = [task_names] if isinstance(task_names, str) else list(task_names)
    if not task_names or num_envs < 1:
      raise ValueError(f"need at least one task and one env, got tasks={task_names} num_envs={num_envs}")
    self.task_names = task_names
    self.num_envs = num_envs
    self.specs = [registry.get_spec(name) for name in task_names]
    self.env_tasks = [task_names[i % len(task_names)] for i in range(num_envs)]
    self.instructions = [registry.get_spec(name).instruction for name in self.env_tasks]
    self.cameras = env_lib.CameraConfig(image_size[0], image_size[1]) if cameras else None
    rows = [env_lib.task_row(registry.get_spec(name), env_lib.global_task_index(name), episode_length)
            for name in self.env_tasks]
    self.task_rows = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
    self.episode_length = int(self.task_rows["episode_length"].max())

  def observation_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
    """Per-env observation shapes (add the leading num_envs axis for the batch)."""
    return env_lib.Env(self.specs[0], cameras=self.cameras is not None,
                       image_size=(self.cameras.height, self.cameras.width) if self.cameras else (64, 64),
                       ).observation_shapes()

  def expert_actions(self, state: env_lib.EnvState) -> np.ndarray:
    """The scripted expert's actions [num_envs, 4] for this state."""
    return np.asarray(_expert_actions(jax.tree.map(jnp.asarray, state.info["privileged"])))

  def _env_keys(self, rng: jax.Array) -> jax.Array:
    return jax.random.split(rng, self.num_envs)
