"""Issue 15 case 7: a LeRobot dataset whose metadata and files disagree is refused at open, in one
line naming the file, instead of handing out frames of the wrong episode or quietly shrinking."""

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ejax.data.errors import DataError
from ejax.data.lerobot import LeRobotSource
from tests.data.builders import EPISODE_LENGTHS
from tests.test_main import assert_one_line_error, run_main

EPISODES_DIR = "meta/episodes/chunk-000"
DATA_FILE = "data/chunk-000/file-000.parquet"
TOTAL = sum(EPISODE_LENGTHS)  # 28 frames: episodes of 9, 12 and 7


@pytest.fixture
def v3(tmp_path, v3_root):
  """The v3 dataset with one meta/episodes file per episode (as large datasets have many)."""
  root = tmp_path / "v3"
  shutil.copytree(v3_root, root)
  path = root / EPISODES_DIR / "file-000.parquet"
  rows = pq.read_table(path).to_pylist()
  os.remove(path)
  for number, row in enumerate(rows):
    pq.write_table(pa.Table.from_pylist([row]), root / EPISODES_DIR / f"file-{number:03d}.parquet")
  assert len(LeRobotSource(str(root), horizon=2)) == TOTAL  # still a valid dataset
  return root


@pytest.fixture
def v21(tmp_path, v21_root):
  root = tmp_path / "v21"
  shutil.copytree(v21_root, root)
  return root


def _info(root, **changes):
  path = root / "meta" / "info.json"
  info = json.load(open(path))
  info.update(changes)
  json.dump(info, open(path, "w"))


def test_missing_middle_episodes_file_is_a_gap_not_a_shifted_episode(v3):
  os.remove(v3 / EPISODES_DIR / "file-001.parquet")
  with pytest.raises(DataError, match=r"no episode for frames 9\.\.20 \(between episode 0 and episode 2\) "
                                      r"\(meta/episodes/chunk-000/file-001\.parquet is missing\): "
                                      r"frames would be read"):
    LeRobotSource(str(v3), horizon=2)


def test_missing_last_episodes_file_does_not_shrink_the_dataset(v3):
  os.remove(v3 / EPISODES_DIR / "file-002.parquet")
  with pytest.raises(DataError, match=rf"covers 21 frames in 2 episodes but info.json declares {TOTAL} frames in 3 "
                                      r"episodes: is the last meta/episodes file missing\?"):
    LeRobotSource(str(v3), horizon=2)


def test_missing_last_v21_episodes_line(v21):
  path = v21 / "meta" / "episodes.jsonl"
  lines = open(path).read().splitlines()
  open(path, "w").write("\n".join(lines[:-1]) + "\n")
  with pytest.raises(DataError, match=r"covers 21 frames in 2 episodes .* is the last line of "
                                      r"meta/episodes\.jsonl missing\?.*episodes\.jsonl\)"):
    LeRobotSource(str(v21), horizon=2)


def test_total_frames_is_compared(v3):
  _info(v3, total_frames=TOTAL + 5)
  with pytest.raises(DataError, match=rf"covers {TOTAL} frames in 3 episodes but info.json declares {TOTAL + 5}"):
    LeRobotSource(str(v3), horizon=2)


def test_missing_column_named_at_open_in_one_line(v3):
  table = pq.read_table(v3 / DATA_FILE)
  pq.write_table(table.drop(["action"]), v3 / DATA_FILE)
  with pytest.raises(DataError) as caught:
    LeRobotSource(str(v3), horizon=2)
  message = str(caught.value)
  assert message.startswith("column 'action', which info.json declares, is not in this data file")
  assert message.endswith("file-000.parquet, episode 0)") and "\n" not in message and "truncated" not in message


def test_data_file_with_other_frame_count(v3):
  table = pq.read_table(v3 / DATA_FILE)
  pq.write_table(table.slice(0, TOTAL - 3), v3 / DATA_FILE)
  with pytest.raises(DataError, match=rf"holds {TOTAL - 3} frames but the episode index gives it {TOTAL} "
                                      r"\(episodes 0\.\.2\)"):
    LeRobotSource(str(v3), horizon=2)


def test_frames_never_go_to_the_wrong_episode(v3):
  # Episode boundaries moved by one frame: counts and coverage still add up, the data says otherwise.
  for number, (start, stop) in enumerate([(0, 10), (10, 21)]):
    path = v3 / EPISODES_DIR / f"file-{number:03d}.parquet"
    row = pq.read_table(path).to_pylist()[0]
    row.update(dataset_from_index=start, dataset_to_index=stop, length=stop - start)
    pq.write_table(pa.Table.from_pylist([row]), path)
  source = LeRobotSource(str(v3), horizon=2)
  with pytest.raises(DataError, match=r"frame 9 is frame 0 of episode 1 in its data file, but the episode index "
                                      r"makes it frame 9 of episode 0"):
    source[0]


@pytest.mark.parametrize("declared, found", [("v2.1", "v3.0"), ("v3.0", "v2.1")])
def test_version_that_does_not_match_the_files(request, declared, found):
  root = request.getfixturevalue("v3" if found == "v3.0" else "v21")
  _info(root, codebase_version=declared)
  with pytest.raises(DataError, match=rf"declares codebase_version '{declared}' but the files are {found}'s.*"
                                      rf"set codebase_version to \"{found}\""):
    LeRobotSource(str(root), horizon=2)


@pytest.mark.parametrize("text, fragment", [
    ("{not json",
     "info.json is not valid JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
    ("[1, 2]", "info.json holds a list, not an object"),
    ('{"codebase_version": "v3.0", "features": {}}', "'fps' is missing; 'data_path' is missing"),
    ('{"codebase_version": "v3.0", "fps": 10, "data_path": "x", "features": {"a": 3}}',
     "'features' is not a table of {dtype, shape} entries"),
])
def test_bad_info_json_is_one_line(v3, text, fragment):
  open(v3 / "meta" / "info.json", "w").write(text)
  with pytest.raises(DataError) as caught:
    LeRobotSource(str(v3), horizon=2)
  assert fragment in str(caught.value) and str(caught.value).endswith("info.json)")


def test_bad_metadata_through_the_launcher(v3, tmp_path):
  open(v3 / "meta" / "info.json", "w").write("{not json")
  result = run_main("--config=configs/tiny.py:runlocal", "--config.data.name=lerobot", f"--config.data.path={v3}",
                    f"--workdir={tmp_path / 'run'}", timeout=120)
  assert_one_line_error(result, "info.json is not valid JSON", "meta/info.json)")


def test_every_frame_still_reads_back(v3, episodes):
  source = LeRobotSource(str(v3), horizon=1, cameras=[])
  for index in range(TOTAL):
    sample = source[index]
    episode = int(np.searchsorted(np.cumsum(EPISODE_LENGTHS), index, side="right"))
    assert sample["episode_index"] == episode
    np.testing.assert_array_equal(sample["observation.state"],
                                  episodes[episode]["observation.state"][sample["frame_index"]])
