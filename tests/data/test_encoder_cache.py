"""DreamZero's frozen-encoder cache (issue 32 point 3): the encode job's cache gives the in-step loss on
the same batch and noise; a stale, damaged or unfinished cache is one error line; the trainer reads it.
The dataset is tests/models/test_dreamzero_data.py's (20 samples, two prompts, two 32 px cameras)."""

import os

import jax
import numpy as np
import pytest

from ejax.data import encoder_cache
from ejax.data import pipeline
from ejax.data.errors import DataError
from ejax.models.dreamzero import inputs
from ejax.parallel import make_mesh
from ejax.parallel.rules import sharding_context
from ejax.train import encode as encode_job
from ejax.train.loop import train
from tests.models.test_dreamzero_data import LENGTHS, write_dataset
from tests.train.helpers import load_config

BATCH = 8                          # the test session's 8 CPU devices, one sample each


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
  return write_dataset(str(tmp_path_factory.mktemp("dz_cache") / "dataset"))


def _config(dataset, directory, **data):
  config = load_config("configs/dreamzero.py", f"runlocal,dataset={dataset}")
  config.data.update(num_workers=0, prefetch=0, encoder_cache=str(directory), **data)
  config.train.update(global_batch_size=BATCH, steps=2)
  config.metrics.update(tensorboard=False, progress_bar=False, log_every_steps=1)
  config.checkpoint.update(async_save=False, every_steps=2)
  config.compilation_cache_dir = ""
  return config


@pytest.fixture(scope="module")
def cached(dataset, tmp_path_factory):
  """The trainer's reader with data.encoder_cache_refresh (runlocal's default on the quickstart demos):
  the cache is missing, so it is written first."""
  folder = tmp_path_factory.mktemp("dz_cache") / "caches"
  config = _config(dataset, folder, encoder_cache_refresh=True)
  directory = encode_job.keyed_config(config).data.encoder_cache      # folder/<key of settings and seed>
  assert os.path.dirname(directory) == str(folder)
  with pytest.raises(encoder_cache.StaleCache, match="no finished cache"):
    encoder_cache.CachedBatches(directory, config=config, batch_size=BATCH, seed=0)
  reader = encode_job.open_cache(config, batch_size=BATCH)
  manifest = reader.manifest
  config = _config(dataset, directory)                                 # the cache itself, as the job writes it
  return config, {"directory": directory, "num_samples": manifest["num_samples"],
                  "num_prompts": manifest["tables"]["text_embeddings"]["rows"]}


def test_the_cache_holds_every_sample_once_and_each_prompt_once(cached):
  config, result = cached
  manifest = encoder_cache.read_manifest(result["directory"])
  assert result["num_samples"] == manifest["num_samples"] == sum(LENGTHS)
  assert result["num_prompts"] == manifest["tables"]["text_embeddings"]["rows"] == 2
  assert manifest["fields"]["latents"]["shape"] == [3, 8, 8, 8]       # 1 + 2 chunks latent frames, 8 x 8 x 8
  assert "video" not in manifest["fields"] and "first_frame" not in manifest["fields"]
  assert manifest["frozen"]["components"] == ["text_encoder", "image_encoder", "vae"]
  assert manifest["inputs"]["model.vae"]["z_dim"] == 8 and "model.dit" not in manifest["inputs"]
  assert not [p for p in os.listdir(os.path.dirname(result["directory"])) if ".partial-" in p]


def test_a_cached_batch_gives_the_in_step_loss(cached):
  config, result = cached
  reader = encoder_cache.CachedBatches(result["directory"], config=config, batch_size=BATCH, seed=0)
  first = np.arange(BATCH)                           # the cache is in the dataset's order
  cached_batch = reader.gather(first)
  reading = config.data.copy_and_resolve_references()
  reading.update(shuffle=False, encoder_cache=None)
  collate = inputs.make_collate(config.model, reading)
  with pipeline.build_pipeline(reading, batch_size=BATCH, seed=0, collate=collate) as samples:
    in_step_batch = next(samples)
  assert set(cached_batch) == set(in_step_batch) - {"video", "first_frame"} | {
      "latents", "image_embeddings", "text_embeddings", "prompt_index"}
  for key in set(in_step_batch) & set(cached_batch):
    np.testing.assert_array_equal(cached_batch[key], in_step_batch[key], err_msg=key)
  mesh = make_mesh(config.mesh.to_dict())
  rules = [tuple(rule) for rule in config.sharding_rules]
  with sharding_context(mesh, rules):
    model, frozen = encode_job.frozen_model(config, mesh, rules)
    assert encoder_cache.fingerprint(frozen, ["vae"]) != encoder_cache.fingerprint(frozen, ["text_encoder"])
    reader.check_frozen(frozen)                     # the trainer's weights: accepted
    rng = jax.random.key(7)                         # the same timesteps and noise for both
    loss = jax.jit(lambda b: model.compute_loss(b, rng))
    in_step, in_step_metrics = loss(in_step_batch)
    from_cache, cache_metrics = loss(cached_batch)
    text = model.text_encoder(in_step_batch["text_ids"], in_step_batch["text_mask"])
  np.testing.assert_allclose(cached_batch["text_embeddings"], text, rtol=1e-5, atol=1e-6)
  assert float(in_step) > 0.1
  np.testing.assert_allclose(float(from_cache), float(in_step), rtol=1e-5)
  np.testing.assert_allclose(float(cache_metrics["video_loss"]), float(in_step_metrics["video_loss"]), rtol=1e-5)


def test_batches_shuffle_each_epoch_and_resume_exactly(cached):
  config, result = cached
  reader = encoder_cache.CachedBatches(result["directory"], config=config, batch_size=BATCH, seed=3)
  epoch = [next(reader)["actions"] for _ in range(sum(LENGTHS) // BATCH)]       # one epoch: 2 batches of 8
  firsts = np.concatenate([e[:, 0, 0] for e in epoch])
  assert len(np.unique(firsts)) > 10 and not np.array_equal(firsts, np.sort(firsts))   # 16 of the 20, shuffled
  state = reader.get_state()
  following = [next(reader)["latents"] for _ in range(2)]
  again = encoder_cache.CachedBatches(result["directory"], config=config, batch_size=BATCH, seed=3)
  again.set_state(state)
  for want in following:
    np.testing.assert_array_equal(next(again)["latents"], want)
  assert state == {"epoch": 0, "position": 16} and reader.get_state()["epoch"] == 1
  with pytest.raises(DataError, match="not an encoder cache's"):
    again.set_state({"next_index": 5})              # a checkpoint of the in-step pipeline


def test_a_stale_damaged_or_unfinished_cache_is_one_error(cached, tmp_path):
  config, result = cached
  directory = result["directory"]
  changed = config.copy_and_resolve_references()
  changed.data.relative_action_dims = 1
  with pytest.raises(DataError, match=r"written with data.relative_action_dims=0, this run has 1: .*--config.job=encode"):
    encoder_cache.CachedBatches(directory, config=changed, batch_size=BATCH, seed=0, rerun=encode_job.RERUN)
  changed = config.copy_and_resolve_references()
  changed.model.vae.dim = 16
  with pytest.raises(DataError, match="written with model.vae="):
    encoder_cache.CachedBatches(directory, config=changed, batch_size=BATCH, seed=0)
  # Other frozen weights (another seed's random encoders): refused by the trainer's check.
  other = config.copy_and_resolve_references()
  other.seed = 1
  mesh = make_mesh(other.mesh.to_dict())
  rules = [tuple(rule) for rule in other.sharding_rules]
  with sharding_context(mesh, rules):
    _, frozen = encode_job.frozen_model(other, mesh, rules)
  reader = encoder_cache.CachedBatches(directory, config=config, batch_size=BATCH, seed=0)
  with pytest.raises(DataError, match="other frozen weights"):
    reader.check_frozen(frozen)
  # A damaged copy: one byte of a shard altered.
  copy = tmp_path / "copy"
  os.system(f"cp -r {directory} {copy}")
  path = copy / "shard_00000" / "latents.npy"
  data = bytearray(path.read_bytes())
  data[-1] ^= 1
  path.write_bytes(bytes(data))
  with pytest.raises(DataError, match="sha256"):
    encoder_cache.CachedBatches(str(copy), config=config, batch_size=BATCH, seed=0)
  (copy / "manifest.json").unlink()
  with pytest.raises(DataError, match="no finished cache"):
    encoder_cache.CachedBatches(str(copy), config=config, batch_size=BATCH, seed=0)
  # The job never replaces a directory that is not a cache (a mistyped data.encoder_cache=runs).
  with pytest.raises(DataError, match="is not an encoder cache"):
    encoder_cache.CacheWriter(str(copy))
  assert (copy / "shard_00000" / "latents.npy").exists()


@pytest.mark.slow   # 85 s on 2 loaded cores (the step's compile); benchmarks/dreamzero_encode.py trains on a cache too
def test_the_train_job_reads_the_cache(cached, tmp_path):
  config, result = cached
  history = train(config, str(tmp_path / "run"))["history"]
  assert [h["step"] for h in history] == [1, 2] and all(np.isfinite(h["loss"]) for h in history)
  # The pipeline's normalisation statistics travel with the cache (and from it into checkpoints).
  assert set(encoder_cache.read_manifest(result["directory"])["norm_stats"]) >= {"action", "observation.state"}


@pytest.mark.slow   # two encodes and three frozen states: ~60 s on 2 loaded cores
def test_refresh_rewrites_a_cache_of_other_frozen_weights(dataset, tmp_path):
  config = _config(dataset, tmp_path / "caches", encoder_cache_refresh=True)
  directory = encode_job.keyed_config(config).data.encoder_cache
  other = config.copy_and_resolve_references()
  other.seed = 1
  assert encode_job.keyed_config(other).data.encoder_cache != directory    # another seed: its own cache
  # Seed 1's encoders written where seed 0's belong: as if train.init_weights' files changed since.
  stale = _config(dataset, directory)
  stale.seed = 1
  encode_job.encode(stale)
  before = encoder_cache.read_manifest(directory)["frozen"]["fingerprint"]
  mesh = make_mesh(config.mesh.to_dict())
  rules = [tuple(rule) for rule in config.sharding_rules]
  with sharding_context(mesh, rules):
    _, frozen = encode_job.frozen_model(config, mesh, rules)
  reader = encode_job.open_cache(config, batch_size=BATCH)   # its settings match: opened as it is
  next(reader)
  reader.check_frozen(frozen)                                # the trainer's check: rewritten, then accepted
  after = encoder_cache.read_manifest(directory)["frozen"]["fingerprint"]
  assert after != before and reader.get_state() == {"epoch": 0, "position": BATCH}
