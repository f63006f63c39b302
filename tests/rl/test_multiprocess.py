"""RL-VLA3 over two local processes (jax.distributed, CPU collectives), launched like SFT:
`python -m ejax.main ... --config.distributed.*` once per process.

(a) sync mode over 2 processes ends with the parameters of 1 process running the same shards;
(b) async over 2 processes: lag <= eta, every shard contributes, a SIGTERM to one process stops
    both at the same version with that version checkpointed, and the run resumes on 1 process;
(c) the learner's batch is global: its env dimension is every process's segments together;
(d) a process killed mid-run ends the other in one line naming the version to resume from.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from ejax.rl.checkpoint import RLCheckpointer
from ejax.rl.runner import load_rl_policy
from tests.train.helpers import REPO

pytestmark = pytest.mark.timeout(600)

# point_reach, 4 shards of 16 envs, 4 segments per update (runlocal): 2 shards and 2 segments a process.
CONFIG = "--config=configs/rl_vla3.py:runlocal,task=point_reach,updates={updates}"
COMMON = ["--config.rl.judge.episodes=64", "--config.rl.checkpoint_every_updates=1", "--config.rl.warm_start.steps=0",
          "--config.compilation_cache_dir="]  # two writers of one cache entry could tear it


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(workdir, *, processes: int, updates: int, extra=(), devices_per_process: int = 2):
  """`processes` copies of the rl job (one process: no jax.distributed), each with its own CPU devices."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
             JAX_PLATFORMS="cpu")
  command = [sys.executable, "-m", "ejax.main", CONFIG.format(updates=updates), *COMMON, *extra,
             f"--workdir={workdir}"]
  if processes == 1:
    return [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
  port = _free_port()
  return [subprocess.Popen(command + [f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                                      f"--config.distributed.num_processes={processes}",
                                      f"--config.distributed.process_id={i}"],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for i in range(processes)]


def finish(procs, timeout=540) -> list[str]:
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=timeout)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  for i, (proc, out) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
  return outputs


def summary(workdir) -> dict:
  return json.load(open(os.path.join(workdir, "rl_summary.json")))


def latest_params(workdir):
  policy = load_rl_policy(os.path.join(workdir, "rl_checkpoints"))
  return jax.device_get(policy.params)


@pytest.mark.slow  # CI time (69 s): the async two-process test runs in CI
def test_sync_two_processes_match_one_process_and_the_batch_is_global(tmp_path):
  sync = ["--config.rl.mode=sync"]
  two = launch(tmp_path / "two", processes=2, updates=3, extra=sync)
  finish(two)
  # The same 4 shards in one process, on as many devices (4) as the two processes had together.
  finish(launch(tmp_path / "one", processes=1, updates=3, extra=sync, devices_per_process=4))
  two_summary, one_summary = summary(tmp_path / "two"), summary(tmp_path / "one")
  assert two_summary["num_processes"] == 2 and one_summary["num_processes"] == 1
  assert two_summary["version"] == one_summary["version"] == 3 and two_summary["lag_max"] == 0
  # (c) each process collected 2 segments x 16 envs per update; the learner trained on all 64.
  assert two_summary["learner_batch_envs"] == one_summary["learner_batch_envs"] == 4 * 16
  assert two_summary["env_steps_per_process"] == [3 * 2 * 8 * 16 * 4] * 2  # updates x segments x steps x envs x actions
  # (a) sync fixes which shard collects which segment and every env's sampling key: the same run.
  assert two_summary["env_steps"] == one_summary["env_steps"]
  leaves_two, leaves_one = jax.tree.leaves(latest_params(tmp_path / "two")), jax.tree.leaves(latest_params(tmp_path / "one"))
  assert len(leaves_two) == len(leaves_one)
  moved = 0.0
  initial = jax.tree.leaves(jax.device_get(load_rl_policy(str(tmp_path / "one" / "rl_checkpoints"), 0).params))
  for a, b, start in zip(leaves_two, leaves_one, initial):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    moved = max(moved, float(np.abs(np.asarray(b) - np.asarray(start)).max()))
  assert moved > 1e-3  # the updates changed the parameters: the comparison is not of two untouched copies


@pytest.mark.slow  # CI time (2026-12-01): 105 s; tests/train/test_multiprocess.py and the watchdog keep two processes in CI
def test_async_two_processes_bound_lag_stop_together_on_sigterm_and_resume_on_one(tmp_path):
  workdir = tmp_path / "run"
  procs = launch(workdir, processes=2, updates=400)
  checkpoints = RLCheckpointer(str(workdir / "rl_checkpoints"))
  deadline = time.time() + 420
  try:
    while time.time() < deadline:  # let it run a few updates, then preempt process 1 only
      try:
        checkpoints._manager.reload()
        if (checkpoints.latest_version() or 0) >= 4:
          break
      except FileNotFoundError:
        pass
      assert all(proc.poll() is None for proc in procs), "a process ended before the SIGTERM"
      time.sleep(0.5)
    procs[1].send_signal(signal.SIGTERM)
    outputs = finish(procs, timeout=300)
  finally:
    checkpoints.close()
  run = summary(workdir)
  assert run["num_processes"] == 2 and 4 <= run["version"] < 400
  assert run["lag_max"] <= run["eta"] == 2
  assert len(run["segments_per_shard"]) == 4 and min(run["segments_per_shard"]) > 0  # every shard contributed
  assert all(steps > 0 for steps in run["env_steps_per_process"])
  assert run["learner_batch_envs"] == 4 * 16
  # Both stopped at the same version: process 0 heard it from process 1.
  assert run["stop_reason"] == "process 1: SIGTERM"
  stopped = [max(int(v) for v in re.findall(r"RL update (\d+):", out)) for out in outputs]
  assert stopped == [run["version"]] * 2
  saved = RLCheckpointer(str(workdir / "rl_checkpoints"))
  try:
    assert saved.latest_version() == run["version"]  # the last good state, saved once by both
  finally:
    saved.close()

  # Resume on one process (with 2 devices): it picks up at the saved version and finishes.
  finish(launch(workdir, processes=1, updates=run["version"] + 2))
  resumed = summary(workdir)
  assert resumed["resumed"] and resumed["start_version"] == run["version"]
  assert resumed["version"] == run["version"] + 2 and resumed["num_processes"] == 1
  assert resumed["lag_max"] <= 2


@pytest.mark.slow  # the mechanism (ejax/parallel/watchdog.py) is the train job's, tested in CI there
def test_a_killed_peer_ends_the_other_in_one_line_naming_the_version_to_resume_from(tmp_path):
  workdir = tmp_path / "run"
  procs = launch(workdir, processes=2, updates=400)
  checkpoints = RLCheckpointer(str(workdir / "rl_checkpoints"))
  deadline = time.time() + 420
  try:
    while time.time() < deadline:
      try:
        checkpoints._manager.reload()
        if (checkpoints.latest_version() or 0) >= 2:
          break
      except FileNotFoundError:
        pass
      assert all(proc.poll() is None for proc in procs), "a process ended before the kill"
      time.sleep(0.5)
    procs[1].kill()  # kill -9
    started = time.time()
    out = procs[0].communicate(timeout=150)[0]
  finally:
    checkpoints.close()
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  assert time.time() - started < 120 and procs[0].returncode == 3, out[-3000:]
  last = out.rstrip().splitlines()[-1]
  match = re.fullmatch(r"error: process 1 of 2 stopped answering at update (\d+) \(rl: no heartbeat for \d+ s\): "
                       r"run the same command to resume from version (\d+)", last)
  assert match, out[-3000:]
  assert "Traceback" not in out and "Fatal" not in out
  saved = RLCheckpointer(str(workdir / "rl_checkpoints"))
  try:
    assert saved.latest_version() == int(match.group(2)) >= 2
  finally:
    saved.close()
