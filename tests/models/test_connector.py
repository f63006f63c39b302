"""Pixel keypoints (model.connector.keypoints): spatial-softmax tokens after the connector's."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ejax.models import groot, groot_inputs
from ejax.models.connector import KEYPOINT_HIDDEN, PixelKeypoints, pixel_grid


def test_pixel_grid_is_row_major_centres_in_unit_square():
  grid = pixel_grid(4, 4)
  np.testing.assert_allclose(grid[:4, 0], [-0.75, -0.25, 0.25, 0.75])   # x runs along a row
  np.testing.assert_allclose(grid[::4, 1], [-0.75, -0.25, 0.25, 0.75])  # y down the rows


def test_a_keypoint_follows_a_green_object_across_the_image():
  """A detector for green pixels puts its keypoint on a green square wherever it is (the same weights at
  every pixel), not on the red distractor, and its token changes with the position."""
  keypoints = PixelKeypoints(2, 16, rngs=nnx.Rngs(0))
  conv = np.zeros((3, 3, 3, KEYPOINT_HIDDEN), np.float32)
  conv[1, 1, 1, 0], conv[1, 1, 0, 0] = 1.0, -1.0        # hidden 0: green minus red at the centre pixel
  keypoints.conv[...] = jnp.asarray(conv)
  detectors = np.zeros((KEYPOINT_HIDDEN, 2), np.float32)
  detectors[0, 0] = 30.0
  keypoints.detectors.kernel[...] = jnp.asarray(detectors)
  tokens = []
  for top, left in ((2, 3), (20, 9), (11, 25)):
    image = np.full((1, 32, 32, 3), -1.0, np.float32)
    image[0, top:top + 3, left:left + 3] = (-1.0, 1.0, -1.0)      # green
    image[0, 28:31, 1:4] = (1.0, -1.0, -1.0)                      # red
    coords, strength = keypoints.coordinates(jnp.asarray(image))
    expected = pixel_grid(32, 32).reshape(32, 32, 2)[top + 1, left + 1]
    np.testing.assert_allclose(coords[0, 0], expected, atol=0.02)
    tokens.append(np.asarray(keypoints(jnp.asarray(image))[0, 0]))
  assert min(np.abs(a - b).max() for i, a in enumerate(tokens) for b in tokens[i + 1:]) > 1e-3


def test_keypoints_add_image_tokens_and_freeze_with_the_vision_tower():
  c = groot.model_config("runlocal")
  c.update(num_cameras=1)
  c.packing.row_length = 256
  base = groot_inputs.tokens_per_image(c)
  c.connector.keypoints = 8
  assert groot_inputs.tokens_per_image(c) == base + 8
  model = groot.create(c, nnx.Rngs(0))
  batch = groot.example_batch(c, 2, seed=0)
  assert model.backbone.encode_images(batch).shape[1] == base + 8
  trainable = nnx.state(model, groot.trainable_filter(c))
  assert not [p for p, _ in nnx.to_flat_state(trainable) if "keypoints" in p]   # tune_visual=False
