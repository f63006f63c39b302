"""Issue 15 case 6: a checkpoint folder that cannot be written (read-only, full) ends the run within
seconds, in one line, with a non-zero exit and the previous checkpoint intact.

Unwritable folders come from chmod for ordinary users and from read-only tmpfs mounts for root
(whom permissions do not stop); a full disk needs a small tmpfs: those tests are skipped where
mounting is not allowed.
"""

import os
import subprocess
import sys
import time

import pytest

from tests.test_main import assert_one_line_error
from tests.train.helpers import REPO
from tests.train.test_nonfinite import _checkpoint_files

ROOT = os.geteuid() == 0
RUN = ["--config=configs/tiny.py:runlocal,steps=100000", "--config.model.width=32", "--config.model.depth=2",
       "--config.metrics.progress_bar=False", "--config.metrics.log_every_steps=1", "--config.checkpoint.every_steps=5"]


def _mount_tmpfs(path, size="8m", read_only=False):
  os.makedirs(path, exist_ok=True)
  options = f"size={size}" + (",ro" if read_only else "")
  result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
  if result.returncode:
    pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()})")


def _unmount(path):
  subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _make_unwritable(path):
  if not ROOT:
    os.chmod(path, 0o555)
    return
  deadline = time.time() + 20
  # A file open for writing (a save in progress) makes the remount fail with "busy": try again.
  while subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True).returncode:
    assert time.time() < deadline, f"cannot remount {path} read-only"
    time.sleep(0.02)


def _start(workdir):
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, "-m", "ejax.main", *RUN, f"--workdir={workdir}"], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_until_checkpoint_then(workdir, spoil, *, timeout=240):
  """Starts a long run, calls spoil() once checkpoint 5 exists, returns (result, seconds from spoil to exit)."""
  process = _start(workdir)
  try:
    deadline = time.time() + timeout
    while not os.path.isdir(workdir / "checkpoints" / "5"):
      assert time.time() < deadline and process.poll() is None, process.communicate()[1][-3000:]
      time.sleep(0.1)
    before = _checkpoint_files(workdir / "checkpoints" / "5")
    spoil()
    spoiled = time.time()
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), time.time() - spoiled, before
  finally:
    process.kill()


@pytest.fixture
def checkpoint_mount(tmp_path):
  """workdir/checkpoints as its own file system (root) or a plain folder (others)."""
  path = tmp_path / "checkpoints"
  if ROOT:
    _mount_tmpfs(path)
  else:
    path.mkdir()
  yield path
  if ROOT:
    _unmount(path)
  else:
    os.chmod(path, 0o755)


@pytest.mark.timeout(300)
def test_unwritable_checkpoint_folder_at_start(tmp_path, checkpoint_mount):
  _make_unwritable(checkpoint_mount)
  started = time.time()
  result = subprocess.run([sys.executable, "-m", "ejax.main", *RUN, f"--workdir={tmp_path}"], cwd=REPO,
                          env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                          timeout=120)
  assert time.time() - started < 60
  assert_one_line_error(result, f"cannot write checkpoints to {checkpoint_mount}", "pass another --workdir")
  assert not os.path.exists(tmp_path / "metrics.jsonl")  # stopped before training


@pytest.mark.timeout(300)
def test_checkpoint_folder_turning_unwritable_mid_run(tmp_path, checkpoint_mount):
  result, seconds, before = _run_until_checkpoint_then(tmp_path, lambda: _make_unwritable(checkpoint_mount))
  assert seconds < 20, seconds
  assert_one_line_error(result, "cannot write checkpoint step", "make it writable or pass another --workdir",
                        "the newest complete checkpoint, step 5, is intact")
  assert _checkpoint_files(checkpoint_mount / "5") == before


@pytest.mark.timeout(300)
def test_full_disk_mid_run(tmp_path):
  _mount_tmpfs(tmp_path / "disk", size="8m")
  try:
    workdir = tmp_path / "disk" / "run"

    def fill():
      with open(tmp_path / "disk" / "filler", "wb", buffering=0) as f:  # unbuffered: close has nothing left
        try:
          while True:
            f.write(b"\0" * 65536)
        except OSError:
          pass

    result, seconds, before = _run_until_checkpoint_then(workdir, fill)
    assert seconds < 20, seconds
    assert_one_line_error(result, "cannot write checkpoint step", "(No space left on device)", "free some space",
                          "the newest complete checkpoint, step 5, is intact")
    assert _checkpoint_files(workdir / "checkpoints" / "5") == before
    os.remove(tmp_path / "disk" / "filler")  # with room again, the same command resumes from step 5
    resumed = subprocess.run([sys.executable, "-m", "ejax.main", *RUN, "--config.train.stop_at=7",
                              f"--workdir={workdir}"],
                             cwd=REPO, env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"), capture_output=True,
                             text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 5" in resumed.stderr and "stopped at step 7 by train.stop_at" in resumed.stdout
  finally:
    _unmount(tmp_path / "disk")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kill_9_during_saves_always_resumes_from_the_newest_complete_checkpoint(tmp_path):
  import random
  import signal

  from ejax.train.workdir import saved_steps
  rng = random.Random(0)
  every_step = [*RUN[:-1], "--config.checkpoint.every_steps=1", "--config.checkpoint.keep=2"]
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  expected = None
  for trial in range(10):
    process = subprocess.Popen([sys.executable, "-m", "ejax.main", *every_step, f"--workdir={tmp_path}"], cwd=REPO,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
      before = max(saved_steps(str(tmp_path / "checkpoints")), default=0)
      deadline = time.time() + 240
      while max(saved_steps(str(tmp_path / "checkpoints")), default=0) < before + 2:
        assert time.time() < deadline and process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.05)
      time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside the next saves
      process.send_signal(signal.SIGKILL)
      _, err = process.communicate(timeout=60)
    finally:
      process.kill()
    if expected is not None:
      assert f"resumed from step {expected}" in err, (trial, expected, err[-2000:])
    expected = max(saved_steps(str(tmp_path / "checkpoints")))
  final = subprocess.run([sys.executable, "-m", "ejax.main", *every_step, f"--config.train.stop_at={expected + 1}",
                          f"--workdir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
  assert final.returncode == 0, final.stderr[-3000:]
  assert f"resumed from step {expected}" in final.stderr


def test_a_full_disk_reads_the_same_whichever_way_tensorstore_words_it(tmp_path):
  """tensorstore reports a full disk either with the OS's wording or as a bare RESOURCE_EXHAUSTED
  (seen 2026-11-26 in test_full_disk_mid_run, one run in several): both say "No space left on device"."""
  from ejax.checkpoint.manager import Checkpointer
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
  try:
    os.makedirs(tmp_path / "checkpoints" / "5")
    worded = "RESOURCE_EXHAUSTED: Error writing local file \"/d/x\": No space left on device [os_error_code=28]"
    for text in (worded, "RESOURCE_EXHAUSTED: Error writing \"/d/x\" [source locations='...']"):
      message = str(checkpointer._write_error(10, Exception(text)))
      assert "(No space left on device)" in message and "free some space" in message, message
      assert "step 5, is intact" in message, message
    permission = str(checkpointer._write_error(10, PermissionError(13, "Permission denied")))
    assert "(Permission denied)" in permission and "make it writable" in permission, permission
  finally:
    checkpointer.close()
