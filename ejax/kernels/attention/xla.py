"""Memory-efficient blockwise attention in plain XLA (the CPU path, and the GPU fallback).

The same algorithm as the Pallas kernel: an online softmax over kv tiles in fp32, looping only over
the active tiles of each q block (tiles.py), so packed rows cost what their segments cost. The
loops are real XLA loops with data-dependent trip counts; on CPU they skip work exactly. Scores
never exist beyond one [kv_heads, groups, block_q, block_kv] tile.

The backward pass is one sweep per batch row: for each q block, over its active kv tiles, dQ is
accumulated in registers and dK/dV are added into row-sized fp32 buffers, which a sequential loop
can do without atomics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ejax.kernels.attention.tiles import MASKED_SCORE, MaskInputs, active_tiles, compact, pair_mask


def _tile_lists(mask: MaskInputs, block_q: int, block_kv: int, ordered: bool):
  return compact(active_tiles(mask, block_q, block_kv, ordered))


def forward(q, k, v, mask: MaskInputs, *, ordered: bool, scale: float, block_q: int,
            block_kv: int):
  """Returns out [batch, q_len, heads, head_dim] (q.dtype) and lse [batch, q_len, heads] fp32.

  Lengths must be multiples of the blocks (tiles.pad_to_blocks).
  """
  batch, q_len, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  groups = heads // kv_heads
  n_q = q_len // block_q
  tile_order, tile_count = _tile_lists(mask, block_q, block_kv, ordered)

  def one_q_block(index):
    b, i = index // n_q, index % n_q
    q_start = i * block_q
    q_blk = lax.dynamic_slice_in_dim(q[b], q_start, block_q, 0).reshape(
        block_q, kv_heads, groups, head_dim)
    q_seg = lax.dynamic_slice_in_dim(mask.q_segment_ids[b], q_start, block_q)
    q_key = lax.dynamic_slice_in_dim(mask.q_keys[b], q_start, block_q)

    def kv_tile(t, carry):
      acc, row_max, row_sum = carry
      kv_start = tile_order[b, i, t] * block_kv
      k_blk = lax.dynamic_slice_in_dim(k[b], kv_start, block_kv, 0)  # [bk, kv_heads, d]
      v_blk = lax.dynamic_slice_in_dim(v[b], kv_start, block_kv, 0)
      allowed = pair_mask(q_seg, lax.dynamic_slice_in_dim(mask.kv_segment_ids[b], kv_start, block_kv),
                          q_key, lax.dynamic_slice_in_dim(mask.kv_keys[b], kv_start, block_kv),
                          ordered)  # [bq, bk]
      scores = jnp.einsum("qhgd,khd->hgqk", q_blk, k_blk,
                          preferred_element_type=jnp.float32) * scale
      scores = jnp.where(allowed, scores, MASKED_SCORE)
      new_max = jnp.maximum(row_max, scores.max(-1))
      correction = jnp.exp(row_max - new_max)
      weights = jnp.where(allowed, jnp.exp(scores - new_max[..., None]), 0.0)
      row_sum = row_sum * correction + weights.sum(-1)
      acc = acc * correction[..., None] + jnp.einsum(
          "hgqk,khd->hgqd", weights.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
      return acc, new_max, row_sum

    init = (jnp.zeros((kv_heads, groups, block_q, head_dim), jnp.float32),
            jnp.full((kv_heads, groups, block_q), MASKED_SCORE, jnp.float32),
            jnp.zeros((kv_heads, groups, block_q), jnp.float32))
    acc, row_max, row_sum = lax.fori_loop(0, tile_count[b, i], kv_tile, init)
    seen = row_sum > 0  # rows with no allowed key output zeros
    out = acc / jnp.where(seen, row_sum, 1.0)[..., None]
    lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), 0.0)
    out = jnp.transpose(out, (2, 0, 1, 3)).reshape(block_q, heads, head_dim)
    return out.astype(q.dtype), jnp.transpose(lse, (2, 0, 1)).reshape(block_q, heads)

  out, lse = lax.map(one_q_block, jnp.arange(batch * n_q))
  return (out.reshape(batch, q_len, heads, head_dim), lse.reshape(batch, q_len, heads))


def backward(q, k, v, mask: MaskInputs, out, lse, d_out, *, ordered: bool, scale: float,
             block_q: int, block_kv: int):
  """Gradients (dq, dk, dv) in the dtypes of q, k, v, from forward()'s out and lse."""
  batch, q_len, heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  groups = heads // kv_heads
  n_q = q_len // block_q
  tile_order, tile_count = _tile_lists(mask, block_q, block_kv, ordered)
  # delta_i = sum_d out_id * dout_id: the softmax-Jacobian term shared by every tile of a row.
  delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)  # [b, q, h]
  grouped = lambda x: x.reshape(x.shape[0], kv_heads, groups, *x.shape[2:])

  def one_row(b):
    def one_q_block(carry, i):
      q_start = i * block_q
      take = lambda x: lax.dynamic_slice_in_dim(x[b], q_start, block_q, 0)
      q_blk, do_blk = grouped(take(q)), grouped(take(d_out))  # [bq, kv_heads, groups, d]
      lse_blk = jnp.transpose(grouped(take(lse)), (1, 2, 0))  # [kv_heads, groups, bq]
      delta_blk = jnp.transpose(grouped(take(delta)), (1, 2, 0))
      q_seg, q_key = take(mask.q_segment_ids), take(mask.q_keys)

      def kv_tile(t, inner):
        dq, dk, dv = inner
        kv_start = tile_order[b, i, t] * block_kv
        kv_take = lambda x: lax.dynamic_slice_in_dim(x, kv_start, block_kv, 0)
        k_blk, v_blk = kv_take(k[b]), kv_take(v[b])
        allowed = pair_mask(q_seg, kv_take(mask.kv_segment_ids[b]), q_key,
                            kv_take(mask.kv_keys[b]), ordered)
        scores = jnp.einsum("qhgd,khd->hgqk", q_blk, k_blk,
                            preferred_element_type=jnp.float32) * scale
        probs = jnp.where(allowed, jnp.exp(scores - lse_blk[..., None]), 0.0)
        d_probs = jnp.einsum("qhgd,khd->hgqk", do_blk, v_blk, preferred_element_type=jnp.float32)
        d_scores = probs * (d_probs - delta_blk[..., None]) * scale
        dv_tile = jnp.einsum("hgqk,qhgd->khd", probs, do_blk.astype(jnp.float32))
        dk_tile = jnp.einsum("hgqk,qhgd->khd", d_scores, q_blk.astype(jnp.float32))
        dq = dq + jnp.einsum("hgqk,khd->qhgd", d_scores, k_blk.astype(jnp.float32))
        dk = lax.dynamic_update_slice_in_dim(dk, kv_take(dk) + dk_tile, kv_start, 0)
        dv = lax.dynamic_update_slice_in_dim(dv, kv_take(dv) + dv_tile, kv_start, 0)
        return dq, dk, dv

      dq0 = jnp.zeros((block_q, kv_heads, groups, head_dim), jnp.float32)
      dq, dk, dv = lax.fori_loop(0, tile_count[b, i], kv_tile, (dq0, *carry))
      return (dk, dv), dq.reshape(block_q, heads, head_dim)

    zeros = jnp.zeros((kv_len, kv_heads, head_dim), jnp.float32)
    (dk, dv), dq = lax.scan(one_q_block, (zeros, zeros), jnp.arange(n_q))
    return dq.reshape(q_len, heads, head_dim), dk, dv

  dq, dk, dv = lax.map(one_row, jnp.arange(batch))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
