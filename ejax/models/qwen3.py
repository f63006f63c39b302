"""Qwen3 decoder (GQA, RoPE, RMSNorm, QK-norm) that can stop after `num_layers` blocks.

GR00T-N1.5 keeps only the first 12 of Qwen3-1.7B's 28 layers (select_layer = 12) and uses the
12th layer's output after the final RMSNorm as its VL features: with the later layers removed,
Hugging Face's last `hidden_states` entry is `norm(layer_12(...))`, which is what the released
action head was trained on. The LM head is not built (its weight is tied to the embedding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ejax.kernels.attention import with_attention_impl
from ejax.models import layers
from ejax.parallel import constrain
from ejax.parallel.axes import ACT_BATCH, ACT_EMBED, ACT_LEN, EMBED, VOCAB


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  vocab_size: int = 151680
  width: int = 2048
  mlp_dim: int = 6144
  num_heads: int = 16
  num_kv_heads: int = 8
  head_dim: int = 128
  num_layers: int = 12          # layers kept (GR00T's select_layer), not the LLM's full depth
  rope_theta: float = 1_000_000.0
  norm_eps: float = 1e-6


class Qwen3Block(nnx.Module):

  FP8_INPUT_NORMS = {"input_layernorm": "self_attn", "post_attention_layernorm": "mlp"}  # norm -> its reader

  def __init__(self, config: Qwen3Config, *, dtype, param_dtype, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.input_layernorm = layers.RMSNorm(config.width, eps=config.norm_eps, **common)
    self.self_attn = layers.Attention(
        config.width, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        qk_norm=True, norm_eps=config.norm_eps, rope_theta=config.rope_theta, **common)
    self.post_attention_layernorm = layers.RMSNorm(config.width, eps=config.norm_eps, **common)
    self.mlp = layers.GatedMLP(config.width, config.mlp_dim, act="silu", **common)

  def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
    x = x + self.self_attn(self.input_layernorm(x), mask_kind="causal", q_segment_ids=segment_ids,
                           q_positions=positions)
    x = x + self.mlp(self.post_attention_layernorm(x))
    return constrain(x, (ACT_BATCH, ACT_LEN, ACT_EMBED))


class Qwen3(nnx.Module):
  """Token embedding + the first `num_layers` decoder blocks + final RMSNorm."""

  def __init__(self, config: Qwen3Config, *, dtype=jnp.float32, param_dtype=jnp.float32, remat: str = "none",
               attention_impl: str = "auto", scan_layers: bool = True, rngs: nnx.Rngs):
    self.config = config
    self.remat = remat
    self.scan_layers = scan_layers
    self.attention_impl = attention_impl
    self.dtype = dtype
    self.embed_tokens = layers.make_param(rngs, nnx.initializers.normal(0.02), (config.vocab_size, config.width),
                                          (VOCAB, EMBED), param_dtype)
    self.blocks = nnx.List([Qwen3Block(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                            for _ in range(config.num_layers)])
    self.norm = layers.RMSNorm(config.width, eps=config.norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def embed(self, tokens: jax.Array) -> jax.Array:
    """tokens [b, l] int32 -> [b, l, width]."""
    return jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.dtype)

  @with_attention_impl
  def __call__(self, embeddings: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """embeddings [b, l, width] (text and image tokens), segment_ids/positions [b, l] -> features."""
    x = constrain(embeddings.astype(self.dtype), (ACT_BATCH, ACT_LEN, ACT_EMBED))
    x = layers.run_blocks(self.blocks, x, segment_ids, positions, remat=self.remat, scan=self.scan_layers)
    return self.norm(x)
