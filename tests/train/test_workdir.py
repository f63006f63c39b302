"""Issue 15 cases 2 and 5: an old run's checkpoints are never mixed with a new run's, and one
workdir serves one run at a time."""

import json
import os

import jax
import pytest

from ejax.checkpoint import Checkpointer, CheckpointError
from ejax.train.loop import train
from ejax.train.workdir import WorkdirError
from tests.test_main import assert_one_line_error, run_main
from tests.train.helpers import tiny_config
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
