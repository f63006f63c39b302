"""Pixel keypoints (model.connector.keypoints): spatial-softmax tokens after the connector's."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ejax.models import groot, groot_inputs, layers
from ejax.models.connector import KEYPOINT_HIDDEN, PixelKeypoints, heatmap_loss, pixel_grid
from ejax.models.siglip import normalize_images


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
  model = nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0)))  # shapes only: no weights to make
  batch = groot.example_batch(c, 2, seed=0)
  graphdef, state = nnx.split(model)
  encoded = jax.eval_shape(lambda s, b: nnx.merge(graphdef, s).backbone.encode_images(b), state, batch)
  assert encoded.shape[1] == base + 8
  trainable = nnx.state(model, groot.trainable_filter(c))
  assert not [p for p, _ in nnx.to_flat_state(trainable) if "keypoints" in p]   # tune_visual=False


def test_keypoints_on_pixel_patches_find_the_object_to_a_fraction_of_a_patch():
  """pixel_patch=2: one dense layer over each 2x2 patch (space to depth), the softmax over the 16 x 16
  patch grid; a green 3x3 square is still placed to within half a patch, coordinates only (no tokens)."""
  keypoints = PixelKeypoints(1, 0, pixel_patch=2, rngs=nnx.Rngs(0))
  assert keypoints.fc1 is None and keypoints.conv.shape == (1, 1, 12, KEYPOINT_HIDDEN)
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


def test_auxiliary_keypoints_read_the_pixels_and_train_from_the_target():
  """model.aux_keypoints: the auxiliary estimate reads a keypoint detector over each sample's images
  directly, so its target's gradient reaches the detector (not only the VL path), and moving an image's
  pixels moves that sample's estimate only."""
  c = groot.model_config("runlocal")
  c.update(num_cameras=2, aux_state_dim=3, aux_keypoints=4, tune_visual=True, tune_llm=True)
  c.vision.update(depth=1, image_size=32)
  c.llm.num_layers = 1
  c.packing.row_length = 256
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  assert model.action_head.aux_keypoints.conv.shape == (1, 1, 12, KEYPOINT_HIDDEN)
  batch = groot.example_batch(c, 2, seed=3)
  labelled = dict(batch, aux_state=np.ones((2, 3), np.float32), aux_mask=np.ones(2, np.float32))
  # Jitted (op by op this took ~50 s on 2 cores); each call reads the model's current weights.
  context = nnx.jit(lambda m, b: m.context(b)[0])
  estimate = nnx.jit(lambda m, v, b: m.aux_estimate(v, b))
  vl = context(model, labelled)
  before = np.asarray(estimate(model, vl, labelled))
  moved = dict(labelled, images=labelled["images"].copy())
  moved["images"][3] = np.roll(moved["images"][3], 9, axis=1)          # sample 1's second camera
  model.backbone.vision.patch_embedding.kernel[...] *= 0.0              # isolate the keypoint path
  vl, vl_moved = context(model, labelled), context(model, moved)
  np.testing.assert_allclose(vl, vl_moved, atol=1e-6)
  after, after_moved = (np.asarray(estimate(model, v, b)) for v, b in ((vl, labelled), (vl_moved, moved)))
  np.testing.assert_allclose(after[0], after_moved[0], rtol=1e-6)
  assert np.abs(after[1] - after_moved[1]).max() > 1e-4
  time, noise = jnp.full((2,), 0.5), jnp.zeros(batch["actions"].shape)
  grads = nnx.jit(nnx.grad(lambda m, b: m.compute_loss(b, jax.random.key(1), time=time, noise=noise,
                                                        train=False)[1]["aux_state_loss"]))(model, labelled)
  assert float(jnp.abs(grads.action_head.aux_keypoints.detectors.kernel[...]).sum()) > 0
  assert float(jnp.abs(grads.action_head.aux_keypoint_in.kernel[...]).sum()) > 0
  assert before.shape == (2, 3)
  # The arm's state is an input too (the wrist camera sees the object relative to the hand).
  shifted = dict(labelled, state=labelled["state"] + np.eye(c.max_state_dim, dtype=np.float32)[0])
  assert np.abs(np.asarray(estimate(model, vl, shifted)) - after).max() > 1e-4


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
  """model.aux_heatmaps: detectors chosen by the instruction, trained by the heatmap loss against
  keypoint labels, learn to put each instruction's keypoint on its own object (a green square for one
  prompt, a red one for the other) wherever the squares are, in a few hundred steps."""
  import optax
  c = groot.model_config("runlocal")
  c.update(num_cameras=1, aux_state_dim=3, aux_keypoints=2, aux_heatmaps=1, tune_visual=True, tune_llm=True)
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
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m.action_head.heatmap_loss(b, m.instruction_embedding(b))))(model)
    optimizer.update(model, grads)
    return loss

  for _ in range(300):
    step(model, optimizer, batch(16)[0])
  test, labels = batch(32)
  head = model.action_head
  images = normalize_images(test["images"], jnp.float32)
  coords, _ = head.aux_keypoints.coordinates(images, logits=head.heatmap_logits(images, model.instruction_embedding(test)))
  error = np.abs(np.asarray(coords[:, -1]) - labels).max(axis=1)
  assert np.median(error) < 1 / 16 and np.mean(error < 2 / 16) > 0.9   # within a 2-pixel patch
