"""Language-conditioned tasks as data: specs, the task table, and the goal / success / reward maths.

A task never changes the scene or the step function. It fixes, per episode:
  - which graspable to manipulate: an object slot, or a spatial relation among the three blocks
    ("the block on the left") resolved against the sampled layout at reset, or the drawer handle;
  - where it must end up: in the bowl, on the plate, on another object (stacking), or at a fixed point
    (lifted in the air, drawer handle at the open / closed position);
  - tolerances and whether the gripper must have let go.
Goal, success and reward are written once for numpy and jax.numpy (`xp`), like kinematics.py, so the
MJX and native backends and the scripted expert all agree.

Graspable slots: 0..3 = scene.OBJECT_NAMES (block_a, block_b, block_c, cylinder), 4 = drawer handle.
Anchors for a goal: 0..3 objects, 4 bowl, 5 plate, 6 a fixed point stored per episode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

HANDLE_SLOT = 4
ANCHOR_BOWL, ANCHOR_PLATE, ANCHOR_FIXED = 4, 5, 6
# Spatial relations among the blocks; the direction whose largest projection picks the block.
# The robot looks along +x, so its left is +y.
RELATIONS = {"left": (0.0, 1.0), "right": (0.0, -1.0), "front": (-1.0, 0.0), "back": (1.0, 0.0)}
RELATION_CODES = {name: code for code, name in enumerate(["none", *RELATIONS])}
LIFT_HEIGHT = 0.15        # a lifted object's goal height [m]
DRAWER_OPEN_GOAL, DRAWER_CLOSED_GOAL = 0.13, 0.0

BLOCK_COLOURS = {"red": (0.85, 0.12, 0.1), "green": (0.12, 0.65, 0.2), "blue": (0.12, 0.28, 0.85)}
CYLINDER_COLOUR = (0.92, 0.78, 0.1)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """One task. `target` / `destination` are a slot name ("red", "cylinder"), a relation ("left"),
  "handle", "bowl", "plate", "air" (lift) or "open"/"closed" (drawer)."""
  name: str
  suite: str
  instruction: str
  target: str
  destination: str
  same_colour_blocks: bool = False  # spatial suite: identical blocks, told apart only by position
  drawer_start: tuple[float, float] = (0.0, 0.03)  # initial drawer opening range [m]
  episode_length: int = 60


SLOT_OF_NAME = {"red": 0, "green": 1, "blue": 2, "cylinder": 3, "handle": HANDLE_SLOT}


def encode_task(spec: TaskSpec) -> dict[str, np.ndarray]:
  """The spec as fixed-size arrays (one row of the task table; rows stack so tasks batch together)."""
  target_relation = RELATION_CODES.get(spec.target, 0)
  target_slot = SLOT_OF_NAME.get(spec.target, -1)
  if target_relation == 0 and target_slot < 0:
    raise ValueError(f"task {spec.name}: unknown target {spec.target!r}; use one of "
                     f"{sorted(SLOT_OF_NAME) + sorted(RELATIONS)}")
  destination_relation = RELATION_CODES.get(spec.destination, 0)
  anchor = {"bowl": ANCHOR_BOWL, "plate": ANCHOR_PLATE, "air": ANCHOR_FIXED, "open": ANCHOR_FIXED,
            "closed": ANCHOR_FIXED}.get(spec.destination, SLOT_OF_NAME.get(spec.destination, -1))
  if destination_relation == 0 and anchor < 0:
    raise ValueError(f"task {spec.name}: unknown destination {spec.destination!r}")
  is_drawer = spec.destination in ("open", "closed")
  is_lift = spec.destination == "air"
  if spec.destination == "bowl":
    tol_xy, tol_z = 0.035, 0.012
  elif spec.destination == "plate":
    tol_xy, tol_z = 0.045, 0.012
  elif is_lift:
    tol_xy, tol_z = 0.2, 0.05
  elif is_drawer:
    tol_xy, tol_z = (0.025 if spec.destination == "open" else 0.015), 0.05
  else:  # stacked on another object
    tol_xy, tol_z = 0.02, 0.012
  return {
      "target_slot": np.int32(target_slot), "target_relation": np.int32(target_relation),
      "anchor": np.int32(anchor), "anchor_relation": np.int32(destination_relation),
      "is_drawer": np.bool_(is_drawer), "is_lift": np.bool_(is_lift),
      "drawer_goal": np.float32(DRAWER_OPEN_GOAL if spec.destination == "open" else DRAWER_CLOSED_GOAL),
      "drawer_start": np.asarray(spec.drawer_start, np.float32),
      "same_colour_blocks": np.bool_(spec.same_colour_blocks),
      "tol_xy": np.float32(tol_xy), "tol_z": np.float32(tol_z),
      "require_release": np.bool_(not (is_lift or is_drawer)),
  }


def resolve_relation(relation: Any, fixed_slot: Any, block_xy: Any, xp: Any = np) -> Any:
  """Slot chosen by a relation code over the blocks' xy [3, 2], or `fixed_slot` when relation is 0."""
  directions = xp.asarray(np.array([(0.0, 0.0), *RELATIONS.values()], np.float32))
  scores = block_xy @ directions[relation]
  return xp.where(relation > 0, xp.argmax(scores), fixed_slot).astype(xp.int32)


def goal_position(info: dict, graspables: Any, fixture_pos: Any, xp: Any = np) -> Any:
  """Where the target graspable must be: anchor position + per-episode offset, [3]."""
  anchors = xp.concatenate([graspables[:4], fixture_pos, info["fixed_goal"][None]], axis=0)  # [7, 3]
  return anchors[info["anchor"]] + info["goal_offset"]


def evaluate(info: dict, tcp: Any, graspables: Any, fixture_pos: Any, grasped: Any,
             xp: Any = np) -> tuple[Any, Any, dict]:
  """-> (success bool, dense reward in [0, 1], metrics) for one env.

  Reward stages: reach the target (up to 0.3), hold it (0.4) and bring it to the goal (up to 0.9),
  success 1. It is 1 - tanh(k * distance) shaped, so RL gets a gradient everywhere.
  """
  target = info["target"]
  obj = graspables[target]
  goal = goal_position(info, graspables, fixture_pos, xp)
  xy_error = xp.sqrt(xp.sum((obj[:2] - goal[:2]) ** 2))
  z_error = xp.abs(obj[2] - goal[2])
  holding = grasped == target
  success = (xy_error < info["tol_xy"]) & (z_error < info["tol_z"]) & (~holding | ~info["require_release"])
  reach_distance = xp.sqrt(xp.sum((tcp - obj) ** 2))
  place_distance = xp.sqrt(xy_error ** 2 + z_error ** 2)
  reward = xp.where(success, 1.0, xp.where(holding, 0.4 + 0.5 * (1.0 - xp.tanh(5.0 * place_distance)),
                                           0.3 * (1.0 - xp.tanh(10.0 * reach_distance))))
  metrics = {"reach_distance": reach_distance, "place_distance": place_distance,
             "holding": holding.astype(xp.float32)}
  return success, reward.astype(xp.float32), metrics
