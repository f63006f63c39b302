"""configs/dreamzero.py:runlocal through the train job (issue 32, deliverable 4's training path): the
same trainer as GR00T on ejax/data/synthetic.py, batches from ejax/models/dreamzero/inputs.py."""

import jax
import numpy as np
from flax import nnx

from ejax.data import synthetic
from ejax.models.dreamzero import inputs
from ejax.models.dreamzero import model as dz
from ejax.train.loop import train
from tests.train.helpers import load_config


def test_synthetic_batches_have_the_example_batch_layout():
  config = dz.model_config("runlocal")
  batch = next(synthetic.make_iterator(config, {}, batch_size=3, seed=0, process_index=0, process_count=1,
                                       collate=inputs.make_collate(config, None)))
  example = dz.example_batch(config, 3)
  assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {k: (v.shape, v.dtype) for k, v in example.items()}
  # The synthetic world: the first latent frame is the state's, later frames move with the actions.
  assert np.abs(batch["latents"][:, 1] - batch["latents"][:, 0]).max() > 0.01


def test_runlocal_trains_on_synthetic_data(tmp_path):
  config = load_config("configs/dreamzero.py", "runlocal,dataset=synthetic,steps=16")
  config.metrics.update(tensorboard=False, progress_bar=False, log_every_steps=1)
  config.checkpoint.update(async_save=False, every_steps=16)
  config.compilation_cache_dir = ""  # keep the test session's cache (tests/conftest.py)
  result = train(config, str(tmp_path))
  history = result["history"]
  losses = np.asarray([entry["loss"] for entry in history])
  assert result["final_step"] == 16 and np.all(np.isfinite(losses))
  # Both terms fall, the first four steps against the last four (the video term, with a random
  # timestep per chunk and batch 8, is the noisier one).
  for name, ratio in (("loss", 0.7), ("action_loss", 0.7), ("video_loss", 0.9)):
    values = np.asarray([entry[name] for entry in history])
    assert values[-4:].mean() < ratio * values[:4].mean(), (name, values)
  # umT5, CLIP and the VAE are frozen: the trainer keeps them outside the optimizer.
  frozen_paths = {str(path[0].key) for path, _ in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(result["state"].frozen))[0]}
  trained_paths = {str(path[0].key) for path, _ in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(result["state"].params))[0]}
  assert frozen_paths == {"text_encoder", "image_encoder", "vae"} and trained_paths == {"dit"}
