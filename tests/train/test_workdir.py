"""Issue 15 cases 2 and 5: an old run's checkpoints are never mixed with a new run's, and one
workdir serves one run at a time."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest

from ejax.checkpoint import Checkpointer, CheckpointError
from ejax.train.loop import train
from tests.test_main import assert_one_line_error, run_main
from tests.train.helpers import REPO, tiny_config
from tests.train.test_nonfinite import _checkpoint_files

SMALL = ["--config.model.width=32", "--config.model.depth=2", "--config.metrics.progress_bar=False",
         "--config.metrics.tensorboard=False"]


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
  """A finished 2-step run: checkpoints/2 and metrics.jsonl."""
  workdir = tmp_path_factory.mktemp("old_run")
  train(tiny_config(steps=2), str(workdir))
  return workdir


def _copy(old_run, tmp_path):
  import shutil
  shutil.copytree(old_run, tmp_path / "run")
  return tmp_path / "run"


def test_resume_false_over_checkpoints_refuses_to_start(old_run, tmp_path):
  workdir = _copy(old_run, tmp_path)
  before = _checkpoint_files(workdir / "checkpoints")
  result = run_main("--config=configs/tiny.py:runlocal,steps=4", *SMALL, "--config.checkpoint.resume=False",
                    f"--workdir={workdir}", timeout=120)
  assert_one_line_error(result, "checkpoint.resume=False but", "holds steps 2 of an earlier run",
                        "--config.checkpoint.move_aside=True", "nothing is deleted")
  assert _checkpoint_files(workdir / "checkpoints") == before
  assert len(open(workdir / "metrics.jsonl").readlines()) == 2  # nothing appended


def test_move_aside_keeps_the_old_run_and_starts_afresh(old_run, tmp_path):
  workdir = _copy(old_run, tmp_path)
  before = _checkpoint_files(workdir / "checkpoints")
  config = tiny_config(steps=3)
  config.checkpoint.resume = False
  config.checkpoint.move_aside = True
  result = train(config, str(workdir))
  assert [h["step"] for h in result["history"]] == [1, 2, 3]  # from scratch, not from the old step 2
  (aside,) = [name for name in os.listdir(workdir) if name.startswith("previous-")]
  assert _checkpoint_files(workdir / aside / "checkpoints") == before
  assert [json.loads(line)["step"] for line in open(workdir / aside / "metrics.jsonl")] == [1, 2]
  assert [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")] == [1, 2, 3]
  assert os.listdir(workdir / "checkpoints") == ["3"]


def test_a_save_orbax_would_refuse_is_an_error(old_run, tmp_path):
  workdir = _copy(old_run, tmp_path)
  checkpointer = Checkpointer(str(workdir / "checkpoints"), async_save=False)
  try:
    state = {"x": jax.numpy.ones(3)}
    for step in (1, 2):  # below and at the newest step: orbax would skip or write beside it
      with pytest.raises(CheckpointError, match=rf"cannot save step {step}: .* already holds step 2"):
        checkpointer.save(step, state)
  finally:
    checkpointer.close()
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]


def _start(workdir, steps, *extra):
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  return subprocess.Popen(
      [sys.executable, "-m", "ejax.main", f"--config=configs/tiny.py:runlocal,steps={steps}", *SMALL,
       "--config.metrics.log_every_steps=1", *extra, f"--workdir={workdir}"],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_metrics(workdir, process, timeout=240):
  deadline = time.time() + timeout
  metrics = workdir / "metrics.jsonl"
  while time.time() < deadline and not (metrics.exists() and metrics.stat().st_size > 0):
    assert process.poll() is None, process.communicate()[1][-3000:]
    time.sleep(0.2)


def _wait_for_checkpoint(workdir, process, timeout=240):
  """Until a complete step (orbax renames it to its number when done) is in checkpoints/."""
  deadline = time.time() + timeout
  folder = workdir / "checkpoints"
  while time.time() < deadline and not (folder.exists() and [s for s in os.listdir(folder) if s.isdigit()]):
    assert process.poll() is None, process.communicate()[1][-3000:]
    time.sleep(0.2)


def _assert_one_run(workdir, steps):
  logged = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
  assert logged == list(range(1, steps + 1))  # one run's rows, in order, none interleaved


@pytest.mark.timeout(600)
def test_two_runs_started_together_on_one_workdir(tmp_path):
  runs = [_start(tmp_path, 30) for _ in range(2)]
  try:
    outputs = [run.communicate(timeout=400) for run in runs]
  finally:
    for run in runs:
      run.kill()
  codes = sorted(run.returncode for run in runs)
  assert codes == [0, 2], [out[1][-2000:] for out in outputs]
  loser = outputs[[run.returncode for run in runs].index(2)]
  assert_one_line_error(subprocess.CompletedProcess([], 2, loser[0], loser[1]), "is in use by another run",
                        "pass another --workdir")
  assert "Traceback" not in loser[1]
  _assert_one_run(tmp_path, 30)
  assert not os.path.exists(tmp_path / "ejax.lock")  # released at the end


@pytest.mark.timeout(600)
def test_a_second_run_stops_at_once_naming_the_holder_and_a_killed_runs_lock_is_taken_over(tmp_path):
  first = _start(tmp_path, 100000, "--config.checkpoint.every_steps=5")
  try:
    _wait_for_metrics(tmp_path, first)
    started = time.time()
    second = run_main("--config=configs/tiny.py:runlocal,steps=3", *SMALL, f"--workdir={tmp_path}", timeout=120)
    assert time.time() - started < 30  # it stops before compiling anything
    assert_one_line_error(second, "is in use by another run", f"pid {first.pid} on host {socket.gethostname()}")
    _wait_for_checkpoint(tmp_path, first)  # under load step 5's save can come after the second run
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
  finally:
    first.kill()
  saved = [int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit()]
  assert saved and json.load(open(tmp_path / "ejax.lock"))["pid"] == first.pid  # left behind by kill -9

  third = run_main("--config=configs/tiny.py:runlocal,steps=100000", *SMALL,
                   "--config.checkpoint.every_steps=5", "--config.train.stop_at=" + str(max(saved) + 1),
                   f"--workdir={tmp_path}", timeout=240)
  assert third.returncode == 0, third.stderr[-3000:]
  assert f"took over the lock of a run that ended without releasing it (pid {first.pid}" in third.stderr
  assert f"stopped at step {max(saved) + 1} by train.stop_at" in third.stdout
  assert not os.path.exists(tmp_path / "ejax.lock")
