"""Process-wide JAX settings a job applies before it compiles anything."""

from __future__ import annotations

import os

import jax
from absl import logging


def enable_compilation_cache(directory: str | None, min_compile_seconds: float = 0.0) -> None:
  """Persists compiled programs so a resumed or repeated run compiles nothing: its step and every
  small program (by default whatever the compile time).

  Programs are keyed by their HLO, compile options and the jax/XLA version, so a stale entry can
  never be used for a different program. An empty directory disables the cache.
  """
  if not directory:
    return
  directory = os.path.expanduser(directory)
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as error:
    logging.warning("compilation cache %s unusable (%s): compiling without it", directory, error)
    return
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
