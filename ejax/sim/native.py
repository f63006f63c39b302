"""Native MuJoCo backend: the MJX backend's controller and task maths in JAX, physics in C MuJoCo.

Split per control step:
  1. plan (jitted vmap, JAX on CPU): IK, joint servo, actuator set points for every substep —
     literally control.plan_step, the function the MJX backend runs;
  2. physics (native, one MjData per env, a thread pool over envs; mj_step releases the GIL):
     SUBSTEPS x (control.substep_ctrl, mj_step);
  3. finish (jitted vmap): success, reward, privileged state, observations and camera images.
So the two backends differ only in the physics engine, which is what the agreement test measures.
Cameras: by default MuJoCo casts the rays in C from the same thread pool (raycast_native.py) and the
finish only shades them; camera_renderer="jax" ray casts in JAX as the MJX backend does (several times
slower on a CPU, kept for comparison: benchmarks/sim.py).
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

from ejax.sim import control, raycast_native, scene
from ejax.sim import env as env_lib
from ejax.sim.batch_common import BatchedEnv, _mjx_functions

_PHYSICS_FIELDS = ("qpos", "qvel", "qacc_warmstart", "mocap_pos", "mocap_quat", "ctrl")
_DIVERGED = (mujoco.mjtWarning.mjWARN_BADQACC, mujoco.mjtWarning.mjWARN_BADQPOS, mujoco.mjtWarning.mjWARN_BADQVEL)
# MuJoCo 4.0.0's plane-cylinder collider misses the contact for about a quarter of yaw angles when an
# upright cylinder is tilted by ~1e-15 rad (the axis test sits on mjMINVAL), and the cylinder then
# falls through the table. Integration noise produces such tilts; snapping tilts below
# _NEGLIGIBLE_TILT to exactly upright after each step avoids it (tests/sim/test_backends.py).
_NEGLIGIBLE_TILT = 1e-12
CAMERA_RENDERERS = ("mujoco", "jax")


def _load_physics(data: mujoco.MjData, physics: dict, i: int) -> None:
  """Env i's physics state from a batched EnvState's data into its MjData."""
  for field in _PHYSICS_FIELDS:
    getattr(data, field)[:] = physics[field][i]


def _snap_upright(qpos: np.ndarray, tilt_address: np.ndarray) -> None:
  tilt = qpos[tilt_address]
  if 0.0 < np.abs(tilt).max() < _NEGLIGIBLE_TILT:
    qpos[tilt_address] = 0.0


@jax.jit
def _plan(info: dict, actions: jax.Array):
  def plan_one(info, action):
    info, ctrl_path = control.plan_step(info, action, jnp)
    arm_pos, arm_quat = control.arm_mocap_pose(info["arm_q"], jnp)
    return info, ctrl_path, arm_pos, arm_quat
  return jax.vmap(plan_one)(info, actions)


@functools.partial(jax.jit, static_argnames=("cameras", "advance"))
def _finish(prev_success, prev_done, info, qpos, qvel, mocap_pos, kinematics, hits, unstable, *, cameras, advance):
  def finish_one(prev_success, prev_done, info, qpos, qvel, mocap_pos, kinematics, hits, unstable):
    info = dict(info, step=info["step"] + advance)
    success, done, reward, metrics, info = env_lib.assess(qpos, qvel, mocap_pos, info, prev_success, prev_done,
                                                          unstable)
    obs = env_lib.base_observations(qpos, info)
    if cameras is not None:
      obs.update(env_lib.render_cameras(cameras, info["geom_size"], info["geom_rgba"], *kinematics, hits=hits,
                                        points=env_lib.pixel_points(info)))
    return obs, reward, done, success, metrics, info
  return jax.vmap(finish_one)(prev_success, prev_done, info, qpos, qvel, mocap_pos, kinematics, hits, unstable)


class NativeBatchedEnv(BatchedEnv):
  backend = "native"

  def __init__(self, *args, num_threads: int | None = None, camera_renderer: str = "mujoco", **kwargs):
    super().__init__(*args, **kwargs)
    if camera_renderer not in CAMERA_RENDERERS:
      raise ValueError(f"unknown camera_renderer {camera_renderer!r}: use one of {CAMERA_RENDERERS}")
    self.camera_renderer = camera_renderer
    base = scene.mj_model()
    self._models = [copy.copy(base) for _ in range(self.num_envs)]
    self._datas = [mujoco.MjData(model) for model in self._models]
    threads = num_threads if num_threads is not None else min(os.cpu_count() or 1, 8)
    self._pool = ThreadPoolExecutor(threads) if threads > 1 and self.num_envs > 1 else None
    self._arm_bodies = scene.scene_index().arm_mocap
    self._cylinder_tilt = scene.scene_index().object_qpos[scene.OBJECT_NAMES.index("cylinder"), 4:6]  # quat x, y
    self._caster = (raycast_native.NativeRayCaster(self.cameras, self.num_envs)
                    if self.cameras is not None and camera_renderer == "mujoco" else None)

  def _map(self, fn):
    if self._pool is None:
      return [fn(i) for i in range(self.num_envs)]
    return list(self._pool.map(fn, range(self.num_envs)))

  def _gather(self) -> tuple[dict, tuple, dict | None]:
    """Physics state, the cameras' kinematics (float32, for the jitted finish) and the C-cast hits."""
    data = {field: np.stack([getattr(d, field) for d in self._datas]).astype(np.float32) for field in _PHYSICS_FIELDS}
    if self.cameras is None:
      return data, (), None
    geom_xpos, geom_xmat, xpos, xmat, xipos = (np.stack([getattr(d, field) for d in self._datas])
                                               for field in ("geom_xpos", "geom_xmat", "xpos", "xmat", "xipos"))
    geom_xmat, xmat = geom_xmat.reshape(self.num_envs, -1, 3, 3), xmat.reshape(self.num_envs, -1, 3, 3)
    kinematics = tuple(array.astype(np.float32) for array in (geom_xpos, geom_xmat, xpos, xmat))
    if self._caster is None:
      return data, kinematics, None
    plan = self._caster.plan(geom_xpos, geom_xmat, xpos, xmat, xipos)
    self._map(lambda i: self._caster.cast(i, plan))
    return data, kinematics, self._caster.hits()

  def reset(self, rng: jax.Array | None = None, *, keys: jax.Array | None = None,
            state: env_lib.EnvState | None = None, where: np.ndarray | None = None) -> env_lib.EnvState:
    """New episodes from `rng` (split over the envs) or from per-env `keys` [num_envs]. Given `state`
    and `where` (bool [num_envs]), only the envs where `where` is set start a new episode and the
    others carry on from `state` (an RL env shard's auto-reset after some episodes end)."""
    reset, _ = _mjx_functions(None)
    keys = self._env_keys(rng) if keys is None else keys
    initial = jax.device_get(reset(keys, jax.tree.map(jnp.asarray, self.task_rows)))
    fresh = np.ones((self.num_envs,), bool) if state is None else np.asarray(where, bool)
    if state is not None:
      pick = lambda new, old: np.where(fresh.reshape(fresh.shape + (1,) * (np.ndim(new) - 1)), new, np.asarray(old))
      initial = initial.replace(success=pick(initial.success, state.success), done=pick(initial.done, state.done),
                                info=jax.tree.map(pick, initial.info, state.info))
    geom_size = np.asarray(initial.info["geom_size"], np.float64)
    geom_rgba = np.asarray(initial.info["geom_rgba"], np.float32)

    def load(i):
      model, data = self._models[i], self._datas[i]
      if not fresh[i]:  # carries on: its MjData holds exactly the state's physics
        _load_physics(data, state.data, i)
        mujoco.mj_kinematics(model, data)
        return
      model.geom_size[:] = geom_size[i]
      model.geom_rgba[:] = geom_rgba[i]  # so MuJoCo's own renderer shows this episode's colours
      mujoco.mj_resetData(model, data)
      data.qpos[:] = initial.data.qpos[i]
      data.mocap_pos[:] = initial.data.mocap_pos[i]
      data.mocap_quat[:] = initial.data.mocap_quat[i]
      data.ctrl[:] = initial.data.ctrl[i]
      mujoco.mj_forward(model, data)
      if self._caster is not None:
        self._caster.load_episode(i, geom_size[i], geom_rgba[i])

    self._map(load)
    data, kinematics, hits = self._gather()
    obs, reward, done, success, metrics, info = jax.device_get(_finish(
        initial.success, initial.done, initial.info, data["qpos"], data["qvel"], data["mocap_pos"], kinematics, hits,
        np.zeros(self.num_envs, bool), cameras=self.cameras, advance=0))
    return env_lib.EnvState(data=data, obs=obs, reward=reward, done=done, success=success, metrics=metrics, info=info)

  def step(self, state: env_lib.EnvState, actions) -> env_lib.EnvState:
    info, ctrl_path, arm_pos, arm_quat = jax.device_get(_plan(state.info, jnp.asarray(actions, jnp.float32)))

    unstable = np.zeros(self.num_envs, bool)

    def physics(i):
      model, data = self._models[i], self._datas[i]
      _load_physics(data, state.data, i)
      for warning in _DIVERGED:
        data.warning[warning].number = 0
      for k in range(scene.SUBSTEPS):
        data.ctrl[:] = control.substep_ctrl(ctrl_path[i, k], data.qpos)
        mujoco.mj_step(model, data)
        _snap_upright(data.qpos, self._cylinder_tilt)
      # MuJoCo resets diverged physics to the model's initial state (and warns); like MJX's runner, the
      # episode ends on the state before the step instead.
      if any(data.warning[w].number for w in _DIVERGED) or env_lib.diverged(data.qpos, data.qvel, np):
        unstable[i] = True
        _load_physics(data, state.data, i)
      data.mocap_pos[self._arm_bodies] = arm_pos[i]
      data.mocap_quat[self._arm_bodies] = arm_quat[i]
      if self.cameras is not None:
        mujoco.mj_kinematics(model, data)

    self._map(physics)
    data, kinematics, hits = self._gather()
    obs, reward, done, success, metrics, info = jax.device_get(_finish(
        state.success, state.done, info, data["qpos"], data["qvel"], data["mocap_pos"], kinematics, hits, unstable,
        cameras=self.cameras, advance=1))
    return env_lib.EnvState(data=data, obs=obs, reward=reward, done=done, success=success, metrics=metrics, info=info)

  def mj_data(self, i: int) -> tuple[mujoco.MjModel, mujoco.MjData]:
    """The native model and data of env i (for the OpenGL renderer and debugging)."""
    return self._models[i], self._datas[i]
