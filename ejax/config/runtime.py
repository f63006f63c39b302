"""Process-wide JAX settings a job applies before it compiles anything."""

from __future__ import annotations

import os

import jax
from absl import logging

# Why a multi-process run on CPUs compiles without the persistent cache (README, "Multi-host"):
# - every process must run the same executable: jaxlib derives each launch's id, which XLA:CPU uses
#   as the run id that its cross-process (gloo) collectives meet under, from the executable's
#   fingerprint, a hash of its HLO *with* its debug metadata (source files, stack frames);
# - the cache key leaves that metadata out, so an entry written by an earlier launch loads with that
#   launch's metadata and another fingerprint than a fresh compile of the same program;
# - on CPUs the key also holds the process's own view of the topology, and only process 0 writes:
#   process 1 never finds an entry, so every warm launch has process 0 loading and process 1
#   compiling -> two launch ids -> a collective that never meets (a hang, or gloo's 30 s
#   "GetKeyValue() timed out with key: cpu:gloo/..." when its context is new).
# The cache cannot shorten such a start anyway (the processes wait for the one that compiles).
# GPUs and TPUs key entries the same on every process; there a mixed start (a cache dir local to
# each host) is caught by ejax.parallel.distributed.compile_agreed.
MULTI_PROCESS_CPU_NOTE = ("persistent compilation cache off: a multi-process CPU run would load process 0's "
                          "program from it and compile process 1's, which then never meet in a collective "
                          "(README, Multi-host)")


# The cache's bound in bytes. A bound (not jax's default, none) also turns on jax's file lock around
# each entry's read and write: without it an entry is written in place, so a second process sharing
# the directory (two runs on one machine, a process a GPU, two test workers) can read it half written.
CACHE_MAX_BYTES = 16 * 2**30


def host_cpu_tag(cpuinfo: str | None = None) -> str:
  """'cpu-' and a hash of this host's CPU model and instruction-set flags (/proc/cpuinfo's first
  processor). XLA:CPU builds for the host's features and its cache key leaves them out: an entry built
  on another CPU (a home directory shared across a cluster's nodes, or a machine moved) loads with an
  error line a program ("Target machine feature ... is not supported on the host machine"), and one
  that needs an instruction the host lacks would crash it. Each kind of CPU gets its own directory."""
  import hashlib
  import platform
  if cpuinfo is None:
    try:
      with open("/proc/cpuinfo") as file:
        cpuinfo = file.read()
    except OSError:
      cpuinfo = ""
  first = cpuinfo.split("\n\n")[0]
  keep = [line.split(":", 1)[1].strip() for line in first.splitlines()
          if line.split(":", 1)[0].strip() in ("model name", "flags", "Features", "CPU part")]
  text = "\n".join([platform.machine()] + keep) if keep else platform.machine() + platform.processor()
  return "cpu-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def enable_compilation_cache(directory: str | None, min_compile_seconds: float = 0.0,
                             max_bytes: int = CACHE_MAX_BYTES) -> bool:
  """Persists compiled programs so a resumed or repeated run compiles nothing: its step and every
  small program (by default whatever the compile time). Returns whether the cache is on.

  Programs are keyed by their HLO, compile options and the jax/XLA version, so a stale entry can
  never be used for a different program. Entries are read and written under a file lock, the least
  recently used evicted beyond `max_bytes`. An empty directory disables the cache, and so does a
  multi-process run on CPUs (see above). On CPUs the entries go in a subdirectory a kind of host CPU
  (host_cpu_tag). Call it after jax.distributed is initialised.
  """
  if jax.process_count() > 1 and jax.default_backend() == "cpu":
    # Also a cache that JAX_COMPILATION_CACHE_DIR turned on behind the config's back.
    jax.config.update("jax_enable_compilation_cache", False)
    if directory:
      logging.info(MULTI_PROCESS_CPU_NOTE)
    return False
  if not directory:
    return False
  directory = os.path.expanduser(directory)
  if jax.default_backend() == "cpu":
    directory = os.path.join(directory, host_cpu_tag())
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as error:
    logging.warning("compilation cache %s unusable (%s): compiling without it", directory, error)
    return False
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.config.update("jax_compilation_cache_max_size", max_bytes)
  return True
