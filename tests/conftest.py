"""Test setup shared by every test: 8 fake CPU devices, eager sharding off, quiet logs."""

import os

# Before JAX initialises: 8 fake CPU devices so that sharding tests see a real mesh. The suite compiles
# far more than it runs (a GR00T train step on tiny shapes, run once or twice), so its programs compile
# with jax_disable_most_optimizations: XLA's backend at LLVM -O0 with LLVM's expensive passes off, not
# at the level 1 XLA_FLAGS asks for (16 % fewer test-seconds on 2 cores; BENCHMARKS.md, "The test
# suite's time", has what else was tried). Tests marked `optimised` compile at level 1 (the fixture
# below): the long rollouts and trainings of -m slow, whose time is in running (the 20-seed experts took
# 148 s at -O0, 71 s optimised), and a bit-for-bit comparison of two programs that round 1 ulp apart at -O0.
# Subprocesses (notebooks, benchmarks, `python -m ejax.main` runs) inherit both settings;
# tests/test_main.py's run_main replaces XLA_FLAGS.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=1")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")
# XLA:CPU aborts the process ("Termination timeout ... of 40 seconds exceeded, only 3 of 8 threads
# arrived") when the fake devices of one program reach a collective that far apart; on a loaded
# 2-core machine (two test workers, a GR00T train step per device) they can. A real deadlock still
# ends, through pytest-timeout's limit.
if "collective_call_terminate" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += (" --xla_cpu_collective_call_terminate_timeout_seconds=900"
                              " --xla_cpu_collective_call_warn_stuck_timeout_seconds=120")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from ejax.config.runtime import enable_compilation_cache  # noqa: E402

nnx.use_eager_sharding(False)
# ejax names its mesh wherever it places or constrains (NamedSharding, shard_map(mesh=...)) and never
# enters one with `with mesh:`, which jax 0.12 deprecates: any use of that form fails the suite.
jax.config.update("jax_disallow_mesh_context_manager", True)
# Many tests compile the same small programs (a train step per mesh, say): compile each once per
# session, in a fresh directory that the session's first process (xdist's controller, or the only
# one) makes and its workers inherit, so both share it (entries are read and written under a file
# lock, ejax.config.runtime). A cache kept across sessions in the system's temp directory once
# held an entry that aborted the process when run (CI died mid-suite, exit 134, and a stale local
# cache did the same until cleared; entries were then written without a lock);
# EJAX_TEST_XLA_CACHE=DIR keeps one across sessions on purpose.
_session_cache = os.environ.get("EJAX_TEST_XLA_CACHE") or os.environ.get("EJAX_TEST_SESSION_XLA_CACHE")
if not _session_cache:
  _session_cache = os.environ["EJAX_TEST_SESSION_XLA_CACHE"] = tempfile.mkdtemp(prefix="ejax-test-xla-")
  atexit.register(shutil.rmtree, _session_cache, ignore_errors=True)
enable_compilation_cache(_session_cache, 0.5)


# `-n 2 --dist loadfile` (README) runs each file whole on one worker and, with pyproject's
# --no-loadscope-reorder, hands the files out in the order collected. The longest files (seconds each
# took in CI on 2 cores, 2026-11-30 and 2026-12-01) go first, so that the short ones fill in at the end and no long
# file is left running on one worker while the other has nothing to do.
LONGEST_FILES = (
    "tests/test_gpu_script.py",                  # 235-395
    "tests/test_colab.py",                       # 80-200
    "tests/train/test_watchdog.py",              # 110-125
    "tests/serve/test_checkpoint_kinds.py",      # 40-140
    "tests/models/test_pi05.py",                 # 60-115
    "tests/train/test_step.py",                  # 60-140
    "tests/parallel/test_shard_local.py",        # 55-135
    "tests/kernels/test_attention.py",           # 45-125
    "tests/test_startup.py",                     # 60-120
    "tests/eval/test_closed_loop.py",            # 95
    "tests/train/test_frozen_fp8.py",            # 70-90
    "tests/train/test_resume_checks.py",         # 50-90
    "tests/models/test_perception_upgrade.py",   # 55-110
    "tests/serve/test_server.py",                # 60-80
    "tests/rl/test_vla_pi05.py",                 # 100
    "tests/models/test_dreamzero_policy.py",     # 50-90
    "tests/sim/test_envs.py",                    # 65-100
    "tests/rl/test_runner.py",                   # 55
    "tests/train/test_sharded_training.py",      # 35-75
)


def pytest_collection_modifyitems(items):
  """The files in LONGEST_FILES first, in its order; the rest after them as collected. The sort is
  stable, so a file's tests stay together and in order."""
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(autouse=True)
def _optimised_compiles(request, monkeypatch):
  """An `optimised` test's programs, and its subprocesses', compile with XLA's optimisations on."""
  if request.node.get_closest_marker("optimised") is None:
    yield
    return
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "false")
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture
def tmp_workdir(tmp_path):
  path = tmp_path / "workdir"
  path.mkdir()
  return path


@pytest.fixture(scope="session")
def groot_sft_checkpoint(tmp_path_factory):
  """One small GR00T checkpoint of the train job, shared by the RL-actor and serve tests (each made
  its own before, ~75 s apiece on 2 cores); tests/train/helpers.py: SFT_* says what it holds."""
  from tests.train.helpers import SFT_IMAGE_SIZE, SFT_MAX_ACTION_DIM, SFT_TASK, groot_sim_checkpoint
  return groot_sim_checkpoint(tmp_path_factory.mktemp("groot_sft"), task=SFT_TASK, image_size=SFT_IMAGE_SIZE,
                              max_action_dim=SFT_MAX_ACTION_DIM)
