"""cuDNN flash attention over packed rows: segments as per-row offsets and lengths (Hopper and later).

jax's cuDNN fused attention takes `q_offsets` / `kv_offsets` with `q_seqlen` / `kv_seqlen` ([batch,
max_segments(+1)], -1 padded) and runs each segment as its own sequence, so it does only the work the
segments allow, unlike the dense-mask path (ops "cudnn"), which runs every pair of the row. It covers
self-attention rows with the "bidirectional" and "causal" mask kinds (cuDNN's causal mask runs along
the packed tokens: order keys must rise along each segment); "block_causal" has no cuDNN form.
intervals.packed_segments checks the layout on device and routes.py falls back to ejax's kernel where
it does not hold. The entry point is jax's private `fused_attention_stablehlo.dot_product_attention`
(jax.nn.dot_product_attention has no offsets argument).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

from ejax.kernels.attention.intervals import PackedSegments

# The most segments one row may hold for the packed path (more: the layout check fails and routes.py
# falls back). cuDNN takes a static [batch, max_segments] table; a 4,096-token row of the VLA mix
# holds ~10.
MAX_SEGMENTS = 64
MASK_KINDS = ("bidirectional", "causal")


def attention(q, k, v, segments: PackedSegments, *, scale: float, causal: bool):
  """out [batch, len, heads, d]; tokens outside every segment get zeros (and zero gradients)."""
  inside = segments.in_segment[:, :, None, None]
  zero = jnp.zeros((), q.dtype)
  # cuDNN leaves the rows of tokens outside every segment unwritten, forward and backward; the
  # selects give them zeros and keep whatever cuDNN wrote there out of the gradients.
  q, k, v = (jnp.where(inside, x, zero) for x in (q, k, v))
  mask_type = (cudnn_attention.MaskType.PADDING_CAUSAL if causal else cudnn_attention.MaskType.PADDING)
  out = cudnn_attention.dot_product_attention(
      q, k, v, q_seqlen=segments.lengths, kv_seqlen=segments.lengths, q_offsets=segments.offsets,
      kv_offsets=segments.offsets, scale=scale, mask_type=mask_type, qkv_layout="BTNH")
  return jnp.where(inside, out, zero)
