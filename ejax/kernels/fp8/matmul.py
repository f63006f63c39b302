"""GEMM on block-quantised operands, with the block scales applied inside the accumulation.

out[m, n] = sum over 128-wide k blocks of (a_fp8[m, kb] . b_fp8[kb, n]) * a_scale[m, kb] * b_scale[kb, n]

Each k block is one fp8 dot accumulated in fp32, rescaled by its two scales and summed in fp32; this
is how DeepSeek-V3 keeps block-wise scaling exact across k (a single fp8 dot over all of k could
only apply one scale). `a` is usually activations (1x128 tiles), `b` weights (128x128 blocks).

The Pallas kernel (Triton lowering) runs one (block_m x 128) output tile per program and loops over
k; `fp8_matmul_reference` is its specification. Operands of two formats (the backward GEMMs' e5m2
gradients against e4m3) run as an fp16 dot of the same values: exact, at fp16 tensor-core speed.

Hopper: JAX's Pallas-Triton lowering (0.9.2 and 0.11.2 alike) emits every `tt.dot` with
maxNumImpreciseAcc = 0, and Triton then keeps FP8 dots off the FP8 wgmma (BENCHMARKS.md, "GPU
readiness"). `triton_fp8_fast_accumulation` lowers them with a bound instead; no public API sets it.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ejax.kernels import platform
from ejax.kernels.platform import pallas_dot, plgpu
from ejax.kernels.fp8.quantize import Fp8Tensor

IMPLS = ("auto", "reference", "pallas")


def _contraction_block(a: Fp8Tensor, b: Fp8Tensor) -> int:
  if a.shape[1] != b.shape[0]:
    raise ValueError(f"fp8_matmul: a {a.shape} and b {b.shape} do not share the contraction size")
  if a.block[1] != b.block[0] or a.values.shape[1] != b.values.shape[0]:
    raise ValueError(f"fp8_matmul: a's column blocks {a.block} and b's row blocks {b.block} must "
                     "match (quantise activations with 1x128 tiles and weights with 128x128 blocks)")
  return a.block[1]


def _row_scales(a: Fp8Tensor) -> jax.Array:
  """a's scales per padded row: [padded rows, k blocks]."""
  return jnp.repeat(a.scales, a.block[0], axis=0, total_repeat_length=a.values.shape[0])


def _col_scales(b: Fp8Tensor) -> jax.Array:
  """b's scales per padded column: [k blocks, padded cols]."""
  return jnp.repeat(b.scales, b.block[1], axis=1, total_repeat_length=b.values.shape[1])


def fp8_matmul_reference(a: Fp8Tensor, b: Fp8Tensor, out_dtype=jnp.float32) -> jax.Array:
  """[a rows, b cols] in out_dtype: the specification of the kernel, in plain XLA."""
  block_k = _contraction_block(a, b)
  a_scales, b_scales = _row_scales(a), _col_scales(b)

  def k_block(i, acc):
    a_blk = lax.dynamic_slice_in_dim(a.values, i * block_k, block_k, 1)
    b_blk = lax.dynamic_slice_in_dim(b.values, i * block_k, block_k, 0)
    partial = lax.dot(a_blk, b_blk, preferred_element_type=jnp.float32)
    return acc + partial * a_scales[:, i, None] * b_scales[None, i, :]

  acc = jnp.zeros((a.values.shape[0], b.values.shape[1]), jnp.float32)
  acc = lax.fori_loop(0, a.values.shape[1] // block_k, k_block, acc)
  return acc[:a.shape[0], :b.shape[1]].astype(out_dtype)


def _kernel(a_ref, b_ref, a_scale_ref, b_scale_ref, out_ref, *, block_k: int):
  # a_ref [block_m, K] fp8, b_ref [K, block_n] fp8, a_scale_ref [k blocks, block_m],
  # b_scale_ref [k blocks, block_n], both fp32.
  block_m, block_n = out_ref.shape

  def k_block(i, acc):
    ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
    a_blk, b_blk = a_ref[:, ks], b_ref[ks, :]
    if a_blk.dtype != b_blk.dtype:
      # The backward GEMMs mix e5m2 (dY) with e4m3, and the Triton lowering takes one element type
      # per dot: both formats embed exactly in fp16, so this dot gives the same sums at fp16 speed.
      a_blk, b_blk = a_blk.astype(jnp.float16), b_blk.astype(jnp.float16)
    partial = pallas_dot(a_blk, b_blk)  # fp32 accumulation
    return acc + partial * a_scale_ref[i, :][:, None] * b_scale_ref[i, :][None, :]

  acc = lax.fori_loop(0, a_ref.shape[1] // block_k, k_block,
                      jnp.zeros((block_m, block_n), jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_m", "block_n", "interpret"))
def fp8_matmul_pallas(a: Fp8Tensor, b: Fp8Tensor, out_dtype=jnp.float32, *, block_m: int = 64,
                      block_n: int = 128, interpret: bool = False) -> jax.Array:
  """The Pallas kernel: grid (m tiles, n tiles), one fp8 dot per 128-wide k block."""
  block_k = _contraction_block(a, b)
  rows, cols = a.values.shape[0], b.values.shape[1]
  if cols % block_n:
    raise ValueError(f"fp8_matmul_pallas: b's padded columns {cols} are not a multiple of "
                     f"block_n={block_n}; quantise b with column blocks that divide by it")
  pad_m = -rows % block_m
  a_values = jnp.pad(a.values, ((0, pad_m), (0, 0))) if pad_m else a.values
  a_scales = jnp.pad(_row_scales(a), ((0, pad_m), (0, 0)), constant_values=1.0).T
  out = pl.pallas_call(
      functools.partial(_kernel, block_k=block_k),
      grid=((rows + pad_m) // block_m, cols // block_n),
      in_specs=[pl.BlockSpec((block_m, a_values.shape[1]), lambda i, j: (i, 0)),
                pl.BlockSpec((b.values.shape[0], block_n), lambda i, j: (0, j)),
                pl.BlockSpec((a_scales.shape[0], block_m), lambda i, j: (0, i)),
                pl.BlockSpec((b.scales.shape[0], block_n), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((rows + pad_m, cols), out_dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret,
      name="ejax_fp8_blockwise_matmul",
  )(a_values, b.values, a_scales, _col_scales(b))
  return out[:a.shape[0], :b.shape[1]]


def fp8_matmul(a: Fp8Tensor, b: Fp8Tensor, out_dtype=jnp.float32, *, impl: str = "auto",
               interpret: bool | None = None) -> jax.Array:
  """a @ b on block-quantised operands. impl "auto": the Pallas kernel on GPU (with a jax that has
  Pallas's Triton backend), else the reference."""
  if impl not in IMPLS:
    raise ValueError(f"fp8_matmul impl={impl!r} is not one of {IMPLS}")
  on_gpu = platform.on_gpu()
  missing = platform.triton_missing()
  if impl == "auto":
    impl = "pallas" if on_gpu and missing is None else "reference"
  if impl == "pallas" and missing:
    raise ValueError(f"fp8_matmul impl='pallas': {missing}; use impl='auto' or 'reference'")
  if impl == "reference":
    return fp8_matmul_reference(a, b, out_dtype)
  return fp8_matmul_pallas(a, b, out_dtype, interpret=(not on_gpu) if interpret is None else interpret)


@contextlib.contextmanager
def triton_fp8_fast_accumulation(max_num_imprecise_acc: int = 128):
  """Pallas-Triton dots on two fp8 operands lowered inside this block get maxNumImpreciseAcc.

  Triton then may run them on Hopper's FP8 wgmma, which sums up to that many products in its
  reduced-precision accumulator before adding them into fp32. 128 = this kernel's k block, which it
  rescales and sums in fp32 itself (DeepSeek-V3's promotion interval), so no sum runs longer.

  It patches JAX's private Triton lowering for the duration of the block (jax exposes no such
  setting in 0.9.2 or 0.11.2): wrap the `.lower()` (or first call) of a fresh jit, as with
  `platform.lowering_for`. For benchmarks; the training path does not use it.
  """
  from jax._src.pallas.triton import lowering  # private: the only place the dot is emitted
  dialect = lowering.tt_dialect
  emit_dot = dialect.dot

  def dot(a, b, c, **kwargs):
    if kwargs.get("max_num_imprecise_acc") is None and all("f8E" in str(v.type) for v in (a, b)):
      kwargs["max_num_imprecise_acc"] = max_num_imprecise_acc
    return emit_dot(a, b, c, **kwargs)

  dialect.dot = dot
  try:
    yield
  finally:
    dialect.dot = emit_dot
