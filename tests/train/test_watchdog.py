"""No silent hangs over two processes (ejax/parallel/watchdog.py): a peer that stops stepping, or
one killed outright, ends every other process with one line naming it, and the run resumes."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from ejax.train.workdir import saved_steps
from tests.train.helpers import REPO

pytestmark = pytest.mark.timeout(600)


def line(process: int) -> re.Pattern:
  return re.compile(rf"^error: process {process} of 2 stopped answering at step (\d+) \(train: (.*)\): "
                    r"run the same command to resume from step (\d+)$", re.M)


LINE = line(1)
COMMAND = ["--config=configs/tiny.py:runlocal,steps={steps},batch=16", "--config.model.width=32",
           "--config.model.depth=2", "--config.metrics.log_every_steps=1", "--config.metrics.progress_bar=False",
           "--config.metrics.tensorboard=False", "--config.checkpoint.every_steps=5",
           "--config.checkpoint.async_save=False"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(workdir, *, steps: int, extra=()) -> list[subprocess.Popen]:
  port = _free_port()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
  command = [sys.executable, "-m", "ejax.main", *(c.format(steps=steps) for c in COMMAND), *extra,
             f"--workdir={workdir}", f"--config.distributed.coordinator_address=127.0.0.1:{port}",
             "--config.distributed.num_processes=2"]
  return [subprocess.Popen(command + [f"--config.distributed.process_id={i}"], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]


def wait_for_step(procs, workdir, step: int, timeout: float = 400) -> None:
  """Until process 0 has logged `step` and a checkpoint is on disk."""
  deadline = time.time() + timeout
  metrics = os.path.join(workdir, "metrics.jsonl")
  while time.time() < deadline:
    assert all(p.poll() is None for p in procs), "a process ended early:\n" + procs[0].communicate()[0][-3000:]
    if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= step and saved_steps(os.path.join(workdir, "checkpoints")):
      return
    time.sleep(0.2)
  raise AssertionError(f"step {step} not reached in {timeout} s")


def ended_within(proc, seconds: float) -> tuple[str, float]:
  started = time.time()
  try:
    out = proc.communicate(timeout=seconds)[0]
  finally:
    if proc.poll() is None:
      proc.kill()
  return out, time.time() - started


# Far above a step or a checkpoint save of this tiny model, even on a loaded machine.
STEP_TIMEOUT_S = 15


@pytest.mark.slow  # CI time (2026-12-01): 73 s; the killed-peer drill below and test_watchdog_rules.py stay in CI
def test_a_peer_that_stops_stepping_ends_every_process_within_the_step_timeout(tmp_path):
  workdir = tmp_path / "run"
  procs = launch(workdir, steps=100_000, extra=[f"--config.train.step_timeout={STEP_TIMEOUT_S}"])
  try:
    wait_for_step(procs, workdir, 8)
    os.kill(procs[1].pid, signal.SIGSTOP)  # process 1 stops stepping (and answering)
    out, seconds = ended_within(procs[0], 90)
    assert procs[0].returncode == 3, out[-3000:]
    match = LINE.search(out)
    assert match, out[-3000:]
    assert "waited" in match.group(2) and f"train.step_timeout {STEP_TIMEOUT_S} s" in match.group(2)
    # the timeout, a few heartbeats, a loaded machine's slack
    assert STEP_TIMEOUT_S - 2 <= seconds <= STEP_TIMEOUT_S + 3 * 2 + 20
    assert "Traceback" not in out and "Fatal" not in out
    assert out.rstrip().splitlines()[-1] == match.group(0)  # the last line
    # The checkpoint it names is the newest complete one, and intact.
    assert int(match.group(3)) == saved_steps(str(workdir / "checkpoints"))[-1] >= 5
    # Woken, process 1 reads the line process 0 left with the coordination service (which stays up,
    # in a process of its own, while process 1 is connected) and ends with it too, without an abort.
    os.kill(procs[1].pid, signal.SIGCONT)
    out1, _ = ended_within(procs[1], 90)
    assert procs[1].returncode == 3, out1[-3000:]
    assert out1.rstrip().splitlines()[-1] == match.group(0)
    assert "Fatal" not in out1 and "stack trace" not in out1
  finally:
    for p in procs:
      if p.poll() is None:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()


@pytest.mark.parametrize("killed", [0, pytest.param(1, marks=pytest.mark.slow)])  # the same path; CI runs one
def test_a_killed_process_ends_the_other_in_one_line_and_the_run_resumes(tmp_path, killed):
  """Process 0 holds jax.distributed's coordination service in a child process of its own
  (ejax/parallel/coordinator.py): killed, it does not take the service down with it, which made
  jaxlib abort process 1 at once with a C++ stack trace."""
  workdir, survivor = tmp_path / "run", 1 - killed
  # A peer is named lost after 20 s here (40 by default), far above this tiny run's steps and heartbeats
  procs = launch(workdir, steps=100_000, extra=["--config.distributed.peer_lost_after=20"])
  try:
    wait_for_step(procs, workdir, 8)
    procs[killed].kill()  # kill -9
    out, seconds = ended_within(procs[survivor], 120)
    assert procs[survivor].returncode == 3, out[-3000:]
    match = line(killed).search(out)
    assert match and "no heartbeat" in match.group(2), out[-3000:]
    assert 18 <= int(re.search(r"no heartbeat for (\d+) s", match.group(2)).group(1)) <= 40, match.group(2)
    assert seconds < 120
    assert "Traceback" not in out and "Fatal" not in out and "Aborted" not in out and "stack trace" not in out
    assert len(re.findall(r"^error:", out, re.M)) == 1
    assert out.rstrip().splitlines()[-1] == match.group(0)
    resume = int(match.group(3))
    assert resume == saved_steps(str(workdir / "checkpoints"))[-1] >= 5
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  # The same command (ended early by train.stop_at) resumes from the named step on both processes.
  procs = launch(workdir, steps=100_000, extra=[f"--config.train.stop_at={resume + 3}"])
  outs = [ended_within(p, 400)[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i}:\n{out[-3000:]}"
    assert f"resumed from step {resume}" in out
    assert re.search(rf"train: process {i} of 2 stopped at step {resume + 3} by train.stop_at", out)


@pytest.mark.slow  # the same watchdog as above, started earlier; ~1.5 min of two processes
def test_a_process_killed_during_start_up_ends_the_other_in_one_line(tmp_path):
  """Killed while the train step compiles, process 0 leaves process 1 in start-up (the compile
  agreement, the barrier after it): the watchdog runs from before the state is made, so process 1
  names it within distributed.peer_lost_after, where it used to wait until the coordination service gave up
  (~120 s) and jaxlib aborted it."""
  import threading

  workdir = tmp_path / "run"
  procs = launch(workdir, steps=100_000)
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(procs[0].stdout), daemon=True)
  reader.start()
  try:
    deadline = time.time() + 300
    while not any("compiling the train step" in x for x in lines):
      assert time.time() < deadline and procs[0].poll() is None, "".join(lines)[-3000:]
      time.sleep(0.05)
    procs[0].kill()  # kill -9
    out, seconds = ended_within(procs[1], 120)
    assert procs[1].returncode == 3, out[-3000:]
    match = re.search(r"^error: process 0 of 2 stopped answering at step 0 \(train: no heartbeat for \d+ s\): "
                      r"run the same command to start again \(no checkpoint was saved\)$", out, re.M)
    assert match, out[-3000:]
    assert seconds < 90
    assert "Traceback" not in out and "Fatal" not in out and "Aborted" not in out and "stack trace" not in out
    assert out.rstrip().splitlines()[-1] == match.group(0)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
