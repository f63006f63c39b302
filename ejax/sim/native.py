"""Native MuJoCo backend: the MJX backend's controller and task maths in JAX, physics in C MuJoCo.

Split per control step:
  1. plan (jitted vmap, JAX on CPU): grasp update, IK, joint servo, tcp path over the substeps —
     literally control.plan_step, the function the MJX backend runs;
  2. physics (native, one MjData per env, a thread pool over envs; mj_step releases the GIL):
     SUBSTEPS x (mj_step, hold the grasped object at the planned tcp);
  3. finish (jitted vmap): success, reward, privileged state, observations and camera images.
So the two backends differ only in the physics engine, which is what the agreement test measures.
Resets go through the same JAX initial-state sampler, then load into MjData.
State arrays are numpy; `state.data` is {"qpos","qvel","qacc_warmstart","mocap_pos","mocap_quat"}.
"""

from __future__ import annotations

import copy
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import mujoco
import numpy as np

from ejax.sim import control, scene, tasks
from ejax.sim import env as env_lib
from ejax.sim.batched import BatchedEnv, _mjx_functions

_PHYSICS_FIELDS = ("qpos", "qvel", "qacc_warmstart", "mocap_pos", "mocap_quat")


@jax.jit
def _plan(info: dict, qpos: jax.Array, actions: jax.Array):
  def plan_one(info, qpos, action):
    info, tcp_path = control.plan_step(info, qpos, action, jnp)
    arm_pos, arm_quat = control.arm_mocap_pose(info["arm_q"], info["finger"], jnp)
    return info, tcp_path, arm_pos, arm_quat
  return jax.vmap(plan_one)(info, qpos, actions)


@functools.partial(jax.jit, static_argnames=("cameras", "advance"))
def _finish(prev_success, prev_done, info, qpos, mocap_pos, kinematics, *, cameras, advance):
  def finish_one(prev_success, prev_done, info, qpos, mocap_pos, kinematics):
    info = dict(info, step=info["step"] + advance)
    success_now, reward, metrics = env_lib.evaluate_state(qpos, mocap_pos, info)
    success = prev_success | success_now
    done = prev_done | success | (info["step"] >= info["episode_length"])
    info["privileged"] = env_lib.privileged(qpos, mocap_pos, info)
    obs = env_lib.base_observations(info)
    if cameras is not None:
      obs.update(env_lib.render_cameras(cameras, info["geom_size"], info["geom_rgba"], *kinematics))
    return obs, reward, done, success, metrics, info
  return jax.vmap(finish_one)(prev_success, prev_done, info, qpos, mocap_pos, kinematics)


class NativeBatchedEnv(BatchedEnv):
  backend = "native"

  def __init__(self, *args, num_threads: int | None = None, **kwargs):
    super().__init__(*args, **kwargs)
    base = scene.mj_model()
    self._models = [copy.copy(base) for _ in range(self.num_envs)]
    self._datas = [mujoco.MjData(model) for model in self._models]
    threads = num_threads if num_threads is not None else min(os.cpu_count() or 1, 8)
    self._pool = ThreadPoolExecutor(threads) if threads > 1 and self.num_envs > 1 else None
    index = scene.scene_index()
    self._arm_bodies = np.concatenate([index.arm_mocap, index.finger_mocap])

  def _map(self, fn):
    if self._pool is None:
      return [fn(i) for i in range(self.num_envs)]
    return list(self._pool.map(fn, range(self.num_envs)))

  def _gather(self) -> tuple[dict, tuple]:
    data = {field: np.stack([getattr(d, field) for d in self._datas]).astype(np.float32) for field in _PHYSICS_FIELDS}
    kinematics = ()
    if self.cameras is not None:
      kinematics = tuple(np.stack([getattr(d, field) for d in self._datas]).astype(np.float32)
                         for field in ("geom_xpos", "geom_xmat", "xpos", "xmat"))
      kinematics = (kinematics[0], kinematics[1].reshape(self.num_envs, -1, 3, 3), kinematics[2],
                    kinematics[3].reshape(self.num_envs, -1, 3, 3))
    return data, kinematics

  def reset(self, rng: jax.Array) -> env_lib.EnvState:
    reset, _ = _mjx_functions(None)
    initial = jax.device_get(reset(self._env_keys(rng), jax.tree.map(jnp.asarray, self.task_rows)))
    geom_size = np.asarray(initial.info["geom_size"], np.float64)
    geom_rgba = np.asarray(initial.info["geom_rgba"], np.float32)

    def load(i):
      model, data = self._models[i], self._datas[i]
      model.geom_size[:] = geom_size[i]
      model.geom_rgba[:] = geom_rgba[i]  # so MuJoCo's own renderer shows this episode's colours
      mujoco.mj_resetData(model, data)
      data.qpos[:] = initial.data.qpos[i]
      data.mocap_pos[:] = initial.data.mocap_pos[i]
      data.mocap_quat[:] = initial.data.mocap_quat[i]
      mujoco.mj_forward(model, data)

    self._map(load)
    data, kinematics = self._gather()
    obs, reward, done, success, metrics, info = jax.device_get(_finish(
        initial.success, initial.done, initial.info, data["qpos"], data["mocap_pos"], kinematics,
        cameras=self.cameras, advance=0))
    return env_lib.EnvState(data=data, obs=obs, reward=reward, done=done, success=success, metrics=metrics, info=info)

  def step(self, state: env_lib.EnvState, actions) -> env_lib.EnvState:
    info, tcp_path, arm_pos, arm_quat = jax.device_get(
        _plan(state.info, state.data["qpos"], jnp.asarray(actions, jnp.float32)))
    grip = info["grip"]
    index = scene.scene_index()

    def physics(i):
      model, data = self._models[i], self._datas[i]
      for field in _PHYSICS_FIELDS:
        getattr(data, field)[:] = state.data[field][i]
      grasped = int(grip["grasped"][i])
      for k in range(scene.SUBSTEPS):
        mujoco.mj_step(model, data)
        tcp = tcp_path[i, k]
        if 0 <= grasped < scene.NUM_OBJECTS:
          address = index.object_qpos[grasped]
          data.qpos[address[:3]] = tcp + grip["offset"][i]
          data.qpos[address[3:]] = grip["quat"][i]
          data.qvel[index.object_dof[grasped]] = 0.0
        elif grasped == tasks.HANDLE_SLOT:
          moved = float(np.dot(tcp - grip["tcp_at_grasp"][i], scene.DRAWER_AXIS))
          data.qpos[index.drawer_qpos] = np.clip(grip["drawer_at_grasp"][i] + moved, 0.0, scene.DRAWER_TRAVEL)
          data.qvel[index.drawer_dof] = 0.0
      data.mocap_pos[self._arm_bodies] = arm_pos[i]
      data.mocap_quat[self._arm_bodies] = arm_quat[i]
      if self.cameras is not None:
        mujoco.mj_kinematics(model, data)

    self._map(physics)
    data, kinematics = self._gather()
    obs, reward, done, success, metrics, info = jax.device_get(_finish(
        state.success, state.done, info, data["qpos"], data["mocap_pos"], kinematics,
        cameras=self.cameras, advance=1))
    return env_lib.EnvState(data=data, obs=obs, reward=reward, done=done, success=success, metrics=metrics, info=info)

  def mj_data(self, i: int) -> tuple[mujoco.MjModel, mujoco.MjData]:
    """The native model and data of env i (for the OpenGL renderer and debugging)."""
    return self._models[i], self._datas[i]
