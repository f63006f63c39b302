"""The GPU kernels lower for CUDA on this CPU-only machine (tests/cuda_lowering.py).

Each test exports a kernel's forward and backward for platforms=["cuda"] and asserts the lowered
module calls the kernel itself (Triton or cuDNN custom calls) with no jnp/XLA stand-in traced, so a
kernel that silently falls back, or stops lowering, fails here although its interpret-mode tests
still pass.
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejax.kernels.attention import BlockSizes, attention_reference, choose_impl, flash_attention, pallas_gpu
from ejax.kernels.attention.tiles import MaskInputs
from ejax.kernels.fp8 import fp8_dot, fp8_matmul_pallas, fp8_xla_dot, quantize_activations, quantize_blockwise
from ejax.kernels.platform import lowering_for
from tests.cuda_lowering import (CUDNN_ATTENTION, CUDNN_UNMASKED, TRITON, cudnn_h100, custom_calls,  # noqa: F401
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


def test_fp8_fast_accumulation_sets_max_num_imprecise_acc_on_the_fp8_dot_only():
  from jax._src.lib.mlir import ir
  from jaxlib.triton import dialect

  from benchmarks.triton_sm90 import _triton_calls
  from ejax.kernels.fp8.matmul import triton_fp8_fast_accumulation

  def triton_dots(fast: bool, a_dtype=jnp.float8_e4m3fn) -> list[str]:
    a, b = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16), jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    gemm = jax.jit(lambda a, b: fp8_matmul_pallas(quantize_blockwise(a, (1, 128), a_dtype), quantize_blockwise(b)))
    with triton_fp8_fast_accumulation(128) if fast else contextlib.nullcontext():
      module = lower_for_cuda(gemm, a, b)
    (_, bytecode, *_), = _triton_calls(module)
    context = ir.Context()
    dialect.register_dialect(context)
    with context:
      text = ir.Module.parse(bytecode).operation.get_asm(enable_debug_info=False)
    return [line for line in text.splitlines() if "tt.dot" in line]

  # jax's lowering leaves maxNumImpreciseAcc at 0 (Triton then keeps FP8 off Hopper's FP8 wgmma).
  (plain,) = triton_dots(fast=False)
  assert "f8E4M3FN" in plain and "maxNumImpreciseAcc" not in plain
  (fast,) = triton_dots(fast=True)
  assert "maxNumImpreciseAcc = 128" in fast
  # Outside the block the lowering is jax's again; mixed e5m2 x e4m3 runs as fp16 and is left alone.
  assert "maxNumImpreciseAcc" not in triton_dots(fast=False)[0]
  (mixed,) = triton_dots(fast=True, a_dtype=jnp.float8_e5m2)
  assert "f16" in mixed and "maxNumImpreciseAcc" not in mixed


def _dots_with_fp8_operands(module: str) -> list[dict]:
  """Every dot_general of the module, each operand traced back to the FP8 value it dequantises.

  An operand is matched as XLA's GPU GemmRewriter matches an FP8 GEMM operand: `convert(fp8)`,
  optionally times `broadcast_in_dim` of a scalar (the scale it hands cuBLASLt). Unmatched
  operands read as None.
  """
  dots = []
  for function in module.split("func.func")[1:]:
    defs = dict(re.findall(r"^\s*(%[\w#]+) = (stablehlo\.\w+ .*)$", function, re.MULTILINE))

    def dequantised(value):
      op = defs.get(value, "")
      if op.startswith("stablehlo.convert"):
        source = re.search(r"\(tensor<[^>]*x(f8E\w+)>\) ->", op)
        return {"fp8": source.group(1), "scale": None} if source else None
      if op.startswith("stablehlo.multiply"):
        a, b = re.findall(r"%[\w#]+", op)[:2]
        for converted, scale in ((a, b), (b, a)):
          scalar = re.match(r"stablehlo\.broadcast_in_dim %[\w#]+, dims = \[\] : \(tensor<\w+>\)",
                            defs.get(scale, ""))
          matched = dequantised(converted)
          if scalar and matched and matched["scale"] is None:
            return {"fp8": matched["fp8"], "scale": "scalar"}
      return None

    for op in defs.values():
      if op.startswith("stablehlo.dot_general"):
        lhs, rhs = re.findall(r"%[\w#]+", op)[:2]
        precision = re.search(r"precision = \[(\w+), \w+\]", op)
        dots.append({"lhs": dequantised(lhs), "rhs": dequantised(rhs),
                     "contracting": tuple(tuple(int(d) for d in dims.split(",") if d.strip()) for dims in
                                          re.search(r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\]", op).groups()),
                     "precision": precision.group(1) if precision else "DEFAULT",
                     "out": re.search(r"-> tensor<[^>]*x(\w+)>", op).group(1)})
  return dots


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_xla_fp8_gemms_lower_to_the_pattern_xla_rewrites_into_cublaslt_fp8(scaling):
  # XLA's GemmRewriter (gemm_rewriter.cc) makes a dot one `__cublas$lt$matmul$f8` call when both
  # operands are convert(fp8) [* broadcast(scalar scale)], one of them e4m3, the output bf16/f16/f32;
  # it transposes an operand whose contraction is not its minor dimension (Hopper wants A row-major,
  # B column-major). That last step runs on a GPU only; this checks everything it is fed.
  x = jax.ShapeDtypeStruct((200, 384), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((384, 256), jnp.float32)
  loss = lambda x, w: jnp.sum(fp8_xla_dot(x, w, scaling, jnp.bfloat16).astype(jnp.float32) ** 2)
  module = lower_for_cuda(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), x, w)
  assert not custom_calls(module)  # plain XLA: no Triton kernel, no stand-in
  dots = _dots_with_fp8_operands(module)
  scale = "scalar" if scaling == "tensor" else None
  operands = lambda dot: (dot["lhs"], dot["rhs"])
  e4m3, e5m2 = {"fp8": "f8E4M3FN", "scale": scale}, {"fp8": "f8E5M2", "scale": scale}
  forward, d_x, d_w = sorted(dots, key=lambda dot: (dot["precision"] != "DEFAULT", dot["out"] == "f32"))
  assert len(dots) == 3
  # Forward: x [tokens, in] . W K-major [out, in], fast accumulation: no transpose needed.
  assert operands(forward) == (e4m3, e4m3) and forward["contracting"] == ((1,), (1,))
  assert forward["precision"] == "DEFAULT" and forward["out"] == "bf16"
  # dX = dY(e5m2) . W(e4m3) and dW = X^T(e4m3) . dY(e5m2), full-precision accumulation.
  assert operands(d_x) == (e5m2, e4m3) and d_x["precision"] == "HIGHEST" and d_x["out"] == "bf16"
  assert operands(d_w) == (e4m3, e5m2) and d_w["precision"] == "HIGHEST" and d_w["out"] == "f32"
  assert d_w["contracting"] == ((0,), (0,))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mask_kind", ["bidirectional", "causal", "block_causal"])
def test_cudnn_attention_forward_and_backward_lower_to_cudnn(cudnn_h100, mask_kind, dtype):
  module = lower_for_cuda(jax.jit(_attention_loss("cudnn", mask_kind)), *_qkv(dtype), _mask_args(mask_kind))
  assert set(custom_calls(module)) == set(CUDNN_ATTENTION)


@pytest.mark.parametrize("head_dim", [72, 48])
def test_auto_gives_unmasked_attention_to_cudnn_at_its_own_head_size(cudnn_h100, forbid_fallbacks, head_dim):
  """SigLIP's 72-wide heads and the DiT's 48-wide ones, attending without a mask: cuDNN takes them as
  they are, where the Triton and Mosaic kernels would run them zero-padded to 128 and 64."""
  shape = jax.ShapeDtypeStruct((BATCH, 256, HEADS, head_dim), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v).astype(jnp.float32) ** 2)
  module = lower_for_cuda(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), shape, shape, shape)
  assert set(custom_calls(module)) == set(CUDNN_UNMASKED)
  assert "stablehlo.pad" not in module  # no padded copies of q, k, v
  # With a mask (segment ids) or without cuDNN, the kernels take the call, the head zero-padded.
  masked = lambda q, k, v, ids: jnp.sum(flash_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids))
  ids = jax.ShapeDtypeStruct((BATCH, 256), jnp.int32)
  assert set(custom_calls(lower_for_cuda(jax.jit(masked), shape, shape, shape, ids))) == {TRITON}


@pytest.mark.parametrize("q_len, kv_len", [(128, 257), (49, 49), (256, 256)])
def test_unmasked_attention_trains_on_cudnn_at_odd_lengths_under_remat(cudnn_h100, forbid_fallbacks, q_len, kv_len):
  """jax's cuDNN attention refuses to train on an odd length (its training check takes the empty bias
  it passes for a bias), and under jax.checkpoint it says so only when the backward is traced, past
  the op's choice: DreamZero's cross-attention to CLIP's 257 image tokens failed the 5B's whole step
  on a GPU that way. "auto" pads odd lengths to even ones (an odd key count masked: a bias), so
  GR00T's 49-token DiT self-attention and those 257 keys train on cuDNN too."""
  q = jax.ShapeDtypeStruct((BATCH, q_len, HEADS, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((BATCH, kv_len, HEADS, 128), jnp.bfloat16)
  rematted = jax.checkpoint(lambda q, k, v: flash_attention(q, k, v))
  loss = lambda q, k, v: jnp.sum(rematted(q, k, v).astype(jnp.float32) ** 2)
  module = lower_for_cuda(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, kv, kv)
  assert set(custom_calls(module)) == set(CUDNN_ATTENTION if kv_len % 2 else CUDNN_UNMASKED)


def test_unmasked_attention_padded_to_even_lengths_computes_the_attention():
  """The padding itself, with jnp standing in for cuDNN: the padded key gets no weight, the padded
  query row is cut off, gradients match."""
  from ejax.kernels.attention import cudnn

  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(2, 5, 2, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, 7, 2, 8)), jnp.float32) for _ in range(2))
  original = jax.nn.dot_product_attention

  def xla_instead(*args, implementation=None, **kwargs):
    assert implementation == "cudnn" and args[0].shape[1] % 2 == 0 and args[1].shape[1] % 2 == 0
    return original(*args, implementation="xla", **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(jax.nn, "dot_product_attention", xla_instead)
    got = cudnn.unmasked(q, k, v, 8**-0.5)
    got_grads = jax.grad(lambda q, k, v: jnp.sum(cudnn.unmasked(q, k, v, 8**-0.5) ** 2), (0, 1, 2))(q, k, v)
  want = attention_reference(q, k, v)
  want_grads = jax.grad(lambda q, k, v: jnp.sum(attention_reference(q, k, v) ** 2), (0, 1, 2))(q, k, v)
  np.testing.assert_allclose(got, want, atol=1e-5)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, atol=1e-5)


def _has_cudnn() -> bool:
  try:
    from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
    check_cudnn_version()
  except Exception:  # noqa: BLE001
    return False
  return True


@pytest.mark.skipif(_has_cudnn(), reason="this jaxlib has cuDNN (a CUDA plugin): the case needs none")
def test_without_cudnn_auto_runs_unmasked_attention_on_the_kernels(forbid_fallbacks):
  shape = jax.ShapeDtypeStruct((BATCH, 256, HEADS, 72), jnp.bfloat16)
  module = lower_for_cuda(jax.jit(lambda q, k, v: flash_attention(q, k, v)), shape, shape, shape)
  assert set(custom_calls(module)) == {TRITON}


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
