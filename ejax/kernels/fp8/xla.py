"""FP8 GEMMs written so that XLA's GPU compiler runs them as cuBLASLt FP8 GEMMs (`__cublas$lt$matmul$f8`).

No kernel of our own: the dot is plain XLA, in the pattern XLA's GemmRewriter
(xla/service/gpu/transforms/gemm_rewriter.cc, the pass that runs on FP8 dots before Triton sees
them) turns into one cuBLASLt FP8 call. What that pass requires, read from its source:
- each dot operand is `convert(fp8 -> wider)`, optionally times `broadcast(scale)` with a *scalar*
  scale (the scales become cuBLASLt's A/B scale pointers: free); a non-scalar scale is not fused;
- one operand is e4m3 (e5m2 x e5m2 is refused); the output is bf16, f16 or f32;
- on Hopper, A row-major and B column-major, i.e. the contraction is the minor dimension of both
  operands; otherwise the pass inserts a transpose of the fp8 operand (an extra copy). So the
  weight is quantised K-major, as [out, in];
- precision DEFAULT gives cuBLASLt's fast accumulation (forward), HIGHEST full-precision
  accumulation (the backward GEMMs, where e5m2 gradients are summed; flax's fp8_ops does the same).

Two scalings, both with power-of-two scales (exact in bf16, so the dequantising multiply adds no
rounding and the CPU emulation computes exactly what the GPU does):
- "tensor": one scale per operand, folded into the GEMM: the fastest, but one outlier token
  coarsens every other token (see the error table in benchmarks/fp8.py);
- "row": one scale per token (activations) and per output feature (weights), applied to the GEMM's
  output as an outer product (x_scale[m] * w_scale[n], outside the contraction, so exact). The
  GEMM itself runs unscaled in FP8; the scaling is one elementwise pass over the output that XLA
  fuses into its consumer (bias, activation, cast). Outlier tokens stay in their own rows.

Gradients (custom_vjp): dY in e5m2, dX = dY . W and dW = X^T . dY as FP8 GEMMs too. With "row",
each backward GEMM re-scales its operands along their non-contracted dimension.

Not used: `jax.nn.scaled_matmul` / `scaled_dot_general` (block scales in the GEMM itself) lower to
cuDNN's block-scaled GEMM for MX / NVFP4 formats, which needs Blackwell, not Hopper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ejax.kernels.fp8.quantize import E4M3, E5M2, fp8_max

SCALINGS = ("tensor", "row")
# fp8 values are exact in bf16 (e4m3 and e5m2 have fewer mantissa bits and a smaller range), and so
# are power-of-two scales: the dequantised operands XLA pattern-matches are exact.
DEQUANT_DTYPE = jnp.bfloat16
FORWARD_PRECISION = lax.Precision.DEFAULT    # cuBLASLt fast accumulation
BACKWARD_PRECISION = lax.Precision.HIGHEST   # full-precision accumulation for the gradients


def power_of_two_scale(amax: jax.Array, dtype=E4M3) -> jax.Array:
  """The power of two at or above amax / fp8 max (so amax / scale <= fp8 max); 1 where amax is 0.

  Read off the float's bits: the exponent of amax / fp8 max, plus one if its mantissa is not 0.
  NaN or inf amax gives an inf scale, so a bad tensor stays visibly bad (NaN) after quantisation.
  """
  return jnp.where(amax > 0, _power_of_two_at_or_above(amax.astype(jnp.float32) / fp8_max(dtype)),
                   1.0).astype(jnp.float32)


def _power_of_two_at_or_above(ratio: jax.Array) -> jax.Array:
  bits = lax.bitcast_convert_type(ratio, jnp.int32)
  biased_exponent = (bits >> 23) & 0xFF
  biased_exponent = biased_exponent + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
  return lax.bitcast_convert_type(jnp.clip(biased_exponent, 1, 255) << 23, jnp.float32)


def quantize(x: jax.Array, dtype=E4M3, *, reduce_axis: int | None = None) -> tuple[jax.Array, jax.Array]:
  """x -> (fp8 values, fp32 scales), x ~= values * scales.

  reduce_axis None: one scalar scale; else one scale per slice along reduce_axis (kept as a size-1
  dimension, so scales broadcast against x).
  """
  x = x.astype(jnp.float32)
  keep = reduce_axis is not None
  amax = jnp.max(jnp.abs(x), axis=reduce_axis, keepdims=keep)
  scale = power_of_two_scale(amax, dtype)
  return to_fp8(x, scale, dtype), scale


def to_fp8(x: jax.Array, scale: jax.Array, dtype=E4M3) -> jax.Array:
  """x / scale in `dtype`, clipped to its largest finite value (fp8 types have no room above it)."""
  limit = fp8_max(dtype)
  return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


def scaled_gemm(a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array,
                contracting: tuple[int, int], out_dtype, precision) -> jax.Array:
  """2-D a, b in fp8 contracted over a's and b's `contracting` dimensions -> [a free, b free].

  Scalar scales are multiplied into the dequantised operands (the pattern cuBLASLt takes them
  from); per-slice scales (one per free row of a / of b) into the output.
  """
  dims = (((contracting[0],), (contracting[1],)), ((), ()))
  if a_scale.ndim == 0 and b_scale.ndim == 0:
    lhs = a.astype(DEQUANT_DTYPE) * a_scale.astype(DEQUANT_DTYPE)
    rhs = b.astype(DEQUANT_DTYPE) * b_scale.astype(DEQUANT_DTYPE)
    return lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=out_dtype)
  out = lax.dot_general(a.astype(DEQUANT_DTYPE), b.astype(DEQUANT_DTYPE), dims, precision=precision,
                        preferred_element_type=out_dtype)
  return (out.astype(jnp.float32) * _free_scales(a_scale, contracting[0])[:, None]
          * _free_scales(b_scale, contracting[1])[None, :]).astype(out_dtype)


def _free_scales(scale: jax.Array, contracting: int) -> jax.Array:
  """A per-slice scale (size 1 along `contracting`) as a vector over the free dimension."""
  if scale.ndim != 2 or scale.shape[contracting] != 1:
    raise ValueError(f"scaled_gemm: scales {scale.shape} must be scalar or have size 1 along the "
                     f"contracted dimension {contracting}; mix neither, both operands alike")
  return scale.reshape(-1)


def quantize_weight(kernel: jax.Array, scaling: str) -> tuple[jax.Array, jax.Array]:
  """kernel [in, out] -> K-major e4m3 values [out, in] and their scale (scalar, or [out, 1])."""
  _check_scaling(scaling)
  return quantize(kernel.T, E4M3, reduce_axis=None if scaling == "tensor" else 1)


def forward(x: jax.Array, kernel_q: jax.Array, kernel_scale: jax.Array, scaling: str,
            out_dtype) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """x [tokens, in] @ K-major FP8 kernel [out, in] -> ([tokens, out] in out_dtype, quantised x)."""
  x_q, x_scale = quantize(x, E4M3, reduce_axis=None if scaling == "tensor" else 1)
  return scaled_gemm(x_q, x_scale, kernel_q, kernel_scale, (1, 1), out_dtype, FORWARD_PRECISION), \
      (x_q, x_scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fp8_xla_dot(x: jax.Array, kernel: jax.Array, scaling: str = "tensor",
                out_dtype=jnp.float32) -> jax.Array:
  """x [tokens, in] @ kernel [in, out] -> [tokens, out] in out_dtype, as XLA FP8 GEMMs (fwd and bwd)."""
  return _dot_fwd(x, kernel, scaling, out_dtype)[0]


def _dot_fwd(x, kernel, scaling, out_dtype):
  kernel_q, kernel_scale = quantize_weight(kernel, scaling)
  y, (x_q, x_scale) = forward(x, kernel_q, kernel_scale, scaling, out_dtype)
  # "tensor" keeps only FP8 operands; "row" re-scales the kernel along `in` for dX, from the master
  # kernel (alive anyway as a parameter). Zero-size arrays carry the primal dtypes.
  kept_kernel = kernel_q if scaling == "tensor" else kernel
  return y, (x_q, x_scale, kept_kernel, kernel_scale, jnp.zeros((0,), x.dtype),
             jnp.zeros((0,), kernel.dtype))


def _dot_bwd(scaling, out_dtype, residuals, d_out):
  x_q, x_scale, kept_kernel, kernel_scale, x_like, kernel_like = residuals
  x_dtype, kernel_dtype = x_like.dtype, kernel_like.dtype
  if scaling == "tensor":
    d_out_q, d_out_scale = quantize(d_out, E5M2)
    # dX [tokens, in] = dY [tokens, out] . W^T, W held as [out, in]: contract `out`.
    d_x = scaled_gemm(d_out_q, d_out_scale, kept_kernel, kernel_scale, (1, 0), x_dtype,
                      BACKWARD_PRECISION)
    # dW [in, out] = X^T . dY: contract the tokens.
    d_kernel = scaled_gemm(x_q, x_scale, d_out_q, d_out_scale, (0, 0), kernel_dtype,
                           BACKWARD_PRECISION)
    return d_x, d_kernel
  # "row": every GEMM scales its operands along their free dimension.
  d_out_rows, d_out_row_scale = quantize(d_out, E5M2, reduce_axis=1)          # per token
  kernel_cols, kernel_col_scale = quantize(kept_kernel, E4M3, reduce_axis=1)  # per `in`, [in, 1]
  d_x = scaled_gemm(d_out_rows, d_out_row_scale, kernel_cols, kernel_col_scale, (1, 1), x_dtype,
                    BACKWARD_PRECISION)
  x = x_q.astype(jnp.float32) * x_scale
  x_cols, x_col_scale = quantize(x, E4M3, reduce_axis=0)                      # per `in`, [1, in]
  d_out_cols, d_out_col_scale = quantize(d_out, E5M2, reduce_axis=0)          # per `out`
  d_kernel = scaled_gemm(x_cols, x_col_scale, d_out_cols, d_out_col_scale, (0, 0), kernel_dtype,
                         BACKWARD_PRECISION)
  return d_x, d_kernel


fp8_xla_dot.defvjp(_dot_fwd, _dot_bwd)


# Delayed scaling (Transformer Engine's default recipe for Hopper): each FP8 GEMM keeps, per operand, the
# amax of its last HISTORY_LENGTH steps, and quantises with the power-of-two scale of their maximum. The
# scale is known before the tensor exists, so the conversion need not wait for an amax pass over the
# tensor (current scaling, "tensor", must finish one first); this step's amax is computed beside it for
# the next steps (_amax_bound). On jaxlib 0.11.2's compile-only H100, pi0.5's FP8 step prices at
# 217.9 ms against 226.4 with current scaling (213.0 if the amaxes cost nothing; BENCHMARKS.md, FP8).
HISTORY_LENGTH = 16
HISTORY_DTYPES = (E4M3, E4M3, E5M2)  # the histories of x, the kernel and dY, in this order
HISTORY_ROWS = len(HISTORY_DTYPES)
# The scale of an empty history: x's and the kernel's 1, as Transformer Engine starts (a new train state
# primes the kernel's from the kernel itself: prime_kernel_history); dY's 2^-16
# (e5m2 then holds 2.3e-10 to 0.875): at 1, gradients below 7.6e-6 would all flush to zero, and an
# all-zero dY says nothing about its magnitude (_amax_bound), so its scale would never move.
START_SCALES = (1.0, 1.0, 2.0 ** -16)
# _amax_bound's record for a saturated tensor: this many times the largest FP8 value (times the scale),
# so its scale doubles each step until nothing saturates. A record stays in the history for
# HISTORY_LENGTH steps, and the true amax of a saturated tensor is at least the largest FP8 value
# times its scale: doubling keeps every record within 2x of the truth (a larger step would leave the
# scale that much too coarse for 16 steps after one saturated step).
SATURATED_GROWTH = 2.0


def new_history(*leading: int) -> jax.Array:
  """Empty amax histories [*leading, HISTORY_ROWS, HISTORY_LENGTH] for fp8_xla_dot_delayed: the first
  step quantises with START_SCALES, later ones with the amaxes seen."""
  return jnp.zeros((*leading, HISTORY_ROWS, HISTORY_LENGTH), jnp.float32)


def prime_kernel_history(history: jax.Array, kernel_amax: jax.Array) -> jax.Array:
  """history [..., HISTORY_ROWS, HISTORY_LENGTH] with `kernel_amax` [...] as its kernel's newest record
  where the kernel's row is empty (a history already written is left as it is).

  The kernel is there before the first step, so its first scale need not be START_SCALES' 1: at 1,
  small weights fall in e4m3's subnormals (below 2^-6, in steps of 2^-9), and a [128, 1536] x [1536,
  1536] GEMM is 4 % off at std 0.02, 11 % at 0.005, 28 % at 0.002 (3.7 % at any std primed). Primed,
  the first step quantises the kernel as every later one does. The trainer primes a new state
  (ejax.train.state.materialize, through prime_fp8_histories)."""
  empty = jnp.all(history[..., 1, :] == 0, axis=-1)
  newest = jnp.where(empty, kernel_amax.astype(history.dtype), history[..., 1, 0])
  return history.at[..., 1, 0].set(newest)


def _amax_bound(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """An upper bound on max |x| from its FP8 values q = clip(round(x / scale)): the rounding boundary above
  the largest |q| (in the normal range at most one FP8 step above the true amax: 1.1x for e4m3, 1.2x
  for e5m2);
  SATURATED_GROWTH x the FP8 max where q saturated; 0 where q is all zero (x was zero, or flushed: no
  information, the history keeps its older amaxes); NaN where q holds a NaN.

  Read from q's bits behind an optimisation barrier: a reduction of x itself keeps XLA from fusing x's
  producer with the transposed FP8 copies the dW GEMM needs (it writes x in bf16, then converts it in
  a second pass), while q is written anyway for the GEMMs. Transformer Engine takes the exact amax in
  its fused cast-transpose kernel; this is the bound XLA can fuse (pi0.5's step: 217.9 vs 222.2 ms)."""
  codes = lax.bitcast_convert_type(lax.optimization_barrier(q), jnp.uint8) & jnp.uint8(0x7F)  # |q|'s bits
  code = jnp.max(codes)
  top = lax.bitcast_convert_type(jnp.asarray(fp8_max(dtype), dtype), jnp.uint8)
  value = lax.bitcast_convert_type(code, dtype).astype(jnp.float32)
  above = lax.bitcast_convert_type(code + jnp.uint8(1), dtype).astype(jnp.float32)
  bound = jnp.where(code == 0, 0.0, jnp.where(code < top, (value + above) / 2,
                                               jnp.where(code == top, SATURATED_GROWTH * fp8_max(dtype), jnp.nan)))
  return bound * scale


def _delayed_scales(history: jax.Array) -> jax.Array:
  """The scales [HISTORY_ROWS] of x, the kernel and dY from their histories' largest amaxes (START_SCALES
  where a history is empty; NaN stays NaN), as one vector: one kernel, not one per operand."""
  largest = jnp.max(history, axis=-1)
  limits = jnp.asarray([fp8_max(dtype) for dtype in HISTORY_DTYPES], jnp.float32)
  return jnp.where(largest == 0, jnp.asarray(START_SCALES, jnp.float32),
                   _power_of_two_at_or_above(largest / limits))


def _delayed(x: jax.Array, scale: jax.Array, dtype, *, exact_amax: bool = False) -> tuple[jax.Array, jax.Array]:
  """x quantised with `scale` -> (fp8 values, this x's amax, or the _amax_bound of it)."""
  q = to_fp8(x, scale, dtype)
  return q, jnp.max(jnp.abs(x.astype(jnp.float32))) if exact_amax else _amax_bound(q, scale, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fp8_xla_dot_delayed(x: jax.Array, kernel: jax.Array, history: jax.Array, out_dtype=jnp.float32,
                        fast_backward: bool = False) -> jax.Array:
  """x [tokens, in] @ kernel [in, out] as cuBLASLt FP8 GEMMs (forward and backward), per-tensor scales
  from `history` [HISTORY_ROWS, HISTORY_LENGTH] (new_history) rather than from the tensors themselves.

  The gradient with respect to `history` is not a gradient: it is the history with this step's amaxes
  pushed in front, which the trainer stores as the history's new value (ejax.train.step; flax's
  fp8_ops passes its amax history back the same way). One history per GEMM, used once a step.

  fast_backward: dX and dW with cuBLASLt's fast accumulation too (FORWARD_PRECISION), a departure from
  Transformer Engine's recipe, which accumulates its dgrad and wgrad GEMMs in full precision (its
  "split accumulator"): the impl "xla_delayed_fastacc", for measuring what that precision costs."""
  return _delayed_fwd(x, kernel, history, out_dtype, fast_backward)[0]


def _delayed_fwd(x, kernel, history, out_dtype, fast_backward):
  scales = _delayed_scales(history)
  x_q, x_amax = _delayed(x, scales[0], E4M3)
  # The kernel's exact amax: its reduction fuses with its conversion (no transposed copy to keep apart).
  kernel_q, kernel_amax = _delayed(kernel.T, scales[1], E4M3, exact_amax=True)  # K-major [out, in]
  y = scaled_gemm(x_q, scales[0], kernel_q, scales[1], (1, 1), out_dtype, FORWARD_PRECISION)
  return y, (x_q, kernel_q, scales, history, x_amax, kernel_amax,
             jnp.zeros((0,), x.dtype), jnp.zeros((0,), kernel.dtype))


def _delayed_bwd(out_dtype, fast_backward, residuals, d_out):
  x_q, kernel_q, scales, history, x_amax, kernel_amax, x_like, kernel_like = residuals
  d_out_q, d_out_amax = _delayed(d_out, scales[2], E5M2)
  precision = FORWARD_PRECISION if fast_backward else BACKWARD_PRECISION
  d_x = scaled_gemm(d_out_q, scales[2], kernel_q, scales[1], (1, 0), x_like.dtype, precision)
  d_kernel = scaled_gemm(x_q, scales[0], d_out_q, scales[2], (0, 0), kernel_like.dtype, precision)
  amaxes = jnp.stack([x_amax, kernel_amax, d_out_amax]).astype(jnp.float32)
  pushed = jnp.concatenate([amaxes[:, None], history[:, :-1]], axis=1)
  return d_x, d_kernel, pushed


fp8_xla_dot_delayed.defvjp(_delayed_fwd, _delayed_bwd)


def fp8_xla_dot_reference(x: jax.Array, kernel: jax.Array, scaling: str = "tensor") -> jax.Array:
  """The forward pass in fp32 on the dequantised operands: what the GEMM must compute."""
  kernel_q, kernel_scale = quantize_weight(kernel, scaling)
  x_q, x_scale = quantize(x, E4M3, reduce_axis=None if scaling == "tensor" else 1)
  x_deq = x_q.astype(jnp.float32) * x_scale
  kernel_deq = kernel_q.astype(jnp.float32) * kernel_scale
  return jnp.dot(x_deq, kernel_deq.T, precision=lax.Precision.HIGHEST)


def _check_scaling(scaling: str) -> None:
  if scaling not in SCALINGS:
    raise ValueError(f"FP8 XLA GEMM scaling={scaling!r} is not one of {SCALINGS}")
