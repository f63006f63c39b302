"""Memory-efficient blockwise attention in plain XLA (the CPU path, and the GPU fallback).

The same algorithm as the Pallas kernel: an online softmax over kv tiles in fp32, looping only over
the active tiles of each q block (tiles.py), so packed rows cost what their segments cost. The
loops are real XLA loops with data-dependent trip counts; on CPU they skip work exactly. Scores
never exist beyond one [kv_heads, groups, block_q, block_kv] tile.

Inside the loops everything is head-major ([kv_heads, groups * block, head_dim]) so every tile
product is a plain batched matmul with no transposes; the layout changes once, outside the loops.

The backward pass is one sweep per batch row: for each q block, over its active kv tiles, dQ is
accumulated in registers and dK/dV are added into row-sized fp32 buffers, which a sequential loop
can do without atomics (5 tile matmuls per active tile, against 7 for separate dQ and dK/dV passes).

On CPU this runs on one thread. XLA:CPU splits only large single ops (big dots, big elementwise
fusions) across its thread pool; it runs a loop's iterations, and independent loops of one program,
one after another. The tile matmuls run at ~55-65 GFLOP/s (of ~78 peak on the AVX2 core of the
shared 2-core machine) and the softmax passes add about half as much again, so one tile of 64 x 64
costs ~50 us forward and ~120 us backward (4 heads x 32). Batching work per loop step so that XLA
threads it was measured and rejected (2026-11-21, the packing benchmark's rows, machine at load
~3-4): q blocks sorted by active-tile count and run in cohorts of c blocks per step (each step one
batched matmul over the cohort, dK/dV by scatter-add) took 0.86-1.0 s per epoch of forward+backward
at c = 1, 1.02-1.10 s at c = 8, 1.08-1.26 s at c = 16, 1.36-1.54 s at c = 32; a whole packed
training epoch took 6.5-6.9 s at c = 1, 7.2-7.7 s at c = 4 and 7.6-7.8 s at c = 16. Threaded
steps are short (~0.1-1 ms), and on a shared machine every one waits for its slowest thread; a vmap
over all q blocks would also run each block to the largest tile count (2.4x the active tiles of
packed rows at 64-token tiles). Tile sizes are therefore what matters on CPU: see
tiles.CPU_BLOCK_SIZES.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ejax.kernels.attention.tiles import MASKED_SCORE, MaskInputs, active_tiles, compact, pair_mask
from ejax.kernels.platform import varying_axes


def _carry(shape, value: float, sources) -> jax.Array:
  """A constant fp32 loop carry, typed as varying over every jax.shard_map axis that `sources`
  vary over. The loop bodies mix those inputs in, and shard_map's varying-axes check (on by
  default) requires a carry to enter a loop with the type it leaves with; outside shard_map no
  axis varies and this is a plain constant."""
  carry = jnp.full(shape, value, jnp.float32)
  axes = frozenset().union(*(varying_axes(source) for source in jax.tree.leaves(sources)))
  return lax.pcast(carry, tuple(sorted(axes)), to="varying") if axes else carry


def _rows_of(ids, b, start, block: int):
  """ids[b, start:start + block], or None where the mask has no such ids (groups outside "wam")."""
  return None if ids is None else lax.dynamic_slice_in_dim(ids[b], start, block)


def _tile_lists(mask: MaskInputs, block_q: int, block_kv: int, ordered: bool):
  return compact(active_tiles(mask, block_q, block_kv, ordered))


def _head_major(x: jax.Array, kv_heads: int) -> jax.Array:
  """[batch, len, heads, d] -> [batch, kv_heads, groups, len, d]."""
  batch, length, heads, head_dim = x.shape
  return x.reshape(batch, length, kv_heads, heads // kv_heads, head_dim).transpose(0, 2, 3, 1, 4)


def _sequence_major(x: jax.Array) -> jax.Array:
  """[batch, kv_heads, groups, len, d] -> [batch, len, heads, d]."""
  batch, kv_heads, groups, length, head_dim = x.shape
  return x.transpose(0, 3, 1, 2, 4).reshape(batch, length, kv_heads * groups, head_dim)


def _q_rows(x: jax.Array, start, block: int) -> jax.Array:
  """Rows [start, start + block) of a [kv_heads, groups, len, ...] array, groups folded into rows."""
  rows = lax.dynamic_slice_in_dim(x, start, block, 2)
  return rows.reshape(x.shape[0], x.shape[1] * block, *x.shape[3:])


def _scores(q_rows, k_blk, allowed):
  """[kv_heads, groups * bq, bk] fp32 scores of pre-scaled q, masked; `allowed` is [bq, bk]."""
  scores = jnp.einsum("hqd,hkd->hqk", q_rows, k_blk, preferred_element_type=jnp.float32)
  kv_heads, rows, block_kv = scores.shape
  grouped = scores.reshape(kv_heads, -1, allowed.shape[0], block_kv)
  return jnp.where(allowed, grouped, MASKED_SCORE).reshape(kv_heads, rows, block_kv)


def forward(q, k, v, mask: MaskInputs, *, ordered: bool, scale: float, block_q: int,
            block_kv: int):
  """Returns out [batch, q_len, heads, head_dim] (q.dtype) and lse [batch, kv_heads, groups, q_len].

  Lengths must be multiples of the blocks (tiles.pad_to_blocks).
  """
  batch, q_len, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  groups = heads // kv_heads
  n_q = q_len // block_q
  tile_order, tile_count = _tile_lists(mask, block_q, block_kv, ordered)
  # q is scaled once here rather than every tile's scores (one pass over q, not over each tile).
  q_hm = _head_major(q * jnp.asarray(scale, q.dtype), kv_heads)
  k_hm, v_hm = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [batch, kv_heads, len, d]

  def one_q_block(index):
    b, i = index // n_q, index % n_q
    q_start = i * block_q
    q_rows = _q_rows(q_hm[b], q_start, block_q)  # [kv_heads, groups * bq, d]
    q_seg = lax.dynamic_slice_in_dim(mask.q_segment_ids[b], q_start, block_q)
    q_key = lax.dynamic_slice_in_dim(mask.q_keys[b], q_start, block_q)
    q_group = _rows_of(mask.q_groups, b, q_start, block_q)

    def kv_tile(t, carry):
      acc, row_max, row_sum = carry
      kv_start = tile_order[b, i, t] * block_kv
      kv_take = lambda x, axis: lax.dynamic_slice_in_dim(x, kv_start, block_kv, axis)
      allowed = pair_mask(q_seg, kv_take(mask.kv_segment_ids[b], 0), q_key,
                          kv_take(mask.kv_keys[b], 0), ordered, q_groups=q_group,
                          kv_groups=_rows_of(mask.kv_groups, b, kv_start, block_kv))
      k_blk, v_blk = kv_take(k_hm[b], 1), kv_take(v_hm[b], 1)  # [kv_heads, bk, d]
      scores = _scores(q_rows, k_blk, allowed)
      new_max = jnp.maximum(row_max, scores.max(-1))
      correction = jnp.exp(row_max - new_max)
      # No mask pass on the weights: a row that has seen only masked keys has new_max ==
      # MASKED_SCORE and weight exp(0) = 1 on them, but the first allowed key brings a correction
      # exp(MASKED_SCORE - real) = 0 that wipes them, and a row that never sees one keeps
      # row_max == MASKED_SCORE and is zeroed at the end. Elsewhere exp(MASKED - real) = 0.
      weights = jnp.exp(scores - new_max[..., None])
      row_sum = row_sum * correction + weights.sum(-1)
      acc = acc * correction[..., None] + jnp.einsum(
          "hqk,hkd->hqd", weights.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
      return acc, new_max, row_sum

    rows = groups * block_q
    sources = (q_rows, k_hm, v_hm, mask, tile_order)
    init = (_carry((kv_heads, rows, head_dim), 0.0, sources),
            _carry((kv_heads, rows), MASKED_SCORE, sources),
            _carry((kv_heads, rows), 0.0, sources))
    acc, row_max, row_sum = lax.fori_loop(0, tile_count[b, i], kv_tile, init)
    seen = row_max > MASKED_SCORE / 2  # rows with no allowed key output zeros
    safe_sum = jnp.where(seen, row_sum, 1.0)
    out = jnp.where(seen[..., None], acc / safe_sum[..., None], 0.0)
    lse = jnp.where(seen, row_max + jnp.log(safe_sum), 0.0)
    return (out.astype(q.dtype).reshape(kv_heads, groups, block_q, head_dim),
            lse.reshape(kv_heads, groups, block_q))

  out, lse = lax.map(one_q_block, jnp.arange(batch * n_q))
  # [batch * n_q, kv_heads, groups, bq, ...] -> [batch, kv_heads, groups, q_len, ...]
  out = out.reshape(batch, n_q, kv_heads, groups, block_q, head_dim).transpose(0, 2, 3, 1, 4, 5)
  lse = lse.reshape(batch, n_q, kv_heads, groups, block_q).transpose(0, 2, 3, 1, 4)
  return (_sequence_major(out.reshape(batch, kv_heads, groups, q_len, head_dim)),
          lse.reshape(batch, kv_heads, groups, q_len))


def backward(q, k, v, mask: MaskInputs, out, lse, d_out, *, ordered: bool, scale: float,
             block_q: int, block_kv: int):
  """Gradients (dq, dk, dv) in the dtypes of q, k, v, from forward()'s out and lse."""
  batch, q_len, heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  groups = heads // kv_heads
  n_q = q_len // block_q
  tile_order, tile_count = _tile_lists(mask, block_q, block_kv, ordered)
  q_hm, do_hm = _head_major(q * jnp.asarray(scale, q.dtype), kv_heads), _head_major(d_out, kv_heads)
  k_hm, v_hm = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  # delta_i = sum_d out_id * dout_id: the softmax-Jacobian term shared by every tile of a row.
  delta = jnp.sum(_head_major(out, kv_heads).astype(jnp.float32) * do_hm.astype(jnp.float32), -1)
  sources = (q_hm, do_hm, k_hm, v_hm, lse, delta, mask, tile_order)

  def one_row(b):
    def one_q_block(carry, i):
      q_start = i * block_q
      q_rows, do_rows = _q_rows(q_hm[b], q_start, block_q), _q_rows(do_hm[b], q_start, block_q)
      lse_rows, delta_rows = _q_rows(lse[b], q_start, block_q), _q_rows(delta[b], q_start, block_q)
      q_seg = lax.dynamic_slice_in_dim(mask.q_segment_ids[b], q_start, block_q)
      q_key = lax.dynamic_slice_in_dim(mask.q_keys[b], q_start, block_q)
      q_group = _rows_of(mask.q_groups, b, q_start, block_q)

      def kv_tile(t, inner):
        dq, dk, dv = inner
        kv_start = tile_order[b, i, t] * block_kv
        kv_take = lambda x, axis: lax.dynamic_slice_in_dim(x, kv_start, block_kv, axis)
        allowed = pair_mask(q_seg, kv_take(mask.kv_segment_ids[b], 0), q_key,
                            kv_take(mask.kv_keys[b], 0), ordered, q_groups=q_group,
                            kv_groups=_rows_of(mask.kv_groups, b, kv_start, block_kv))
        k_blk, v_blk = kv_take(k_hm[b], 1), kv_take(v_hm[b], 1)  # [kv_heads, bk, d]
        scores = _scores(q_rows, k_blk, allowed)
        # Masked scores give exp(MASKED_SCORE - lse) = 0 (lse is 0 for rows with no key).
        probs = jnp.exp(scores - lse_rows[..., None])
        d_probs = jnp.einsum("hqd,hkd->hqk", do_rows, v_blk, preferred_element_type=jnp.float32)
        d_scores = probs * (d_probs - delta_rows[..., None])  # w.r.t. the scores of scaled q
        dv_tile = jnp.einsum("hqk,hqd->hkd", probs, do_rows.astype(jnp.float32))
        dk_tile = jnp.einsum("hqk,hqd->hkd", d_scores, q_rows.astype(jnp.float32))
        dq = dq + jnp.einsum("hqk,hkd->hqd", d_scores, k_blk.astype(jnp.float32))
        dk = lax.dynamic_update_slice_in_dim(dk, kv_take(dk, 1) + dk_tile, kv_start, 1)
        dv = lax.dynamic_update_slice_in_dim(dv, kv_take(dv, 1) + dv_tile, kv_start, 1)
        return dq, dk, dv

      dq0 = _carry((kv_heads, groups * block_q, head_dim), 0.0, sources)
      dq, dk, dv = lax.fori_loop(0, tile_count[b, i], kv_tile, (dq0, *carry))
      return (dk, dv), dq.reshape(kv_heads, groups, block_q, head_dim)

    zeros = _carry((kv_heads, kv_len, head_dim), 0.0, sources)
    (dk, dv), dq = lax.scan(one_q_block, (zeros, zeros), jnp.arange(n_q))
    # dq [n_q, kv_heads, groups, bq, d] -> [kv_heads, groups, q_len, d]
    # Scores used scaled q: dQ picks up the scale here; dK already has it through the scaled q.
    return dq.transpose(1, 2, 0, 3, 4).reshape(kv_heads, groups, q_len, head_dim) * scale, dk, dv

  dq, dk, dv = lax.map(one_row, jnp.arange(batch))
  return (_sequence_major(dq).astype(q.dtype), dk.transpose(0, 2, 1, 3).astype(k.dtype),
          dv.transpose(0, 2, 1, 3).astype(v.dtype))
