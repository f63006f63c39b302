"""The attention op's blockwise paths against the jnp reference: values and gradients.

One test class runs every case; on a GPU it compiles the Pallas kernels, and the CPU subclass runs
them in interpret mode (STYLE.md). Shapes are small and the block sizes tiny so that every row spans
several tiles, with skipped tiles, padded tails and partial segments in each.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejax.kernels.attention import (BlockSizes, attention, attention_reference,
                                    block_ids_from_ar_flags, choose_impl, flash_attention, intervals,
                                    ops, tokamax_gpu, unchecked_layout)
from ejax.kernels.attention.tiles import MaskInputs, active_fraction, active_tiles, normalise_mask, pair_mask

# tokamax needs Python >= 3.12 and jax >= 0.11.1; elsewhere its cases skip (its lowering and values
# were checked in such a venv, see ejax/kernels/attention/tokamax_gpu.py).
TOKAMAX = pytest.mark.skipif(not tokamax_gpu.available(), reason=tokamax_gpu.unavailable_reason())

BATCH, LEN, HEADS, KV_HEADS, HEAD_DIM = 3, 80, 4, 2, 32
# Forward and backward tiles differ so that both tile lists are exercised; 80 is no multiple of 32.
BLOCKS = BlockSizes(block_q=16, block_kv=32, block_q_bwd=32, block_kv_bwd=16)


def _packed_layout(rng: np.random.Generator, length: int):
  """Segment ids, per-segment positions and block ids for three rows:
  random segments with length-1 ones and a padded tail; one segment; all padding."""
  segment_ids = np.zeros((BATCH, length), np.int32)
  lengths, filled = [], 0
  while filled < length - 10:
    n = int(rng.choice([1, 1, 3, 7, 12, 20]))
    lengths.append(min(n, length - 10 - filled))
    filled += lengths[-1]
  segment_ids[0, :filled] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
  segment_ids[1, :] = 1
  positions = np.zeros_like(segment_ids)
  ar_flags = np.zeros_like(segment_ids)
  for row in range(BATCH):
    for seg in np.unique(segment_ids[row]):
      where = np.flatnonzero(segment_ids[row] == seg)
      positions[row, where] = np.arange(len(where))
      # pi0-style: a bidirectional prefix, then suffix tokens that open new blocks.
      ar_flags[row, where[len(where) // 2:]] = rng.integers(0, 2, len(where) - len(where) // 2)
  return segment_ids, positions, block_ids_from_ar_flags(jnp.asarray(ar_flags))


class AttentionTest:
  INTERPRET = False
  IMPLS = ("pallas", "xla", pytest.param("tokamax", marks=TOKAMAX), pytest.param("tokamax_fwd", marks=TOKAMAX))

  @pytest.fixture(scope="class")
  @classmethod
  def data(cls):
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    segment_ids, positions, block_ids = _packed_layout(rng, LEN)
    return dict(q=normal(BATCH, LEN, HEADS, HEAD_DIM), k=normal(BATCH, LEN, KV_HEADS, HEAD_DIM),
                v=normal(BATCH, LEN, KV_HEADS, HEAD_DIM), d_out=normal(BATCH, LEN, HEADS, HEAD_DIM),
                segment_ids=jnp.asarray(segment_ids), positions=jnp.asarray(positions),
                block_ids=block_ids)

  def _mask_kwargs(self, data, mask_kind):
    kwargs = dict(mask_kind=mask_kind, q_segment_ids=data["segment_ids"],
                  kv_segment_ids=data["segment_ids"])
    if mask_kind == "causal":
      kwargs.update(q_positions=data["positions"], kv_positions=data["positions"])
    if mask_kind == "block_causal":
      kwargs.update(q_block_ids=data["block_ids"], kv_block_ids=data["block_ids"])
    return kwargs

  def _check(self, impl, q, k, v, d_out, mask_kwargs, *, dtype, atol, grad_atol):
    """Output and (dq, dk, dv) of `impl` vs the fp32 reference on the same (rounded) inputs."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))

    def loss(attend, q, k, v):
      out = attend(q, k, v)
      return jnp.sum(out.astype(jnp.float32) * d_out), out

    tested = lambda q, k, v: flash_attention(q, k, v, impl=impl, block_sizes=BLOCKS,
                                             interpret=self.INTERPRET, **mask_kwargs)
    spec = lambda q, k, v: attention_reference(q, k, v, **mask_kwargs)
    grad = lambda attend: jax.jit(jax.grad(lambda *a: loss(attend, *a), argnums=(0, 1, 2),
                                           has_aux=True))
    upcast = [x.astype(jnp.float32) for x in (q, k, v)]
    grads, out = grad(tested)(q, k, v)
    want_grads, want_out = grad(spec)(*upcast)
    assert out.dtype == dtype and out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=atol, rtol=atol)
    for name, got, want, primal in zip("qkv", grads, want_grads, (q, k, v)):
      assert got.dtype == primal.dtype, name
      scale = float(jnp.abs(want).max())
      np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=grad_atol * scale,
                                 err_msg=f"d{name} of impl={impl}")
    return out

  @pytest.mark.parametrize("impl", IMPLS)
  @pytest.mark.parametrize("mask_kind", ["bidirectional", "causal", "block_causal"])
  def test_packed_rows_fp32(self, data, impl, mask_kind):
    out = self._check(impl, data["q"], data["k"], data["v"], data["d_out"],
                      self._mask_kwargs(data, mask_kind), dtype=jnp.float32, atol=2e-5,
                      grad_atol=2e-5)
    # Padding queries (the tail of row 0 and all of row 2) output exact zeros.
    padding = np.asarray(data["segment_ids"] == 0)
    assert padding[2].all() and padding[0].any()
    assert not np.asarray(out)[padding].any()

  @pytest.mark.parametrize("impl,mask_kind", [("pallas", "block_causal"), ("xla", "causal"),
                                              pytest.param("tokamax", "block_causal", marks=TOKAMAX),
                                              pytest.param("tokamax_fwd", "causal", marks=TOKAMAX)])
  def test_packed_rows_bf16(self, data, impl, mask_kind):
    self._check(impl, data["q"], data["k"], data["v"], data["d_out"],
                self._mask_kwargs(data, mask_kind), dtype=jnp.bfloat16, atol=3e-2, grad_atol=3e-2)

  def test_packed_rows_bf16_a_kv_head_per_query_head(self, data):
    # No groups: the Pallas dK/dV pass writes bf16 itself instead of fp32 slices summed outside.
    k, v = (jnp.concatenate([x, x[..., ::-1]], axis=2) for x in (data["k"], data["v"]))
    assert k.shape[2] == HEADS
    self._check("pallas", data["q"], k, v, data["d_out"], self._mask_kwargs(data, "causal"),
                dtype=jnp.bfloat16, atol=3e-2, grad_atol=3e-2)

  @pytest.mark.parametrize("impl", IMPLS)
  def test_cross_attention_multi_query_default_positions(self, data, impl):
    # 24 queries over 80 keys, one kv head (MQA), causal with the spec's default positions: the
    # queries are the last 24 of the 80 positions.
    q = data["q"][:, :24]
    k, v = data["k"][:, :, :1], data["v"][:, :, :1]
    self._check(impl, q, k, v, data["d_out"][:, :24], dict(mask_kind="causal"),
                dtype=jnp.float32, atol=2e-5, grad_atol=2e-5)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GPU class covers this backend")
class TestAttentionInterpret(AttentionTest):
  INTERPRET = True


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiles the Pallas kernels for a GPU")
class TestAttentionGpu(AttentionTest):
  INTERPRET = False


def test_tile_skipping_follows_segment_lengths():
  # Four 32-token segments in a 128-token row with 16-token tiles: each segment covers 2x2 tiles,
  # so 16 of 64 tiles are active bidirectionally and 12 (lower triangles) causally.
  segment_ids = jnp.repeat(jnp.arange(1, 5), 32)[None]
  positions = jnp.tile(jnp.arange(32), 4)[None]
  mask = MaskInputs(segment_ids, segment_ids, positions, positions)
  blocks = BlockSizes(16, 16, 16, 16)
  assert float(active_fraction(mask, blocks, ordered=False)) == 16 / 64
  assert float(active_fraction(mask, blocks, ordered=True)) == 12 / 64
  # A row of padding runs no tile at all.
  empty = MaskInputs(*(jnp.zeros((1, 128), jnp.int32),) * 4)
  assert not active_tiles(empty, 16, 16, ordered=False).any()


def test_choose_impl_and_errors():
  q = jnp.zeros((1, 1024, 2, 32))
  expected = "pallas" if jax.default_backend() == "gpu" else "xla"
  assert choose_impl(q, q) == expected
  if jax.default_backend() != "gpu":
    assert choose_impl(q[:, :64], q[:, :64]) == "reference"
    with pytest.raises(ValueError, match="needs a GPU"):
      attention(q, q, q, impl="cudnn")
  with pytest.raises(ValueError, match="not one of"):
    attention(q, q, q, impl="flash")
  with pytest.raises(ValueError, match="head_dim"):
    attention(jnp.zeros((1, 16, 2, 320)), jnp.zeros((1, 16, 2, 320)), jnp.zeros((1, 16, 2, 320)),
              impl="pallas")
  with pytest.raises(ValueError, match="multiple of kv_heads"):
    attention(jnp.zeros((1, 16, 3, 32)), q[:, :16], q[:, :16], impl="xla")


def test_auto_matches_reference_on_a_long_row():
  # Long enough that auto picks the blockwise path off GPU; through the public signature.
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(1, 320, 2, 16)), jnp.float32)
  segment_ids = jnp.asarray(np.repeat([1, 2, 3, 0], [100, 150, 50, 20])[None])
  kwargs = dict(q_segment_ids=segment_ids, kv_segment_ids=segment_ids, mask_kind="causal")
  np.testing.assert_allclose(attention(q, q, q, **kwargs), attention_reference(q, q, q, **kwargs),
                             atol=2e-5)


def test_xla_default_cpu_tiles_values_and_gradients():
  # The CPU defaults use different forward and backward tiles (128x64, then 64x64), so the backward
  # re-tiles the forward's lse; a 320-token row pads to 384 and has segments that straddle tiles.
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(2, 320, 4, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, 320, 2, 16)), jnp.float32) for _ in range(2))
  segment_ids = jnp.asarray(np.stack([np.repeat([1, 2, 3, 0], [70, 150, 90, 10]),
                                      np.repeat([1, 2], [200, 120])]))
  block_ids = jnp.asarray(np.tile(np.repeat([0, 1, 2], [250, 10, 60]), (2, 1)))
  kwargs = dict(q_segment_ids=segment_ids, kv_segment_ids=segment_ids, mask_kind="block_causal",
                q_block_ids=block_ids, kv_block_ids=block_ids)
  tested = lambda q, k, v: flash_attention(q, k, v, impl="xla", **kwargs)
  spec = lambda q, k, v: attention_reference(q, k, v, **kwargs)
  np.testing.assert_allclose(tested(q, k, v), spec(q, k, v), atol=2e-5)
  loss = lambda attend: jax.grad(lambda *a: jnp.sum(jnp.sin(attend(*a))), argnums=(0, 1, 2))(q, k, v)
  for got, want in zip(loss(tested), loss(spec)):
    np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()))


def test_xla_query_whose_first_tile_is_all_masked():
  # Segment 1 = tokens 0..19, segment 2 = 20..47, 16-token tiles. kv tile 0 (tokens 0..15) is active
  # for q block 1 (tokens 16..31) through segment 1's tokens 16..19, but for the segment-2 queries
  # 20..31 every key in it is masked: their online softmax starts on an all-masked tile, which the
  # xla path does not mask explicitly (weights exp(0) = 1) and must wipe at the first allowed key.
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(4 * rng.normal(size=(1, 48, 2, 16)), jnp.float32) for _ in range(3))
  segment_ids = jnp.asarray(np.repeat([1, 2], [20, 28])[None])
  kwargs = dict(q_segment_ids=segment_ids, kv_segment_ids=segment_ids, mask_kind="bidirectional")
  tested = lambda q, k, v: flash_attention(q, k, v, impl="xla", block_sizes=BlockSizes(16, 16, 16, 16),
                                           **kwargs)
  spec = lambda q, k, v: attention_reference(q, k, v, **kwargs)
  np.testing.assert_allclose(tested(q, k, v), spec(q, k, v), atol=2e-5)
  loss = lambda attend: jax.grad(lambda *a: jnp.sum(jnp.sin(attend(*a))), argnums=(0, 1, 2))(q, k, v)
  for got, want in zip(loss(tested), loss(spec)):
    np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()))


def test_xla_inside_shard_map_with_the_varying_axes_check():
  # Data-parallel training calls the op inside jax.shard_map, whose varying-axes check is on by
  # default: the tile loops' carries must enter typed like the per-device rows they accumulate.
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:2])
  rng = np.random.default_rng(4)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 48, 2, 16)), jnp.float32) for _ in range(3))
  segment_ids = jnp.asarray(np.stack([np.repeat([1, 2, 0], [20, 24, 4]), np.repeat([1], [48])]))
  kwargs = lambda seg: dict(q_segment_ids=seg, kv_segment_ids=seg, mask_kind="causal")
  blocks = BlockSizes(16, 16, 16, 16)

  def per_device(q, k, v, seg):
    loss = lambda q, k, v: jnp.sum(jnp.sin(flash_attention(q, k, v, impl="xla", block_sizes=blocks, **kwargs(seg))))
    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    return jax.lax.psum(value, "data"), grads

  rows = NamedSharding(mesh, P("data"))
  sharded = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"),
                                  out_specs=(P(), P("data"))))
  value, grads = sharded(*(jax.device_put(x, rows) for x in (q, k, v, segment_ids)))
  spec = lambda q, k, v: jnp.sum(jnp.sin(attention_reference(q, k, v, **kwargs(segment_ids))))
  want_value, want_grads = jax.value_and_grad(spec, argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()))


def _interval_case(kind):
  """Two packed rows (padding between and after segments, one row starting with padding)."""
  segment_ids = np.array([[1] * 5 + [2] * 7 + [0] * 2 + [3] * 6 + [0] * 4,
                          [0] * 3 + [1] * 10 + [2] * 11])
  positions = np.concatenate([np.arange(24)[None]] * 2)
  block_ids = np.cumsum(np.arange(24) % 5 == 3, dtype=np.int32)[None].repeat(2, 0)
  keys = {"causal": (positions, positions, None, None), "block_causal": (None, None, block_ids, block_ids),
          "bidirectional": (None,) * 4}[kind]
  return normalise_mask(2, 24, 24, kind, segment_ids, segment_ids, *keys)


@pytest.mark.parametrize("kind", ["bidirectional", "causal", "block_causal"])
def test_key_ranges_are_the_mask_on_packed_rows(kind):
  mask, ordered = _interval_case(kind)
  ranges = intervals.key_ranges(mask, ordered)
  keys = np.arange(24)
  got = (keys >= np.asarray(ranges.k_start)[..., None]) & (keys < np.asarray(ranges.k_end)[..., None])
  assert bool(ranges.valid)
  np.testing.assert_array_equal(got, pair_mask(*mask[:4], ordered))
  np.testing.assert_array_equal(ranges.has_keys, np.asarray(pair_mask(*mask[:4], ordered)).any(-1))


def test_key_ranges_flag_layouts_that_are_not_ranges():
  mask, _ = _interval_case("bidirectional")
  holed = mask._replace(kv_segment_ids=mask.kv_segment_ids.at[0, 2].set(0))  # padding inside a segment
  assert not bool(intervals.key_ranges(holed, False).valid)
  mask, _ = _interval_case("causal")
  falling = mask._replace(kv_keys=mask.kv_keys.at[0, 3].set(0))  # order keys fall inside a segment
  assert not bool(intervals.key_ranges(falling, True).valid)
  assert bool(intervals.key_ranges(falling, False).valid)


def test_packed_segments_offsets_and_checks():
  mask, ordered = _interval_case("causal")
  packed = intervals.packed_segments(mask, ordered, max_segments=4)
  assert bool(packed.valid)
  np.testing.assert_array_equal(packed.offsets, [[0, 5, 14, -1, -1], [3, 13, -1, -1, -1]])
  np.testing.assert_array_equal(packed.lengths, [[5, 7, 6, -1], [10, 11, -1, -1]])
  assert not bool(intervals.packed_segments(mask, ordered, max_segments=2).valid)  # 3 segments in a row
  # Block ids repeat inside a segment: no causal order cuDNN can run.
  mask, ordered = _interval_case("block_causal")
  assert not bool(intervals.packed_segments(mask, ordered, max_segments=4).valid)


@TOKAMAX
@pytest.mark.parametrize("impl", ["tokamax", "tokamax_fwd"])
def test_tokamax_falls_back_to_ejax_for_a_layout_that_is_not_ranges(impl):
  rng = np.random.default_rng(1)
  mask, _ = _interval_case("causal")
  segment_ids = np.asarray(mask.q_segment_ids).copy()
  segment_ids[0, 2] = 0  # padding inside segment 1: no key range holds this mask
  q, k, v = (jnp.asarray(rng.normal(size=(2, 24, 2, 16)), jnp.float32) for _ in range(3))
  kwargs = dict(q_segment_ids=segment_ids, kv_segment_ids=segment_ids, mask_kind="causal")
  np.testing.assert_allclose(flash_attention(q, k, v, impl=impl, **kwargs),
                             attention_reference(q, k, v, **kwargs), atol=2e-5)


def _range_attention(q, k, v, ranges, scale, **_):
  """Dense attention over each query's key range: a stand-in for tokamax's kernel (tests without it)."""
  allowed = (jnp.arange(k.shape[1]) >= ranges.k_start[..., None]) & (jnp.arange(k.shape[1]) < ranges.k_end[..., None])
  scores = jnp.where(allowed[:, None], jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale, -1e30)
  probs = jax.nn.softmax(scores, axis=-1) * ranges.has_keys[:, None, :, None]
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _unchecked_case(route: str):
  """(run(segment_ids, unchecked) -> (out, dq), a layout of key ranges, one that is not: padding inside a
  segment), for a route that needs packed rows."""
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 24, 2, 16)), jnp.float32) for _ in range(3))
  mask, _ = _interval_case("causal")
  packed = np.asarray(mask.q_segment_ids)
  holed = packed.copy()
  holed[0, 2] = 0

  def run(segment_ids, unchecked):
    kwargs = dict(q_segment_ids=segment_ids, kv_segment_ids=segment_ids, mask_kind="causal")
    with unchecked_layout(unchecked):
      def loss(q):
        out = flash_attention(q, k, v, impl=route, **kwargs)
        return jnp.sum(out * out), out
      (_, out), dq = jax.value_and_grad(loss, has_aux=True)(q)
      jaxpr = str(jax.make_jaxpr(lambda q: flash_attention(q, k, v, impl=route, **kwargs))(q))
    return out, dq, jaxpr, attention_reference(q, k, v, **kwargs)

  return run, packed, holed


def test_unchecked_layout_runs_the_route_unconditionally_and_poisons_rows_that_are_not_packed(monkeypatch):
  """Under unchecked_layout (the train step's default) a route that needs packed rows runs without the
  lax.cond beside ejax's exact kernel: on packed rows the same values and gradients, on rows it cannot
  take NaN (where the checked op gives the exact answer). tokamax's kernel is stood in for here."""
  monkeypatch.setattr(tokamax_gpu, "available", lambda: True)
  monkeypatch.setattr(tokamax_gpu, "attention", _range_attention)
  run, packed, holed = _unchecked_case("tokamax")
  out, dq, jaxpr, want = run(packed, unchecked=False)
  assert " cond[" in jaxpr
  np.testing.assert_allclose(out, want, atol=2e-5)
  fast_out, fast_dq, fast_jaxpr, _ = run(packed, unchecked=True)
  assert " cond[" not in fast_jaxpr
  np.testing.assert_array_equal(fast_out, out)
  np.testing.assert_allclose(fast_dq, dq, atol=1e-5)
  checked, _, _, want = run(holed, unchecked=False)
  np.testing.assert_allclose(checked, want, atol=2e-5)
  poisoned, _, _, _ = run(holed, unchecked=True)
  assert np.isnan(np.asarray(poisoned)).all()


@TOKAMAX
def test_unchecked_layout_with_tokamax_fwd():
  run, packed, holed = _unchecked_case("tokamax_fwd")
  out, dq, _, want = run(packed, unchecked=False)
  fast_out, fast_dq, fast_jaxpr, _ = run(packed, unchecked=True)
  assert " cond[" not in fast_jaxpr
  np.testing.assert_allclose(fast_out, out, atol=1e-6)
  np.testing.assert_allclose(fast_dq, dq, atol=1e-5)
  assert np.isnan(np.asarray(run(holed, unchecked=True)[0])).all()


def test_auto_on_hopper_takes_the_measured_impl_where_it_applies(monkeypatch):
  q = jnp.zeros((1, 1024, 2, 64), jnp.bfloat16)
  monkeypatch.setattr(ops.platform, "on_gpu", lambda: True)
  monkeypatch.setattr(ops, "_hopper", lambda: True)
  monkeypatch.setattr(ops, "HOPPER_AUTO", ("cudnn_packed",))
  assert choose_impl(q, q, mask_kind="causal") == "cudnn_packed"
  assert choose_impl(q, q, mask_kind="block_causal") == "pallas"  # no cuDNN form: ejax's kernel
  monkeypatch.setattr(ops, "HOPPER_AUTO", ("tokamax",))
  assert choose_impl(q, q) == ("tokamax" if tokamax_gpu.available() else "pallas")
  monkeypatch.setattr(ops, "HOPPER_AUTO", ("cudnn_packed", "tokamax"))  # the first that applies
  assert choose_impl(q, q, mask_kind="causal") == "cudnn_packed"
  assert choose_impl(q, q, mask_kind="block_causal") == ("tokamax" if tokamax_gpu.available() else "pallas")
  # EJAX_HOPPER_AUTO replaces the list (benchmarks/gpu.py drops a route that fails its check).
  monkeypatch.setenv(ops.HOPPER_AUTO_ENV, "tokamax")  # the patched list would give cudnn_packed
  assert choose_impl(q, q, mask_kind="causal") == ("tokamax" if tokamax_gpu.available() else "pallas")
  monkeypatch.setenv(ops.HOPPER_AUTO_ENV, " tokamax , cudnn_packed")
  assert ops.hopper_auto() == ("tokamax", "cudnn_packed")
  monkeypatch.setenv(ops.HOPPER_AUTO_ENV, "mosaic,fast")
  with pytest.raises(ValueError, match="EJAX_HOPPER_AUTO='mosaic,fast': 'fast' not attention impls"):
    choose_impl(q, q, mask_kind="causal")
  monkeypatch.setenv(ops.HOPPER_AUTO_ENV, "")
  assert ops.hopper_auto() == ops.HOPPER_AUTO
  monkeypatch.setattr(ops, "_hopper", lambda: False)
  assert choose_impl(q, q) == "pallas"


def test_a_hopper_route_limited_to_head_sizes_hands_the_others_on(monkeypatch):
  """auto's Hopper routes as "impl@128" (or "impl@64+128") take only those head sizes (auto's first route
  while mosaic_own's forward was wrong at 64, 2026-11-30 to 2026-12-04). A bad route is one line naming it."""
  monkeypatch.setattr(ops.platform, "on_gpu", lambda: True)
  monkeypatch.setattr(ops, "_hopper", lambda: True)
  monkeypatch.setattr(ops.routes, "applies", lambda impl, q, k, mask_kind: impl != "pallas")
  at = lambda head_dim: jnp.zeros((1, 1024, 2, head_dim), jnp.bfloat16)
  monkeypatch.setattr(ops, "HOPPER_AUTO", ("mosaic_own@128", "mosaic"))
  assert [choose_impl(at(d), at(d), mask_kind="block_causal") for d in (64, 128, 256)] == ["mosaic", "mosaic_own", "mosaic"]
  monkeypatch.setenv(ops.HOPPER_AUTO_ENV, "mosaic_own@64+128, tokamax_fwd")
  assert [choose_impl(at(d), at(d)) for d in (64, 128, 256)] == ["mosaic_own", "mosaic_own", "tokamax_fwd"]
  assert ops.parse_route(" mosaic_own@64+128") == ("mosaic_own", (64, 128)) and ops.parse_route("xla") == ("xla", ())
  for bad in ("mosaic_own@", "mosaic_own@wide", "fast@128", "auto"):
    monkeypatch.setenv(ops.HOPPER_AUTO_ENV, bad)
    with pytest.raises(ValueError, match="not attention impls; .* limited to head sizes as impl@128"):
      choose_impl(at(128), at(128))
    with pytest.raises(ValueError, match=f"attention route '{bad}': not an attention impl"):
      ops.parse_route(bad)
  # The default list's first route is mosaic_own at head size 128 (gpu.py's route check says so first).
  assert ops.parse_route(ops.HOPPER_AUTO[0]) == ("mosaic_own", (128,))


def test_new_impls_refuse_clearly():
  q = jnp.zeros((1, 32, 2, 32))
  with pytest.raises(ValueError, match="cudnn_packed.*needs a GPU"):
    flash_attention(q, q, q, impl="cudnn_packed")
  if not tokamax_gpu.available():
    with pytest.raises(ValueError, match="impl='tokamax'.*use impl='auto'"):
      flash_attention(q, q, q, impl="tokamax")
    with pytest.raises(ValueError, match="impl='mosaic'.*use impl='auto'"):
      flash_attention(q, q, q, impl="mosaic")
  else:  # the Mosaic GPU backward takes 16-bit floats only
    with pytest.raises(ValueError, match="impl='mosaic'.*bf16/f16.*float32"):
      flash_attention(q, q, q, impl="mosaic")
  # ejax's own Mosaic GPU kernels: jax >= 0.11 and 16-bit floats, no tokamax.
  with pytest.raises(ValueError, match="impl='mosaic_own'.*(bf16/f16.*float32|use impl='auto')"):
    flash_attention(q, q, q, impl="mosaic_own")


def test_block_sizes_carry_launch_settings():
  blocks = BlockSizes(128, 64, 64, 64, num_warps=4, num_stages=3).fitted(40, 40)
  assert (blocks.block_q, blocks.block_kv, blocks.num_warps, blocks.num_stages) == (64, 64, 4, 3)
  with pytest.raises(ValueError, match="num_warps"):
    BlockSizes(num_warps=3)


@pytest.mark.parametrize("head_dim", [24, 48, 72])
def test_head_sizes_the_kernels_lack_run_padded_with_the_same_values_and_gradients(head_dim):
  """SigLIP's 72-wide and the DiT's 48-wide heads run in the Pallas kernel on zero-padded heads
  (interpret mode here) instead of the XLA tile loops: same attention, same gradients."""
  rng = np.random.default_rng(head_dim)
  segment_ids, positions, _ = _packed_layout(rng, 48)
  q, k, v, d_out = (jnp.asarray(rng.normal(size=(BATCH, 48, 2, head_dim)), jnp.float32) for _ in range(4))
  kwargs = dict(q_segment_ids=jnp.asarray(segment_ids), kv_segment_ids=jnp.asarray(segment_ids),
                q_positions=jnp.asarray(positions), kv_positions=jnp.asarray(positions), mask_kind="causal")
  assert ops._kernel_head_dim(q, "pallas") == next(d for d in (32, 64, 128) if d > head_dim)
  assert ops._kernel_head_dim(q, "xla") == head_dim
  blocks = BlockSizes(block_q=16, block_kv=16, block_q_bwd=16, block_kv_bwd=16)

  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v) * d_out)

  padded = lambda q, k, v: flash_attention(q, k, v, impl="pallas", block_sizes=blocks, interpret=True, **kwargs)
  reference = lambda q, k, v: attention_reference(q, k, v, **kwargs)
  out = padded(q, k, v)
  assert out.shape == q.shape
  np.testing.assert_allclose(out, reference(q, k, v), atol=2e-5, rtol=2e-5)
  for ours, theirs in zip(jax.grad(loss(padded), argnums=(0, 1, 2))(q, k, v),
                          jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(ours, theirs, atol=5e-5, rtol=5e-5)
