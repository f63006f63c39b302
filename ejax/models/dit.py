"""GR00T's action-head transformers: the DiT with AdaLN timestep conditioning and interleaved
cross-/self-attention, and the 4-layer self-attention transformer over VL tokens.

Block layout (diffusers' BasicTransformerBlock as GR00T configures it):
  x += dropout(attn(norm1(x), [VL tokens]));  x += ff(norm3(x))
where norm1 is AdaLayerNorm (scale/shift from Linear(SiLU(temb))) in the DiT and an affine
LayerNorm in the VL transformer; ff is Linear -> GELU(tanh) -> dropout -> Linear -> dropout.
Even DiT blocks cross-attend to the VL tokens, odd blocks self-attend.

Packed VL tokens: the VL stream is packed rows [rows, L, d] with segment ids; the action head
runs per sample [n, T, d]. A cross-attention block projects keys/values once per row and attends
each sample's queries to its own segment of its row (packed_cross_attention; the original attends
to padding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ejax.kernels.attention import attention, with_attention_impl
from ejax.models import layers
from ejax.parallel import constrain
from ejax.parallel.axes import ACT_BATCH, ACT_EMBED, ACT_LEN, EMBED, IN_FEATURES, MLP
from ejax.parallel.shard_local import batch_shards, take_rows


@dataclasses.dataclass(frozen=True)
class DiTConfig:
  num_layers: int = 16
  num_heads: int = 32
  head_dim: int = 48
  output_dim: int = 1024
  cross_attention_dim: int = 2048
  dropout: float = 0.2
  timestep_channels: int = 256

  @property
  def width(self) -> int:
    return self.num_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class VLTransformerConfig:
  num_layers: int = 4
  num_heads: int = 32
  head_dim: int = 64
  dropout: float = 0.2

  @property
  def width(self) -> int:
    return self.num_heads * self.head_dim


def timestep_sinusoid(timesteps: jax.Array, channels: int) -> jax.Array:
  """diffusers Timesteps(channels, flip_sin_to_cos=True, downscale_freq_shift=1): [cos, sin]."""
  half = channels // 2
  exponent = -jnp.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / (half - 1)
  angles = timesteps.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]
  return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


def _fp8_factory(fp8: bool):
  """Routes the big feed-forward Dense layers through the FP8 kernel when config.model.fp8."""
  if not fp8:
    return None
  from ejax.kernels.fp8 import make_dense

  def factory(in_features, out_features, *, axes, use_bias, dtype, param_dtype, rngs):
    return make_dense(in_features, out_features, fp8=fp8, kernel_axes=axes, use_bias=use_bias, dtype=dtype,
                      param_dtype=param_dtype, rngs=rngs)
  return factory


class TimestepEncoder(nnx.Module):
  """timestep buckets [n] -> temb [n, width] (256-channel sinusoid -> Linear -> SiLU -> Linear)."""

  def __init__(self, channels: int, width: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.channels = channels
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.linear_1 = layers.Dense(channels, width, axes=(IN_FEATURES, EMBED), **common)
    self.linear_2 = layers.Dense(width, width, axes=(MLP, EMBED), **common)

  def __call__(self, timesteps: jax.Array) -> jax.Array:
    return self.linear_2(jax.nn.silu(self.linear_1(timestep_sinusoid(timesteps, self.channels))))


class AdaLayerNorm(nnx.Module):
  """LayerNorm(x) * (1 + scale) + shift with (scale, shift) = Linear(SiLU(temb))."""

  def __init__(self, width: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.linear = layers.Dense(width, 2 * width, axes=(EMBED, MLP), dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm = layers.LayerNorm(width, eps=1e-5, elementwise_affine=False, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array, temb: jax.Array) -> jax.Array:
    scale, shift = jnp.split(self.linear(jax.nn.silu(temb)), 2, axis=-1)
    return self.norm(x) * (1.0 + scale[:, None]) + shift[:, None]


def packed_cross_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, sample_row: jax.Array,
                           sample_segment: jax.Array, vl_segment_ids: jax.Array) -> jax.Array:
  """Each sample's queries q [n, T, H, D] against its own segment of its packed row: k, v [rows, L, H, D],
  vl_segment_ids [rows, L]; the sample's row and segment in sample_row, sample_segment [n].

  One varlen attention over each batch shard's samples and rows laid end to end: a query carries its
  sample's (row, segment) as its segment id and a key its token's, so the mask keeps every sample to
  its own segment and the kernels skip the tiles between. The queries go in (row, segment) order,
  which keeps a tile's samples within a few key tiles. Gathering each sample's whole row instead (a
  per-sample copy of its row's keys: at full size [32, 2,176, 32 heads, 64] a layer, and f32
  gradients of that size) was GR00T's largest single cost on a GPU (BENCHMARKS.md "Kernels a step").
  """
  n, t = q.shape[:2]
  rows, length = k.shape[:2]
  stride = length + 1  # segment ids of a row are 1..L: (row, segment) -> row * (L + 1) + segment >= 1
  sample_ids = (sample_row * stride + sample_segment).astype(jnp.int32)
  token_ids = jnp.where(vl_segment_ids > 0, jnp.arange(rows, dtype=jnp.int32)[:, None] * stride + vl_segment_ids, 0)
  # Sorted by row, each shard's samples stay in the shard (the trainer packs a shard's samples into its
  # own rows), so the permutation is a shard-local take_rows.
  order = jnp.argsort(sample_ids)
  shards = batch_shards(n, rows)
  per_shard = lambda x: x.reshape(shards, -1, *x.shape[2:])
  q_ids = jnp.broadcast_to(sample_ids[order][:, None], (n, t))
  out = attention(per_shard(take_rows(q, order)), per_shard(k), per_shard(v),
                  q_segment_ids=per_shard(q_ids), kv_segment_ids=per_shard(token_ids))
  return take_rows(out.reshape(q.shape), jnp.argsort(order))


class TransformerBlock(nnx.Module):
  """One block; `ada_norm` for the DiT, `cross_attention_dim` for blocks reading the VL tokens."""

  def __init__(self, width: int, num_heads: int, head_dim: int, *, dropout: float, ada_norm: bool,
               cross_attention_dim: int | None, fp8: bool = False, dtype, param_dtype, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.dropout = dropout
    self.is_cross = cross_attention_dim is not None
    self.norm1 = (AdaLayerNorm(width, **common) if ada_norm else layers.LayerNorm(width, eps=1e-5, **common))
    self.attn1 = layers.Attention(width, num_heads=num_heads, head_dim=head_dim, kv_features=cross_attention_dim,
                                  use_bias=True, **common)
    self.norm3 = layers.LayerNorm(width, eps=1e-5, elementwise_affine=not ada_norm, **common)
    self.ff = layers.MLP(width, 4 * width, act="gelu_tanh", dense_factory=_fp8_factory(fp8), **common)

  def _norm1(self, x, temb):
    return self.norm1(x, temb) if isinstance(self.norm1, AdaLayerNorm) else self.norm1(x)

  def __call__(self, x: jax.Array, *, temb=None, segment_ids=None, vl_tokens=None, vl_segment_ids=None,
               sample_row=None, sample_segment=None, rng=None) -> jax.Array:
    """x [n, T, width]. Self-attention uses `segment_ids` (or none); cross-attention reads packed
    `vl_tokens` [rows, L, d_vl] with `vl_segment_ids` [rows, L] for the samples at (sample_row,
    sample_segment) [n]."""
    rngs = [None] * 3 if rng is None else list(jax.random.split(rng, 3))
    h = self._norm1(x, temb)
    if self.is_cross:
      # One key / value projection per row; each sample reads its own segment of its row.
      out = packed_cross_attention(self.attn1.q_proj(h), self.attn1.k_proj(vl_tokens), self.attn1.v_proj(vl_tokens),
                                   sample_row=sample_row, sample_segment=sample_segment, vl_segment_ids=vl_segment_ids)
      attn_out = self.attn1.o_proj(out)
    else:
      attn_out = self.attn1(h, q_segment_ids=segment_ids)
    x = x + layers.dropout(attn_out, self.dropout, rngs[0])
    h = self.norm3(x)
    h = layers.dropout(layers.activation(self.ff.act)(self.ff.fc1(h)), self.dropout, rngs[1])
    x = x + layers.dropout(self.ff.fc2(h), self.dropout, rngs[2])
    return constrain(x, (ACT_BATCH, ACT_LEN, ACT_EMBED))


class DiT(nnx.Module):
  """tokens [n, T, width] + timestep buckets [n] + packed VL tokens -> [n, T, output_dim]."""

  def __init__(self, config: DiTConfig, *, fp8: bool = False, dtype=jnp.float32, param_dtype=jnp.float32,
               remat: str = "none", attention_impl: str = "auto", scan_layers: bool = True, rngs: nnx.Rngs):
    self.remat = remat
    self.attention_impl = attention_impl
    self.scan_layers = scan_layers
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    width = config.width
    self.timestep_encoder = TimestepEncoder(config.timestep_channels, width, **common)
    self.blocks = nnx.List([
        TransformerBlock(width, config.num_heads, config.head_dim, dropout=config.dropout, ada_norm=True,
                         cross_attention_dim=config.cross_attention_dim if i % 2 == 0 else None, fp8=fp8, **common)
        for i in range(config.num_layers)])
    self.norm_out = layers.LayerNorm(width, eps=1e-6, elementwise_affine=False, dtype=dtype, rngs=rngs)
    self.proj_out_1 = layers.Dense(width, 2 * width, axes=(EMBED, MLP), **common)
    self.proj_out_2 = layers.Dense(width, config.output_dim, axes=(EMBED, MLP), **common)

  @with_attention_impl
  def __call__(self, x: jax.Array, timesteps: jax.Array, *, vl_tokens: jax.Array, vl_segment_ids: jax.Array,
               sample_row: jax.Array, sample_segment: jax.Array, rng: jax.Array | None = None,
               stacked: layers.StackedBlocks | None = None) -> jax.Array:
    """`stacked` (from stack_blocks, made once outside a sampling loop) skips restacking the weights."""
    temb = self.timestep_encoder(timesteps)
    x = constrain(x, (ACT_BATCH, ACT_LEN, ACT_EMBED))
    # Even blocks cross-attend to the VL tokens, odd ones self-attend: scanned in pairs.
    x = layers.run_blocks(self.blocks, x, temb=temb, vl_tokens=vl_tokens, vl_segment_ids=vl_segment_ids,
                          sample_row=sample_row, sample_segment=sample_segment, rng=rng, remat=self.remat,
                          scan=self.scan_layers, period=2, stacked=stacked)
    shift, scale = jnp.split(self.proj_out_1(jax.nn.silu(temb)), 2, axis=-1)
    x = self.norm_out(x) * (1.0 + scale[:, None]) + shift[:, None]
    return self.proj_out_2(x)

  def stack_blocks(self) -> layers.StackedBlocks | None:
    """The blocks' weights as __call__'s scan reads them (None where they run as a loop): a sampling
    loop makes them once and passes them to every step."""
    return layers.stack_blocks(self.blocks, scan=self.scan_layers, period=2)


class VLSelfAttentionTransformer(nnx.Module):
  """Bidirectional transformer over packed VL rows [rows, L, width], within each segment."""

  def __init__(self, config: VLTransformerConfig, *, fp8: bool | str = False, dtype=jnp.float32,
               param_dtype=jnp.float32, remat: str = "none", attention_impl: str = "auto", scan_layers: bool = True,
               rngs: nnx.Rngs):
    self.remat = remat
    self.attention_impl = attention_impl
    self.scan_layers = scan_layers
    self.blocks = nnx.List([
        TransformerBlock(config.width, config.num_heads, config.head_dim, dropout=config.dropout, ada_norm=False,
                         cross_attention_dim=None, fp8=fp8, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        for _ in range(config.num_layers)])

  @with_attention_impl
  def __call__(self, x: jax.Array, segment_ids: jax.Array, rng: jax.Array | None = None) -> jax.Array:
    return layers.run_blocks(self.blocks, x, segment_ids=segment_ids, rng=rng, remat=self.remat,
                             scan=self.scan_layers)
