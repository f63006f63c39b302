"""Spatial-softmax keypoints and their heatmap loss (ejax/models/perception/keypoints.py), and the
instruction's detectors of the perception module learning where each instruction points."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ejax.models import groot, groot_inputs, perception
from ejax.models.perception.keypoints import KEYPOINT_HIDDEN, PixelKeypoints, heatmap_loss, pixel_grid
from ejax.models.siglip import normalize_images


def test_pixel_grid_is_row_major_centres_in_unit_square():
  grid = pixel_grid(4, 4)
  np.testing.assert_allclose(grid[:4, 0], [-0.75, -0.25, 0.25, 0.75])   # x runs along a row
  np.testing.assert_allclose(grid[::4, 1], [-0.75, -0.25, 0.25, 0.75])  # y down the rows


def test_a_keypoint_follows_a_green_object_across_the_image():
  """A detector for green pixels puts its keypoint on a green square wherever it is (the same weights at
  every pixel), not on the red distractor."""
  keypoints = PixelKeypoints(2, rngs=nnx.Rngs(0))
  conv = np.zeros((3, 3, 3, KEYPOINT_HIDDEN), np.float32)
  conv[1, 1, 1, 0], conv[1, 1, 0, 0] = 1.0, -1.0        # hidden 0: green minus red at the centre pixel
  keypoints.conv[...] = jnp.asarray(conv)
  detectors = np.zeros((KEYPOINT_HIDDEN, 2), np.float32)
  detectors[0, 0] = 30.0
  keypoints.detectors.kernel[...] = jnp.asarray(detectors)
  for top, left in ((2, 3), (20, 9), (11, 25)):
    image = np.full((1, 32, 32, 3), -1.0, np.float32)
    image[0, top:top + 3, left:left + 3] = (-1.0, 1.0, -1.0)      # green
    image[0, 28:31, 1:4] = (1.0, -1.0, -1.0)                      # red
    coords, strength = keypoints.coordinates(jnp.asarray(image))
    expected = pixel_grid(32, 32).reshape(32, 32, 2)[top + 1, left + 1]
    np.testing.assert_allclose(coords[0, 0], expected, atol=0.02)


def test_keypoints_on_pixel_patches_find_the_object_to_a_fraction_of_a_patch():
  """pixel_patch=2: one dense layer over each 2x2 patch (space to depth), the softmax over the 16 x 16
  patch grid; a green 3x3 square is still placed to within half a patch."""
  keypoints = PixelKeypoints(1, pixel_patch=2, rngs=nnx.Rngs(0))
  assert keypoints.conv.shape == (1, 1, 12, KEYPOINT_HIDDEN)
  conv = np.zeros((1, 1, 12, KEYPOINT_HIDDEN), np.float32)
  conv[0, 0, 1::3, 0], conv[0, 0, 0::3, 0] = 1.0, -1.0   # hidden 0: green minus red, summed over the patch
  keypoints.conv[...] = jnp.asarray(conv)
  detectors = np.zeros((KEYPOINT_HIDDEN, 1), np.float32)
  detectors[0, 0] = 10.0
  keypoints.detectors.kernel[...] = jnp.asarray(detectors)
  for top, left in ((2, 3), (20, 9), (11, 25)):
    image = np.full((1, 32, 32, 3), -1.0, np.float32)
    image[0, top:top + 3, left:left + 3] = (-1.0, 1.0, -1.0)
    image[0, 28:31, 1:4] = (1.0, -1.0, -1.0)
    coords, _ = keypoints.coordinates(jnp.asarray(image))
    expected = pixel_grid(32, 32).reshape(32, 32, 2)[top + 1, left + 1]
    np.testing.assert_allclose(coords[0, 0], expected, atol=1 / 16)    # half a 2-pixel patch
    summary = np.asarray(keypoints.summary(jnp.asarray(image)))
    assert summary.shape == (1, 3) and np.allclose(summary[0, :2], coords[0, 0])


def test_heatmap_loss_picks_the_labelled_cell_and_skips_points_out_of_view():
  grid = (4, 4)
  logits = np.zeros((1, 16, 3), np.float32)
  logits[0, 1 * 4 + 2, 0] = 20.0                     # point 0: all mass on row 1, column 2
  labels = np.array([[[0.25, -0.25], [0.25, -0.25], [1.5, 0.0]]], np.float32)   # (x, y); point 2 out of view
  loss, in_view = heatmap_loss(jnp.asarray(logits), jnp.asarray(labels), grid)
  assert in_view.tolist() == [[True, True, False]]
  assert float(loss[0, 0]) < 1e-6                    # the right cell
  np.testing.assert_allclose(float(loss[0, 1]), np.log(16), rtol=1e-6)   # flat: log of the cells
  assert float(loss[0, 2]) == 0.0


def test_instruction_chosen_heatmaps_learn_where_each_instruction_points():
  """model.perception.detectors: detectors chosen by the instruction, trained by the heatmap loss against
  keypoint labels, learn to put each instruction's keypoint on its own object (a green square for one
  prompt, a red one for the other) wherever the squares are, in a few hundred steps."""
  import optax
  c = groot.model_config("runlocal")
  c.update(num_cameras=1, tune_visual=True, tune_llm=True)
  c.perception = perception.default_config()
  c.perception.update(image_size=0)
  c.perception.detectors.update(free=2, points=1)
  c.perception.estimate.dim = 3
  c.vision.update(depth=1, image_size=32)
  c.llm.num_layers = 1
  c.packing.row_length = 256
  model = groot.create(c, nnx.Rngs(0))
  tokenizer = groot_inputs.load_tokenizer("", c.llm.vocab_size)
  rng = np.random.default_rng(0)

  def batch(n):
    prompts, images, labels = [], np.full((n, 32, 32, 3), 60, np.uint8), np.zeros((n, 2), np.float32)
    for i in range(n):
      corners = rng.choice(13, (2, 2), replace=False) * 2 + 2
      images[i, corners[0, 0]:corners[0, 0] + 3, corners[0, 1]:corners[0, 1] + 3] = (20, 200, 20)   # green
      images[i, corners[1, 0]:corners[1, 0] + 3, corners[1, 1]:corners[1, 1] + 3] = (200, 20, 20)   # red
      which = i % 2
      prompts.append(groot_inputs.prompt_ids(c, tokenizer, ["lift the green block", "lift the red block"][which], 1))
      row, col = corners[which] + 1.5
      labels[i] = (col / 16 - 1, row / 16 - 1)
    zeros = np.zeros((n, c.max_state_dim), np.float32)
    b = groot_inputs.assemble(c, prompts, images, zeros, np.zeros((n, c.action_horizon, c.max_action_dim), np.float32),
                              np.zeros((n, c.action_horizon, c.max_action_dim), np.float32), np.zeros(n, np.int32),
                              aux_pixels=list(labels))
    return b, labels

  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, b):
    def heatmap_loss(m):
      seen = m.perception(normalize_images(b["images"], jnp.float32), m.instruction_embedding(b), b["state"])
      return m.perception.losses(seen, dict(b, aux_mask=jnp.ones(b["state"].shape[0])), b["images"])["aux_heatmap_loss"][1]
    loss, grads = nnx.value_and_grad(heatmap_loss)(model)
    optimizer.update(model, grads)
    return loss

  for _ in range(300):
    step(model, optimizer, batch(16)[0])
  test, labels = batch(32)
  images = normalize_images(test["images"], jnp.float32)
  coords = model.perception(images, model.instruction_embedding(test), test["state"]).keypoints.reshape(-1, 1, 2)
  error = np.abs(np.asarray(coords[:, -1]) - labels).max(axis=1)
  assert np.median(error) < 1 / 16 and np.mean(error < 2 / 16) > 0.9   # within a 2-pixel patch
