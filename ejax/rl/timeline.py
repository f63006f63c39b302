"""What each component did and when: busy intervals, waits, and the timeline plot.

Components (env shards, the inference server, the learner) record the intervals in which they were
busy; the summary turns them into busy fractions and the plot into one row per component, so the
overlap that asynchrony buys (or the idling a barrier causes) is visible at a glance.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np


class ActivityLog:
  """Thread-safe record of busy intervals and waits, on one monotonic clock started at creation."""

  def __init__(self):
    self._lock = threading.Lock()
    self.origin = time.perf_counter()
    self.intervals: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    self.waits: dict[str, list[float]] = collections.defaultdict(list)

  def now(self) -> float:
    return time.perf_counter() - self.origin

  def busy(self, component: str, start: float, end: float) -> None:
    with self._lock:
      self.intervals[component].append((start, end))

  def wait(self, name: str, seconds: float) -> None:
    with self._lock:
      self.waits[name].append(seconds)

  def busy_fractions(self, wall_seconds: float) -> dict[str, float]:
    with self._lock:
      return {component: sum(end - start for start, end in spans) / max(wall_seconds, 1e-9)
              for component, spans in self.intervals.items()}

  def wait_summary(self) -> dict[str, float]:
    with self._lock:
      summary = {}
      for name, values in self.waits.items():
        summary[f"wait/{name}/mean_s"] = float(np.mean(values)) if values else 0.0
        summary[f"wait/{name}/total_s"] = float(np.sum(values))
      return summary


def plot_timeline(log: ActivityLog, path: str, title: str = "RL-VLA3 timeline") -> None:
  """Writes a PNG with one row per component and a bar for every busy interval."""
  # A bare Figure renders headless (Agg) without switching the process-wide pyplot backend.
  from matplotlib.figure import Figure

  with log._lock:
    components = sorted(log.intervals, key=lambda name: (not name.startswith("env"), name))
    rows = [(name, list(log.intervals[name])) for name in components]
  figure = Figure(figsize=(12, 0.45 * len(rows) + 1.5))
  axes = figure.subplots()
  colors = {"env": "tab:green", "inference": "tab:blue", "learner": "tab:red"}
  for row, (name, spans) in enumerate(rows):
    color = next((value for prefix, value in colors.items() if name.startswith(prefix)), "tab:gray")
    axes.broken_barh([(start, end - start) for start, end in spans], (row - 0.4, 0.8), color=color)
  axes.set_yticks(range(len(rows)), [name for name, _ in rows])
  axes.invert_yaxis()
  axes.set_xlabel("wall-clock seconds")
  axes.set_title(title)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
