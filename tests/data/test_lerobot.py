"""LeRobot v2.1 and v3.0 datasets written on the fly read back exactly: values, frames, pads."""

import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from ejax.data.errors import DataError
from ejax.data.lerobot import LeRobotSource, LeRobotV21Writer, LeRobotV3Writer
from tests.data.builders import EPISODE_LENGTHS, FEATURES, FPS, TASKS, write_dataset

CODEC_TOLERANCE = 4  # max |decoded - written| on these smooth images; frames differ by 12


def _global(episode, frame):
  return sum(EPISODE_LENGTHS[:episode]) + frame


@pytest.mark.parametrize("root_fixture", ["v3_root", "v21_root"])
def test_every_step_reads_back_what_was_written(request, episodes, root_fixture):
  source = LeRobotSource(request.getfixturevalue(root_fixture), horizon=5)
  assert len(source) == sum(EPISODE_LENGTHS)
  for episode, length in enumerate(EPISODE_LENGTHS):
    written = episodes[episode]
    for frame in range(length):
      sample = source[_global(episode, frame)]
      assert (sample["episode_index"], sample["frame_index"]) == (episode, frame)
      assert sample["index"] == _global(episode, frame)
      assert sample["task"] == TASKS[episode]
      assert sample["timestamp"] == pytest.approx(frame / FPS)
      np.testing.assert_array_equal(sample["observation.state"],
                                    written["observation.state"][frame])
      # The action chunk runs past the episode's end: clamped to the last frame and flagged.
      rows = np.arange(frame, frame + 5)
      np.testing.assert_array_equal(sample["action_is_pad"], rows >= length)
      np.testing.assert_array_equal(sample["action"],
                                    written["action"][np.minimum(rows, length - 1)])
      for camera in ("observation.images.agentview", "observation.images.wrist"):
        image = sample[camera]
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
        error = np.abs(image.astype(int) - written[camera][frame].astype(int)).max()
        assert error <= CODEC_TOLERANCE, (camera, episode, frame, error)


def test_v3_layout_and_metadata(v3_root):
  info = json.load(open(os.path.join(v3_root, "meta", "info.json")))
  assert info["codebase_version"] == "v3.0"
  assert info["total_episodes"] == 3 and info["total_frames"] == sum(EPISODE_LENGTHS)
  assert info["total_tasks"] == 2 and info["fps"] == FPS
  assert info["features"]["observation.images.wrist"]["info"]["video.codec"] == "h264"
  for path in ("data/chunk-000/file-000.parquet", "meta/tasks.parquet", "meta/stats.json",
               "meta/episodes/chunk-000/file-000.parquet",
               "videos/observation.images.wrist/chunk-000/file-000.mp4"):
    assert os.path.exists(os.path.join(v3_root, path)), path
  episodes = pq.read_table(os.path.join(v3_root, "meta/episodes/chunk-000/file-000.parquet"))
  rows = episodes.to_pylist()
  assert [r["dataset_from_index"] for r in rows] == [0, 9, 21]
  # Episode k's frames start where episode k-1's end inside the shared mp4.
  assert [r["videos/observation.images.wrist/from_timestamp"] for r in rows] == [0.0, 0.9, 2.1]
  stats = json.load(open(os.path.join(v3_root, "meta", "stats.json")))
  assert set(stats["action"]) >= {"min", "max", "mean", "std", "count", "q01", "q99"}
  assert np.shape(stats["observation.images.wrist"]["mean"]) == (3, 1, 1)


def test_observation_offsets_pad_at_episode_start(v3_root, episodes):
  source = LeRobotSource(v3_root, horizon=2, observation_offsets=(-2, -1, 0))
  sample = source[_global(1, 1)]  # episode 1, frame 1: offset -2 falls before the episode
  np.testing.assert_array_equal(sample["observation.state_is_pad"], [True, False, False])
  np.testing.assert_array_equal(sample["observation.state"],
                                episodes[1]["observation.state"][[0, 0, 1]])
  images = sample["observation.images.agentview"]
  assert images.shape == (3, 32, 32, 3)
  np.testing.assert_array_equal(sample["observation.images.agentview_is_pad"], [True, False, False])
  written = episodes[1]["observation.images.agentview"][[0, 0, 1]].astype(int)
  assert np.abs(images.astype(int) - written).max() <= CODEC_TOLERANCE


def test_cameras_image_size_modality_and_embodiment(tmp_path, v3_root, episodes):
  root = tmp_path / "with_modality"
  shutil.copytree(v3_root, root)
  modality = {"state": {"arm": {"start": 0, "end": 4}, "gripper": {"start": 4, "end": 6}},
              "action": {"arm": {"start": 0, "end": 3}, "gripper": {"start": 3, "end": 4}}}
  json.dump(modality, open(root / "meta" / "modality.json", "w"))
  source = LeRobotSource(str(root), horizon=3, cameras=["wrist"], image_size=(16, 24),
                         embodiment_id=7)
  sample = source[4]
  assert "observation.images.agentview" not in sample
  assert sample["observation.images.wrist"].shape == (16, 24, 3)
  assert sample["embodiment_id"] == 7
  by_robot = LeRobotSource(str(root), cameras=[], embodiment_id={"other": 1, "test_arm": 3})
  assert by_robot[0]["embodiment_id"] == 3
  with pytest.raises(DataError, match=r"robot_type 'test_arm' has no entry"):
    LeRobotSource(str(root), embodiment_id={"other": 1})
  np.testing.assert_array_equal(sample["state.gripper"], episodes[0]["observation.state"][4, 4:6])
  np.testing.assert_array_equal(sample["action.arm"], episodes[0]["action"][4:7, :3])


def test_av1_dataset_decodes(tmp_path, episodes):
  root = write_dataset(tmp_path / "av1", LeRobotV3Writer, episodes[:1], video_codec="av1")
  source = LeRobotSource(root, horizon=1)
  for frame in (0, 4, 8):
    image = source[frame]["observation.images.wrist"]
    written = episodes[0]["observation.images.wrist"][frame]
    assert np.abs(image.astype(int) - written.astype(int)).max() <= 6


def test_writer_rejects_bad_episodes(tmp_path, episodes):
  writer = LeRobotV3Writer(str(tmp_path / "bad"), fps=FPS, features=FEATURES, robot_type="arm")
  missing = dict(episodes[0])
  del missing["action"]
  with pytest.raises(ValueError, match=r"missing features \['action'\]"):
    writer.add_episode(missing, task="x")
  wrong = dict(episodes[0], action=np.zeros((9, 5), np.float32))
  with pytest.raises(ValueError, match=r"'action' has per-frame shape \[5\], declared \[4\]"):
    writer.add_episode(wrong, task="x")


def test_v3_episodes_spread_over_several_data_and_video_files(tmp_path, episodes):
  # Tiny size limits: every episode starts a new data file and new mp4s (chunk-000/file-00k).
  root = write_dataset(tmp_path / "many_files", LeRobotV3Writer, episodes,
                       data_files_size_in_mb=1e-6, video_files_size_in_mb=1e-6)
  for k in range(3):
    assert os.path.exists(os.path.join(root, f"data/chunk-000/file-{k:03d}.parquet"))
    assert os.path.exists(os.path.join(root, f"videos/observation.images.wrist/chunk-000/"
                                             f"file-{k:03d}.mp4"))
  rows = pq.read_table(os.path.join(root, "meta/episodes/chunk-000/file-000.parquet")).to_pylist()
  assert [r["videos/observation.images.wrist/from_timestamp"] for r in rows] == [0.0] * 3
  source = LeRobotSource(root, horizon=2)
  for episode, frame in ((0, 8), (1, 0), (1, 11), (2, 6)):
    sample = source[_global(episode, frame)]
    assert (sample["episode_index"], sample["frame_index"]) == (episode, frame)
    np.testing.assert_array_equal(sample["action"][0], episodes[episode]["action"][frame])
    written = episodes[episode]["observation.images.wrist"][frame].astype(int)
    assert np.abs(sample["observation.images.wrist"].astype(int) - written).max() <= 4


@pytest.mark.parametrize("writer_class", [LeRobotV3Writer, LeRobotV21Writer])
def test_image_features_stored_in_parquet_read_back_exactly(tmp_path, episodes, writer_class):
  features = dict(FEATURES)
  features["observation.images.wrist"] = {"dtype": "image", "shape": [32, 32, 3]}
  writer = writer_class(str(tmp_path / "images"), fps=FPS, features=features, robot_type="arm")
  for episode, task in zip(episodes[:2], TASKS):
    writer.add_episode(episode, task=task)
  root = writer.finalize()
  info = json.load(open(os.path.join(root, "meta", "info.json")))
  assert info["features"]["observation.images.wrist"]["dtype"] == "image"
  source = LeRobotSource(root, horizon=2, observation_offsets=(-1, 0))
  sample = source[_global(1, 0)]
  np.testing.assert_array_equal(sample["observation.images.wrist"],  # PNG: lossless
                                episodes[1]["observation.images.wrist"][[0, 0]])
  np.testing.assert_array_equal(sample["observation.images.wrist_is_pad"], [True, False])
  assert sample["observation.images.agentview"].shape == (2, 32, 32, 3)
