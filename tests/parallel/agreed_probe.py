"""One process of a two-process program with a cross-process sum, compiled with JAX's persistent
cache on (tests/parallel/test_compile_agreed.py). Usage: PROCESS PORT CACHE_DIR LAUNCH MODE

LAUNCH shifts the traced function's source lines, as an edited file or another entry point does
between two launches: the cache key leaves debug metadata out, so launch 1's process 0 loads
launch 0's entry while its process 1 (whose CPU cache key differs and which never writes) compiles.
MODE `plain` compiles with .compile() and prints the fingerprints; `agreed` goes through
ejax.parallel.distributed.compile_agreed and runs the sum.
"""

import os
import sys

process, port, cache, launch, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

jax.distributed.initialize(f"127.0.0.1:{port}", 2, process, initialization_timeout=60)
jax.config.update("jax_compilation_cache_dir", cache)  # on, as ejax's runtime.py would not on CPUs
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

from ejax.parallel.distributed import compile_agreed, executable_fingerprint  # noqa: E402

namespace = {}
exec(compile("\n" * launch + "def centred(x):\n  return x - x.sum()\n", "probe_program.py", "exec"), namespace)
mesh = jax.make_mesh((4,), ("d",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("d")),
                                           np.arange(2, dtype=np.float32) + 10 * process)
step = jax.jit(namespace["centred"], out_shardings=NamedSharding(mesh, PartitionSpec()))
if mode == "plain":
  print(f"fingerprint {executable_fingerprint(step.lower(x).compile())}", flush=True)
else:
  compiled = compile_agreed(lambda: step.lower(x), "probe")
  print(f"result {np.asarray(compiled(x).addressable_data(0)).tolist()}", flush=True)
