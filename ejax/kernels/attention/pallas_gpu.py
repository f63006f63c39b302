"""Variable-length flash attention for GPUs in Pallas (Triton lowering), forward and backward.

Grid: (batch, q_heads, blocks). Each program loops over the *active* tiles of its block only
(lists built in tiles.py from per-block min/max of segment ids and order keys), so a packed row
costs the sum of its squared segment lengths. Grouped kv heads are read through the index map
(q head h reads kv head h // groups); the dK/dV pass writes one fp32 slice per q head and the
group sum happens outside the kernel, which needs no atomics (without groups it writes dK/dV in the
input dtype).

Inside a tile: scores in fp32 (`pallas_dot` accumulates in fp32), online softmax with a finite masked
score, bf16 (or the input dtype) operands for the second matmul. `interpret=True` runs the same
kernels on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ejax.kernels import platform
from ejax.kernels.platform import pallas_dot, plgpu
from ejax.kernels.attention.tiles import MASKED_SCORE, MaskInputs, active_tiles, compact, pair_mask

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def supports(q, k) -> bool:
  """Whether the kernel handles these shapes (Triton tiles need a power-of-two head_dim) with this
  jax (platform.triton_missing)."""
  return (platform.triton_missing() is None and q.shape[-1] in SUPPORTED_HEAD_DIMS
          and q.dtype in (jnp.bfloat16, jnp.float16, jnp.float32))


def _compiler_params(head_dim: int, num_warps: int | None = None, num_stages: int | None = None):
  return plgpu.CompilerParams(num_warps=num_warps or (4 if head_dim <= 64 else 8),
                              num_stages=num_stages or 2)


def _split_groups(refs, grouped: bool):
  """(q_group_ref, kv_group_ref, *rest): the "wam" mask's group ids follow the order keys."""
  return tuple(refs) if grouped else (None, None, *refs)


def _groups(q_group_ref, kv_group_ref, q_rows, kv_rows) -> dict:
  """pair_mask's group arguments for a tile's queries and keys (none without groups)."""
  if q_group_ref is None:
    return {}
  return dict(q_groups=q_group_ref[q_rows], kv_groups=kv_group_ref[kv_rows])


def _forward_kernel(count_ref, order_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, q_key_ref,
                    kv_key_ref, *refs, scale: float, ordered: bool, block_kv: int, grouped: bool):
  q_group_ref, kv_group_ref, out_ref, lse_ref = _split_groups(refs, grouped)
  q = q_ref[...]  # [block_q, d]
  q_seg, q_key = q_seg_ref[...], q_key_ref[...]
  block_q, head_dim = q.shape

  def kv_tile(t, carry):
    acc, row_max, row_sum = carry
    kv = pl.ds(pl.multiple_of(order_ref[t] * block_kv, block_kv), block_kv)
    k, v = k_ref[kv, :], v_ref[kv, :]
    allowed = pair_mask(q_seg, kv_seg_ref[kv], q_key, kv_key_ref[kv], ordered,
                        **_groups(q_group_ref, kv_group_ref, slice(None), kv))
    scores = jnp.where(allowed, pallas_dot(q, k, trans_b=True) * scale, MASKED_SCORE)
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
    correction = jnp.exp(row_max - new_max)
    weights = jnp.where(allowed, jnp.exp(scores - new_max[:, None]), 0.0)
    row_sum = row_sum * correction + jnp.sum(weights, axis=1)
    acc = acc * correction[:, None] + pallas_dot(weights.astype(v.dtype), v)
    return acc, new_max, row_sum

  init = (jnp.zeros((block_q, head_dim), jnp.float32),
          jnp.full((block_q,), MASKED_SCORE, jnp.float32), jnp.zeros((block_q,), jnp.float32))
  acc, row_max, row_sum = lax.fori_loop(0, count_ref[0], kv_tile, init)
  seen = row_sum > 0  # a query with no allowed key outputs zeros
  safe_sum = jnp.where(seen, row_sum, 1.0)
  out_ref[...] = (acc / safe_sum[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(seen, row_max + jnp.log(safe_sum), 0.0)


def _dq_kernel(count_ref, order_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref,
               kv_seg_ref, q_key_ref, kv_key_ref, *refs, scale: float, ordered: bool,
               block_kv: int, grouped: bool):
  q_group_ref, kv_group_ref, dq_ref = _split_groups(refs, grouped)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_seg, q_key = q_seg_ref[...], q_key_ref[...]

  def kv_tile(t, dq):
    kv = pl.ds(pl.multiple_of(order_ref[t] * block_kv, block_kv), block_kv)
    k, v = k_ref[kv, :], v_ref[kv, :]
    allowed = pair_mask(q_seg, kv_seg_ref[kv], q_key, kv_key_ref[kv], ordered,
                        **_groups(q_group_ref, kv_group_ref, slice(None), kv))
    probs = jnp.where(allowed, jnp.exp(pallas_dot(q, k, trans_b=True) * scale - lse[:, None]), 0.0)
    d_scores = probs * (pallas_dot(do, v, trans_b=True) - delta[:, None]) * scale
    return dq + pallas_dot(d_scores.astype(k.dtype), k)

  dq = lax.fori_loop(0, count_ref[0], kv_tile, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(count_ref, order_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref,
                kv_seg_ref, q_key_ref, kv_key_ref, *refs, scale: float, ordered: bool,
                block_q: int, grouped: bool):
  q_group_ref, kv_group_ref, dk_ref, dv_ref = _split_groups(refs, grouped)
  k, v = k_ref[...], v_ref[...]  # [block_kv, d]
  kv_seg, kv_key = kv_seg_ref[...], kv_key_ref[...]

  def q_tile(t, carry):
    dk, dv = carry
    rows = pl.ds(pl.multiple_of(order_ref[t] * block_q, block_q), block_q)
    q, do = q_ref[rows, :], do_ref[rows, :]
    allowed = pair_mask(q_seg_ref[rows], kv_seg, q_key_ref[rows], kv_key, ordered,
                        **_groups(q_group_ref, kv_group_ref, rows, slice(None)))
    probs = jnp.where(allowed, jnp.exp(pallas_dot(q, k, trans_b=True) * scale
                                       - lse_ref[rows][:, None]), 0.0)
    d_scores = probs * (pallas_dot(do, v, trans_b=True) - delta_ref[rows][:, None]) * scale
    dv = dv + pallas_dot(probs.astype(do.dtype), do, trans_a=True)
    dk = dk + pallas_dot(d_scores.astype(q.dtype), q, trans_a=True)
    return dk, dv

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, count_ref[0], q_tile, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _seq_specs(block: int, length: int, groups: int, head_dim: int, *, blocked: bool):
  """BlockSpecs for a [batch, len, heads, d] tensor, either one block per program or the whole row."""
  if blocked:
    return pl.BlockSpec((None, block, None, head_dim), lambda b, h, i: (b, i, h // groups, 0))
  return pl.BlockSpec((None, length, None, head_dim), lambda b, h, i: (b, 0, h // groups, 0))


def _ids_spec(block: int | None, length: int):
  if block is None:
    return pl.BlockSpec((None, length), lambda b, h, i: (b, 0))
  return pl.BlockSpec((None, block), lambda b, h, i: (b, i))


def _tile_list_specs(n_tiles: int):
  # counts [batch, n_blocks] read as a (1,) ref; lists [batch, n_blocks, n_tiles] as (n_tiles,).
  return [pl.BlockSpec((None, 1), lambda b, h, i: (b, i)),
          pl.BlockSpec((None, None, n_tiles), lambda b, h, i: (b, i, 0))]


def _group_ids(mask: MaskInputs) -> tuple:
  return () if mask.q_groups is None else (mask.q_groups, mask.kv_groups)


_STATIC = ("ordered", "scale", "block_q", "block_kv", "interpret", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def forward(q, k, v, mask: MaskInputs, *, ordered: bool, scale: float, block_q: int, block_kv: int,
            interpret: bool = False, num_warps: int | None = None, num_stages: int | None = None):
  """out [batch, q_len, heads, d] (q.dtype), lse [batch, heads, q_len] fp32. Block-multiple lengths."""
  batch, q_len, heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  groups = heads // kv_heads
  order, count = compact(active_tiles(mask, block_q, block_kv, ordered))
  grouped = mask.q_groups is not None
  kernel = functools.partial(_forward_kernel, scale=scale, ordered=ordered, block_kv=block_kv, grouped=grouped)
  group_specs = [_ids_spec(block_q, q_len), _ids_spec(None, kv_len)] if grouped else []
  return pl.pallas_call(
      kernel,
      grid=(batch, heads, q_len // block_q),
      in_specs=[*_tile_list_specs(kv_len // block_kv),
                _seq_specs(block_q, q_len, 1, head_dim, blocked=True),
                _seq_specs(block_kv, kv_len, groups, head_dim, blocked=False),
                _seq_specs(block_kv, kv_len, groups, head_dim, blocked=False),
                _ids_spec(block_q, q_len), _ids_spec(None, kv_len),
                _ids_spec(block_q, q_len), _ids_spec(None, kv_len), *group_specs],
      out_specs=[_seq_specs(block_q, q_len, 1, head_dim, blocked=True),
                 pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i))],
      out_shape=[platform.varying_struct(q.shape, q.dtype, (q, k, v, mask, count, order)),
                 platform.varying_struct((batch, heads, q_len), jnp.float32, (q, k, v, mask, count, order))],
      compiler_params=_compiler_params(head_dim, num_warps, num_stages),
      interpret=interpret,
      name="ejax_varlen_attention_fwd",
  )(count, order, q, k, v, mask.q_segment_ids, mask.kv_segment_ids, mask.q_keys, mask.kv_keys,
    *_group_ids(mask))


@functools.partial(jax.jit, static_argnames=_STATIC)
def backward(q, k, v, mask: MaskInputs, out, lse, d_out, *, ordered: bool, scale: float,
             block_q: int, block_kv: int, interpret: bool = False, num_warps: int | None = None,
             num_stages: int | None = None):
  """(dq, dk, dv) in the input dtypes, from forward()'s out and lse."""
  batch, q_len, heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  groups = heads // kv_heads
  n_q, n_kv = q_len // block_q, kv_len // block_kv
  active = active_tiles(mask, block_q, block_kv, ordered)  # [batch, n_q, n_kv]
  q_order, q_count = compact(active)
  kv_order, kv_count = compact(jnp.swapaxes(active, 1, 2))
  # delta_i = sum_d out_id * dout_id, the softmax-Jacobian term; [batch, heads, q_len] like lse.
  delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), d_out.astype(jnp.float32))
  grouped = mask.q_groups is not None
  ids = (mask.q_segment_ids, mask.kv_segment_ids, mask.q_keys, mask.kv_keys, *_group_ids(mask))
  common = dict(compiler_params=_compiler_params(head_dim, num_warps, num_stages), interpret=interpret)

  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, ordered=ordered, block_kv=block_kv, grouped=grouped),
      grid=(batch, heads, n_q),
      in_specs=[*_tile_list_specs(n_kv),
                _seq_specs(block_q, q_len, 1, head_dim, blocked=True),
                _seq_specs(block_kv, kv_len, groups, head_dim, blocked=False),
                _seq_specs(block_kv, kv_len, groups, head_dim, blocked=False),
                _seq_specs(block_q, q_len, 1, head_dim, blocked=True),
                pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i)),
                pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i)),
                _ids_spec(block_q, q_len), _ids_spec(None, kv_len),
                _ids_spec(block_q, q_len), _ids_spec(None, kv_len),
                *([_ids_spec(block_q, q_len), _ids_spec(None, kv_len)] if grouped else [])],
      out_specs=_seq_specs(block_q, q_len, 1, head_dim, blocked=True),
      out_shape=platform.varying_struct(q.shape, q.dtype, (q_count, q_order, q, k, v, d_out, lse, delta, ids)),
      name="ejax_varlen_attention_dq", **common,
  )(q_count, q_order, q, k, v, d_out, lse, delta, *ids)

  # One program per (batch, q head, kv block); kv tensors are indexed by h // groups.
  whole_row = lambda length: pl.BlockSpec((None, length, None, head_dim), lambda b, h, j: (b, 0, h, 0))
  per_head_out = pl.BlockSpec((None, block_kv, None, head_dim), lambda b, h, j: (b, j, h, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=scale, ordered=ordered, block_q=block_q, grouped=grouped),
      grid=(batch, heads, n_kv),
      in_specs=[*_tile_list_specs(n_q),
                whole_row(q_len),
                _seq_specs(block_kv, kv_len, groups, head_dim, blocked=True),
                _seq_specs(block_kv, kv_len, groups, head_dim, blocked=True),
                whole_row(q_len),
                pl.BlockSpec((None, None, q_len), lambda b, h, j: (b, h, 0)),
                pl.BlockSpec((None, None, q_len), lambda b, h, j: (b, h, 0)),
                _ids_spec(None, q_len), _ids_spec(block_kv, kv_len),
                _ids_spec(None, q_len), _ids_spec(block_kv, kv_len),
                *([_ids_spec(None, q_len), _ids_spec(block_kv, kv_len)] if grouped else [])],
      out_specs=[per_head_out, per_head_out],
      # Per query head: fp32 where a kv head's gradient is then summed over its group of q heads, else
      # written in k's dtype as the caller gets it (the same values, half the bytes).
      out_shape=[platform.varying_struct((batch, kv_len, heads, head_dim), jnp.float32 if groups > 1 else k.dtype,
                                         (kv_count, kv_order, q, k, v, d_out, lse, delta, ids))] * 2,
      name="ejax_varlen_attention_dkv", **common,
  )(kv_count, kv_order, q, k, v, d_out, lse, delta, *ids)
  if groups == 1:
    return dq, dk, dv
  group_sum = lambda x: x.reshape(batch, kv_len, kv_heads, groups, head_dim).sum(3)
  return dq, group_sum(dk).astype(k.dtype), group_sum(dv).astype(v.dtype)
