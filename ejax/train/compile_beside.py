"""The train step compiled in a worker thread while the main thread builds the state it will take.

XLA compiles outside the GIL, so a step lowered from the state's shapes (tracing stays in the main
thread) compiles beside the parameters' initialisation: the time to the first step is the longer of
the two instead of their sum (on an H200 on 2026-11-28, GR00T-N1.5's state took 12-15 s and its
step's compile 40-50 s). The compiled step is used only where the state that was built has the
shapes, dtypes, weak types and shardings the step was lowered for; otherwise `result` returns None
and the caller compiles from the state itself.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import jax

from ejax.checkpoint import abstract_target


def fits(state: Any, shapes: Any) -> bool:
  """Whether `state` is what a step lowered for `shapes` takes (a compiled jax program refuses others)."""
  leaves, tree = jax.tree.flatten(state)
  expected, expected_tree = jax.tree.flatten(shapes)
  if tree != expected_tree:
    return False
  for leaf, shape in zip(leaves, expected):
    if (leaf.shape != shape.shape or leaf.dtype != shape.dtype
        or bool(getattr(leaf, "weak_type", False)) != bool(shape.weak_type)):
      return False
    sharding = getattr(leaf, "sharding", None)
    if sharding is None or not sharding.is_equivalent_to(shape.sharding, len(shape.shape)):
      return False
  return True


class CompileBeside:
  """`jitted.lower(state shapes, batch)` here, its compile in a thread; `result(state)` joins it."""

  def __init__(self, jitted, abstract_state: Any, shardings: Any, batch: Any, compiler_options: dict):
    self._shapes = abstract_target(abstract_state, shardings)
    lowered = jitted.lower(self._shapes, batch)  # tracing holds the GIL: in the caller's thread
    self._outcome: dict[str, Any] = {}

    def compile_it():
      begun = time.perf_counter()
      try:
        self._outcome["compiled"] = lowered.compile(compiler_options)
      except BaseException as error:  # noqa: BLE001 (raised again in the caller's thread by result())
        self._outcome["error"] = error
      self._outcome["seconds"] = time.perf_counter() - begun

    # Not a daemon: an interpreter must not tear XLA down under a running compile. A launcher that
    # ends on an error or a signal leaves with os._exit (ejax.main, ejax.train.signals) instead.
    self._thread = threading.Thread(target=compile_it, name="ejax-compile-train-step")
    self._thread.start()

  @property
  def seconds(self) -> float:
    """The compile's own wall time (once result() has returned)."""
    return self._outcome.get("seconds", 0.0)

  def result(self, state: Any):
    """The compiled step once its compile ends (a compile error is raised here), or None where
    `state` is not what it was lowered for."""
    self._thread.join()
    if "error" in self._outcome:
      raise self._outcome["error"]
    return self._outcome["compiled"] if fits(state, self._shapes) else None
