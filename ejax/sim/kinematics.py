"""Franka-like 7-DoF arm kinematics from public DH parameters, written once for numpy and jax.numpy.

The MuJoCo body chain in `scene.py` is built from the same table, so `forward_kinematics` here is
exactly the simulated arm's kinematics (tests check it against MuJoCo's `xpos`). The controller in
`control.py` uses these functions for damped-least-squares IK on both backends: every function
takes the array module `xp` (numpy or jax.numpy) so the MJX and native backends run identical math.

Parameters: Franka Emika Panda, modified (Craig) DH convention, from the Franka FCI documentation
("Denavit-Hartenberg parameters"): per joint (a_{i-1}, d_i, alpha_{i-1}); the flange adds d = 0.107.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# (a [m], d [m], alpha [rad]) per joint, modified DH: T_i = RotX(alpha) TransX(a) RotZ(q_i) TransZ(d).
PANDA_DH: tuple[tuple[float, float, float], ...] = (
    (0.0, 0.333, 0.0),
    (0.0, 0.0, -math.pi / 2),
    (0.0, 0.316, math.pi / 2),
    (0.0825, 0.0, math.pi / 2),
    (-0.0825, 0.384, -math.pi / 2),
    (0.0, 0.0, math.pi / 2),
    (0.088, 0.0, math.pi / 2),
)
FLANGE_D = 0.107
# Tool centre point: between the fingertips, this far below the flange along the flange z axis.
TCP_OFFSET = 0.105
JOINT_LIMITS = np.array([
    (-2.8973, 2.8973), (-1.7628, 1.7628), (-2.8973, 2.8973), (-3.0718, -0.0698),
    (-2.8973, 2.8973), (-0.0175, 3.7525), (-2.8973, 2.8973),
], dtype=np.float32)  # [7, 2]
# Home posture: the hand points straight down above the table centre.
HOME_QPOS = np.array([0.0, -0.3, 0.0, -2.2, 0.0, 1.9, 0.785], dtype=np.float32)
NUM_JOINTS = 7


def _rot_x(alpha: float) -> np.ndarray:
  c, s = math.cos(alpha), math.sin(alpha)
  return np.array([[1, 0, 0], [0, c, -s], [0, s, c]], dtype=np.float32)


def link_offsets() -> list[tuple[np.ndarray, np.ndarray]]:
  """(position, rotation) of each joint frame in its parent frame at q = 0, for building the model."""
  offsets = []
  for a, d, alpha in PANDA_DH:
    rot = _rot_x(alpha)
    offsets.append((np.array([a, 0.0, 0.0], np.float32) + rot @ np.array([0.0, 0.0, d], np.float32), rot))
  return offsets


def link_frames(q: Any, xp: Any = np) -> tuple[Any, Any]:
  """Joint angles [..., 7] -> frames of links 1..7 and the hand (flange): positions [..., 8, 3],
  rotations [..., 8, 3, 3]. World frame = arm base frame (the scene puts the base at the origin)."""
  rotation = xp.broadcast_to(xp.eye(3, dtype=xp.float32), q.shape[:-1] + (3, 3))
  position = xp.zeros(q.shape[:-1] + (3,), dtype=xp.float32)
  positions, rotations = [], []
  for i, (offset, rot_alpha) in enumerate(link_offsets()):
    position = position + xp.einsum("...ij,j->...i", rotation, xp.asarray(offset))
    rotation = rotation @ xp.asarray(rot_alpha)
    c, s = xp.cos(q[..., i]), xp.sin(q[..., i])
    zero, one = xp.zeros_like(c), xp.ones_like(c)
    rot_z = xp.stack([xp.stack([c, -s, zero], -1), xp.stack([s, c, zero], -1), xp.stack([zero, zero, one], -1)], -2)
    rotation = rotation @ rot_z
    positions.append(position)
    rotations.append(rotation)
  positions.append(position + rotation[..., :, 2] * FLANGE_D)
  rotations.append(rotation)
  return xp.stack(positions, -2), xp.stack(rotations, -3)


def forward_kinematics(q: Any, xp: Any = np) -> tuple[Any, Any, Any, Any]:
  """Joint angles [..., 7] -> (tcp position [..., 3], tcp rotation [..., 3, 3], joint origins [..., 7, 3],
  joint axes [..., 7, 3])."""
  positions, rotations = link_frames(q, xp)
  tcp = positions[..., 7, :] + rotations[..., 7, :, 2] * TCP_OFFSET
  return tcp, rotations[..., 7, :, :], positions[..., :7, :], rotations[..., :7, :, 2]


def matrix_to_quat(rot: Any, xp: Any = np) -> Any:
  """Rotation matrices [..., 3, 3] -> unit quaternions [..., 4] (w, x, y, z), branch-free (Shepperd)."""
  m = rot
  trace = m[..., 0, 0] + m[..., 1, 1] + m[..., 2, 2]
  candidates = xp.stack([
      xp.stack([1 + trace, m[..., 2, 1] - m[..., 1, 2], m[..., 0, 2] - m[..., 2, 0], m[..., 1, 0] - m[..., 0, 1]], -1),
      xp.stack([m[..., 2, 1] - m[..., 1, 2], 1 + m[..., 0, 0] - m[..., 1, 1] - m[..., 2, 2],
                m[..., 0, 1] + m[..., 1, 0], m[..., 0, 2] + m[..., 2, 0]], -1),
      xp.stack([m[..., 0, 2] - m[..., 2, 0], m[..., 0, 1] + m[..., 1, 0],
                1 - m[..., 0, 0] + m[..., 1, 1] - m[..., 2, 2], m[..., 1, 2] + m[..., 2, 1]], -1),
      xp.stack([m[..., 1, 0] - m[..., 0, 1], m[..., 0, 2] + m[..., 2, 0], m[..., 1, 2] + m[..., 2, 1],
                1 - m[..., 0, 0] - m[..., 1, 1] + m[..., 2, 2]], -1),
  ], -2)  # [..., 4, 4]: row k is 4 * q_k * q, best conditioned where q_k is largest
  diagonal = xp.stack([trace, m[..., 0, 0], m[..., 1, 1], m[..., 2, 2]], -1)
  best = xp.argmax(diagonal, -1)
  quat = xp.take_along_axis(candidates, best[..., None, None], -2)[..., 0, :]
  quat = quat / xp.linalg.norm(quat, axis=-1, keepdims=True)
  return quat * xp.where(quat[..., :1] < 0, -1.0, 1.0)


def geometric_jacobian(q: Any, xp: Any = np) -> tuple[Any, Any, Any]:
  """-> (tcp position [3], tcp rotation [3, 3], jacobian [6, 7]: rows = linear velocity, angular velocity)."""
  tcp, rotation, origins, axes = forward_kinematics(q, xp)
  linear = xp.cross(axes, tcp[None, :] - origins)  # [7, 3] (q is one configuration [7] here)
  jacobian = xp.concatenate([linear.T, axes.T], axis=0)
  return tcp, rotation, jacobian


def orientation_error(rotation: Any, target: Any, xp: Any = np) -> Any:
  """Small-angle rotation vector taking `rotation` to `target` (both [3, 3]), in the world frame."""
  return 0.5 * xp.sum(xp.cross(rotation.T, target.T), axis=0)


def ik_step(q: Any, target_position: Any, target_rotation: Any, *, damping: float = 0.02,
            nullspace_gain: float = 0.1, xp: Any = np) -> Any:
  """One damped-least-squares IK update of joint angles q [7] towards a tcp pose; stays within limits.

  The null-space term pulls the redundant DoF towards HOME_QPOS so the elbow does not drift.
  """
  tcp, rotation, jacobian = geometric_jacobian(q, xp)
  error = xp.concatenate([target_position - tcp, orientation_error(rotation, target_rotation, xp)])
  jjt = jacobian @ jacobian.T + (damping ** 2) * xp.eye(6, dtype=xp.float32)
  pinv = jacobian.T @ xp.linalg.inv(jjt)  # [7, 6]
  nullspace = xp.eye(NUM_JOINTS, dtype=xp.float32) - pinv @ jacobian
  dq = pinv @ error + nullspace @ (nullspace_gain * (xp.asarray(HOME_QPOS) - q))
  limits = xp.asarray(JOINT_LIMITS)
  return xp.clip(q + dq, limits[:, 0], limits[:, 1])


def home_tcp_rotation() -> np.ndarray:
  """The fixed hand orientation the controller holds (pointing down), taken from the home posture."""
  _, rotation, _, _ = forward_kinematics(HOME_QPOS, np)
  return np.asarray(rotation, np.float32)
