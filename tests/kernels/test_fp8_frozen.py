"""Frozen FP8 kernels (ejax.kernels.fp8.frozen): quantised once, K-major, and the layers that run them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.kernels.fp8.frozen import FrozenKernel, dequantize, frozen_dot, quantize_kernel
from ejax.kernels.fp8.xla import quantize
from ejax.models import layers
from ejax.parallel.axes import EMBED, MLP


def _kernel(shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 0.05


@pytest.mark.parametrize("shape,contracted", [((96, 160), 1), ((96, 4, 40), 1), ((4, 40, 96), 2)])
def test_a_kernel_is_stored_k_major_in_e4m3_with_a_power_of_two_scale(shape, contracted):
  kernel = _kernel(shape)
  frozen = quantize_kernel(kernel, contracted)
  inner = int(np.prod(shape[:contracted]))
  assert frozen.values.dtype == jnp.float8_e4m3fn and frozen.values.shape == (kernel.size // inner, inner)
  scale = float(frozen.scale)
  assert frozen.scale.shape == () and scale == 2.0 ** round(np.log2(scale))
  assert float(jnp.max(jnp.abs(frozen.values.astype(jnp.float32)))) <= 448
  # Within e4m3's rounding of the original (3 mantissa bits: half a step is 1/16 relative; values
  # far below the largest sit in coarser subnormal steps, hence the absolute term).
  back = np.asarray(dequantize(frozen)).reshape(shape)
  np.testing.assert_allclose(back, np.asarray(kernel), rtol=1 / 16, atol=scale * 2.0 ** -10)


def test_frozen_dot_is_the_fp8_product_of_its_quantised_operands():
  """The forward is exactly what cuBLASLt computes: x quantised per tensor (its own amax), times the
  stored kernel, both dequantised exactly; and it stays near the unquantised product."""
  kernel = _kernel((192, 256))
  x = jax.random.normal(jax.random.key(1), (3, 40, 192), jnp.float32).astype(jnp.bfloat16)
  frozen = quantize_kernel(kernel, 1)
  y = frozen_dot(x, frozen, jnp.float32)
  x_q, x_scale = quantize(x.reshape(-1, 192))
  exact = (x_q.astype(jnp.float32) * x_scale) @ dequantize(frozen)
  assert y.shape == (3, 40, 256)
  np.testing.assert_allclose(np.asarray(y).reshape(-1, 256), np.asarray(exact), rtol=1e-2, atol=1e-2)
  reference = np.asarray(x.astype(jnp.float32) @ kernel)
  error = np.linalg.norm(np.asarray(y) - reference) / np.linalg.norm(reference)
  assert 0 < error < 0.06


def test_a_scale_known_ahead_quantises_the_input_without_its_amax():
  """With an input_scale the input is converted with it (no amax of its own): the product of the
  input so quantised and the kernel; an input beyond the scale's range saturates at 448 x the scale."""
  frozen = quantize_kernel(_kernel((128, 64)), 1)
  x = jax.random.normal(jax.random.key(5), (16, 128), jnp.float32)
  ahead = frozen._replace(input_scale=jnp.float32(2.0 ** -4))
  x_q = jnp.clip(x / 2.0 ** -4, -448, 448).astype(jnp.float8_e4m3fn).astype(jnp.float32) * 2.0 ** -4
  np.testing.assert_allclose(np.asarray(frozen_dot(x, ahead, jnp.float32)), np.asarray(x_q @ dequantize(frozen)),
                             rtol=1e-5, atol=1e-5)
  own = frozen_dot(x, frozen, jnp.float32)
  assert not np.allclose(np.asarray(own), np.asarray(frozen_dot(x, ahead, jnp.float32)))
  tight = frozen._replace(input_scale=jnp.float32(2.0 ** -10))  # 448 x 2^-10 = 0.44: most of x saturates
  saturated = jnp.clip(x, -448 * 2.0 ** -10, 448 * 2.0 ** -10)
  np.testing.assert_allclose(np.asarray(frozen_dot(x, tight, jnp.float32)),
                             np.asarray(frozen_dot(saturated, tight, jnp.float32)), rtol=1e-6, atol=1e-6)


def test_frozen_dot_differentiates_through_the_dequantised_kernel():
  kernel = quantize_kernel(_kernel((64, 128)), 1)
  x = jax.random.normal(jax.random.key(2), (10, 64), jnp.float32)
  d_y = jax.random.normal(jax.random.key(3), (10, 128), jnp.float32)
  _, vjp = jax.vjp(lambda x, k: frozen_dot(x, k, jnp.float32), x, kernel)
  d_x, d_kernel = vjp(d_y)
  expected = d_y.astype(jnp.bfloat16).astype(jnp.float32) @ dequantize(kernel).T
  np.testing.assert_allclose(np.asarray(d_x), np.asarray(expected), rtol=2e-2, atol=2e-2)
  assert not np.any(np.asarray(d_kernel.values.astype(jnp.float32))) and float(d_kernel.scale) == 0


def test_frozen_dot_names_a_feature_mismatch():
  with pytest.raises(ValueError, match="x has 32 features, the FP8 kernel takes 64"):
    frozen_dot(jnp.ones((2, 32)), quantize_kernel(_kernel((64, 16)), 1), jnp.float32)


def _with_frozen_kernel(module):
  """The module's kernel replaced by its FrozenKernel, as ejax.train.frozen_fp8.substitute does."""
  graphdef, state = nnx.split(module)
  contracted = type(module).FP8_CONTRACTED
  swapped = nnx.map_state(lambda path, v: v.replace(quantize_kernel(v.get_value(), contracted))
                          if path == ("kernel",) else v, state)
  return nnx.merge(graphdef, swapped), dequantize(swapped["kernel"].get_value())


@pytest.mark.parametrize("make,x_shape", [
    (lambda rngs: layers.Dense(48, 80, axes=(EMBED, MLP), rngs=rngs), (2, 5, 48)),
    (lambda rngs: layers.HeadProjection(48, 4, 16, use_bias=True, rngs=rngs), (2, 5, 48)),
    (lambda rngs: layers.OutputProjection(4, 16, 48, use_bias=True, rngs=rngs), (2, 5, 4, 16)),
])
def test_layers_run_a_frozen_kernel_as_one_fp8_gemm(make, x_shape):
  """Dense, HeadProjection and OutputProjection give, with a FrozenKernel in their kernel's place,
  frozen_dot of the flattened input plus their bias, in the shape they give with the kernel."""
  module = make(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(4), x_shape, jnp.float32)
  plain = module(x)
  fp8, weight = _with_frozen_kernel(module)
  y = fp8(x)
  assert y.shape == plain.shape and y.dtype == plain.dtype
  flat = x.reshape(*x.shape[:2], -1)
  bias = 0 if module.bias is None else module.bias[...].reshape(-1)
  expected = frozen_dot(flat, fp8.kernel.get_value(), jnp.float32) + bias
  np.testing.assert_allclose(np.asarray(y).reshape(expected.shape), np.asarray(expected), rtol=1e-6, atol=1e-6)
  error = np.linalg.norm(np.asarray(y - plain)) / np.linalg.norm(np.asarray(plain))
  assert error < 0.06
  assert isinstance(fp8.kernel.get_value(), FrozenKernel) and weight.shape == (flat.shape[-1], y.size // 10)
