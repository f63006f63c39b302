"""The environment interface and its MJX implementation: pure `reset(rng)` / `step(state, action)`.

One `Env` is one task on one environment; batch with `jax.vmap` (or use `batched.make_batched`, which
also mixes tasks in one compiled program). Observations:
  "observation.state"            [11] f32: arm joint angles (7), gripper opening (1, metres between
                                 the finger pads), the hand's tool-centre-point position (3)
  "task_index"                   [] int32: the task's position in registry.list_tasks()
  "observation.environment_state" [7] f32: the task's object state (robosuite's "object-state"
                                 analogue, for state-based policies): the target object's position
                                 (3), the position it must reach (3), whether it is held (1)
  "observation.images.agentview" [H, W, 3] uint8, front camera facing the robot   (cameras on)
  "observation.images.wrist"     [H, W, 3] uint8, on the hand, looking down       (cameras on)
  "observation.depth.agentview" / "observation.depth.wrist" [H, W] f32 metres along the camera
                                 axis, 0 where nothing is hit                      (cameras on)
  "observation.environment_pixels" [8] f32: where the target and its goal position appear in
                                 each camera, (x, y) in [-1, 1] when in view (agentview target,
                                 agentview goal, wrist target, wrist goal); privileged, like the
                                 environment state: a training-only label for image keypoints (cameras on)
Actions: [dx, dy, dz, gripper] in [-1, 1] (see control.py). Control at 10 Hz, physics at 100 Hz.
`done` and `success` are sticky: once set they stay set; the physics keeps stepping.
`info` holds the step count, the episode's task parameters (resolved target, goal, tolerances),
per-episode geom sizes and colours, the controller targets and gripper command, and "privileged"
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

from ejax.sim import camera, control, layout, scene, tasks

STATE_SIZE = 11
ENVIRONMENT_STATE_SIZE = 7
CAMERA_NAMES = ("agentview", "wrist")
ENVIRONMENT_PIXELS = "observation.environment_pixels"
PIXEL_POINTS = 2  # target, goal


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
  # On this process's own device: MJX's default, jax.devices()[0], belongs to process 0 in a
  # multi-process run (arrays another process cannot read).
  with jax.ensure_compile_time_eval():
    return mjx.put_model(scene.mj_model(), device=jax.local_devices()[0])


def fixture_positions(mocap_pos: Any) -> Any:
  """Bowl and plate positions [2, 3]."""
  index = scene.scene_index()
  return mocap_pos[np.array([index.bowl_mocap, index.plate_mocap])]


def privileged(qpos: Any, mocap_pos: Any, info: dict, grasped: Any, xp: Any = jnp) -> dict:
  """What a scripted expert needs: tcp, the target's position, its goal, and grasp flags."""
  positions = control.graspable_positions(qpos, xp)
  return {"tcp": control.tcp_position(qpos), "target_pos": positions[info["target"]],
          "goal": tasks.goal_position(info, positions, fixture_positions(mocap_pos), xp),
          "holding": grasped == info["target"], "holding_other": (grasped >= 0) & (grasped != info["target"]),
          "is_drawer": info["is_drawer"], "is_lift": info["is_lift"], "require_release": info["require_release"],
          "target_half_height": info["half_heights"][info["target"]], "ee_target": info["ee_target"]}


def state_vector(qpos: Any, info: dict, xp: Any = jnp) -> Any:
  return xp.concatenate([info["arm_q"], control.gripper_gap(qpos, xp)[None], control.tcp_position(qpos)]).astype(xp.float32)


def assess(qpos: Any, qvel: Any, mocap_pos: Any, info: dict, prev_success: Any, prev_done: Any, unstable: Any = False,
           xp: Any = jnp):
  """The task's verdict on a physics state, shared by both backends.

  unstable: the step's physics diverged (the backend kept the state before it): the episode ends
  without success, and metrics["unstable"] says so.
  -> (success, done, reward, metrics, info with "privileged"); success and done are sticky.
  """
  grasped = control.grasped_slot(qpos, qvel, info["close"], info["half_widths"], xp)
  success_now, reward, metrics = tasks.evaluate(info, control.tcp_position(qpos), control.graspable_positions(qpos, xp),
                                                fixture_positions(mocap_pos), grasped, xp)
  unstable = xp.asarray(unstable, bool)
  success = prev_success | (success_now & ~unstable)
  done = prev_done | success | (info["step"] >= info["episode_length"]) | unstable
  metrics = dict(metrics, unstable=unstable.astype(xp.float32))
  info = dict(info, privileged=privileged(qpos, mocap_pos, info, grasped, xp))
  return success, done, reward, metrics, info


def with_arm_pose(mocap_pos: Any, mocap_quat: Any, info: dict, xp: Any = jnp) -> tuple[Any, Any]:
  """Mocap arrays with links 1..7 posed from info["arm_q"]."""
  bodies = scene.scene_index().arm_mocap
  pos, quat = control.arm_mocap_pose(info["arm_q"], xp)
  if xp is np:
    mocap_pos, mocap_quat = mocap_pos.copy(), mocap_quat.copy()
    mocap_pos[bodies], mocap_quat[bodies] = pos, quat
    return mocap_pos, mocap_quat
  return mocap_pos.at[bodies].set(pos), mocap_quat.at[bodies].set(quat)


def render_cameras(config: CameraConfig, geom_size, geom_rgba, geom_xpos, geom_xmat, body_xpos, body_xmat,
                   hits: dict | None = None, points=None) -> dict:
  """Both cameras for one env from its kinematics (any backend): the observation image entries, and
  with `points` [P, 3] (world) also "observation.environment_pixels" [cameras * P * 2], where each
  point appears in each camera (camera.image_points: (x, y) in [-1, 1] when in view).

  hits: None ray casts every geom here (camera.render); or, per camera name, the nearest non-plane geom
  on each pixel's ray as a backend cast it itself: (geom ids [P], distances [P], normals [P, 3] in camera
  axes), see camera.render_from_hits.
  """
  model = scene.mj_model()
  geom_types = tuple(int(t) for t in model.geom_type)
  obs, pixels = {}, []
  for name in CAMERA_NAMES:
    cam = model.camera(name)
    cam_pos, cam_mat = camera.camera_pose(int(cam.bodyid[0]), cam.pos, cam.quat, body_xpos, body_xmat)
    size = dict(height=config.height, width=config.width, fovy=float(cam.fovy[0]))
    if hits is None:
      rgb, depth = camera.render(geom_types, geom_size, geom_xpos, geom_xmat, geom_rgba, cam_pos, cam_mat, **size)
    else:
      rgb, depth = camera.render_from_hits(geom_types, geom_size, geom_xpos, geom_xmat, geom_rgba, cam_pos, cam_mat,
                                           *hits[name], **size)
    obs[f"observation.images.{name}"] = rgb
    obs[f"observation.depth.{name}"] = depth
    if points is not None:
      pixels.append(camera.image_points(points, cam_pos, cam_mat, **size, xp=jnp))
  if points is not None:
    obs[ENVIRONMENT_PIXELS] = jnp.concatenate([p.reshape(-1) for p in pixels])
  return obs


def pixel_points(info: dict, xp: Any = jnp) -> Any:
  """[2, 3] the world points "observation.environment_pixels" locates in each camera: the target
  object and the position it must reach (from info["privileged"], set before observing)."""
  p = info["privileged"]
  return xp.stack([p["target_pos"], p["goal"]]).astype(xp.float32)


def environment_state(info: dict, xp: Any = jnp) -> Any:
  """[7]: target position, goal position, held flag (from info["privileged"], set before observing)."""
  p = info["privileged"]
  return xp.concatenate([p["target_pos"], p["goal"], xp.asarray(p["holding"], xp.float32)[None]]).astype(xp.float32)


def base_observations(qpos: Any, info: dict, xp: Any = jnp) -> dict:
  return {"observation.state": state_vector(qpos, info, xp), "observation.environment_state": environment_state(info, xp),
          "task_index": info["task_index"]}


def _observe(model: mjx.Model, data: mjx.Data, info: dict, cameras: CameraConfig | None) -> dict:
  obs = base_observations(data.qpos, info)
  if cameras is not None:
    data = mjx.kinematics(model, data)  # geom poses for the final qpos / mocap of this step
    obs.update(render_cameras(cameras, info["geom_size"], info["geom_rgba"], data.geom_xpos, data.geom_xmat,
                              data.xpos, data.xmat, points=pixel_points(info)))
  return obs


def _finish(model: mjx.Model, data: mjx.Data, info: dict, prev_success: jax.Array, prev_done: jax.Array,
            cameras: CameraConfig | None, unstable: jax.Array | bool = False) -> EnvState:
  success, done, reward, metrics, info = assess(data.qpos, data.qvel, data.mocap_pos, info, prev_success, prev_done,
                                                unstable)
  return EnvState(data=data, obs=_observe(model, data, info, cameras), reward=reward, done=done,
                  success=success, metrics=metrics, info=info)


def mjx_reset(rng: jax.Array, task_row: dict, cameras: CameraConfig | None) -> EnvState:
  """Reset one env for the task row (tasks.encode_task + "task_index", "episode_length")."""
  episode = layout.sample_episode(rng, task_row)
  info = dict(episode["info"], step=jnp.zeros((), jnp.int32), task_index=jnp.asarray(task_row["task_index"], jnp.int32),
              episode_length=jnp.asarray(task_row["episode_length"], jnp.int32))
  model = mjx_model().replace(geom_size=info["geom_size"])
  data = mjx.make_data(mjx_model(), device=jax.local_devices()[0])
  mocap_pos, mocap_quat = with_arm_pose(episode["mocap_pos"], data.mocap_quat, info)
  # No mjx.forward here: observations come from qpos and our own kinematics, the cameras run
  # mjx.kinematics, and the first mjx.step computes the rest. It keeps reset cheap to compile.
  data = data.replace(qpos=episode["qpos"], mocap_pos=mocap_pos, mocap_quat=mocap_quat,
                      ctrl=control.initial_ctrl(info["arm_q"], jnp))
  never = jnp.zeros((), bool)
  return _finish(model, data, info, never, never, cameras)


DIVERGED = 1e10


def diverged(qpos: Any, qvel: Any, xp: Any = jnp) -> Any:
  """[] bool: the physics state has left the finite range a simulation can continue from."""
  return ~(xp.all(xp.abs(qpos) < DIVERGED) & xp.all(xp.abs(qvel) < DIVERGED))


def mjx_step(state: EnvState, action: jax.Array, cameras: CameraConfig | None) -> EnvState:
  model = mjx_model().replace(geom_size=state.info["geom_size"])
  info, ctrl_path = control.plan_step(state.info, action, jnp)

  def substep(data, ctrl):
    return mjx.step(model, data.replace(ctrl=control.substep_ctrl(ctrl, data.qpos, jnp))), None

  data, _ = jax.lax.scan(substep, state.data, ctrl_path)
  # Physics that diverged ends the episode on the state before the step, so that no non-finite value
  # reaches an observation, a reward or the next step. "Diverged" as native MuJoCo's warnings have it:
  # a position or velocity that is not finite or beyond DIVERGED (MuJoCo's mjMAXVAL).
  unstable = diverged(data.qpos, data.qvel)
  data = jax.tree.map(lambda new, old: jnp.where(unstable, old, new), data, state.data)
  mocap_pos, mocap_quat = with_arm_pose(data.mocap_pos, data.mocap_quat, info)
  data = data.replace(mocap_pos=mocap_pos, mocap_quat=mocap_quat)
  info["step"] = info["step"] + 1
  return _finish(model, data, info, state.success, state.done, cameras, unstable)


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
      shapes[ENVIRONMENT_PIXELS] = ((len(CAMERA_NAMES) * PIXEL_POINTS * 2,), "float32")
    return shapes
