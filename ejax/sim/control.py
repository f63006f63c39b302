"""The action space and the controller behind it, written once for numpy and jax.numpy (`xp`).

Action (4 floats in [-1, 1]): [dx, dy, dz, gripper].
  - dx, dy, dz move the end-effector target by up to MAX_DELTA metres per control step (10 Hz) in the
    world frame (x away from the robot, y to its left, z up); the target is clipped to WORKSPACE.
  - gripper > 0 closes, <= 0 opens (LIBERO's sign convention).
The hand keeps a fixed downward orientation. Each step runs IK_ITERATIONS damped-least-squares IK
updates (kinematics.ik_step) from the previous joint target; the joints then move towards it at most
MAX_JOINT_STEP per control step (a rate-limited kinematic servo, interpolated over the physics
substeps).
Cartesian deltas suit both the scripted experts (waypoints) and learned policies (small, bounded,
embodiment-agnostic), and the IK lives inside the env so policies never see joint-space quirks.

Grasping: when the gripper closes with the tool centre point within GRASP_RADIUS_XY / GRASP_RADIUS_Z
of a graspable (an object's centre or the drawer handle), that graspable is attached to the hand
(the held object follows the tcp rigidly every physics substep; the drawer follows the tcp's motion
along its slide axis). Opening the gripper releases it. This replaces frictional grasping, which
would need finger collisions and make MJX several times slower and the experts fragile.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ejax.sim import kinematics, scene

ACTION_SIZE = 4
MAX_DELTA = 0.04                       # metres per control step per axis at |action| = 1
WORKSPACE_LOW = np.array([0.25, -0.38, 0.0], np.float32)
WORKSPACE_HIGH = np.array([0.75, 0.45, 0.45], np.float32)
IK_ITERATIONS = 2
MAX_JOINT_STEP = 0.25                  # rad per control step (2.5 rad/s, about a Panda's joint speed)
MAX_FINGER_STEP = 0.02                 # metres per control step per finger
GRASP_RADIUS_XY = 0.02
GRASP_RADIUS_Z = 0.02
NO_GRASP = -1
_TCP_ROTATION = kinematics.home_tcp_rotation()


def update_targets(ee_target: Any, q_target: Any, action: Any, xp: Any = np) -> tuple[Any, Any]:
  """Move the Cartesian target by the action and solve IK for the new joint target ([3], [7])."""
  delta = xp.clip(action[:3], -1.0, 1.0) * MAX_DELTA
  ee_target = xp.clip(ee_target + delta, xp.asarray(WORKSPACE_LOW), xp.asarray(WORKSPACE_HIGH))
  rotation = xp.asarray(_TCP_ROTATION)
  for _ in range(IK_ITERATIONS):
    q_target = kinematics.ik_step(q_target, ee_target, rotation, xp=xp)
  return ee_target, q_target


def update_grasp(grip: dict, close: Any, tcp: Any, graspables: Any, object_quats: Any, drawer_q: Any,
                 xp: Any = np) -> dict:
  """New grasp state after the gripper command. `grip` holds:
    grasped [] int32 (slot or NO_GRASP), offset [3] (held object - tcp), quat [4] (held object's
    orientation), tcp_at_grasp [3], drawer_at_grasp [].
  """
  xy_distance = xp.sqrt(xp.sum((graspables[:, :2] - tcp[None, :2]) ** 2, axis=-1))
  z_distance = xp.abs(graspables[:, 2] - tcp[2])
  in_reach = (xy_distance < GRASP_RADIUS_XY) & (z_distance < GRASP_RADIUS_Z)
  nearest = xp.argmin(xp.where(in_reach, xy_distance + z_distance, xp.inf)).astype(xp.int32)
  new_grasp = close & (grip["grasped"] == NO_GRASP) & xp.any(in_reach)
  grasped = xp.where(close, xp.where(new_grasp, nearest, grip["grasped"]), NO_GRASP).astype(xp.int32)
  quats = xp.concatenate([object_quats, xp.asarray(np.array([[1.0, 0, 0, 0]], np.float32))], axis=0)
  return {
      "grasped": grasped,
      "offset": xp.where(new_grasp, graspables[nearest] - tcp, grip["offset"]),
      "quat": xp.where(new_grasp, quats[nearest], grip["quat"]),
      "tcp_at_grasp": xp.where(new_grasp, tcp, grip["tcp_at_grasp"]),
      "drawer_at_grasp": xp.where(new_grasp, drawer_q, grip["drawer_at_grasp"]),
  }


def initial_grip(xp: Any = np) -> dict:
  return {"grasped": xp.asarray(NO_GRASP, dtype=xp.int32), "offset": xp.zeros(3, xp.float32),
          "quat": xp.asarray(np.array([1.0, 0, 0, 0], np.float32)), "tcp_at_grasp": xp.zeros(3, xp.float32),
          "drawer_at_grasp": xp.zeros((), xp.float32)}


def finger_target(close: Any, grip: dict, object_half_widths: Any, xp: Any = np) -> Any:
  """Per-finger opening: wide open, or closed onto the held object's half width (visual only)."""
  held = xp.clip(grip["grasped"], 0, object_half_widths.shape[0] - 1)
  holding_object = (grip["grasped"] >= 0) & (grip["grasped"] < object_half_widths.shape[0])
  closed = xp.where(holding_object, object_half_widths[held], 0.0)
  return xp.where(close, closed, scene.FINGER_OPEN).astype(xp.float32)


def drawer_follow(grip: dict, tcp: Any, xp: Any = np) -> Any:
  """Drawer opening while its handle is held: the tcp's displacement along the slide axis."""
  moved = xp.sum((tcp - grip["tcp_at_grasp"]) * xp.asarray(scene.DRAWER_AXIS))
  return xp.clip(grip["drawer_at_grasp"] + moved, 0.0, scene.DRAWER_TRAVEL)


def graspable_positions(qpos: Any, xp: Any = np) -> Any:
  """Positions [5, 3] of the four objects' centres and the drawer handle."""
  index = scene.scene_index()
  objects = qpos[index.object_qpos[:, :3]]
  return xp.concatenate([objects, scene.handle_position(qpos[index.drawer_qpos], xp)[None]], axis=0)


def plan_step(info: dict, qpos: Any, action: Any, xp: Any = np) -> tuple[dict, Any]:
  """Everything a control step decides before physics, shared by both backends.

  -> (info with the new grasp state, targets, joint angles "arm_q" and finger opening "finger";
      tcp position at the end of each physics substep [SUBSTEPS, 3], for holding the grasped object).
  """
  index = scene.scene_index()
  action = xp.clip(xp.asarray(action, dtype=xp.float32), -1.0, 1.0)
  close = action[3] > 0
  q_now = info["arm_q"]
  tcp_now, _, _, _ = kinematics.forward_kinematics(q_now, xp)
  grip = update_grasp(info["grip"], close, tcp_now, graspable_positions(qpos, xp),
                      qpos[index.object_qpos[:, 3:]], qpos[index.drawer_qpos], xp)
  ee_target, q_target = update_targets(info["ee_target"], info["q_target"], action, xp)
  q_next = q_now + xp.clip(q_target - q_now, -MAX_JOINT_STEP, MAX_JOINT_STEP)
  finger_goal = finger_target(close, grip, info["half_widths"], xp)
  finger_next = info["finger"] + xp.clip(finger_goal - info["finger"], -MAX_FINGER_STEP, MAX_FINGER_STEP)
  fractions = xp.asarray(np.arange(1, scene.SUBSTEPS + 1, dtype=np.float32) / scene.SUBSTEPS)
  q_path = q_now[None] + fractions[:, None] * (q_next - q_now)[None]
  tcp_path, _, _, _ = kinematics.forward_kinematics(q_path, xp)
  info = dict(info, grip=grip, ee_target=ee_target, q_target=q_target, arm_q=q_next,
              finger=finger_next.astype(xp.float32))
  return info, tcp_path


def arm_mocap_pose(q: Any, finger: Any, xp: Any = np) -> tuple[Any, Any]:
  """Mocap poses of links 1..7, hand, left and right finger: positions [10, 3], quaternions [10, 4]."""
  positions, rotations = kinematics.link_frames(q, xp)
  hand_pos, hand_rot = positions[7], rotations[7]
  finger_pos = hand_pos[None] + scene.finger_offsets(finger, xp) @ hand_rot.T
  all_pos = xp.concatenate([positions, finger_pos], axis=0)
  all_rot = xp.concatenate([rotations, xp.stack([hand_rot, hand_rot])], axis=0)
  return all_pos.astype(xp.float32), kinematics.matrix_to_quat(all_rot, xp).astype(xp.float32)
