"""Issue 15 case 1: a NaN / inf loss stops the run naming the step; nothing non-finite is saved."""

import json
import os

import numpy as np
import pytest

from ejax.data import synthetic
from ejax.train.guard import NonFiniteError
from ejax.train.loop import train
from ejax.train.metrics import MetricsWriter
from tests.test_main import assert_one_line_error, run_main
from tests.train.helpers import tiny_config


def _strict_rows(path):
  def refuse(constant):
    raise AssertionError(f"metrics.jsonl holds {constant}: not strict JSON")
  return [json.loads(line, parse_constant=refuse) for line in open(path)]


def _checkpoint_files(directory):
  """{relative path: bytes} of every file under the checkpoints directory."""
  files = {}
  for root, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(root, name)
      files[os.path.relpath(path, directory)] = open(path, "rb").read()
  return files


def test_divergence_stops_at_the_step_and_never_rotates_good_checkpoints_out(tmp_path):
  config = tiny_config(steps=6)
  config.checkpoint.keep = 3
  config.checkpoint.every_steps = 2
  train(config, str(tmp_path))
  checkpoints = tmp_path / "checkpoints"
  before = _checkpoint_files(checkpoints)
  assert sorted(int(s) for s in os.listdir(checkpoints)) == [2, 4, 6]

  # The same run resumed with a learning rate that diverges at once: every later save would be NaN.
  config.train.steps = 20
  config.train.learning_rate = 1e6
  config.checkpoint.allow_changes = "all"
  with pytest.raises(NonFiniteError) as caught:
    train(config, str(tmp_path))
  message = str(caught.value)
  assert message.startswith("step ") and "stopped without saving" in message
  assert "the last checkpoint, step 6, is intact" in message and "train.learning_rate" in message
  step = int(message.split()[1].rstrip(":"))
  assert 7 <= step <= 10
  assert _checkpoint_files(checkpoints) == before  # not one byte changed, nothing rotated out
  rows = _strict_rows(tmp_path / "metrics.jsonl")
  assert all(np.isfinite(row["loss"]) for row in rows) and rows[-1]["step"] < step


def test_a_nan_sample_is_named(tmp_path, monkeypatch):
  clean = synthetic.SyntheticDemos.sample

  def sample(self, index):
    values = clean(self, index)
    if index == 21:
      values["action"][3, 1] = np.nan
    return values

  monkeypatch.setattr(synthetic.SyntheticDemos, "sample", sample)
  with pytest.raises(NonFiniteError, match=r"^step 2: .*batch field 'action' holds non-finite values "
                                           r"\(sample 21\)") as caught:
    train(tiny_config(steps=4), str(tmp_path))
  assert "no checkpoint was written" in str(caught.value)
  assert not os.path.exists(tmp_path / "checkpoints") or not os.listdir(tmp_path / "checkpoints")


def test_metrics_jsonl_is_strict_json(tmp_path):
  writer = MetricsWriter(str(tmp_path), total_steps=2, tensorboard=False, progress_bar=False)
  writer.write(1, {"loss": float("nan"), "grad_norm": float("inf"), "learning_rate": 0.1})
  writer.close()
  (row,) = _strict_rows(tmp_path / "metrics.jsonl")
  assert row["loss"] is None and row["grad_norm"] is None and row["learning_rate"] == 0.1


def test_the_launcher_exits_non_zero_with_one_line(tmp_path):
  result = run_main("--config=configs/tiny.py:runlocal,steps=50", "--config.model.width=32",
                    "--config.model.depth=2", "--config.metrics.progress_bar=False",
                    "--config.train.learning_rate=1e6", "--config.checkpoint.every_steps=2",
                    f"--workdir={tmp_path}")
  assert_one_line_error(result, "stopped without saving", "train.learning_rate (now 1e+06)")
  assert "finished" not in result.stdout
  saved = [int(s) for s in os.listdir(tmp_path / "checkpoints")] if os.path.exists(tmp_path / "checkpoints") else []
  step = int(result.stderr.split("error: step ")[1].split(":")[0])
  assert all(s < step for s in saved)
  _strict_rows(tmp_path / "metrics.jsonl")
