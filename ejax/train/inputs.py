"""The trainer's input: process-local batches from the configured source, as global arrays."""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
from ml_collections import ConfigDict

from ejax.data import row_plan
from ejax.data.packing import collate_per_shard
from ejax.errors import UserError
from ejax.models.registry import get_model_spec

SOURCES = ("synthetic", "lerobot", "rlds", "sim_demos")


class StackedMicroBatches:
  """`count` consecutive batches stacked on a new leading axis: [count, ...] per field.

  Gradient accumulation scans over that axis. Each micro-batch is assembled on its own, so packed
  batches (rows, images and samples of different counts that index each other) stay consistent.
  """

  def __init__(self, iterator: Any, count: int):
    self.iterator, self.count = iterator, count

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    parts = [next(self.iterator) for _ in range(self.count)]
    return {k: np.stack([p[k] for p in parts]) for k, v in parts[0].items()
            if isinstance(v, np.ndarray) and v.dtype != object}

  def get_state(self):
    return self.iterator.get_state()

  def set_state(self, state) -> None:
    self.iterator.set_state(state)

  def __getattr__(self, name):  # norm_stats, close, ... of the wrapped pipeline
    return getattr(self.iterator, name)


def make_input(config: ConfigDict, *, local_batch_size: int, shards: int = 1) -> Any:
  """An iterator of process-local numpy batches with get_state()/set_state() for checkpoints.

  With train.grad_accum_steps = k > 1, each element holds k micro-batches stacked: [k, ...].
  `shards`: the devices this process's batch is split over; a packing model's collate packs each
  device's samples into its own rows (ejax.data.packing.collate_per_shard).
  """
  accum = config.train.grad_accum_steps
  if local_batch_size % accum:
    raise UserError(f"this process's batch of {local_batch_size} samples does not split into "
                    f"train.grad_accum_steps={accum} micro-batches: make the batch a multiple")
  iterator = _make_source(config, local_batch_size=local_batch_size // accum, shards=shards)
  return StackedMicroBatches(iterator, accum) if accum > 1 else iterator


def with_packing_plan(config: ConfigDict, *, local_batch_size: int, shards: int = 1) -> ConfigDict:
  """config with an auto packed row (model.packing.row_length = 0) chosen from the dataset's lengths.

  The lengths are the model collate's own token streams for the first `model.packing.probe_samples`
  samples of the run's shuffled order (the same samples on every process, so every process chooses
  the same row); the plan is for batches of a device's share (ejax.data.row_plan). Any other config
  is returned as it is.
  """
  model = config.model
  spec = get_model_spec(model.name)
  if "packing" not in model or not row_plan.is_auto(model.packing) or spec.make_collate is None:
    return config
  per_collate = max(1, local_batch_size // int(config.train.grad_accum_steps) // max(shards, 1))
  lengths = dataset_lengths(config, int(model.packing.get("probe_samples", row_plan.PROBE_SAMPLES)))
  try:
    resolved, plan = row_plan.resolve(model, lengths, samples_per_batch=per_collate)
  except ValueError as error:
    raise UserError(f"choosing the packed row from the dataset: {error}") from None
  logging.info("model.packing.row_length 0 (auto): %s", plan.describe())
  out = ConfigDict(config.to_dict())
  out.model = resolved
  return out


_PROBE_ROW = 1 << 16  # a row no sample fills: each probe sample is collated alone into one


def dataset_lengths(config: ConfigDict, count: int) -> np.ndarray:
  """Packed tokens of each of the first `count` samples the run reads, as the model's collate lays them
  out (the `*segment_ids` stream of its rows: GR00T's VL tokens, pi0.5's prefix)."""
  spec = get_model_spec(config.model.name)
  probe_model = ConfigDict(config.model.to_dict())
  probe_model.packing.update(row_length=_PROBE_ROW, samples_per_row=1)
  collate = spec.make_collate(probe_model, config.data)

  def length(sample: dict) -> dict:
    batch = collate([sample])
    streams = [v for k, v in batch.items() if k.endswith("segment_ids") and np.shape(v)[-1:] == (_PROBE_ROW,)]
    return {"length": np.int64(sum(int(np.count_nonzero(v)) for v in streams))}

  data = ConfigDict(config.data.to_dict())
  name = data.get("name", "synthetic")
  if name == "synthetic":
    from ejax.data import synthetic
    iterator = synthetic.make_iterator(config.model, data, batch_size=count, seed=config.seed, process_index=0,
                                       process_count=1, collate=lambda samples: {
                                           "length": np.asarray([length(s)["length"] for s in samples])})
    return np.asarray(next(iterator)["length"])
  if name not in ("lerobot", "rlds", "sim_demos"):
    raise UserError(f"unknown data source config.data.name={name!r}: use one of {', '.join(SOURCES)}")
  from ejax.data import pipeline
  # In this process, endless (a dataset shorter than `count` wraps), no augmentation's randomness matters.
  data.update(num_workers=0, prefetch=0, num_epochs=None)
  with pipeline.build_pipeline(data, batch_size=count, seed=config.seed, transform=length) as probe:
    return np.asarray(next(probe)["length"])


def _make_source(config: ConfigDict, *, local_batch_size: int, shards: int = 1) -> Any:
  data = config.data
  name = data.get("name", "synthetic")
  if data.get("encoder_cache", None):
    # Frozen-encoder outputs computed ahead by the encode job (ejax/train/encode.py), read instead of
    # the raw samples; the loop checks the cache against its frozen weights (check_frozen).
    from ejax.train.encode import open_cache
    return open_cache(config, batch_size=local_batch_size)
  spec = get_model_spec(config.model.name)
  # The model's input assembly (tokenisation, packing); None stacks the per-sample fields.
  collate = spec.make_collate(config.model, data) if spec.make_collate else None
  if collate is not None:
    collate = collate_per_shard(collate, shards)
  if name == "synthetic":
    from ejax.data import synthetic
    return synthetic.make_iterator(config.model, data, batch_size=local_batch_size, seed=config.seed,
                                   process_index=jax.process_index(), process_count=jax.process_count(),
                                   collate=collate)
  if name in ("lerobot", "rlds", "sim_demos"):
    from ejax.data import pipeline
    return pipeline.build_pipeline(data, batch_size=local_batch_size, seed=config.seed,
                                   process_index=jax.process_index(), process_count=jax.process_count(),
                                   collate=collate)
  raise UserError(f"unknown data source config.data.name={name!r}: use one of {', '.join(SOURCES)}")
