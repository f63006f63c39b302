"""Rendered layouts for vision pre-training: the labels say where the images show each object."""

import mujoco
import numpy as np
import pytest

from ejax.sim import camera, scene
from ejax.sim.layouts import POINT_NAMES, render_layouts


@pytest.fixture(scope="module")
def frames():
  # A lift (distinct block colours) and a spatial task (three blocks of one colour), 6 layouts x 2 steps.
  return render_layouts(["goal_lift_green_block", "spatial_left_block_to_bowl"], 6, steps_per_layout=2,
                        image_size=(64, 64), seed=3)


@pytest.mark.timeout(600)
def test_layouts_have_every_camera_and_point(frames):
  n = 6 * 2
  assert frames["observation.images.agentview"].shape == (n, 64, 64, 3)
  assert frames["observation.images.wrist"].shape == (n, 64, 64, 3)
  assert frames["points"].shape == (n, len(POINT_NAMES), 3) and frames["tcp"].shape == (n, 3)
  assert sorted(np.bincount(frames["layout"])) == [2] * 6
  # Objects rest on the table; bowl and plate sit on it; every layout is another arrangement.
  first = frames["points"][:6]
  assert np.all(first[:, :4, 2] > 0.005) and np.all(first[:, :4, 2] < 0.08)
  assert np.allclose(first[:, 5:, 2], 0.0)
  assert len({tuple(np.round(p[:4, :2].ravel(), 3)) for p in first}) == 6
  # Blocks of one colour cannot be told apart: masked in the spatial task's layouts only.
  spatial = frames["layout"] % 2 == 1
  assert not frames["valid"][spatial][:, :3].any() and frames["valid"][spatial][:, 3:].all()
  assert frames["valid"][~spatial].all()


@pytest.mark.timeout(600)
def test_points_land_on_their_objects_in_the_agentview(frames):
  """Projected into the fixed agentview camera, the green block's label falls on green pixels."""
  model = scene.mj_model()
  data = mujoco.MjData(model)
  mujoco.mj_forward(model, data)
  cam = model.camera("agentview").id
  first = frames["layout"] % 2 == 0  # the lift's layouts: red, green, blue blocks
  images = frames["observation.images.agentview"][first]
  pixels = camera.project(frames["points"][first][:, 1], data.cam_xpos[cam], data.cam_xmat[cam].reshape(3, 3),
                          64, 64, float(model.cam_fovy[cam]))
  rows, cols = np.clip(np.round(pixels).astype(int), 0, 63).T
  colours = images[np.arange(len(images)), rows, cols].astype(int)
  green = (colours[:, 1] > colours[:, 0] + 20) & (colours[:, 1] > colours[:, 2] + 20)
  assert green.mean() >= 0.75, colours
