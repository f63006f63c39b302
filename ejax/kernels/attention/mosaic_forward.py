"""Attention forward as a Pallas Mosaic GPU kernel (wgmma + TMA, Hopper) over per-query key ranges.

The forward of `impl="mosaic_own"` (ops.py), whose backward is mosaic_backward.py's: ejax's own
kernels both ways, with no tokamax. tokamax's SM90 forward (impl "mosaic"'s) bounds a CTA of 128
queries by their ranges' hull: 64 % of the pairs it visits on the VLA rows of benchmarks/attention.py
are allowed. Here each compute warpgroup of 64 queries runs the wgmmas and the softmax only for the kv
tiles its own queries' ranges touch (79 % useful on those rows); the CTA's ring of K/V tiles covers
the hull, and a warpgroup steps over the tiles outside its span without computing (it still waits
and frees each slot, keeping the barriers' phases).

Layout (as FlashAttention-3 and jax's Mosaic GPU attention example): a warpgroup issues the TMA
copies of K and V into a ring of `stages` shared-memory slots; FWD_WGS compute warpgroups keep their
accumulator in registers. With two, a schedule barrier takes turns between them (PINGPONG): one runs
its softmax while the other's wgmmas hold the tensor cores. The element-wise mask is applied only on
tiles that cross an edge of some query's range.

Inputs are ejax's: q [batch, q_len, heads, d], k / v [batch, kv_len, kv_heads, d] (bf16 / f16), per
query k_start / k_end [batch, q_len] (an empty range where it sees none). Returns out (q's dtype) and
lse [batch, heads, q_len] f32 (natural log): both 0 where a query sees no key, the convention of the
backward. q_len and kv_len multiples of 128 (routes.py pads them), d 64 or 128. Off GPU the kernel runs
in Mosaic GPU interpret mode (jax >= 0.11; tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ejax.kernels import platform
from ejax.kernels.attention.mosaic_common import (LENGTH_MULTIPLE, LOG2E, MAX_HEAD_DIM, SMEM_BYTES, at_head_dim,
                                                  available, compute_registers, copying_warpgroup, inner_ranges,
                                                  item_part, kernel_params, kv_ring, kv_spans, load, mma,
                                                  named_barrier_sync, own_buffers, persistent_ctas, register_operand,
                                                  reloads_operands, ring_stages, scope, store_item, wgmma_wait_after,
                                                  work_items, TURN_BARRIER)

FWD_WGS = 2  # compute warpgroups a CTA (64 queries each), beside the copying one
PINGPONG = True  # with two: a schedule barrier alternates their tensor-core phases (FlashAttention-3)
# Keys a ring slot, by head size (mosaic_common.at_head_dim): smaller tiles skip more of the pairs the
# ranges forbid; at head size 128, 128-key tiles (FlashAttention-3's) halve the steps and their turns
# and waits, and with Q from shared memory they are the fastest forward timed (2026-12-04 evening, calls
# back to back: 276-283 TFLOP/s against 262-265 with 64-key tiles; right at 64 and 128 in
# --check_variants). At 64 the 64-key form, the only one a GPU has timed there.
BLOCK_KV = {128: 128, None: 64}
# Ring slots; None: the deepest that fits shared memory up to MAX_STAGES (5 at head size 128 with a CTA
# an item, 4 persistent; 6 at 64). Was 2, too shallow to hide a copy's latency at 64-key steps (BENCHMARKS.md).
STAGES = None
# A CTA an SM looping over the work items (static round-robin), its copying warpgroup fetching the
# next item's Q and K/V while the compute ones finish the last: no CTA start-up between items. Else a
# CTA an item.
PERSISTENT = False
# Q held in registers for the scores' wgmma, an RS wgmma (32 more registers a thread at head size 128;
# the PTX shows m64n64k16 with a register A operand). From shared memory (SS), a 64-row wgmma against
# 64-key tiles reads 128 bytes a clock, all of an SM's shared-memory bandwidth (A: 2 KB and B: 2 KB a
# k-step of 16, 64 x 64 x 16 x 2 flops at 4,096 a clock), before the TMA copies write theirs: it could
# not run at the tensor cores' rate. From registers it reads B only, 64 bytes a clock. Where ptxas would
# overwrite them (mosaic_common.RELOAD_OPERANDS) the fragments are loaded every step.
# By head size as BLOCK_KV: at 128, Q from shared memory (SS) with the 128-key tiles: a 64 x 128 x 16
# wgmma reads A once for twice the columns, half the bandwidth a FLOP of the 64-key form.
Q_IN_REGISTERS = {128: False, None: True}
# The next step's K waited for while this step's PV wgmma runs, not after it (jax's Mosaic GPU attention
# example does so): the wait, and a copy still landing, leave the warpgroup's tensor-core phase.
# Off until a GPU times it beside the form measured on 2026-11-29.
K_WAIT_DURING_PV = False
# Each warpgroup runs a step's softmax while its own previous PV wgmma is on the tensor cores
# (FlashAttention-3's intra-warpgroup overlap; K_WAIT_DURING_PV off). With PINGPONG the warpgroups pass
# a token, once a step, to issue their wgmmas in turn; without, their phases drift apart by themselves.
# Timed on 2026-11-30 at 2 % over the forward as configured, when ptxas waited for the PV before the
# softmax; since 2026-12-01 the SASS has the whole softmax (row maxima, 32 exp2, row sums) between the
# QK's wait and the PV's. Off until a GPU times that form and checks it (the attention figure's variants
# "softmax beside its own PV").
OVERLAP_SOFTMAX = False
# A step's row sums of its weights (l, a sum over 64 keys and two warp shuffles deep) added while the next
# step's QK wgmma runs, not between the weights and the PV: the on-device profile of 2026-11-30 had the
# softmax at 719 of a step's 2,069 cycles, the step at twice its wgmmas' 1,024, and the two warpgroups'
# turns bound by one's softmax and wgmmas (FlashAttention-3 sums late too). The fp32 weights stay live
# across the PV (32 registers a thread). Off until a GPU times it (the attention figure's variant "row
# sums during the next QK"); OVERLAP_SOFTMAX has its own order and ignores it.
ROW_SUM_DEFERRED = False
# A step's PV product into a fresh accumulator, and the running one rescaled and added to it during the
# next step's QK wgmma, before the turn (64 FFMAs a thread at head size 128), not rescaled inside the
# softmax (64 FMULs after the exp2s, in ptxas's order). With the ping-pong a warpgroup's softmax is on the
# step's critical path, while between its QK and its turn it waits for the other warpgroup's softmax. The
# product's 64 registers live into the next step; ptxas zeroes them before each PV. With ROW_SUM_DEFERRED
# too the weights' 32 also live there, and at head size 128 ptxas spills (7 local accesses): the two are
# not timed together. Off until a GPU times it (the attention figure's variant "rescaled after the PV");
# OVERLAP_SOFTMAX has its own order and ignores it.
RESCALE_AFTER_PV = False
# The ping-pong's turns at a hardware named barrier (bar.sync over both compute warpgroups, as
# FlashAttention-3), not a shared-memory mbarrier each warpgroup arrives on and then waits for. The SASS
# (compile-only H100) shows why: the mbarrier arrive that ends a warpgroup's softmax is a release that
# orders only memory operations, and ptxas moves it up to the softmax's start, so the other warpgroup is
# let into its own softmax at once: the two softmaxes run together and neither overlaps the other's
# wgmmas (the 2026-11-30 profile's step: softmax 719 + both warpgroups' wgmmas 1,024 + waits ~330 =
# 2,069 cycles). ptxas keeps a bar.sync where it is. The turn before a PV then starts once V has landed.
# A GPU only (inline PTX; interpret mode keeps the mbarrier). By head size as BLOCK_KV: on at 128, with
# the 128-key tiles (timed and right there on 2026-12-04); no GPU has run it at 64.
NAMED_TURNS = {128: True, None: False}
# Where a warpgroup's span starts in the upper half of its first tile or ends in the lower half of its last
# one (no query of its 64 needs the other half), that step computes the needed half alone: its QK and PV
# wgmmas and its softmax over block_kv / 2 keys (tiles of 128 keys or more). On the attention figure's
# block-causal rows at head size 128, 487 of the 2,966 steps of 128 keys have such a half: the pairs
# computed fall from 24.3M to 22.3M (77 % to 84 % of them allowed, as with 64-key tiles), for each
# step's turns and waits as with 128-key tiles. The ring still copies whole tiles. By head size as
# BLOCK_KV; not with OVERLAP_SOFTMAX or ROW_SUM_DEFERRED, whose carried weights have a step's width.
# Off until a GPU times it (the attention figure's variant "128-key tiles' unneeded halves skipped").
EDGE_HALVES = False
# A tile that crosses its queries' starts only (or their ends only) masked by that edge's compare alone:
# one FSETP and one FSEL a score, not two of each (the SASS of the 128-key step: 320 instructions a
# thread a masked step, 128 a score's compare and select each way). With the ping-pong a warpgroup's step
# is its mask and softmax twice over (the other warpgroup's wgmmas, 1,024 cycles, take less: the profile
# of 2026-12-04's evening gave mask 365 + softmax 1,189 of a 3,378-cycle step), so a cycle off the mask
# is two off the step. A span's first tile mostly crosses the starts and its last the ends. Off until a
# GPU times it (the attention figure's variant "each edge masked alone").
MASK_EACH_EDGE = False
LN2 = math.log(2.0)
# The kernel's named scopes (mosaic_common.scope): a compute warpgroup's "start" of an item, its "step"s
# ("wait_k", "qk" with its "turn" (and with ROW_SUM_DEFERRED the last step's "row_sum"), "mask", "softmax",
# "wait_v", "pv", with RESCALE_AFTER_PV "rescale"), the tiles it is "pass_by", its "end".


def _fixed_bytes(head_dim: int, block_q: int, compute_wgs: int, persistent: bool) -> int:
  """Shared memory beside the ring: the queries' tiles, one item's or persistent two (reused for the
  output), and the lse rows."""
  return 2 * own_buffers(persistent) * compute_wgs * block_q * head_dim + compute_wgs * block_q * 4


def stages_for(head_dim: int, block_q: int = 64, block_kv: int = 64, stages: int | None = None,
               compute_wgs: int = FWD_WGS, persistent: bool = False) -> int:
  """The K/V ring's slots: `stages`, else STAGES, else the deepest that fits (mosaic_common.ring_stages)."""
  return ring_stages(_fixed_bytes(head_dim, block_q, compute_wgs, persistent), 4 * block_kv * head_dim,
                     STAGES if stages is None else stages)


def smem_bytes(head_dim: int, block_q: int = 64, block_kv: int = 64, stages: int | None = None,
               compute_wgs: int = FWD_WGS, persistent: bool = False) -> int:
  """Shared memory a CTA: the tiles beside the ring and the K/V ring (`stages` None: stages_for's)."""
  return (_fixed_bytes(head_dim, block_q, compute_wgs, persistent)
          + stages_for(head_dim, block_q, block_kv, stages, compute_wgs, persistent) * 4 * block_kv * head_dim)


def supports(q, k, block_q: int = 64, block_kv: int = 64, stages: int | None = None, compute_wgs: int = FWD_WGS,
             persistent: bool = False) -> bool:
  """Whether the kernel takes these operands as they are (routes.py pads lengths first)."""
  tile = LENGTH_MULTIPLE
  return (available() is None and q.dtype in (jnp.bfloat16, jnp.float16)
          and q.shape[-1] % 64 == 0 and q.shape[-1] <= MAX_HEAD_DIM
          and stages_for(q.shape[-1], block_q, block_kv, stages, compute_wgs, persistent) >= 2
          and smem_bytes(q.shape[-1], block_q, block_kv, stages, compute_wgs, persistent) <= SMEM_BYTES
          and q.shape[1] % tile == 0 and k.shape[1] % tile == 0
          and tile % (compute_wgs * block_q) == 0 and tile % block_kv == 0)


def halves_apply(block_kv: int) -> bool:
  """Whether a span's edge tiles may compute one half (EDGE_HALVES; halves of 64 keys or more)."""
  return block_kv >= 128 and block_kv % 128 == 0


def spare_halves(k_start, k_end, block_q: int, block_kv: int):
  """Per warpgroup of block_q queries, int32 [batch, q_len // block_q]: bit 0 where no query of it needs the
  first half of its span's first tile (all start in the upper half), bit 1 where none needs the second half
  of its last tile (all end in the lower half); 0 where it sees no key."""
  lo, hi = kv_spans(k_start, k_end, block_q, block_kv // 2)
  return (lo % 2 + 2 * (hi % 2)).astype(jnp.int32)


def visited_pairs(k_start, k_end, block_q: int = 64, block_kv: int = 64, compute_wgs: int = FWD_WGS,
                  edge_halves: bool = False) -> tuple[int, int]:
  """(pairs the warpgroups compute, pairs the CTAs' K/V rings stream past them) for these ranges; with
  `edge_halves` a span's first and last tiles count the halves its queries need (EDGE_HALVES)."""
  step_keys = block_kv // 2 if edge_halves and halves_apply(block_kv) else block_kv
  lo, hi = kv_spans(k_start, k_end, block_q, step_keys)
  cta_lo, cta_hi = kv_spans(k_start, k_end, compute_wgs * block_q, block_kv)
  return int(jnp.sum(hi - lo)) * block_q * step_keys, int(jnp.sum(cta_hi - cta_lo)) * compute_wgs * block_q * block_kv


def forward(q, k, v, k_start, k_end, *, scale: float, block_q: int = 64, block_kv: int | None = None,
            stages: int | None = None, compute_wgs: int | None = None, pingpong: bool | None = None,
            persistent: bool | None = None, ctas: int | None = None, interpret: bool | None = None):
  """(out, lse) of attention over each query's key range [k_start, k_end); settings left None are the
  module's (FWD_WGS, PINGPONG, BLOCK_KV at q's head size, STAGES, PERSISTENT), read as the call is traced. `ctas`: a
  persistent kernel's CTAs (None: the GPU's SMs)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  batch, q_len, heads, head_dim = q.shape
  _, kv_len, kv_heads, _ = k.shape
  wgs = FWD_WGS if compute_wgs is None else compute_wgs
  block_kv = at_head_dim(BLOCK_KV, head_dim) if block_kv is None else block_kv
  persistent = PERSISTENT if persistent is None else persistent
  q_in_registers = at_head_dim(Q_IN_REGISTERS, head_dim)
  overlap = OVERLAP_SOFTMAX
  deferred_sum = ROW_SUM_DEFERRED and not overlap
  late_rescale = RESCALE_AFTER_PV and not overlap
  early_k = K_WAIT_DURING_PV and not overlap
  each_edge = MASK_EACH_EDGE
  edge_halves = at_head_dim(EDGE_HALVES, head_dim) and halves_apply(block_kv) and not overlap and not deferred_sum
  turns = (PINGPONG if pingpong is None else pingpong) and wgs == 2
  pingpong = turns and not overlap  # the schedule barrier as a rendezvous, two a step
  token = turns and overlap  # its two barriers as a token passed between the warpgroups, once a step
  if not supports(q, k, block_q, block_kv, stages, wgs, persistent):
    missing = available()
    raise ValueError(f"mosaic attention forward: needs bf16/f16, head_dim 64 or 128, q_len and kv_len "
                     f"multiples of {LENGTH_MULTIPLE}; got {q.dtype}, q {q.shape}, k {k.shape}"
                     + (f" ({missing})" if missing else ""))
  stages = stages_for(head_dim, block_q, block_kv, stages, wgs, persistent)
  if interpret is None:
    interpret = not platform.on_gpu()
  named_turns = pingpong and at_head_dim(NAMED_TURNS, head_dim) and not interpret
  groups = heads // kv_heads
  dtype = q.dtype
  k, v = k.astype(dtype), v.astype(dtype)

  # Per query its range as f32 rows [batch, 2, q_len] (indices below 2^24 are exact); per CTA the kv
  # tiles its ring streams, per warpgroup those it computes and the keys inside all its queries' ranges.
  ranges = jnp.stack([k_start, k_end], 1).astype(jnp.float32)
  cta_lo, cta_hi = kv_spans(k_start, k_end, wgs * block_q, block_kv)
  wg_lo, wg_hi = kv_spans(k_start, k_end, block_q, block_kv)
  inner_lo, inner_hi = inner_ranges(k_start, k_end, block_q)
  spare = spare_halves(k_start, k_end, block_q, block_kv) if edge_halves else jnp.zeros_like(wg_lo)

  tiling = plgpu.TilingTransform((8, 64))
  swizzle = plgpu.SwizzleTransform(128)
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  params, out_name, scratch_name = kernel_params(interpret)
  c = scale * LOG2E  # scores times c are in log2 units: exp2 and an FMA, as FlashAttention
  shape = (block_q, block_kv)
  whole, half = (0, block_kv), block_kv // 2  # a step's keys in its tile: (first, how many)

  items = (heads, q_len // (wgs * block_q), batch)  # a work item: 128 queries of one head and row

  def forward_kernel(q_ref, k_ref, v_ref, ranges_ref, cta_lo_ref, cta_hi_ref, wg_lo_ref, wg_hi_ref, inner_lo_ref,
                     inner_hi_ref, spare_ref, out_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem, q_bar, q_free, k_bar,
                     v_bar, k_free, v_free, schedule):
    wg = lax.axis_index("wg")

    def take_turn():  # both compute warpgroups arrive, then wait: one turn of the schedule barrier
      if named_turns:
        named_barrier_sync(TURN_BARRIER, wgs * 128)
      elif pingpong:
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    # With OVERLAP_SOFTMAX the turns are a token (FlashAttention-3's warp scheduler barrier): a warpgroup
    # waits for it before it issues a ring step's wgmmas (or passes the step by) and hands it on right
    # after, so the two issue in alternation, one step each.
    def await_token():
      if token:
        plgpu.barrier_wait(schedule.at[wg])

    def pass_token():
      if token:
        plgpu.barrier_arrive(schedule.at[1 - wg])

    @pl.when(wg < wgs)
    def _compute():
      plgpu.set_max_registers(compute_registers(wgs), action="increase")
      if token:  # warpgroup 0 holds the token first
        pl.when(wg == 1)(lambda: plgpu.barrier_arrive(schedule.at[0]))

      @functools.partial(work_items, items, cta_lo_ref, cta_hi_ref)
      def _item(h, qi, b, j, g):
        with scope("start"):
          lo, steps, block, rows_q, buf = item_part(cta_lo_ref, cta_hi_ref, b, qi, j, wg, wgs, block_q)
          q_s = q_smem.at[buf]
          start, end = (load(ranges_ref.at[b, i, rows_q], row_layout, optimized=False)
                        for i in range(2))
          first = lax.min(lax.max(wg_lo_ref[b, block] - lo, 0), steps)
          last = lax.min(lax.max(wg_hi_ref[b, block] - lo, first), steps)
          inner_lo, inner_hi = inner_lo_ref[b, block], inner_hi_ref[b, block]
          row = lambda x, n: lax.broadcast_in_dim(x, (block_q, n), [0])
          plgpu.barrier_wait(q_bar.at[buf])
          # Q_IN_REGISTERS: the scores' wgmma reads Q from registers (RS) rather than shared memory (SS);
          # where the SASS needs it (mosaic_common.reloads_operands) its fragments are loaded in each step.
          held = q_in_registers and not interpret
          queries = register_operand(q_s, wgmma_layout, held, reloads_operands(head_dim, block_kv))

        def wait_k(i):
          plgpu.barrier_wait(k_bar.at[lax.rem(g + i, stages)])

        @scope("pass_by")
        def pass_by(i):  # a tile of the ring outside this warpgroup's span
          slot = lax.rem(g + i, stages)
          wait_k(i)
          plgpu.barrier_arrive(k_free.at[slot])
          take_turn()
          take_turn()
          await_token()
          pass_token()
          plgpu.barrier_wait(v_bar.at[slot])
          plgpu.barrier_arrive(v_free.at[slot])

        def tile_part(ref, slot, part):  # a ring slot's tile, or the keys `part` of it
          return ref.at[slot] if part == whole else ref.at[slot, pl.ds(part[0], part[1])]

        def masked(s, i, part=whole):  # step i's scores, -inf outside each query's range where its keys cross an edge
          kv_base = (lo + i) * block_kv + part[0]
          width = part[1]

          # A score's column in the tile against its query's range less the tile's first key: the columns
          # are the same every step (no per-step add and conversion a column), the rows' bounds move.
          base = kv_base.astype(jnp.float32)

          def keep_where(keep):  # the scores, -inf where not keep(column)
            def apply(s):
              column = plgpu.broadcasted_iota(jnp.int32, (block_q, width), 1, layout=wgmma_layout).astype(jnp.float32)
              return jnp.where(keep(column), s, -jnp.inf)
            return apply

          after_start = lambda column: column >= row(start - base, width)
          before_end = lambda column: column < row(end - base, width)
          crosses_starts, crosses_ends = kv_base < inner_lo, kv_base + width > inner_hi
          masks = (((crosses_starts, after_start), (crosses_ends, before_end)) if each_edge else
                   ((crosses_starts | crosses_ends, lambda key: after_start(key) & before_end(key)),))
          for crosses, keep in masks:
            s = scope("mask")(lax.cond)(crosses, keep_where(keep), lambda s: s, s)
          return s

        def weights(s, m):
          """(the rows' new maxima, the factor their accumulators scale by, the weights)."""
          m_new = jnp.maximum(m, s.max(axis=1) * c)
          # Masked scores are -inf, and a row may have seen nothing else yet: it subtracts 0 then, so its
          # weights stay 0 and no -inf - -inf appears. (A large finite stand-in does not do: with the
          # subtraction fused into the product, as on GPUs and XLA's CPU, its rounding error is ~1e21.)
          shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
          return m_new, jnp.exp2(m - shift), jnp.exp2(s * c - row(shift, s.shape[1]))

        def row_sums(l, alpha, p):
          return l * alpha + p.sum(axis=1)

        def online_softmax(s, m, l):
          """(the rows' new maxima, the factor their accumulators scale by, the weights, the new sums)."""
          m_new, alpha, p = weights(s, m)
          return m_new, alpha, p, row_sums(l, alpha, p)

        def scores_of(i, slot, meanwhile=lambda: None, part=whole):
          """(step i's scores (QK) over the keys `part` of its tile, waited for; what `meanwhile()` gives,
          run while the QK wgmma runs and before the turn: with the ping-pong, the wait for the other
          warpgroup's softmax)."""
          def scores(s_ref):
            await_token()
            plgpu.wgmma(s_ref, queries(), tile_part(k_smem, slot, part).T)
            pass_token()
            extra = meanwhile()
            scope("turn")(take_turn)()  # the other warpgroup's PV wgmma may start
            return s_ref[...], extra

          s, extra = scope("qk")(pl.run_scoped)(scores, plgpu.ACC((block_q, part[1]), jnp.float32))
          plgpu.barrier_arrive(k_free.at[slot])
          return masked(s, i, part), extra

        def catch_up(acc, l, pending):
          """The last step's deferred work on (acc, l): `pending` is its (alpha, weights, PV product), the
          weights there with ROW_SUM_DEFERRED (not yet summed into l), the product with RESCALE_AFTER_PV
          (not yet added to acc, which is not yet rescaled)."""
          alpha, p, pv = pending
          if deferred_sum:
            l = scope("row_sum")(row_sums)(l, alpha, p)
          if late_rescale:
            acc = scope("rescale")(lambda: acc * row(alpha, head_dim) + pv)()
          return acc, l

        def step_over(part):
          """A ring step over the keys `part` of its tile (all of them, or with EDGE_HALVES a half)."""
          return scope("step")(functools.partial(step, part=part))

        def step(i, carry, part=whole):
          acc, m, l, pending = carry
          slot = lax.rem(g + i, stages)
          if not early_k:
            scope("wait_k")(wait_k)(i)
          s, (acc, l) = scores_of(i, slot, lambda: catch_up(acc, l, pending), part)

          @scope("softmax")
          def softmax(acc, m, l, s):
            m_new, alpha, p = weights(s, m)
            if not deferred_sum:
              l = row_sums(l, alpha, p)
            if not late_rescale:
              acc *= row(alpha, head_dim)
            # The order FlashAttention-3's example found fastest: the softmax done before the turn is handed on.
            return lax.optimization_barrier((acc, l, m_new, p.astype(dtype), (alpha, p if deferred_sum else ())))

          acc, l, m_new, p16, (alpha, p) = softmax(acc, m, l, s)
          with scope("wait_v"):  # V's copy and, with the turns, the tensor cores
            if named_turns:
              plgpu.barrier_wait(v_bar.at[slot])
              take_turn()  # the tensor cores are this warpgroup's
            else:
              if pingpong:
                plgpu.barrier_arrive(schedule)
              plgpu.barrier_wait(v_bar.at[slot])
              if pingpong:
                plgpu.barrier_wait(schedule)  # the tensor cores are this warpgroup's
          # early_k: step i + 1's K (waited for here, not at its start) while the PV wgmma runs.
          meanwhile = (lambda: pl.when(i + 1 < last)(lambda: wait_k(i + 1))) if early_k else None
          # RESCALE_AFTER_PV: the product alone (a zero-initialised accumulator), added in the next QK.
          acc_or_pv = scope("pv")(mma)(None if late_rescale else acc, p16, tile_part(v_smem, slot, part), interpret,
                                       meanwhile)
          plgpu.barrier_arrive(v_free.at[slot])
          if late_rescale:
            return acc, m_new, l, (alpha, p, acc_or_pv)
          return acc_or_pv, m_new, l, (alpha, p, ())

        # OVERLAP_SOFTMAX: step i issues its QK and step i - 1's PV together, waits for the QK alone and
        # runs its softmax while the PV is on the tensor cores; the accumulator is rescaled once the PV
        # is done (FlashAttention-3's intra-warpgroup overlap). The span's first QK and its last PV
        # stand alone.
        def pv_of(acc, p16, i):  # step i's PV on the accumulator, waited for; V's slot freed
          slot = lax.rem(g + i, stages)
          scope("wait_v")(plgpu.barrier_wait)(v_bar.at[slot])
          acc = scope("pv")(mma)(acc, p16, v_smem.at[slot], interpret)
          plgpu.barrier_arrive(v_free.at[slot])
          return acc

        @scope("step")
        def overlapped_step(i, carry):
          acc, m, l, p16 = carry  # p16: step i - 1's weights, not yet multiplied into acc
          # The SASS (compile-only H100) of the form timed on 2026-11-30 had the PV's wait before the
          # softmax's row maxima, so that only the mask overlapped the PV (BENCHMARKS.md): the softmax
          # converted the new weights to 16 bits into the loop carry's registers, which the PV in flight
          # still read, so ptxas waited for the PV before the first conversion; and it moves an
          # operand-less wgmma wait up to the top of its basic block anyway. Here the weights stay f32
          # until the PV's wait, and that wait sits behind a branch after the softmax (wgmma_wait_after);
          # the accumulator's rescale and the conversion follow it, off the token's turn.
          slot, prev = lax.rem(g + i, stages), lax.rem(g + i - 1, stages)
          scope("wait_k")(wait_k)(i)
          scope("wait_v")(plgpu.barrier_wait)(v_bar.at[prev])
          if interpret:  # no register operand or accumulator-initialised wgmma: the same sums as dots
            await_token()
            s = jnp.dot(q_s[...], k_smem.at[slot][...].T, preferred_element_type=jnp.float32)
            acc = acc + jnp.dot(p16, v_smem.at[prev][...], preferred_element_type=jnp.float32)
            pass_token()
            plgpu.barrier_arrive(k_free.at[slot])
            m, alpha, p, l = online_softmax(masked(s, i), m, l)
          else:
            def scores(s_ref):
              await_token()
              plgpu.wgmma(s_ref, queries(), k_smem.at[slot].T)

              def pv_and_softmax(refs):  # the PV issued behind the QK, the softmax while it runs
                acc_ref, m_ref, alpha_ref, p_ref, l_ref = refs
                plgpu.wgmma(acc_ref, p16, v_smem.at[prev])
                pass_token()
                s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # the QK; the PV runs on
                plgpu.barrier_arrive(k_free.at[slot])
                outs = scope("softmax")(online_softmax)(masked(s, i), m, l)
                m_ref[...], alpha_ref[...], p_ref[...], l_ref[...] = lax.optimization_barrier(outs)
                # ... and the PV waited for after it (inner_lo is a key index, never negative).
                wgmma_wait_after(inner_lo >= 0)

              weights = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma_layout)  # written in there
              return pl.run_state(pv_and_softmax)((plgpu.ACC.init(acc), m, m, weights, l))

            acc, m, alpha, p, l = scope("qk_pv")(pl.run_scoped)(scores, plgpu.ACC(shape, jnp.float32))
            # The PV reads step i - 1's weights from registers until it is waited for: held alive past
            # the wait, so that nothing in between is given their registers (ptxas would serialize the
            # wgmmas, C7513).
            acc, m, alpha, p, l, _ = lax.optimization_barrier((acc, m, alpha, p, l, p16))
          plgpu.barrier_arrive(v_free.at[prev])
          return acc * row(alpha, head_dim), m, l, p.astype(dtype)

        def overlapped_span(acc, m, l):
          scope("wait_k")(wait_k)(first)
          m, alpha, p, l = scope("softmax")(online_softmax)(scores_of(first, lax.rem(g + first, stages))[0], m, l)
          acc, m, l, p16 = lax.fori_loop(first + 1, last, overlapped_step, (acc * row(alpha, head_dim), m, l,
                                                                           p.astype(dtype)))
          return pv_of(acc, p16, last - 1), m, l

        m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout)
        l = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), wgmma_layout)
        pl.when(wg == 1)(take_turn)  # offsets the two warpgroups by one turn
        pl.loop(0, first)(pass_by)
        if overlap:
          acc, m, l = lax.cond(first < last, overlapped_span, lambda *carry: carry, acc, m, l)
        else:
          if early_k:
            pl.when(first < last)(lambda: wait_k(first))
          # Before the first step nothing is pending (a factor of 1 on zeros); the last step's deferred
          # work is done after the loop.
          zeros = lambda cols: plgpu.layout_cast(jnp.zeros((block_q, cols), jnp.float32), wgmma_layout)
          none = (plgpu.layout_cast(jnp.ones((block_q,), jnp.float32), row_layout),
                  zeros(block_kv) if deferred_sum else (), zeros(head_dim) if late_rescale else ())
          carry = (acc, m, l, none)
          if edge_halves:  # the span's first and last steps over the half of their tiles its queries need
            spare = spare_ref[b, block]
            head = (lax.rem(spare, 2) == 1) & (first < last)
            body_first = first + head.astype(first.dtype)
            tail = (lax.div(spare, 2) == 1) & (last - 1 >= body_first)
            body_last = last - tail.astype(last.dtype)
            carry = lax.cond(head, lambda c: step_over((half, half))(first, c), lambda c: c, carry)
            carry = lax.fori_loop(body_first, body_last, step_over(whole), carry)
            carry = lax.cond(tail, lambda c: step_over((0, half))(last - 1, c), lambda c: c, carry)
          else:
            carry = lax.fori_loop(first, last, step_over(whole), carry)
          acc, m, l, pending = carry
          acc, l = catch_up(acc, l, pending)
        pl.loop(last, steps)(pass_by)
        pl.when(wg == 0)(take_turn)

        with scope("end"):
          seen = end > start  # l > 0 then: the span holds a key of each of its queries
          total = jnp.where(seen, l, 1.0)
          q_s[...] = (acc * row(jnp.where(seen, 1.0 / total, 0.0), head_dim)).astype(dtype)
          lse_smem.at[wg][...] = jnp.where(seen, m * LN2 + jnp.log(total), 0.0)
          store_item([(q_s, out_ref.at[b, rows_q, h]), (lse_smem.at[wg], lse_ref.at[b, h, rows_q])], q_free, j)

      if token:  # the token's last hand-over to warpgroup 0, observed
        pl.when(wg == 0)(lambda: plgpu.barrier_wait(schedule.at[0]))

    @pl.when(wg == wgs)
    def _memory():
      def own(h, qi, b, half):  # this item's queries, for each compute warpgroup
        return [(q_ref.at[b, pl.ds((qi * wgs + w) * block_q, block_q), h], q_smem.at[half * wgs + w],
                 q_bar.at[half * wgs + w]) for w in range(wgs)]

      copying_warpgroup(items, cta_lo_ref, cta_hi_ref, own,
                        kv_ring(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, groups, block_kv), q_free,
                        (k_free, v_free), stages)

  tiles = lambda count, rows_: plgpu.SMEM((count, rows_, head_dim), dtype, transforms=(tiling, swizzle))
  out, lse = plgpu.kernel(
      forward_kernel, **{out_name: (jax.ShapeDtypeStruct(q.shape, dtype),
                                    jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32))},
      **{scratch_name: [tiles(own_buffers(persistent) * wgs, block_q), tiles(stages, block_kv), tiles(stages, block_kv),
                        plgpu.SMEM((wgs, block_q), jnp.float32),
                        plgpu.Barrier(num_barriers=2 * wgs), plgpu.Barrier(num_arrivals=wgs, num_barriers=2)]
      + [plgpu.Barrier(num_barriers=stages)] * 2
      + [plgpu.Barrier(num_arrivals=wgs, num_barriers=stages)] * 2
      + [plgpu.Barrier(num_arrivals=1, num_barriers=2) if token else plgpu.Barrier(num_arrivals=wgs)]},
      grid=(persistent_ctas(math.prod(items), persistent, ctas),), grid_names=("ctas",), num_threads=wgs + 1, **params)(
          q, k, v, ranges, cta_lo, cta_hi, wg_lo, wg_hi, inner_lo, inner_hi, spare)
  return out, lse
