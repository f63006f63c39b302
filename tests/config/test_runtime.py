"""The persistent compilation cache ejax turns on (ejax.config.runtime)."""

import subprocess
import sys

from ejax.config.runtime import host_cpu_tag
from tests.train.helpers import REPO

_COMPILE = """
import sys
import jax, jax.numpy as jnp
from ejax.config.runtime import enable_compilation_cache
events = []
jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
assert enable_compilation_cache(sys.argv[1])
jax.jit(lambda x: jnp.sin(x) * 3).lower(jnp.ones(4)).compile()
print("cache hits", sum(event.endswith("/compilation_cache/cache_hits") for event in events))
"""


def test_entries_are_written_under_a_file_lock_and_read_by_the_next_process(tmp_path):
  """Two processes sharing the directory (two runs on one machine, a process a GPU) read and write each
  entry under jax's file lock, so neither reads one the other is still writing."""
  cache = tmp_path / "xla"
  run = lambda: subprocess.run([sys.executable, "-c", _COMPILE, str(cache)], cwd=REPO, capture_output=True,
                               text=True, timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
  first = run()
  assert first.returncode == 0, first.stderr[-2000:]
  assert "cache hits 0" in first.stdout, first.stdout
  # On CPUs the entries go in a directory of this kind of host CPU (host_cpu_tag).
  assert [p.name for p in cache.iterdir()] == [host_cpu_tag()]
  entries = sorted(p.name for p in (cache / host_cpu_tag()).iterdir())
  assert ".lockfile" in entries, entries
  written = [p for p in (cache / host_cpu_tag()).iterdir() if p.name.endswith("-cache")]
  assert written, entries
  stamps = {p: p.stat().st_mtime_ns for p in written}
  second = run()
  assert second.returncode == 0, second.stderr[-2000:]
  # The second process loaded the entry (not rewritten), its use stamped for the least-recently-used bound.
  assert int(second.stdout.split("cache hits")[1]) >= 1, second.stdout
  assert {p: p.stat().st_mtime_ns for p in written} == stamps
  assert any(p.name.endswith("-atime") for p in (cache / host_cpu_tag()).iterdir())


def test_each_kind_of_host_cpu_has_its_own_directory():
  """XLA:CPU builds for the host's instruction set and the cache key leaves it out: a home directory
  shared by a cluster's nodes must not hand one CPU's programs to another."""
  info = lambda flags, name="Xeon": "".join(f"processor\t: {i}\nmodel name\t: {name}\nflags\t\t: {flags}\n\n"
                                          for i in range(2))
  tag = host_cpu_tag(info("fpu sse avx avx2"))
  assert tag.startswith("cpu-") and tag == host_cpu_tag(info("fpu sse avx avx2"))
  assert tag != host_cpu_tag(info("fpu sse avx avx2 avx512f"))
  assert tag != host_cpu_tag(info("fpu sse avx avx2", name="EPYC"))
  assert host_cpu_tag() == host_cpu_tag(open("/proc/cpuinfo").read())
