"""`python -m ejax.main` end to end on the tiny config, and bad input met with one clear line."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.train.helpers import REPO

SMALL = ["--config.model.width=32", "--config.model.depth=2", "--config.metrics.progress_bar=False"]


def run_main(*args, timeout=300):
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "ejax.main", *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout)


def assert_one_line_error(result, *fragments):
  assert result.returncode == 2, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1, result.stderr[-3000:]
  for fragment in fragments:
    assert fragment in errors[0], errors[0]


def test_main_job_leaves_checkpoint_tensorboard_and_metrics(tmp_path):
  result = run_main("--config=configs/tiny.py:runlocal,steps=20", *SMALL, "--config.metrics.log_every_steps=5",
                    f"--workdir={tmp_path}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "train: finished at step 20" in result.stdout
  assert os.listdir(tmp_path / "checkpoints") == ["20"] or "20" in os.listdir(tmp_path / "checkpoints")
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tensorboard"))
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert rows[-1]["step"] == 20 and rows[-1]["loss"] < rows[0]["loss"]
  assert {"loss", "grad_norm", "learning_rate", "samples_per_second"} <= set(rows[-1])


def test_unknown_config_key(tmp_path):
  result = run_main("--config=configs/tiny.py:runlocal", "--config.train.stepz=3", f"--workdir={tmp_path}")
  assert_one_line_error(result, "unknown config key", "stepz", 'Did you mean "steps"')


def test_unknown_config_arg(tmp_path):
  result = run_main("--config=configs/tiny.py:runlocl", f"--workdir={tmp_path}")
  assert_one_line_error(result, "'runlocl' is not one of")


def test_missing_config_file(tmp_path):
  result = run_main("--config=configs/nope.py", f"--workdir={tmp_path}")
  assert_one_line_error(result, "No such file or directory: 'configs/nope.py'")


def test_mesh_that_does_not_match_devices(tmp_path):
  result = run_main("--config=configs/tiny.py:runlocal", "--config.mesh.data=3", "--config.mesh.fsdp=2",
                    f"--workdir={tmp_path}")
  assert_one_line_error(result, "mesh data=3 x fsdp=2 needs 6 devices, found 1")


def test_packed_rows_too_short_for_the_prompts(tmp_path):
  """Found while assembling the first batch (inside the data pipeline): one line, not grain's traceback."""
  result = run_main("--config=configs/groot.py:runlocal,dataset=synthetic", "--config.model.packing.row_length=24",
                    f"--workdir={tmp_path}")
  assert_one_line_error(result, "> row_length 24", "config.model.packing.row_length")


def test_missing_dataset_path(tmp_path):
  result = run_main("--config=configs/tiny.py:runlocal", "--config.data.path=/no/such/dataset",
                    f"--workdir={tmp_path}")
  assert_one_line_error(result, "data.path '/no/such/dataset' does not exist")


def test_unwritable_workdir():
  result = run_main("--config=configs/tiny.py:runlocal", "--workdir=/etc/hostname/run")
  assert_one_line_error(result, "workdir /etc/hostname/run is not writable")


def test_corrupted_checkpoint(tmp_path):
  first = run_main("--config=configs/tiny.py:runlocal,steps=2", *SMALL, f"--workdir={tmp_path}")
  assert first.returncode == 0, first.stderr[-3000:]
  for root, _, files in os.walk(tmp_path / "checkpoints" / "2" / "state"):
    for name in files:
      with open(os.path.join(root, name), "r+b") as f:
        f.write(b"garbage" * 8)
  result = run_main("--config=configs/tiny.py:runlocal,steps=4", *SMALL, "--config.checkpoint.allow_changes=train.steps",
                    f"--workdir={tmp_path}")
  assert_one_line_error(result, "checkpoint step 2 in", "is damaged", "no earlier step to resume from")


@pytest.mark.timeout(300)
def test_sigterm_saves_and_exits_cleanly(tmp_path):
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  process = subprocess.Popen(
      [sys.executable, "-m", "ejax.main", "--config=configs/tiny.py:runlocal,steps=100000", *SMALL,
       "--config.metrics.log_every_steps=1", "--config.checkpoint.every_steps=100000", f"--workdir={tmp_path}"],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 240
    metrics = tmp_path / "metrics.jsonl"
    while time.time() < deadline and not (metrics.exists() and metrics.stat().st_size > 0):
      time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
  finally:
    process.kill()
  assert process.returncode == 0, err[-3000:]
  steps = [int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit()]
  assert len(steps) == 1 and 0 < steps[0] < 100000
  assert f"stopped at step {steps[0]}" in err
