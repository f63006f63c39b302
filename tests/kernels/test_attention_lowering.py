"""The Hopper attention routes lower for CUDA on this CPU-only machine (tests/cuda_lowering.py).

cuDNN over packed segments (impl "cudnn_packed"), tokamax's Mosaic GPU kernel (impl "tokamax", where
tokamax imports: Python >= 3.12, jax >= 0.11.1) and the Triton kernel's launch settings. The packed
routes keep ejax's Triton kernel as the branch for batches that are not packed rows, so both appear.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from ejax.kernels.attention import BlockSizes, flash_attention, mosaic_backward, tokamax_gpu
from tests.cuda_lowering import (TRITON, custom_calls, forbid_fallbacks, lower_for_cuda,  # noqa: F401
                                 tokamax_h100, triton_kernels)

ATTENTION_KERNELS = {"ejax_varlen_attention_fwd", "ejax_varlen_attention_dq", "ejax_varlen_attention_dkv"}
CUDNN_PACKED = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
BATCH, LEN, HEADS, KV_HEADS, HEAD_DIM = 2, 200, 4, 2, 64


def _loss(impl, mask_kind, **kwargs):
  def loss(q, k, v, segment_ids, keys):
    extra = {"causal": dict(q_positions=keys, kv_positions=keys),
             "block_causal": dict(q_block_ids=keys, kv_block_ids=keys)}.get(mask_kind, {})
    out = flash_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                          mask_kind=mask_kind, impl=impl, **extra, **kwargs)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _args(dtype=jnp.bfloat16):
  ids = jax.ShapeDtypeStruct((BATCH, LEN), jnp.int32)
  return (jax.ShapeDtypeStruct((BATCH, LEN, HEADS, HEAD_DIM), dtype),
          *[jax.ShapeDtypeStruct((BATCH, LEN, KV_HEADS, HEAD_DIM), dtype)] * 2, ids, ids)


@pytest.fixture
def cudnn_packed_on_hopper(monkeypatch):
  """jax checks cuDNN's version and, for packed segments, a Hopper GPU while tracing; stand both in."""
  monkeypatch.setattr("jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version", lambda: 90800)
  monkeypatch.setattr("jax._src.cudnn.fused_attention_stablehlo.check_compute_capability", lambda _: True)
  monkeypatch.setattr("tests.cuda_lowering.ALLOWED_CUSTOM_CALLS",
                      (TRITON, *CUDNN_PACKED))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mask_kind", ["bidirectional", "causal"])
def test_cudnn_packed_lowers_to_cudnn_with_ejax_kernel_as_the_other_branch(
    forbid_fallbacks, cudnn_packed_on_hopper, mask_kind, dtype):
  module = lower_for_cuda(_loss("cudnn_packed", mask_kind), *_args(dtype))
  assert custom_calls(module) == {CUDNN_PACKED[0]: 1, CUDNN_PACKED[1]: 1, TRITON: 3}
  assert set(triton_kernels(module)) == ATTENTION_KERNELS
  # The segment table travels as data (no dense [len, len] mask or bias is built).
  assert f"tensor<{BATCH}x{LEN}x{LEN}x" not in module


def test_cudnn_packed_refuses_block_causal(cudnn_packed_on_hopper):
  with pytest.raises(ValueError, match="cudnn_packed.*mask_kind"):
    lower_for_cuda(_loss("cudnn_packed", "block_causal"), *_args())


def test_triton_launch_settings_reach_every_kernel(forbid_fallbacks):
  blocks = BlockSizes(128, 64, 64, 64, num_warps=4, num_stages=3)
  module = lower_for_cuda(_loss("pallas", "block_causal", block_sizes=blocks), *_args())
  launches = re.findall(r'name = "(ejax_varlen_attention_\w+)", num_stages = (\d+) : i32, num_warps = (\d+)',
                        module)
  assert {name for name, _, _ in launches} == ATTENTION_KERNELS
  assert {(stages, warps) for _, stages, warps in launches} == {("3", "4")}


@pytest.mark.skipif(not tokamax_gpu.available(), reason=tokamax_gpu.unavailable_reason())
@pytest.mark.parametrize("impl,mask_kind", [("tokamax", "bidirectional"), ("tokamax", "causal"),
                                            ("tokamax", "block_causal"), ("tokamax_fwd", "block_causal"),
                                            ("mosaic", "block_causal"), ("mosaic", "causal")])
def test_tokamax_lowers_to_mosaic_gpu_kernels(forbid_fallbacks, tokamax_h100, impl, mask_kind):
  module = lower_for_cuda(_loss(impl, mask_kind, tokamax_config=tokamax_h100), *_args())
  calls = custom_calls(module)
  # tokamax: its forward and its backward's dQ and dK/dV kernels; tokamax_fwd: its forward only, the
  # backward is ejax's (Triton) as in the fallback branch; mosaic: its forward and ejax's Mosaic GPU
  # dQ and dK/dV kernels (mosaic_backward.py).
  assert calls["mosaic_gpu_v2"] == (1 if impl == "tokamax_fwd" else 3)
  assert set(triton_kernels(module)) == ATTENTION_KERNELS


@pytest.mark.skipif(mosaic_backward.available() is not None, reason=str(mosaic_backward.available()))
@pytest.mark.parametrize("mask_kind", ["block_causal", "causal"])
def test_mosaic_own_lowers_to_three_mosaic_gpu_kernels(forbid_fallbacks, mask_kind):
  """impl="mosaic_own": ejax's forward, dQ and dK/dV Mosaic GPU kernels, no tokamax; the Triton kernels
  are the branch for batches whose mask is not key ranges."""
  module = lower_for_cuda(_loss("mosaic_own", mask_kind), *_args())
  assert custom_calls(module)["mosaic_gpu_v2"] == 3
  assert set(triton_kernels(module)) == ATTENTION_KERNELS


@pytest.mark.skipif(mosaic_backward.available() is not None, reason=str(mosaic_backward.available()))
def test_repeated_layers_lower_each_mosaic_gpu_kernel_once_per_shape(forbid_fallbacks, monkeypatch):
  """Three identical attention calls (a model's repeated layers) and one of another length: one forward,
  dQ and dK/dV kernel for each shape in the program, not one for each call (ops._once_per_shape: the full
  GR00T step's 99 kernels lowered one by one in 41 s). The kernels are traced once per shape and per
  value of their module settings: a changed setting is traced anew, never served from before."""
  from ejax.kernels.attention import mosaic_forward

  traced, forward = [], mosaic_forward.forward

  def counted(q, *args, **kwargs):
    traced.append(q.shape)
    return forward(q, *args, **kwargs)

  monkeypatch.setattr(mosaic_forward, "forward", counted)

  def loss(q, k, v, segment_ids, keys, q2):
    total = 0.0
    for x in (q, q, q, q2):
      out = flash_attention(x, k, v, q_segment_ids=segment_ids[:, :x.shape[1]], kv_segment_ids=segment_ids,
                            mask_kind="causal", q_positions=keys[:, :x.shape[1]], kv_positions=keys, impl="mosaic_own")
      total = total + jnp.sum(out.astype(jnp.float32) ** 2)
    return total

  args = _args() + (jax.ShapeDtypeStruct((BATCH, LEN // 2, HEADS, HEAD_DIM), jnp.bfloat16),)
  step = lambda: jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 5)))
  assert custom_calls(lower_for_cuda(step(), *args))["mosaic_gpu_v2"] == 6  # 3 kernels x 2 shapes
  assert len(traced) == 2
  lower_for_cuda(step(), *args)  # another program with the same shapes and settings
  assert len(traced) == 2
  pingpong = mosaic_forward.PINGPONG
  monkeypatch.setattr(mosaic_forward, "PINGPONG", not pingpong)
  assert custom_calls(lower_for_cuda(step(), *args))["mosaic_gpu_v2"] == 6
  assert len(traced) == 4
  monkeypatch.setattr(mosaic_forward, "PINGPONG", pingpong)
  lower_for_cuda(step(), *args)
  assert len(traced) == 4


@pytest.mark.parametrize("kv_heads, written", [(HEADS, "bf16"), (KV_HEADS, "f32")])
def test_dkv_kernel_writes_bf16_unless_it_sums_a_group(forbid_fallbacks, kv_heads, written):
  """The Triton dK/dV pass writes one slice per query head: fp32 where a group of query heads shares a
  kv head (summed outside the kernel), else in the inputs' bf16 (the same values, half the bytes)."""
  ids = jax.ShapeDtypeStruct((BATCH, LEN), jnp.int32)
  q = jax.ShapeDtypeStruct((BATCH, LEN, HEADS, HEAD_DIM), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((BATCH, LEN, kv_heads, HEAD_DIM), jnp.bfloat16)
  module = lower_for_cuda(_loss("pallas", "causal"), q, kv, kv, ids, ids)
  line = next(line for line in module.splitlines() if 'name = "ejax_varlen_attention_dkv"' in line)
  results = re.findall(r"tensor<\d+x\d+x(\d+)x\d+x(\w+)>", line.rsplit("->", 1)[1])  # rows padded to tiles
  assert results == [(str(HEADS), written)] * 2, line[-300:]
