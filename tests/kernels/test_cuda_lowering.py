"""The GPU kernels lower for CUDA on this CPU-only machine (tests/cuda_lowering.py).

Each test exports a kernel's forward and backward for platforms=["cuda"] and asserts the lowered
module calls the kernel itself (Triton or cuDNN custom calls) with no jnp/XLA stand-in traced, so a
kernel that silently falls back, or stops lowering, fails here although its interpret-mode tests
still pass.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejax.kernels.attention import BlockSizes, attention_reference, choose_impl, flash_attention, pallas_gpu
from ejax.kernels.attention.tiles import MaskInputs
from ejax.kernels.fp8 import fp8_dot, fp8_matmul_pallas, quantize_activations, quantize_blockwise
from ejax.kernels.platform import lowering_for
from tests.cuda_lowering import (CUDNN_ATTENTION, TRITON, cudnn_h100, custom_calls,  # noqa: F401
                                 forbid_fallbacks, lower_for_cuda, triton_kernels)

ATTENTION_KERNELS = {"ejax_varlen_attention_fwd", "ejax_varlen_attention_dq", "ejax_varlen_attention_dkv"}
# Packed rows with grouped kv heads (4 query heads share 2 kv heads); 200 tokens is no multiple of
# the 64-token tiles, so the padding path lowers too.
BATCH, LEN, HEADS, KV_HEADS, HEAD_DIM = 2, 200, 4, 2, 64


def _mask_args(mask_kind):
  """ShapeDtypeStructs for the mask arguments a mask kind takes (segment ids always)."""
  ids = jax.ShapeDtypeStruct((BATCH, LEN), jnp.int32)
  names = {"bidirectional": (), "causal": ("positions",), "block_causal": ("block_ids",)}[mask_kind]
  return {"segment_ids": ids, **{name: ids for name in names}}


def _attention_loss(impl, mask_kind):
  def loss(q, k, v, mask):
    extra = {}
    if mask_kind == "causal":
      extra = dict(q_positions=mask["positions"], kv_positions=mask["positions"])
    elif mask_kind == "block_causal":
      extra = dict(q_block_ids=mask["block_ids"], kv_block_ids=mask["block_ids"])
    out = flash_attention(q, k, v, q_segment_ids=mask["segment_ids"], kv_segment_ids=mask["segment_ids"],
                          mask_kind=mask_kind, impl=impl, **extra)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _qkv(dtype, q_len=LEN, kv_heads=KV_HEADS):
  return (jax.ShapeDtypeStruct((BATCH, q_len, HEADS, HEAD_DIM), dtype),
          jax.ShapeDtypeStruct((BATCH, LEN, kv_heads, HEAD_DIM), dtype),
          jax.ShapeDtypeStruct((BATCH, LEN, kv_heads, HEAD_DIM), dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mask_kind", ["bidirectional", "causal", "block_causal"])
def test_varlen_attention_forward_and_backward_lower_to_triton(forbid_fallbacks, mask_kind, dtype):
  module = lower_for_cuda(jax.jit(_attention_loss("pallas", mask_kind)), *_qkv(dtype), _mask_args(mask_kind))
  assert set(custom_calls(module)) == {TRITON}
  assert set(triton_kernels(module)) == ATTENTION_KERNELS


def test_auto_attention_is_the_pallas_kernel_on_gpu_except_for_odd_head_dims(forbid_fallbacks):
  q, k, _ = _qkv(jnp.bfloat16)
  module = lower_for_cuda(jax.jit(_attention_loss("auto", "causal")), *_qkv(jnp.bfloat16), _mask_args("causal"))
  assert set(triton_kernels(module)) == ATTENTION_KERNELS
  # Triton tiles need a power-of-two head_dim: GR00T-N1.5's DiT heads (48) take the XLA path on GPU.
  odd = jax.ShapeDtypeStruct((BATCH, LEN, HEADS, 48), jnp.bfloat16)
  with lowering_for("gpu"):
    assert choose_impl(q, k) == "pallas"
    assert choose_impl(odd, odd) == "xla"
  assert choose_impl(q, k) == "reference"  # back on this CPU: short rows take the dense reference


def test_cross_attention_with_one_kv_head_lowers_to_triton(forbid_fallbacks):
  # The DiT's cross-attention: few queries over a longer VL row, multi-query (one kv head).
  module = lower_for_cuda(jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(flash_attention(q, k, v, impl="pallas").astype(jnp.float32)), argnums=(0, 1, 2))),
      *_qkv(jnp.bfloat16, q_len=24, kv_heads=1))
  assert set(triton_kernels(module)) == ATTENTION_KERNELS


def test_fp8_gemm_forward_and_backward_lower_to_triton(forbid_fallbacks):
  # fp8_dot: forward e4m3 x e4m3; backward dX = dY(e5m2) . W^T(e4m3) and dW = X^T(e4m3) . dY(e5m2).
  x = jax.ShapeDtypeStruct((200, 384), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((384, 256), jnp.float32)
  loss = lambda x, w: jnp.sum(fp8_dot(x, w) ** 2)
  module = lower_for_cuda(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), x, w)
  assert set(custom_calls(module)) == {TRITON}
  assert triton_kernels(module) == {"ejax_fp8_blockwise_matmul": 3}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mask_kind", ["bidirectional", "causal", "block_causal"])
def test_cudnn_attention_forward_and_backward_lower_to_cudnn(cudnn_h100, mask_kind, dtype):
  module = lower_for_cuda(jax.jit(_attention_loss("cudnn", mask_kind)), *_qkv(dtype), _mask_args(mask_kind))
  assert set(custom_calls(module)) == set(CUDNN_ATTENTION)


def test_a_block_shape_triton_cannot_tile_fails_lowering_though_interpret_mode_runs_it():
  # 24-row q blocks: interpret mode on CPU computes the right answer, Triton cannot lower them.
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 96, 2, 32)), jnp.float32) for _ in range(3))
  segment_ids = jnp.asarray(np.repeat([1, 2], [50, 46])[None], jnp.int32)
  mask = MaskInputs(segment_ids, segment_ids, segment_ids * 0, segment_ids * 0)
  broken = lambda q, k, v, mask: pallas_gpu.forward(q, k, v, mask, ordered=False, scale=32**-0.5, block_q=24,
                                                    block_kv=32, interpret=True)[0]
  want = attention_reference(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
  np.testing.assert_allclose(jax.jit(broken)(q, k, v, mask), want, atol=1e-5)

  on_gpu = lambda q, k, v, mask: pallas_gpu.forward(q, k, v, mask, ordered=False, scale=32**-0.5, block_q=24,
                                                    block_kv=32)[0]
  with pytest.raises(ValueError, match=r"power of 2.*\(24, 32\)"):
    lower_for_cuda(jax.jit(on_gpu), q, k, v, mask)
  with pytest.raises(ValueError, match=r"power of 2.*\(48, 128\)"):
    a, b = jax.ShapeDtypeStruct((96, 256), jnp.bfloat16), jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    lower_for_cuda(jax.jit(lambda a, b: fp8_matmul_pallas(quantize_activations(a), quantize_blockwise(b),
                                                          block_m=48)), a, b)
  # The public tile sizes refuse such blocks before any kernel sees them.
  with pytest.raises(ValueError, match="power of two"):
    BlockSizes(block_q=24)
