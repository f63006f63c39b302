"""Test setup shared by every test: 8 fake CPU devices, eager sharding off, quiet logs."""

import os

# Before JAX initialises: 8 fake CPU devices so that sharding tests see a real mesh.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from ejax.config.runtime import enable_compilation_cache  # noqa: E402

nnx.use_eager_sharding(False)
# Many tests compile the same small programs (a train step per mesh, say): compile each once.
enable_compilation_cache(os.environ.get("EJAX_TEST_XLA_CACHE", os.path.join(tempfile.gettempdir(), "ejax-test-xla-cache")), 0.5)


@pytest.fixture
def tmp_workdir(tmp_path):
  path = tmp_path / "workdir"
  path.mkdir()
  return path
