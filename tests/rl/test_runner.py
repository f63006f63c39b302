"""Job `rl` end to end on CPU: SFT warm start, RL improves closed-loop success, SIGTERM and resume;
on an ejax.sim task, judged by the eval job before and after, and re-judged from the checkpoints."""

import json
import os
import signal
import threading
import time

import pytest

from configs import rl_vla3
from ejax.rl.checkpoint import RLCheckpointer
from ejax.rl.runner import run_job

pytestmark = pytest.mark.timeout(400)


def small_config(updates):
  config = rl_vla3.get_config(f"runlocal,task=point_reach,updates={updates}")
  config.rl.judge.episodes = 128
  config.rl.checkpoint_every_updates = 1
  return config


def test_rl_job_improves_success_then_stops_on_sigterm_and_resumes(tmp_path):
  workdir = str(tmp_path / "run")
  summary = run_job(small_config(20), workdir)
  assert summary["version"] == 20 and summary["lag_max"] <= summary["eta"] == 2
  assert summary["threads_alive"] == []
  # SFT alone solves some episodes; RL solves clearly more (seen: 0.28 -> 0.36..0.47 over runs on this budget).
  assert 0.05 < summary["success_before"] < 0.6
  assert summary["success_after"] > summary["success_before"] + 0.05
  for name in ("rl_summary.json", "rl_history.jsonl", "timeline.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  assert json.load(open(os.path.join(workdir, "rl_summary.json")))["version"] == 20

  # A second launch resumes at version 20; a SIGTERM after one more update stops it cleanly.
  checkpoints = RLCheckpointer(os.path.join(workdir, "rl_checkpoints"))
  def terminate_after_version_21():
    deadline = time.time() + 300
    while time.time() < deadline:
      try:
        checkpoints._manager.reload()
        latest = checkpoints.latest_version() or 0
      except FileNotFoundError:  # a version rotated out while the listing read it: look again
        latest = 0
      if latest >= 21:
        os.kill(os.getpid(), signal.SIGTERM)
        return
      time.sleep(0.2)
  watcher = threading.Thread(target=terminate_after_version_21, daemon=True)
  watcher.start()
  resumed = run_job(small_config(500), workdir)
  watcher.join(timeout=10)
  assert resumed["resumed"] and resumed["start_version"] == 20
  assert resumed["stop_reason"] == "SIGTERM" and 21 <= resumed["version"] < 500
  assert resumed["threads_alive"] == []
  checkpoints._manager.reload()
  assert checkpoints.latest_version() == resumed["version"]


def sim_config():
  """The runlocal recipe on its ejax.sim task, shrunk to a plumbing check (the improvement itself
  takes the full runlocal budget: see the slow test below)."""
  config = rl_vla3.get_config("runlocal,updates=4")
  config.rl.update(num_shards=2, envs_per_shard=8, segments_per_update=2, num_minibatches=2, queue_size=4)
  config.rl.warm_start.update(demo_episodes=8, steps=100)
  config.rl.judge.update(episodes=8, videos=1)
  config.rl.checkpoint_every_updates = 1  # versions 0..4: more than the 3 newest kept, 0 kept for good
  return config


@pytest.mark.slow  # CI time (2026-12-01): 62 s; the RL job's run, SIGTERM and resume stay in CI (the test above)
@pytest.mark.optimised
@pytest.mark.timeout(900)
def test_rl_job_on_a_sim_task_is_judged_by_the_eval_job_and_rejudged_from_checkpoints(tmp_path):
  from configs import eval as eval_config
  from ejax.eval import evaluate

  workdir = str(tmp_path / "run")
  summary = run_job(sim_config(), workdir)
  assert summary["version"] == 4 and summary["lag_max"] <= summary["eta"] and summary["threads_alive"] == []
  for stage in ("before", "after"):
    judged = json.load(open(os.path.join(workdir, f"eval_{stage}", "summary.json")))
    assert judged["tasks"][0]["task"] == "goal_lift_green_block" and judged["overall"]["episodes"] == 8
    assert judged["overall"]["success_rate"] == summary[f"success_{stage}"]
    assert os.path.getsize(os.path.join(workdir, f"eval_{stage}", "success.png")) > 1000
    assert os.listdir(os.path.join(workdir, f"eval_{stage}", "videos"))
  # Version 0 (the SFT policy) and the final version are saved with their policy config; the eval
  # job rebuilds either from the checkpoint and reproduces the job's own judgement.
  checkpoints = RLCheckpointer(os.path.join(workdir, "rl_checkpoints"))
  assert checkpoints.all_versions() == [0, 2, 3, 4]
  from ejax.checkpoint import CheckpointError
  from ejax.rl.runner import load_rl_policy
  with pytest.raises(CheckpointError, match=r"no version 1; saved: \[0, 2, 3, 4\]"):
    load_rl_policy(os.path.join(workdir, "rl_checkpoints"), version=1)
  for version, stage in ((0, "before"), (-1, "after")):
    config = eval_config.get_config("policy=rl")
    config.eval.update(checkpoint=os.path.join(workdir, "rl_checkpoints"), version=version,
                       tasks="goal_lift_green_block", episodes_per_task=8, num_envs=8, image_height=64,
                       image_width=64, replan_every=4, videos_per_task=1, seed=5,
                       output_dir=str(tmp_path / f"rejudged_{stage}"))
    evaluate.run_job(config, str(tmp_path))
    rejudged = json.load(open(tmp_path / f"rejudged_{stage}" / "summary.json"))
    assert rejudged["overall"]["success_rate"] == summary[f"success_{stage}"]


@pytest.mark.slow
@pytest.mark.optimised
@pytest.mark.timeout(3600)
def test_runlocal_rl_lifts_a_weak_state_based_start_to_the_issue_bar(tmp_path):
  """Issue 14's bar for the state-based actor, as the README runs it (`configs/rl_vla3.py:runlocal`,
  ~30 minutes on 2 cores): from <= 50 % to >= 90 %, with Wilson intervals that do not overlap.
  Seen 2026-11-26: 0.500 -> 0.930 (128 judged episodes each)."""
  config = rl_vla3.get_config("runlocal")
  summary = run_job(config, str(tmp_path / "run"))
  assert summary["lag_max"] <= summary["eta"] and summary["threads_alive"] == []
  assert summary["success_before"] <= 0.5
  assert summary["success_after"] >= 0.9
  assert_intervals_disjoint(summary, config.rl.judge.episodes)


def assert_intervals_disjoint(summary: dict, episodes: int) -> None:
  """The judged success before and after RL differ beyond sampling noise (95 % Wilson intervals)."""
  from ejax.eval.stats import wilson_interval
  before = wilson_interval(round(summary["success_before"] * episodes), episodes)
  after = wilson_interval(round(summary["success_after"] * episodes), episodes)
  assert before[1] < after[0], (before, after)


@pytest.mark.slow
@pytest.mark.optimised
@pytest.mark.timeout(5400)
def test_runlocal_rl_lifts_a_weak_groot_start_by_twenty_points(tmp_path):
  """Issue 14's bar for the GR00T actor, as configs/rl_vla3.py's docstring runs it: a weaker SFT
  start (the quickstart recipe stopped at step 1000 of 1500, seed 1; ~5 minutes), then RL-VLA3 with
  `configs/rl_vla3.py:runlocal,actor=groot` (<= 30 minutes on 2 cores): >= 20 points more, Wilson
  intervals disjoint. Seen 2026-11-26: 0.23 -> 0.64 (100 judged episodes each, 24 minutes) and, in
  this test's own run, 0.23 -> 0.55 [0.45, 0.64] (RL job 19.5 minutes; the whole test 25)."""
  from tests.test_main import run_main

  def main(*args, timeout):
    result = run_main(*args, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]

  main("--config=configs/groot.py:runlocal", "--config.seed=1", "--config.train.stop_at=1000",
       "--config.metrics.progress_bar=False", f"--workdir={tmp_path / 'sft'}", timeout=1800)
  start = time.perf_counter()
  rl_arg = f"runlocal,actor=groot,sft={tmp_path / 'sft' / 'checkpoints'}"
  main(f"--config=configs/rl_vla3.py:{rl_arg}", f"--workdir={tmp_path / 'rl'}", timeout=2700)
  minutes = (time.perf_counter() - start) / 60
  summary = json.load(open(tmp_path / "rl" / "rl_summary.json"))
  assert summary["lag_max"] <= summary["eta"] and summary["threads_alive"] == []
  assert summary["success_after"] - summary["success_before"] >= 0.2, summary
  assert_intervals_disjoint(summary, rl_vla3.get_config(rl_arg).rl.judge.episodes)
  print(f"GR00T RL: {summary['success_before']:.2f} -> {summary['success_after']:.2f} in {minutes:.1f} minutes")
