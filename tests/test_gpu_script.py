"""benchmarks/gpu.py, the one prepared GPU run, at CPU sizes: every figure runs, writes its JSON, and
the train-step benchmark's arms and startup line come out with numbers (issue 31, points 1 and 2)."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.train.helpers import REPO


@pytest.mark.timeout(900)
def test_every_gpu_figure_runs_at_cpu_size(tmp_path):
  out = tmp_path / "gpu"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", "--out", str(out), "--budget", "840"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=880)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  names = ("train_step", "attention", "fp8", "startup", "packing", "sim", "serve")  # pi0.5's: train_step's script
  summary = json.loads((out / "all.json").read_text())
  for name in names:
    own = out / f"{name}.json"
    figure = json.loads(own.read_text()) if own.exists() else summary["figures"][name]
    assert figure["returncode"] == 0, f"{name}: {figure['output'][-2000:]}"
    assert "(goal" in figure["line"] or name == "startup", f"{name}: {figure['line']}"
    assert summary["figures"][name]["returncode"] == 0
  assert len(list(out.iterdir())) <= 8  # what one device call brings back  assert done.stdout.strip().splitlines()[-1] == f"GPU figures: {len(names)} of {len(names)} ran (goal all)"

  train_step = json.loads((out / "train_step.json").read_text())
  arms = train_step["data"]["groot"]
  for arm in ("configured", "padded"):
    assert arms[arm]["samples_per_second"] > 0 and arms[arm]["compile_seconds"] > 0, arms[arm]
    assert arms[arm]["state_seconds"] > 0 and arms[arm]["step_peak_gib"] > 0
    assert arms[arm]["model_flops_per_sample"] > 0 and arms[arm]["loss"] == arms[arm]["loss"]  # finite
  # The padded arm computes more row tokens per sample than the packed one.
  assert arms["padded"]["row_tokens"] > arms["configured"]["row_tokens"]
  assert re.fullmatch(r"GR00T-N1\.5 train step on cpu: [0-9.]+ samples/s, MFU n/a % \(goal 40 %\)", train_step["line"])

  startup = summary["figures"]["startup"]
  assert re.fullmatch(r"startup configs/tiny\.py:runlocal: state [0-9.]+ s, train step compile [0-9.]+ s \(cpu\)",
                      startup["line"]), startup["line"]
