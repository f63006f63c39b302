"""The trainer's input: process-local batches from the configured source, as global arrays."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from ml_collections import ConfigDict

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


def _make_source(config: ConfigDict, *, local_batch_size: int, shards: int = 1) -> Any:
  data = config.data
  name = data.get("name", "synthetic")
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
