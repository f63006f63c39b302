"""DreamZero hosting model.perception (ejax/models/perception/) through the same hook as GR00T and pi0.5:
what it writes into every chunk's state, the losses it adds, and the train job on a LeRobot dataset
with ejax.sim's keypoint labels and object state (configs/dreamzero.py:runlocal's recipe)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import dreamzero as dreamzero_config
from ejax.models import layers, perception
from ejax.models.dreamzero import inputs
from ejax.models.dreamzero import model as dz
from ejax.models.siglip import normalize_images
from tests.models.test_dreamzero_data import write_dataset
from tests.train.helpers import load_config


def perceiving_config():
  """runlocal (tiny DiT) with GR00T's quickstart perception on two cameras, a 2-d estimate, no teacher noise."""
  c = dz.model_config("runlocal")
  c.perception = perception.default_config()
  c.perception.update(image_size=32)
  c.perception.estimate.update(dim=2, width=32)
  c.perception.teacher.noise = 0.0
  c.num_cameras = 2
  c.max_state_dim = 11 + perception.state_slots(c.perception, 2)      # 11 + 2 + 2 x 2 x 2 = 21
  return c


def test_the_hook_writes_every_chunks_state_slots_and_adds_the_modules_losses():
  c = perceiving_config()
  layout = perception.read(c).layout
  assert (layout.estimate, layout.keypoints) == (slice(11, 13), slice(13, 21))
  model = layers.host_random_init(nnx.eval_shape(lambda: dz.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  batch = dz.example_batch(c, 3, seed=2)
  assert batch["images"].shape == (6, 32, 32, 3) and not batch["state"][..., 11:].any()
  rng = np.random.default_rng(0)
  batch.update(aux_state=rng.normal(size=(3, 2)).astype(np.float32), aux_mask=np.array([1, 0, 1], np.float32),
               aux_pixels=rng.uniform(-1, 1, (3, 8)).astype(np.float32))

  @nnx.jit
  def perceive(model, batch):
    written, seen = model.perceive(batch, jax.random.key(0))
    return written["state"], seen

  state, seen = perceive(model, batch)
  # The module sees the current frame's cameras, the prompt's mean token embedding and chunk 0's state.
  mask = batch["text_mask"].astype(np.float32)
  table = np.asarray(model.text_encoder.token_embedding[...])
  instruction = np.einsum("nl,nld->nd", mask, table[batch["text_ids"]]) / mask.sum(1, keepdims=True)
  direct = nnx.jit(lambda m, i, s: m.perception(normalize_images(i), s, jnp.asarray(batch["state"][:, 0])))(
      model, jnp.asarray(batch["images"]), jnp.asarray(instruction))
  np.testing.assert_allclose(seen.readout, direct.readout, rtol=1e-5, atol=1e-6)
  # Every chunk's state token reads the data's state, then the estimate (the target where a sample has
  # one), then the keypoints; the data's own dims are untouched.
  expected_estimate = np.where(batch["aux_mask"][:, None] > 0, batch["aux_state"], seen.readout)
  for chunk in range(state.shape[1]):
    np.testing.assert_array_equal(state[:, chunk, :11], batch["state"][:, chunk, :11])
    np.testing.assert_allclose(state[:, chunk, layout.estimate], expected_estimate, rtol=1e-6)
    np.testing.assert_allclose(state[:, chunk, layout.keypoints], seen.keypoints, rtol=1e-6)
  # The loss is the flow-matching loss plus the module's weighted heatmap and estimate losses.
  loss, metrics = nnx.jit(lambda m, b: m.compute_loss(b, jax.random.key(1)))(model, batch)
  flow = float(np.mean(metrics["per_sample_loss"]))
  assert metrics["aux_state_loss"] > 0 and metrics["aux_heatmap_loss"] > 0
  np.testing.assert_allclose(loss, flow + metrics["aux_state_loss"] + metrics["aux_heatmap_loss"], rtol=1e-5)
  error = np.mean(np.square(np.asarray(seen.readout) - batch["aux_state"]), -1)
  np.testing.assert_allclose(metrics["aux_state_loss"], (error * batch["aux_mask"]).sum() / 2, rtol=1e-5)
  # The module trains with the DiT; the frozen encoders stay out.
  trained = nnx.state(model, dz.trainable_filter(c))
  assert set(nnx.to_pure_dict(trained)) == {"dit", "perception"}


@pytest.fixture(scope="module")
def labelled_dataset(tmp_path_factory):
  return write_dataset(str(tmp_path_factory.mktemp("dz_perception") / "dataset"), labels=True)


def _perceiving_run(dataset, steps):
  config = load_config("configs/dreamzero.py", f"runlocal,dataset={dataset},steps={steps},batch=8")
  dreamzero_config._sim_perception(config)
  config.data.update(inputs.data_settings(config.model))
  config.metrics.update(tensorboard=False, progress_bar=False, log_every_steps=1)
  config.checkpoint.update(async_save=False, every_steps=steps)
  config.compilation_cache_dir = ""  # keep the test session's cache (tests/conftest.py)
  return config


def test_collate_gives_the_module_its_images_and_targets(labelled_dataset):
  from ejax.data import pipeline
  config = _perceiving_run(labelled_dataset, 2)
  assert tuple(config.data.image_size) == (64, 64) and config.model.max_state_dim == 26
  collate = inputs.make_collate(config.model, config.data)
  with pipeline.build_pipeline(config.data, batch_size=4, seed=0, collate=collate) as batches:
    batch = next(iter(batches))
  assert batch["images"].shape == (8, 64, 64, 3) and batch["video"].shape == (4, 9, 64, 64, 3)
  # each sample's cameras at its first frame, in the collate's camera order (agentview, wrist)
  np.testing.assert_array_equal(batch["images"][0::2], batch["video"][:, 0, :32, :32].repeat(2, 1).repeat(2, 2))
  assert batch["aux_mask"].tolist() == [1, 1, 1, 1] and batch["aux_pixels"].shape == (4, 8)
  assert not batch["state"][..., 11:].any()


@pytest.mark.slow  # CI time (2026-12-01): 57 s; the hook and the collate stay in CI
def test_runlocal_with_perception_trains_the_module_and_the_dit(labelled_dataset, tmp_path):
  from ejax.train.loop import train
  result = train(_perceiving_run(labelled_dataset, 2), str(tmp_path))
  history = result["history"]
  assert result["final_step"] == 2
  for entry in history:
    assert all(np.isfinite(entry[name]) for name in ("loss", "action_loss", "aux_state_loss", "aux_heatmap_loss"))
  params = nnx.to_pure_dict(result["state"].params)
  assert set(params) == {"dit", "perception"} and "queries" in params["perception"]
