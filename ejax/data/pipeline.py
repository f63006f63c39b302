"""The grain input pipeline: step-level random access, per-process shards, workers, exact resume.

  source (LeRobot / RLDS, one sample per step)
    -> global shuffle of step indices (a fresh permutation every epoch, no shuffle buffer)
    -> this process's shard (every process_count-th position)
    -> read (bad samples raise, or are skipped and counted) -> augment + normalise (+ transform)
    -> batch (collate) -> multiprocess workers (grain mp_prefetch) or a prefetch thread

`build_pipeline(...)` returns a `DataPipeline`: `next()` gives a dict of numpy arrays (the process-
local batch); `get_state()` is JSON-serialisable and `set_state()` continues on the next unseen
sample. Every random choice is a function of (seed, position), so resume is exact.

config.data fields read here (and by `ejax.data.sources.make_source`, `transforms.make_sample_transform`):
  name                "lerobot" | "rlds"
  path                LeRobot dataset root, or the TFDS data_dir for rlds
  rlds_name, split    TFDS builder name ("name" or "name/config:version") and split ("train")
  rlds_state_field, rlds_instruction_field  observation field of the state ("state") and step
                      field of the instruction ("language_instruction")
  horizon             action chunk length (16)
  observation_offsets frame offsets of the observations ([0]: a single frame, no pad mask)
  cameras             camera keys (None: every video feature / every image in the RLDS steps)
  image_size          [height, width] the images come out at (None: as stored)
  state_key, action_key  "observation.state", "action"
  aux_state_key       a per-frame vector read and normalised beside the state (None), for a model's
                      training-only target (model.perception's estimate)
  aux_pixel_key       a per-frame vector read as it is (None): image keypoint labels (model.perception's
                      detectors)
  embodiment_id       integer id written into every sample (0), or a table robot_type -> id
                      looked up with info.json's robot_type (LeRobot)
  tolerance_s         video frame timestamp tolerance in seconds (1e-4)
  shuffle             global shuffle at step granularity (True)
  num_epochs          None: endless; else the iterator stops after that many passes
  num_workers         grain worker processes (0: in-process with a prefetch thread)
  prefetch            batches buffered per worker (or by the prefetch thread) (2)
  normalization       "mean_std" | "quantile" | "none"
  stats_path          stats.json to normalise with (None: the dataset's meta/stats.json, else
                      computed in one pass at start-up)
  augment             crop_scale (1.0 = off), brightness, contrast, saturation (0.0 = off)
  on_bad_sample       "error" | "skip" (skip: count, log, drop the sample)
  skip_limit          bad samples in a row after which "skip" stops the run (100)
  max_open_videos     mp4 containers each reading thread keeps open (32)
  read_threads        threads reading samples in each worker (0: the worker itself reads, the
                      fewest CPU cycles per sample; parallelism comes from num_workers)
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import sys
import weakref
from typing import Any, Callable

import numpy as np

from ejax.data import stats as stats_lib
from ejax.data.sources import make_source
from ejax.data import transforms

_INDEX_ROUNDS = 4  # Feistel rounds of grain's index_shuffle, as grain's own shuffle uses


def _quiet_grain_import():
  """Imports grain without its jaxlib-version profiling warning (noise on every import)."""
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)
  try:
    import grain
  finally:
    absl_logger.setLevel(level)
  return grain


class _ShuffledShard:
  """Position j of process p -> a source index: epoch-wise permutation, strided by process.

  Each epoch's permutation is a function of (seed, epoch) alone, the same on every process;
  process p takes positions p, p + P, ... of it, so shards are disjoint and equal-sized (the last
  len % P steps of each epoch are dropped). Up to MAX_CACHED_PERMUTATION steps the permutation is
  materialised once per epoch (a lookup per sample); larger datasets use grain's index_shuffle,
  which needs no memory but costs ~0.2 ms per sample.
  """

  MAX_CACHED_PERMUTATION = 1 << 25  # 32M steps: 128 MiB of uint32 per worker

  def __init__(self, num_samples: int, *, seed: int, shuffle: bool, process_index: int,
               process_count: int, num_epochs: int | None):
    self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
    self.process_index, self.process_count = process_index, process_count
    self.per_epoch = num_samples // process_count
    if self.per_epoch == 0:
      raise ValueError(f"{num_samples} samples cannot be shared by {process_count} processes")
    self.length = sys.maxsize if num_epochs is None else self.per_epoch * int(num_epochs)
    self._permutation: tuple[int, np.ndarray] | None = None  # (epoch, permutation)

  def __getstate__(self):
    return {**self.__dict__, "_permutation": None}

  def _shuffled(self, global_position: int, epoch: int) -> int:
    if self.num_samples > self.MAX_CACHED_PERMUTATION:
      from grain.experimental import index_shuffle
      return index_shuffle(global_position, max_index=self.num_samples - 1,
                           seed=(self.seed + epoch) % 2 ** 32, rounds=_INDEX_ROUNDS)
    if self._permutation is None or self._permutation[0] != epoch:
      rng = np.random.default_rng([self.seed, epoch])
      self._permutation = (epoch, rng.permutation(self.num_samples).astype(np.uint32))
    return int(self._permutation[1][global_position])

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, position: int) -> int:
    if not 0 <= position < self.length:
      raise IndexError(position)
    epoch, offset = divmod(int(position), self.per_epoch)
    global_position = offset * self.process_count + self.process_index
    return self._shuffled(global_position, epoch) if self.shuffle else global_position


def default_collate(samples: list[dict[str, Any]]) -> dict[str, np.ndarray]:
  """Stacks every key; strings become a numpy unicode array."""
  return {key: np.stack([np.asarray(s[key]) for s in samples]) for key in samples[0]}


class _ReadSample:
  """Picklable `position -> sample` (grain sends it to each worker, which opens its own files)."""

  def __init__(self, source, shard: _ShuffledShard):
    self.source, self.shard = source, shard

  def __call__(self, position: int):
    return self.source[self.shard[position]]


class _Transform:
  """Picklable augment + normalise, then derived fields, then the caller's transform."""

  def __init__(self, sample_transform, derive, user_transform):
    self.sample_transform, self.derive = sample_transform, derive
    self.user_transform = user_transform

  def __call__(self, sample, rng):
    sample = self.sample_transform(sample, rng)
    if self.derive is not None:
      sample = self.derive(sample)  # e.g. modality.json slices of the normalised vectors
    return self.user_transform(sample) if self.user_transform is not None else sample


class DataPipeline:
  """Iterator of process-local batches with JSON-serialisable, exact get_state / set_state."""

  def __init__(self, dataset, *, source, normalizer: transforms.Normalizer | None,
               norm_stats: dict[str, dict[str, np.ndarray]]):
    self._dataset = dataset
    self._iterator = iter(dataset)
    self.source, self.normalizer, self.norm_stats = source, normalizer, norm_stats
    _LIVE_PIPELINES.add(self)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._iterator)
    # Worker batches arrive as shared-memory arrays that unlink when freed; copy them into plain
    # arrays now so no caller holds a view of memory grain frees, and none outlives the process.
    return {key: np.array(value) if type(value) is not np.ndarray and isinstance(
        value, np.ndarray) else value for key, value in batch.items()}

  def get_state(self) -> dict[str, Any]:
    # A JSON round trip turns grain's tuples and numpy scalars into plain types now, so what the
    # checkpoint stores is exactly what set_state will see.
    return json.loads(json.dumps(self._iterator.get_state(), default=_json_default))

  def set_state(self, state: dict[str, Any]) -> None:
    self._iterator.set_state(state)

  def close(self) -> None:
    """Stops the workers and frees their shared memory.

    Also runs at interpreter exit for pipelines nobody closed: grain's iterators close again in
    `__del__`, which prints tracebacks if that happens while modules are being torn down.
    """
    if self._iterator is None:
      return
    self._iterator.close()
    self._iterator = None
    self._dataset = None
    # Run the grain iterators' __del__ now, while their modules still exist. Open mp4s are not
    # closed here: grain's reader threads may still be decoding; they close when freed.
    gc.collect()

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


_LIVE_PIPELINES: "weakref.WeakSet[DataPipeline]" = weakref.WeakSet()
_EXIT_HOOK_REGISTERED = False


def _close_live_pipelines() -> None:
  for pipeline in list(_LIVE_PIPELINES):
    pipeline.close()


def _register_exit_hook() -> None:
  """Closes unclosed pipelines at exit before multiprocessing's own exit handler runs.

  atexit runs hooks last-in first-out; registering after multiprocessing.util (whose handler
  finalises grain's workers without unlinking their in-flight shared memory) puts ours first.
  """
  global _EXIT_HOOK_REGISTERED
  if not _EXIT_HOOK_REGISTERED:
    import multiprocessing.util  # noqa: F401 (its atexit hook must be registered before ours)
    atexit.register(_close_live_pipelines)
    _EXIT_HOOK_REGISTERED = True


def _json_default(value):
  if isinstance(value, np.generic):
    return value.item()
  raise TypeError(f"grain iterator state holds a {type(value).__name__}, not JSON-serialisable")


def _ensure_absl_flags_parsed() -> None:
  # grain's workers read absl flags; outside `app.run` (tests, notebooks) they are unparsed.
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def build_pipeline(data_config, *, batch_size: int, seed: int, process_index: int = 0,
                   process_count: int = 1, transform: Callable[[dict], dict] | None = None,
                   collate: Callable[[list[dict]], dict] | None = None) -> DataPipeline:
  """The process-local input pipeline described in the module docstring."""
  grain = _quiet_grain_import()
  _register_exit_hook()
  source = make_source(data_config)
  mode = data_config.get("normalization", "mean_std")
  keys = stats_lib.normalized_keys(source)
  norm_stats = stats_lib.load_or_compute_stats(data_config, source) if mode != "none" else {}
  normalizer = transforms.Normalizer(norm_stats, mode, keys) if mode != "none" else None
  sample_transform = transforms.make_sample_transform(
      data_config, normalizer, image_keys=list(getattr(source, "cameras", [])))
  num_epochs = data_config.get("num_epochs", None)
  shard = _ShuffledShard(len(source), seed=seed, shuffle=bool(data_config.get("shuffle", True)),
                         process_index=process_index, process_count=process_count,
                         num_epochs=num_epochs)
  dataset = grain.MapDataset.source(_Positions(len(shard))).map(_ReadSample(source, shard))
  dataset = dataset.filter(_is_sample)
  derive = getattr(source, "add_modality_slices", None)
  dataset = dataset.random_map(_Transform(sample_transform, derive, transform), seed=seed)
  read_threads = int(data_config.get("read_threads", 0))
  iter_dataset = dataset.to_iter_dataset(grain.ReadOptions(
      num_threads=read_threads, prefetch_buffer_size=max(2 * batch_size, read_threads))).batch(
      batch_size, drop_remainder=True, batch_fn=collate or default_collate)
  num_workers = int(data_config.get("num_workers", 0))
  prefetch = int(data_config.get("prefetch", 2))
  if num_workers > 0:
    _ensure_absl_flags_parsed()
    iter_dataset = iter_dataset.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=num_workers, per_worker_buffer_size=prefetch))
  elif prefetch > 0:
    iter_dataset = grain.experimental.ThreadPrefetchIterDataset(
        iter_dataset, prefetch_buffer_size=prefetch)
  return DataPipeline(iter_dataset, source=source, normalizer=normalizer, norm_stats=norm_stats)


def _is_sample(sample) -> bool:
  return sample is not None  # None: a bad sample skipped under on_bad_sample="skip"


class _Positions:
  """0, 1, 2, ...: a lazy range that may be sys.maxsize long (an endless pipeline)."""

  def __init__(self, length: int):
    self.length = length

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, position: int) -> int:
    return int(position)
