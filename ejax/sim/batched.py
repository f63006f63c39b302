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

from typing import Sequence

import jax
import jax.numpy as jnp

from ejax.sim import env as env_lib
from ejax.sim.batch_common import BatchedEnv, _expert_actions, _mjx_functions  # noqa: F401  (re-exported)

BACKENDS = ("mjx", "native")


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
