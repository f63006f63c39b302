"""Keeps a plain run's console to what the user needs: libraries' start-up chatter that reads as
failure ("Failed to import warp", "Unable to initialize backend 'tpu'", XLA:CPU's cache-loading
errors) is dropped or kept out of sight; their real warnings and errors stay.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import io
import logging as py_logging
import os
import sys

from absl import logging

# Libraries that log every file they touch at INFO: their warnings stay, the chatter goes.
_CHATTY = ("orbax", "grain", "tensorstore", "etils")


def accelerator_plugins_installed() -> bool:
  """Whether jax could find a GPU or TPU here (a plugin package or libtpu), without importing jax."""
  if importlib.util.find_spec("libtpu") is not None:
    return True
  try:
    if list(importlib.metadata.entry_points(group="jax_plugins")):
      return True
  except Exception:  # noqa: BLE001 (broken metadata: assume nothing)
    pass
  return any(importlib.util.find_spec(name) is not None
             for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin"))


def quiet_xla_cpu_logs() -> None:
  """On a CPU-only install, XLA's C++ log lines are left out (unless TF_CPP_MIN_LOG_LEVEL is set).

  With the persistent compilation cache every cached program loads with an error-level line that
  its machine features ("+prefer-no-gather") do not match, though it loads and runs correctly
  (openxla/xla#44565); nothing XLA:CPU reports there is otherwise missed, as its failures raise.
  Must run before jax is imported. Set TF_CPP_MIN_LOG_LEVEL=0 to see every line.
  """
  if "TF_CPP_MIN_LOG_LEVEL" in os.environ or "jaxlib" in sys.modules:
    return
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms.strip().lower() == "cpu" or (not platforms and not accelerator_plugins_installed()):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"


def quiet_library_logs() -> None:
  """Filters absl's handler (installed by app.run): chatty libraries' INFO lines, and jax's INFO line
  for each accelerator backend it probes and does not find."""
  def keep(record: py_logging.LogRecord) -> bool:
    if record.levelno >= py_logging.WARNING:
      return True
    if any(name in record.pathname for name in _CHATTY):
      return False
    return not (record.pathname.endswith("xla_bridge.py") and
                record.getMessage().startswith("Unable to initialize backend"))
  logging.get_absl_handler().addFilter(keep)


class _QuietOptionalImport(importlib.abc.MetaPathFinder):
  """MuJoCo's `mujoco.mjx.warp` prints "Failed to import warp: No module named 'warp'" (twice) on
  every import where the optional GPU package is not installed. That import's missing-module lines
  are logged at DEBUG; anything else it prints is passed on."""

  MODULE = "mujoco.mjx.warp"

  def find_spec(self, name, path, target=None):
    if name != self.MODULE:
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
      return spec
    execute = spec.loader.exec_module

    def exec_module(module):
      printed = io.StringIO()
      with contextlib.redirect_stdout(printed):
        execute(module)
      for line in printed.getvalue().splitlines():
        if "No module named" in line:
          logging.debug("%s: %s", name, line)
        else:
          print(line)

    spec.loader.exec_module = exec_module
    return spec


def quiet_optional_imports() -> None:
  if not any(isinstance(finder, _QuietOptionalImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _QuietOptionalImport())
