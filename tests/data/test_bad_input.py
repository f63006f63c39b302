"""Bad input gives a DataError naming the file and the episode, or is skipped and counted."""

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ejax.data.errors import DataError
from ejax.data.lerobot import LeRobotSource

pytestmark = pytest.mark.timeout(60)  # a bad file must fail fast, never hang

WRIST_MP4 = "videos/observation.images.wrist/chunk-000/file-000.mp4"
DATA_FILE = "data/chunk-000/file-000.parquet"
EPISODES_FILE = "meta/episodes/chunk-000/file-000.parquet"


@pytest.fixture
def copy(tmp_path, v3_root):
  root = tmp_path / "dataset"
  shutil.copytree(v3_root, root)
  return root


def _corrupt_mdat(path):
  """Overwrites the middle third of the encoded frames, keeping the mp4 index intact."""
  data = bytearray(open(path, "rb").read())
  mdat = data.find(b"mdat")
  size = int.from_bytes(data[mdat - 4:mdat], "big")
  start = mdat + 4 + size // 3
  data[start:start + size // 3] = np.random.default_rng(0).integers(0, 256, size // 3,
                                                                    dtype=np.uint8).tobytes()
  open(path, "wb").write(bytes(data))


def test_missing_video_names_file_and_episode(copy):
  os.remove(copy / WRIST_MP4)
  source = LeRobotSource(str(copy), horizon=2)
  with pytest.raises(DataError, match=r"video file is missing.*file-000\.mp4, episode 1\)"):
    source[10]


def test_truncated_mp4(copy):
  path = copy / WRIST_MP4
  data = open(path, "rb").read()
  open(path, "wb").write(data[:len(data) // 2])
  source = LeRobotSource(str(copy), horizon=2)
  with pytest.raises(DataError, match=r"truncated or corrupt.*file-000\.mp4, episode 2\)"):
    source[25]


def test_corrupt_frames_inside_an_mp4_raise_instead_of_returning_garbage(copy, episodes):
  _corrupt_mdat(copy / WRIST_MP4)
  source = LeRobotSource(str(copy), horizon=1)
  failures = 0
  for index in range(len(source)):
    try:
      sample = source[index]
    except DataError as error:
      assert "file-000.mp4" in str(error) and "episode" in str(error)
      failures += 1
      continue
    written = episodes[sample["episode_index"]]["observation.images.wrist"][sample["frame_index"]]
    assert np.abs(sample["observation.images.wrist"].astype(int) - written).max() <= 4
  assert failures > 0


def test_missing_and_corrupt_parquet(copy):
  open(copy / DATA_FILE, "wb").write(b"PAR1 this is not a parquet file")
  with pytest.raises(DataError, match=r"cannot read parquet.*file-000\.parquet, episode 0\)"):
    LeRobotSource(str(copy), horizon=2)[3]
  os.remove(copy / DATA_FILE)
  with pytest.raises(DataError, match=r"parquet file is missing.*file-000\.parquet, episode 0\)"):
    LeRobotSource(str(copy), horizon=2)[3]


def test_feature_missing_from_info_json(copy):
  info_path = copy / "meta" / "info.json"
  info = json.load(open(info_path))
  del info["features"]["action"]
  json.dump(info, open(info_path, "w"))
  with pytest.raises(DataError, match=r"'action' is not declared in info\.json.*info\.json\)"):
    LeRobotSource(str(copy))
  with pytest.raises(DataError, match=r"camera 'top' is not a video or image feature"):
    LeRobotSource(str(copy), cameras=["top"], action_key="observation.state")


def test_timestamp_outside_the_video(copy):
  path = copy / EPISODES_FILE
  table = pq.read_table(path).to_pylist()
  table[2]["videos/observation.images.wrist/from_timestamp"] += 100.0
  pq.write_table(pa.Table.from_pylist(table), path)
  source = LeRobotSource(str(copy), horizon=2)
  source[0]
  with pytest.raises(DataError, match=r"past the end of the video.*file-000\.mp4, episode 2\)"):
    source[22]


def test_skip_mode_counts_and_logs(copy, caplog):
  os.remove(copy / WRIST_MP4)
  source = LeRobotSource(str(copy), horizon=2, cameras=["wrist"], on_bad_sample="skip")
  with caplog.at_level("WARNING"):
    results = [source[i] for i in range(5)]
  assert results == [None] * 5
  assert source.skipped == 5
  assert "skipping frame 4 (5 skipped so far" in caplog.text and "episode 0" in caplog.text
  assert LeRobotSource(str(copy), horizon=2, cameras=[])[4]["frame_index"] == 4


def test_nan_action_row_is_named_at_first_read_or_skipped(tmp_path, episodes):
  from ejax.data.lerobot import LeRobotV3Writer
  from ejax.data.stats import load_or_compute_stats
  from ml_collections import ConfigDict
  from tests.data.builders import write_dataset
  poisoned = [dict(e) for e in episodes]
  poisoned[1] = dict(poisoned[1], action=poisoned[1]["action"].copy())
  poisoned[1]["action"][4, 2] = np.nan  # global frame 9 + 4 = 13
  root = write_dataset(tmp_path / "dataset", LeRobotV3Writer, poisoned)
  with pytest.raises(DataError, match=r"'action' holds NaN or inf at frame 13 \(1 such frames\).*"
                                      r"on_bad_sample=skip.*file-000\.parquet, episode 1\)"):
    LeRobotSource(str(root), horizon=2, cameras=[])[0]

  source = LeRobotSource(str(root), horizon=2, cameras=[], on_bad_sample="skip")
  read = [source[i] for i in range(len(source))]
  assert [i for i, sample in enumerate(read) if sample is None] == [12, 13]  # chunks that reach frame 13
  stats = load_or_compute_stats(ConfigDict({"normalization": "mean_std"}), source)
  assert np.isfinite(stats["action"]["mean"]).all() and stats["action"]["count"][0] == len(source) - 1


def test_skip_gives_up_after_bad_samples_in_a_row_with_few_warnings(copy, caplog):
  os.remove(copy / WRIST_MP4)  # every sample reads the wrist camera: all bad
  source = LeRobotSource(str(copy), horizon=2, cameras=["wrist"], on_bad_sample="skip", skip_limit=20)
  with caplog.at_level("WARNING"):
    with pytest.raises(DataError, match=r"gave up after 20 bad frames in a row under data.on_bad_sample=skip "
                                        r"\(20 skipped in all\).*the last: video file is missing"):
      for index in range(len(source)):
        source[index]
  assert index == 19
  assert len(caplog.records) <= 6  # five one by one, then one summary per 30 s at most


def test_skip_counts_only_bad_samples_in_a_row(tmp_path, v21_root):
  root = tmp_path / "v21"
  shutil.copytree(v21_root, root)
  os.remove(root / "videos/chunk-000/observation.images.wrist/episode_000001.mp4")  # 12 frames of 28
  source = LeRobotSource(str(root), horizon=1, cameras=["wrist"], on_bad_sample="skip", skip_limit=13)
  read = [source[index] for index in range(len(source))]
  assert source.skipped == 12 and sum(sample is None for sample in read) == 12


def test_pipeline_with_nothing_readable_stops_instead_of_spinning(copy):
  from ml_collections import ConfigDict
  from ejax.data.pipeline import build_pipeline
  os.remove(copy / WRIST_MP4)
  config = ConfigDict(dict(name="lerobot", path=str(copy), horizon=2, cameras=["wrist"], on_bad_sample="skip",
                           skip_limit=50, normalization="none", prefetch=2))
  with build_pipeline(config, batch_size=4, seed=0) as pipeline:
    with pytest.raises(DataError, match="gave up after 50 bad frames in a row"):
      next(pipeline)
