"""Spatial-softmax keypoints over an image's pixel patches, and their heatmap loss.

A detector is the same at every location, so "where is the green block" is a number that moves with
the object at pixel precision (Levine et al. 2016; robomimic's and Diffusion Policy's image encoders)
instead of a position a from-scratch vision tower must memorise layout by layout. `PixelKeypoints`
reads each p x p pixel patch with one dense layer (space to depth; p = 1: a 3x3 convolution over the
pixels) into KEYPOINT_HIDDEN features; its own detectors, or any others (the instruction's,
perception/module.py), give logits over the patch grid whose softmax places a keypoint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ejax.models import layers
from ejax.models.siglip import patchify
from ejax.parallel.axes import MLP

KEYPOINT_HIDDEN = 32   # features per location that every detector reads


def pixel_grid(height: int, width: int) -> np.ndarray:
  """[height * width, 2] (x, y) cell centres in [-1, 1], row-major."""
  y, x = np.meshgrid((np.arange(height) + 0.5) / height * 2 - 1, (np.arange(width) + 0.5) / width * 2 - 1,
                     indexing="ij")
  return np.stack([x.reshape(-1), y.reshape(-1)], -1).astype(np.float32)


class PixelKeypoints(nnx.Module):
  """images [n, H, W, 3] in [-1, 1] -> K keypoints: (x, y) and strength per image."""

  def __init__(self, keypoints: int, *, pixel_patch: int = 1, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.dtype = dtype
    # p > 1: at 64 px and p = 2, ~5x cheaper on a CPU than the 3x3 convolution, with the patches' own
    # pixels still read at full resolution.
    self.pixel_patch = int(pixel_patch)
    kernel = (3, 3, 3) if self.pixel_patch == 1 else (1, 1, 3 * self.pixel_patch ** 2)
    self.conv = layers.make_param(rngs, nnx.initializers.lecun_normal(), (*kernel, KEYPOINT_HIDDEN),
                                  (None, None, None, MLP), param_dtype)
    self.conv_bias = layers.make_param(rngs, nnx.initializers.zeros, (KEYPOINT_HIDDEN,), (MLP,), param_dtype)
    self.detectors = layers.Dense(KEYPOINT_HIDDEN, keypoints, axes=(MLP, None), dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)

  def grid(self, images: jax.Array) -> tuple[int, int]:
    return tuple(size // self.pixel_patch for size in images.shape[1:3])

  def features(self, images: jax.Array) -> jax.Array:
    """Per-location features [n, h * w, KEYPOINT_HIDDEN]: what every detector reads."""
    images = images.astype(self.dtype)
    if self.pixel_patch == 1:
      x = jax.lax.conv_general_dilated(images, self.conv[...].astype(self.dtype), (1, 1), ((1, 1), (1, 1)),
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
    else:
      x = jnp.einsum("npc,cd->npd", patchify(images, self.pixel_patch), self.conv[0, 0].astype(self.dtype))
    x = jax.nn.gelu(x + self.conv_bias[...].astype(self.dtype))
    return x.reshape(x.shape[0], -1, x.shape[-1])

  def heatmaps(self, images: jax.Array) -> jax.Array:
    """Its own detectors' logits [n, h * w, K]."""
    return self.detectors(self.features(images)).astype(jnp.float32)

  def coordinates(self, images: jax.Array, *, logits: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """-> (expected (x, y) in [-1, 1] [n, K, 2], strength [n, K]: log mean exp of `logits` (default:
    its own detectors'; any [n, cells, K] over this image grid, e.g. the instruction's))."""
    logits = self.heatmaps(images) if logits is None else logits
    weights = jax.nn.softmax(logits, axis=1)
    coords = jnp.einsum("npk,pd->nkd", weights, jnp.asarray(pixel_grid(*self.grid(images))))
    strength = jax.nn.logsumexp(logits, axis=1) - np.log(logits.shape[1])
    return coords, strength

  def summary(self, images: jax.Array, *, logits: jax.Array | None = None) -> jax.Array:
    """[n, K * 3]: every keypoint's (x, y) and strength, flat (what a small head reads)."""
    coords, strength = self.coordinates(images, logits=logits)
    return jnp.concatenate([coords, strength[..., None]], -1).reshape(images.shape[0], -1)


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
