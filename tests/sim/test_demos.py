"""Job `demos` writes scripted-expert episodes as a LeRobot v3 dataset the data reader can open."""

import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from configs import demos as demos_config
from ejax.errors import UserError
from ejax.sim import demos

TASKS = "all"  # 15 tasks x 2 envs at 64x64: the batch of tests/sim, so compiled programs are shared


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
  """The demos job's workdir after recording 2 episodes of every task."""
  workdir = tmp_path_factory.mktemp("demos")
  config = demos_config.get_config("runlocal")
  config.demos.update(tasks=TASKS, episodes_per_task=2, num_envs=30, image_height=64, image_width=64)
  demos.run_job(config, str(workdir))
  return workdir


@pytest.mark.timeout(900)
def test_demos_job_writes_a_lerobot_v3_dataset(recorded):
  tmp_path = recorded
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
  # Keypoint labels: the target's and goal's (x, y) in each camera; the target is in the agentview always.
  pixels = np.asarray(table.column("observation.environment_pixels").to_pylist(), np.float32)
  assert pixels.shape == (table.num_rows, 8) and np.all(np.abs(pixels[:, :2]) < 1)
  # The pipeline reads them as they are (data.aux_pixel_key: not normalised, unlike data.aux_state_key).
  from ejax.data.sources import make_source
  from ejax.data.stats import normalized_keys
  from ml_collections import ConfigDict
  source = make_source(ConfigDict(dict(name="lerobot", path=str(root), horizon=4,
                                       aux_pixel_key="observation.environment_pixels")))
  assert "observation.environment_pixels" not in normalized_keys(source)
  np.testing.assert_array_equal(source[0]["observation.environment_pixels"], pixels[0])
  assert len(list(root.glob("videos/observation.images.wrist/*/*.mp4"))) == 1
  # Full-resolution colour, lossless (demo_settings' video_lossless): the frames the policy trains on
  # are the simulator's renders, as at evaluation.
  assert info["features"]["observation.images.wrist"]["info"]["video.pix_fmt"] == "yuv444p"
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


def test_sim_demos_source_records_once_into_the_cache_and_never_leaves_a_partial_dataset(recorded, tmp_path,
                                                                                          monkeypatch):
  """data.name="sim_demos" (the README's default data): recorded on first use under EJAX_CACHE_DIR,
  reused after; a recording that fails leaves nothing that looks like a dataset."""
  from ml_collections import ConfigDict

  from configs import common
  from ejax.data.sources import make_source
  calls = []

  def fake_record(settings, root):  # the real recording is the fixture's; copy it (seconds, not minutes)
    calls.append(root)
    shutil.copytree(recorded / "dataset", root)

  monkeypatch.setattr(demos, "record", fake_record)
  monkeypatch.setenv("EJAX_CACHE_DIR", str(tmp_path / "cache"))
  settings = ConfigDict(common.demo_settings())
  settings.update(episodes_per_task=2, image_height=64, image_width=64)
  data = ConfigDict(dict(name="sim_demos", path=None, sim_demos=settings, horizon=4))
  source = make_source(data)
  assert len(calls) == 1 and len(source) > 0
  path = demos.cached_dataset(settings)
  assert os.path.basename(path).startswith("all-2ep-64x64-seed0-") and len(calls) == 1  # reused
  assert os.listdir(tmp_path / "cache" / "sim_demos") == [os.path.basename(path)]  # no partial copy left
  settings.seed = 1  # other settings: another dataset
  assert demos.cached_dataset(settings) != path and len(calls) == 2

  def failing_record(settings, root):
    os.makedirs(os.path.join(root, "meta"))
    raise KeyboardInterrupt  # e.g. Ctrl-C half way
  monkeypatch.setattr(demos, "record", failing_record)
  target = tmp_path / "elsewhere"
  with pytest.raises(KeyboardInterrupt):
    demos.cached_dataset(settings, str(target))
  assert not target.exists() and os.listdir(tmp_path) == ["cache"]  # no dataset, no partial copy
  target.mkdir()
  (target / "notes.txt").write_text("not a dataset")
  with pytest.raises(UserError, match="holds no LeRobot dataset"):
    demos.cached_dataset(settings, str(target))


def test_perturbations_replace_hand_moves_on_the_asked_fraction_and_keep_the_gripper():
  rng = np.random.default_rng(0)
  actions = np.tile(np.array([[0.5, -0.5, 0.25, 1.0]], np.float32), (4000, 1))
  np.testing.assert_array_equal(demos.perturb(actions, rng), actions)  # nothing asked: the expert's
  executed = demos.perturb(actions, rng, perturb_prob=0.2)
  replaced = np.any(executed[:, :3] != actions[:, :3], axis=1)
  assert 0.17 < replaced.mean() < 0.23
  assert np.abs(executed[replaced, :3]).max() <= 1 and executed[replaced, :3].std() > 0.5  # uniform moves
  np.testing.assert_array_equal(executed[:, 3], actions[:, 3])
  noisy = demos.perturb(actions, rng, action_noise=0.1)
  assert 0.08 < np.std(noisy[:, 0] - actions[:, 0]) < 0.12 and np.abs(noisy).max() <= 1


@pytest.mark.timeout(600)
def test_missed_grasps_show_an_empty_closed_gripper_and_a_second_grasp():
  """miss_grasp_prob=1: episodes close their fingers on air beside the target (the gripper nearly shut
  while the environment state says nothing is held), then grasp again, and all still succeed. The cache's name for recordings without misses is
  the one it had before the option existed."""
  import jax

  from ejax.sim.batched import make_batched
  env = make_batched(["goal_lift_green_block", "object_red_block_to_bowl"], 4, backend="native", cameras=True,
                     image_size=(32, 32))
  plain = demos.record_round(env, jax.random.key(1), 0.0, np.random.default_rng(0))
  missed = demos.record_round(env, jax.random.key(1), 0.0, np.random.default_rng(0), miss_grasp_prob=1.0)
  assert all(e["success"] for e in missed)
  empty_closed = longer = 0
  for a, b in zip(plain, missed):
    gap, held = b["frames"]["observation.state"][:, 7], b["frames"]["observation.environment_state"][:, 6]
    empty_closed += int(np.any((gap < 0.015) & (held < 0.5)))
    longer += int(len(b["frames"]["action"]) > len(a["frames"]["action"]))  # the second grasp takes longer
    assert set(np.unique(b["frames"]["action"][:, 3])) <= {-1.0, 1.0}
  # a slide can still catch the object between the fingers: most episodes, not all, miss
  assert empty_closed >= len(missed) // 2 and longer >= len(missed) // 2
  settings = dict(demos_config.get_config("runlocal").demos)
  assert demos.settings_digest(dict(settings, miss_grasp_prob=0.0)) == demos.settings_digest(
      {k: v for k, v in settings.items() if k != "miss_grasp_prob"})
  assert demos.settings_digest(dict(settings, miss_grasp_prob=0.3)) != demos.settings_digest(settings)


@pytest.mark.timeout(600)
def test_offset_starts_record_only_after_the_random_move():
  """offset_start_prob=1: every episode starts after one random hand move (from a state the plain
  recording of the same layouts never starts from) and still succeeds."""
  import jax

  from ejax.sim.batched import make_batched
  env = make_batched(["goal_lift_green_block", "goal_open_drawer"], 4, backend="native", cameras=True,
                     image_size=(32, 32))
  plain = demos.record_round(env, jax.random.key(1), 0.0, np.random.default_rng(0))
  offset = demos.record_round(env, jax.random.key(1), 0.0, np.random.default_rng(0), offset_start_prob=1.0)
  assert all(e["success"] for e in plain + offset)
  for a, b in zip(plain, offset):
    start = b["frames"]["observation.state"][0]
    # The first recorded frame is none of the plain episode's first OFFSET_START_STEPS[0] + 1 frames.
    early = a["frames"]["observation.state"][:demos.OFFSET_START_STEPS[0] + 1]
    assert np.min(np.abs(early - start).max(-1)) > 1e-4
    assert np.abs(b["frames"]["action"]).max() <= 1.0
