"""Block-wise FP8: quantisation, the block-scaled GEMM, an FP8 Dense and FP8 inference weights."""

from ejax.kernels.fp8.dense import Fp8Dense, Fp8Weight, fp8_dot, make_dense, quantize_params
from ejax.kernels.fp8.matmul import fp8_matmul, fp8_matmul_pallas, fp8_matmul_reference
from ejax.kernels.fp8.quantize import (ACTIVATION_TILE, E4M3, E5M2, WEIGHT_BLOCK, Fp8Tensor,
                                       dequantize, quantize_activations, quantize_blockwise,
                                       quantize_per_tensor)

__all__ = ["ACTIVATION_TILE", "E4M3", "E5M2", "WEIGHT_BLOCK", "Fp8Dense", "Fp8Tensor", "Fp8Weight",
           "dequantize", "fp8_dot", "fp8_matmul", "fp8_matmul_pallas", "fp8_matmul_reference",
           "make_dense", "quantize_activations", "quantize_blockwise", "quantize_params",
           "quantize_per_tensor"]
