"""Keypoints through calibrated cameras (ejax/models/perception/geometry.py) against ejax.sim's own projection."""

import jax.numpy as jnp
import numpy as np

from ejax.models.perception import geometry
from ejax.models.perception.keypoints import pixel_grid
from ejax.sim import camera, scene


def _project(points, cam, tcp):
  """ejax.sim's projection of world points [n, 3] in one calibrated camera -> [n, 2]."""
  rotation = np.asarray(cam["rotation"], np.float32).reshape(3, 3)
  out = []
  for p, t in zip(points, tcp):
    position = np.asarray(cam["position"], np.float32) + (t if cam["mount"] == "tcp" else 0.0)
    out.append(np.asarray(camera.image_points(p[None], position, rotation, 64, 64, cam["fovy"], xp=np))[0])
  return np.stack(out)


def _scene_points(n, seed=0):
  rng = np.random.default_rng(seed)
  points = np.stack([rng.uniform(0.35, 0.65, n), rng.uniform(-0.25, 0.25, n), rng.uniform(0.02, 0.15, n)], -1)
  tcp = points + np.stack([rng.uniform(-0.02, 0.02, n), rng.uniform(-0.02, 0.02, n), rng.uniform(0.1, 0.2, n)], -1)
  return points.astype(np.float32), tcp.astype(np.float32)


def test_the_agentview_ray_at_the_true_height_is_the_point():
  cams = scene.camera_calibration()
  points, tcp = _scene_points(64)
  xy = _project(points, cams["agentview"], tcp)
  world = geometry.locate(jnp.asarray(xy)[:, None, None], jnp.asarray(points[:, 2:]), jnp.asarray(tcp),
                          [cams["agentview"]], tolerance=0.04)
  np.testing.assert_allclose(np.asarray(world)[:, 0], points, atol=1e-4)


def test_the_hand_camera_refines_an_agreeing_estimate_and_ignores_a_disagreeing_one():
  cams = scene.camera_calibration()
  order = [cams["agentview"], cams["wrist"]]
  points, tcp = _scene_points(32, seed=1)
  agent, wrist = _project(points, cams["agentview"], tcp), _project(points, cams["wrist"], tcp)
  assert np.all(np.abs(wrist) < 0.9), "the test's points should be in the wrist camera's view"
  heights = jnp.asarray(points[:, 2:])
  # the agentview's keypoint a pixel off sideways (1.5-3 cm): the wrist camera's exact one wins
  off = np.asarray(agent) + np.array([2 / 64, 0], np.float32)
  both = jnp.asarray(np.stack([off, wrist], 1))[:, :, None]
  world = np.asarray(geometry.locate(both, heights, jnp.asarray(tcp), order, tolerance=0.04))[:, 0]
  np.testing.assert_allclose(world, points, atol=1e-4)
  # a wrist keypoint on something else (15 px away) is not trusted over the agentview's
  wrong = jnp.asarray(np.stack([agent, np.asarray(wrist) + np.float32(15 / 32)], 1))[:, :, None]
  world = np.asarray(geometry.locate(wrong, heights, jnp.asarray(tcp), order, tolerance=0.04))[:, 0]
  np.testing.assert_allclose(world, points, atol=1e-4)


def test_local_soft_argmax_keeps_to_the_strongest_peak():
  grid = pixel_grid(32, 32)
  cell = 2.0 / 32
  logits = np.full((1, 32 * 32, 1), -10.0, np.float32)
  strong, weak = 5 * 32 + 6, 20 * 32 + 25  # (row, col) (5, 6) and (20, 25)
  logits[0, strong, 0], logits[0, strong + 1, 0], logits[0, weak, 0] = 4.0, 4.0, 3.5
  local = np.asarray(geometry.local_soft_argmax(jnp.asarray(logits), grid, 2, cell))[0, 0]
  np.testing.assert_allclose(local, (grid[strong] + grid[strong + 1]) / 2, atol=1e-3)
  # the global soft-argmax is pulled a third of the way towards the weaker peak
  weights = np.exp(logits[0, :, 0] - logits.max())
  global_xy = (weights[:, None] * grid).sum(0) / weights.sum()
  assert np.linalg.norm(global_xy - local) > 0.2


def test_a_point_with_zero_tolerance_keeps_the_world_camera():
  cams = scene.camera_calibration()
  order = [cams["agentview"], cams["wrist"]]
  points, tcp = _scene_points(16, seed=2)
  agent, wrist = _project(points, cams["agentview"], tcp), _project(points, cams["wrist"], tcp)
  off = np.asarray(agent) + np.array([2 / 64, 0], np.float32)
  # two points, both with the agentview a pixel off: the first refined by the wrist, the second not
  both = jnp.asarray(np.stack([np.stack([off, off], 1), np.stack([wrist, wrist], 1)], 1))
  heights = jnp.asarray(np.concatenate([points[:, 2:]] * 2, 1))
  world = np.asarray(geometry.locate(both, heights, jnp.asarray(tcp), order, tolerance=(0.04, 0.0)))
  np.testing.assert_allclose(world[:, 0], points, atol=1e-4)
  alone = np.asarray(geometry.locate(both[:, :1], heights, jnp.asarray(tcp), order[:1], tolerance=0.04))
  np.testing.assert_allclose(world[:, 1], alone[:, 1], atol=1e-6)
  assert np.min(np.linalg.norm(world[:, 1] - points, axis=-1)) > 5e-3
