"""CLIP ViT-H/14's vision tower as Wan uses it (frozen): the first video frame at 224 px -> 257 tokens.

open-clip-xlm-roberta-large-vit-huge-14's visual part: 14 px patches (no bias), a class token, learnt
positions, a pre-norm, 32 pre-LN blocks (fused qkv, exact GELU, width 1280, 16 heads, MLP 5120), then
a post-norm and a projection head that Wan never reads: it takes the output of the first 31 blocks
(`use_31_block`). Pixels arrive in [-1, 1] and are mapped to CLIP's normalisation here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ejax.kernels.attention import attention
from ejax.models import layers
from ejax.parallel import constrain
from ejax.parallel.axes import ACT_BATCH, ACT_EMBED, ACT_LEN, EMBED, IN_FEATURES, MLP

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class ClipVisionConfig:
  image_size: int = 224
  patch_size: int = 14
  dim: int = 1280
  mlp_dim: int = 5120
  num_heads: int = 16
  num_layers: int = 32
  out_dim: int = 1024
  use_layers: int = 31            # Wan reads the output of the first 31 blocks
  eps: float = 1e-5

  @property
  def num_tokens(self) -> int:
    return (self.image_size // self.patch_size) ** 2 + 1


class ClipBlock(nnx.Module):
  def __init__(self, config: ClipVisionConfig, *, common: dict):
    dim = config.dim
    norm = dict(eps=config.eps, dtype=common["dtype"], param_dtype=common["param_dtype"], rngs=common["rngs"])
    self.num_heads = config.num_heads
    self.norm1, self.norm2 = layers.LayerNorm(dim, **norm), layers.LayerNorm(dim, **norm)
    self.to_qkv = layers.Dense(dim, 3 * dim, axes=(EMBED, MLP), **common)
    self.proj = layers.Dense(dim, dim, axes=(MLP, EMBED), **common)
    self.fc1 = layers.Dense(dim, config.mlp_dim, axes=(EMBED, MLP), **common)
    self.fc2 = layers.Dense(config.mlp_dim, dim, axes=(MLP, EMBED), **common)

  def __call__(self, x):
    q, k, v = jnp.split(self.to_qkv(self.norm1(x)), 3, axis=-1)
    heads = lambda t: t.reshape(*t.shape[:2], self.num_heads, -1)
    x = x + self.proj(attention(heads(q), heads(k), heads(v)).reshape(x.shape))
    x = x + self.fc2(jax.nn.gelu(self.fc1(self.norm2(x)), approximate=False))
    return constrain(x, (ACT_BATCH, ACT_LEN, ACT_EMBED))


class ClipVisionTower(nnx.Module):
  """images [b, H, W, 3] in [-1, 1] at image_size -> [b, 257, dim] (the 31st block's output)."""

  def __init__(self, config: ClipVisionConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
               scan_layers: bool = True, rngs: nnx.Rngs):
    self.config = config
    self.scan_layers = scan_layers    # the blocks used as one lax.scan (layers.run_blocks)
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    dim = config.dim
    self.patch_embedding = layers.Dense(3 * config.patch_size**2, dim, axes=(IN_FEATURES, EMBED), use_bias=False,
                                        **common)
    init = nnx.initializers.normal(dim**-0.5)
    self.cls_embedding = layers.make_param(rngs, init, (dim,), (EMBED,), param_dtype)
    self.pos_embedding = layers.make_param(rngs, init, (config.num_tokens, dim), (None, EMBED), param_dtype)
    norm = dict(eps=config.eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.pre_norm = layers.LayerNorm(dim, **norm)
    self.blocks = nnx.List([ClipBlock(config, common=common) for _ in range(config.num_layers)])
    self.post_norm = layers.LayerNorm(dim, **norm)
    self.head = layers.make_param(rngs, init, (dim, config.out_dim), (EMBED, None), param_dtype)
    self.dtype = dtype

  def __call__(self, images: jax.Array) -> jax.Array:
    c = self.config
    if images.shape[1:3] != (c.image_size, c.image_size):
      images = jax.image.resize(images, (images.shape[0], c.image_size, c.image_size, 3), "bicubic")
    pixels = ((images + 1) / 2 - jnp.asarray(CLIP_MEAN)) / jnp.asarray(CLIP_STD)
    b, p = images.shape[0], c.patch_size
    n = c.image_size // p
    # [b, n, p, n, p, 3] -> [b, n * n, 3 * p * p] in the (channel, row, column) order of a conv kernel
    patches = pixels.reshape(b, n, p, n, p, 3).transpose(0, 1, 3, 5, 2, 4).reshape(b, n * n, 3 * p * p)
    x = self.patch_embedding(patches)
    cls = jnp.broadcast_to(self.cls_embedding[...].astype(x.dtype), (b, 1, c.dim))
    x = jnp.concatenate([cls, x], axis=1) + self.pos_embedding[...].astype(x.dtype)
    x = constrain(self.pre_norm(x), (ACT_BATCH, ACT_LEN, ACT_EMBED))
    return layers.run_blocks(list(self.blocks)[:c.use_layers], x, scan=self.scan_layers)
