"""Test setup shared by every test: 8 fake CPU devices, eager sharding off, quiet logs."""

import os

# Before JAX initialises: 8 fake CPU devices so that sharding tests see a real mesh. The suite compiles
# more than it runs, so XLA:CPU's code is built at LLVM's optimisation level 1, not 2: compile-bound
# files take less CPU time (tests/train/test_frozen_fp8.py 102 -> 87 s) and MJX's rollouts run as fast
# (the 20-seed expert test 21 s at both). Level 0 compiled faster still (68 s) but ran those rollouts
# 5x slower (108 s) and rounded the device-built and traced inits 1 ulp apart (tests/train/test_state.py).
# Subprocesses (notebooks, benchmarks) inherit it; `python -m ejax.main` runs of tests/test_main.py's
# run_main do not.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=1")
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
