"""Normalisation statistics (exact, one pass, the `stats` job) and per-sample transforms."""

import json
import os

import numpy as np
import pytest
from ml_collections import ConfigDict

from ejax.data import stats as stats_lib
from ejax.data import stats_math, transforms
from ejax.data.lerobot import LeRobotSource


def test_stats_job_is_exact_and_written_in_lerobot_format(tmp_path, v3_root, episodes):
  config = ConfigDict(dict(data=dict(name="lerobot", path=v3_root, horizon=4)))
  result = stats_lib.run_job(config, str(tmp_path))
  saved = json.load(open(os.path.join(tmp_path, "stats.json")))
  actions = np.concatenate([e["action"] for e in episodes]).astype(np.float64)
  np.testing.assert_allclose(saved["action"]["mean"], actions.mean(0), rtol=1e-6)
  np.testing.assert_allclose(saved["action"]["std"], actions.std(0), rtol=1e-6)
  np.testing.assert_allclose(saved["action"]["q01"], np.quantile(actions, 0.01, axis=0))
  np.testing.assert_allclose(saved["action"]["q99"], np.quantile(actions, 0.99, axis=0))
  assert saved["action"]["count"] == [len(actions)] and result["steps"] == len(actions)
  loaded = stats_lib.load_or_compute_stats(
      ConfigDict(dict(stats_path=result["path"], normalization="quantile")), None)
  np.testing.assert_allclose(loaded["observation.state"]["q99"],
                             saved["observation.state"]["q99"])


def test_merged_episode_stats_match_the_whole(episodes):
  parts = [stats_math.vector_stats(e["observation.state"]) for e in episodes]
  whole = stats_math.vector_stats(np.concatenate([e["observation.state"] for e in episodes]))
  merged = stats_math.merge_stats(parts)
  for name in ("min", "max", "mean", "std"):
    np.testing.assert_allclose(merged[name], whole[name], rtol=1e-9, atol=1e-12)
  assert merged["count"][0] == whole["count"][0]


def test_normalizer_round_trips_and_guards_flat_dimensions():
  stats = {"action": {"mean": np.array([1.0, 5.0]), "std": np.array([2.0, 0.0]),
                      "q01": np.array([-1.0, 5.0]), "q99": np.array([3.0, 5.0])}}
  values = np.array([[3.0, 5.0], [-1.0, 5.0]], np.float32)
  mean_std = transforms.Normalizer(stats, "mean_std", ["action"])
  np.testing.assert_allclose(mean_std.normalize("action", values), [[1.0, 5.0], [-1.0, 5.0]])
  quantile = transforms.Normalizer(stats, "quantile", ["action"])
  np.testing.assert_allclose(quantile.normalize("action", values), [[1.0, 5.0], [-1.0, 5.0]])
  beyond = np.array([[7.0, 5.0]], np.float32)  # past q99: linear, not clipped (openpi's convention)
  np.testing.assert_allclose(quantile.normalize("action", beyond), [[3.0, 5.0]])
  for normalizer in (mean_std, quantile):
    np.testing.assert_allclose(
        normalizer.unnormalize("action", normalizer.normalize("action", values))[:, 0],
        values[:, 0])
  with pytest.raises(ValueError, match=r"no normalisation statistics for 'observation.state'"):
    transforms.Normalizer(stats, "mean_std", ["observation.state"])


def test_quantile_mode_passes_through_a_dimension_whose_bulk_is_one_value():
  """ejax.sim's goal position over all 15 tasks: 98 % of frames hold one goal (q99 - q01 = 7e-6 m),
  the rest span 0.13 m. Scaled by the bulk's spread the rare goals landed at ~3e4 (pi0.5's loss ~1e7);
  the dimension passes through instead, as an exactly flat one does. A narrow but real bulk still scales."""
  stats = {"goal": {"q01": np.array([0.0476, 0.0]), "q99": np.array([0.0476068, 0.1]),
                    "min": np.array([0.018, -0.5]), "max": np.array([0.15, 0.5])}}
  quantile = transforms.Normalizer(stats, "quantile", ["goal"])
  goals = np.array([[0.0476, 0.05], [0.15, 0.1]], np.float32)
  np.testing.assert_allclose(quantile.normalize("goal", goals), [[0.0476, 0.0], [0.15, 1.0]], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(quantile.unnormalize("goal", quantile.normalize("goal", goals)), goals, rtol=1e-6)


def test_image_transforms_are_seeded_and_keep_shapes():
  image = np.random.default_rng(0).integers(0, 256, (20, 30, 3), np.uint8)
  config = ConfigDict(dict(image_size=[16, 16], augment=dict(crop_scale=0.8, brightness=0.3,
                                                            contrast=0.3, saturation=0.3)))
  transform = transforms.make_sample_transform(config, None, ["cam"])
  out1 = transform({"cam": image.copy()}, np.random.default_rng(1))["cam"]
  out2 = transform({"cam": image.copy()}, np.random.default_rng(1))["cam"]
  out3 = transform({"cam": image.copy()}, np.random.default_rng(2))["cam"]
  assert out1.shape == (16, 16, 3) and out1.dtype == np.uint8
  np.testing.assert_array_equal(out1, out2)
  assert not np.array_equal(out1, out3)
  plain = transforms.make_sample_transform(ConfigDict(dict(image_size=None)), None, ["cam"])
  np.testing.assert_array_equal(plain({"cam": image}, np.random.default_rng(0))["cam"], image)


def test_tokenisation_hook_pads_and_truncates():
  sample = transforms.tokenize_instruction({"task": "abc"}, lambda s: [ord(c) for c in s],
                                           max_length=5)
  np.testing.assert_array_equal(sample["tokens"], [97, 98, 99, 0, 0])
  np.testing.assert_array_equal(sample["token_mask"], [True, True, True, False, False])
  long = transforms.tokenize_instruction({"task": "abcdefg"}, lambda s: [ord(c) for c in s],
                                         max_length=5)
  assert long["token_mask"].all()
