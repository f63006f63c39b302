"""Frozen weights in FP8: quantised once, read by every step's forward (`train.frozen_fp8`).

A frozen tower (GR00T's SigLIP and Qwen3) runs forward only and its weights never change, so their
quantisation need not be paid every step, as `fp8_xla_dot` pays it for trained weights:
ejax.train.frozen_fp8 quantises each frozen projection once, when the state is made, into a
`FrozenKernel`: e4m3 values stored K-major, [out, in] (Hopper's FP8 GEMM wants the contraction
minor in both operands; stored so, no transpose runs in the step), and one power-of-two scale. The
layers that take one (ejax.models.layers: Dense, HeadProjection, OutputProjection) run it through
`frozen_dot`:
- the activation is quantised per tensor, with a scale known ahead where the copy carries one (a
  bound on the input: a norm's output, the attention over its values; ejax.train.frozen_fp8), else
  with its own amax (current scaling). A delayed scale would need an amax history, which a
  forward-only GEMM has no backward to hand back through (the way ejax.train.step collects
  delayed-scaling histories), and its amax pass costs what current scaling's does (BENCHMARKS.md);
- one cuBLASLt FP8 GEMM with fast accumulation (xla.forward), its output in the layer's dtype;
- the gradient with respect to the activation (a LoRA adapter upstream, a tower RL fine-tunes) is a
  bf16 GEMM against the dequantised kernel: the function the forward computed, differentiated.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ejax.kernels.fp8 import xla
from ejax.kernels.fp8.quantize import E4M3


class FrozenKernel(NamedTuple):
  """A frozen projection's kernel in FP8: `values` e4m3 [out, in] (K-major), `scale` f32 scalar;
  kernel ~= values.T * scale, with the kernel's contracted dimensions flattened into `in`.
  `input_scale`: the power-of-two scale of the layer's input where a bound on it is known ahead
  (ejax.train.frozen_fp8: the input is a norm's output); None: quantised with its own amax."""
  values: jax.Array
  scale: jax.Array
  input_scale: jax.Array | None = None


def quantize_kernel(kernel: jax.Array, contracted: int) -> FrozenKernel:
  """A kernel whose first `contracted` dimensions the layer contracts -> its FrozenKernel."""
  inner = math.prod(kernel.shape[:contracted])
  values, scale = xla.quantize_weight(kernel.reshape(inner, -1), "tensor")
  return FrozenKernel(values, scale)


def dequantize(kernel: FrozenKernel, dtype=jnp.float32) -> jax.Array:
  """[in, out] in `dtype`: the kernel the FP8 GEMM multiplies by (exact: values times a power of two)."""
  return (kernel.values.astype(jnp.float32) * kernel.scale).T.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def frozen_dot(x: jax.Array, kernel: FrozenKernel, out_dtype) -> jax.Array:
  """x [..., in] @ the frozen kernel -> [..., out] in out_dtype, as one FP8 GEMM."""
  out_features, in_features = kernel.values.shape
  if x.shape[-1] != in_features:
    raise ValueError(f"frozen_dot: x has {x.shape[-1]} features, the FP8 kernel takes {in_features}")
  if kernel.input_scale is None:
    x_q, x_scale = xla.quantize(x.reshape(-1, in_features), E4M3)
  else:  # a scale known ahead: the conversion fuses into the input's producer, no amax pass
    x_scale = kernel.input_scale
    x_q = xla.to_fp8(x.reshape(-1, in_features), x_scale, E4M3)
  # Projections of one input (q, k and v; gate and up) share its quantisation (XLA merges the equal
  # amax and conversion), but not their GEMM: XLA's DotMerger would join dots that share an operand
  # into one, whose weights, the concatenation of differently scaled FP8 values, are no FP8 pattern
  # (Qwen3's q, k and v became one bf16 GEMM over weights dequantised every step). Passing the
  # quantised input through a barrier together with the kernel gives each GEMM its own operand.
  x_q, values = lax.optimization_barrier((x_q, kernel.values))
  y = xla.scaled_gemm(x_q, x_scale, values, kernel.scale, (1, 1), out_dtype, xla.FORWARD_PRECISION)
  return y.reshape(*x.shape[:-1], out_features)


def _frozen_dot_fwd(x, kernel, out_dtype):
  return frozen_dot(x, kernel, out_dtype), (kernel, jnp.zeros((0,), x.dtype))


def _frozen_dot_bwd(out_dtype, residuals, d_y):
  kernel, x_like = residuals
  weight = dequantize(kernel, xla.DEQUANT_DTYPE)
  d_x = jnp.dot(d_y.astype(xla.DEQUANT_DTYPE), weight.T, preferred_element_type=jnp.float32)
  return d_x.astype(x_like.dtype), jax.tree.map(jnp.zeros_like, kernel)


frozen_dot.defvjp(_frozen_dot_fwd, _frozen_dot_bwd)
