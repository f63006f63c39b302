"""The "wam" mask kind (DreamZero's world-action-model attention) against the official semantics.

The specification here is a direct per-block implementation of the official teacher-forcing branch
(dreamzero0/dreamzero, CausalWanSelfAttention): each block of queries attends, with a plain softmax,
to the keys the official code concatenates for it. ejax's one attention call with mask kind "wam" must
give the same values and gradients on every path (reference, XLA, Pallas in interpret mode on CPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejax.kernels.attention import BlockSizes, attention_mask, flash_attention
from ejax.kernels.attention.tiles import active_tiles, normalise_mask
from ejax.models.dreamzero.sequence import Layout, direct_wam_mask, wam_mask_ids
from tests.cuda_lowering import TRITON, custom_calls, forbid_fallbacks, lower_for_cuda, triton_kernels  # noqa: F401

# 8 tokens a latent frame, 2 chunks of 2 frames, 4 actions and 1 state a chunk: 40 + 40 + 8 + 2 tokens.
LAYOUT = Layout(grid_height=2, grid_width=4, num_chunks=2, frames_per_chunk=2, actions_per_chunk=4,
                states_per_chunk=1)
BLOCKS = BlockSizes(block_q=16, block_kv=16, block_q_bwd=16, block_kv_bwd=32)
HEADS, HEAD_DIM = 2, 16


def _softmax_attention(q, k, v, allowed=None):
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * HEAD_DIM**-0.5
  if allowed is not None:
    scores = jnp.where(allowed, scores, -jnp.inf)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def official_blockwise(q, k, v, layout: Layout):
  """The official per-block attention: [clean | noisy video | actions | states] in, same order out."""
  frame, chunk = layout.frame_tokens, layout.frames_per_chunk * layout.frame_tokens
  video = layout.video_tokens
  split = lambda x: (x[:, :video], x[:, video:2 * video], x[:, 2 * video:2 * video + layout.num_actions],
                     x[:, 2 * video + layout.num_actions:])
  (cq, nq, aq, sq), (ck, nk, ak, sk), (cv, nv, av, sv) = split(q), split(k), split(v)
  # Clean: the first frame by itself, the rest causal over all clean keys (aligned bottom-right).
  rest = video - frame
  causal = jnp.arange(video)[None, :] <= jnp.arange(rest)[:, None] + frame
  clean = jnp.concatenate([_softmax_attention(cq[:, :frame], ck[:, :frame], cv[:, :frame]),
                           _softmax_attention(cq[:, frame:], ck, cv, causal)], axis=1)
  noisy, actions, states = [_softmax_attention(nq[:, :frame], nk[:, :frame], nv[:, :frame])], [], []
  a, s = layout.actions_per_chunk, layout.states_per_chunk
  for i in range(layout.num_chunks):
    block = slice(frame + i * chunk, frame + (i + 1) * chunk)
    context = lambda x_clean, x_noisy, x_action, x_state: jnp.concatenate(
        [x_clean[:, :frame + i * chunk], x_noisy[:, block], x_action[:, i * a:(i + 1) * a],
         x_state[:, i * s:(i + 1) * s]], axis=1)
    keys, values = context(ck, nk, ak, sk), context(cv, nv, av, sv)
    noisy.append(_softmax_attention(nq[:, block], keys, values))
    actions.append(_softmax_attention(aq[:, i * a:(i + 1) * a], keys, values))
    states.append(_softmax_attention(sq[:, i * s:(i + 1) * s], sk[:, i * s:(i + 1) * s], sv[:, i * s:(i + 1) * s]))
  return jnp.concatenate([clean] + noisy + actions + states, axis=1)


def test_mask_ids_give_the_official_mask():
  for layout in (LAYOUT, Layout(grid_height=5, grid_width=10)):  # the 5B's 1,000-token sample
    keys, groups = wam_mask_ids(layout)
    as_row = lambda x: jnp.asarray(x)[None]
    mask = attention_mask(layout.length, layout.length, batch=1, mask_kind="wam", q_positions=as_row(keys),
                          kv_positions=as_row(keys), q_block_ids=as_row(groups), kv_block_ids=as_row(groups))
    np.testing.assert_array_equal(np.asarray(mask[0]), direct_wam_mask(layout))
  assert Layout(grid_height=5, grid_width=10).length == 1000


@pytest.fixture(scope="module")
def case():
  """Inputs, the mask arguments and the specification's values and gradients (computed once)."""
  rng = np.random.default_rng(0)
  shape = (2, LAYOUT.length, HEADS, HEAD_DIM)
  q, k, v, d_out = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(4))
  keys, groups = (jnp.broadcast_to(jnp.asarray(x), (2, LAYOUT.length)) for x in wam_mask_ids(LAYOUT))
  kwargs = dict(mask_kind="wam", q_positions=keys, kv_positions=keys, q_block_ids=groups, kv_block_ids=groups)
  spec = lambda q, k, v: official_blockwise(q, k, v, LAYOUT)
  value, grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(spec(*a) * d_out), argnums=(0, 1, 2)))(q, k, v)
  return dict(qkv=(q, k, v), d_out=d_out, kwargs=kwargs, out=jax.jit(spec)(q, k, v), value=value, grads=grads)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_wam_attention_matches_the_official_blocks(case, impl):
  interpret = jax.default_backend() != "gpu"  # a GPU compiles the Triton kernels
  tested = lambda q, k, v: flash_attention(q, k, v, impl=impl, block_sizes=BLOCKS, interpret=interpret,
                                           **case["kwargs"])
  q, k, v = case["qkv"]
  np.testing.assert_allclose(jax.jit(tested)(q, k, v), case["out"], atol=2e-5, rtol=2e-5)
  value, grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(tested(*a) * case["d_out"]), argnums=(0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(value, case["value"], rtol=1e-5)
  for name, got, want in zip("qkv", grads, case["grads"]):
    np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()), err_msg=f"d{name} of impl={impl}")


def test_tiles_the_mask_forbids_are_skipped():
  """At the 5B's sample (1,000 tokens, 64-token tiles) about half the tiles run, and no allowed pair
  lies in a skipped tile."""
  layout = Layout(grid_height=5, grid_width=10)
  keys, groups = (jnp.asarray(x)[None] for x in wam_mask_ids(layout))
  padded = 1024
  pad = lambda x, value: jnp.pad(x, [(0, 0), (0, padded - layout.length)], constant_values=value)
  segments = pad(jnp.ones((1, layout.length), jnp.int32), 0)
  mask, ordered = normalise_mask(1, padded, padded, "wam", segments, segments, pad(keys, 0), pad(keys, 0),
                                 pad(groups, 0), pad(groups, 0))
  active = np.asarray(active_tiles(mask, 64, 64, ordered)[0])
  dense = np.zeros((padded, padded), bool)
  dense[:layout.length, :layout.length] = direct_wam_mask(layout)
  holds_pairs = dense.reshape(16, 64, 16, 64).any(axis=(1, 3))
  assert not (holds_pairs & ~active).any()
  assert 0.4 < active.mean() < 0.6, active.mean()


def test_external_kernels_refuse_the_wam_mask():
  x = jnp.zeros((1, 16, 1, 16))
  ids = jnp.zeros((1, 16), jnp.int32)
  with pytest.raises(ValueError, match="does not take mask_kind='wam'"):
    flash_attention(x, x, x, impl="tokamax", mask_kind="wam", q_positions=ids, kv_positions=ids,
                    q_block_ids=ids, kv_block_ids=ids)
  with pytest.raises(ValueError, match="needs q_positions, kv_positions, q_block_ids and kv_block_ids"):
    flash_attention(x, x, x, impl="xla", mask_kind="wam")


def test_wam_kernels_lower_to_triton_for_cuda(forbid_fallbacks):
  """The grouped forward, dQ and dK/dV kernels lower for CUDA from this CPU host (bf16, 64-wide heads,
  the 5B sample's 1,000 tokens: no multiple of the tiles)."""
  layout = Layout(grid_height=5, grid_width=10)
  keys, groups = (jnp.broadcast_to(jnp.asarray(x), (2, layout.length)) for x in wam_mask_ids(layout))

  def loss(q, k, v):
    out = flash_attention(q, k, v, impl="pallas", mask_kind="wam", q_positions=keys, kv_positions=keys,
                          q_block_ids=groups, kv_block_ids=groups)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  qkv = [jax.ShapeDtypeStruct((2, layout.length, 4, 64), jnp.bfloat16)] * 3
  module = lower_for_cuda(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), *qkv)
  assert set(custom_calls(module)) == {TRITON}
  assert set(triton_kernels(module)) == {"ejax_varlen_attention_fwd", "ejax_varlen_attention_dq",
                                         "ejax_varlen_attention_dkv"}
