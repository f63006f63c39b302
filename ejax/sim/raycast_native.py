"""Camera rays for the native backend, cast by MuJoCo in C and only where an image can show a solid.

camera.render casts every pixel against every geom in JAX; on a CPU that costs the native backend about
20 times its physics (benchmarks/sim.py). This caster finds the same hits (tests/sim/test_camera.py
compares the images pixel by pixel) in three steps:
  1. Culling (numpy, the whole batch at once): every visible non-plane geom's bounding box is projected
     into each camera. A pixel outside all projected boxes can only see a plane (the table) or nothing.
     Geoms on the camera's own body (the hand around the wrist camera) keep their place in its image:
     their pixels are found once per episode by casting against their boxes.
  2. Casting (C, one call per env and camera, from the backend's thread pool: mj_multiRay releases the
     GIL): the candidate pixels' rays against the non-plane geoms in view -> geom id, distance, normal.
  3. Shading (JAX, camera.render_from_hits in the backend's jitted finish): planes are intersected for
     every pixel, the nearer surface kept, and shaded exactly as camera.render shades.
At 64 envs with both 64x64 cameras a native step then costs 90-110 ms of CPU time against ~760 ms with
camera.render and 26 ms without cameras (2-core CPU; BENCHMARKS.md has the env-steps/s side by side).

mj_multiRay culls geoms with each body's bounding volume, which the compiler builds from colliding geoms
only and which mj_multiRay centres without rotating it into the world; with the scene's model it misses
about 1 % of the agentview's pixels. So the rays go through a model of their own (`ray_model`): every
geom counts as colliding, each body's root volume becomes a sphere about its centre of mass that holds
all its geoms, materials are dropped (a geom's own alpha says whether it is seen, as in camera.render)
and planes are hidden (step 3 draws them).
"""

from __future__ import annotations

import dataclasses
import functools

import mujoco
import numpy as np

from ejax.sim import camera, scene
from ejax.sim.env import CAMERA_NAMES, CameraConfig

_BOX_SIGNS = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], np.float64)  # corner k: bits
_BOX_EDGES = np.array([(a, a | bit) for a in range(8) for bit in (1, 2, 4) if not a & bit])       # 12 corner pairs
_PIXEL_MARGIN = 1.0  # pixels added around every projected box, against rounding
_NEAR_DEPTH = 0.005  # metres: boxes are clipped this far in front of the camera
# mj_multiRay culls geoms by their extent in azimuth and elevation about the world z axis, which is
# loose for rays near that axis (the wrist camera looks down). Rays are cast in a frame whose x axis is
# the camera's view direction (its columns in camera axes: forward = -z, then -x, and y), so that the
# image spans a small patch around the equator and the angular bounds are tight.
_RAY_FRAME = np.array([[0.0, -1.0, 0.0], [0.0, 0.0, 1.0], [-1.0, 0.0, 0.0]])
_ORIGIN = np.zeros(3)
_GROUP_0 = np.array([1, 0, 0, 0, 0, 0], np.uint8)  # mj_multiRay's geomgroup: cast against group 0 only


@functools.lru_cache(maxsize=None)
def ray_model() -> mujoco.MjModel:
  """The scene compiled for mj_multiRay's culling (see the module docstring); copy it before editing."""
  spec = mujoco.MjSpec.from_string(scene.scene_xml())
  for geom in spec.geoms:
    if geom.contype == 0 and geom.conaffinity == 0:
      geom.contype = 1  # a bounding volume for visual-only geoms too; this model never steps
  model = spec.compile()
  physics = scene.mj_model()
  for field in ("geom_type", "geom_bodyid", "geom_size", "body_ipos"):
    if not np.array_equal(getattr(model, field), getattr(physics, field)):
      raise RuntimeError(f"the ray model's {field} differs from the scene's: the two must list the same geoms")
  unsupported = set(model.geom_type.tolist()) - set(camera.SUPPORTED_TYPES)
  if unsupported:
    raise ValueError(f"geom types {sorted(unsupported)} cannot be ray cast: use one of {camera.SUPPORTED_TYPES}")
  model.geom_matid[:] = -1
  planes = model.geom_type == mujoco.mjtGeom.mjGEOM_PLANE
  model.geom_rgba[planes, 3] = 0.0
  for body in np.flatnonzero(model.body_bvhadr >= 0):
    geoms = np.flatnonzero((model.geom_bodyid == body) & ~planes)
    radius = max((np.linalg.norm(model.geom_pos[g] - model.body_ipos[body]) + model.geom_rbound[g] for g in geoms),
                 default=0.0)
    model.bvh_aabb[model.body_bvhadr[body]] = [0.0, 0.0, 0.0, *np.full(3, radius / np.sqrt(3.0))]
  return model


def box_half_extents(geom_types: np.ndarray, geom_size: np.ndarray) -> np.ndarray:
  """Half extents [..., G, 3] of each geom's bounding box in its own frame (planes: their size)."""
  radius, half_length = geom_size[..., 0], geom_size[..., 1]
  by_type = {
      int(mujoco.mjtGeom.mjGEOM_SPHERE): np.stack([radius, radius, radius], -1),
      int(mujoco.mjtGeom.mjGEOM_CAPSULE): np.stack([radius, radius, radius + half_length], -1),
      int(mujoco.mjtGeom.mjGEOM_CYLINDER): np.stack([radius, radius, half_length], -1),
  }
  half = np.array(geom_size, np.float64)
  for geom_type, extents in by_type.items():
    half[..., geom_types == geom_type, :] = extents[..., geom_types == geom_type, :]
  return half


def box_corners(geom_xpos: np.ndarray, geom_xmat: np.ndarray, half_extents: np.ndarray) -> np.ndarray:
  """World corners [E, G, 8, 3] of the geoms' bounding boxes (corner k has sign bits k)."""
  return geom_xpos[:, :, None] + np.matmul(_BOX_SIGNS * half_extents[:, :, None], np.swapaxes(geom_xmat, -1, -2))


def candidate_pixels(corners: np.ndarray, geom_xpos: np.ndarray, geom_xmat: np.ndarray, half_extents: np.ndarray,
                     visible: np.ndarray, cam_pos: np.ndarray, cam_mat: np.ndarray, height: int, width: int,
                     fovy: float) -> tuple[np.ndarray, np.ndarray]:
  """Pixels whose ray may meet a geom, [E, height * width] bool (row-major like camera.pixel_directions),
  and the geoms that may be seen, [E, G] bool.

  corners [E, G, 8, 3] (box_corners), geom_xpos [E, G, 3], geom_xmat [E, G, 3, 3], half_extents
  [E, G, 3], visible [E, G] (the geoms to consider), cam_pos [E, 3], cam_mat [E, 3, 3]. A pixel is a
  candidate when its centre lies within _PIXEL_MARGIN of the image rectangle that bounds some visible
  geom's bounding box. The part of a box nearer than _NEAR_DEPTH is only seen inside a small ball around
  the camera: a box reaching into that ball makes every pixel a candidate; otherwise the box is clipped
  there and its far part projected.
  """
  tan_y = np.tan(np.deg2rad(fovy) / 2)
  tan_x = tan_y * width / height
  num_envs, num_geoms = visible.shape
  local = np.matmul((corners - cam_pos[:, None, None]).reshape(num_envs, -1, 3), cam_mat)
  local = local.reshape(num_envs, num_geoms, 8, 3)  # camera frame: x right, y up, z backwards
  x, y, depth = local[..., 0], local[..., 1], -local[..., 2]
  beside = ((x > depth * tan_x).all(-1) | (-x > depth * tan_x).all(-1) | (y > depth * tan_y).all(-1)
            | (-y > depth * tan_y).all(-1))  # wholly outside one side plane of the view pyramid
  camera_in_box = np.einsum("egji,egj->egi", geom_xmat, cam_pos[:, None] - geom_xpos)
  gap = np.linalg.norm(camera_in_box - np.clip(camera_in_box, -half_extents, half_extents), axis=-1)
  near_ball = gap < _NEAR_DEPTH * np.sqrt(1 + tan_x ** 2 + tan_y ** 2)
  # Vertices of the box's part at depth >= _NEAR_DEPTH: far corners and edge crossings of that plane.
  a, b = local[..., _BOX_EDGES[:, 0], :], local[..., _BOX_EDGES[:, 1], :]
  depth_a, depth_b = -a[..., 2], -b[..., 2]
  crosses = (depth_a >= _NEAR_DEPTH) != (depth_b >= _NEAR_DEPTH)
  fraction = np.where(crosses, (depth_a - _NEAR_DEPTH) / np.where(crosses, depth_a - depth_b, 1.0), 0.0)
  points = np.concatenate([local, a + fraction[..., None] * (b - a)], -2)
  valid = np.concatenate([depth >= _NEAR_DEPTH, crosses], -1)
  point_depth = np.where(valid, -points[..., 2], 1.0)
  u = np.where(valid, (points[..., 0] / (point_depth * tan_x) + 1) * width / 2, np.inf)   # columns, 0 .. width
  v = np.where(valid, (1 - points[..., 1] / (point_depth * tan_y)) * height / 2, np.inf)  # rows, 0 .. height
  u_min, v_min = u.min(-1), v.min(-1)
  u_max, v_max = np.where(valid, u, -np.inf).max(-1), np.where(valid, v, -np.inf).max(-1)
  u_min, v_min = np.where(near_ball, -np.inf, u_min), np.where(near_ball, -np.inf, v_min)
  u_max, v_max = np.where(near_ball, np.inf, u_max), np.where(near_ball, np.inf, v_max)
  # Pixel c is a candidate when its centre c + 0.5 lies in [min, max], widened by the margin.
  cols, rows = np.arange(width) + 0.5, np.arange(height) + 0.5
  use = visible & ~beside & (valid.any(-1) | near_ball)
  in_rows = use[..., None] & (rows >= v_min[..., None] - _PIXEL_MARGIN) & (rows <= v_max[..., None] + _PIXEL_MARGIN)
  in_cols = (cols >= u_min[..., None] - _PIXEL_MARGIN) & (cols <= u_max[..., None] + _PIXEL_MARGIN)
  covered = np.matmul(in_rows.astype(np.float32).transpose(0, 2, 1), in_cols.astype(np.float32))  # [E, H, W]
  return (covered > 0).reshape(num_envs, -1), in_rows.any(-1) & in_cols.any(-1)


def box_pixels(directions: np.ndarray, centre: np.ndarray, rotation: np.ndarray,
               half_extents: np.ndarray) -> np.ndarray:
  """Which rays from the origin meet a box: [P] bool for unit directions [P, 3], the box's centre [3],
  rotation [3, 3] (its axes as columns) and half extents [3], all in the rays' frame (slab test)."""
  origin = rotation.T @ -centre
  local = directions @ rotation
  safe = np.where(np.abs(local) < 1e-12, 1e-12, local)
  t1, t2 = (-half_extents - origin) / safe, (half_extents - origin) / safe
  t_near, t_far = np.minimum(t1, t2).max(-1), np.maximum(t1, t2).min(-1)
  return t_far >= np.maximum(t_near, 0.0)


def _dilate(mask: np.ndarray) -> np.ndarray:
  """A [H, W] mask grown by one pixel in all eight directions."""
  grown = mask.copy()
  grown[1:] |= mask[:-1]
  grown[:-1] |= mask[1:]
  wide = grown.copy()
  wide[:, 1:] |= grown[:, :-1]
  wide[:, :-1] |= grown[:, 1:]
  return wide


@dataclasses.dataclass
class CastPlan:
  """What `NativeRayCaster.cast` needs for one step, computed for the whole batch at once ([E, C, ...])."""
  candidates: np.ndarray   # [E, C, P] bool: pixels whose rays are cast
  geom_group: np.ndarray   # [E, C, G]: 0 for geoms in view, 1 for the rest (left out of the cast)
  body_bvhadr: np.ndarray  # [E, C, B]: bodies' culling volumes, -1 for bodies with no geom in view
  geom_xpos: np.ndarray    # [E, C, G, 3] geom poses in each camera's ray frame
  geom_xmat: np.ndarray    # [E, C, G, 9]
  xipos: np.ndarray        # [E, C, B, 3] body centres of mass in each camera's ray frame


class NativeRayCaster:
  """Per-env ray models and buffers. Per step: `plan` (whole batch), then `cast(i, plan)` for every env
  (from the backend's thread pool), then `hits()`."""

  def __init__(self, config: CameraConfig, num_envs: int):
    self.config = config
    base = ray_model()
    self._base = base
    self._models = [mujoco.MjModel.__copy__(base) for _ in range(num_envs)]
    self._datas = [mujoco.MjData(model) for model in self._models]
    # The arrays `cast` rewrites for every camera (views into each env's model and data).
    self._inputs = [(model.geom_group, model.body_bvhadr, data.geom_xpos, data.geom_xmat, data.xipos)
                    for model, data in zip(self._models, self._datas)]
    physics = scene.mj_model()
    self._cameras = [physics.camera(name) for name in CAMERA_NAMES]
    self._fovy = [float(cam.fovy[0]) for cam in self._cameras]
    self._cam_body = np.array([int(cam.bodyid[0]) for cam in self._cameras])
    self._cam_pos_local = np.stack([cam.pos for cam in self._cameras]).astype(np.float64)
    self._cam_mat_local = np.stack([_quat_to_mat(cam.quat) for cam in self._cameras])
    self._directions = [camera.pixel_directions(config.height, config.width, fovy).astype(np.float64)
                        for fovy in self._fovy]
    self._ray_directions = np.stack([directions @ _RAY_FRAME for directions in self._directions])  # [C, P, 3]
    self._non_plane = base.geom_type != mujoco.mjtGeom.mjGEOM_PLANE
    self._body_geoms = np.eye(base.nbody, dtype=np.float32)[base.geom_bodyid]  # [G, B] incidence
    self._half_extents = np.tile(box_half_extents(base.geom_type, base.geom_size), (num_envs, 1, 1))
    self._visible = np.tile(self._non_plane, (num_envs, 1))
    self._body_bvhadr = np.tile(base.body_bvhadr, (num_envs, 1))
    # Geoms fixed to each camera's body, and their poses in that camera's frame (the same in every state).
    self._fixed = [np.flatnonzero(self._non_plane & (base.geom_bodyid == body)) for body in self._cam_body]
    rest = mujoco.MjData(physics)
    mujoco.mj_kinematics(physics, rest)
    cam_pos, cam_mat = self.camera_poses(rest.xpos[None], rest.xmat.reshape(1, -1, 3, 3))
    self._fixed_poses = [[(cam_mat[0, c].T @ (rest.geom_xpos[g] - cam_pos[0, c]),
                           cam_mat[0, c].T @ rest.geom_xmat[g].reshape(3, 3)) for g in fixed]
                         for c, fixed in enumerate(self._fixed)]
    num_cameras, pixels = len(CAMERA_NAMES), config.height * config.width
    self._fixed_pixels = np.zeros((num_envs, num_cameras, pixels), bool)
    self._fixed_in_view = [np.zeros((num_envs, len(fixed)), bool) for fixed in self._fixed]
    # Outputs, written in place by `cast` (mj_multiRay leaves the geom id and normal of a skipped ray
    # unset: its negative distance is what marks it), and per-env scratch.
    self._hit_geom = np.full((num_envs, num_cameras, pixels), -1, np.int32)
    self._hit_distance = np.full((num_envs, num_cameras, pixels), -1.0)
    self._hit_normal = np.zeros((num_envs, num_cameras, pixels, 3), np.float32)
    self._rays = np.zeros((num_envs, pixels, 3))
    self._normals = np.zeros((num_envs, pixels, 3))

  def load_episode(self, i: int, geom_size: np.ndarray, geom_rgba: np.ndarray) -> None:
    """Env i's per-episode geom sizes and visibility (alpha); planes stay hidden (drawn in JAX)."""
    model = self._models[i]
    model.geom_size[:] = geom_size
    model.geom_rgba[:, 3] = np.where(self._non_plane, geom_rgba[:, 3], 0.0)
    # The culling volumes were computed for the scene's sizes, the largest the episodes draw; a body
    # with a larger geom is not culled at all rather than culled wrongly.
    grown = np.any(geom_size > self._base.geom_size + 1e-9, axis=1)
    self._body_bvhadr[i] = self._base.body_bvhadr
    self._body_bvhadr[i, np.unique(model.geom_bodyid[grown])] = -1
    self._half_extents[i] = box_half_extents(model.geom_type, np.asarray(geom_size, np.float64))
    self._visible[i] = self._non_plane & (geom_rgba[:, 3] > 0)
    for c, (fixed, poses) in enumerate(zip(self._fixed, self._fixed_poses)):
      pixels = np.zeros(self.config.height * self.config.width, bool)
      for k, (g, (centre, rotation)) in enumerate(zip(fixed, poses)):
        seen = self._visible[i, g] & box_pixels(self._directions[c], centre, rotation, self._half_extents[i, g])
        self._fixed_in_view[c][i, k] = seen.any()
        pixels |= seen
      self._fixed_pixels[i, c] = _dilate(pixels.reshape(self.config.height, self.config.width)).reshape(-1)

  def camera_poses(self, body_xpos: np.ndarray, body_xmat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """World camera poses [E, C, 3], [E, C, 3, 3] from body poses [E, B, 3], [E, B, 3, 3]."""
    xpos, xmat = body_xpos[:, self._cam_body], body_xmat[:, self._cam_body]
    return xpos + np.einsum("ecij,cj->eci", xmat, self._cam_pos_local), xmat @ self._cam_mat_local

  def candidates(self, geom_xpos, geom_xmat, cam_pos, cam_mat) -> tuple[np.ndarray, np.ndarray]:
    """Candidate pixels [E, C, P] and geoms in view [E, C, G] of every env and camera (candidate_pixels)."""
    corners = box_corners(geom_xpos, geom_xmat, self._half_extents)
    pixels, in_view = [], []
    for c, fovy in enumerate(self._fovy):
      moving = self._visible.copy()
      moving[:, self._fixed[c]] = False
      camera_pixels, camera_geoms = candidate_pixels(corners, geom_xpos, geom_xmat, self._half_extents, moving,
                                                     cam_pos[:, c], cam_mat[:, c], self.config.height,
                                                     self.config.width, fovy)
      camera_geoms[:, self._fixed[c]] = self._fixed_in_view[c]
      pixels.append(camera_pixels | self._fixed_pixels[:, c])
      in_view.append(camera_geoms)
    return np.stack(pixels, 1), np.stack(in_view, 1)

  def plan(self, geom_xpos: np.ndarray, geom_xmat: np.ndarray, body_xpos: np.ndarray, body_xmat: np.ndarray,
           body_xipos: np.ndarray) -> CastPlan:
    """The step's cast for the batch's kinematics: geom_xpos [E, G, 3], geom_xmat [E, G, 3, 3], body_xpos
    [E, B, 3], body_xmat [E, B, 3, 3], body_xipos [E, B, 3] (float64, as MjData holds them)."""
    cam_pos, cam_mat = self.camera_poses(body_xpos, body_xmat)
    candidates, in_view = self.candidates(geom_xpos, geom_xmat, cam_pos, cam_mat)
    bodies_in_view = np.matmul(in_view.astype(np.float32), self._body_geoms) > 0
    # Each camera casts in its ray frame (see _RAY_FRAME): the camera at the origin, looking along +x.
    frames = cam_mat @ _RAY_FRAME                                                     # [E, C, 3, 3]
    geom_xmat_ray = np.matmul(np.swapaxes(frames, -1, -2)[:, :, None], geom_xmat[:, None])
    return CastPlan(
        candidates=candidates, geom_group=(~in_view).astype(np.int32),
        body_bvhadr=np.where(bodies_in_view, self._body_bvhadr[:, None], -1).astype(np.int32),
        geom_xpos=np.matmul(geom_xpos[:, None] - cam_pos[:, :, None], frames),
        geom_xmat=geom_xmat_ray.reshape(*geom_xmat_ray.shape[:3], 9),
        xipos=np.matmul(body_xipos[:, None] - cam_pos[:, :, None], frames))

  def cast(self, i: int, plan: CastPlan) -> None:
    """Casts env i's candidate rays in C against its geoms in view (the other rays are zero: skipped)."""
    model, ray_data = self._models[i], self._datas[i]
    geom_group, body_bvhadr, geom_xpos, geom_xmat, xipos = self._inputs[i]
    rays, normals = self._rays[i], self._normals[i]
    for c in range(len(CAMERA_NAMES)):
      geom_group[:] = plan.geom_group[i, c]
      body_bvhadr[:] = plan.body_bvhadr[i, c]
      geom_xpos[:] = plan.geom_xpos[i, c]
      geom_xmat[:] = plan.geom_xmat[i, c]
      xipos[:] = plan.xipos[i, c]  # the bodies' culling spheres are centred here
      np.multiply(self._ray_directions[c], plan.candidates[i, c, :, None], out=rays)
      mujoco.mj_multiRay(model, ray_data, _ORIGIN, rays.reshape(-1), _GROUP_0, 1, -1, self._hit_geom[i, c],
                         self._hit_distance[i, c], normals.reshape(-1), len(rays), mujoco.mjMAXVAL)
      np.matmul(normals, _RAY_FRAME.T, out=self._hit_normal[i, c], casting="same_kind")  # -> camera axes

  def hits(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per camera name, (geom ids [E, P] int32, distances [E, P] float32 (negative: no hit or not cast),
    outward normals [E, P, 3] float32 in camera axes), as camera.render_from_hits takes them."""
    return {name: (self._hit_geom[:, c].copy(), self._hit_distance[:, c].astype(np.float32),
                   self._hit_normal[:, c].copy()) for c, name in enumerate(CAMERA_NAMES)}


def _quat_to_mat(quat: np.ndarray) -> np.ndarray:
  mat = np.zeros(9)
  mujoco.mju_quat2Mat(mat, np.asarray(quat, np.float64))
  return mat.reshape(3, 3)
