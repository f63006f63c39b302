"""Scripted experts: waypoints in Cartesian space, tracked through the env's IK controller.

One stateless expert solves every task: the waypoint is a pure function of the privileged state
(tcp, the target's position, its goal, grasp flags; env.privileged), so it batches with vmap,
retries a failed or slipped grasp by itself, and runs unchanged on numpy for the native backend.
"Holding" is physical (control.grasped_slot: the object between closed, settled fingers), so the
expert waits with the fingers closing until they have stopped on the object before it lifts.

  not holding the target: rise, hover above it, descend onto its centre, close;
  holding it:             rise to a carrying height, move above the goal, descend until the object
                          sits just above the goal, open (lift and drawer tasks keep holding and just
                          move the target to the goal).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ejax.sim import control

HOVER = 0.07           # hover this far above a target before descending [m]
CARRY_CLEARANCE = 0.06  # carried objects travel this far above the higher of goal and 6 cm
RELEASE_GAP = 0.004    # open when the object's centre is this far above its goal
ALIGN_TOLERANCE = 0.008
GRASP_TOLERANCE = 0.012


def expert_action(p: dict, xp: Any = np) -> Any:
  """Privileged state of one env (env.privileged plus "ee_target") -> action [4]."""
  tcp, obj, goal, ee_target = p["tcp"], p["target_pos"], p["goal"], p["ee_target"]

  # Reaching for the target.
  hover_z = obj[2] + HOVER
  over_object = xp.sqrt(xp.sum((obj[:2] - tcp[:2]) ** 2)) < ALIGN_TOLERANCE
  low_and_off = (tcp[2] < hover_z - 0.03) & ~over_object & (xp.sqrt(xp.sum((obj[:2] - tcp[:2]) ** 2)) > 0.02)
  reach_waypoint = xp.where(over_object, obj, xp.stack([obj[0], obj[1], hover_z]))
  reach_waypoint = xp.where(low_and_off, xp.stack([tcp[0], tcp[1], hover_z]), reach_waypoint)
  close_on_target = xp.max(xp.abs(obj - tcp)) < GRASP_TOLERANCE

  # Carrying it: plan for the object, then shift by the grasp offset to get the tcp waypoint.
  offset = obj - tcp
  carry_z = xp.maximum(goal[2], 0.06) + CARRY_CLEARANCE
  over_goal = xp.sqrt(xp.sum((goal[:2] - obj[:2]) ** 2)) < ALIGN_TOLERANCE
  release_point = goal + xp.asarray(np.array([0.0, 0.0, RELEASE_GAP], np.float32))
  carry_waypoint = xp.where(obj[2] < carry_z - 0.02, xp.stack([obj[0], obj[1], carry_z]),
                            xp.stack([goal[0], goal[1], carry_z]))
  place_waypoint = xp.where(over_goal, release_point, carry_waypoint)
  direct = p["is_lift"] | p["is_drawer"]
  object_waypoint = xp.where(direct, goal, place_waypoint)
  at_release = over_goal & (xp.abs(obj[2] - release_point[2]) < 0.006)
  release = p["require_release"] & at_release

  holding = p["holding"]
  waypoint = xp.where(holding, object_waypoint - offset, reach_waypoint)
  waypoint = xp.where(p["holding_other"], tcp + xp.asarray(np.array([0.0, 0.0, 0.05], np.float32)), waypoint)
  close = xp.where(holding, ~release, close_on_target) & ~p["holding_other"]
  move = xp.clip((waypoint - ee_target) / control.MAX_DELTA, -1.0, 1.0)
  return xp.concatenate([move, xp.where(close, 1.0, -1.0)[None]]).astype(xp.float32)
