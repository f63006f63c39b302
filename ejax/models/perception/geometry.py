"""Keypoints through calibrated cameras: where an image point is in the world, in metres.

A learnt readout from keypoints to positions memorises the layouts it was trained on (ejax.sim's
15 tasks: ~1 cm on training frames, 2-14 cm along rollouts on unseen layouts). A camera whose pose is
known needs no learning for that: the point lies on the ray through its pixel, and a height fixes
where on the ray. The perception module's estimate uses these (ejax/models/perception/, model.perception.geometry).

Conventions (ejax.sim.camera.image_points'): (x, y) in [-1, 1] from the left / top edge, the camera
looking along its -z axis with x right and y up; `rotation` [3, 3] maps camera axes to world axes
(its columns are the camera's axes in the world).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def ray_directions(xy: jax.Array, rotation, fovy: float, aspect: float = 1.0) -> jax.Array:
  """Image points [..., 2] -> world directions [..., 3] of the rays through them (not unit length)."""
  tan_half = float(np.tan(np.deg2rad(fovy) / 2))
  local = jnp.stack([xy[..., 0] * tan_half * aspect, -xy[..., 1] * tan_half, -jnp.ones_like(xy[..., 0])], -1)
  return local @ jnp.asarray(rotation, jnp.float32).T


def on_plane(origin: jax.Array, direction: jax.Array, height: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Where rays meet the horizontal plane z = height: (points [..., 3], ahead [...] bool: the plane is in
  front of the camera)."""
  dz = direction[..., 2]
  safe = jnp.where(jnp.abs(dz) > 1e-6, dz, -1e-6)
  t = (height - origin[..., 2]) / safe
  return origin + t[..., None] * direction, t > 0


def local_soft_argmax(logits: jax.Array, grid: np.ndarray, radius: int, cell: float,
                      centre: jax.Array | None = None) -> jax.Array:
  """Expected (x, y) [n, K, 2] of heatmaps `logits` [n, cells, K] over the cells within `radius` cells
  (each `cell` wide in [-1, 1] units) of each map's argmax (or of the cells `centre` [n, K]): the peak's
  position without the pull of a second, weaker peak elsewhere (another block of the same colour) that
  the global soft-argmax averages in."""
  grid = jnp.asarray(grid, jnp.float32)
  centre = grid[jnp.argmax(logits, axis=1) if centre is None else centre]        # [n, K, 2]
  near = jnp.all(jnp.abs(grid[None, :, None, :] - centre[:, None]) <= radius * cell + 1e-4, -1)
  weights = jax.nn.softmax(jnp.where(near, logits, -jnp.inf), axis=1)
  return jnp.einsum("npk,pd->nkd", weights, grid)


def locate(points_xy: jax.Array, heights: jax.Array, tcp: jax.Array, cameras: list[dict],
           tolerance) -> jax.Array:
  """World positions [n, P, 3] of P points seen by each camera.

  points_xy [n, C, P, 2]: each camera's keypoint of each point; heights [n, P]: a prior height per
  point (the readout's); tcp [n, 3]: the tool centre point, for cameras mounted on the hand.
  cameras: C dicts, mount "world" (position: the camera's) or "tcp" (position: its offset from the
  tcp; the hand keeps its orientation), rotation 9 row-major camera -> world, fovy in degrees.

  The first world-mounted camera puts each point on its ray at the prior height. A hand camera (close,
  so finer: ~0.4 cm a pixel at 20 cm against the agentview's 1.5-2 cm) then takes over where its own
  ray, at the same height, lands within `tolerance` of that estimate; its keypoints near the image's
  edge (|x| or |y| > 0.9) are not used. `tolerance`: metres, one for all points or one per point (0: that
  point from the world camera alone)."""
  tolerance = jnp.broadcast_to(jnp.asarray(tolerance, jnp.float32), heights.shape[-1:])
  rays = []
  for index, cam in enumerate(cameras):
    rotation = np.asarray(cam["rotation"], np.float32).reshape(3, 3)
    position = jnp.asarray(np.asarray(cam["position"], np.float32))
    origin = position + tcp[:, None, :] if cam["mount"] == "tcp" else jnp.broadcast_to(position, tcp.shape)[:, None]
    direction = ray_directions(points_xy[:, index], rotation, float(cam["fovy"]), float(cam.get("aspect", 1.0)))
    rays.append((cam["mount"], jnp.broadcast_to(origin, direction.shape), direction, points_xy[:, index]))
  world = [r for r in rays if r[0] == "world"]
  if not world:
    raise ValueError("model.perception.geometry.cameras: no camera is mounted in the world (mount='world')")
  _, origin, direction, _ = world[0]
  estimate, _ = on_plane(origin, direction, heights)
  for mount, hand_origin, hand_direction, xy in rays:
    if mount != "tcp":
      continue
    near, ahead = on_plane(hand_origin, hand_direction, heights)
    agrees = (jnp.max(jnp.abs(xy), -1) < 0.9) & ahead & (jnp.linalg.norm(near - estimate, axis=-1) < tolerance)
    estimate = jnp.where(agrees[..., None], near, estimate)
  return estimate
