"""Gemma decoder and the mixture-of-transformers joint attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.models import gemma

TINY = gemma.GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=4, num_kv_heads=1, head_dim=8, vocab_size=50)
TINY_EXPERT = gemma.GemmaConfig(width=16, depth=2, mlp_dim=32, num_heads=4, num_kv_heads=1, head_dim=8,
                                adarms_cond_dim=16)


causal_lm = nnx.jit(gemma.causal_lm_forward)


@nnx.jit(static_argnums=(0, 1))
def make_decoder(config, seed):
  """Initialised under jit with an "rbg" key: XLA:CPU takes seconds to compile each partitionable
  threefry draw, so eager or threefry init would dominate this file's run time."""
  return gemma.GemmaDecoder(config, rngs=nnx.Rngs(jax.random.key(seed, impl="rbg")))


@nnx.jit(static_argnames=("return_kv_cache",))
def mixture(decoders, streams, kv_cache=None, return_kv_cache=False):
  return gemma.run_mixture(decoders, streams, kv_cache=kv_cache, return_kv_cache=return_kv_cache)


def _count(module_fn) -> int:
  abstract = nnx.eval_shape(module_fn)
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("config, published", [
    # Gemma-2B as released with PaliGemma: 2,506,172,416 parameters (HF gemma-2b model card / config).
    (gemma.GEMMA_2B, 2_506_172_416),
    # openpi gemma.py: "gemma_300m ... 311M params" (no embedder in the action expert).
    (gemma.GEMMA_300M, 311_000_000),
])
def test_published_parameter_counts_within_two_percent(config, published):
  count = _count(lambda: gemma.GemmaDecoder(config, rngs=nnx.Rngs(0)))
  assert abs(count - published) / published < 0.02, count


def test_adarms_adds_the_zero_initialised_modulation():
  plain = _count(lambda: gemma.GemmaDecoder(TINY_EXPERT.replace(adarms_cond_dim=0), rngs=nnx.Rngs(0)))
  ada = _count(lambda: make_decoder(TINY_EXPERT, 0))
  width, cond, depth = 16, 16, 2
  # Per norm: kernel [cond, 3 width] + bias [3 width] replaces scale [width]; 2 per layer + final.
  assert ada - plain == (2 * depth + 1) * (cond * 3 * width + 3 * width - width)


def _rows(lengths, row_length):
  """Segment ids and per-segment positions of samples laid end to end in one row."""
  seg = np.zeros((1, row_length), np.int32)
  pos = np.zeros((1, row_length), np.int32)
  start = 0
  for i, n in enumerate(lengths):
    seg[0, start:start + n] = i + 1
    pos[0, start:start + n] = np.arange(n)
    start += n
  return jnp.asarray(seg), jnp.asarray(pos)


def test_packed_causal_lm_equals_samples_one_by_one():
  decoder = make_decoder(TINY, 1)
  rng = np.random.default_rng(0)
  lengths = [5, 3, 6]
  samples = [rng.integers(1, 50, n) for n in lengths]
  seg, pos = _rows(lengths, 16)
  tokens = np.zeros((1, 16), np.int32)
  tokens[0, :14] = np.concatenate(samples)
  packed = causal_lm(decoder, jnp.asarray(tokens), seg, pos)
  start = 0
  for sample in samples:
    # Each sample alone in a row of 8 (segment 0 after it), so all three share one compilation.
    n = len(sample)
    alone_tokens = np.zeros((1, 8), np.int32)
    alone_tokens[0, :n] = sample
    alone_seg, alone_pos = _rows([n], 8)
    alone = causal_lm(decoder, jnp.asarray(alone_tokens), alone_seg, alone_pos)
    np.testing.assert_allclose(packed[0, start:start + n], alone[0, :n], atol=1e-5, rtol=1e-5)
    start += n


def test_causal_lm_ignores_future_tokens():
  decoder = make_decoder(TINY, 1)
  tokens = jnp.asarray([[3, 4, 5, 6, 7, 8]])
  changed = tokens.at[0, 5].set(9)
  seg, pos = jnp.ones((1, 6), jnp.int32), jnp.arange(6)[None]
  a = causal_lm(decoder, tokens, seg, pos)
  b = causal_lm(decoder, changed, seg, pos)
  np.testing.assert_allclose(a[0, :5], b[0, :5], atol=1e-6)
  assert np.abs(a[0, 5] - b[0, 5]).max() > 1e-4


def _mixture_inputs(rng, prefix_len=6, suffix_len=4):
  prefix = jnp.asarray(rng.normal(size=(1, prefix_len, 32)), jnp.float32)
  suffix = jnp.asarray(rng.normal(size=(1, suffix_len, 16)), jnp.float32)
  cond = jnp.asarray(rng.normal(size=(1, 16)), jnp.float32)
  ar = jnp.concatenate([jnp.zeros(prefix_len, jnp.int32), jnp.ones(1, jnp.int32), jnp.zeros(suffix_len - 1, jnp.int32)])
  blocks = gemma.block_ids_from_ar_flags(ar)[None]
  pos = jnp.arange(prefix_len + suffix_len)[None]
  ones = jnp.ones((1, prefix_len + suffix_len), jnp.int32)
  prefix_stream = gemma.Stream(prefix, pos[:, :prefix_len], ones[:, :prefix_len], blocks[:, :prefix_len])
  suffix_stream = gemma.Stream(suffix, pos[:, prefix_len:], ones[:, prefix_len:], blocks[:, prefix_len:], cond)
  return prefix_stream, suffix_stream


def _randomise_adarms(decoder, seed):
  """Zero-initialised adaRMS would hide bugs (gate 0 closes every residual): fill it with noise."""
  state = nnx.state(decoder, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(seed, impl="rbg"), 64))
  state = jax.tree.map_with_path(
      lambda path, x: (0.1 * jax.random.normal(next(keys), x.shape) if "norm" in jax.tree_util.keystr(path) else x),
      state)
  nnx.update(decoder, state)


def test_mixture_prefix_never_sees_suffix_and_kv_cache_matches_joint_pass():
  llm = make_decoder(TINY, 2)
  expert = make_decoder(TINY_EXPERT, 3)
  _randomise_adarms(expert, 4)
  prefix, suffix = _mixture_inputs(np.random.default_rng(1))
  (p_joint, s_joint), _ = mixture([llm, expert], [prefix, suffix])
  # The prefix output does not depend on the suffix at all (block-causal mask).
  suffix_changed = gemma.Stream(suffix.x + 1.0, suffix.positions, suffix.segment_ids, suffix.block_ids, suffix.cond)
  (p_changed, s_changed), _ = mixture([llm, expert], [prefix, suffix_changed])
  np.testing.assert_allclose(p_joint, p_changed, atol=1e-6)
  assert np.abs(s_joint - s_changed).max() > 1e-3
  # Prefix once into a cache, then the suffix alone against it: the same suffix output.
  (p_only, none), cache = mixture([llm, expert], [prefix, None], return_kv_cache=True)
  assert none is None and cache.k.shape == (2, 1, 6, 1, 8)
  np.testing.assert_allclose(p_only, p_joint, atol=1e-5)
  (_, s_cached), _ = mixture([llm, expert], [None, suffix], kv_cache=cache)
  np.testing.assert_allclose(s_cached, s_joint, atol=1e-5, rtol=1e-5)


def test_adarms_gate_zero_at_init_makes_expert_layers_identity():
  # With the published zero init every gate is 0, so each layer passes its input through unchanged
  # and the expert output is the (zero-shift, unit-scale) RMS-normalised input.
  llm = make_decoder(TINY, 2)
  expert = make_decoder(TINY_EXPERT, 3)
  prefix, suffix = _mixture_inputs(np.random.default_rng(2))
  (_, out), _ = mixture([llm, expert], [prefix, suffix])
  np.testing.assert_allclose(out, gemma.rms_normalize(suffix.x), atol=1e-5)
