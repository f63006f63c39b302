"""AdamW with linear warmup + cosine decay and global-norm clipping, from config.train."""

from __future__ import annotations

import jax
import optax
from ml_collections import ConfigDict


def make_schedule(train: ConfigDict) -> optax.Schedule:
  warmup = int(round(train.warmup_fraction * train.steps))
  if not warmup:  # the same values; optax logs a warning-like line for a zero-step warmup
    return optax.cosine_decay_schedule(train.learning_rate, max(train.steps, 1), alpha=train.min_learning_rate_ratio)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else train.learning_rate,
      peak_value=train.learning_rate,
      warmup_steps=warmup,
      decay_steps=max(train.steps, warmup + 1),
      end_value=train.learning_rate * train.min_learning_rate_ratio)


def _decay_mask(params):
  # No weight decay on norms, biases and other vectors: only matrices (and embedding tables).
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(train: ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = make_schedule(train)
  parts = []
  if train.grad_clip_norm and train.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(train.grad_clip_norm))
  parts.append(optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=train.eps,
                           weight_decay=train.weight_decay, mask=_decay_mask))
  return optax.chain(*parts), schedule
