"""Block-wise FP8 quantisation (the DeepSeek-V3 recipe): one fp32 scale per block of values.

Weights use 128x128 blocks and activations 1x128 tiles along the contraction dimension, so one
outlier only coarsens the 128 (or 128x128) values that share its block instead of the whole
tensor. Forward operands are e4m3 (more mantissa); gradients are e5m2 (more range).

A quantised matrix is an `Fp8Tensor`: fp8 `values` padded to whole blocks, fp32 `scales`
[rows / block_rows, cols / block_cols], the block shape and the original shape.
x ~= values * scale of its block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
WEIGHT_BLOCK = (128, 128)
ACTIVATION_TILE = (1, 128)


def fp8_max(dtype) -> float:
  return float(jnp.finfo(dtype).max)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("values", "scales"),
                   meta_fields=("block", "shape"))
@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
  """A block-quantised matrix. values [padded rows, padded cols] fp8; scales [row blocks, col blocks]."""
  values: jax.Array
  scales: jax.Array
  block: tuple[int, int]
  shape: tuple[int, int]

  @property
  def dtype(self):
    return self.values.dtype

  def transpose(self) -> Fp8Tensor:
    """The transposed matrix: blocks transpose with it, so no requantisation is needed."""
    return Fp8Tensor(self.values.T, self.scales.T, self.block[::-1], self.shape[::-1])


def _pad_to(x: jax.Array, rows: int, cols: int) -> jax.Array:
  pad_rows, pad_cols = -x.shape[0] % rows, -x.shape[1] % cols
  return jnp.pad(x, ((0, pad_rows), (0, pad_cols))) if pad_rows or pad_cols else x


def quantize_blockwise(x: jax.Array, block: tuple[int, int] = WEIGHT_BLOCK,
                       dtype=E4M3) -> Fp8Tensor:
  """Quantises a 2-D x [rows, cols] with one fp32 scale per block (zero-padded to whole blocks).

  scale = amax(block) / fp8_max, so each block's largest magnitude lands on the format's maximum;
  all-zero blocks get scale 1.
  """
  if x.ndim != 2:
    raise ValueError(f"quantize_blockwise wants a 2-D matrix, got shape {x.shape}; reshape first")
  block_rows, block_cols = block
  padded = _pad_to(x.astype(jnp.float32), block_rows, block_cols)
  rows, cols = padded.shape
  blocks = padded.reshape(rows // block_rows, block_rows, cols // block_cols, block_cols)
  amax = jnp.max(jnp.abs(blocks), axis=(1, 3))  # [row blocks, col blocks]
  scales = jnp.where(amax > 0, amax / fp8_max(dtype), 1.0).astype(jnp.float32)
  scaled = blocks / scales[:, None, :, None]
  values = jnp.clip(scaled, -fp8_max(dtype), fp8_max(dtype)).astype(dtype).reshape(rows, cols)
  return Fp8Tensor(values, scales, (block_rows, block_cols), tuple(x.shape))


def quantize_per_tensor(x: jax.Array, dtype=E4M3) -> Fp8Tensor:
  """One scale for the whole matrix: the baseline block-wise scaling is measured against."""
  return quantize_blockwise(x, tuple(x.shape), dtype)


def dequantize(t: Fp8Tensor, dtype=jnp.float32) -> jax.Array:
  """values * block scale, cropped to the original shape."""
  rows, cols = t.values.shape
  block_rows, block_cols = t.block
  blocks = t.values.astype(jnp.float32).reshape(rows // block_rows, block_rows,
                                               cols // block_cols, block_cols)
  x = (blocks * t.scales[:, None, :, None]).reshape(rows, cols)
  return x[:t.shape[0], :t.shape[1]].astype(dtype)


def quantize_activations(x: jax.Array, dtype=E4M3) -> Fp8Tensor:
  """x [..., features] -> Fp8Tensor [tokens, features] in 1x128 tiles along the features."""
  return quantize_blockwise(x.reshape(-1, x.shape[-1]), ACTIVATION_TILE, dtype)
