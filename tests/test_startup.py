"""Issue 15 case 10: signals during start-up end the run within seconds, a second one at once, and
the last line says how the run ended; a plain CPU run prints no import or backend noise; the weight
importers work from a plain script."""

import os
import signal
import subprocess
import sys
import time

import pytest

from ejax.config.runtime import host_cpu_tag
from tests.test_main import run_main
from tests.train.helpers import REPO

NOISE = ("Failed to import warp", "Failed to import mujoco_warp", "Unable to initialize backend", "libtpu",
         "cpu_aot_loader", "Assume version compatibility", "non-positive `transition_steps`", "Traceback")
# Wide and deep enough that initialising and compiling take several seconds on any CPU.
# What start-up is doing while the train step compiles: the main thread initialises the parameters,
# then waits for the compile.
STEP_COMPILE_PHASES = ("initialising the parameters while the train step compiles", "compiling the train step")
SLOW_START = ["--config=configs/tiny.py:runlocal,steps=100000", "--config.model.width=256", "--config.model.depth=12",
              "--config.compilation_cache_dir=", "--config.metrics.progress_bar=False"]


def _plain_env(**extra):
  """The environment of a user's shell: none of the test session's quieting or device settings."""
  env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "JAX_PLATFORMS", "XLA_FLAGS")}
  return {**env, **extra}


def _start(*args):
  return subprocess.Popen([sys.executable, "-m", "ejax.main", *args], cwd=REPO, env=_plain_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_line(process, fragment, timeout=240):
  """Reads stderr until a line holds `fragment`; returns what was read."""
  seen, deadline = "", time.time() + timeout
  while fragment not in seen:
    assert time.time() < deadline and process.poll() is None, seen[-3000:]
    line = process.stderr.readline()
    seen += line
  return seen


def _interrupt(process, after_line, signals, pause):
  """Sends `signals` (0.3 s apart) `pause` seconds after stderr shows `after_line`; returns
  (stdout, stderr, seconds from the last signal to the exit)."""
  try:
    _wait_for_line(process, after_line)
    time.sleep(pause)
    for number, signum in enumerate(signals):
      if number:
        time.sleep(0.3)
      process.send_signal(signum)
    sent = time.time()
    out, err = process.communicate(timeout=120)
    return out, err, time.time() - sent
  finally:
    process.kill()


@pytest.mark.timeout(300)
def test_a_signal_during_start_up_ends_the_run_within_seconds(tmp_path):
  process = _start(*SLOW_START, f"--workdir={tmp_path}")
  # Seconds inside XLA from here, where Python signal handlers cannot run.
  out, err, seconds = _interrupt(process, "compiling the train step", [signal.SIGINT], 0.5)
  assert process.returncode == 128 + signal.SIGINT, err[-3000:]
  assert seconds < 8, seconds
  last = out.strip().splitlines()[-1]
  # One process compiles its step beside the parameters' initialisation (ejax/train/compile_beside.py).
  assert last in [f"train: interrupted by SIGINT during start-up ({phase}); nothing was trained or saved"
                  for phase in STEP_COMPILE_PHASES], out
  assert "Traceback" not in err
  assert not (tmp_path / "checkpoints").exists() or not os.listdir(tmp_path / "checkpoints")


@pytest.mark.timeout(300)
def test_a_second_signal_exits_at_once(tmp_path):
  process = _start(*SLOW_START, f"--workdir={tmp_path}")
  out, err, seconds = _interrupt(process, "compiling the train step", [signal.SIGTERM] * 2, 0.0)
  # The first signal may already have ended the start-up (the last line says so) or still be
  # waiting for XLA: either way the second ends the process at once.
  assert seconds < 2, seconds
  assert process.returncode in (128 + signal.SIGTERM, -signal.SIGTERM), err[-3000:]
  assert out.strip().splitlines()[-1] in [
      "train: second signal (SIGTERM): exited at once without saving; no checkpoint was saved",
      *(f"train: interrupted by SIGTERM during start-up ({phase}); nothing was trained or saved"
        for phase in STEP_COMPILE_PHASES)]


WATCHED = """
import sys, time
import jax, jax.numpy as jnp
from ejax.train.signals import StartupInterrupted, StopSignal, signal_name
stop = StopSignal(lambda: "the newest checkpoint is step 4", watch=True)
stop.phase = "compiling the train step"
def long_program(x):
  for i in range(600):
    x = jnp.sin(x @ x) + i
  return x
lowered = jax.jit(long_program).lower(jnp.ones((16, 16)))
print("ready", flush=True)
try:
  lowered.compile()  # ~15 s inside XLA, where Python signal handlers cannot run
except StartupInterrupted as interrupt:  # XLA returned within the watcher's grace: what the launcher does
  if not stop.say_last(f"train: interrupted by {signal_name(interrupt.signum)} during start-up "
                       f"({interrupt.phase}); nothing was trained or saved"):
    time.sleep(6)
  sys.exit(128 + interrupt.signum)
print("the watcher did not end the run", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signals, code, line", [
    (1, 128 + signal.SIGINT,
     "train: interrupted by SIGINT during start-up (compiling the train step); nothing was trained or saved"),
    (2, 128 + signal.SIGINT,
     "train: second signal (SIGINT): exited at once without saving; the newest checkpoint is step 4"),
])
def test_the_watcher_ends_a_start_up_stuck_in_native_code(signals, code, line):
  process = subprocess.Popen([sys.executable, "-c", WATCHED], cwd=REPO, env=_plain_env(JAX_PLATFORMS="cpu"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert process.stdout.readline().strip() == "ready"
    time.sleep(2.0)  # into XLA's native compiling
    for _ in range(signals):
      process.send_signal(signal.SIGINT)
      time.sleep(0.3)
    sent = time.time()
    out, err = process.communicate(timeout=60)
  finally:
    process.kill()
  assert process.returncode == code, err[-3000:]
  assert time.time() - sent < (4 if signals == 1 else 1)
  assert out.strip().splitlines()[-1] == line


@pytest.mark.timeout(300)
def test_the_last_line_says_how_the_run_ended(tmp_path):
  small = ["--config.model.width=32", "--config.model.depth=2", "--config.metrics.progress_bar=False"]
  stopped = run_main("--config=configs/tiny.py:runlocal,steps=6", *small, "--config.train.stop_at=3",
                     f"--workdir={tmp_path}")
  assert stopped.returncode == 0, stopped.stderr[-3000:]
  last = stopped.stdout.strip().splitlines()[-1]
  assert last.startswith("train: stopped at step 3 by train.stop_at, checkpoint saved")
  assert stopped.stdout.strip().endswith("run the same command to resume")

  process = _start("--config=configs/tiny.py:runlocal,steps=100000", *small, "--config.metrics.log_every_steps=1",
                   f"--workdir={tmp_path / 'signal'}")
  out, err, _ = _interrupt(process, "train step memory", [signal.SIGTERM], 1.0)  # while training
  assert process.returncode == 0, err[-3000:]
  last = out.strip().splitlines()[-1]
  assert last.startswith("train: stopped at step ") and " by SIGTERM, checkpoint saved" in last, out


@pytest.mark.timeout(300)
def test_a_plain_cpu_run_prints_no_noise(tmp_path):
  cache = tmp_path / "xla_cache"
  entries = {}
  for attempt in ("cold", "warm"):  # the warm run loads its programs from the compilation cache
    result = subprocess.run(
        [sys.executable, "-m", "ejax.main", "--config=configs/tiny.py:runlocal,steps=10", "--config.model.width=32",
         "--config.model.depth=2", "--config.metrics.progress_bar=False", f"--config.compilation_cache_dir={cache}",
         f"--workdir={tmp_path / attempt}"], cwd=REPO, env=_plain_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    for noise in NOISE:
      assert noise not in result.stdout + result.stderr, (attempt, noise, result.stderr[-3000:])
    assert result.stdout.strip().splitlines()[-1].startswith("train: finished at step 10")
    entries[attempt] = set(os.listdir(cache / host_cpu_tag()))  # this kind of CPU's directory
  # The same command compiles nothing the second time: every program came from the cache.
  assert entries["cold"] and entries["warm"] == entries["cold"]


@pytest.mark.timeout(300)
def test_importing_mujoco_through_the_launcher_prints_no_warp_noise(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "ejax.main", "--config=configs/demos.py:runlocal,tasks=goal_lift_green_block,episodes=1",
       "--config.demos.num_envs=1", f"--workdir={tmp_path}"], cwd=REPO, env=_plain_env(), capture_output=True,
      text=True, timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
  for noise in NOISE:
    assert noise not in result.stdout + result.stderr, (noise, result.stdout[-2000:], result.stderr[-2000:])


def test_import_params_from_a_plain_script(tmp_path):
  script = tmp_path / "convert.py"
  script.write_text(
      "from flax import nnx\n"
      "from ejax.models import layers, pi05\n"
      "from ejax.models.io import pi05_openpi\n"
      "config = pi05.model_config('runlocal')\n"
      "model = layers.host_random_init(nnx.eval_shape(lambda: pi05.create(config, nnx.Rngs(0))), seed=7, stddev=1.0)\n"
      "tree = pi05_openpi.export_params(model)\n"
      "restored = pi05_openpi.import_params(config, tree)\n"
      "print('imported', len(tree))\n")
  result = subprocess.run([sys.executable, str(script)], cwd=REPO, env=_plain_env(JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("imported ")


@pytest.mark.timeout(300)
def test_ctrl_c_while_recording_demonstrations(tmp_path):
  process = _start("--config=configs/groot.py:runlocal", f"--config.data.path={tmp_path / 'demos'}",
                   "--config.metrics.progress_bar=False", f"--workdir={tmp_path / 'run'}")
  out, err, seconds = _interrupt(process, "recording simulated demonstrations", [signal.SIGINT], 2.0)
  assert process.returncode == 128 + signal.SIGINT, err[-3000:]
  assert seconds < 8, seconds
  assert out.strip().splitlines()[-1] == (
      "train: interrupted by SIGINT during start-up (reading the dataset); nothing was trained or saved")
  assert not (tmp_path / "demos").exists()  # the partial recording never looks like a dataset
