"""The specification of ejax's attention op, written in plain jnp.

Shapes: q [batch, q_len, q_heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim] with
q_heads a multiple of kv_heads (grouped- or multi-query attention).

Query i may attend to key j when all of these hold:
- segments (if given): q_segment_ids[i] == kv_segment_ids[j] and q_segment_ids[i] != 0
  (0 marks padding, which attends to nothing and is attended by nothing);
- mask kind "causal": q_positions[i] >= kv_positions[j] (positions default to arange, and are
  per-segment in packed rows);
- mask kind "block_causal": q_block_ids[i] >= kv_block_ids[j], where block ids are the running sum
  of per-token "autoregressive" flags (pi0's prefix/suffix mask; see `block_ids_from_ar_flags`);
- mask kind "bidirectional": no further condition;
- mask kind "wam" (DreamZero's world-action-model mask, ejax/models/dreamzero/sequence.py): block ids
  are groups, 0 the shared context: q_positions[i] >= kv_positions[j] and (kv_block_ids[j] == 0 or
  kv_block_ids[j] == q_block_ids[i]). A query sees the shared context up to its position plus the
  keys of its own group at or below its position; the order keys make a group see part of itself
  (DreamZero's state tokens see their own chunk's states, not its video and actions, which see them).
A query with no allowed key outputs zeros. Softmax runs in fp32; the output has q's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_KINDS = ("bidirectional", "causal", "block_causal", "wam")


def block_ids_from_ar_flags(ar_flags: jax.Array) -> jax.Array:
  """Block ids for the block-causal mask: tokens with flag 1 start a new block later ones see."""
  return jnp.cumsum(ar_flags.astype(jnp.int32), axis=-1)


def attention_mask(
    q_len: int,
    kv_len: int,
    *,
    batch: int,
    mask_kind: str = "bidirectional",
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    q_block_ids: jax.Array | None = None,
    kv_block_ids: jax.Array | None = None,
) -> jax.Array:
  """Boolean mask [batch, q_len, kv_len]: True where query i may attend to key j."""
  if mask_kind not in MASK_KINDS:
    raise ValueError(f"attention mask_kind={mask_kind!r} is not one of {MASK_KINDS}")
  mask = jnp.ones((batch, q_len, kv_len), dtype=bool)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("attention needs both q_segment_ids and kv_segment_ids, or neither")
  if q_segment_ids is not None:
    mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    mask &= (q_segment_ids != 0)[:, :, None]
  if mask_kind == "causal":
    if q_positions is None:
      q_positions = jnp.broadcast_to(jnp.arange(q_len) + (kv_len - q_len), (batch, q_len))
    if kv_positions is None:
      kv_positions = jnp.broadcast_to(jnp.arange(kv_len), (batch, kv_len))
    mask &= q_positions[:, :, None] >= kv_positions[:, None, :]
  elif mask_kind == "block_causal":
    if q_block_ids is None or kv_block_ids is None:
      raise ValueError("mask_kind='block_causal' needs q_block_ids and kv_block_ids")
    mask &= q_block_ids[:, :, None] >= kv_block_ids[:, None, :]
  elif mask_kind == "wam":
    if q_positions is None or kv_positions is None or q_block_ids is None or kv_block_ids is None:
      raise ValueError("mask_kind='wam' needs q_positions, kv_positions, q_block_ids and kv_block_ids")
    mask &= q_positions[:, :, None] >= kv_positions[:, None, :]
    mask &= (kv_block_ids[:, None, :] == 0) | (kv_block_ids[:, None, :] == q_block_ids[:, :, None])
  return mask


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask_kind: str = "bidirectional",
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    q_block_ids: jax.Array | None = None,
    kv_block_ids: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
  """Dense attention with the mask above; materialises [batch, heads, q_len, kv_len] scores."""
  batch, q_len, q_heads, head_dim = q.shape
  _, kv_len, kv_heads, _ = k.shape
  if q_heads % kv_heads:
    raise ValueError(f"attention: q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
  scale = head_dim**-0.5 if scale is None else scale
  groups = q_heads // kv_heads
  qg = q.reshape(batch, q_len, kv_heads, groups, head_dim)
  scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
  mask = attention_mask(
      q_len, kv_len, batch=batch, mask_kind=mask_kind,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_positions=q_positions, kv_positions=kv_positions,
      q_block_ids=q_block_ids, kv_block_ids=kv_block_ids)
  mask = mask[:, None, None]
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  weights = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(weights, axis=-1, keepdims=True)
  weights = weights / jnp.where(denom == 0, 1.0, denom)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v.astype(jnp.float32))
  return out.reshape(batch, q_len, q_heads, head_dim).astype(q.dtype)
