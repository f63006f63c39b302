"""Attention backward as Pallas Mosaic GPU kernels (wgmma + TMA, Hopper) over per-query key ranges.

The backward of impls "mosaic" and "mosaic_own" (ops.py): tokamax's or ejax's Mosaic GPU forward
(mosaic_forward.py) gives out and lse, these two kernels give dQ and dK/dV. tokamax's own SM90 backward masks each query's key range element-wise but
bounds its loops only for causal masks, so over packed rows it does the dense row's work; ejax's
Triton backward skips by segment but runs at ~75 TFLOP/s on an H200 (BENCHMARKS.md). These kernels
bound every loop by the ranges: a dQ tile visits only the kv tiles its queries' ranges touch (each of
its warpgroups computes those of its own 64 queries only), a dK/dV tile only the q blocks whose ranges
reach it (tile bounds computed in XLA, read by the kernel).

Layout (as in jax's Mosaic GPU attention example): a warpgroup issues the TMA copies, of each work
item's own tiles (two items' buffers when persistent) and of the streamed operand into a ring of `stages`
shared-memory slots; compute warpgroups of 64 rows each (two in dQ, one in dK/dV: DQ_WGS, DKV_WGS)
hand a buffer or slot back with an arrive on its "free" barrier. A CTA runs one work item, or with
PERSISTENT one an SM loops over them, the ring and buffers carried from one item to the next (the
helpers of mosaic_common.py, shared with the forward). The scores are
recomputed in both kernels (7 matmuls a tile pair, as FlashAttention-2).

Inputs are ejax's: q [batch, q_len, heads, d], k / v [batch, kv_len, kv_heads, d] (bf16 / f16),
lse [batch, heads, q_len] f32 (natural log, 0 where a query sees no key), per query k_start / k_end
[batch, q_len] (an empty range where it sees none). q_len and kv_len must be multiples of 128 (routes.py
pads them), d 64 or 128 (registers). Off GPU the kernels run in Mosaic GPU
interpret mode (jax >= 0.11; tests), which has no wgmma from registers: there `mma` is a jnp dot.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ejax.kernels import platform
# available, LENGTH_MULTIPLE and MAX_HEAD_DIM are this module's API too (routes.py, the tests, the benchmark).
from ejax.kernels.attention.mosaic_common import (  # noqa: F401
    LENGTH_MULTIPLE, LOG2E, MAX_HEAD_DIM, SMEM_BYTES, _key_spans, at_head_dim, available, compute_registers,
    copying_warpgroup, inner_ranges, item_part, kernel_params, kv_ring, kv_spans, load, mma, mma_pair, own_buffers,
    persistent_ctas, register_operand, reloads_operands, ring_stages, scope, store_item, work_items)

# The kernels' named scopes (mosaic_common.scope), per compute warpgroup: an item's "start", its "step"s
# (dQ: "wait_kv", "scores", "ds", "dq_mma"; dK/dV: "wait_q", "scores", "wait_rows", "p", "mask",
# "wait_do", "dv_mma", "dp", "dk_mma", with WGMMA_PAIRS "dkv_mma" for the last two), dQ's tiles
# "pass_by", the item's "end".

# Compute warpgroups a CTA, beside the one that issues the copies. dQ: two (its accumulator and two
# score tiles fit the 168 registers a thread of a 384-thread CTA). dK/dV: one, so a thread may use
# 255 (the one measured). With two, the first design spilled 256 bytes a thread for its two
# accumulators and three score tiles (MOSAIC_GPU_DUMP_PTXAS, compile-only H100, jaxlib 0.11.2); since
# the copying warpgroup loads the item's K and V too, two compile to 168 registers without spills.
DQ_WGS = 2
# dK/dV's by head size (mosaic_common.at_head_dim): two at 128, where FlashAttention-3's layout (one
# warpgroup's softmax beside the other's wgmmas) took the forward+backward from 174-180 to 191-199
# TFLOP/s in every arm timed with it on 2026-12-04, gradients as right as one's; no GPU has run it at 64.
DKV_WGS = {128: 2, None: 1}
# Both kernels a CTA an SM looping over their work items (static round-robin, plgpu.nd_loop): the copying
# warpgroup fetches the next item's own tiles (double-buffered) and ring while the compute ones finish
# the last, so no CTA start-up between items. Else a CTA an item. True or False, or the head sizes at
# which it is persistent: 128, where both H200 windows of 2026-11-30 timed the forward+backward faster
# with it (3.04 against 3.35 ms, 177.3 against 161.1 TFLOP/s) and its gradients right (4.6e-3, as a CTA
# an item's). No GPU has checked it at 64 (benchmarks/attention.py --check_variants does).
PERSISTENT: bool | tuple[int, ...] = (128,)
# Each kernel's own operands in registers for its score wgmmas (RS): Q and dO in dQ (64 more registers a
# thread at head size 128), K in dK/dV. From shared memory (SS) a 64 x 64 x 16 wgmma reads all of an
# SM's shared-memory bandwidth (mosaic_forward.Q_IN_REGISTERS). Off: the measured route's form.
OPERANDS_IN_REGISTERS = False
# The backward's wgmmas two at a time. dK/dV: S^T and dP^T issued together and the exp2 and mask computed
# while dP^T runs, then dV and dK issued together and waited for once; else each of the four is waited
# for as it is issued, nothing beside it: the 2026-11-30 profile's dK/dV step took 2,421 cycles against
# the 1,024 of its wgmmas (scores 340, P 338, dP 311, dK 307, dV 305, mask 113, waits 282). dO is waited
# for before dP^T, freed once dV is done. dQ (which issues S and dP together already): the exp2 and mask
# computed while dP runs, not after both are waited for (its step: 2,069 cycles against 1,536). Off until
# a GPU times it (the attention figure's variants "backward wgmmas in pairs").
WGMMA_PAIRS = False
# Both kernels' ring slots; None: the deepest that fits shared memory up to mosaic_common.MAX_STAGES
# (at head size 128 with a CTA an item: dQ 5, dK/dV 5). Was 2.
STAGES = None


def persistent_at(head_dim: int, persistent: bool | tuple[int, ...] | None = None) -> bool:
  """Whether the kernels run persistent at this head size: `persistent`, or where None PERSISTENT
  (either a bool or the head sizes at which they do)."""
  persistent = PERSISTENT if persistent is None else persistent
  return head_dim in persistent if isinstance(persistent, tuple) else bool(persistent)


def _dq_sizes(head_dim: int, block_q: int, block_kv: int, persistent: bool) -> tuple[int, int]:
  """dQ's shared memory (bytes beside the ring: Q and dO tiles, one item's or persistent two; bytes a
  ring slot: a K and a V tile), 16-bit."""
  return 2 * 2 * own_buffers(persistent) * DQ_WGS * block_q * head_dim, 2 * 2 * block_kv * head_dim


def _dkv_sizes(head_dim: int, block_q: int, block_kv: int, persistent: bool) -> tuple[int, int]:
  """dK/dV's: its K and V tiles beside the ring; a slot holds a Q and a dO tile and their four f32 rows."""
  return (2 * 2 * own_buffers(persistent) * at_head_dim(DKV_WGS, head_dim) * block_kv * head_dim,
          2 * 2 * block_q * head_dim + 4 * block_q * 4)


def stages_for(head_dim: int, block_q: int = 64, block_kv: int = 64, stages: int | None = None,
               persistent: bool = False) -> tuple[int, int]:
  """(dQ's, dK/dV's) ring slots: `stages`, else STAGES, else the deepest that fits each kernel
  (mosaic_common.ring_stages)."""
  stages = STAGES if stages is None else stages
  return tuple(ring_stages(*sizes(head_dim, block_q, block_kv, persistent), stages)
               for sizes in (_dq_sizes, _dkv_sizes))


def smem_bytes(head_dim: int, block_q: int = 64, block_kv: int = 64, stages: int | None = None,
               persistent: bool = False) -> int:
  """Shared memory of the larger kernel: its own two operands' tiles and its ring of streamed tiles."""
  return max(fixed + slots * slot for (fixed, slot), slots in zip(
      (_dq_sizes(head_dim, block_q, block_kv, persistent), _dkv_sizes(head_dim, block_q, block_kv, persistent)),
      stages_for(head_dim, block_q, block_kv, stages, persistent)))


def head_dim_fits(head_dim: int, block_q: int = 64, block_kv: int = 64, stages: int | None = None,
                  persistent: bool = False) -> bool:
  """128-byte swizzled rows (a multiple of 64 elements), the accumulators in registers and the tiles
  with a ring of two slots or more in a CTA's shared memory: 64 or 128."""
  return (head_dim % 64 == 0 and head_dim <= MAX_HEAD_DIM
          and min(stages_for(head_dim, block_q, block_kv, stages, persistent)) >= 2
          and smem_bytes(head_dim, block_q, block_kv, stages, persistent) <= SMEM_BYTES)


def supports(q, k, block_q: int = 64, block_kv: int = 64, stages: int | None = None, persistent: bool = False) -> bool:
  """Whether the kernels take these operands as they are (routes.py pads lengths first)."""
  return (available() is None and q.dtype in (jnp.bfloat16, jnp.float16)
          and head_dim_fits(q.shape[-1], block_q, block_kv, stages, persistent)
          and q.shape[1] % LENGTH_MULTIPLE == 0 and k.shape[1] % LENGTH_MULTIPLE == 0
          and LENGTH_MULTIPLE % (DQ_WGS * block_q) == 0
          and LENGTH_MULTIPLE % (at_head_dim(DKV_WGS, q.shape[-1]) * block_kv) == 0)


def _tile_bounds(k_start, k_end, kv_len: int, *, block_q: int, block_kv: int, dkv_wgs: int):
  """Loop bounds [lo, hi) a CTA, int32 [batch, tiles]: the kv tiles (of block_kv keys) each dQ tile of
  DQ_WGS * block_q queries visits, and the q blocks (of block_q) each dK/dV tile of dkv_wgs * block_kv
  keys visits. Both are spans, so any query layout is right; on packed rows they are tight."""
  kv_lo, kv_hi = kv_spans(k_start, k_end, DQ_WGS * block_q, block_kv)

  # q block i reaches kv tile j when some query's range meets the tile's keys [j * t, (j + 1) * t).
  lo, hi = _key_spans(k_start, k_end, block_q)
  tile_kv = dkv_wgs * block_kv
  starts = jnp.arange(kv_len // tile_kv, dtype=jnp.int32) * tile_kv
  meets = (lo[:, :, None] < starts + tile_kv) & (hi[:, :, None] > starts)
  blocks = jnp.arange(lo.shape[1], dtype=jnp.int32)[None, :, None]
  q_hi = jnp.max(jnp.where(meets, blocks + 1, 0), axis=1)
  q_lo = jnp.where(q_hi > 0, jnp.min(jnp.where(meets, blocks, lo.shape[1]), axis=1), 0)
  return kv_lo, kv_hi, q_lo.astype(jnp.int32), q_hi.astype(jnp.int32)


def visited_pairs(k_start, k_end, kv_len: int, block_q: int = 64, block_kv: int = 64,
                  head_dim: int | None = None) -> tuple[int, int]:
  """(query, key) pairs the dQ and the dK/dV kernel compute for these ranges at a head size (their tile
  loops; a dQ warpgroup computes the tiles of its own queries' span only)."""
  dkv_wgs = at_head_dim(DKV_WGS, head_dim)
  _, _, q_lo, q_hi = _tile_bounds(k_start, k_end, kv_len, block_q=block_q, block_kv=block_kv, dkv_wgs=dkv_wgs)
  wg_lo, wg_hi = kv_spans(k_start, k_end, block_q, block_kv)
  dq = int(jnp.sum(wg_hi - wg_lo)) * block_q * block_kv
  dkv = int(jnp.sum(q_hi - q_lo)) * dkv_wgs * block_kv * block_q
  return dq, dkv


def backward(q, k, v, out, lse, d_out, k_start, k_end, *, scale: float, block_q: int = 64,
             block_kv: int = 64, stages: int | None = None, persistent: bool | None = None,
             ctas: int | None = None, interpret: bool | None = None):
  """(dq, dk, dv) of attention over each query's key range [k_start, k_end). `persistent` (None: the
  module's PERSISTENT; persistent_at): both kernels a CTA an SM (or `ctas`) looping over the work items. `stages`
  (None: stages_for's): both kernels' ring slots."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  batch, q_len, heads, head_dim = q.shape
  _, kv_len, kv_heads, _ = k.shape
  persistent = persistent_at(head_dim, persistent)
  if not supports(q, k, block_q, block_kv, stages, persistent):
    raise ValueError(f"mosaic attention backward: needs bf16/f16, head_dim 64 or 128, "
                     f"q_len and kv_len multiples of {LENGTH_MULTIPLE}; "
                     f"got {q.dtype}, q {q.shape}, k {k.shape}" + (f" ({available()})" if available() else ""))
  if interpret is None:
    interpret = not platform.on_gpu()
  dq_stages, dkv_stages = stages_for(head_dim, block_q, block_kv, stages, persistent)
  buffers = own_buffers(persistent)
  groups = heads // kv_heads
  dtype = q.dtype
  k, v, d_out = k.astype(dtype), v.astype(dtype), d_out.astype(dtype)

  # Per query, for both kernels: lse and delta (log2 units), k_start and k_end, as f32 rows
  # [batch, heads, 4, q_len] (indices below 2^24 are exact in f32): one TMA a q block.
  delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), d_out.astype(jnp.float32))
  ranges = jnp.broadcast_to(jnp.stack([k_start, k_end], 1).astype(jnp.float32)[:, None],
                            (batch, heads, 2, q_len))
  rows = jnp.concatenate([jnp.stack([lse.astype(jnp.float32) * LOG2E, delta], 2), ranges], 2)

  dkv_wgs = at_head_dim(DKV_WGS, head_dim)
  kv_lo, kv_hi, qb_lo, qb_hi = _tile_bounds(k_start, k_end, kv_len, block_q=block_q, block_kv=block_kv,
                                            dkv_wgs=dkv_wgs)
  wg_lo, wg_hi = kv_spans(k_start, k_end, block_q, block_kv)
  inner_lo, inner_hi = inner_ranges(k_start, k_end, block_q)
  tile_kv = dkv_wgs * block_kv

  tiling = plgpu.TilingTransform((8, 64))
  swizzle = plgpu.SwizzleTransform(128)
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = plgpu.Layout.WGMMA.reduce(1)  # a value per row of a [m, n] WGMMA array
  col_layout = plgpu.Layout.WGMMA.reduce(0)  # a value per column
  params, out_name, scratch_name = kernel_params(interpret)
  c = scale * LOG2E
  mma_ = functools.partial(mma, interpret=interpret)

  def tiles(count, rows_):  # `count` [rows_, head_dim] tiles in wgmma's swizzled layout
    return plgpu.SMEM((count, rows_, head_dim), dtype, transforms=(tiling, swizzle))

  # ---- dQ: a work item per (head, 128 queries, batch); K and V stream through the ring. ----
  dq_items = (heads, q_len // (DQ_WGS * block_q), batch)

  def dq_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, lo_ref, hi_ref, wg_lo_ref, wg_hi_ref, inner_lo_ref,
                inner_hi_ref, dq_ref, q_smem, do_smem, k_smem, v_smem, q_bar, do_bar, q_free, k_bar, v_bar,
                k_free, v_free):
    wg = lax.axis_index("wg")

    @pl.when(wg < DQ_WGS)
    def _compute():
      plgpu.set_max_registers(compute_registers(DQ_WGS), action="increase")

      @functools.partial(work_items, dq_items, lo_ref, hi_ref)
      def _item(h, qi, b, j, g):
        with scope("start"):
          lo, steps, block, rows_q, buf = item_part(lo_ref, hi_ref, b, qi, j, wg, DQ_WGS, block_q)
          q_s, do_s = q_smem.at[buf], do_smem.at[buf]
          lse2, delta_, start, end = (load(rows_ref.at[b, h, i, rows_q], row_layout, optimized=False)
                                      for i in range(4))
          inner_lo, inner_hi = inner_lo_ref[b, block], inner_hi_ref[b, block]
          # This warpgroup computes only the kv tiles its own queries' ranges touch, steps [first, last)
          # of the item's; it waits for and frees the others (each barrier phase is waited for once).
          first = lax.min(lax.max(wg_lo_ref[b, block] - lo, 0), steps)
          last = lax.min(lax.max(wg_hi_ref[b, block] - lo, first), steps)
          plgpu.barrier_wait(q_bar.at[buf])
          plgpu.barrier_wait(do_bar.at[buf])
          # Q and dO in registers for the two score wgmmas (RS), as the forward's Q (mosaic_forward.py);
          # loaded in each step where the SASS needs it (mosaic_common.reloads_operands).
          held = OPERANDS_IN_REGISTERS and not interpret
          reload = reloads_operands(head_dim, block_kv)
          q_op, do_op = (register_operand(ref, wgmma_layout, held, reload) for ref in (q_s, do_s))
        shape = (block_q, block_kv)
        row = lambda x: lax.broadcast_in_dim(x, shape, [0])

        @scope("step")
        def step(i, dq_acc):
          slot = lax.rem(g + i, dq_stages)
          with scope("wait_kv"):
            plgpu.barrier_wait(k_bar.at[slot])
            plgpu.barrier_wait(v_bar.at[slot])

          kv_base = (lo + i) * block_kv

          def mask(p):
            key = (kv_base + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout)).astype(jnp.float32)
            return jnp.where((key >= row(start)) & (key < row(end)), p, 0.0)

          def weights(s):
            p = jnp.exp2(s * c - row(lse2))
            return lax.cond((kv_base < inner_lo) | (kv_base + block_kv > inner_hi), mask, lambda p: p, p)

          def scores(s_ref, dp_ref):  # (P, dP); with WGMMA_PAIRS, P while dP's wgmma runs
            plgpu.wgmma(s_ref, q_op(), k_smem.at[slot].T)
            plgpu.wgmma(dp_ref, do_op(), v_smem.at[slot].T)
            if WGMMA_PAIRS:
              p = scope("ds")(weights)(plgpu.wgmma_accumulator_load(s_ref, wait_n=1))
              return p, plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)
            plgpu.wgmma_wait(0)
            return s_ref[...], dp_ref[...]

          acc = plgpu.ACC(shape, jnp.float32)
          s_or_p, dp = scope("scores")(pl.run_scoped)(scores, acc, acc)
          plgpu.barrier_arrive(v_free.at[slot])
          with scope("ds"):
            p = s_or_p if WGMMA_PAIRS else weights(s_or_p)
            ds = p * (dp - row(delta_))
          dq_acc = scope("dq_mma")(mma_)(dq_acc, ds.astype(dtype), k_smem.at[slot])
          plgpu.barrier_arrive(k_free.at[slot])
          return dq_acc

        @scope("pass_by")
        def pass_by(i):
          slot = lax.rem(g + i, dq_stages)
          plgpu.barrier_wait(k_bar.at[slot])
          plgpu.barrier_wait(v_bar.at[slot])
          plgpu.barrier_arrive(v_free.at[slot])
          plgpu.barrier_arrive(k_free.at[slot])

        dq = plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), wgmma_layout)
        pl.loop(0, first)(pass_by)
        dq = lax.fori_loop(first, last, step, dq)
        pl.loop(last, steps)(pass_by)
        with scope("end"):
          q_s[...] = (dq * scale).astype(dtype)
          store_item([(q_s, dq_ref.at[b, rows_q, h])], q_free, j)

    @pl.when(wg == DQ_WGS)
    def _memory():
      def own(h, qi, b, half):  # this item's queries and their dO, for both compute warpgroups
        rows_q = lambda w: pl.ds((qi * DQ_WGS + w) * block_q, block_q)
        return [copy for w in range(DQ_WGS) for copy in (
            (q_ref.at[b, rows_q(w), h], q_smem.at[half * DQ_WGS + w], q_bar.at[half * DQ_WGS + w]),
            (do_ref.at[b, rows_q(w), h], do_smem.at[half * DQ_WGS + w], do_bar.at[half * DQ_WGS + w]))]

      copying_warpgroup(dq_items, lo_ref, hi_ref, own,
                        kv_ring(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, groups, block_kv), q_free,
                        (k_free, v_free), dq_stages)

  dq = plgpu.kernel(
      dq_kernel, **{out_name: jax.ShapeDtypeStruct(q.shape, dtype)},
      **{scratch_name: [tiles(buffers * DQ_WGS, block_q)] * 2 + [tiles(dq_stages, block_kv)] * 2
      + [plgpu.Barrier(num_barriers=2 * DQ_WGS)] * 2 + [plgpu.Barrier(num_arrivals=DQ_WGS, num_barriers=2)]
      + [plgpu.Barrier(num_barriers=dq_stages)] * 2 + [plgpu.Barrier(num_arrivals=DQ_WGS, num_barriers=dq_stages)] * 2},
      grid=(persistent_ctas(math.prod(dq_items), persistent, ctas),), grid_names=("ctas",),
      num_threads=DQ_WGS + 1, **params)(q, k, v, d_out, rows, kv_lo, kv_hi, wg_lo, wg_hi, inner_lo, inner_hi)

  # ---- dK, dV: a work item per (q head, dkv_wgs x 64 keys, batch); Q, dO and the rows stream through
  # the ring. ----
  dkv_items = (heads, kv_len // tile_kv, batch)

  def dkv_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, lo_ref, hi_ref, inner_lo_ref, inner_hi_ref, dk_ref, dv_ref,
                 k_smem, v_smem, q_smem, do_smem, rows_smem, k_bar, v_bar, kv_free, q_bar, do_bar, rows_bar,
                 q_free, do_free, rows_free):
    wg = lax.axis_index("wg")

    @pl.when(wg < dkv_wgs)
    def _compute():
      plgpu.set_max_registers(compute_registers(dkv_wgs), action="increase")

      @functools.partial(work_items, dkv_items, lo_ref, hi_ref)
      def _item(h, ki, b, j, g):
        with scope("start"):
          lo, steps, own, keys, buf = item_part(lo_ref, hi_ref, b, ki, j, wg, dkv_wgs, block_kv)
          base = own * block_kv  # the warpgroup's first key
          k_s, v_s = k_smem.at[buf], v_smem.at[buf]
          plgpu.barrier_wait(k_bar.at[buf])
          plgpu.barrier_wait(v_bar.at[buf])
          # K alone, and with one compute warpgroup: with V too it spilled 144 bytes a thread at head
          # size 128, with two warpgroups 16 (ptxas, compile-only H100).
          held = OPERANDS_IN_REGISTERS and not interpret and dkv_wgs == 1
          # loaded in each step where the SASS needs it (mosaic_common.reloads_operands)
          k_op = register_operand(k_s, wgmma_layout, held, reloads_operands(head_dim, block_kv))
        v_op = v_s
        shape = (block_kv, block_q)
        col = lambda x: lax.broadcast_in_dim(x, shape, [1])

        # The per-query rows are read from shared memory where they are used, not held in registers
        # across the step: the dK/dV warpgroup is the one that runs short of them.
        row_of = lambda slot: lambda r: col(load(rows_smem.at[slot, r], col_layout))

        def weights(s_t, row, i):  # P^T from the scores, 0 outside each query's range where a tile crosses an edge
          with scope("p"):
            p_t = jnp.exp2(s_t * c - row(0))

          def mask(p_t):
            key = (base + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma_layout)).astype(jnp.float32)
            return jnp.where((key >= row(2)) & (key < row(3)), p_t, 0.0)

          block = lo + i
          inside = (base >= inner_lo_ref[b, block]) & (base + block_kv <= inner_hi_ref[b, block])
          return scope("mask")(lax.cond)(inside, lambda p_t: p_t, mask, p_t)

        @scope("step")
        def step(i, carry):
          dk_acc, dv_acc = carry
          slot = lax.rem(g + i, dkv_stages)
          scope("wait_q")(plgpu.barrier_wait)(q_bar.at[slot])

          def scores_t(s_ref):
            plgpu.wgmma(s_ref, k_op(), q_smem.at[slot].T)
            plgpu.wgmma_wait(0)
            return s_ref[...]

          s_t = scope("scores")(pl.run_scoped)(scores_t, plgpu.ACC(shape, jnp.float32))
          row = row_of(slot)
          scope("wait_rows")(plgpu.barrier_wait)(rows_bar.at[slot])
          p_t = weights(s_t, row, i)
          scope("wait_do")(plgpu.barrier_wait)(do_bar.at[slot])

          dv_acc = scope("dv_mma")(mma_)(dv_acc, p_t.astype(dtype), do_smem.at[slot])

          def dp_t(dp_ref):
            plgpu.wgmma(dp_ref, v_op, do_smem.at[slot].T)
            plgpu.wgmma_wait(0)
            return dp_ref[...]

          ds_t = p_t * (scope("dp")(pl.run_scoped)(dp_t, plgpu.ACC(shape, jnp.float32)) - row(1))
          plgpu.barrier_arrive(rows_free.at[slot])
          plgpu.barrier_arrive(do_free.at[slot])
          dk_acc = scope("dk_mma")(mma_)(dk_acc, ds_t.astype(dtype), q_smem.at[slot])
          plgpu.barrier_arrive(q_free.at[slot])
          return dk_acc, dv_acc

        @scope("step")
        def paired_step(i, carry):  # WGMMA_PAIRS
          dk_acc, dv_acc = carry
          slot = lax.rem(g + i, dkv_stages)
          scope("wait_q")(plgpu.barrier_wait)(q_bar.at[slot])
          scope("wait_do")(plgpu.barrier_wait)(do_bar.at[slot])
          row = row_of(slot)

          def scores_t(s_ref, dp_ref):  # (P^T, dP^T): the exp2 and mask while dP^T's wgmma runs
            with scope("scores"):
              plgpu.wgmma(s_ref, k_op(), q_smem.at[slot].T)
              plgpu.wgmma(dp_ref, v_op, do_smem.at[slot].T)
              s_t = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
            scope("wait_rows")(plgpu.barrier_wait)(rows_bar.at[slot])
            p_t = weights(s_t, row, i)
            return p_t, scope("dp")(plgpu.wgmma_accumulator_load)(dp_ref, wait_n=0)

          acc = plgpu.ACC(shape, jnp.float32)
          p_t, dp = pl.run_scoped(scores_t, acc, acc)
          ds_t = p_t * (dp - row(1))
          plgpu.barrier_arrive(rows_free.at[slot])
          dv_acc, dk_acc = scope("dkv_mma")(mma_pair)((dv_acc, dk_acc), (p_t.astype(dtype), ds_t.astype(dtype)),
                                                      (do_smem.at[slot], q_smem.at[slot]), interpret)
          plgpu.barrier_arrive(do_free.at[slot])
          plgpu.barrier_arrive(q_free.at[slot])
          return dk_acc, dv_acc

        zeros = plgpu.layout_cast(jnp.zeros((block_kv, head_dim), jnp.float32), wgmma_layout)
        dk, dv = lax.fori_loop(0, steps, paired_step if WGMMA_PAIRS else step, (zeros, zeros))
        with scope("end"):
          k_s[...] = (dk * scale).astype(dtype)
          v_s[...] = dv.astype(dtype)
          store_item([(k_s, dk_ref.at[b, keys, h]), (v_s, dv_ref.at[b, keys, h])], kv_free, j)

    @pl.when(wg == dkv_wgs)
    def _memory():
      def own(h, ki, b, half):  # this item's keys and values, for each compute warpgroup
        hk = lax.div(h, jnp.array(groups, h.dtype))
        keys = lambda w: pl.ds(ki * tile_kv + w * block_kv, block_kv)
        return [copy for w in range(dkv_wgs) for copy in (
            (k_ref.at[b, keys(w), hk], k_smem.at[half * dkv_wgs + w], k_bar.at[half * dkv_wgs + w]),
            (v_ref.at[b, keys(w), hk], v_smem.at[half * dkv_wgs + w], v_bar.at[half * dkv_wgs + w]))]

      def ring(h, ki, b, block, slot):  # q block `block`: its queries, their rows and dO
        queries = pl.ds(block * block_q, block_q)
        return [(q_ref.at[b, queries, h], q_smem.at[slot], q_bar.at[slot]),
                (rows_ref.at[b, h, :, queries], rows_smem.at[slot], rows_bar.at[slot]),
                (do_ref.at[b, queries, h], do_smem.at[slot], do_bar.at[slot])]

      copying_warpgroup(dkv_items, lo_ref, hi_ref, own, ring, kv_free, (q_free, rows_free, do_free), dkv_stages)

  per_head = jax.ShapeDtypeStruct((batch, kv_len, heads, head_dim), dtype)
  dk, dv = plgpu.kernel(
      dkv_kernel, **{out_name: (per_head, per_head)},
      **{scratch_name: [tiles(buffers * dkv_wgs, block_kv)] * 2 + [tiles(dkv_stages, block_q)] * 2
      + [plgpu.SMEM((dkv_stages, 4, block_q), jnp.float32)]
      + [plgpu.Barrier(num_barriers=2 * dkv_wgs)] * 2 + [plgpu.Barrier(num_arrivals=dkv_wgs, num_barriers=2)]
      + [plgpu.Barrier(num_barriers=dkv_stages)] * 3
      + [plgpu.Barrier(num_arrivals=dkv_wgs, num_barriers=dkv_stages)] * 3},
      grid=(persistent_ctas(math.prod(dkv_items), persistent, ctas),), grid_names=("ctas",),
      num_threads=dkv_wgs + 1, **params)(q, k, v, d_out, rows, qb_lo, qb_hi, inner_lo, inner_hi)
  if groups > 1:  # each kv head's gradient is the sum over the q heads that read it
    grouped = lambda x: x.reshape(batch, kv_len, kv_heads, groups, head_dim).astype(jnp.float32).sum(3)
    dk, dv = grouped(dk).astype(dtype), grouped(dv).astype(dtype)
  return dq, dk, dv
