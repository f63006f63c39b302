"""Issue 15 case 9: settings that cannot work stop the run in one line before anything compiles."""

import os
import subprocess
import sys

import pytest

from tests.test_main import assert_one_line_error, run_main
from tests.train.helpers import REPO


@pytest.mark.parametrize("override, fragment", [
    ("--config.checkpoint.every_steps=0", "checkpoint.every_steps=0 must be a positive integer"),
    ("--config.metrics.log_every_steps=0", "metrics.log_every_steps=0 must be a positive integer"),
    ("--config.checkpoint.keep=0", "checkpoint.keep=0 must be a positive integer"),
    ("--config.train.compute_dtype=float17", "train.compute_dtype='float17' is not a float type: use one of "
                                             "float32, bfloat16, float16"),
    ("--config.train.param_dtype=int8", "train.param_dtype='int8' is not a float type"),
    ("--config.train.stop_at=-1", "train.stop_at=-1 must be 0 (off) or a step number"),
    ("--config.checkpoint.step=-2", "checkpoint.step=-2 must be a saved step number"),
    ("--config.data.skip_limit=0", "data.skip_limit=0 must be a positive integer"),
])
def test_bad_setting_is_one_line_before_start(tmp_path, override, fragment):
  result = run_main("--config=configs/tiny.py:runlocal", override, f"--workdir={tmp_path}", timeout=120)
  assert_one_line_error(result, fragment)
  assert not os.listdir(tmp_path)  # nothing started: no lock, no metrics, no checkpoints


def test_batch_that_does_not_split_over_the_data_parallel_devices(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-m", "ejax.main", "--config=configs/tiny.py:runlocal,batch=30",
                           f"--workdir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert_one_line_error(result, "train.global_batch_size=30 does not split over the 8 data-parallel devices of "
                                "mesh data=8: make it a multiple of 8")
  assert "train step memory" not in result.stderr  # stopped before compiling
