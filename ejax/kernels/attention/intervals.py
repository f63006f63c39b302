"""ejax's mask as per-query key ranges and per-row segment offsets: the inputs of external kernels.

tokamax's Mosaic GPU kernel takes, for each query, one range of keys [k_start, k_end) and skips the
kv blocks outside it; cuDNN's packed layout takes per-row segment offsets and lengths. ejax's mask
(reference.py) has that form when the rows are packed: each segment's keys are contiguous in the row
(padding, segment id 0, may lie anywhere outside them) and, for ordered masks, the order keys never
decrease along a segment. Then query i of segment s attends the keys of s from its first one up to
the last whose order key is <= i's: one range.

Whether a batch has that layout is data, known only on device, so every function here returns a
traced `valid` flag beside its arrays; routes.py runs the external kernel under `lax.cond(valid, ...)`
with ejax's own kernel as the other branch, and every impl gives reference.py's answer on any input.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ejax.kernels.attention.tiles import MaskInputs


class KeyRanges(NamedTuple):
  """Per query [batch, q_len] int32: the allowed keys are k_start <= j < k_end (empty: has_keys False)."""
  k_start: jax.Array
  k_end: jax.Array
  has_keys: jax.Array
  valid: jax.Array  # scalar bool: the mask is exactly these ranges


def _segment_table(kv_segment_ids):
  """Per segment id (0..kv_len) of one row: first index, last index, token count; and a check."""
  kv_len = kv_segment_ids.shape[0]
  index = jnp.arange(kv_len, dtype=jnp.int32)
  in_table = (kv_segment_ids >= 0) & (kv_segment_ids <= kv_len)
  ids = jnp.where(in_table, kv_segment_ids, 0)
  first = jax.ops.segment_min(index, ids, num_segments=kv_len + 1)
  last = jax.ops.segment_max(index, ids, num_segments=kv_len + 1)
  count = jax.ops.segment_sum(jnp.ones_like(index), ids, num_segments=kv_len + 1)
  contiguous = (count == 0) | (last - first + 1 == count)
  contiguous = contiguous.at[0].set(True)  # padding may lie anywhere
  return first, last, count, jnp.all(in_table) & jnp.all(contiguous)


def _row_ranges(q_segment_ids, kv_segment_ids, q_keys, kv_keys, ordered: bool):
  kv_len = kv_segment_ids.shape[0]
  first, last, count, valid = _segment_table(kv_segment_ids)
  valid &= jnp.all((q_segment_ids >= 0) & (q_segment_ids <= kv_len))
  segment = jnp.clip(q_segment_ids, 0, kv_len)
  present = (q_segment_ids != 0) & (count[segment] > 0)
  start = jnp.where(present, first[segment], 0)
  end = jnp.where(present, last[segment] + 1, 0)
  if ordered:
    same = (kv_segment_ids[1:] == kv_segment_ids[:-1]) & (kv_segment_ids[1:] != 0)
    valid &= jnp.all(~same | (kv_keys[1:] >= kv_keys[:-1]))
    # Binary search in [start, end) for the first key whose order key exceeds the query's.
    low, high = start, end
    for _ in range(max(1, kv_len.bit_length())):
      middle = (low + high) // 2
      searching = low < high
      below = kv_keys[jnp.clip(middle, 0, kv_len - 1)] <= q_keys
      low = jnp.where(searching & below, middle + 1, low)
      high = jnp.where(searching & ~below, middle, high)
    end = low
  return start, end, end > start, valid


def key_ranges(mask: MaskInputs, ordered: bool) -> KeyRanges:
  """Each query's allowed keys as one range, for any q and kv layouts (cross-attention included)."""
  start, end, has_keys, valid = jax.vmap(_row_ranges, in_axes=(0, 0, 0, 0, None))(
      mask.q_segment_ids, mask.kv_segment_ids, mask.q_keys, mask.kv_keys, ordered)
  return KeyRanges(start, end, has_keys, jnp.all(valid))


class PackedSegments(NamedTuple):
  """cuDNN's packed layout of self-attention rows: per row up to `max_segments` segments.

  offsets [batch, max_segments + 1] (segment starts, then -1), lengths [batch, max_segments] (-1 pads),
  in_segment [batch, len] bool (the tokens some segment covers).
  """
  offsets: jax.Array
  lengths: jax.Array
  in_segment: jax.Array
  valid: jax.Array


def _row_segments(segment_ids, keys, max_segments: int, strictly_ordered: bool):
  length = segment_ids.shape[0]
  _, _, count, valid = _segment_table(segment_ids)
  previous = jnp.concatenate([jnp.zeros((1,), segment_ids.dtype), segment_ids[:-1]])
  starts_here = (segment_ids != 0) & (segment_ids != previous)
  valid &= jnp.sum(starts_here) <= max_segments
  (starts,) = jnp.nonzero(starts_here, size=max_segments, fill_value=-1)
  starts = starts.astype(jnp.int32)
  lengths = jnp.where(starts >= 0, count[segment_ids[jnp.maximum(starts, 0)]], -1)
  offsets = jnp.concatenate([starts, jnp.full((1,), -1, jnp.int32)])
  if strictly_ordered:
    # cuDNN's causal mask runs along the packed tokens: order keys must rise along each segment.
    same = (segment_ids[1:] == segment_ids[:-1]) & (segment_ids[1:] != 0)
    valid &= jnp.all(~same | (keys[1:] > keys[:-1]))
  del length
  return offsets, lengths, segment_ids != 0, valid


def packed_segments(mask: MaskInputs, ordered: bool, max_segments: int) -> PackedSegments:
  """The packed layout of self-attention rows (q and kv share segment ids and order keys)."""
  same_layout = jnp.all(mask.q_segment_ids == mask.kv_segment_ids)
  if ordered:
    same_layout &= jnp.all(mask.q_keys == mask.kv_keys)
  offsets, lengths, in_segment, valid = jax.vmap(_row_segments, in_axes=(0, 0, None, None))(
      mask.q_segment_ids, mask.q_keys, max_segments, ordered)
  return PackedSegments(offsets, lengths, in_segment, jnp.all(valid) & same_layout)
