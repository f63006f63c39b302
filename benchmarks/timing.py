"""Timing a jitted call as a train step issues it: calls back to back, one wait a round."""

from __future__ import annotations

import statistics
import time

import jax


def back_to_back(fn, *args, repeats: int, calls: int) -> float:
  """Seconds a call: the median over `repeats` rounds of `calls` calls of fn(*args) issued back to back
  and waited for once (the next call's dispatch overlaps the device's work on the last). Warm-up is the
  caller's."""
  rounds = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      result = fn(*args)
    jax.block_until_ready(result)
    rounds.append((time.perf_counter() - start) / calls)
  return statistics.median(rounds)
