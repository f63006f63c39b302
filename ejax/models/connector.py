"""The vision -> language connector of Eagle-style VLMs (`mlp1`), with the pixel-shuffle option.

Eagle builds one of three connectors from (mlp_connector_layers, use_pixel_shuffle):
  2 layers:            LayerNorm(d_in) -> Linear(d_in, d_llm) -> GELU -> Linear(d_llm, d_llm)
  1 layer:             Linear(d_in, d_llm)
with d_in = vision width * 4 when pixel shuffle (0.5) merges 2x2 patches into one token.
The released GR00T-N1.5 checkpoint uses 1 layer without pixel shuffle (weights
`mlp1.0.weight` [2048, 1152]): 256 tokens per 224 px image.

`PixelKeypoints` (ejax's, not Eagle's; model.connector.keypoints=K, off at released sizes) adds K
spatial-softmax keypoint tokens per image after the connector's (Levine et al. 2016; the image
encoders of robomimic and Diffusion Policy): K detectors, small convolutions over the pixels, each
weigh the pixel grid by a softmax of their response; a keypoint's token carries the expected pixel
coordinates (with Fourier features) and how strongly the detector fired. A detector is the same at every
pixel, so "where is the green block" is a number that moves with the object at pixel precision
instead of a position that a from-scratch tower must memorise layout by layout from its patch tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ejax.models import layers
from ejax.models.siglip import patchify
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


def mlp_settings(connector_config) -> dict:
  """model.connector without the fields that are not MLPConnector's (keypoints: PixelKeypoints')."""
  return {k: v for k, v in connector_config.items() if k != "keypoints"}


class MLPConnector(nnx.Module):
  """vision tokens [n, patches, d_vision] -> LLM-width tokens [n, tokens, d_llm]."""

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


KEYPOINT_FREQUENCIES = (1.0, 2.0, 4.0, 8.0)   # Fourier features of a keypoint's coordinates in [-1, 1]
KEYPOINT_HIDDEN = 32                          # channels of the detectors' 3x3 convolution


def keypoint_coordinate_features(coords: jax.Array) -> jax.Array:
  """[..., 2] coordinates in [-1, 1] -> [..., 2 + 4 * len(KEYPOINT_FREQUENCIES)]."""
  angles = jnp.concatenate([np.pi * f * coords for f in KEYPOINT_FREQUENCIES], axis=-1)
  return jnp.concatenate([coords, jnp.sin(angles), jnp.cos(angles)], axis=-1)


def pixel_grid(height: int, width: int) -> np.ndarray:
  """[height * width, 2] (x, y) pixel centres in [-1, 1], row-major."""
  y, x = np.meshgrid((np.arange(height) + 0.5) / height * 2 - 1, (np.arange(width) + 0.5) / width * 2 - 1,
                     indexing="ij")
  return np.stack([x.reshape(-1), y.reshape(-1)], -1).astype(np.float32)


class PixelKeypoints(nnx.Module):
  """images [n, H, W, 3] in [-1, 1] -> K keypoint tokens [n, K, d_llm]."""

  def __init__(self, keypoints: int, llm_width: int, *, pixel_patch: int = 1, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.dtype = dtype
    # pixel_patch 1: a 3x3 convolution over the pixels; p > 1: one dense layer over each p x p pixel
    # patch (space to depth), a softmax over the patch grid: at 64 px and p = 2, ~5x cheaper on a CPU
    # than the convolution, with the patches' own pixels still read at full resolution.
    self.pixel_patch = int(pixel_patch)
    kernel = (3, 3, 3) if self.pixel_patch == 1 else (1, 1, 3 * self.pixel_patch ** 2)
    self.conv = layers.make_param(rngs, nnx.initializers.lecun_normal(), (*kernel, KEYPOINT_HIDDEN),
                                  (None, None, None, MLP), param_dtype)
    self.conv_bias = layers.make_param(rngs, nnx.initializers.zeros, (KEYPOINT_HIDDEN,), (MLP,), param_dtype)
    self.detectors = layers.Dense(KEYPOINT_HIDDEN, keypoints, axes=(MLP, None), **common)
    self.fc1 = self.fc2 = self.identity = nnx.data(None)
    if not llm_width:  # coordinates only (e.g. for GR00T's auxiliary head), no tokens
      return
    d_in = 3 + 4 * len(KEYPOINT_FREQUENCIES)
    self.fc1 = layers.Dense(d_in, llm_width, axes=(None, EMBED), **common)
    self.fc2 = layers.Dense(llm_width, llm_width, axes=(MLP, EMBED), **common)
    self.identity = layers.make_param(rngs, nnx.initializers.normal(0.02), (keypoints, llm_width), (None, EMBED),
                                      param_dtype)

  def features(self, images: jax.Array) -> jax.Array:
    """Per-location features [n, h * w, KEYPOINT_HIDDEN] over the pixel grid (pixel_patch 1) or the
    patch grid: what every detector reads, the same at every location."""
    images = images.astype(self.dtype)
    if self.pixel_patch == 1:
      x = jax.lax.conv_general_dilated(images, self.conv[...].astype(self.dtype), (1, 1), ((1, 1), (1, 1)),
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
    else:
      x = jnp.einsum("npc,cd->npd", patchify(images, self.pixel_patch), self.conv[0, 0].astype(self.dtype))
    x = jax.nn.gelu(x + self.conv_bias[...].astype(self.dtype))
    return x.reshape(x.shape[0], -1, x.shape[-1])

  def heatmaps(self, images: jax.Array) -> jax.Array:
    """Detector logits [n, h * w, K] over the pixel grid (pixel_patch 1) or the patch grid."""
    return self.detectors(self.features(images)).astype(jnp.float32)

  def coordinates(self, images: jax.Array, *, logits: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """-> (expected (x, y) in [-1, 1] [n, K, 2], strength [n, K]: log mean exp of `logits` (default:
    the detectors'; any [n, cells, K] over this image grid, e.g. instruction-chosen ones))."""
    logits = self.heatmaps(images) if logits is None else logits
    weights = jax.nn.softmax(logits, axis=1)
    grid = [size // self.pixel_patch for size in images.shape[1:3]]
    coords = jnp.einsum("npk,pd->nkd", weights, jnp.asarray(pixel_grid(*grid)))
    strength = jax.nn.logsumexp(logits, axis=1) - np.log(logits.shape[1])
    return coords, strength

  def summary(self, images: jax.Array, *, logits: jax.Array | None = None) -> jax.Array:
    """[n, K * 3]: every keypoint's (x, y) and strength, flat (what a small head reads)."""
    coords, strength = self.coordinates(images, logits=logits)
    return jnp.concatenate([coords, strength[..., None]], -1).reshape(images.shape[0], -1)

  def __call__(self, images: jax.Array) -> jax.Array:
    coords, strength = self.coordinates(images)
    x = jnp.concatenate([keypoint_coordinate_features(coords), strength[..., None]], -1).astype(self.dtype)
    x = self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))
    return x + self.identity[...].astype(x.dtype)


def heatmap_loss(logits: jax.Array, labels: jax.Array, grid: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
  """Cross-entropy of heatmap logits [n, h * w, Q] against keypoint labels [n, Q, 2] ((x, y) in [-1, 1],
  pixel_grid's convention) on a grid of (h, w) cells -> (loss [n, Q], in view [n, Q]); a label
  outside the image gives 0 and in view False."""
  height, width = grid
  col = jnp.floor((labels[..., 0] + 1) / 2 * width).astype(jnp.int32)
  row = jnp.floor((labels[..., 1] + 1) / 2 * height).astype(jnp.int32)
  in_view = (col >= 0) & (col < width) & (row >= 0) & (row < height)
  cell = jnp.where(in_view, row * width + col, 0)
  picked = jnp.take_along_axis(logits, cell[:, None, :], axis=1)[:, 0]
  loss = jax.nn.logsumexp(logits, axis=1) - picked
  return jnp.where(in_view, loss, 0.0), in_view
