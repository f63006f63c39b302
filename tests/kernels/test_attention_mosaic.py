"""ejax's Mosaic GPU attention kernels against the reference: the backward (mosaic_backward.py, impls
"mosaic" and "mosaic_own") and the forward (mosaic_forward.py, impl "mosaic_own").

The kernels run in Mosaic GPU interpret mode on this CPU (jax >= 0.11: .ci/jax011-tests; on the pinned
jax they skip). The loop bounds are plain jnp and are checked everywhere: every tile pair the mask
allows is visited, and on packed rows nothing else is.
"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejax.kernels.attention import (attention_reference, flash_attention, mosaic_backward, mosaic_common,
                                    mosaic_forward, tokamax_gpu)
from ejax.kernels.attention.mosaic_backward import DQ_WGS, _tile_bounds
from ejax.kernels.attention.mosaic_common import kv_spans
from ejax.parallel import aot_target
from tests.kernels import sass
from tests.train.helpers import REPO

MOSAIC = pytest.mark.skipif(mosaic_backward.available() is not None, reason=str(mosaic_backward.available()))


def _ranges(layout: str, length: int, rng: np.random.Generator, longest: int = 90):
  """Per query [k_start, k_end) of one row: packed block-causal segments of 20 to `longest` tokens, or
  the same with the segments shuffled and padding between them (ranges not monotone in the query)."""
  lengths = rng.integers(20, longest, size=length // 20)
  starts = np.concatenate([[0], np.cumsum(lengths)])
  k_start, k_end = np.zeros(length, np.int32), np.zeros(length, np.int32)
  order = rng.permutation(len(lengths)) if layout == "shuffled" else np.arange(len(lengths))
  gap = 7 if layout == "shuffled" else 0
  offset = 0
  for i in order:
    n = int(lengths[i])
    if offset + n + gap > length - 10:
      break
    offset += gap
    index = np.arange(offset, offset + n)
    k_start[index] = offset
    k_end[index] = np.minimum(offset + n, offset + (np.arange(n) // 16 + 1) * 16)  # blocks of 16
    offset += n
  del starts
  return k_start, k_end


def _allowed(k_start, k_end, kv_len):
  keys = np.arange(kv_len)
  return (keys[None, :] >= k_start[:, None]) & (keys[None, :] < k_end[:, None])


@pytest.mark.parametrize("dkv_wgs", [1, 2])
@pytest.mark.parametrize("layout", ["packed", "shuffled"])
def test_tile_bounds_visit_every_allowed_tile_and_on_packed_rows_only_those(layout, dkv_wgs):
  rng = np.random.default_rng(0)
  length, block_q, block_kv = 512, 64, 64
  rows = [_ranges(layout, length, rng) for _ in range(2)]
  k_start = jnp.asarray(np.stack([r[0] for r in rows]))
  k_end = jnp.asarray(np.stack([r[1] for r in rows]))
  kv_lo, kv_hi, q_lo, q_hi = map(np.asarray, _tile_bounds(k_start, k_end, length, block_q=block_q, block_kv=block_kv,
                                                          dkv_wgs=dkv_wgs))
  tile_q, tile_kv = DQ_WGS * block_q, dkv_wgs * block_kv
  for b, (start, end) in enumerate(rows):
    allowed = _allowed(start, end, length)
    # dQ: a CTA of tile_q queries visits kv blocks [kv_lo, kv_hi) of block_kv keys.
    for i in range(length // tile_q):
      active = np.flatnonzero(allowed[i * tile_q:(i + 1) * tile_q].reshape(tile_q, -1, block_kv).any((0, 2)))
      visited = np.arange(kv_lo[b, i], kv_hi[b, i])
      assert set(active) <= set(visited), (b, i)
      if layout == "packed":
        assert len(active) == len(visited), (b, i)  # a tile's ranges form one span on packed rows
    # dK/dV: a CTA of tile_kv keys visits q blocks [q_lo, q_hi) of block_q queries.
    for j in range(length // tile_kv):
      active = np.flatnonzero(allowed[:, j * tile_kv:(j + 1) * tile_kv].reshape(-1, block_q, tile_kv).any((1, 2)))
      visited = np.arange(q_lo[b, j], q_hi[b, j])
      assert set(active) <= set(visited), (b, j)
      if layout == "packed":
        assert len(active) == len(visited), (b, j)
  # The forward's warpgroups: 64 queries each compute kv tiles [lo, hi) of their span only.
  wg_lo, wg_hi = map(np.asarray, kv_spans(k_start, k_end, block_q, block_kv))
  for b, (start, end) in enumerate(rows):
    allowed = _allowed(start, end, length)
    for i in range(length // block_q):
      active = np.flatnonzero(allowed[i * block_q:(i + 1) * block_q].reshape(block_q, -1, block_kv).any((0, 2)))
      assert set(active) <= set(range(wg_lo[b, i], wg_hi[b, i])), (b, i)
  computed, streamed = mosaic_forward.visited_pairs(k_start, k_end, block_q, block_kv)
  assert computed <= streamed
  # EDGE_HALVES: 128-key tiles computing one half at a span's edge where its queries need one compute the
  # pairs of 64-key tiles; spare_halves marks those edges.
  halved, _ = mosaic_forward.visited_pairs(k_start, k_end, block_q, 128, edge_halves=True)
  assert halved == mosaic_forward.visited_pairs(k_start, k_end, block_q, 64)[0]
  spare = np.asarray(mosaic_forward.spare_halves(k_start, k_end, block_q, 128))
  lo128, hi128 = map(np.asarray, kv_spans(k_start, k_end, block_q, 128))
  assert halved == (2 * (hi128 - lo128).sum() - (spare & 1).sum() - (spare >> 1).sum()) * block_q * 64
  assert halved < mosaic_forward.visited_pairs(k_start, k_end, block_q, 128)[0]
  # The packed rows skip most of the work: the visited tile pairs are far fewer than the dense row's.
  if layout == "packed":
    assert (kv_hi - kv_lo).sum() < 0.5 * kv_hi.size * (length // block_kv)
    assert computed < streamed  # the warpgroups' own spans skip tiles of the CTA's


def _reference_grads(q, k, v, d_out, k_start, k_end, scale):
  """out, lse and (dq, dk, dv) in fp32 of attention over the ranges, by autodiff of dense jnp."""
  groups = q.shape[2] // k.shape[2]
  allowed = jnp.asarray(np.stack([_allowed(s, e, k.shape[1]) for s, e in zip(k_start, k_end)]))

  def attend(q, k, v):
    k, v = jnp.repeat(k, groups, 2), jnp.repeat(v, groups, 2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = jnp.where(allowed[:, None], s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    total = p.sum(-1, keepdims=True)
    lse = jnp.where(total[..., 0] > 0, m[..., 0] + jnp.log(jnp.maximum(total[..., 0], 1e-30)), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p / jnp.maximum(total, 1e-30), v), lse

  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  (out, lse), pullback = jax.vjp(attend, *f32)
  return out, lse, pullback((d_out.astype(jnp.float32), jnp.zeros_like(lse)))


@MOSAIC
@pytest.mark.parametrize("head_dim,heads,kv_heads,ctas,stages,paired,dkv_wgs",
                         [(64, 2, 1, None, None, False, 1), (128, 2, 2, None, None, False, 1),
                          (64, 2, 1, 3, None, False, 1), (64, 2, 1, None, 2, False, 1), (64, 2, 1, 3, 3, False, 1),
                          (64, 2, 1, None, None, True, 1), (128, 2, 2, 3, 2, True, 1),
                          (128, 2, 2, "module's", None, False, 1), (64, 2, 1, 3, None, False, 2),
                          (128, 2, 2, "module's", None, True, 2)])
def test_backward_kernels_match_autodiff_of_the_reference(monkeypatch, head_dim, heads, kv_heads, ctas, stages,
                                                         paired, dkv_wgs):
  """`ctas`: persistent kernels of that many CTAs, each looping over several work items (8 for dQ, 16
  for dK/dV), their own tiles double-buffered and the ring carried from one item to the next ("module's":
  persistent or not as PERSISTENT says at this head size, a CTA an SM). `stages`:
  the rings' slots (None: the deepest that fits, more than a work item's steps here). `paired`:
  WGMMA_PAIRS, dK/dV's wgmmas issued two at a time. `dkv_wgs`: DKV_WGS, dK/dV's compute warpgroups (two:
  a work item of 128 keys, the streamed Q and dO tiles shared by both)."""
  monkeypatch.setattr(mosaic_backward, "WGMMA_PAIRS", paired)
  monkeypatch.setattr(mosaic_backward, "DKV_WGS", dkv_wgs)
  rng = np.random.default_rng(1)
  length = 256
  # Segments up to 200 tokens: some tiles lie inside every range of their queries (no mask applied).
  rows = [_ranges(layout, length, rng, longest=200) for layout in ("packed", "shuffled")]
  k_start = np.stack([r[0] for r in rows])
  k_end = np.stack([r[1] for r in rows])
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, d_out = normal(2, length, heads, head_dim), normal(2, length, heads, head_dim)
  k, v = normal(2, length, kv_heads, head_dim), normal(2, length, kv_heads, head_dim)
  scale = head_dim**-0.5
  out, lse, want = _reference_grads(q, k, v, d_out, k_start, k_end, scale)
  kernels = []  # each kernel's (work items, persistence), as the backward resolved them
  monkeypatch.setattr(mosaic_backward, "persistent_ctas",
                      lambda items, persistent, ctas=None: kernels.append((items, persistent))
                      or mosaic_common.persistent_ctas(items, persistent, ctas))
  default = ctas == "module's"
  got = mosaic_backward.backward(q, k, v, out.astype(jnp.bfloat16), lse, d_out, jnp.asarray(k_start),
                                 jnp.asarray(k_end), scale=scale, persistent=None if default else ctas is not None,
                                 ctas=None if default else ctas, stages=stages)
  assert [p for _, p in kernels] == [mosaic_backward.persistent_at(head_dim) if default else ctas is not None] * 2
  # dQ's items: 128 queries of a head and row; dK/dV's: dkv_wgs x 64 keys of a kv head and row
  assert [n for n, _ in kernels] == [2 * heads * length // 128, 2 * heads * length // (64 * dkv_wgs)]
  for name, g, w, primal in zip("qkv", got, want, (q, k, v)):
    assert g.shape == primal.shape and g.dtype == primal.dtype, name
    np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=2e-2 * float(jnp.abs(w).max()),
                               err_msg=f"d{name}")
  # Queries that see no key (padding) get exact zeros.
  empty = k_end <= k_start
  assert empty.any() and not np.asarray(got[0], np.float32)[empty].any()


def test_the_backward_is_persistent_at_the_head_sizes_its_setting_names(monkeypatch):
  """PERSISTENT: True or False at every head size, or the head sizes at which the kernels are persistent
  (128 by default: faster there on two H200s, unchecked on a GPU at 64); a call's own `persistent` wins."""
  assert mosaic_backward.PERSISTENT == (128,)
  assert mosaic_backward.persistent_at(128) and not mosaic_backward.persistent_at(64)
  assert mosaic_backward.persistent_at(64, True) and not mosaic_backward.persistent_at(128, False)
  monkeypatch.setattr(mosaic_backward, "PERSISTENT", True)
  assert mosaic_backward.persistent_at(64)
  monkeypatch.setattr(mosaic_backward, "PERSISTENT", (64,))
  assert mosaic_backward.persistent_at(64) and not mosaic_backward.persistent_at(128)


@MOSAIC
@pytest.mark.parametrize("head_dim,heads,kv_heads,compute_wgs,pingpong,block_kv,ctas,stages,schedule",
                         [(64, 2, 1, 2, True, 64, None, None, ""), (128, 2, 2, 2, True, 64, None, None, ""),
                          (64, 2, 1, 2, False, 128, None, None, ""), (64, 2, 2, 1, False, 64, None, None, ""),
                          (64, 2, 1, 2, True, 64, 3, None, ""), (64, 2, 2, 1, False, 128, 1, None, ""),
                          (64, 2, 1, 2, True, 64, None, 2, ""), (64, 2, 1, 2, True, 64, 3, 3, ""),
                          (64, 2, 1, 2, True, 64, None, 2, "early_k"), (64, 2, 2, 1, False, 64, 3, 3, "early_k"),
                          (64, 2, 1, 2, True, 64, None, None, "overlap"), (128, 2, 2, 2, True, 64, None, 2, "overlap"),
                          (64, 2, 1, 2, True, 64, 3, 3, "overlap"), (64, 2, 2, 1, False, 128, 1, None, "overlap"),
                          (64, 2, 1, 2, False, 64, 3, 2, "overlap"), (64, 2, 1, 2, True, 64, None, None, "row_sum"),
                          (128, 2, 2, 2, True, 64, None, 2, "row_sum"), (64, 2, 2, 1, False, 128, 1, None, "row_sum"),
                          (64, 2, 1, 2, True, 64, None, None, "rescale"), (128, 2, 2, 2, True, 64, 3, 2, "rescale"),
                          (64, 2, 2, 1, False, 128, None, None, "rescale"),
                          (64, 2, 1, 2, True, 64, None, 2, "rescale+row_sum"), (128, 2, 2, 2, True, 64, None, None,
                                                                               "rescale+row_sum"),
                          (64, 2, 1, 2, True, 64, 3, None, "named+row_sum"),
                          (64, 2, 1, 2, True, 128, None, None, "halves"), (128, 2, 2, 2, True, 128, 3, 2, "halves"),
                          (64, 2, 2, 1, False, 128, None, None, "halves+early_k"),
                          (128, 2, 1, 2, True, 128, None, None, "halves+rescale"),
                          (64, 2, 1, 2, True, 64, None, None, "each_edge"), (128, 2, 2, 2, True, 128, 3, 2, "each_edge"),
                          (64, 2, 1, 2, True, 128, None, None, "each_edge+halves")])
def test_forward_kernel_matches_the_reference(monkeypatch, head_dim, heads, kv_heads, compute_wgs, pingpong, block_kv,
                                              ctas, stages, schedule):
  """Out and lse over packed and shuffled ranges, with queries whose first tiles are all masked and
  padding queries that see no key (0 out and lse, the backward's convention). `ctas`: a persistent
  kernel of that many CTAs, each looping over several of the 8 work items (its ring and Q buffers
  carried from one to the next; interpret mode checks every barrier phase is observed). `stages`: the
  ring's slots (None: the deepest that fits, more than an item's steps here). `schedule`: "early_k"
  (K_WAIT_DURING_PV, each step's K waited for during the step before's PV wgmma) or "overlap"
  (OVERLAP_SOFTMAX, each step's softmax beside the step before's PV; with the ping-pong, a token
  passed between the two warpgroups once a ring step), "row_sum" (ROW_SUM_DEFERRED, each step's row
  sums added during the next step's QK) or "rescale" (RESCALE_AFTER_PV, the PV into a fresh accumulator
  and the running one rescaled during the next QK) or "named" (NAMED_TURNS: on a GPU the turns at a
  named barrier; interpret mode keeps the mbarrier) or "halves" (EDGE_HALVES, a span's first and last
  steps over the half of their 128-key tile its queries need; the rows have both kinds) or "each_edge"
  (MASK_EACH_EDGE, a tile crossing its queries' starts or ends masked by each edge's compare alone), or
  two joined by "+"."""
  forms = schedule.split("+")
  monkeypatch.setattr(mosaic_forward, "K_WAIT_DURING_PV", "early_k" in forms)
  monkeypatch.setattr(mosaic_forward, "OVERLAP_SOFTMAX", "overlap" in forms)
  monkeypatch.setattr(mosaic_forward, "ROW_SUM_DEFERRED", "row_sum" in forms)
  monkeypatch.setattr(mosaic_forward, "RESCALE_AFTER_PV", "rescale" in forms)
  monkeypatch.setattr(mosaic_forward, "NAMED_TURNS", "named" in forms)
  monkeypatch.setattr(mosaic_forward, "EDGE_HALVES", "halves" in forms)
  monkeypatch.setattr(mosaic_forward, "MASK_EACH_EDGE", "each_edge" in forms)
  rng = np.random.default_rng(3)
  length = 256
  longest = 120 if "halves" in forms else 200
  rows = [_ranges(layout, length, rng, longest=longest) for layout in ("packed", "shuffled")]
  k_start = np.stack([r[0] for r in rows])
  k_end = np.stack([r[1] for r in rows])
  if "halves" in forms:  # spans that start in a tile's upper half and spans that end in a lower half
    spare = np.asarray(mosaic_forward.spare_halves(jnp.asarray(k_start), jnp.asarray(k_end), 64, block_kv))
    assert (spare & 1).any() and (spare & 2).any(), spare
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q = normal(2, length, heads, head_dim)
  k, v = normal(2, length, kv_heads, head_dim), normal(2, length, kv_heads, head_dim)
  scale = head_dim**-0.5
  want_out, want_lse, _ = _reference_grads(q, k, v, q, k_start, k_end, scale)
  out, lse = mosaic_forward.forward(q, k, v, jnp.asarray(k_start), jnp.asarray(k_end), scale=scale,
                                    compute_wgs=compute_wgs, pingpong=pingpong, block_kv=block_kv,
                                    persistent=ctas is not None, ctas=ctas, stages=stages)
  assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, heads, length)
  np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=1e-2)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4, rtol=1e-5)
  empty = k_end <= k_start
  assert empty.any() and not np.asarray(out, np.float32)[empty].any() and not np.asarray(lse)[:, 0][empty].any()


@MOSAIC
@pytest.mark.parametrize("edge_halves", [True, False])
def test_a_spans_unneeded_halves_are_never_read(monkeypatch, edge_halves):
  """EDGE_HALVES: a warpgroup whose queries see keys 64-191 only computes the upper half of its first
  128-key tile and the lower half of its last. V is NaN on the keys no query sees: a half computed with
  its weights 0 still gives 0 x NaN, so the whole tiles' control is NaN there, and the halves' form is
  the reference's."""
  monkeypatch.setattr(mosaic_forward, "EDGE_HALVES", edge_halves)
  rng = np.random.default_rng(7)
  length, heads, head_dim = 256, 2, 64
  k_start, k_end = np.zeros((1, length), np.int32), np.zeros((1, length), np.int32)
  k_start[0, 64:192], k_end[0, 64:192] = 64, 192  # one bidirectional segment; the rest sees nothing
  spare = np.asarray(mosaic_forward.spare_halves(jnp.asarray(k_start), jnp.asarray(k_end), 64, 128))
  assert spare.tolist() == [[0, 3, 3, 0]]  # both edges of both warpgroups' spans
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, k, v = (normal(1, length, heads, head_dim) for _ in range(3))
  unseen = np.r_[0:64, 192:256]
  v = v.at[:, unseen].set(jnp.nan)
  want_out, want_lse, _ = _reference_grads(q, k, jnp.where(jnp.isnan(v), 0, v), q, k_start, k_end, head_dim**-0.5)
  out, lse = mosaic_forward.forward(q, k, v, jnp.asarray(k_start), jnp.asarray(k_end), scale=head_dim**-0.5,
                                    block_kv=128, compute_wgs=2, pingpong=True)
  out = np.asarray(out, np.float32)
  if not edge_halves:
    assert np.isnan(out[0, 64:192]).all()
    return
  np.testing.assert_allclose(out, want_out, atol=1e-2)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4, rtol=1e-5)

def _assert_loss_and_gradients_match_the_reference(impl, q, k, v, d_out, kwargs):
  """sum(attention * d_out) and its gradients through the op with `impl` against the fp32 reference's."""
  def grads(attend, *args):
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)

  value, got = grads(lambda q, k, v: flash_attention(q, k, v, impl=impl, **kwargs), q, k, v)
  want_value, want = grads(lambda q, k, v: attention_reference(q, k, v, **kwargs),
                           *(x.astype(jnp.float32) for x in (q, k, v)))
  np.testing.assert_allclose(value, want_value, rtol=2e-2)
  for name, g, w in zip("qkv", got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=3e-2 * float(jnp.abs(w).max()), err_msg=f"d{name}")


@pytest.mark.parametrize("impl", ["mosaic", "mosaic_own"])
@pytest.mark.parametrize("mask_kind", ["bidirectional", "causal", "block_causal"])
def test_impl_mosaic_values_and_gradients_through_the_op(impl, mask_kind):
  """impl="mosaic" (tokamax's forward, the Mosaic GPU backward) and "mosaic_own" (ejax's Mosaic GPU
  kernels both ways) on packed rows of odd length with a head size the kernels pad (32 -> 64) and
  grouped kv heads: the reference's answer."""
  if mosaic_backward.available() is not None:
    pytest.skip(str(mosaic_backward.available()))
  if impl == "mosaic" and not tokamax_gpu.available():
    pytest.skip(tokamax_gpu.unavailable_reason())
  rng = np.random.default_rng(2)
  batch, length, heads, kv_heads, head_dim = 2, 200, 4, 2, 32
  segment_ids = np.zeros((batch, length), np.int32)
  segment_ids[0, :90], segment_ids[0, 90:190] = 1, 2
  segment_ids[1, 10:120], segment_ids[1, 120:] = 1, 2
  order = np.tile(np.arange(length) // 16, (batch, 1))
  kwargs = dict(mask_kind=mask_kind, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
  if mask_kind == "causal":
    kwargs.update(q_positions=np.tile(np.arange(length), (batch, 1)), kv_positions=np.tile(np.arange(length), (batch, 1)))
  if mask_kind == "block_causal":
    kwargs.update(q_block_ids=order, kv_block_ids=order)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, d_out = normal(batch, length, heads, head_dim), normal(batch, length, heads, head_dim)
  k, v = normal(batch, length, kv_heads, head_dim), normal(batch, length, kv_heads, head_dim)

  _assert_loss_and_gradients_match_the_reference(impl, q, k, v, d_out, kwargs)


@MOSAIC
@pytest.mark.parametrize("q_in_registers", [True, False])
def test_mosaic_own_with_128_key_tiles_values_and_gradients(monkeypatch, q_in_registers):
  """mosaic_forward.BLOCK_KV = 128 (the attention figure's variants "128-key tiles", Q in registers, and
  "128-key tiles, Q in shared memory", FlashAttention-3's tiles) at head size 128 on block-causal packed
  rows, with the ping-pong: the forward's out and lse and the backward's gradients from them are the
  reference's. (On the H200 of 2026-11-30 the first's gradients were 1.9 off the Pallas kernel's at 8 x
  4,096 tokens; interpret mode agrees with the reference here and at 1 x 4,096: on the GPU ptxas had
  given the softmax weights Q's registers, which the SASS check below finds.)"""
  monkeypatch.setattr(mosaic_forward, "BLOCK_KV", 128)
  monkeypatch.setattr(mosaic_forward, "Q_IN_REGISTERS", q_in_registers)
  rng = np.random.default_rng(5)
  length, heads, head_dim = 384, 2, 128
  segment_ids, block_ids = np.zeros((1, length), np.int32), np.zeros((1, length), np.int32)
  offset = 0
  for segment, n in enumerate((150, 170, 50), start=1):  # segments crossing 128-key tiles; padding at the end
    segment_ids[0, offset:offset + n] = segment
    block_ids[0, offset + n - 17], block_ids[0, offset + n - 16:offset + n] = 1, 2  # state, then action tokens
    offset += n
  kwargs = dict(mask_kind="block_causal", q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                q_block_ids=block_ids, kv_block_ids=block_ids)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, k, v, d_out = (normal(1, length, heads, head_dim) for _ in range(4))
  out = jax.jit(lambda q, k, v: flash_attention(q, k, v, impl="mosaic_own", **kwargs))(q, k, v)
  want_out = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), **kwargs)
  np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=2e-2)
  _assert_loss_and_gradients_match_the_reference("mosaic_own", q, k, v, d_out, kwargs)


@MOSAIC
@pytest.mark.parametrize("persistent", [False, True])
def test_mosaic_own_cross_attention_with_an_empty_row(monkeypatch, persistent):
  """Queries and keys of different lengths (as GR00T's DiT reading the VL tokens), and a batch row with
  no keys at all (work items with nothing to stream); persistent: all three kernels on 2 CTAs, each
  looping over items with and without steps. The reference's values and gradients, zeros for the
  empty row."""
  monkeypatch.setattr(mosaic_forward, "PERSISTENT", persistent)
  monkeypatch.setattr(mosaic_backward, "PERSISTENT", persistent)
  monkeypatch.setattr(mosaic_common, "H100_SMS", 2)  # the CTAs of a persistent kernel off a GPU
  rng = np.random.default_rng(4)
  batch, q_len, kv_len, heads, head_dim = 3, 100, 300, 2, 64
  q_ids, kv_ids = np.zeros((batch, q_len), np.int32), np.zeros((batch, kv_len), np.int32)
  q_ids[0, :40], q_ids[0, 40:], q_ids[1, :] = 1, 2, 1
  kv_ids[0, :150], kv_ids[0, 150:280], kv_ids[1, 20:] = 1, 2, 1
  kwargs = dict(mask_kind="bidirectional", q_segment_ids=q_ids, kv_segment_ids=kv_ids)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, d_out = normal(batch, q_len, heads, head_dim), normal(batch, q_len, heads, head_dim)
  k, v = normal(batch, kv_len, heads, head_dim), normal(batch, kv_len, heads, head_dim)

  out = jax.jit(lambda q, k, v: flash_attention(q, k, v, impl="mosaic_own", **kwargs))(q, k, v)
  want_out = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), **kwargs)
  np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=2e-2)
  assert not np.asarray(out, np.float32)[2].any()
  _assert_loss_and_gradients_match_the_reference("mosaic_own", q, k, v, d_out, kwargs)


# ptxas's verdict on the kernels as the GPU machines' jax builds them. Mosaic GPU compiles a kernel to
# PTX and SASS when it lowers; with JAX's CUDA plugin (jax >= 0.11: .venv-cuda011, see
# ejax/parallel/aot_target.py) that runs here against a compile-only H100. Before each compile the
# script prints the settings it compiles with, so that each ptxas report is read against them.
_PTXAS = """
import sys
from ejax.parallel import aot_target
aot_target.run_jax_on_cpu()
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from ejax.kernels.attention import mosaic_backward, mosaic_common, mosaic_forward
device = aot_target.compile_only_devices("h100", 1)[0]
head_dim = int(sys.argv[1])
arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
x = arg((2, 512, 4, head_dim), jnp.bfloat16)
ids = arg((2, 512), jnp.int32)
mark = lambda text: print("SETTINGS " + text, file=sys.stderr, flush=True)
# The forms below are named by their settings, each set as one value for every head size; the defaults
# (some by head size) come back for the forms as configured at the end.
defaults = (mosaic_forward.BLOCK_KV, mosaic_forward.Q_IN_REGISTERS, mosaic_forward.NAMED_TURNS, mosaic_backward.DKV_WGS)
mosaic_forward.BLOCK_KV, mosaic_forward.Q_IN_REGISTERS, mosaic_forward.NAMED_TURNS = 64, True, False
mosaic_backward.DKV_WGS = 1
for persistent in (False, True):
  # the score wgmmas SS or RS; dK/dV's wgmmas in pairs
  for mosaic_backward.OPERANDS_IN_REGISTERS, mosaic_backward.WGMMA_PAIRS in ((False, False), (True, False), (False, True)):
    mark(f"backward persistent={persistent} operands_in_registers={mosaic_backward.OPERANDS_IN_REGISTERS} "
         f"wgmma_pairs={mosaic_backward.WGMMA_PAIRS}")
    backward = jax.jit(lambda *a: mosaic_backward.backward(*a, scale=head_dim**-0.5, interpret=False, persistent=persistent))
    backward.trace(x, x, x, x, arg((2, 4, 512), jnp.float32), x, ids, ids).lower(lowering_platforms=("cuda",)).compile()
  # two dK/dV warpgroups (DKV_WGS), their wgmmas one or two at a time
  mosaic_backward.OPERANDS_IN_REGISTERS, mosaic_backward.DKV_WGS = False, 2
  for mosaic_backward.WGMMA_PAIRS in (False, True):
    mark(f"backward persistent={persistent} dkv_wgs=2 wgmma_pairs={mosaic_backward.WGMMA_PAIRS}")
    backward = jax.jit(lambda *a: mosaic_backward.backward(*a, scale=head_dim**-0.5, interpret=False, persistent=persistent))
    backward.trace(x, x, x, x, arg((2, 4, 512), jnp.float32), x, ids, ids).lower(lowering_platforms=("cuda",)).compile()
  mosaic_backward.WGMMA_PAIRS, mosaic_backward.DKV_WGS = False, 1
  for mosaic_forward.Q_IN_REGISTERS, mosaic_forward.K_WAIT_DURING_PV in ((True, False), (False, False), (True, True)):
    # the scores' wgmma RS or SS; each step's K waited for during the PV wgmma before it
    mark(f"forward persistent={persistent} q_in_registers={mosaic_forward.Q_IN_REGISTERS} "
         f"k_wait_during_pv={mosaic_forward.K_WAIT_DURING_PV}")
    forward = jax.jit(lambda *a: mosaic_forward.forward(*a, scale=head_dim**-0.5, interpret=False, persistent=persistent))
    forward.trace(x, x, x, ids, ids).lower(lowering_platforms=("cuda",)).compile()
# The forward under Mosaic GPU's on-device profiler (attention.py --profile_kernel): its buffer in shared
# memory beside the ring. The trace's host callback lowers only where a GPU is, so it is left out here.
# The forward with each step's softmax beside its own last PV (OVERLAP_SOFTMAX): two wgmma groups in flight.
mosaic_forward.OVERLAP_SOFTMAX = True
mark("forward overlap_softmax=True")
forward = jax.jit(lambda *a: mosaic_forward.forward(*a, scale=head_dim**-0.5, interpret=False))
forward.trace(x, x, x, ids, ids).lower(lowering_platforms=("cuda",)).compile()
mosaic_forward.OVERLAP_SOFTMAX = False
# Each step's row sums during the next step's QK (ROW_SUM_DEFERRED): the weights live across the PV.
mosaic_forward.ROW_SUM_DEFERRED = True
mark("forward row_sum_deferred=True")
forward = jax.jit(lambda *a: mosaic_forward.forward(*a, scale=head_dim**-0.5, interpret=False))
forward.trace(x, x, x, ids, ids).lower(lowering_platforms=("cuda",)).compile()
# The PV into a fresh accumulator, the running one rescaled during the next QK (RESCALE_AFTER_PV); the
# turns at a hardware named barrier (NAMED_TURNS, inline PTX: a GPU's code path only) with it and with
# the deferred row sums (the attention figure's variants).
for named, rescale, row_sum in ((False, True, False), (True, True, False), (True, False, True)):
  mosaic_forward.NAMED_TURNS, mosaic_forward.RESCALE_AFTER_PV, mosaic_forward.ROW_SUM_DEFERRED = named, rescale, row_sum
  mark(f"forward named_turns={named} rescale_after_pv={rescale} row_sum_deferred={row_sum}")
  forward = jax.jit(lambda *a: mosaic_forward.forward(*a, scale=head_dim**-0.5, interpret=False))
  forward.trace(x, x, x, ids, ids).lower(lowering_platforms=("cuda",)).compile()
mosaic_forward.NAMED_TURNS = mosaic_forward.RESCALE_AFTER_PV = mosaic_forward.ROW_SUM_DEFERRED = False
# 128-key tiles (BLOCK_KV), where ptxas overwrote Q's fragments at head size 128 (mosaic_common.RELOAD_OPERANDS);
# with Q read from shared memory (FlashAttention-3's tiles), also with the turns at a named barrier or each
# step's softmax beside its own PV.
mosaic_forward.BLOCK_KV = 128
for (mosaic_forward.Q_IN_REGISTERS, mosaic_forward.NAMED_TURNS,
     mosaic_forward.OVERLAP_SOFTMAX) in ((True, False, False), (False, False, False), (False, True, False), (False, False, True)):
  mark(f"forward block_kv=128 q_in_registers={mosaic_forward.Q_IN_REGISTERS} named_turns={mosaic_forward.NAMED_TURNS} "
       f"overlap_softmax={mosaic_forward.OVERLAP_SOFTMAX}")
  forward = jax.jit(lambda *a: mosaic_forward.forward(*a, scale=head_dim**-0.5, interpret=False))
  forward.trace(x, x, x, ids, ids).lower(lowering_platforms=("cuda",)).compile()
# A span's first and last steps over half of their 128-key tile (EDGE_HALVES: 64-key wgmmas on a slice of
# the slot), with Q from shared memory and the named turns (head size 128's form).
mosaic_forward.Q_IN_REGISTERS, mosaic_forward.NAMED_TURNS, mosaic_forward.OVERLAP_SOFTMAX = False, True, False
mosaic_forward.EDGE_HALVES = True
mark("forward block_kv=128 edge_halves=True q_in_registers=False named_turns=True")
forward = jax.jit(lambda *a: mosaic_forward.forward(*a, scale=head_dim**-0.5, interpret=False))
forward.trace(x, x, x, ids, ids).lower(lowering_platforms=("cuda",)).compile()
# Each edge of a tile's ranges masked alone (MASK_EACH_EDGE), with and without the halves.
mosaic_forward.MASK_EACH_EDGE = True
for mosaic_forward.EDGE_HALVES in (False, True):
  mark(f"forward block_kv=128 mask_each_edge=True edge_halves={mosaic_forward.EDGE_HALVES}")
  forward = jax.jit(lambda *a: mosaic_forward.forward(*a, scale=head_dim**-0.5, interpret=False))
  forward.trace(x, x, x, ids, ids).lower(lowering_platforms=("cuda",)).compile()
mosaic_forward.EDGE_HALVES = mosaic_forward.MASK_EACH_EDGE = False
mosaic_forward.BLOCK_KV, mosaic_forward.Q_IN_REGISTERS, mosaic_forward.NAMED_TURNS, mosaic_backward.DKV_WGS = defaults
mosaic_forward.OVERLAP_SOFTMAX = False
mark("forward and backward as configured")
forward = jax.jit(lambda *a: mosaic_forward.forward(*a, scale=head_dim**-0.5, interpret=False))
forward.trace(x, x, x, ids, ids).lower(lowering_platforms=("cuda",)).compile()
backward = jax.jit(lambda *a: mosaic_backward.backward(*a, scale=head_dim**-0.5, interpret=False))
backward.trace(x, x, x, x, arg((2, 4, 512), jnp.float32), x, ids, ids).lower(lowering_platforms=("cuda",)).compile()
mosaic_common.PROFILE_DIR = "/nonexistent"
jax.debug.callback = lambda *args, **kwargs: None
mark("forward profiled")
forward = jax.jit(lambda *a: mosaic_forward.forward(*a, scale=head_dim**-0.5, interpret=False))
forward.trace(x, x, x, ids, ids).lower(lowering_platforms=("cuda",)).compile()
"""
# The spills ptxas reports, in forms that are off by default, as (kernel, settings, head size, most
# bytes a thread, None: any):
# - jaxlib 0.12.0.1 builds the dQ kernel with Q and dO held in registers (mosaic_backward.
#   OPERANDS_IN_REGISTERS, two warpgroups at 168 registers, head size 128) with 292 bytes spilled a
#   thread; jaxlib 0.11.2 built it without. That form was slower on an H200 without spills too.
# - dK/dV with its wgmmas in pairs (WGMMA_PAIRS), a CTA an item, at 128: 8 bytes, stored before the
#   step loop and loaded after it (the SASS); its loop has no local access.
# - dK/dV in two warpgroups (DKV_WGS 2) with its wgmmas in pairs, at 128: 44 bytes stored, 52 loaded a
#   thread, either persistence (2026-12-01); without the pairs no spill. The attention figure times them apart.
_KNOWN_SPILLS = (("dq_kernel", "operands_in_registers=True", 128, None),
                 ("dkv_kernel", "persistent=False operands_in_registers=False wgmma_pairs=True", 128, 8),
                 ("dkv_kernel", "dkv_wgs=2 wgmma_pairs=True", 128, 52))


def _ptxas_reports(output: str) -> list[tuple[str, str, int, int]]:
  """(the settings printed before it, the kernel, spill store and load bytes) of each ptxas report."""
  reports, settings, kernel = [], "", ""
  for line in output.splitlines():
    if line.startswith("SETTINGS "):
      settings = line[len("SETTINGS "):]
    elif found := re.search(r"Compiling entry function '(\w+)'", line):
      kernel = found.group(1)
    elif found := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
      if "ptxas warning" not in line:
        reports.append((settings, kernel, int(found.group(1)), int(found.group(2))))
  return reports


@MOSAIC
@pytest.mark.skipif(not aot_target.cuda_plugin_installed(),
                    reason="JAX's CUDA plugin is not installed (see ejax/parallel/aot_target.py)")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernels_compile_for_an_h100_without_register_spills(head_dim, tmp_path):
  """ptxas's report on each form: no spill but those known. And, where nvdisasm is installed, the SASS:
  no scores' wgmma reads Q fragments (or the backward's K / V) that a later instruction of its loop
  overwrote (tests/kernels/sass.py: at head size 64 ptxas gave the forward's softmax weights Q's
  registers, the fault the H200s showed there until mosaic_common.RELOAD_OPERANDS)."""
  cuda_root = sass.cuda_root_with_nvdisasm(str(tmp_path))
  env = {**os.environ, "MOSAIC_GPU_DUMP_PTXAS": "1", "XLA_FLAGS": ""}
  if cuda_root:
    env.update(MOSAIC_GPU_DUMP_SASS="1", CUDA_ROOT=cuda_root)
  done = subprocess.run([sys.executable, "-c", _PTXAS, str(head_dim)], cwd=REPO, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, env=env, timeout=900)
  report = done.stdout
  assert done.returncode == 0, report[-3000:]
  reports = _ptxas_reports(report)
  kernels = {kernel for _, kernel, _, _ in reports}
  assert {"dq_kernel_mosaic_gpu_kernel", "dkv_kernel_mosaic_gpu_kernel", "forward_kernel_mosaic_gpu_kernel"} <= kernels, \
      report[-2000:]
  # per persistence: five backwards of two kernels, three forwards; then the overlapped, the deferred-sum,
  # the late-rescale, two named-turn, four 128-key-tile forwards, one with halves at the spans' edges and
  # two with each edge masked alone, the forward and backward as configured, and the profiled forward
  assert len(reports) == 42, reports
  spilled = [r for r in reports if r[2] or r[3]]
  allowed = [r for r in spilled if any(kernel in r[1] and settings in r[0] and head_dim == size
                                       and (most is None or max(r[2], r[3]) <= most)
                                       for kernel, settings, size, most in _KNOWN_SPILLS)]
  assert spilled == allowed, spilled  # every other form compiles without a spill
  if not cuda_root:
    pytest.skip("spills checked; the SASS is not: `pip install nvidia-cuda-nvdisasm` beside the CUDA plugin")
  clobbered, listings = [], 0
  for chunk in re.split(r"(?m)^SETTINGS ", report)[1:]:
    settings = chunk.splitlines()[0]
    for kernel, (instructions, labels) in sass.kernels(chunk).items():
      listings += 1
      found = sass.clobbered_register_operands(instructions, labels)
      if found:
        clobbered.append((settings, kernel, sorted({register for _, register, _ in found})))
  assert listings == len(reports), f"{listings} SASS listings for {len(reports)} ptxas reports"
  assert not clobbered, clobbered


@MOSAIC
def test_the_variant_checks_give_each_variant_and_case_an_error():
  """benchmarks/attention.py --check_variants (attention_variants.check_variants), run on a GPU to find which of the forward's code
  paths was wrong at head size 64 there, and whether the backward's faster settings are right there:
  here, in interpret mode, each case of a variant within tolerance of impl xla, and its module
  settings put back after the call."""
  from benchmarks import attention_variants as bench
  rings = bench.FORWARD_VARIANTS[3]
  assert rings[0] == "rings of 2 slots"
  errors = bench.check_variants(1024, jnp.bfloat16, "mosaic_own", (rings,), gradients=False)
  assert list(errors) == ["rings of 2 slots"]
  assert set(errors["rings of 2 slots"]) == {"segments@64", "segments@128", "block-causal@64", "block-causal@128"}
  assert all(isinstance(e, float) and e < 1e-2 for e in errors["rings of 2 slots"].values()), errors
  assert mosaic_forward.STAGES is None
  # The backward's variants: gradients against xla's in fp32 (here through impl xla itself, bf16 against
  # fp32: the backward kernels' interpret-mode gradients are this file's other tests), settings put back.
  persistent = bench.BACKWARD_VARIANTS[1]
  assert persistent[0] == "persistent"
  errors = bench.check_variants(1024, jnp.bfloat16, "xla", (persistent,), gradients=True)
  assert set(errors["persistent"]) == {"segments@64", "segments@128", "block-causal@64", "block-causal@128"}
  assert all(isinstance(e, float) and e < 2e-2 for e in errors["persistent"].values()), errors
  assert mosaic_backward.PERSISTENT == (128,)
  assert [label for label, _ in bench.FORWARD_GRADIENT_VARIANTS] == [
      "as configured", f"{bench.HEAD_128_FORM}, each edge masked alone, unneeded halves skipped", bench.HEAD_128_FORM,
      "128-key tiles",
      "128-key tiles, Q loaded once an item", "128-key tiles, Q in shared memory"]
  assert bench.FORWARD_VARIANTS[1][0] == "Q loaded once an item" and mosaic_common.RELOAD_OPERANDS is None


def test_the_variant_checks_trace_each_variant_under_its_own_settings(monkeypatch):
  """check_variants runs each variant's own program: jax.jit keys its compiled programs by the Python
  function (one cache for every jax.jit of it), so a function reused across variants runs the first
  variant's program under every later variant's settings, read as it traces (on the H200 of 2026-11-30
  the seven forward variants all gave the errors of the forward as configured). Here a stand-in for
  attention_outputs that reads a module setting as it traces: the variant that doubles it is off by 1."""
  from benchmarks import attention_variants as bench
  settings = type(sys)("settings")
  settings.SCALE = 1.0
  q = jnp.arange(1.0, 9.0).reshape(1, 2, 2, 2)
  monkeypatch.setattr(bench, "_variant_cases", lambda row_length, dtype: [("case", q, q, q, {})])
  monkeypatch.setattr(bench, "attention_outputs",
                      lambda impl, mask, d_out=None: lambda q, k, v: (q * settings.SCALE,))
  for gradients in (False, True):
    reported = []  # each variant as it is done, so that a time limit leaves the ones before it
    errors = bench.check_variants(2, jnp.float32, "mosaic_own", (("as configured", ()),
                                                                 ("doubled", ((settings, "SCALE", 2.0),))), gradients,
                                  report=lambda label, by_case: reported.append((label, dict(by_case))))
    assert errors == {"as configured": {"case": 0.0}, "doubled": {"case": 1.0}}, errors
    assert reported == list(errors.items())
  assert settings.SCALE == 1.0
