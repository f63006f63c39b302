"""Batched runners: many envs (mixing tasks) behind one interface, MJX or native MuJoCo.

    env = make_batched(["object_red_block_to_bowl", "goal_open_drawer"], num_envs=64, backend="mjx")
    state = env.reset(jax.random.key(0))          # EnvState with a leading [num_envs] axis
    state = env.step(state, actions)              # actions [num_envs, 4]

Env i runs task_names[i % len(task_names)]. Every task shares the scene, so one compiled program
serves any mix of tasks: the compiled reset/step are cached per camera configuration and reused by
every runner with the same batch size.

backend="mjx": jit(vmap(reset / step)), physics substeps in lax.scan; GPU-batched, also runs on CPU.
backend="native": the same JAX controller and task maths, physics in native MuJoCo (one MjData per env,
  stepped from a thread pool); on CPU hosts this is several times faster. States hold numpy arrays.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ejax.sim import env as env_lib
from ejax.sim import expert, registry, scene

BACKENDS = ("mjx", "native")


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


class MjxBatchedEnv(BatchedEnv):
  backend = "mjx"

  def reset(self, rng: jax.Array) -> env_lib.EnvState:
    reset, _ = _mjx_functions(self.cameras)
    return reset(self._env_keys(rng), jax.tree.map(jnp.asarray, self.task_rows))

  def step(self, state: env_lib.EnvState, actions) -> env_lib.EnvState:
    _, step = _mjx_functions(self.cameras)
    return step(state, jnp.asarray(actions, jnp.float32))


def make_batched(task_names: Sequence[str] | str, num_envs: int, backend: str = "mjx", *, cameras: bool = False,
                 image_size: tuple[int, int] = (64, 64), episode_length: int | None = None,
                 num_threads: int | None = None) -> BatchedEnv:
  """A batched runner over `num_envs` envs; see the module docstring."""
  kwargs = dict(cameras=cameras, image_size=image_size, episode_length=episode_length)
  if backend == "mjx":
    return MjxBatchedEnv(task_names, num_envs, **kwargs)
  if backend == "native":
    from ejax.sim.native import NativeBatchedEnv
    return NativeBatchedEnv(task_names, num_envs, num_threads=num_threads, **kwargs)
  raise ValueError(f"unknown backend {backend!r}: use one of {BACKENDS}")
