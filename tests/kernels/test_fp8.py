"""FP8: quantisation error bounds, the block-scaled GEMM (reference and Pallas kernel) against
fp32, block-wise vs per-tensor scaling under outliers, the XLA-native (cuBLASLt) FP8 GEMMs' values
and gradients, Fp8Dense training and inference for every impl."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ejax.kernels.fp8 import (DENSE_IMPLS, E4M3, E5M2, Fp8Dense, Fp8History, Fp8Weight, dequantize, fp8_dot,
                              fp8_matmul_pallas, fp8_matmul_reference, fp8_xla_dot,
                              fp8_xla_dot_reference, make_dense, quantize_activations,
                              quantize_blockwise, quantize_params, quantize_per_tensor)
from ejax.kernels.fp8 import xla as fp8_xla
from ejax.parallel.params import variable_axis_names

M, K, N = 256, 512, 384
INTERPRET = jax.default_backend() != "gpu"


@pytest.fixture(scope="module")
def gaussian():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(M, K)).astype(np.float32), rng.normal(size=(K, N)).astype(np.float32))


def _relative_error(got, want, rows=slice(None), cols=slice(None)):
  got, want = np.asarray(got, np.float32)[rows][:, cols], np.asarray(want)[rows][:, cols]
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("dtype,mantissa_bits,min_subnormal_exp", [(E4M3, 3, -9), (E5M2, 2, -16)])
def test_quantize_dequantize_error_bound(dtype, mantissa_bits, min_subnormal_exp):
  rng = np.random.default_rng(1)
  # 200 x 300 is no multiple of 128: padding and cropping are part of the round trip. One block
  # is all zeros and one holds a 1e4 spike, so the bound is checked for extreme scales too.
  x = rng.normal(size=(200, 300)).astype(np.float32) * rng.uniform(0.01, 10, size=(200, 1))
  x[:128, 128:256] = 0.0
  x[150, 20] = 1e4
  for block in [(128, 128), (1, 128)]:
    quantized = quantize_blockwise(jnp.asarray(x), block, dtype)
    assert quantized.values.dtype == dtype and quantized.scales.dtype == jnp.float32
    assert quantized.scales.shape == (-(-200 // block[0]), 3)
    restored = np.asarray(dequantize(quantized))
    assert restored.shape == x.shape
    scale = np.repeat(np.repeat(np.asarray(quantized.scales), block[0], 0), 128, 1)[:200, :300]
    # Round to nearest: half an ulp relative for normals, half the subnormal spacing absolute.
    bound = np.maximum(np.abs(x) * 2.0**-(mantissa_bits + 1), scale * 2.0**(min_subnormal_exp - 1))
    assert np.all(np.abs(restored - x) <= bound * (1 + 1e-6))
    assert not restored[:128, 128:256].any()
    # Each block's largest magnitude lands on the top of the range and comes back to within fp32's
    # rounding of amax / fp8_max * fp8_max: jax 0.9.2's CPU compiler divides exactly (1e4 again),
    # 0.11's multiplies by the reciprocal of the constant (10000.001, one ulp off).
    assert np.abs(restored[150, 20] - 1e4) <= 1e4 * 2.0**-23


def test_gemm_gaussian_matches_fp32_and_the_kernel_matches_its_reference(gaussian):
  a, b = gaussian
  a_q, b_q = quantize_activations(jnp.asarray(a)), quantize_blockwise(jnp.asarray(b))
  reference = jax.jit(fp8_matmul_reference)(a_q, b_q)
  kernel = fp8_matmul_pallas(a_q, b_q, interpret=INTERPRET)
  np.testing.assert_allclose(kernel, reference, rtol=1e-5, atol=1e-4)
  # e4m3 rounds each operand by up to 2^-4 relative; on Gaussian data the GEMM lands near 3.7 %.
  assert _relative_error(reference, a @ b) < 0.045
  # Non-multiple-of-block shapes through the kernel (padding in m, n and k).
  a_odd, b_odd = quantize_activations(jnp.asarray(a[:70, :200])), quantize_blockwise(jnp.asarray(b[:200, :130]))
  np.testing.assert_allclose(fp8_matmul_pallas(a_odd, b_odd, interpret=INTERPRET),
                             jax.jit(fp8_matmul_reference)(a_odd, b_odd), rtol=1e-5, atol=1e-4)


def test_kernel_takes_the_backward_pass_mixed_e5m2_e4m3_operands(gaussian):
  # dX = dY . W^T: e5m2 gradient tiles against e4m3 weight blocks, as fp8_dot's backward feeds it.
  a, b = gaussian
  d_out, w = quantize_blockwise(jnp.asarray(a[:100]), (1, 128), E5M2), quantize_blockwise(jnp.asarray(b))
  np.testing.assert_allclose(fp8_matmul_pallas(d_out, w, interpret=INTERPRET),
                             jax.jit(fp8_matmul_reference)(d_out, w), rtol=1e-5, atol=1e-4)


@jax.jit
def _blockwise_and_per_tensor(a, b):
  blockwise = fp8_matmul_reference(quantize_activations(a), quantize_blockwise(b))
  per_tensor = dequantize(quantize_per_tensor(a)) @ dequantize(quantize_per_tensor(b))
  return blockwise, per_tensor


def test_blockwise_beats_per_tensor_with_outliers(gaussian):
  a, b = gaussian
  rng = np.random.default_rng(2)
  rows, cols = rng.choice(M, 4, replace=False), rng.choice(N, 4, replace=False)
  other_rows, other_cols = np.setdiff1d(np.arange(M), rows), np.setdiff1d(np.arange(N), cols)

  # Case 1: four tokens with "massive activations" (3e4 x the rest). 1x128 tiles confine them to
  # their own rows; one per-tensor scale pushes every other token towards fp8's subnormals.
  # Measured: block-wise 0.037 (its Gaussian error), per-tensor 0.135. Margin required: 3x.
  spiky = a.copy()
  spiky[rows] *= 3e4
  blockwise, per_tensor = _blockwise_and_per_tensor(spiky, b)
  want = spiky @ b
  block_error = _relative_error(blockwise, want, other_rows)
  tensor_error = _relative_error(per_tensor, want, other_rows)
  assert block_error < 0.045
  assert tensor_error > 3 * block_error

  # Case 2: those tokens at 1e4 x plus four weight columns at 1e4 x. A 128x128 weight block shares
  # its scale with 127 neighbouring columns, so isolation is partial. Measured on the entries in
  # neither an outlier row nor column: block-wise 0.044, per-tensor 0.065. Margin required: 1.3x.
  spiky_a, spiky_b = a.copy(), b.copy()
  spiky_a[rows] *= 1e4
  spiky_b[:, cols] *= 1e4
  blockwise, per_tensor = _blockwise_and_per_tensor(spiky_a, spiky_b)
  want = spiky_a @ spiky_b
  block_error = _relative_error(blockwise, want, other_rows, other_cols)
  tensor_error = _relative_error(per_tensor, want, other_rows, other_cols)
  assert block_error < 0.05
  assert tensor_error > 1.3 * block_error


def test_fp8_dot_gradients_track_fp32(gaussian):
  a, b = gaussian
  x, w = jnp.asarray(a[:128]), jnp.asarray(b) * 0.05
  d_out = jnp.asarray(np.random.default_rng(3).normal(size=(128, N)), jnp.float32)
  loss = lambda dot, x, w: jnp.sum(dot(x, w) * d_out)
  got = jax.jit(jax.grad(lambda x, w: loss(fp8_dot, x, w), argnums=(0, 1)))(x, w)
  want = jax.grad(lambda x, w: loss(jnp.dot, x, w), argnums=(0, 1))(x, w)
  # dX: e5m2 gradient tiles (2^-3 rounding) times e4m3 weights; dW also re-tiles X along tokens.
  assert _relative_error(got[0], want[0]) < 0.07
  assert _relative_error(got[1], want[1]) < 0.09


def test_power_of_two_scales_fill_the_fp8_range_exactly():
  rng = np.random.default_rng(6)
  x = rng.normal(size=(64, 200)).astype(np.float32) * rng.uniform(1e-3, 1e3, size=(64, 1))
  x[3] = 0.0
  for dtype in (E4M3, E5M2):
    limit = float(jnp.finfo(dtype).max)
    for axis in (None, 1, 0):
      values, scale = fp8_xla.quantize(jnp.asarray(x), dtype, reduce_axis=axis)
      scale = np.asarray(scale)
      assert values.dtype == dtype and scale.dtype == np.float32
      assert scale.shape == {None: (), 1: (64, 1), 0: (1, 200)}[axis]
      mantissa, _ = np.frexp(scale)
      assert np.all(mantissa == 0.5)  # powers of two: exact in bf16, dequantising adds no rounding
      amax = np.max(np.abs(x), axis=axis, keepdims=axis is not None)
      used = amax / scale
      # The largest magnitude lands in the top binade of the format: at most one bit of range unused.
      assert np.all((used <= limit) & ((used > limit / 2) | (amax == 0)))
      restored = np.asarray(values, np.float32) * scale
      assert np.all(np.abs(restored - x) <= np.abs(x) * 2.0 ** -(3 if dtype == E4M3 else 2) + scale * 2.0 ** -9)
  assert float(fp8_xla.quantize(jnp.zeros((4, 4)))[1]) == 1.0


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_xla_fp8_dot_computes_the_dequantised_product(gaussian, scaling):
  a, b = gaussian
  x, w = jnp.asarray(a), jnp.asarray(b) * 0.05
  want = np.asarray(fp8_xla_dot_reference(x, w, scaling))
  # fp32 out: the GEMM is exact on the dequantised operands up to fp32 summation order.
  got = jax.jit(lambda x, w: fp8_xla_dot(x, w, scaling, jnp.float32))(x, w)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  # bf16 out, as Fp8Dense asks for it: one bf16 rounding more (plus the scaling pass for "row").
  got_bf16 = jax.jit(lambda x, w: fp8_xla_dot(x, w, scaling, jnp.bfloat16))(x, w)
  assert got_bf16.dtype == jnp.bfloat16
  assert _relative_error(got_bf16, want) < 2 * 2.0**-8
  # Against fp32: e4m3 rounding of both operands, as with block-wise scaling (~3.7 %).
  assert _relative_error(got, a @ (b * 0.05)) < 0.045


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_xla_fp8_dot_gradients(gaussian, scaling):
  a, b = gaussian
  x, w = jnp.asarray(a[:128]), jnp.asarray(b) * 0.05
  d_out = jnp.asarray(np.random.default_rng(3).normal(size=(128, N)), jnp.float32)
  loss = lambda dot, x, w: jnp.sum(dot(x, w) * d_out)
  got = jax.jit(jax.grad(lambda x, w: loss(lambda x, w: fp8_xla_dot(x, w, scaling), x, w), argnums=(0, 1)))(x, w)
  assert got[0].dtype == x.dtype and got[1].dtype == w.dtype
  want = jax.grad(lambda x, w: loss(jnp.dot, x, w), argnums=(0, 1))(x, w)
  # dX: e5m2 gradients (2^-3 rounding) against e4m3 weights; dW: re-quantised X against e5m2 dY.
  assert _relative_error(got[0], want[0]) < 0.07
  assert _relative_error(got[1], want[1]) < 0.09
  if scaling == "tensor":
    # Exactly the product of the dequantised FP8 operands the forward pass kept.
    dequant = lambda values_scale: values_scale[0].astype(jnp.float32) * values_scale[1]
    g = dequant(fp8_xla.quantize(d_out, E5M2))
    w_kmajor = dequant(fp8_xla.quantize_weight(w, "tensor"))
    x_deq = dequant(fp8_xla.quantize(x, E4M3))
    np.testing.assert_allclose(got[0], g @ w_kmajor, rtol=1e-5, atol=1e-5 * float(jnp.abs(g @ w_kmajor).max()))
    np.testing.assert_allclose(got[1], x_deq.T @ g, rtol=1e-5, atol=1e-5 * float(jnp.abs(x_deq.T @ g).max()))


def test_delayed_scaling_with_this_steps_amaxes_is_current_scaling(gaussian):
  """fp8_xla_dot_delayed quantises with the scale of its history's largest amax: given histories that
  hold the tensors' own amaxes, it computes exactly what current scaling does, values and gradients.
  Its "gradient" with respect to the history is the history with the step's amaxes pushed in front."""
  a, b = gaussian
  x, w = jnp.asarray(a[:128]), jnp.asarray(b) * 0.05
  d_out = jnp.asarray(np.random.default_rng(5).normal(size=(128, N)), jnp.float32) * 1e-4
  amaxes = [jnp.abs(t).max() for t in (x, w, d_out)]
  history = fp8_xla.new_history().at[:, 3].set(jnp.stack(amaxes)).at[:, 5].set(jnp.stack(amaxes) / 4)
  loss = lambda dot, x, w, *h: jnp.sum(dot(x, w, *h) * d_out)
  got = jax.jit(jax.grad(lambda x, w, h: loss(fp8_xla.fp8_xla_dot_delayed, x, w, h), argnums=(0, 1, 2)))(x, w, history)
  want = jax.jit(jax.grad(lambda x, w: loss(lambda x, w: fp8_xla_dot(x, w, "tensor"), x, w), argnums=(0, 1)))(x, w)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(jax.jit(fp8_xla.fp8_xla_dot_delayed)(x, w, history),
                                jax.jit(lambda x, w: fp8_xla_dot(x, w, "tensor"))(x, w))
  # What it pushes: the kernel's exact amax; for x and dY an upper bound read from their FP8 values (at
  # most one rounding step above: 1.1x for e4m3, 1.2x for e5m2).
  assert float(got[2][1, 0]) == float(amaxes[1])
  for row, slack in ((0, 1.1), (2, 1.2)):
    assert float(amaxes[row]) <= float(got[2][row, 0]) <= slack * float(amaxes[row])
  np.testing.assert_array_equal(got[2][:, 1:], history[:, :-1])
  # An empty history starts dY at scale 2^-16: a dY of 4e-7 is held, not flushed (at Transformer
  # Engine's start, scale 1, e5m2's smallest subnormal is 1.5e-5).
  tiny = d_out * 1e-3
  empty = jax.grad(lambda w, h: jnp.sum(fp8_xla.fp8_xla_dot_delayed(x, w, h) * tiny), argnums=(0, 1))(
      w, fp8_xla.new_history())
  assert np.count_nonzero(np.asarray(empty[0])) > 0.99 * empty[0].size
  assert float(jnp.abs(tiny).max()) <= float(empty[1][2, 0]) <= 1.2 * float(jnp.abs(tiny).max())


def test_a_primed_history_quantises_the_first_steps_kernel_as_later_steps_do(gaussian):
  """prime_kernel_history records the kernel's amax in an empty history (and leaves a written one as
  it is). At the empty history's scale 1, most weights of std 0.005 (a deep model's output projections)
  are e4m3 subnormals (below 2^-6, steps of 2^-9): the first GEMM is 11 % off (4 % at std 0.02, 28 % at
  0.002); primed, 3.7 % at any std, what the delayed recipe gives from the second step on."""
  a, b = gaussian
  x, w = jnp.asarray(a[:128]), jnp.asarray(b) * 0.005 / float(np.std(b))
  want = x @ w
  empty = fp8_xla.new_history()
  primed = fp8_xla.prime_kernel_history(empty, jnp.abs(w).max())
  assert float(primed[1, 0]) == float(jnp.abs(w).max()) and int(jnp.count_nonzero(primed)) == 1
  written = empty.at[1, 3].set(5.0)
  np.testing.assert_array_equal(fp8_xla.prime_kernel_history(written, jnp.abs(w).max()), written)
  first = _relative_error(fp8_xla.fp8_xla_dot_delayed(x, w, empty), want)
  second = _relative_error(fp8_xla.fp8_xla_dot_delayed(x, w, primed), want)
  assert first > 0.08 and second < 0.05, (first, second)
  stacked = fp8_xla.prime_kernel_history(fp8_xla.new_history(4, 3), jnp.arange(12.0).reshape(4, 3) + 1)
  np.testing.assert_array_equal(stacked[..., 1, 0], jnp.arange(12.0).reshape(4, 3) + 1)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_amax_bound_from_fp8_values(dtype):
  """_amax_bound: at or above the true amax and within one FP8 rounding step of it; SATURATED_GROWTH x
  the FP8 max when the values saturated (the scale then grows); 0 for a tensor that is all zero or
  flushed (no information: the history keeps its older amaxes); NaN for a NaN."""
  rng = np.random.default_rng(7)
  limit = float(jnp.finfo(dtype).max)
  slack = 1.1 if dtype == E4M3 else 1.2
  for magnitude in (1e-3, 0.3, 7.0, 0.9 * limit):
    x = jnp.asarray(rng.normal(size=(64, 96)) * magnitude / 4, jnp.float32)
    scale = jnp.float32(1.0)
    q = fp8_xla.to_fp8(x, scale, dtype)
    bound, amax = float(fp8_xla._amax_bound(q, scale, dtype)), float(jnp.abs(x).max())
    largest = float(jnp.abs(q.astype(jnp.float32)).max())
    if largest == 0:
      assert bound == 0
    elif largest >= float(jnp.finfo(dtype).smallest_normal):
      assert amax <= bound <= slack * amax, (magnitude, amax, bound)
    else:  # subnormal: within one subnormal step
      assert amax <= bound <= amax + float(jnp.finfo(dtype).smallest_subnormal), (magnitude, amax, bound)
  scale = jnp.float32(2.0 ** -4)
  saturated = fp8_xla.to_fp8(jnp.full((8,), 10 * limit) * 2.0 ** -4, scale, dtype)
  assert float(fp8_xla._amax_bound(saturated, scale, dtype)) == fp8_xla.SATURATED_GROWTH * limit * 2.0 ** -4
  assert float(fp8_xla._amax_bound(jnp.zeros((8,), dtype), scale, dtype)) == 0
  assert np.isnan(float(fp8_xla._amax_bound(jnp.full((8,), jnp.nan, dtype), scale, dtype)))


def _dot_precisions(fn, *args) -> list[str]:
  """The precision of each dot_general in fn's jaxpr (its forward and backward), in program order."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(str(eqn.params["precision"][0] if eqn.params["precision"] else "DEFAULT"))
      for value in eqn.params.values():  # sub-jaxprs (custom_vjp, pjit, cond branches), any jax version
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def test_fast_backward_changes_only_the_backward_gemms_precision(gaussian):
  """"xla_delayed_fastacc" is xla_delayed whose dX and dW GEMMs accumulate fast (precision DEFAULT, as
  the forward does) instead of in full precision (HIGHEST, Transformer Engine's split accumulator).
  Off a GPU the precision changes nothing, so values and gradients are exactly xla_delayed's."""
  a, b = gaussian
  x, w = jnp.asarray(a[:128]), jnp.asarray(b) * 0.05
  d_out = jnp.asarray(np.random.default_rng(6).normal(size=(128, N)), jnp.float32) * 1e-3
  history = fp8_xla.new_history().at[:, 0].set(jnp.stack([jnp.abs(t).max() for t in (x, w, d_out)]))
  grads = {fast: jax.jit(jax.grad(lambda x, w, h, fast=fast: jnp.sum(
      fp8_xla.fp8_xla_dot_delayed(x, w, h, jnp.float32, fast) * d_out), argnums=(0, 1, 2)))(x, w, history)
      for fast in (False, True)}
  for got, want in zip(grads[True], grads[False]):
    np.testing.assert_array_equal(got, want)
  precisions = {fast: _dot_precisions(jax.grad(lambda x, w, h, fast=fast: jnp.sum(
      fp8_xla.fp8_xla_dot_delayed(x, w, h, jnp.float32, fast) * d_out), argnums=(0, 1)), x, w, history)
      for fast in (False, True)}
  assert precisions[False] == ["DEFAULT", "HIGHEST", "HIGHEST"], precisions
  assert precisions[True] == ["DEFAULT", "DEFAULT", "DEFAULT"], precisions
  # Through the Dense layer's impl name as well.
  dense = make_dense(128, 64, fp8="xla_delayed_fastacc", kernel_axes=(None, None), rngs=nnx.Rngs(0))
  assert dense.fp8_history is not None


def test_xla_rowwise_scaling_confines_outlier_tokens_per_tensor_does_not(gaussian):
  a, b = gaussian
  rng = np.random.default_rng(2)
  rows = rng.choice(M, 4, replace=False)
  other_rows = np.setdiff1d(np.arange(M), rows)
  spiky = a.copy()
  spiky[rows] *= 3e4
  want = spiky @ b
  errors = {scaling: _relative_error(jax.jit(lambda x, w: fp8_xla_dot(x, w, scaling))(spiky, b), want, other_rows)
            for scaling in ("tensor", "row")}
  # Per-token scales keep every other token at its Gaussian error (~3.7 %); one tensor scale
  # pushes them towards e4m3's subnormals.
  assert errors["row"] < 0.045
  assert errors["tensor"] > 3 * errors["row"]


def test_an_unknown_impl_or_scaling_is_refused():
  with pytest.raises(ValueError, match="impl='cublas' is not one of"):
    make_dense(128, 128, fp8="cublas", kernel_axes=(None, None), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="scaling='block' is not one of"):
    fp8_xla.quantize_weight(jnp.ones((128, 128)), "block")


class _Mlp(nnx.Module):
  def __init__(self, fp8: bool | str, rngs: nnx.Rngs):
    self.hidden = make_dense(128, 256, fp8=fp8, kernel_axes=("embed", "mlp"), rngs=rngs,
                             dtype=jnp.bfloat16)
    self.out = make_dense(256, 128, fp8=fp8, kernel_axes=("mlp", "embed"), rngs=rngs,
                          dtype=jnp.bfloat16)

  def __call__(self, x):
    return self.out(jax.nn.gelu(self.hidden(x)))


def _loss_curve(fp8: bool | str, inputs, targets, steps: int = 40, trained: list | None = None):
  model = _Mlp(fp8, nnx.Rngs(0))
  if trained is not None:
    trained.append(model)
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss_fn = lambda m: jnp.mean((m(inputs).astype(jnp.float32) - targets) ** 2)
    # As the trainer does: delayed scaling's histories are differentiated too, and their "gradients"
    # (the histories with this step's amaxes pushed in) stored.
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8History))
    loss, grads = nnx.value_and_grad(loss_fn, argnums=wrt)(model)
    histories, param_grads = nnx.split_state(grads, Fp8History, ...)
    optimizer.update(model, param_grads)
    nnx.update(model, histories)
    return loss

  return np.array([float(step(model, optimizer)) for _ in range(steps)])


@pytest.mark.parametrize("impl", DENSE_IMPLS)
def test_fp8_dense_training_tracks_bf16(impl):
  rng = np.random.default_rng(4)
  inputs = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32)
  teacher = rng.normal(size=(128, 128)).astype(np.float32) / np.sqrt(128)
  targets = jnp.tanh(inputs @ teacher)
  bf16_curve = _loss_curve(False, inputs, targets)
  models = []
  fp8_curve = _loss_curve(impl, inputs, targets, trained=models)
  assert bf16_curve[-1] < 0.3 * bf16_curve[0]  # the task is learnable in 40 steps
  # Same init, same data: the FP8 curve stays within 15 % of the bf16 curve at every step.
  np.testing.assert_allclose(fp8_curve, bf16_curve, rtol=0.15)
  if impl == "xla_delayed":  # from the second step on, scales from the amaxes seen: close to current scaling's
    np.testing.assert_allclose(fp8_curve[1:], _loss_curve("xla", inputs, targets)[1:], rtol=0.02)
    history = np.asarray(models[0].hidden.fp8_history[...])
    assert (history > 0).all()  # 40 steps filled all 16 places of x's, the kernel's and dY's amaxes


def test_make_dense_and_quantize_params():
  fp8_layer = make_dense(256, 128, fp8=True, kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0))
  linear = make_dense(256, 128, fp8=False, kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0))
  assert isinstance(fp8_layer, Fp8Dense) and isinstance(linear, nnx.Linear)
  # Same parameter names, shapes, init and logical axes: checkpoints move between the two.
  np.testing.assert_array_equal(fp8_layer.kernel[...], linear.kernel[...])
  for layer in (fp8_layer, linear):
    assert variable_axis_names(layer.kernel) == ("embed", "mlp")
    assert variable_axis_names(layer.bias) == ("mlp",)

  class Policy(nnx.Module):
    def __init__(self, rngs):
      self.encoder = nnx.Linear(256, 256, rngs=rngs,
                                kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")))
      self.blocks = nnx.List([make_dense(256, 128, fp8=True, kernel_axes=("mlp", "embed"), rngs=rngs)])
      self.head = nnx.Linear(128, 7, rngs=rngs)  # below 128 features: stays in high precision

    def __call__(self, x):
      x = self.encoder(x)
      for block in self.blocks:
        x = block(x)
      return self.head(x)

  policy = Policy(nnx.Rngs(1))
  x = jnp.asarray(np.random.default_rng(5).normal(size=(64, 256)), jnp.float32)
  before = nnx.jit(lambda model, x: model(x))(policy, x)
  assert quantize_params(policy) == 2
  assert isinstance(policy.encoder, Fp8Dense) and policy.encoder.is_quantized
  assert policy.blocks[0].is_quantized and isinstance(policy.head, nnx.Linear)
  weights = nnx.state(policy, Fp8Weight)
  assert weights["encoder"]["kernel_fp8"][...].dtype == E4M3
  assert variable_axis_names(policy.encoder.kernel_fp8) == ("embed", "mlp")
  assert len(jax.tree.leaves(nnx.state(policy.encoder, nnx.Param))) == 1  # only the bias remains
  after = jax.jit(lambda model, x: model(x))(policy, x)
  assert _relative_error(after, before) < 0.06


@pytest.mark.parametrize("impl", ["xla", "xla_rowwise"])
def test_xla_impl_inference_weights_are_k_major(impl):
  layer = make_dense(256, 384, fp8=impl, kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  kernel = np.asarray(layer.kernel[...])
  x = jnp.asarray(np.random.default_rng(7).normal(size=(2, 32, 256)), jnp.float32)
  training = layer(x)
  assert training.shape == (2, 32, 384) and training.dtype == jnp.bfloat16
  assert _relative_error(training.reshape(-1, 384), np.asarray(x).reshape(-1, 256) @ kernel) < 0.045
  layer.quantize()
  # [out, in]: cuBLASLt's FP8 GEMM wants its second operand K-major; the axis names follow.
  assert layer.kernel is None
  assert layer.kernel_fp8[...].shape == (384, 256) and layer.kernel_fp8[...].dtype == E4M3
  assert variable_axis_names(layer.kernel_fp8) == ("mlp", "embed")
  assert layer.kernel_scales[...].shape == {"xla": (), "xla_rowwise": (384, 1)}[impl]
  inference = jax.jit(lambda layer, x: layer(x))(layer, x)
  np.testing.assert_array_equal(np.asarray(inference, np.float32), np.asarray(training, np.float32))
