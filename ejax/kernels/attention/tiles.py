"""Shared preparation for the blockwise attention paths (XLA and Pallas).

Every blockwise implementation sees one normalised form of the mask (see reference.py):
- `segment ids` [batch, len] int32, 0 = padding (all ones when the caller gave none);
- an `order key` [batch, len] int32 with one rule, `q_key >= kv_key`, that covers both masks with
  an order: positions for "causal", block ids for "block_causal" (unused when bidirectional).
- for the "wam" mask, `groups` [batch, len] int32 beside the order keys (0 = the shared context): a pair
  also needs kv_group == 0 or kv_group == q_group (None for every other mask kind).
Sequences are padded with segment id 0 to a multiple of the block size, so padding never needs a
special case in a kernel.

Tile skipping: per block we keep the min/max segment id over its real tokens and the min/max order
key. A (q-block, kv-block) tile can hold an allowed pair only if the segment ranges overlap and, for
ordered masks, the largest q key reaches the smallest kv key. Active tiles are compacted into a list
per q-block (and per kv-block for the dK/dV pass), so a kernel loops over exactly the active tiles
and packed rows cost the sum of squared segment lengths, not the squared row length.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

_INT_MAX = 2**31 - 1
# Finite stand-in for -inf in masked scores: exp(MASKED - MASKED) stays defined for rows that have
# seen only masked scores so far, and the explicit `where(mask, ...)` zeroes their weights.
MASKED_SCORE = -1e30


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes: forward (block_q x block_kv) and both backward passes (block_q_bwd x block_kv_bwd).

  Powers of two, at least 16 (Triton's smallest dot). Smaller tiles skip more work at segment
  boundaries; larger tiles use the tensor cores better.
  """
  block_q: int = 64
  block_kv: int = 64
  block_q_bwd: int = 64
  block_kv_bwd: int = 64
  # Triton launch settings of the Pallas kernels (all three); None: pallas_gpu's per-head_dim choice.
  num_warps: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
      size = getattr(self, name)
      if size < 16 or size & (size - 1):
        raise ValueError(f"BlockSizes.{name}={size} must be a power of two >= 16")
    if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"BlockSizes.num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
    if self.num_stages is not None and self.num_stages < 1:
      raise ValueError(f"BlockSizes.num_stages={self.num_stages} must be >= 1")

  def fitted(self, q_len: int, kv_len: int) -> BlockSizes:
    """Shrinks blocks to the (power-of-two rounded) lengths so short sequences are not over-padded."""
    q_cap, kv_cap = max(16, next_power_of_2(q_len)), max(16, next_power_of_2(kv_len))
    return dataclasses.replace(self, block_q=min(self.block_q, q_cap), block_kv=min(self.block_kv, kv_cap),
                               block_q_bwd=min(self.block_q_bwd, q_cap),
                               block_kv_bwd=min(self.block_kv_bwd, kv_cap))

  @property
  def q_multiple(self) -> int:
    return max(self.block_q, self.block_q_bwd)

  @property
  def kv_multiple(self) -> int:
    return max(self.block_kv, self.block_kv_bwd)


GPU_BLOCK_SIZES = BlockSizes(64, 64, 64, 64)
# On CPU a tile is one XLA loop iteration on one thread: its matmuls run at ~55-65 GFLOP/s (of ~78
# peak on the shared AVX2 core) and the softmax passes cost about half as much again, so the loop
# overhead no longer dominates and smaller tiles win by skipping more masked pairs at segment
# boundaries. Measured 2026-11-21 on the packing benchmark's rows (4 batches of 2 x 3328 tokens,
# 4 heads x 32, block-causal, forward+backward per epoch, shared 2-core CPU at load ~3):
#   128x128 everywhere: 1.25-1.45 s (22.2M active pairs); 64x64: 0.85-0.95 s (19.1M);
#   32x32: 1.10-1.25 s (17.6M, tiles too small for the matmuls); 64x32: 0.95-1.2 s;
#   forward alone: 128x64 0.26-0.29 s, 64x128 0.26-0.29 s, 64x64 0.30-0.34 s, 128x128 0.37-0.40 s.
# Hence 128x64 forward tiles (wider q rows per matmul, same kv granularity) and 64x64 backward tiles.
CPU_BLOCK_SIZES = BlockSizes(128, 64, 64, 64)
# The xla path as the GPU fallback (shapes the Pallas kernel does not take) keeps the tiles it had
# before the CPU measurements above: a GPU pays far more per loop iteration than per tile, and
# smaller tiles there are unmeasured.
XLA_GPU_BLOCK_SIZES = BlockSizes(128, 128, 128, 128)


def next_power_of_2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


class MaskInputs(NamedTuple):
  """The normalised mask: segment ids and order keys, [batch, len] int32 each; groups for "wam"."""
  q_segment_ids: jax.Array
  kv_segment_ids: jax.Array
  q_keys: jax.Array
  kv_keys: jax.Array
  q_groups: jax.Array | None = None
  kv_groups: jax.Array | None = None


def normalise_mask(batch: int, q_len: int, kv_len: int, mask_kind: str, q_segment_ids,
                   kv_segment_ids, q_positions, kv_positions, q_block_ids,
                   kv_block_ids) -> tuple[MaskInputs, bool]:
  """Turns the op's mask arguments into MaskInputs plus `ordered` (whether q_key >= kv_key applies)."""
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("attention needs both q_segment_ids and kv_segment_ids, or neither")
  if q_segment_ids is None:
    q_segment_ids = jnp.ones((batch, q_len), jnp.int32)
    kv_segment_ids = jnp.ones((batch, kv_len), jnp.int32)
  ordered = mask_kind != "bidirectional"
  if mask_kind == "causal":
    # Same defaults as the reference: queries are the last q_len of the kv positions.
    q_keys = (jnp.broadcast_to(jnp.arange(q_len) + (kv_len - q_len), (batch, q_len))
              if q_positions is None else q_positions)
    kv_keys = (jnp.broadcast_to(jnp.arange(kv_len), (batch, kv_len))
               if kv_positions is None else kv_positions)
  elif mask_kind == "block_causal":
    if q_block_ids is None or kv_block_ids is None:
      raise ValueError("mask_kind='block_causal' needs q_block_ids and kv_block_ids")
    q_keys, kv_keys = q_block_ids, kv_block_ids
  elif mask_kind == "wam":
    if q_positions is None or kv_positions is None or q_block_ids is None or kv_block_ids is None:
      raise ValueError("mask_kind='wam' needs q_positions, kv_positions, q_block_ids and kv_block_ids")
    q_keys, kv_keys = q_positions, kv_positions
  else:
    q_keys = jnp.zeros((batch, q_len), jnp.int32)
    kv_keys = jnp.zeros((batch, kv_len), jnp.int32)
  as_int = lambda x, n: jnp.broadcast_to(jnp.asarray(x), (batch, n)).astype(jnp.int32)
  groups = ((as_int(q_block_ids, q_len), as_int(kv_block_ids, kv_len)) if mask_kind == "wam" else (None, None))
  return MaskInputs(as_int(q_segment_ids, q_len), as_int(kv_segment_ids, kv_len),
                    as_int(q_keys, q_len), as_int(kv_keys, kv_len), *groups), ordered


def pad_to_blocks(q, k, v, mask: MaskInputs, blocks: BlockSizes):
  """Pads q to a multiple of the q blocks and k/v to the kv blocks, with segment id 0."""
  q_len, kv_len = q.shape[1], k.shape[1]
  q_pad = -q_len % blocks.q_multiple
  kv_pad = -kv_len % blocks.kv_multiple
  pad_seq = lambda x, n: x if x is None or not n else jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2))
  return (pad_seq(q, q_pad), pad_seq(k, kv_pad), pad_seq(v, kv_pad),
          MaskInputs(pad_seq(mask.q_segment_ids, q_pad), pad_seq(mask.kv_segment_ids, kv_pad),
                     pad_seq(mask.q_keys, q_pad), pad_seq(mask.kv_keys, kv_pad),
                     pad_seq(mask.q_groups, q_pad), pad_seq(mask.kv_groups, kv_pad)))


def pair_mask(q_segment_ids, kv_segment_ids, q_keys, kv_keys, ordered: bool, *, q_groups=None, kv_groups=None):
  """[..., q, kv] bool from [..., q] and [..., kv] pieces: the rule of reference.py."""
  allowed = q_segment_ids[..., :, None] == kv_segment_ids[..., None, :]
  allowed &= (q_segment_ids != 0)[..., :, None]
  if ordered:
    allowed &= q_keys[..., :, None] >= kv_keys[..., None, :]
  if kv_groups is not None:
    allowed &= (kv_groups[..., None, :] == 0) | (q_groups[..., :, None] == kv_groups[..., None, :])
  return allowed


def _block_summary(segment_ids, keys, block: int):
  """Per block: (min, max) segment id and (min, max) key over the real tokens. [batch, n] each.

  A block of padding gets min > max, so it overlaps nothing.
  """
  batch, length = segment_ids.shape
  seg = segment_ids.reshape(batch, length // block, block)
  key = keys.reshape(batch, length // block, block)
  real = seg != 0
  return (jnp.where(real, seg, _INT_MAX).min(-1), jnp.where(real, seg, -1).max(-1),
          jnp.where(real, key, _INT_MAX).min(-1), jnp.where(real, key, -_INT_MAX).max(-1))


def active_tiles(mask: MaskInputs, block_q: int, block_kv: int, ordered: bool) -> jax.Array:
  """[batch, n_q_blocks, n_kv_blocks] bool: True where the tile may hold an allowed pair."""
  q_seg_min, q_seg_max, _, q_key_max = _block_summary(mask.q_segment_ids, mask.q_keys, block_q)
  kv_seg_min, kv_seg_max, kv_key_min, _ = _block_summary(mask.kv_segment_ids, mask.kv_keys, block_kv)
  active = ((q_seg_min[:, :, None] <= kv_seg_max[:, None, :])
            & (kv_seg_min[:, None, :] <= q_seg_max[:, :, None]))
  if ordered:
    active &= q_key_max[:, :, None] >= kv_key_min[:, None, :]
  if mask.kv_groups is not None:
    # A tile is live if its kv block holds shared context (group 0) or the group ranges overlap:
    # a noisy chunk's queries skip every other chunk's tiles.
    _, _, q_group_min, q_group_max = _block_summary(mask.q_segment_ids, mask.q_groups, block_q)
    _, _, kv_group_min, kv_group_max = _block_summary(mask.kv_segment_ids, mask.kv_groups, block_kv)
    real_kv = mask.kv_segment_ids != 0
    shared = ((mask.kv_groups == 0) & real_kv).reshape(real_kv.shape[0], -1, block_kv).any(-1)
    overlap = ((q_group_min[:, :, None] <= kv_group_max[:, None, :])
               & (kv_group_min[:, None, :] <= q_group_max[:, :, None]))
    active &= shared[:, None, :] | overlap
  return active


def compact(active: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Active tile lists: indices [..., n] int32 (active first, ascending) and counts [...] int32."""
  indices = jnp.argsort(~active, axis=-1, stable=True).astype(jnp.int32)
  return indices, active.sum(-1, dtype=jnp.int32)


def active_fraction(mask: MaskInputs, blocks: BlockSizes, ordered: bool) -> jax.Array:
  """Fraction of forward tiles that run: the cost a kernel pays relative to dense attention."""
  return active_tiles(mask, blocks.block_q, blocks.block_kv, ordered).mean()
