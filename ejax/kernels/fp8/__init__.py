"""FP8: quantisation, the block-scaled Pallas GEMM, XLA-native (cuBLASLt) FP8 GEMMs, an FP8 Dense
and FP8 inference weights."""

from ejax.kernels.fp8.dense import DELAYED_IMPLS
from ejax.kernels.fp8.dense import IMPLS as DENSE_IMPLS
from ejax.kernels.fp8.dense import (Fp8Dense, Fp8History, Fp8Weight, fp8_dot, make_dense, prime_fp8_histories,
                                    quantize_params)
from ejax.kernels.fp8.matmul import fp8_matmul, fp8_matmul_pallas, fp8_matmul_reference
from ejax.kernels.fp8.quantize import (ACTIVATION_TILE, E4M3, E5M2, WEIGHT_BLOCK, Fp8Tensor,
                                       dequantize, quantize_activations, quantize_blockwise,
                                       quantize_per_tensor)
from ejax.kernels.fp8.xla import fp8_xla_dot, fp8_xla_dot_reference

__all__ = ["ACTIVATION_TILE", "DELAYED_IMPLS", "DENSE_IMPLS", "E4M3", "E5M2", "WEIGHT_BLOCK", "Fp8Dense", "Fp8Tensor",
           "Fp8History", "Fp8Weight", "dequantize", "fp8_dot", "fp8_matmul", "fp8_matmul_pallas",
           "fp8_matmul_reference", "fp8_xla_dot", "fp8_xla_dot_reference", "make_dense", "prime_fp8_histories",
           "quantize_activations", "quantize_blockwise", "quantize_params", "quantize_per_tensor"]
