"""umT5-XXL's encoder as Wan uses it (frozen): 24 layers, width 4096, 64 heads x 64, gated-GELU 10240.

T5 blocks without biases or attention scaling, RMS layer norms, and a learnt relative-position bias per
layer (umT5: not shared; 32 buckets, bidirectional, max distance 128). Prompts are padded to 512 tokens;
padded keys are masked, and the outputs at padded positions are zeroed as Wan does (it slices each
prompt to its length and pads the embeddings with zeros). The attention carries an additive bias,
which ejax's attention op does not take, so it is a dense jnp softmax (512 tokens, inference only).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from ejax.models import layers
from ejax.parallel import constrain
from ejax.parallel.axes import ACT_BATCH, ACT_EMBED, ACT_LEN, EMBED, HEADS, MLP, VOCAB


@dataclasses.dataclass(frozen=True)
class UMT5Config:
  vocab_size: int = 256384
  dim: int = 4096
  ffn_dim: int = 10240
  num_heads: int = 64
  num_layers: int = 24
  num_buckets: int = 32
  max_distance: int = 128
  eps: float = 1e-6


def relative_buckets(length: int, num_buckets: int, max_distance: int) -> jax.Array:
  """[length, length] T5 bidirectional bucket of (key position - query position)."""
  relative = jnp.arange(length)[None, :] - jnp.arange(length)[:, None]
  half = num_buckets // 2
  buckets = (relative > 0).astype(jnp.int32) * half
  distance = jnp.abs(relative)
  max_exact = half // 2
  large = max_exact + (jnp.log(jnp.maximum(distance, 1) / max_exact) / math.log(max_distance / max_exact)
                       * (half - max_exact)).astype(jnp.int32)
  return buckets + jnp.where(distance < max_exact, distance, jnp.minimum(large, half - 1))


class T5Block(nnx.Module):
  def __init__(self, config: UMT5Config, *, dtype, param_dtype, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    dim = config.dim
    self.num_heads = config.num_heads
    self.norm1 = layers.RMSNorm(dim, eps=config.eps, **common)
    self.norm2 = layers.RMSNorm(dim, eps=config.eps, **common)
    self.q, self.k, self.v = (layers.Dense(dim, dim, axes=(EMBED, MLP), use_bias=False, **common) for _ in range(3))
    self.o = layers.Dense(dim, dim, axes=(MLP, EMBED), use_bias=False, **common)
    self.gate = layers.Dense(dim, config.ffn_dim, axes=(EMBED, MLP), use_bias=False, **common)
    self.fc1 = layers.Dense(dim, config.ffn_dim, axes=(EMBED, MLP), use_bias=False, **common)
    self.fc2 = layers.Dense(config.ffn_dim, dim, axes=(MLP, EMBED), use_bias=False, **common)
    self.pos_embedding = layers.make_param(rngs, nnx.initializers.normal(1.0), (config.num_buckets, config.num_heads),
                                           (None, HEADS), param_dtype)

  def __call__(self, x, buckets, key_mask):
    h = self.norm1(x)
    heads = lambda t: t.reshape(*t.shape[:2], self.num_heads, -1)
    q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
    bias = jnp.take(self.pos_embedding[...].astype(jnp.float32), buckets, axis=0).transpose(2, 0, 1)  # [h, q, k]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) + bias
    scores = jnp.where(key_mask[:, None, None, :], scores, -1e30)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape)
    x = x + self.o(out)
    h = self.norm2(x)
    return constrain(x + self.fc2(self.fc1(h) * jax.nn.gelu(self.gate(h), approximate=True)),
                     (ACT_BATCH, ACT_LEN, ACT_EMBED))


class UMT5Encoder(nnx.Module):
  """token ids [b, L] + mask [b, L] -> [b, L, dim] (zeros at padded positions)."""

  def __init__(self, config: UMT5Config, *, dtype=jnp.float32, param_dtype=jnp.float32, scan_layers: bool = True,
               rngs: nnx.Rngs):
    self.config = config
    self.scan_layers = scan_layers    # the blocks as one lax.scan (layers.run_blocks)
    self.token_embedding = layers.make_param(rngs, nnx.initializers.normal(1.0), (config.vocab_size, config.dim),
                                             (VOCAB, EMBED), param_dtype)
    self.blocks = nnx.List([T5Block(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                            for _ in range(config.num_layers)])
    self.norm = layers.RMSNorm(config.dim, eps=config.eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.dtype = dtype

  def __call__(self, token_ids: jax.Array, mask: jax.Array) -> jax.Array:
    mask = mask.astype(bool)
    # batch-sharded from here: the embedding's rows are FSDP-sharded on their width, and without the
    # constraint XLA kept that layout, running umT5 on the whole global batch on every device
    x = constrain(jnp.take(self.token_embedding[...], token_ids, axis=0).astype(self.dtype),
                  (ACT_BATCH, ACT_LEN, ACT_EMBED))
    buckets = relative_buckets(token_ids.shape[1], self.config.num_buckets, self.config.max_distance)
    x = layers.run_blocks(self.blocks, x, buckets, mask, scan=self.scan_layers)
    return jnp.where(mask[..., None], self.norm(x), 0).astype(self.dtype)

