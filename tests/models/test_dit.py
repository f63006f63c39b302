"""GR00T's DiT cross-attention over packed VL rows (ejax.models.dit.packed_cross_attention): each
sample's queries see exactly its own segment of its row, as the gather-each-sample's-row formulation
did, without a per-sample copy of the row's keys; the same numbers shard by shard."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common
from ejax.kernels.attention import attention
from ejax.models.dit import packed_cross_attention
from ejax.parallel import make_mesh, sharding_context

RULES = [tuple(rule) for rule in common.SHARDING_RULES]


def packed_rows(rng, rows: int, length: int, samples_per_shard: int, shards: int):
  """Rows of `length` tokens holding samples of random lengths (trailing padding), each shard's samples
  in its own rows, listed in a shuffled order (as best-fit packing leaves them)."""
  rows_per_shard = rows // shards
  segment_ids = np.zeros((rows, length), np.int32)
  sample_row, sample_segment = [], []
  for shard in range(shards):
    placed = []
    for i in range(samples_per_shard):
      row = shard * rows_per_shard + i % rows_per_shard
      placed.append((row, i // rows_per_shard + 1))
    for row in range(shard * rows_per_shard, (shard + 1) * rows_per_shard):
      segments = sorted(s for r, s in placed if r == row)
      cuts = np.sort(rng.choice(np.arange(1, length - 2), len(segments), replace=False))
      ends = list(cuts[1:]) + [length - rng.integers(0, 3)]
      for segment, start, end in zip(segments, cuts, ends):  # padding before the first and after the last
        segment_ids[row, start:end] = segment
    order = rng.permutation(samples_per_shard)
    sample_row += [placed[i][0] for i in order]
    sample_segment += [placed[i][1] for i in order]
  return segment_ids, np.asarray(sample_row, np.int32), np.asarray(sample_segment, np.int32)


def gathered(q, k, v, *, sample_row, sample_segment, vl_segment_ids):
  """The earlier formulation: every sample gets its row's keys, masked to its own segment."""
  segments = jnp.broadcast_to(sample_segment[:, None], q.shape[:2])
  return attention(q, k[sample_row], v[sample_row], q_segment_ids=segments,
                   kv_segment_ids=vl_segment_ids[sample_row])


@pytest.mark.parametrize("length", [40, 256])  # the dense reference and the XLA tile loops
def test_packed_cross_attention_equals_a_gathered_row_per_sample(length):
  rng = np.random.default_rng(length)
  rows, n, t, heads, dim = 4, 8, 5, 2, 16
  segment_ids, sample_row, sample_segment = packed_rows(rng, rows, length, n, 1)
  q = jnp.asarray(rng.normal(size=(n, t, heads, dim)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(rows, length, heads, dim)), jnp.float32) for _ in range(2))
  d_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  layout = dict(sample_row=jnp.asarray(sample_row), sample_segment=jnp.asarray(sample_segment),
                vl_segment_ids=jnp.asarray(segment_ids))

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v, **layout) * d_out)

  expected = jax.value_and_grad(lambda *a: loss(gathered, *a), argnums=(0, 1, 2))(q, k, v)
  got = jax.jit(jax.value_and_grad(lambda *a: loss(packed_cross_attention, *a), argnums=(0, 1, 2)))(q, k, v)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-5)
  # A sample's output moves with its own segment's keys only.
  row, segment = sample_row[0], sample_segment[0]
  others = jnp.asarray(segment_ids[row] != segment)
  moved = v.at[row].add(jnp.where(others[:, None, None], 5.0, 0.0))
  np.testing.assert_allclose(packed_cross_attention(q, k, moved, **layout)[0],
                             packed_cross_attention(q, k, v, **layout)[0], rtol=1e-6, atol=1e-6)
  # No array of a row per sample: nothing [n, L, ...] in the traced program.
  jaxpr = jax.make_jaxpr(lambda q, k, v: packed_cross_attention(q, k, v, **layout))(q, k, v)
  shapes = {tuple(var.aval.shape) for eqn in jaxpr.jaxpr.eqns for var in eqn.outvars if hasattr(var.aval, "shape")}
  assert not any(len(s) >= 2 and s[:2] == (n, length) for s in shapes), sorted(shapes)


def test_packed_cross_attention_shard_by_shard_matches_unsharded():
  mesh = make_mesh(dict(data=2, fsdp=4, tensor=1))
  rng = np.random.default_rng(7)
  rows, n, t, heads, dim, length = 16, 24, 3, 2, 16, 48
  segment_ids, sample_row, sample_segment = packed_rows(rng, rows, length, n // 8, 8)
  q = jnp.asarray(rng.normal(size=(n, t, heads, dim)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(rows, length, heads, dim)), jnp.float32) for _ in range(2))
  layout = dict(sample_row=jnp.asarray(sample_row), sample_segment=jnp.asarray(sample_segment),
                vl_segment_ids=jnp.asarray(segment_ids))

  def loss(q, k, v):
    return jnp.sum(packed_cross_attention(q, k, v, **layout) ** 2)

  expected = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  with sharding_context(mesh, RULES):
    jitted = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    got = jitted(q, k, v)
    text = jitted.lower(q, k, v).as_text()
  assert "shard_map" in text or "sdy.manual_computation" in text
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-5)
