"""Batched camera in JAX by ray casting: RGB with simple shading and depth, for any backend's state.

Why our own caster rather than calling `mjx.ray` per pixel: mjx.ray (mujoco-mjx 3.x) has no cylinder
intersection and returns no surface normal; the scene has cylinders (bowl, plate, cylinder object,
gripper) and shading needs normals. The maths is the same ray-primitive intersection, vectorised over
pixels x geoms: find the nearest hit per pixel, then recompute that one geom's normal analytically.

Inputs are plain arrays (geom poses, sizes, colours, camera pose), so MJX states and native MjData
render through the same jitted function; vmap it over environments to render a whole batch at once.
`render_from_hits` finishes an image whose non-plane hits were cast elsewhere (the native backend casts
them in C, raycast_native.py): planes and shading are this module's, so both paths shade alike.
Conventions follow MuJoCo: a camera looks along its -z axis with +y up; `fovy` is vertical, degrees.
Depth is distance along the camera axis in metres, 0 where a ray hits nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import mujoco
import numpy as np

_PLANE, _SPHERE, _CAPSULE, _CYLINDER, _BOX = (int(mujoco.mjtGeom.mjGEOM_PLANE), int(mujoco.mjtGeom.mjGEOM_SPHERE),
                                              int(mujoco.mjtGeom.mjGEOM_CAPSULE), int(mujoco.mjtGeom.mjGEOM_CYLINDER),
                                              int(mujoco.mjtGeom.mjGEOM_BOX))
SUPPORTED_TYPES = (_PLANE, _SPHERE, _CAPSULE, _CYLINDER, _BOX)
BACKGROUND_RGB = np.array([0.62, 0.7, 0.82], np.float32)
LIGHT_DIRECTION = np.array([0.3, 0.2, 1.0], np.float32) / np.linalg.norm([0.3, 0.2, 1.0])
_EPS = 1e-6


def pixel_directions(height: int, width: int, fovy_degrees: float) -> np.ndarray:
  """Unit ray directions in the camera frame, [height * width, 3], row-major from the top-left pixel."""
  tan_half = np.tan(np.deg2rad(fovy_degrees) / 2)
  rows, cols = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
  x = (2 * (cols + 0.5) / width - 1) * tan_half * width / height
  y = (1 - 2 * (rows + 0.5) / height) * tan_half
  directions = np.stack([x, y, -np.ones_like(x)], -1).reshape(-1, 3)
  return (directions / np.linalg.norm(directions, axis=-1, keepdims=True)).astype(np.float32)


def project(points: np.ndarray, cam_pos: np.ndarray, cam_mat: np.ndarray, height: int, width: int,
            fovy_degrees: float) -> np.ndarray:
  """World points [..., 3] -> (row, col) pixel coordinates [..., 2] (float; the inverse of the rays)."""
  local = (np.asarray(points) - cam_pos) @ np.asarray(cam_mat)  # camera frame: x right, y up, -z forward
  tan_half = np.tan(np.deg2rad(fovy_degrees) / 2)
  x_ndc = local[..., 0] / (-local[..., 2]) / (tan_half * width / height)
  y_ndc = local[..., 1] / (-local[..., 2]) / tan_half
  return np.stack([(1 - y_ndc) * height / 2 - 0.5, (x_ndc + 1) * width / 2 - 0.5], -1)


# image_points' value for a point behind the camera (outside [-1, 1] like any point out of view)
BEHIND_CAMERA = 10.0


def image_points(points, cam_pos, cam_mat, height: int, width: int, fovy: float, xp=jnp):
  """World points [P, 3] -> where they appear in the image [P, 2]: (x, y) in [-1, 1] from the left /
  top edge to the right / bottom one (ejax.models.connector.pixel_grid's convention); outside [-1, 1]
  when out of view, BEHIND_CAMERA for both when behind the camera."""
  local = (points - cam_pos) @ cam_mat  # camera frame: x right, y up, -z forward
  tan_half = np.tan(np.deg2rad(fovy) / 2)
  depth = -local[..., 2]
  ahead = depth > 1e-4
  safe = xp.where(ahead, depth, 1.0)
  x = local[..., 0] / safe / (tan_half * width / height)
  y = -local[..., 1] / safe / tan_half
  return xp.where(ahead[..., None], xp.stack([x, y], -1), BEHIND_CAMERA).astype(xp.float32)


def _safe_div(a, b):
  return a / jnp.where(jnp.abs(b) < _EPS, jnp.where(b < 0, -_EPS, _EPS), b)


def _positive(t):
  return jnp.where(t > 1e-4, t, jnp.inf)


def _hit_sphere(p, v, radius, centre_z=0.0):
  p = p - jnp.stack([jnp.zeros_like(centre_z), jnp.zeros_like(centre_z), centre_z], -1)
  b = jnp.sum(p * v, -1)
  c = jnp.sum(p * p, -1) - radius ** 2
  disc = b * b - c
  root = jnp.sqrt(jnp.maximum(disc, 0.0))
  near, far = _positive(-b - root), _positive(-b + root)
  return jnp.where(disc >= 0, jnp.minimum(near, far), jnp.inf)


def _hit_cylinder_side(p, v, radius, half_length):
  a = v[..., 0] ** 2 + v[..., 1] ** 2
  b = p[..., 0] * v[..., 0] + p[..., 1] * v[..., 1]
  c = p[..., 0] ** 2 + p[..., 1] ** 2 - radius ** 2
  disc = b * b - a * c
  root = jnp.sqrt(jnp.maximum(disc, 0.0))
  best = jnp.inf
  for t in (_positive(_safe_div(-b - root, a)), _positive(_safe_div(-b + root, a))):
    inside = jnp.abs(p[..., 2] + t * v[..., 2]) <= half_length
    best = jnp.minimum(best, jnp.where((disc >= 0) & (a > _EPS) & inside, t, jnp.inf))
  return best


def _intersect(geom_type: int, p, v, size):
  """Distance along unit ray v from local point p to the geom (inf on a miss); p, v [..., 3]."""
  sx, sy = size[..., 0], size[..., 1]  # boxes read all three half-sizes from `size` below
  if geom_type == _PLANE:
    t = _positive(_safe_div(-p[..., 2], v[..., 2]))
    hit = p + t[..., None] * v
    inside = ((sx <= 0) | (jnp.abs(hit[..., 0]) <= sx)) & ((sy <= 0) | (jnp.abs(hit[..., 1]) <= sy))
    return jnp.where((p[..., 2] > 0) & inside, t, jnp.inf)
  if geom_type == _SPHERE:
    return _hit_sphere(p, v, sx)
  if geom_type == _CAPSULE:
    caps = jnp.minimum(_hit_sphere(p, v, sx, sy), _hit_sphere(p, v, sx, -sy))
    return jnp.minimum(_hit_cylinder_side(p, v, sx, sy), caps)
  if geom_type == _CYLINDER:
    best = _hit_cylinder_side(p, v, sx, sy)
    for cap_z in (sy, -sy):
      t = _positive(_safe_div(cap_z - p[..., 2], v[..., 2]))
      hit = p + t[..., None] * v
      best = jnp.minimum(best, jnp.where(hit[..., 0] ** 2 + hit[..., 1] ** 2 <= sx ** 2, t, jnp.inf))
    return best
  if geom_type == _BOX:
    t1, t2 = _safe_div(-size - p, v), _safe_div(size - p, v)
    t_near = jnp.max(jnp.minimum(t1, t2), -1)
    t_far = jnp.min(jnp.maximum(t1, t2), -1)
    return jnp.where((t_far >= t_near) & (t_near > 1e-4), t_near, jnp.inf)
  raise ValueError(f"geom type {geom_type} cannot be ray cast: use one of {SUPPORTED_TYPES}")


def _normal(geom_type, q, size):
  """Outward local normal at local surface point q [P, 3] for per-pixel geom types [P]."""
  sx, sy = size[:, 0], size[:, 1]
  zero, one = jnp.zeros_like(sx), jnp.ones_like(sx)
  plane = jnp.stack([zero, zero, one], -1)
  capsule = q - jnp.stack([zero, zero, jnp.clip(q[:, 2], -sy, sy)], -1)
  radial = jnp.sqrt(q[:, 0] ** 2 + q[:, 1] ** 2)
  on_cap = (sy - jnp.abs(q[:, 2])) < (sx - radial)
  cylinder = jnp.where(on_cap[:, None], jnp.stack([zero, zero, jnp.sign(q[:, 2])], -1),
                       jnp.stack([q[:, 0], q[:, 1], zero], -1))
  axis = jnp.argmax(jnp.abs(q) / jnp.maximum(size, _EPS), -1)
  box = jax.nn.one_hot(axis, 3) * jnp.sign(q)
  conditions = [(geom_type == kind)[:, None] for kind in (_PLANE, _SPHERE, _CAPSULE, _CYLINDER)]
  normal = jnp.select(conditions, [plane, q, capsule, cylinder], box)
  return normal / jnp.maximum(jnp.linalg.norm(normal, axis=-1, keepdims=True), _EPS)


@functools.partial(jax.jit, static_argnames=("geom_types", "height", "width", "fovy"))
def render(geom_types: tuple[int, ...], geom_size: jax.Array, geom_xpos: jax.Array, geom_xmat: jax.Array,
           geom_rgba: jax.Array, cam_pos: jax.Array, cam_mat: jax.Array, *, height: int, width: int,
           fovy: float) -> tuple[jax.Array, jax.Array]:
  """One camera image: (rgb uint8 [height, width, 3], depth float32 [height, width]).

  geom_types: static MuJoCo geom type per geom [G]; geom_size [G, 3], geom_xpos [G, 3],
  geom_xmat [G, 3, 3], geom_rgba [G, 4]; cam_pos [3], cam_mat [3, 3] (columns = camera axes).
  Geoms with alpha 0 are invisible. vmap over leading env axes to render a batch.
  """
  types = np.asarray(geom_types)
  directions_cam = jnp.asarray(pixel_directions(height, width, fovy))  # [P, 3]
  directions = directions_cam @ cam_mat.T                                 # world [P, 3]
  distances, ids = [], []
  for geom_type in SUPPORTED_TYPES:
    (geom_ids,) = np.nonzero(types == geom_type)
    if geom_ids.size == 0:
      continue
    rot = geom_xmat[geom_ids]                                              # [Gt, 3, 3]
    p = jnp.einsum("gji,gj->gi", rot, cam_pos[None] - geom_xpos[geom_ids])  # [Gt, 3]
    v = jnp.einsum("gji,pj->pgi", rot, directions)                         # [P, Gt, 3]
    t = _intersect(geom_type, jnp.broadcast_to(p[None], v.shape), v, geom_size[geom_ids][None])
    distances.append(jnp.where(geom_rgba[geom_ids, 3][None] > 0, t, jnp.inf))
    ids.append(geom_ids)
  distances = jnp.concatenate(distances, -1)                               # [P, G]
  ids = jnp.asarray(np.concatenate(ids))
  nearest = jnp.argmin(distances, -1)
  t = jnp.take_along_axis(distances, nearest[:, None], -1)[:, 0]
  hit = jnp.isfinite(t)
  geom = ids[nearest]
  t = jnp.where(hit, t, 0.0)
  point = cam_pos[None] + t[:, None] * directions
  local = jnp.einsum("pji,pj->pi", geom_xmat[geom], point - geom_xpos[geom])
  normal = jnp.einsum("pij,pj->pi", geom_xmat[geom], _normal(jnp.asarray(types)[geom], local, geom_size[geom]))
  return _shade(hit, geom, t, normal, directions, directions_cam, geom_rgba, height, width)


@functools.partial(jax.jit, static_argnames=("geom_types", "height", "width", "fovy"))
def render_from_hits(geom_types: tuple[int, ...], geom_size: jax.Array, geom_xpos: jax.Array, geom_xmat: jax.Array,
                     geom_rgba: jax.Array, cam_pos: jax.Array, cam_mat: jax.Array, hit_geom: jax.Array,
                     hit_distance: jax.Array, hit_normal: jax.Array, *, height: int, width: int,
                     fovy: float) -> tuple[jax.Array, jax.Array]:
  """`render`'s image from the nearest non-plane geom on every pixel's ray, found by another caster.

  hit_geom [P] int32, hit_distance [P] (metres along the unit ray; negative: no non-plane geom on the
  ray, as mj_multiRay reports it) and hit_normal [P, 3] (the surface's outward unit normal in camera
  axes: x right, y up, z backwards); P = height * width, rays as `pixel_directions`. Planes (the table)
  are intersected here for every pixel and the nearer surface kept; shading is `render`'s.
  """
  types = np.asarray(geom_types)
  directions_cam = jnp.asarray(pixel_directions(height, width, fovy))
  directions = _rotate(directions_cam, cam_mat)
  cast = hit_distance >= 0
  geom = jnp.where(cast, hit_geom, 0)
  t = jnp.where(cast, hit_distance, jnp.inf)
  normal = _rotate(hit_normal, cam_mat)
  for plane in np.flatnonzero(types == _PLANE):
    rot = geom_xmat[plane]
    p = rot.T @ (cam_pos - geom_xpos[plane])
    v = _rotate(directions, rot.T)                                         # local ray directions [P, 3]
    t_plane = _intersect(_PLANE, jnp.broadcast_to(p, v.shape), v, geom_size[plane][None])
    nearer = jnp.where(geom_rgba[plane, 3] > 0, t_plane, jnp.inf) < t
    geom = jnp.where(nearer, plane, geom)
    t = jnp.where(nearer, t_plane, t)
    normal = jnp.where(nearer[:, None], rot[:, 2][None], normal)
  hit = jnp.isfinite(t)
  return _shade(hit, geom, jnp.where(hit, t, 0.0), normal, directions, directions_cam, geom_rgba, height, width)


def _rotate(vectors, rotation):
  """vectors [P, 3] @ rotation.T, spelled out: a [P, 3] x [3, 3] dot is ~25 % slower on XLA's CPU backend."""
  return vectors[:, 0:1] * rotation[:, 0] + vectors[:, 1:2] * rotation[:, 1] + vectors[:, 2:3] * rotation[:, 2]


def _shade(hit, geom, t, normal, directions, directions_cam, geom_rgba, height: int, width: int):
  """Per-pixel hit flags, geoms, distances (0 on misses) and world normals -> (rgb uint8 [H, W, 3],
  depth float32 [H, W])."""
  diffuse = jnp.maximum(normal @ jnp.asarray(LIGHT_DIRECTION), 0.0)
  facing = jnp.maximum(-jnp.sum(normal * directions, -1), 0.0)
  shade = 0.3 + 0.5 * diffuse + 0.2 * facing
  colour = jnp.where(hit[:, None], geom_rgba[geom, :3] * shade[:, None], jnp.asarray(BACKGROUND_RGB))
  rgb = jnp.clip(jnp.round(colour * 255.0), 0, 255).astype(jnp.uint8).reshape(height, width, 3)
  depth = (t * -directions_cam[:, 2]).reshape(height, width).astype(jnp.float32)
  return rgb, depth


def camera_pose(cam_body: int, cam_pos_local: np.ndarray, cam_quat_local: np.ndarray, body_xpos, body_xmat,
                xp=jnp):
  """World pose of a camera fixed to a body: (position [3], rotation [3, 3]) from the body's pose."""
  local_mat = np.zeros(9)
  mujoco.mju_quat2Mat(local_mat, np.asarray(cam_quat_local, np.float64))
  position = body_xpos[cam_body] + body_xmat[cam_body] @ xp.asarray(cam_pos_local, dtype=xp.float32)
  return position, body_xmat[cam_body] @ xp.asarray(local_mat.reshape(3, 3), dtype=xp.float32)
