"""The trainer's input: process-local batches from the configured source, as global arrays."""

from __future__ import annotations

from typing import Any

import jax
from ml_collections import ConfigDict

from ejax.errors import UserError
from ejax.models.registry import get_model_spec

SOURCES = ("synthetic", "lerobot", "rlds")


def make_input(config: ConfigDict, *, local_batch_size: int) -> Any:
  """An iterator of process-local numpy batches with get_state()/set_state() for checkpoints."""
  data = config.data
  name = data.get("name", "synthetic")
  spec = get_model_spec(config.model.name)
  # The model's input assembly (tokenisation, packing); None stacks the per-sample fields.
  collate = spec.make_collate(config.model, data) if spec.make_collate else None
  if name == "synthetic":
    from ejax.data import synthetic
    return synthetic.make_iterator(config.model, data, batch_size=local_batch_size, seed=config.seed,
                                   process_index=jax.process_index(), process_count=jax.process_count(),
                                   collate=collate)
  if name in ("lerobot", "rlds"):
    from ejax.data import pipeline
    return pipeline.build_pipeline(data, batch_size=local_batch_size, seed=config.seed,
                                   process_index=jax.process_index(), process_count=jax.process_count(),
                                   collate=collate)
  raise UserError(f"unknown data source config.data.name={name!r}: use one of {', '.join(SOURCES)}")
