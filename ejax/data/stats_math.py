"""Per-feature statistics in LeRobot's format (min, max, mean, std, count, q01..q99) and merging.

Vectors get per-dimension statistics; images get per-channel statistics of values in [0, 1] with
shape [3, 1, 1], as LeRobot stores them.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}


def vector_stats(values: np.ndarray) -> dict[str, np.ndarray]:
  """Statistics over the leading axis of [N, ...] values."""
  values = np.asarray(values, np.float64)
  if values.ndim == 1:
    values = values[:, None]
  stats = {
      "min": values.min(axis=0), "max": values.max(axis=0), "mean": values.mean(axis=0),
      "std": values.std(axis=0), "count": np.asarray([values.shape[0]], np.int64),
  }
  quantiles = np.quantile(values, list(QUANTILES.values()), axis=0)
  for name, value in zip(QUANTILES, quantiles):
    stats[name] = value
  return stats


def image_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
  """Per-channel statistics of uint8 [T, H, W, 3] frames scaled to [0, 1], shaped [3, 1, 1]."""
  frames = np.asarray(frames)
  pixels = frames.reshape(-1, frames.shape[-1]).astype(np.float32) / 255.0  # [T*H*W, 3]
  stats = vector_stats(pixels)
  out = {name: value.reshape(-1, 1, 1) for name, value in stats.items() if name != "count"}
  out["count"] = np.asarray([frames.shape[0]], np.int64)
  return out


def merge_stats(parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """Merges statistics of disjoint parts: min/max/mean/std exactly, quantiles count-weighted.

  Count-weighted quantiles are an approximation (as LeRobot's own aggregation is); the `stats`
  job computes exact ones from the data.
  """
  counts = np.asarray([float(np.asarray(p["count"]).reshape(-1)[0]) for p in parts])
  weights = counts / counts.sum()

  def weighted(name):
    return sum(w * np.asarray(p[name], np.float64) for w, p in zip(weights, parts))

  mean = weighted("mean")
  second_moment = sum(w * (np.asarray(p["std"], np.float64) ** 2 + np.asarray(p["mean"]) ** 2)
                      for w, p in zip(weights, parts))
  merged = {
      "min": np.min([p["min"] for p in parts], axis=0),
      "max": np.max([p["max"] for p in parts], axis=0),
      "mean": mean,
      "std": np.sqrt(np.maximum(second_moment - mean ** 2, 0.0)),
      "count": np.asarray([int(counts.sum())], np.int64),
  }
  for name in QUANTILES:
    if all(name in p for p in parts):
      merged[name] = weighted(name)
  return merged
