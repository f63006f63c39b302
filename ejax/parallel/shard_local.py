"""Indexing inside a packed batch that stays on each device.

A packed batch's samples point at rows (and image slots) by index. XLA's SPMD partitioner cannot
know where a data-dependent index points, so it gathers the whole global operand onto every
device before it indexes: at 1,024 devices, GR00T's DiT cross-attention keys alone would be ~100 GB
per device. The trainer packs each device's share of samples into that device's own rows
(`ejax.data.packing.collate_per_shard`), so every index stays within its shard; these functions
index shard by shard under jax.shard_map when a sharding context is active, and plainly otherwise.

The indices are global (the batch's own `sample_rows`, `image_token_indices`); inside a shard the
shard's first global position is subtracted. A batch that is not packed per shard would read
clamped neighbours here: the trainer never feeds one (tests/parallel/test_shard_local.py).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from ejax.parallel.axes import ACT_BATCH
from ejax.parallel.rules import current_context, logical_to_spec


def _batch_axes(*leading_sizes: int):
  """(mesh, mesh axes of ACT_BATCH) when a context is active and they split every size, else None."""
  context = current_context()
  if context is None:
    return None
  mesh, rules = context
  specs = [logical_to_spec((ACT_BATCH,), rules, shape=(size,), mesh=mesh) for size in leading_sizes]
  axes = specs[0][0] if len(specs[0]) else None
  if axes is None or any((spec[0] if len(spec) else None) != axes for spec in specs):
    return None
  return mesh, axes


def batch_shards(*leading_sizes: int) -> int:
  """The devices arrays of these leading (batch) sizes are split over by the active sharding context,
  as take_rows splits them; 1 without a context or where the split does not divide every size."""
  sharded = _batch_axes(*leading_sizes)
  if sharded is None:
    return 1
  mesh, axes = sharded
  return math.prod(mesh.shape[name] for name in ((axes,) if isinstance(axes, str) else axes))


def _shard_start(axes, local_size: int) -> jax.Array:
  return jax.lax.axis_index(axes) * local_size


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """x[index] along x's leading (batch) axis; index [m, ...] holds global positions that lie in
  the shard of its own leading position."""
  sharded = _batch_axes(x.shape[0], index.shape[0])
  if sharded is None:
    return x[index]
  mesh, axes = sharded

  def local(x, index):
    return x.at[index - _shard_start(axes, x.shape[0])].get(mode="clip")

  return jax.shard_map(local, mesh=mesh, in_specs=(P(axes), P(axes)), out_specs=P(axes))(x, index)


def set_rows(x: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
  """x.at[index].set(values) along x's leading (batch) axis, shard by shard (see take_rows)."""
  sharded = _batch_axes(x.shape[0], index.shape[0], values.shape[0])
  if sharded is None:
    return x.at[index].set(values)
  mesh, axes = sharded

  def local(x, index, values):
    return x.at[index - _shard_start(axes, x.shape[0])].set(values, mode="drop")

  return jax.shard_map(local, mesh=mesh, in_specs=(P(axes), P(axes), P(axes)), out_specs=P(axes))(x, index, values)
