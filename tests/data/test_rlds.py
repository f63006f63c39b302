"""RLDS through tensorflow-datasets (array_record, no TensorFlow): same schema, exact values."""

import numpy as np
import pytest
from ml_collections import ConfigDict

from ejax.data.errors import DataError
from ejax.data.pipeline import build_pipeline
from ejax.data.rlds import RldsSource
from tests.data.builders import RLDS_LENGTHS, build_rlds, rlds_episode


@pytest.fixture(scope="module")
def rlds_dir(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  return data_dir, build_rlds(data_dir)


def test_every_step_reads_back_with_action_chunks_and_pads(rlds_dir):
  data_dir, name = rlds_dir
  source = RldsSource(data_dir, name, horizon=3)
  assert len(source) == sum(RLDS_LENGTHS)
  index, seen = 0, []
  # TFDS stores episodes in its own (hashed) order; state[0] says which one was written.
  for record in range(len(RLDS_LENGTHS)):
    episode = int(source[index]["observation.state"][0])
    seen.append(episode)
    length = RLDS_LENGTHS[episode]
    written = rlds_episode(episode)
    for t in range(length):
      sample = source[index]
      assert (sample["episode_index"], sample["frame_index"], sample["index"]) == (
          record, t, index)
      np.testing.assert_array_equal(sample["observation.state"], written[t]["state"])
      rows = np.arange(t, t + 3)
      np.testing.assert_array_equal(sample["action_is_pad"], rows >= length)
      np.testing.assert_array_equal(
          sample["action"], np.stack([written[min(r, length - 1)]["action"] for r in rows]))
      np.testing.assert_array_equal(sample["observation.images.image"], written[t]["image"])
      assert sample["task"] == written[t]["instruction"]
      index += 1
  assert sorted(seen) == list(range(len(RLDS_LENGTHS)))


def test_columns_cover_every_step(rlds_dir):
  columns = RldsSource(*rlds_dir, horizon=1).columns()
  assert columns["observation.state"].shape == (sum(RLDS_LENGTHS), 4)
  states = columns["observation.state"]
  for episode in range(len(RLDS_LENGTHS)):
    steps = rlds_episode(episode)
    rows = np.flatnonzero(states[:, 0] == episode)
    np.testing.assert_array_equal(states[rows], np.stack([s["state"] for s in steps]))
    np.testing.assert_array_equal(columns["action"][rows], np.stack([s["action"] for s in steps]))


def test_unknown_camera_is_a_clear_error(rlds_dir):
  with pytest.raises(DataError, match=r"camera 'wrist' is not an Image"):
    RldsSource(*rlds_dir, cameras=["wrist"])


def test_pipeline_over_rlds_resizes_and_batches(rlds_dir):
  data_dir, name = rlds_dir
  config = ConfigDict(dict(name="rlds", path=data_dir, rlds_name=name, horizon=2,
                           image_size=[8, 8], num_workers=0, prefetch=0, shuffle=True,
                           normalization="quantile"))
  with build_pipeline(config, batch_size=5, seed=0) as pipeline:
    batch = next(pipeline)
  assert batch["observation.images.image"].shape == (5, 8, 8, 3)
  assert batch["action"].shape == (5, 2, 3) and batch["action_is_pad"].shape == (5, 2)
  assert np.all(np.abs(batch["observation.state"]) <= 1.0)
