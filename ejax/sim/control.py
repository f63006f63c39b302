"""The action space and the controller behind it, written once for numpy and jax.numpy (`xp`).

Action (4 floats in [-1, 1]): [dx, dy, dz, gripper].
  - dx, dy, dz move the end-effector target by up to MAX_DELTA metres per control step (10 Hz) in the
    world frame (x away from the robot, y to its left, z up); the target is clipped to WORKSPACE and
    kept within the arm's REACH.
  - gripper > 0 closes, <= 0 opens (LIBERO's sign convention).
The hand keeps a fixed downward orientation. Each step runs IK_ITERATIONS damped-least-squares IK
updates (kinematics.ik_step) from the previous joint target; the joints then move towards it at most
MAX_JOINT_STEP per control step (a rate-limited joint servo). The forward kinematics of that joint
path, sampled at every physics substep, is the set point of the hand's position servos (scene.py),
with a velocity feed-forward so the hand tracks it without lag. The finger command moves at most
MAX_FINGER_STEP per control step towards open or fully closed. Like a non-backdrivable gripper
that stops where it meets resistance, each finger's set point stays at most SQUEEZE inside where
the finger is, re-read every physics substep (`substep_ctrl`): a finger on an object squeezes it
with kp * SQUEEZE (8 N) and stays stiff against sideways loads, instead of saturating its force
limit and yielding.
Cartesian deltas suit both the scripted experts (waypoints) and learned policies (small, bounded,
embodiment-agnostic), and the IK lives inside the env so policies never see joint-space quirks.

Holding is physical: an object is held only by finger friction. `grasped_slot` reports which
graspable (object or drawer handle) is between closed, settled fingers, for rewards, success ("let
go of it") and the experts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ejax.sim import kinematics, scene

ACTION_SIZE = 4
MAX_DELTA = 0.04                       # metres per control step per axis at |action| = 1
WORKSPACE_LOW = np.array([0.25, -0.38, scene.FINGER_PAD_RADIUS + scene.FINGER_PAD_HALF_LENGTH], np.float32)
WORKSPACE_HIGH = np.array([0.75, 0.45, 0.45], np.float32)
# The box's far corners are out of the arm's reach with the hand pointing down: its flange (TCP_FLANGE
# above the tcp) reaches 0.80 m from the shoulder (joint 2's axis, SHOULDER) with the elbow straight.
# Chasing a target out there, the IK straightened the elbow onto its joint limit, lost the hand's
# orientation and ended with every joint at a limit and the hand driven into the table (random actions:
# 1 of 30 envs within 500 steps, whose MJX physics then went NaN). Targets stay within REACH of the
# shoulder, 2 cm inside that singular edge; every task's waypoints lie well within it.
SHOULDER = np.array([0.0, 0.0, kinematics.PANDA_DH[0][1]], np.float32)
TCP_FLANGE = np.array([0.0, 0.0, kinematics.FLANGE_D + kinematics.TCP_OFFSET], np.float32)
REACH = 0.78
IK_ITERATIONS = 2
MAX_JOINT_STEP = 0.25                  # rad per control step (2.5 rad/s, about a Panda's joint speed)
MAX_FINGER_STEP = 0.02                 # metres per control step per finger (0.2 m/s)
SQUEEZE = 0.004                        # a closing finger's set point stays this far inside its position
NO_GRASP = -1
# A graspable is held when its centre is inside this box around the tcp (hand frame: along the pads,
# across them, along the gripper) while the gripper is closed, the fingers have stopped
# (|velocity| < FINGER_SETTLED) and something keeps them apart (gap > MIN_HOLD_GAP).
HOLD_BOX = np.array([0.03, 0.02, 0.025], np.float32)
FINGER_SETTLED = 0.05                  # m/s
MIN_HOLD_GAP = 0.006                   # m between the pads
_TCP_ROTATION = kinematics.home_tcp_rotation()


def within_reach(ee_target: Any, xp: Any = np) -> Any:
  """The tcp target [3] moved towards the shoulder until the flange above it is within REACH (a
  target within it is returned as it is, bit for bit)."""
  base = xp.asarray(SHOULDER) - xp.asarray(TCP_FLANGE)
  flange = ee_target - base
  distance = xp.sqrt(xp.sum(flange * flange))
  moved = base + flange * (REACH / xp.maximum(distance, REACH))
  return xp.where(distance > REACH, moved, ee_target).astype(xp.float32)


def update_targets(ee_target: Any, q_target: Any, action: Any, xp: Any = np) -> tuple[Any, Any]:
  """Move the Cartesian target by the action and solve IK for the new joint target ([3], [7])."""
  delta = xp.clip(action[:3], -1.0, 1.0) * MAX_DELTA
  ee_target = within_reach(xp.clip(ee_target + delta, xp.asarray(WORKSPACE_LOW), xp.asarray(WORKSPACE_HIGH)), xp)
  rotation = xp.asarray(_TCP_ROTATION)
  for _ in range(IK_ITERATIONS):
    q_target = kinematics.ik_step(q_target, ee_target, rotation, xp=xp)
  return ee_target, q_target


def graspable_positions(qpos: Any, xp: Any = np) -> Any:
  """Positions [5, 3] of the four objects' centres and the drawer handle."""
  index = scene.scene_index()
  objects = qpos[index.object_qpos[:, :3]]
  return xp.concatenate([objects, scene.handle_position(qpos[index.drawer_qpos], xp)[None]], axis=0)


def tcp_position(qpos: Any) -> Any:
  """The hand's actual tool centre point [3] (its slide joints are world coordinates)."""
  return qpos[scene.scene_index().hand_qpos]


def gripper_gap(qpos: Any, xp: Any = np) -> Any:
  """Distance between the finger pads [] (metres; 2 * FINGER_OPEN when fully open)."""
  return xp.sum(qpos[scene.scene_index().finger_qpos])


def grasped_slot(qpos: Any, qvel: Any, close: Any, half_widths: Any, xp: Any = np) -> Any:
  """Which graspable the closed fingers hold ([] int32: slot, or NO_GRASP), from the physical state.

  Held: inside HOLD_BOX around the tcp, the gripper commanded closed, the fingers settled and kept
  apart by at most the graspable's widest horizontal extent (a rotated cube's diagonal) plus 4 mm.
  """
  index = scene.scene_index()
  relative = (graspable_positions(qpos, xp) - tcp_position(qpos)[None]) @ xp.asarray(scene.HAND_ROTATION)  # hand frame
  in_box = xp.all(xp.abs(relative) < xp.asarray(HOLD_BOX)[None], axis=-1)
  gap = gripper_gap(qpos, xp)
  settled = xp.max(xp.abs(qvel[index.finger_dof])) < FINGER_SETTLED
  apart = (gap > MIN_HOLD_GAP) & (gap < 2 * np.sqrt(2) * half_widths + 0.004)
  candidates = in_box & apart & settled & close
  distance = xp.sum(relative ** 2, axis=-1)
  nearest = xp.argmin(xp.where(candidates, distance, xp.inf)).astype(xp.int32)
  return xp.where(xp.any(candidates), nearest, NO_GRASP).astype(xp.int32)


def plan_step(info: dict, action: Any, xp: Any = np) -> tuple[dict, Any]:
  """Everything a control step decides before physics, shared by both backends.

  -> (info with the new targets, joint angles "arm_q", finger set point "finger" and gripper command
      "close"; the actuator set points for each physics substep [SUBSTEPS, nu], before substep_ctrl).
  """
  action = xp.clip(xp.asarray(action, dtype=xp.float32), -1.0, 1.0)
  close = action[3] > 0
  q_now = info["arm_q"]
  ee_target, q_target = update_targets(info["ee_target"], info["q_target"], action, xp)
  q_next = q_now + xp.clip(q_target - q_now, -MAX_JOINT_STEP, MAX_JOINT_STEP)
  finger_goal = xp.where(close, 0.0, scene.FINGER_OPEN)
  finger_next = info["finger"] + xp.clip(finger_goal - info["finger"], -MAX_FINGER_STEP, MAX_FINGER_STEP)
  fractions = xp.asarray(np.arange(0, scene.SUBSTEPS + 1, dtype=np.float32) / scene.SUBSTEPS)
  q_path = q_now[None] + fractions[:, None] * (q_next - q_now)[None]                  # [SUBSTEPS + 1, 7]
  tcp_path, _, _, _ = kinematics.forward_kinematics(q_path, xp)
  # Position servo with kv: force = kp (ctrl - x) - kv v. Offsetting the set point by (kv / kp) v*
  # turns it into kp (x* - x) + kv (v* - v): the hand tracks the moving set point without lag.
  velocity = (tcp_path[1:] - tcp_path[:-1]) / scene.TIMESTEP
  hand_ctrl = tcp_path[1:] + (scene.HAND_KV / scene.HAND_KP) * velocity
  finger_path = info["finger"] + fractions[1:] * (finger_next - info["finger"])        # [SUBSTEPS]
  ctrl = xp.concatenate([hand_ctrl, finger_path[:, None], finger_path[:, None]], axis=-1).astype(xp.float32)
  info = dict(info, ee_target=ee_target, q_target=q_target, arm_q=q_next, finger=finger_next.astype(xp.float32),
              close=close)
  return info, ctrl


def substep_ctrl(ctrl: Any, qpos: Any, xp: Any = np) -> Any:
  """The set points [nu] to apply for one physics substep: the planned ones, with each finger's kept
  at most SQUEEZE inside the finger's current position."""
  fingers = xp.maximum(ctrl[3:], qpos[scene.scene_index().finger_qpos] - SQUEEZE)
  return xp.concatenate([ctrl[:3], fingers]).astype(ctrl.dtype)


def initial_ctrl(arm_q: Any, xp: Any = np) -> Any:
  """Actuator set points [nu] holding the hand at forward_kinematics(arm_q) with the gripper open."""
  tcp, _, _, _ = kinematics.forward_kinematics(arm_q, xp)
  return xp.concatenate([tcp, xp.full(2, scene.FINGER_OPEN)]).astype(xp.float32)


def arm_mocap_pose(q: Any, xp: Any = np) -> tuple[Any, Any]:
  """Mocap poses of links 1..7: positions [7, 3], quaternions [7, 4]."""
  positions, rotations = kinematics.link_frames(q, xp)
  return positions[:7].astype(xp.float32), kinematics.matrix_to_quat(rotations[:7], xp).astype(xp.float32)
