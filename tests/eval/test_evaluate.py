"""Job `eval` with the scripted expert (ceiling) and a random policy (floor)."""

import json

import numpy as np
import pytest

from configs import eval as eval_config
from ejax.eval import evaluate, stats, videos

TASKS = "all"  # 15 tasks x 2 envs at 64x64: the batch of tests/sim, so compiled programs are shared


def test_wilson_interval_known_values():
  np.testing.assert_allclose(stats.wilson_interval(0, 10), (0.0, 0.2775), atol=1e-4)
  np.testing.assert_allclose(stats.wilson_interval(10, 10), (0.7225, 1.0), atol=1e-4)
  np.testing.assert_allclose(stats.wilson_interval(5, 10), (0.2366, 0.7634), atol=1e-4)
  assert stats.wilson_interval(0, 0) == (0.0, 1.0)
  with pytest.raises(ValueError):
    stats.wilson_interval(3, 2)


def _config(policy: str):
  config = eval_config.get_config(f"runlocal,policy={policy}")
  config.eval.update(tasks=TASKS, episodes_per_task=2, num_envs=30, image_height=64, image_width=64,
                     videos_per_task=1)
  return config


@pytest.mark.timeout(900)
def test_expert_policy_scores_full_marks_and_writes_every_artifact(tmp_path):
  evaluate.run_job(_config("expert"), str(tmp_path))
  out = tmp_path / "eval"
  summary = json.loads((out / "summary.json").read_text())
  assert [row["episodes"] for row in summary["tasks"]] == [2] * 15
  assert summary["overall"]["success_rate"] == 1.0
  assert summary["overall"]["ci_low"] == pytest.approx(stats.wilson_interval(30, 30)[0])
  assert [group["task"] for group in summary["suites"]] == ["suite:goal", "suite:object", "suite:spatial"]
  assert "overall" in (out / "summary.txt").read_text()
  assert (out / "success.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  clips = sorted(out.glob("videos/*.mp4"))
  assert len(clips) == 15 and clips[0].name == "goal_close_drawer_0.mp4"
  frames = videos.read_mp4(str(clips[0]))
  assert frames.shape[1:] == (64, 128, 3) and 5 < len(frames) < 50


@pytest.mark.timeout(900)
def test_random_policy_is_the_floor(tmp_path):
  config = _config("random")
  config.eval.episode_length = 20  # random actions never succeed; no need to wait out the full limits
  evaluate.run_job(config, str(tmp_path))
  summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
  assert summary["overall"]["success_rate"] == 0.0


def test_unknown_policy_and_missing_checkpoint_are_explained():
  config = _config("random")
  config.eval.policy = "telepathy"
  with pytest.raises(ValueError, match="unknown config.eval.policy"):
    evaluate.make_policy(config, 4)
  config.eval.policy = "checkpoint"
  with pytest.raises(ValueError, match="needs --config.eval.checkpoint"):
    evaluate.make_policy(config, 4)
