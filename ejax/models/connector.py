"""The vision -> language connector of Eagle-style VLMs (`mlp1`), with the pixel-shuffle option.

Eagle builds one of three connectors from (mlp_connector_layers, use_pixel_shuffle):
  2 layers:            LayerNorm(d_in) -> Linear(d_in, d_llm) -> GELU -> Linear(d_llm, d_llm)
  1 layer:             Linear(d_in, d_llm)
with d_in = vision width * 4 when pixel shuffle (0.5) merges 2x2 patches into one token.
The released GR00T-N1.5 checkpoint uses 1 layer without pixel shuffle (weights
`mlp1.0.weight` [2048, 1152]): 256 tokens per 224 px image.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ejax.models import layers
from ejax.parallel.axes import EMBED, MLP


def pixel_shuffle(x: jax.Array, scale: float = 0.5) -> jax.Array:
  """Eagle's pixel shuffle: [n, h, w, c] -> [n, h*scale, w*scale, c/scale^2], same element order."""
  n, a, b, c = x.shape
  inv = int(round(1 / scale))
  if a % inv or b % inv:
    raise ValueError(f"pixel shuffle {scale} needs a patch grid divisible by {inv}, got {a}x{b}")
  x = x.reshape(n, a, b // inv, c * inv)
  x = x.transpose(0, 2, 1, 3)
  x = x.reshape(n, b // inv, a // inv, c * inv * inv)
  return x.transpose(0, 2, 1, 3)


class MLPConnector(nnx.Module):
  """vision tokens [n, patches, d_vision] -> LLM-width tokens [n, tokens, d_llm]."""

  FP8_INPUT_NORMS = {"norm": "fc1"}  # norm -> the module reading it (ejax.train.frozen_fp8)

  def __init__(self, vision_width: int, llm_width: int, *, num_layers: int = 1, use_pixel_shuffle: bool = False,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if num_layers not in (1, 2):
      raise ValueError(f"connector num_layers must be 1 or 2 (Eagle's mlp_connector_layers), got {num_layers}")
    self.use_pixel_shuffle = use_pixel_shuffle
    d_in = vision_width * (4 if use_pixel_shuffle else 1)
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm = layers.LayerNorm(d_in, eps=1e-5, **common) if num_layers == 2 else None
    self.fc1 = layers.Dense(d_in, llm_width, axes=(MLP, EMBED), **common)
    self.fc2 = layers.Dense(llm_width, llm_width, axes=(MLP, EMBED), **common) if num_layers == 2 else None

  def tokens_per_image(self, num_patches: int) -> int:
    return num_patches // 4 if self.use_pixel_shuffle else num_patches

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.use_pixel_shuffle:
      n, p, c = x.shape
      side = int(round(p ** 0.5))
      x = pixel_shuffle(x.reshape(n, side, side, c)).reshape(n, p // 4, c * 4)
    if self.norm is not None:
      x = self.norm(x)
    x = self.fc1(x)
    if self.fc2 is not None:
      x = self.fc2(jax.nn.gelu(x, approximate=False))
    return x
