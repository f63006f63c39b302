"""The environment interface and its MJX implementation: pure `reset(rng)` / `step(state, action)`.

One `Env` is one task on one environment; batch with `jax.vmap` (or use `batched.make_batched`, which
also mixes tasks in one compiled program). Observations:
  "observation.state"            [11] f32: arm joint angles (7), gripper opening (1, metres between
                                 the fingers), tool-centre-point position (3)
  "task_index"                   [] int32: the task's position in registry.list_tasks()
  "observation.environment_state" [7] f32: the task's object state (robosuite's "object-state"
                                 analogue, for state-based policies): the target object's position
                                 (3), the position it must reach (3), whether it is held (1)
  "observation.images.agentview" [H, W, 3] uint8, front camera facing the robot   (cameras on)
  "observation.images.wrist"     [H, W, 3] uint8, on the hand, looking down       (cameras on)
  "observation.depth.agentview" / "observation.depth.wrist" [H, W] f32 metres along the camera
                                 axis, 0 where nothing is hit                      (cameras on)
Actions: [dx, dy, dz, gripper] in [-1, 1] (see control.py). Control at 10 Hz, physics at 100 Hz.
`done` and `success` are sticky: once set they stay set; the physics keeps stepping.
`info` holds the step count, the episode's task parameters (resolved target, goal, tolerances),
per-episode geom sizes and colours, the controller targets, the grasp state, and "privileged"
(tcp, target position, goal, holding) for scripted experts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from mujoco import mjx

from ejax.sim import camera, control, kinematics, layout, scene, tasks

STATE_SIZE = 11
ENVIRONMENT_STATE_SIZE = 7
CAMERA_NAMES = ("agentview", "wrist")


@struct.dataclass
class EnvState:
  data: Any                     # mjx.Data (MJX backend) / dict of numpy arrays (native backend)
  obs: dict[str, jax.Array]
  reward: jax.Array             # [] f32, dense, in [0, 1]
  done: jax.Array               # [] bool
  success: jax.Array            # [] bool
  metrics: dict[str, jax.Array]
  info: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class CameraConfig:
  height: int = 64
  width: int = 64


@functools.lru_cache(maxsize=None)
def mjx_model() -> mjx.Model:
  # Built eagerly even when first called inside a trace, so the cached model holds no tracers.
  with jax.ensure_compile_time_eval():
    return mjx.put_model(scene.mj_model())


def fixture_positions(mocap_pos: Any) -> Any:
  """Bowl and plate positions [2, 3]."""
  index = scene.scene_index()
  return mocap_pos[np.array([index.bowl_mocap, index.plate_mocap])]


def privileged(qpos: Any, mocap_pos: Any, info: dict, xp: Any = jnp) -> dict:
  """What a scripted expert needs: tcp, the target's position, its goal, and grasp flags."""
  tcp, _, _, _ = kinematics.forward_kinematics(info["arm_q"], xp)
  positions = control.graspable_positions(qpos, xp)
  grasped = info["grip"]["grasped"]
  return {"tcp": tcp, "target_pos": positions[info["target"]],
          "goal": tasks.goal_position(info, positions, fixture_positions(mocap_pos), xp),
          "holding": grasped == info["target"], "holding_other": (grasped >= 0) & (grasped != info["target"]),
          "is_drawer": info["is_drawer"], "is_lift": info["is_lift"], "require_release": info["require_release"],
          "target_half_height": info["half_heights"][info["target"]], "ee_target": info["ee_target"]}


def state_vector(info: dict, xp: Any = jnp) -> Any:
  q = info["arm_q"]
  tcp, _, _, _ = kinematics.forward_kinematics(q, xp)
  return xp.concatenate([q, 2 * info["finger"][None], tcp]).astype(xp.float32)


def evaluate_state(qpos: Any, mocap_pos: Any, info: dict, xp: Any = jnp):
  tcp, _, _, _ = kinematics.forward_kinematics(info["arm_q"], xp)
  return tasks.evaluate(info, tcp, control.graspable_positions(qpos, xp), fixture_positions(mocap_pos),
                        info["grip"]["grasped"], xp)


def with_arm_pose(mocap_pos: Any, mocap_quat: Any, info: dict, xp: Any = jnp) -> tuple[Any, Any]:
  """Mocap arrays with the arm, hand and fingers posed from info["arm_q"] / info["finger"]."""
  index = scene.scene_index()
  bodies = np.concatenate([index.arm_mocap, index.finger_mocap])
  pos, quat = control.arm_mocap_pose(info["arm_q"], info["finger"], xp)
  if xp is np:
    mocap_pos, mocap_quat = mocap_pos.copy(), mocap_quat.copy()
    mocap_pos[bodies], mocap_quat[bodies] = pos, quat
    return mocap_pos, mocap_quat
  return mocap_pos.at[bodies].set(pos), mocap_quat.at[bodies].set(quat)


def render_cameras(config: CameraConfig, geom_size, geom_rgba, geom_xpos, geom_xmat, body_xpos, body_xmat) -> dict:
  """Both cameras for one env from its kinematics (any backend): the observation image entries."""
  model = scene.mj_model()
  obs = {}
  for name in CAMERA_NAMES:
    cam = model.camera(name)
    cam_pos, cam_mat = camera.camera_pose(int(cam.bodyid[0]), cam.pos, cam.quat, body_xpos, body_xmat)
    rgb, depth = camera.render(tuple(int(t) for t in model.geom_type), geom_size, geom_xpos, geom_xmat, geom_rgba,
                               cam_pos, cam_mat, height=config.height, width=config.width,
                               fovy=float(cam.fovy[0]))
    obs[f"observation.images.{name}"] = rgb
    obs[f"observation.depth.{name}"] = depth
  return obs


def environment_state(info: dict, xp: Any = jnp) -> Any:
  """[7]: target position, goal position, held flag (from info["privileged"], set before observing)."""
  p = info["privileged"]
  return xp.concatenate([p["target_pos"], p["goal"], xp.asarray(p["holding"], xp.float32)[None]]).astype(xp.float32)


def base_observations(info: dict, xp: Any = jnp) -> dict:
  return {"observation.state": state_vector(info, xp), "observation.environment_state": environment_state(info, xp),
          "task_index": info["task_index"]}


def _observe(model: mjx.Model, data: mjx.Data, info: dict, cameras: CameraConfig | None) -> dict:
  obs = base_observations(info)
  if cameras is not None:
    data = mjx.kinematics(model, data)  # geom poses for the final qpos / mocap of this step
    obs.update(render_cameras(cameras, info["geom_size"], info["geom_rgba"], data.geom_xpos, data.geom_xmat,
                              data.xpos, data.xmat))
  return obs


def _attach(data: mjx.Data, grip: dict, tcp: jax.Array) -> mjx.Data:
  """Hold the grasped object rigidly at the tcp (zero velocity), or drag the drawer with the tcp."""
  index = scene.scene_index()
  held = grip["grasped"] == jnp.arange(scene.NUM_OBJECTS)                     # [4]
  object_qpos = data.qpos[index.object_qpos]                                  # [4, 7]
  pose = jnp.concatenate([tcp + grip["offset"], grip["quat"]])
  qpos = data.qpos.at[index.object_qpos].set(jnp.where(held[:, None], pose[None], object_qpos))
  qvel = data.qvel.at[index.object_dof].set(jnp.where(held[:, None], 0.0, data.qvel[index.object_dof]))
  on_handle = grip["grasped"] == tasks.HANDLE_SLOT
  qpos = qpos.at[index.drawer_qpos].set(jnp.where(on_handle, control.drawer_follow(grip, tcp, jnp),
                                                  qpos[index.drawer_qpos]))
  qvel = qvel.at[index.drawer_dof].set(jnp.where(on_handle, 0.0, qvel[index.drawer_dof]))
  return data.replace(qpos=qpos, qvel=qvel)


def mjx_reset(rng: jax.Array, task_row: dict, cameras: CameraConfig | None) -> EnvState:
  """Reset one env for the task row (tasks.encode_task + "task_index", "episode_length")."""
  episode = layout.sample_episode(rng, task_row)
  info = dict(episode["info"], step=jnp.zeros((), jnp.int32), task_index=jnp.asarray(task_row["task_index"], jnp.int32),
              episode_length=jnp.asarray(task_row["episode_length"], jnp.int32))
  model = mjx_model().replace(geom_size=info["geom_size"])
  data = mjx.make_data(mjx_model())
  mocap_pos, mocap_quat = with_arm_pose(episode["mocap_pos"], data.mocap_quat, info)
  # No mjx.forward here: observations come from our own kinematics, the cameras run mjx.kinematics,
  # and the first mjx.step computes the rest. It keeps reset cheap to compile.
  data = data.replace(qpos=episode["qpos"], mocap_pos=mocap_pos, mocap_quat=mocap_quat)
  success, reward, metrics = evaluate_state(data.qpos, data.mocap_pos, info)
  info["privileged"] = privileged(data.qpos, data.mocap_pos, info)
  return EnvState(data=data, obs=_observe(model, data, info, cameras), reward=reward, done=success,
                  success=success, metrics=metrics, info=info)


def mjx_step(state: EnvState, action: jax.Array, cameras: CameraConfig | None) -> EnvState:
  model = mjx_model().replace(geom_size=state.info["geom_size"])
  info, tcp_path = control.plan_step(state.info, state.data.qpos, action, jnp)
  grip = info["grip"]

  def substep(data, tcp):
    return _attach(mjx.step(model, data), grip, tcp), None

  data, _ = jax.lax.scan(substep, state.data, tcp_path)
  mocap_pos, mocap_quat = with_arm_pose(data.mocap_pos, data.mocap_quat, info)
  data = data.replace(mocap_pos=mocap_pos, mocap_quat=mocap_quat)
  info["step"] = info["step"] + 1
  success_now, reward, metrics = evaluate_state(data.qpos, data.mocap_pos, info)
  success = state.success | success_now
  done = state.done | success | (info["step"] >= info["episode_length"])
  info["privileged"] = privileged(data.qpos, data.mocap_pos, info)
  return EnvState(data=data, obs=_observe(model, data, info, cameras), reward=reward, done=done,
                  success=success, metrics=metrics, info=info)


def global_task_index(name: str) -> int:
  from ejax.sim.suites import TASKS
  return list(TASKS).index(name)


def task_row(spec: tasks.TaskSpec, task_index: int = 0, episode_length: int | None = None) -> dict:
  row = tasks.encode_task(spec)
  row["task_index"] = np.int32(task_index)
  row["episode_length"] = np.int32(episode_length or spec.episode_length)
  return row


class Env:
  """One task, MJX backend. `reset` and `step` are pure and jit/vmap-able."""

  action_size = control.ACTION_SIZE
  state_size = STATE_SIZE
  control_hz = scene.CONTROL_HZ

  def __init__(self, spec: tasks.TaskSpec, *, cameras: bool = False, image_size: tuple[int, int] = (64, 64),
               episode_length: int | None = None):
    self.spec = spec
    self.name, self.instruction, self.suite = spec.name, spec.instruction, spec.suite
    self.episode_length = int(episode_length or spec.episode_length)
    self.cameras = CameraConfig(image_size[0], image_size[1]) if cameras else None
    self._task_row = task_row(spec, global_task_index(spec.name), self.episode_length)

  def reset(self, rng: jax.Array) -> EnvState:
    return mjx_reset(rng, jax.tree.map(jnp.asarray, self._task_row), self.cameras)

  def step(self, state: EnvState, action: jax.Array) -> EnvState:
    return mjx_step(state, action, self.cameras)

  def observation_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
    """Documented observation shapes and dtypes."""
    shapes = {"observation.state": ((STATE_SIZE,), "float32"),
              "observation.environment_state": ((ENVIRONMENT_STATE_SIZE,), "float32"), "task_index": ((), "int32")}
    if self.cameras is not None:
      for name in CAMERA_NAMES:
        shapes[f"observation.images.{name}"] = ((self.cameras.height, self.cameras.width, 3), "uint8")
        shapes[f"observation.depth.{name}"] = ((self.cameras.height, self.cameras.width), "float32")
    return shapes
