"""Job `rl` end to end on CPU: SFT warm start, RL improves closed-loop success, SIGTERM and resume."""

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
  config = rl_vla3.get_config(f"runlocal,updates={updates}")
  config.rl.judge.episodes = 128
  config.rl.checkpoint_every_updates = 1
  return config


def test_rl_job_improves_success_then_stops_on_sigterm_and_resumes(tmp_path):
  workdir = str(tmp_path / "run")
  summary = run_job(small_config(12), workdir)
  assert summary["version"] == 12 and summary["lag_max"] <= summary["eta"] == 2
  assert summary["threads_alive"] == []
  # SFT alone solves some episodes; RL solves clearly more (seen: 0.28 -> 0.46 on this budget).
  assert 0.05 < summary["success_before"] < 0.6
  assert summary["success_after"] > summary["success_before"] + 0.05
  for name in ("rl_summary.json", "rl_history.jsonl", "timeline.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  assert json.load(open(os.path.join(workdir, "rl_summary.json")))["version"] == 12

  # A second launch resumes at version 12; a SIGTERM after one more update stops it cleanly.
  checkpoints = RLCheckpointer(os.path.join(workdir, "rl_checkpoints"))
  def terminate_after_version_13():
    deadline = time.time() + 300
    while time.time() < deadline:
      checkpoints._manager.reload()
      if (checkpoints.latest_version() or 0) >= 13:
        os.kill(os.getpid(), signal.SIGTERM)
        return
      time.sleep(0.2)
  watcher = threading.Thread(target=terminate_after_version_13, daemon=True)
  watcher.start()
  resumed = run_job(small_config(500), workdir)
  watcher.join(timeout=10)
  assert resumed["resumed"] and resumed["start_version"] == 12
  assert resumed["stop_reason"] == "SIGTERM" and 13 <= resumed["version"] < 500
  assert resumed["threads_alive"] == []
  checkpoints._manager.reload()
  assert checkpoints.latest_version() == resumed["version"]
