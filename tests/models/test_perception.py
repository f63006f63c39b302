"""The perception module behind GR00T's hook (ejax/models/perception/): what it writes into the state,
what trains what, the larger images, the detectors' context and position term, the geometry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.models import groot, layers, perception
from ejax.models.perception.keypoints import pixel_grid
from ejax.models.siglip import normalize_images
from tests.models.test_groot import tiny_config


def perceiving_config(**groups):
  """tiny_config with model.perception: 1 free keypoint, 2 chosen points, a 2-d estimate, teacher-forced."""
  c = tiny_config()
  c.update(tune_visual=True, tune_llm=True)
  c.perception = perception.default_config()
  c.perception.update(image_size=0)
  c.perception.estimate.update(dim=2, width=32)
  for name, settings in groups.items():
    c.perception[name].update(settings)
  return c


def random_model(c):
  return layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)


def labelled_batch(c, n=4):
  batch = groot.example_batch(c, n, seed=3)
  batch["state"][:, perception.read(c).layout.data_dims:] = 0.0
  rng = np.random.default_rng(0)
  return dict(batch, aux_state=np.arange(2 * n, dtype=np.float32).reshape(n, 2) / 8,
              aux_mask=np.array([1, 0, 1, 1][:n], np.float32),
              aux_pixels=rng.uniform(-1, 1, batch["aux_pixels"].shape).astype(np.float32))


@pytest.mark.slow  # CI time (2026-12-01): 80 s; colab/quickstart's test run trains with the hook in CI
def test_the_hook_writes_keypoints_and_the_teacher_forced_estimate_into_the_state_slots():
  """The state the action head reads: the data's, then the estimate (the target where a sample has
  one, noised only with a training rng), then each camera's points' (x, y); the module needs only the
  images, the instruction's embedding and the state."""
  c = perceiving_config(teacher=dict(noise=0.1))
  c.vl_transformer.dropout = 0.0   # so that a training rng changes only the teacher's noise
  model, batch = random_model(c), labelled_batch(c)
  layout = perception.read(c).layout
  assert (layout.estimate, layout.keypoints) == (slice(2, 4), slice(4, 8))   # max_state_dim 8
  images, instruction = normalize_images(jnp.asarray(batch["images"]), jnp.float32), model.instruction_embedding(batch)
  seen = model.perception(images, instruction, jnp.asarray(batch["state"]))   # no targets: the estimate
  assert seen.keypoints.shape == (4, 4) and float(jnp.abs(seen.keypoints).max()) <= 1
  np.testing.assert_array_equal(seen.state[:, layout.estimate], seen.readout)
  _, state = model.context_inputs(batch)
  manual = np.array(batch["state"])
  manual[:, layout.keypoints] = seen.keypoints
  manual[:, layout.estimate] = np.where(batch["aux_mask"][:, None] > 0, batch["aux_state"], seen.readout)
  np.testing.assert_allclose(state, manual, rtol=1e-5, atol=1e-6)
  _, noised = model.context_inputs(batch, jax.random.key(4))
  assert not np.allclose(noised[0], state[0]) and np.allclose(noised[1], state[1], atol=1e-6)
  # The flow loss trains the head, never the estimate nor the detectors; their own losses do.
  # jitted: op by op, this tiny model's gradients took two minutes on 2 cores
  metrics = lambda m, b: m.compute_loss(b, jax.random.key(1), train=False)[1]
  grad = lambda name: nnx.jit(nnx.grad(lambda m, b: metrics(m, b)[name]))(model, batch)
  flow, heat, estimate = grad("flow_loss"), grad("aux_heatmap_loss"), grad("aux_state_loss")
  assert float(jnp.abs(flow.perception.readout_out.kernel[...]).sum()) == 0
  assert float(jnp.abs(flow.perception.queries.kernel[...]).sum()) == 0
  assert float(jnp.abs(flow.action_head.state_encoder.layer1.W[...]).sum()) > 0
  assert float(jnp.abs(heat.perception.queries.kernel[...]).sum()) > 0
  assert float(jnp.abs(estimate.perception.readout_out.kernel[...]).sum()) > 0
  computed = nnx.jit(metrics)(model, batch)
  mask = batch["aux_mask"]
  expected = np.sum(np.mean(np.square(np.asarray(seen.readout) - batch["aux_state"]), -1) * mask) / mask.sum()
  np.testing.assert_allclose(computed["aux_state_loss"], expected, rtol=1e-5)


def test_the_collate_keeps_the_slots_free_and_says_how_far_to_raise_max_state_dim():
  c = perceiving_config()
  collate = groot.make_collate(c)
  size = c.vision.image_size
  sample = {"observation.images.cam": np.zeros((size, size, 3), np.uint8), "task": "lift",
            "action": np.zeros((c.action_horizon, 2), np.float32)}
  assert collate([dict(sample, **{"observation.state": np.zeros(2, np.float32)})])["state"].shape == (1, 8)
  with pytest.raises(ValueError, match=f"raise it to {c.max_state_dim + 1}"):
    collate([dict(sample, **{"observation.state": np.zeros(3, np.float32)})])


def test_larger_images_for_the_detectors_and_a_pooled_copy_for_the_tower():
  c = perceiving_config()
  c.perception.image_size = 2 * c.vision.image_size
  model = random_model(c)
  batch = groot.example_batch(c, 2, seed=3)
  size = c.vision.image_size
  assert batch["images"].shape[1:3] == (2 * size,) * 2
  pooled = batch["images"].astype(np.float32).reshape(-1, size, 2, size, 2, 3).mean(axis=(2, 4))
  direct = model.backbone.connector(model.backbone.vision(normalize_images(jnp.asarray(pooled), jnp.float32)))
  np.testing.assert_allclose(model.backbone.encode_images(batch), direct, rtol=1e-4, atol=1e-5)
  logits = model.perception.heatmap_logits(normalize_images(batch["images"], jnp.float32),
                                           model.instruction_embedding(batch))
  assert logits.shape[1] == size * size   # a 2x2-patch grid of the larger image


def test_context_layers_reach_further_and_the_position_term_adds_its_gain_times_w_dot_xy():
  c = perceiving_config(detectors=dict(context_layers=3, context_dilation=2))
  model = groot.create(c, nnx.Rngs(0))
  assert model.perception.context_more.shape == (2, 3, 3, 32, 32) and model.perception.position is None
  batch = groot.example_batch(c, 2, seed=3)
  images = normalize_images(batch["images"], jnp.float32)
  instruction = model.instruction_embedding(batch)
  base = model.perception.heatmap_logits(images, instruction)
  moved = np.array(batch["images"])
  moved[:, :2, 8:10] = 255 - moved[:, :2, 8:10]          # cell (0, 4) of the 2x2-patch grid
  changed = model.perception.heatmap_logits(normalize_images(jnp.asarray(moved), jnp.float32), instruction)
  grid = c.vision.image_size // 2
  delta = np.abs(np.asarray(changed - base)).reshape(2, grid, grid, -1).max(axis=(0, 3))
  # Reach 1 + 2 + 2 = 5 cells: 4 away moves, 6 away does not beyond float rounding.
  noise = 1e-6 * float(jnp.abs(base).max())
  assert delta[0, 0] > 1e3 * noise and delta[0, 10] < noise

  c.perception.detectors.position_scale = 40.0
  model = random_model(c)
  with_position = model.perception.heatmap_logits(images, instruction)
  weights = model.perception.position(perception.module.standardise(instruction)).reshape(2 * c.num_cameras, 2, 2)
  model.perception.position = nnx.data(None)
  without = model.perception.heatmap_logits(images, instruction)
  cells = jnp.asarray(pixel_grid(grid, grid))
  np.testing.assert_allclose(with_position, without + 40.0 * jnp.einsum("pd,nqd->npq", cells, weights),
                             rtol=1e-5, atol=1e-4)
  # zero-initialised, and trained by the heatmap loss
  fresh = groot.create(c, nnx.Rngs(0))
  assert float(jnp.abs(fresh.perception.position.kernel[...]).max()) == 0
  labelled = labelled_batch(c, 2)
  heatmap_loss = lambda m, b: m.compute_loss(b, jax.random.key(1), train=False)[1]["aux_heatmap_loss"]
  grads = nnx.jit(nnx.grad(heatmap_loss))(fresh, labelled)
  assert float(jnp.abs(grads.perception.position.kernel[...]).sum()) > 0


def test_the_estimate_places_its_points_on_the_calibrated_cameras_rays():
  """geometry.cameras with the policy's statistics (geometry.norm): each instruction point's estimated
  position lies on the camera ray through its keypoint, at the readout's height; the readout's other
  entries stay. Without the statistics (training) the readout stands."""
  from ejax.sim import camera, scene
  agentview = scene.camera_calibration()["agentview"]
  centre, scale = np.linspace(-0.2, 0.3, 7), np.linspace(0.05, 0.3, 7)
  norm = {"state": [[0.0] * 16, [1.0] * 16], "estimate": [centre.tolist(), scale.tolist()]}
  c = perceiving_config(estimate=dict(dim=7), detectors=dict(context_layers=1),
                        geometry=dict(cameras={"agentview": agentview}, radius=(0, 0)))
  c.max_state_dim = 16
  model, batch = random_model(c), groot.example_batch(c, 4, seed=3)
  images, instruction = normalize_images(batch["images"], jnp.float32), model.instruction_embedding(batch)
  state = jnp.asarray(batch["state"])
  untrained = model.perception(images, instruction, state)
  np.testing.assert_array_equal(untrained.estimate, untrained.readout)   # no statistics: the readout
  placed_config = perception.read(dict(c, perception=dict(c.perception, geometry=dict(c.perception.geometry, norm=norm))))
  model.perception.config = placed_config
  seen = model.perception(images, instruction, state)
  readout, placed = np.asarray(seen.readout), np.asarray(seen.estimate)
  keypoints = np.asarray(seen.keypoints).reshape(4, 2, 2)
  metres, before = placed * scale + centre, readout * scale + centre
  rotation = np.asarray(agentview["rotation"], np.float32).reshape(3, 3)
  for k, start in enumerate((0, 3)):
    image = camera.image_points(metres[:, start:start + 3], np.asarray(agentview["position"]), rotation, 64, 64,
                                agentview["fovy"], xp=np)
    np.testing.assert_allclose(image, keypoints[:, k], atol=1e-4)
    np.testing.assert_allclose(metres[:, start + 2], before[:, start + 2], atol=1e-5)
  np.testing.assert_allclose(placed[:, 6], readout[:, 6], atol=1e-6)
  assert not np.allclose(placed[:, :2], readout[:, :2])


def test_an_empty_perception_group_is_the_released_model_and_unknown_settings_are_named():
  c = tiny_config()
  assert perception.read(c) is None and groot.create(c, nnx.Rngs(0)).perception is None
  c.perception = {"estimate": {"dims": 3}}
  with pytest.raises(ValueError, match="model.perception.estimate has no setting 'dims'"):
    perception.read(c)
