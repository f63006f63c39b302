"""Normalisation statistics: one parallel pass over the numeric columns, never the videos.

openpi users wait a long time for norm stats because its pass decodes every frame's images. Here
the state and action columns are read straight from parquet (files in parallel threads; pyarrow
releases the GIL) and reduced with vectorised numpy: exact mean / std / min / max and exact
quantiles q01..q99. The job writes them in LeRobot's stats.json format:

  python -m ejax.main --config=configs/X.py --config.job=stats  ->  <workdir>/stats.json
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from ejax.data import lerobot_format as fmt
from ejax.data import stats_math
from ejax.errors import MissingFileError


def normalized_keys(source) -> list[str]:
  """The columns the pipeline normalises: state, action and any auxiliary vectors the source reads."""
  return [getattr(source, "state_key", "observation.state"), getattr(source, "action_key", "action"),
          *getattr(source, "aux_keys", ())]


def compute_stats(source) -> dict[str, dict[str, np.ndarray]]:
  """Exact statistics of the state and action columns over every step of `source`."""
  columns = source.columns()
  stats = {}
  for key in normalized_keys(source):
    values = columns[key].reshape(len(columns[key]), -1)
    # Frames holding NaN / inf are skipped by the reader (data.on_bad_sample=skip): leave them out.
    finite = np.isfinite(values).all(axis=1) if np.issubdtype(values.dtype, np.floating) else slice(None)
    stats[key] = stats_math.vector_stats(values[finite])
  return stats


def _all_finite(stats: dict[str, np.ndarray]) -> bool:
  return all(np.isfinite(np.asarray(value, np.float64)).all() for value in stats.values())


def load_stats(path: str) -> dict[str, dict[str, np.ndarray]]:
  return fmt.stats_from_json(fmt.read_json(path))


def save_stats(path: str, stats: dict[str, dict[str, np.ndarray]]) -> None:
  fmt.write_json(path, fmt.stats_to_json(stats))


def load_or_compute_stats(data_config, source) -> dict[str, dict[str, np.ndarray]]:
  """data.stats_path if set; else the dataset's own stats when they cover what the mode needs;
  else one pass over the data."""
  path = data_config.get("stats_path", None)
  if path:
    if not os.path.exists(path):
      raise MissingFileError(f"data.stats_path={path} does not exist: run the stats job first "
                              "or unset data.stats_path")
    return load_stats(path)
  needed = ("q01", "q99") if data_config.get("normalization", "mean_std") == "quantile" else (
      "mean", "std")
  stored = getattr(getattr(source, "meta", None), "stats", {}) or {}
  if all(key in stored and all(n in stored[key] for n in needed) for key in normalized_keys(source)):
    if all(_all_finite(stored[key]) for key in normalized_keys(source)):
      return {key: stored[key] for key in normalized_keys(source)}
    logging.warning("meta/stats.json holds NaN or inf (the dataset has non-finite frames): "
                    "computing the statistics over the finite frames instead")
  start = time.perf_counter()
  stats = compute_stats(source)
  logging.info("computed normalisation statistics over %d steps in %.2fs",
               int(stats[normalized_keys(source)[0]]["count"][0]), time.perf_counter() - start)
  return stats


def run_job(config, workdir: str) -> dict[str, Any]:
  """Job `stats`: computes and saves <workdir>/stats.json; returns the stats and timing."""
  from ejax.data.sources import make_source
  data_config = config.data.copy_and_resolve_references() if hasattr(
      config.data, "copy_and_resolve_references") else config.data
  source = make_source(data_config)
  start = time.perf_counter()
  stats = compute_stats(source)
  seconds = time.perf_counter() - start
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "stats.json")
  save_stats(path, stats)
  steps = int(stats[normalized_keys(source)[0]]["count"][0])
  logging.info("stats over %d steps in %.2fs -> %s (set data.stats_path to use them)", steps,
               seconds, path)
  print(f"normalisation statistics over {steps} steps in {seconds:.2f}s written to {path}")
  return {"path": path, "seconds": seconds, "steps": steps, "stats": stats}
