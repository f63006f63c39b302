"""AdamW with linear warmup + cosine decay and global-norm clipping, from config.train."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
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
    parts.append(clip_by_global_norm(train.grad_clip_norm))
  parts.append(optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=train.eps,
                           weight_decay=train.weight_decay, mask=_decay_mask))
  compute_dtype = jnp.dtype(train.compute_dtype)
  if train.get("compute_copy") and compute_dtype != jnp.dtype(train.param_dtype):
    parts.append(keep_compute_copy(compute_dtype))
  return optax.chain(*parts), schedule


def global_norm(tree) -> jax.Array:
  """The L2 norm of all of a tree's leaves together, as optax.tree.norm, with one reduction per group of
  leaves of one shape and dtype (stacked, which XLA fuses into the reduction rather than copying): a
  model's hundreds of gradient leaves take a few dozen kernels where each took one or two of its own
  (GR00T-N1.5: ~430 launches, ~1 ms of an H200 step). The sum's order differs from optax's."""
  groups: dict = {}
  for leaf in jax.tree.leaves(tree):
    groups.setdefault((leaf.shape, jnp.dtype(leaf.dtype)), []).append(leaf)
  total = jnp.zeros((), jnp.float32)
  for leaves in groups.values():
    stacked = jnp.stack(leaves) if len(leaves) > 1 else leaves[0]
    total = total + jnp.sum(jnp.square(stacked.astype(jnp.float32)))
  return jnp.sqrt(total)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm over global_norm: updates scaled by max_norm / norm when the norm is
  max_norm or more, else left as they are."""

  def update(updates, state, params=None):
    del params
    norm = global_norm(updates)
    keep = norm < max_norm
    return jax.tree.map(lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


class ComputeCopy(NamedTuple):
  weights: Any  # the parameters as the last update left them, in the compute dtype


def cast_floats(tree, dtype):
  """The tree with its floating-point leaves cast to `dtype` (integer leaves as they are)."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def keep_compute_copy(dtype) -> optax.GradientTransformation:
  """Last in a chain: keeps the updated parameters cast to the compute dtype in its state, and passes
  the updates through. The step's forward reads this copy (compute_copy) instead of casting the fp32
  master weights every step: XLA writes it in the optimizer's own fusions, so a step reads each weight
  once in bf16 where it read it in fp32 and wrote it in bf16 (train.compute_copy). The same numbers:
  the copy is the cast the forward would make."""

  def init(params):
    return ComputeCopy(cast_floats(params, dtype))

  def update(updates, state, params):
    del state
    # The same params + updates as the step's own apply_updates: XLA computes it once for both.
    return updates, ComputeCopy(cast_floats(optax.apply_updates(params, updates), dtype))

  return optax.GradientTransformation(init, update)


def compute_copy(opt_state):
  """The compute-dtype copy of the parameters a chain ending in keep_compute_copy holds; else None."""
  if isinstance(opt_state, tuple) and opt_state and isinstance(opt_state[-1], ComputeCopy):
    return opt_state[-1].weights
  return None
