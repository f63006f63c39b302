"""SigLIP / SigLIP2 vision transformer (the image encoder of Eagle 2.5 and PaliGemma).

Patchify (a stride-`patch` convolution, written as one Dense over flattened patches), learned
position embeddings, pre-LN encoder blocks with GELU(tanh) MLPs, and a final LayerNorm. The
attention-pooling head of the CLIP-style model is not built: both VLAs use the patch tokens.
Sizes: So400m/14 (width 1152, depth 27, MLP 4304, 16 heads) in GR00T-N1.5 and pi0.5.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ejax.kernels.attention import with_attention_impl
from ejax.models import layers
from ejax.parallel import constrain
from ejax.parallel.axes import ACT_BATCH, ACT_EMBED, ACT_LEN, EMBED, IN_FEATURES


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
  width: int = 1152
  depth: int = 27
  mlp_dim: int = 4304
  num_heads: int = 16
  patch_size: int = 14
  image_size: int = 224
  norm_eps: float = 1e-6
  act: str = "gelu_tanh"

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2


def normalize_images(images_uint8: jax.Array, dtype=jnp.float32) -> jax.Array:
  """uint8 [.., H, W, 3] -> [-1, 1] (SigLIP's mean 0.5 / std 0.5 normalisation)."""
  return (images_uint8.astype(jnp.float32) / 127.5 - 1.0).astype(dtype)


def patchify(images: jax.Array, patch_size: int) -> jax.Array:
  """[n, H, W, C] -> [n, (H/p)*(W/p), p*p*C], patches in row-major order, pixels (py, px, c)."""
  n, h, w, c = images.shape
  if h % patch_size or w % patch_size:
    raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {patch_size}")
  x = images.reshape(n, h // patch_size, patch_size, w // patch_size, patch_size, c)
  x = x.transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(n, (h // patch_size) * (w // patch_size), patch_size * patch_size * c)


class SiglipBlock(nnx.Module):

  FP8_INPUT_NORMS = {"layer_norm1": "self_attn", "layer_norm2": "mlp"}  # norm -> the module reading it

  def __init__(self, config: SiglipConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.layer_norm1 = layers.LayerNorm(config.width, eps=config.norm_eps, **common)
    self.self_attn = layers.Attention(config.width, num_heads=config.num_heads, use_bias=True, **common)
    self.layer_norm2 = layers.LayerNorm(config.width, eps=config.norm_eps, **common)
    self.mlp = layers.MLP(config.width, config.mlp_dim, act=config.act, **common)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.self_attn(self.layer_norm1(x))
    x = x + self.mlp(self.layer_norm2(x))
    return constrain(x, (ACT_BATCH, ACT_LEN, ACT_EMBED))


class SiglipVisionTransformer(nnx.Module):
  """images [n, H, W, 3] in [-1, 1] -> patch tokens [n, num_patches, width]."""

  def __init__(self, config: SiglipConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, remat: str = "none",
               attention_impl: str = "auto", scan_layers: bool = True, rngs: nnx.Rngs):
    self.config = config
    self.remat = remat
    self.scan_layers = scan_layers
    self.attention_impl = attention_impl
    self.dtype = dtype
    patch_dim = config.patch_size * config.patch_size * 3
    self.patch_embedding = layers.Dense(patch_dim, config.width, axes=(IN_FEATURES, EMBED), dtype=dtype,
                                        param_dtype=param_dtype, rngs=rngs)
    self.position_embedding = layers.make_param(rngs, nnx.initializers.normal(0.02), (config.num_patches, config.width),
                                                (None, EMBED), param_dtype)
    self.blocks = nnx.List([SiglipBlock(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                            for _ in range(config.depth)])
    self.post_layernorm = layers.LayerNorm(config.width, eps=config.norm_eps, dtype=dtype,
                                           param_dtype=param_dtype, rngs=rngs)

  @with_attention_impl
  def __call__(self, images: jax.Array) -> jax.Array:
    patches = patchify(images.astype(self.dtype), self.config.patch_size)
    if patches.shape[1] != self.config.num_patches:
      raise ValueError(f"SigLIP expects {self.config.image_size}px images ({self.config.num_patches} patches), "
                       f"got {images.shape[1]}x{images.shape[2]}")
    x = self.patch_embedding(patches) + self.position_embedding[...].astype(self.dtype)
    x = constrain(x, (ACT_BATCH, ACT_LEN, ACT_EMBED))
    x = layers.run_blocks(self.blocks, x, remat=self.remat, scan=self.scan_layers)
    return self.post_layernorm(x)
