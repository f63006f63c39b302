"""Initial-state distribution: object layout, sizes, colours, drawer and arm start, in JAX.

Both backends reset through this one jitted function (the native backend copies its output into
MjData), so "same seed" means the same initial state everywhere.

Layout: six items (three blocks, the cylinder, the bowl, the plate) take distinct cells of a 3 x 4
grid on the table, jittered inside the cell. The three blocks always take distinct rows and columns,
so "the block on the left / closest to the robot" is never ambiguous (margin >= one cell minus jitter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ejax.sim import kinematics, scene, tasks

GRID_X = np.array([0.36, 0.50, 0.64], np.float32)          # rows: distance from the robot
GRID_Y = np.array([-0.27, -0.135, 0.0, 0.135], np.float32)  # columns: right to left
CELL_JITTER = 0.015
ARM_START_NOISE = 0.05
COLOUR_JITTER = 0.06
MAX_YAW = 0.35             # rad (20 degrees)


def _effective_rgba(model) -> np.ndarray:
  """Geom colours as MuJoCo draws them: the material's colour where the geom keeps the default rgba."""
  rgba = model.geom_rgba.copy()
  default = np.array([0.5, 0.5, 0.5, 1.0], np.float32)
  uses_material = (model.geom_matid >= 0) & np.all(np.isclose(rgba, default), axis=1)
  rgba[uses_material] = model.mat_rgba[model.geom_matid[uses_material]]
  return rgba.astype(np.float32)


def _sample_cells(rng: jax.Array) -> jax.Array:
  """Cell indices [6] (row * 4 + column) for blocks 0..2, cylinder, bowl, plate."""
  num_rows, num_cols = len(GRID_X), len(GRID_Y)
  rows = jnp.arange(num_rows * num_cols) // num_cols
  cols = jnp.arange(num_rows * num_cols) % num_cols
  free = jnp.ones(num_rows * num_cols, bool)
  block_lines_free = jnp.ones(num_rows * num_cols, bool)
  cells = []
  for item, key in enumerate(jax.random.split(rng, 6)):
    allowed = free & block_lines_free if item < 3 else free
    cell = jax.random.categorical(key, jnp.where(allowed, 0.0, -jnp.inf))
    cells.append(cell)
    free = free & (jnp.arange(free.shape[0]) != cell)
    if item < 3:
      block_lines_free = block_lines_free & (rows != rows[cell]) & (cols != cols[cell])
  return jnp.stack(cells)


def sample_episode(rng: jax.Array, task: dict[str, jax.Array]) -> dict:
  """One episode's initial state and parameters for the task row `task` (see tasks.encode_task).

  Returns {"qpos" [nq], "mocap_pos" [nmocap, 3] (arm poses are set by the env), "info": {...}} with everything `step` needs in info.
  """
  model, index = scene.mj_model(), scene.scene_index()
  keys = jax.random.split(rng, 10)
  cells = _sample_cells(keys[0])
  centres = jnp.stack([jnp.asarray(GRID_X)[cells // len(GRID_Y)], jnp.asarray(GRID_Y)[cells % len(GRID_Y)]], -1)
  xy = centres + jax.random.uniform(keys[1], centres.shape, minval=-CELL_JITTER, maxval=CELL_JITTER)

  # Sizes: three cubes, then the cylinder (radius, half height).
  block_half = jax.random.uniform(keys[2], (3,), minval=scene.BLOCK_HALF_RANGE[0], maxval=scene.BLOCK_HALF_RANGE[1])
  cylinder_radius = jax.random.uniform(keys[3], (), minval=scene.CYLINDER_RADIUS_RANGE[0],
                                       maxval=scene.CYLINDER_RADIUS_RANGE[1])
  cylinder_half_height = jax.random.uniform(keys[4], (), minval=scene.CYLINDER_HALF_HEIGHT_RANGE[0],
                                            maxval=scene.CYLINDER_HALF_HEIGHT_RANGE[1])
  geom_size = jnp.asarray(model.geom_size)
  for k in range(3):
    geom_size = geom_size.at[index.object_geom[k]].set(jnp.full(3, block_half[k]))
  geom_size = geom_size.at[index.object_geom[3]].set(jnp.stack([cylinder_radius, cylinder_half_height, 0.0]))
  half_heights = jnp.concatenate([block_half, cylinder_half_height[None], jnp.zeros(1)])  # [5] incl. handle
  half_widths = jnp.concatenate([block_half, cylinder_radius[None], jnp.full(1, scene.HANDLE_HALF_WIDTH)])  # [5]

  # Colours: named colours with a little jitter, or one shared random colour for identical blocks.
  base = jnp.asarray(np.array([*tasks.BLOCK_COLOURS.values(), tasks.CYLINDER_COLOUR], np.float32))
  jitter = jax.random.uniform(keys[5], base.shape, minval=-COLOUR_JITTER, maxval=COLOUR_JITTER)
  shared = jax.random.uniform(keys[6], (3,), minval=0.25, maxval=0.85)
  block_colours = jnp.where(task["same_colour_blocks"], jnp.broadcast_to(shared, (3, 3)), base[:3] + jitter[:3])
  object_colours = jnp.clip(jnp.concatenate([block_colours, base[3:] + jitter[3:]]), 0.0, 1.0)
  geom_rgba = jnp.asarray(_effective_rgba(model))
  geom_rgba = geom_rgba.at[index.object_geom, :3].set(object_colours)
  bowl_plate = jax.random.uniform(keys[7], (2, 3), minval=0.55, maxval=0.95)
  geom_rgba = geom_rgba.at[index.bowl_geoms, :3].set(bowl_plate[0])
  geom_rgba = geom_rgba.at[index.plate_geoms, :3].set(bowl_plate[1])

  # Objects rest on the table with a random yaw within +-MAX_YAW of the gripper's closing axis (the
  # action space has no wrist rotation, and a cube squeezed across its diagonal slips); bowl and
  # plate are static bodies.
  yaw = jax.random.uniform(keys[8], (4,), minval=-MAX_YAW, maxval=MAX_YAW)
  quats = jnp.stack([jnp.cos(yaw / 2), jnp.zeros(4), jnp.zeros(4), jnp.sin(yaw / 2)], -1)
  object_pos = jnp.concatenate([xy[:4], half_heights[:4, None]], -1)
  qpos = jnp.asarray(model.qpos0, jnp.float32)
  qpos = qpos.at[index.object_qpos].set(jnp.concatenate([object_pos, quats], -1))
  mocap_pos = jnp.asarray(model.body_pos[model.body_mocapid >= 0][np.argsort(model.body_mocapid[model.body_mocapid >= 0])])
  fixtures = jnp.concatenate([xy[4:6], jnp.zeros((2, 1))], -1)
  mocap_pos = mocap_pos.at[np.array([index.bowl_mocap, index.plate_mocap])].set(fixtures)

  arm_keys = jax.random.split(keys[9], 2)
  drawer_q = jax.random.uniform(arm_keys[0], (), minval=task["drawer_start"][0], maxval=task["drawer_start"][1])
  arm_q = jnp.asarray(kinematics.HOME_QPOS) + jax.random.uniform(
      arm_keys[1], (7,), minval=-ARM_START_NOISE, maxval=ARM_START_NOISE)
  qpos = qpos.at[index.drawer_qpos].set(drawer_q)
  tcp, _, _, _ = kinematics.forward_kinematics(arm_q, jnp)
  qpos = qpos.at[index.hand_qpos].set(tcp).at[index.finger_qpos].set(scene.FINGER_OPEN)

  # Resolve the task against this layout.
  target = tasks.resolve_relation(task["target_relation"], task["target_slot"], xy[:3], jnp)
  target = jnp.where(task["is_drawer"], tasks.HANDLE_SLOT, target)
  anchor = tasks.resolve_relation(task["anchor_relation"], task["anchor"], xy[:3], jnp)
  stacked = anchor < 4
  # The target's centre rests half its height above the anchor's top: another object's top, the
  # plate's surface, or the table inside the bowl's rim.
  anchor_top = jnp.where(stacked, half_heights[jnp.clip(anchor, 0, 3)],
                         jnp.where(anchor == tasks.ANCHOR_PLATE, scene.PLATE_HEIGHT, 0.0))
  goal_offset = jnp.stack([0.0, 0.0, jnp.where(task["is_lift"] | task["is_drawer"], 0.0,
                                               half_heights[target] + anchor_top)])
  fixed_goal = jnp.where(task["is_drawer"], scene.handle_position(task["drawer_goal"], jnp),
                         jnp.concatenate([object_pos[jnp.clip(target, 0, 3), :2], jnp.full(1, tasks.LIFT_HEIGHT)]))
  info = {
      "target": target, "anchor": anchor, "goal_offset": goal_offset.astype(jnp.float32),
      "fixed_goal": fixed_goal.astype(jnp.float32), "tol_xy": task["tol_xy"], "tol_z": task["tol_z"],
      "require_release": task["require_release"], "is_drawer": task["is_drawer"], "is_lift": task["is_lift"],
      "half_heights": half_heights, "half_widths": half_widths,
      "geom_size": geom_size.astype(jnp.float32), "geom_rgba": geom_rgba.astype(jnp.float32),
      "ee_target": tcp.astype(jnp.float32), "q_target": arm_q.astype(jnp.float32),
      "arm_q": arm_q.astype(jnp.float32), "finger": jnp.asarray(scene.FINGER_OPEN, jnp.float32),
      "close": jnp.zeros((), bool),
  }
  return {"qpos": qpos, "mocap_pos": mocap_pos.astype(jnp.float32), "info": info}
