"""Block-wise FP8: GEMM error against fp32 (block-wise vs per-tensor FP8 vs bf16), and on GPU the
FP8 GEMM and FP8 inference speed against bf16 at GR00T DiT shapes.

Error table (any backend): [tokens, 1536] x [1536, 1536] (the DiT width) on Gaussian inputs, with
"massive activation" tokens (3e4 x the rest), and with such tokens plus outlier weight columns
(1e4 x). Errors are relative Frobenius norms over the output entries that are in no outlier row
or column: the entries the outliers should leave alone.

GPU sections (skipped on CPU, where fp8 dots are emulated and say nothing about speed):
- GEMM TFLOP/s: the Pallas block-scaled FP8 kernel vs a bf16 XLA dot, at the DiT's attention
  projection (1536 -> 1536) and MLP (1536 -> 6144, 6144 -> 1536) shapes;
- inference: a 16-block stack of DiT-shaped MLPs (make_dense) in bf16 vs after quantize_params.

  python benchmarks/fp8.py                # headline: the error table; GPU timings when a GPU is present
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ejax.kernels.fp8 import (dequantize, fp8_matmul, make_dense, quantize_activations,
                              quantize_blockwise, quantize_params, quantize_per_tensor)

WIDTH, MLP_WIDTH, DIT_BLOCKS, DIT_TOKENS = 1536, 6144, 16, 49  # GR00T-N1.5 DiT (REFERENCE.md)
OUTLIER_ERROR_GOAL = 1 / 3  # block-wise error must be below a third of per-tensor's
FP8_PEAK_RATIO = 1979 / 989  # H100 SXM dense FP8 / dense bf16 TFLOP/s (REFERENCE.md): a GEMM's bound


def error_table(tokens: int, seed: int) -> dict[str, dict[str, float]]:
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(tokens, WIDTH)).astype(np.float32)
  b = (rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
  rows, cols = rng.choice(tokens, 4, replace=False), rng.choice(WIDTH, 4, replace=False)
  spiky_rows = a.copy()
  spiky_rows[rows] *= 3e4
  both_a, both_b = a.copy(), b.copy()
  both_a[rows] *= 1e4
  both_b[:, cols] *= 1e4
  cases = {"gaussian": (a, b, [], []), "outlier tokens 3e4x": (spiky_rows, b, rows, []),
           "tokens + weight columns 1e4x": (both_a, both_b, rows, cols)}
  matmul = jax.jit(lambda x, w: fp8_matmul(quantize_activations(x), quantize_blockwise(w)))
  per_tensor = jax.jit(lambda x, w: dequantize(quantize_per_tensor(x)) @ dequantize(quantize_per_tensor(w)))
  bf16 = jax.jit(lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                      preferred_element_type=jnp.float32))
  table = {}
  for name, (x, w, bad_rows, bad_cols) in cases.items():
    want = x.astype(np.float64) @ w.astype(np.float64)
    keep = np.ix_(np.setdiff1d(np.arange(tokens), bad_rows), np.setdiff1d(np.arange(WIDTH), bad_cols))
    error = lambda got: float(np.linalg.norm((np.asarray(got) - want)[keep]) / np.linalg.norm(want[keep]))
    table[name] = {"block-wise fp8": error(matmul(x, w)), "per-tensor fp8": error(per_tensor(x, w)),
                   "bf16": error(bf16(x, w))}
  return table


def best_time(fn, *args, repeats: int = 10) -> float:
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return min(times)


def gpu_gemms(tokens: int) -> float:
  """Prints FP8 vs bf16 TFLOP/s per DiT GEMM shape; returns the MLP-weighted FP8/bf16 speedup."""
  key = jax.random.key(0)
  fp8_seconds = bf16_seconds = 0.0
  for k_dim, n_dim in ((WIDTH, WIDTH), (WIDTH, MLP_WIDTH), (MLP_WIDTH, WIDTH)):
    x = jax.random.normal(key, (tokens, k_dim), jnp.bfloat16)
    w = jax.random.normal(key, (k_dim, n_dim), jnp.bfloat16)
    w_q = quantize_blockwise(w)  # weights are quantised once (inference) or once per step (training)
    fp8 = jax.jit(lambda x, w_q: fp8_matmul(quantize_activations(x), w_q, jnp.bfloat16))
    bf16 = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    t_fp8, t_bf16 = best_time(fp8, x, w_q), best_time(bf16, x, w)
    flops = 2.0 * tokens * k_dim * n_dim
    fp8_seconds += t_fp8
    bf16_seconds += t_bf16
    print(f"GEMM [{tokens} x {k_dim}] x [{k_dim} x {n_dim}]: fp8 {flops / t_fp8 / 1e12:6.1f} TFLOP/s "
          f"(with activation quantisation), bf16 {flops / t_bf16 / 1e12:6.1f} TFLOP/s, "
          f"speedup {t_bf16 / t_fp8:.2f}x")
  return bf16_seconds / fp8_seconds


class DitMlpStack(nnx.Module):
  """16 DiT-shaped feed-forward blocks: the bulk of the GR00T action head's weights and FLOPs."""

  def __init__(self, rngs: nnx.Rngs):
    self.blocks = nnx.List([
        nnx.List([make_dense(WIDTH, MLP_WIDTH, fp8=False, kernel_axes=("embed", "mlp"), rngs=rngs,
                             dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
                  make_dense(MLP_WIDTH, WIDTH, fp8=False, kernel_axes=("mlp", "embed"), rngs=rngs,
                             dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)])
        for _ in range(DIT_BLOCKS)])

  def __call__(self, x):
    for up, down in self.blocks:
      x = x + down(jax.nn.gelu(up(x)))
    return x


def gpu_inference(batch: int) -> float:
  model = DitMlpStack(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (batch * DIT_TOKENS, WIDTH), jnp.bfloat16)
  forward = nnx.jit(lambda model, x: model(x))
  t_bf16 = best_time(forward, model, x)
  quantize_params(model)
  t_fp8 = best_time(forward, model, x)
  print(f"DiT MLP stack inference, {batch} x {DIT_TOKENS} tokens: bf16 {t_bf16 * 1e3:.2f} ms, "
        f"FP8 weights {t_fp8 * 1e3:.2f} ms, speedup {t_bf16 / t_fp8:.2f}x")
  return t_bf16 / t_fp8


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=512, help="rows of the error-table GEMM")
  parser.add_argument("--gpu_tokens", type=int, default=8192, help="rows of the GPU GEMMs")
  parser.add_argument("--gpu_batch", type=int, default=64, help="policy batch for GPU inference")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  nnx.use_eager_sharding(False)

  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
  table = error_table(args.tokens, args.seed)
  columns = list(next(iter(table.values())))
  print(f"GEMM relative error vs fp64, [{args.tokens} x {WIDTH}] x [{WIDTH} x {WIDTH}], entries "
        "outside outlier rows/columns:")
  print(f"{'case':32s}" + "".join(f"{c:>16s}" for c in columns))
  for name, row in table.items():
    print(f"{name:32s}" + "".join(f"{row[c]:16.4f}" for c in columns))
  outlier = table["outlier tokens 3e4x"]
  ratio = outlier["block-wise fp8"] / outlier["per-tensor fp8"]
  # The best block-wise FP8 can do is its error without outliers (FP8's rounding alone).
  error_bound = table["gaussian"]["block-wise fp8"] / outlier["per-tensor fp8"]
  error_line = (f"block-wise/per-tensor FP8 error with outlier tokens: {ratio:.2f}, bound {error_bound:.2f} "
                f"(block-wise's error without outliers) (goal < {OUTLIER_ERROR_GOAL:.2f})")

  if jax.default_backend() == "gpu":
    gemm_speedup = gpu_gemms(args.gpu_tokens)
    gpu_inference(args.gpu_batch)
    print(error_line)
    print(f"FP8/bf16 GEMM speed at GR00T DiT shapes: {gemm_speedup:.2f}x of a possible {FP8_PEAK_RATIO:.2f}x "
          "(H100 dense FP8 / bf16 peak) (goal 2.4x)")
  else:
    print("GPU sections (FP8 vs bf16 GEMM TFLOP/s, FP8 policy inference): skipped: no GPU "
          "(CPU emulates fp8 dots, so it can check numerics but never FP8 speed)")
    print(error_line)


if __name__ == "__main__":
  main()
