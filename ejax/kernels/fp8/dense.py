"""An FP8 Dense layer for training, the switch models use, and one-shot FP8 weights for inference.

Training (`Fp8Dense`): master weights stay in param_dtype; every call quantises the activations
and the kernel to e4m3 and runs an FP8 GEMM, forward and backward (custom_vjp, gradients in e5m2).
Its `impl` picks the GEMM:
- "blockwise" (the default): DeepSeek-V3's block scaling (1x128 activation tiles, 128x128 weight
  blocks) in the Pallas block-scaled GEMM (matmul.py); dX = dY . W^T on the same quantised kernel
  (blocks transpose with it), dW = X^T . dY with X re-tiled along the tokens. Residuals are the FP8
  operands, so activation memory halves against bf16. On an H200 it ran at 0.40-0.45x of bf16
  (BENCHMARKS.md): slower than bf16.
- "xla": one power-of-two scale per tensor, written so that XLA's GPU compiler makes each GEMM a
  cuBLASLt FP8 GEMM (xla.py); "xla_rowwise": per-token and per-output-feature scales applied to
  the GEMM's output. Neither has been timed on a GPU yet: benchmarks/fp8.py measures all three.

Inference (`quantize_params`): quantises each Dense kernel once and drops the master copy, so a
rollout policy holds FP8 weights and only quantises its activations per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ejax.kernels.fp8 import xla
from ejax.kernels.fp8.matmul import fp8_matmul
from ejax.parallel.params import variable_axis_names
from ejax.kernels.fp8.quantize import (ACTIVATION_TILE, E4M3, E5M2, WEIGHT_BLOCK, Fp8Tensor,
                                       dequantize, quantize_activations, quantize_blockwise)

default_kernel_init = nnx.initializers.lecun_normal()
# Fp8Dense's GEMMs: "blockwise" -> the Pallas block-scaled GEMM; the others -> xla.fp8_xla_dot with
# that scaling. The default stays "blockwise" until a GPU run shows another one faster.
IMPLS = ("blockwise", "xla", "xla_rowwise", "xla_delayed", "xla_delayed_fastacc")
DELAYED_IMPLS = ("xla_delayed", "xla_delayed_fastacc")  # the impls that keep an amax history (Fp8History)
DEFAULT_IMPL = "blockwise"
# xla_delayed quantises like xla (per tensor) with scales from an amax history (Fp8History);
# xla_delayed_fastacc is that with dX and dW accumulated fast as well. For inference weights
# (quantize) both are xla.
_XLA_SCALING = {"xla": "tensor", "xla_rowwise": "row", "xla_delayed": "tensor", "xla_delayed_fastacc": "tensor"}


def _check_impl(impl: str) -> str:
  if impl not in IMPLS:
    raise ValueError(f"FP8 Dense impl={impl!r} is not one of {IMPLS}")
  return impl


@jax.custom_vjp
def fp8_dot(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """x [tokens, in] @ kernel [in, out] -> fp32, both operands block-quantised to e4m3."""
  return fp8_matmul(quantize_activations(x), quantize_blockwise(kernel, WEIGHT_BLOCK))


def _fp8_dot_fwd(x, kernel):
  x_q, kernel_q = quantize_activations(x), quantize_blockwise(kernel, WEIGHT_BLOCK)
  # Zero-size arrays carry the primal dtypes through the residuals (dtypes are not pytree leaves).
  return fp8_matmul(x_q, kernel_q), (x_q, kernel_q, jnp.zeros((0,), x.dtype),
                                     jnp.zeros((0,), kernel.dtype))


def _fp8_dot_bwd(residuals, d_out):
  x_q, kernel_q, x_like, kernel_like = residuals
  x_dtype, kernel_dtype = x_like.dtype, kernel_like.dtype
  d_out_tiles = quantize_blockwise(d_out, ACTIVATION_TILE, E5M2)  # tiles along out features
  d_x = fp8_matmul(d_out_tiles, kernel_q.transpose(), jnp.float32)
  # dW contracts over tokens: X^T in 1x128 tiles along tokens, dY in 128x128 blocks.
  x_t = quantize_blockwise(dequantize(x_q).T, ACTIVATION_TILE, E4M3)
  d_kernel = fp8_matmul(x_t, quantize_blockwise(d_out, WEIGHT_BLOCK, E5M2), jnp.float32)
  return d_x.astype(x_dtype), d_kernel.astype(kernel_dtype)


fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def fp8_matmul_trained(tokens: jax.Array, kernel: jax.Array, impl: str, out_dtype,
                       history: jax.Array | None = None) -> jax.Array:
  """tokens [n, in] @ a trained kernel [in, out] -> [n, out] in out_dtype, through `impl`'s FP8 GEMMs
  (forward and backward): what Fp8Dense runs, for models whose weights are not Dense layers (pi0.5's
  stacked Gemma einsum weights). "xla_delayed" takes this GEMM's amax `history` (an Fp8History's value)."""
  impl = _check_impl(impl)
  if impl in DELAYED_IMPLS:
    if history is None:
      raise ValueError(f"FP8 impl {impl!r} needs the GEMM's amax history (an Fp8History variable)")
    return xla.fp8_xla_dot_delayed(tokens, kernel, history, out_dtype, impl == "xla_delayed_fastacc")
  if impl in _XLA_SCALING:
    return xla.fp8_xla_dot(tokens, kernel, _XLA_SCALING[impl], out_dtype)
  return fp8_dot(tokens, kernel).astype(out_dtype)


class Fp8Weight(nnx.Variable):
  """Inference-only FP8 kernel storage (not an nnx.Param: optimisers leave it alone)."""


class Fp8History(nnx.Variable):
  """The amax histories of delayed-scaling FP8 GEMMs ([..., 3, HISTORY_LENGTH], xla.new_history). Not
  an nnx.Param: the trainer differentiates the loss with respect to it and stores the result, the
  history with this step's amaxes pushed in, as its new value (ejax.train.step)."""


class Fp8Dense(nnx.Module):
  """Drop-in for nnx.Linear whose matmul runs in FP8 (forward and backward); `impl` in IMPLS."""

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               dtype=None, param_dtype=jnp.float32, kernel_init=default_kernel_init,
               bias_init=nnx.initializers.zeros_init(),
               kernel_axes: Sequence[str | None] = (None, None), impl: str = DEFAULT_IMPL,
               rngs: nnx.Rngs):
    self.in_features, self.out_features = in_features, out_features
    self.dtype = dtype
    self.impl = _check_impl(impl)
    self.kernel_axes = tuple(kernel_axes)
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype),
                            out_sharding=tuple(kernel_axes))
    # nnx.data: these attributes may hold None now and variables later (quantize, _from_linear).
    self.bias = nnx.data(nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype),
                                   out_sharding=(kernel_axes[1],)) if use_bias else None)
    self.kernel_fp8: Fp8Weight | None = nnx.data(None)
    self.kernel_scales: Fp8Weight | None = nnx.data(None)
    self.fp8_history = nnx.data(Fp8History(xla.new_history()) if impl in DELAYED_IMPLS else None)

  def prime_fp8_history(self) -> None:
    """Records the kernel's amax in an empty history (xla.prime_kernel_history)."""
    if self.fp8_history is not None and self.kernel is not None:
      amax = jnp.max(jnp.abs(self.kernel[...].astype(jnp.float32)))
      self.fp8_history[...] = xla.prime_kernel_history(self.fp8_history[...], amax)

  @property
  def is_quantized(self) -> bool:
    return self.kernel_fp8 is not None

  def quantize(self) -> None:
    """Freezes the kernel as FP8 for inference (in its impl's layout) and drops the master copy."""
    if self.is_quantized:
      return
    if self.impl in _XLA_SCALING:
      # K-major [out, in], as cuBLASLt's FP8 GEMM wants its second operand; the scale is a scalar
      # ("xla") or one per output feature ("xla_rowwise", [out, 1]).
      values, scales = xla.quantize_weight(self.kernel[...], _XLA_SCALING[self.impl])
      self.kernel_fp8 = Fp8Weight(values, out_sharding=self.kernel_axes[::-1])
      self.kernel_scales = Fp8Weight(scales, out_sharding=(self.kernel_axes[1], None)[:scales.ndim])
      self.kernel = None
      return
    kernel_q = quantize_blockwise(self.kernel[...], WEIGHT_BLOCK)
    # The FP8 kernel keeps the master kernel's logical axes (it has the same padded layout); the
    # handful of scales is replicated.
    self.kernel_fp8 = Fp8Weight(kernel_q.values, out_sharding=self.kernel_axes)
    self.kernel_scales = Fp8Weight(kernel_q.scales, out_sharding=(None, None))
    self.kernel = None

  def __call__(self, x: jax.Array) -> jax.Array:
    if x.shape[-1] != self.in_features:
      raise ValueError(f"Fp8Dense expects {self.in_features} input features, got shape {x.shape}")
    dtype = self.dtype or x.dtype
    tokens = x.reshape(-1, self.in_features)
    if not self.is_quantized:
      # The XLA routes' GEMMs write the layer's dtype (cuBLASLt's output), the Pallas kernel fp32.
      y = fp8_matmul_trained(tokens, self.kernel[...], self.impl,
                             dtype if self.impl in _XLA_SCALING else jnp.float32,
                             None if self.fp8_history is None else self.fp8_history[...])
    elif self.impl in _XLA_SCALING:
      y, _ = xla.forward(tokens, self.kernel_fp8[...], self.kernel_scales[...], _XLA_SCALING[self.impl], dtype)
    else:
      kernel_q = Fp8Tensor(self.kernel_fp8[...], self.kernel_scales[...], WEIGHT_BLOCK,
                           (self.in_features, self.out_features))
      y = fp8_matmul(quantize_activations(tokens), kernel_q, jnp.float32)
    if self.bias is not None:
      y = y.astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(dtype).reshape(*x.shape[:-1], self.out_features)


def prime_fp8_histories(model: nnx.Module) -> None:
  """Primes every delayed-scaling history in `model` with its kernel's amax (xla.prime_kernel_history):
  each module that keeps one says how (`prime_fp8_history`)."""
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module) and isinstance(getattr(node, "fp8_history", None), Fp8History) \
        and hasattr(node, "prime_fp8_history"):
      node.prime_fp8_history()


def make_dense(in_features: int, out_features: int, *, fp8: bool | str,
               kernel_axes: Sequence[str | None], use_bias: bool = True, rngs: nnx.Rngs,
               dtype=None, param_dtype=jnp.float32, kernel_init=default_kernel_init,
               bias_init=nnx.initializers.zeros_init()) -> nnx.Module:
  """The Dense layer a model builds: `Fp8Dense` when `config.model.fp8`, else nnx.Linear.

  fp8: False, True (the default impl) or an impl name from IMPLS. Both layers carry the same
  logical axis names on kernel (kernel_axes) and bias (kernel_axes[1]), the same parameter names
  and initialisers, so checkpoints move between the two (and between impls).
  """
  if fp8:
    return Fp8Dense(in_features, out_features, use_bias=use_bias, dtype=dtype,
                    param_dtype=param_dtype, kernel_init=kernel_init, bias_init=bias_init,
                    kernel_axes=kernel_axes, impl=DEFAULT_IMPL if fp8 is True else fp8, rngs=rngs)
  return nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype,
                    param_dtype=param_dtype, rngs=rngs,
                    kernel_init=nnx.with_partitioning(kernel_init, tuple(kernel_axes)),
                    bias_init=nnx.with_partitioning(bias_init, (kernel_axes[1],)))


def _from_linear(linear: nnx.Linear, impl: str) -> Fp8Dense:
  kernel = linear.kernel[...]
  axes = variable_axis_names(linear.kernel) or (None, None)
  dense = Fp8Dense(kernel.shape[0], kernel.shape[1], use_bias=False, dtype=linear.dtype,
                   param_dtype=kernel.dtype, kernel_init=lambda *_: kernel, kernel_axes=axes,
                   impl=impl, rngs=nnx.Rngs(0))
  dense.bias = linear.bias
  dense.quantize()
  return dense


def quantize_params(model: nnx.Module, *, min_features: int = 128, impl: str = DEFAULT_IMPL) -> int:
  """Turns every Dense (Fp8Dense or nnx.Linear) of `model` into FP8 inference weights, in place.

  Layers whose in or out features are below `min_features` stay as they are: one partial 128-block
  gains no speed and loses precision (tiny state/action projections). An nnx.Linear becomes an
  Fp8Dense of `impl`; an Fp8Dense keeps its own. Returns how many layers were quantised.
  """
  _check_impl(impl)
  count = 0
  for path, node in list(nnx.iter_graph(model)):
    if not path or not isinstance(node, (Fp8Dense, nnx.Linear)):
      continue
    kernel_shape = node.kernel_fp8.shape if isinstance(node, Fp8Dense) and node.is_quantized \
        else node.kernel.shape
    if min(kernel_shape) < min_features:
      continue
    if isinstance(node, Fp8Dense):
      node.quantize()
    else:
      parent = model
      for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) or not hasattr(parent, str(key)) \
            else getattr(parent, key)
      replacement = _from_linear(node, impl)
      if isinstance(path[-1], int) or not hasattr(parent, str(path[-1])):
        parent[path[-1]] = replacement
      else:
        setattr(parent, path[-1], replacement)
    count += 1
  return count
