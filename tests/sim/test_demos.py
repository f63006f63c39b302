"""Job `demos` writes scripted-expert episodes as a LeRobot v3 dataset the data reader can open."""

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from configs import demos as demos_config
from ejax.sim import demos

TASKS = "all"  # 15 tasks x 2 envs at 64x64: the batch of tests/sim, so compiled programs are shared


@pytest.mark.timeout(900)
def test_demos_job_writes_a_lerobot_v3_dataset(tmp_path):
  config = demos_config.get_config("runlocal")
  config.demos.update(tasks=TASKS, episodes_per_task=2, num_envs=30, image_height=64, image_width=64)
  demos.run_job(config, str(tmp_path))
  root = tmp_path / "dataset"
  info = json.loads((root / "meta" / "info.json").read_text())
  assert info["codebase_version"] == "v3.0" and info["fps"] == 10 and info["total_episodes"] == 30
  assert info["total_tasks"] == 15
  assert info["features"]["observation.images.agentview"]["shape"] == [64, 64, 3]
  assert info["features"]["action"]["shape"] == [4]
  table = pq.read_table(next(root.glob("data/*/*.parquet")))
  assert table.num_rows == info["total_frames"]
  assert set(table.column("episode_index").to_pylist()) == set(range(30))
  actions = np.asarray(table.column("action").to_pylist(), np.float32)
  assert actions.shape[1] == 4 and np.all(np.abs(actions) <= 1)
  assert info["features"]["observation.environment_state"]["shape"] == [7]
  object_state = np.asarray(table.column("observation.environment_state").to_pylist(), np.float32)
  assert object_state.shape == (table.num_rows, 7) and set(np.unique(object_state[:, 6])) <= {0.0, 1.0}
  assert np.any(object_state[:, 6] == 1.0), "the expert holds its target in some frames"
  assert len(list(root.glob("videos/observation.images.wrist/*/*.mp4"))) == 1
  summary = json.loads((tmp_path / "demos_summary.json").read_text())
  assert set(summary["expert_success_rate"].values()) == {1.0}
  # Episodes end where the expert succeeded, well before the time limits (40-60 steps).
  assert info["total_frames"] < 30 * 40


def test_resolve_tasks_accepts_suites_and_lists():
  assert demos.resolve_tasks("goal") == [name for name in demos.resolve_tasks("all") if name.startswith("goal_")]
  assert demos.resolve_tasks("object_red_block_to_bowl+goal_open_drawer") == ["object_red_block_to_bowl",
                                                                               "goal_open_drawer"]
  with pytest.raises(ValueError, match="unknown task"):
    demos.resolve_tasks("object_red_block_to_bowl,nope")
  assert os.path.basename(demos_config.__file__) == "demos.py"
