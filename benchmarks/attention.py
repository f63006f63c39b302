"""Variable-length attention vs dense masked attention on the same packed rows.

Rows are packed (ejax.data.packing) from the VLA length mix of benchmarks/packing.py (1-3 cameras x
256 tokens, a 5-60 token instruction, 1 state + 16 action tokens). Every arm computes the same
block-causal, segment-masked attention; dense (jax.nn.dot_product_attention's XLA path, the
baseline, and ejax's reference op) materialises every (query, key) score of the row,
varlen (impl "xla" on CPU, the Pallas kernel on GPU) runs only the tiles a segment pair allows.
The measured speedup is printed next to the ideal FLOP ratio, sum over rows of row_length^2
divided by the sum of squared segment lengths, and next to the tile-granular ratio the kernel can
reach at its block size. On GPU it also prints TFLOP/s of the Pallas kernel, cuDNN and XLA.

  python benchmarks/attention.py          # headline: 4 rows x 2048 tokens, 4 heads x 32, CPU fp32
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ejax.data.packing import pack_sequences
from ejax.kernels.attention import attention_mask, flash_attention
from ejax.kernels.attention.ops import choose_impl
from ejax.kernels.attention.tiles import (CPU_BLOCK_SIZES, GPU_BLOCK_SIZES, XLA_GPU_BLOCK_SIZES,
                                          MaskInputs, active_fraction)


def vla_lengths(num_samples: int, rng: np.random.Generator) -> np.ndarray:
  cameras = rng.integers(1, 4, num_samples)
  return cameras * 256 + rng.integers(5, 61, num_samples) + 1 + 16


def packed_rows(num_rows: int, row_length: int, seed: int):
  """segment ids, positions and block ids [num_rows, row_length] of the first num_rows packed rows."""
  rng = np.random.default_rng(seed)
  lengths = vla_lengths(8 * num_rows * row_length // 500, rng)
  rows = pack_sequences(lengths, row_length, seed=seed)[:num_rows]
  segment_ids = np.zeros((num_rows, row_length), np.int32)
  block_ids = np.zeros_like(segment_ids)
  segment_lengths = []
  for r, members in enumerate(rows):
    offset = 0
    for segment, i in enumerate(members, start=1):
      n = int(lengths[i])
      segment_ids[r, offset:offset + n] = segment
      block_ids[r, offset + n - 17:offset + n - 16] = 1  # state token opens block 1
      block_ids[r, offset + n - 16:offset + n] = 2       # action tokens: block 2
      segment_lengths.append(n)
      offset += n
  return jnp.asarray(segment_ids), jnp.asarray(block_ids), np.array(segment_lengths)


def timed(fn, *args, repeats: int) -> float:
  """Best of `repeats` wall times after two warm-up calls (min is robust to a shared machine)."""
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=4)
  parser.add_argument("--row_length", type=int, default=2048)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head_dim", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  segment_ids, block_ids, segment_lengths = packed_rows(args.rows, args.row_length, args.seed)
  shape = (args.rows, args.row_length, args.heads, args.head_dim)
  keys = jax.random.split(jax.random.key(args.seed), 4)
  q, k, v, d_out = (jax.random.normal(key, shape, dtype) for key in keys)
  mask = dict(mask_kind="block_causal", q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
              q_block_ids=block_ids, kv_block_ids=block_ids)
  varlen_impl = choose_impl(q, k, "auto") if on_gpu else "xla"
  # The tiles the op picks for this impl and backend (ops.flash_attention).
  blocks = (GPU_BLOCK_SIZES if varlen_impl == "pallas" else
            XLA_GPU_BLOCK_SIZES if on_gpu else CPU_BLOCK_SIZES)

  ideal = args.rows * args.row_length**2 / np.sum(segment_lengths.astype(float)**2)
  tiles = MaskInputs(segment_ids, segment_ids, block_ids, block_ids)
  tile_ratio = 1.0 / float(active_fraction(tiles, blocks, ordered=True))
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, {jnp.dtype(dtype).name}")
  print(f"{args.rows} rows x {args.row_length} tokens, {len(segment_lengths)} segments "
        f"({segment_lengths.min()}..{segment_lengths.max()}), {args.heads} heads x {args.head_dim}, "
        f"padding {float((segment_ids == 0).mean()):.1%}")
  print(f"ideal FLOP ratio (row_length^2 / sum len^2): {ideal:.2f}x; tile-granular ratio at "
        f"{blocks.block_q}x{blocks.block_kv} tiles: {tile_ratio:.2f}x")

  dense_mask = attention_mask(args.row_length, args.row_length, batch=args.rows, **mask)[:, None]

  def make(impl):
    if impl == "dense":  # XLA's dense masked attention: the baseline (faster than the reference)
      attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense_mask,
                                                            implementation="xla")
    else:
      attend = lambda q, k, v: flash_attention(q, k, v, impl=impl, **mask)
    forward = jax.jit(attend)
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))
    return forward, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  results = {}
  arms = (("dense masked (jax.nn, xla)", "dense"), ("dense masked (ejax reference)", "reference"),
          (f"varlen ({varlen_impl})", varlen_impl))
  for name, impl in arms:
    forward, train = make(impl)
    results[name] = (timed(forward, q, k, v, repeats=args.repeats),
                     timed(train, q, k, v, repeats=args.repeats))
    print(f"{name:30s} forward {results[name][0] * 1e3:9.1f} ms   forward+backward {results[name][1] * 1e3:9.1f} ms")
  (dense_fwd, dense_train), _, (var_fwd, var_train) = results.values()
  print(f"speedup over jax.nn dense: forward {dense_fwd / var_fwd:.2f}x, forward+backward "
        f"{dense_train / var_train:.2f}x")

  # Useful FLOPs: 4 * sum(len^2) * head_dim * heads forward (QK^T and PV), 2.5x that with backward.
  useful = 4.0 * np.sum(segment_lengths.astype(float)**2) * args.head_dim * args.heads
  if on_gpu:
    for name, impl in (("pallas", "pallas"), ("cudnn", "cudnn"), ("xla", "xla")):
      try:
        forward, train = make(impl)
        seconds_fwd = timed(forward, q, k, v, repeats=args.repeats)
        seconds_train = timed(train, q, k, v, repeats=args.repeats)
        print(f"GPU {name:7s} forward {useful / seconds_fwd / 1e12:7.1f} TFLOP/s   "
              f"forward+backward {3.5 * useful / seconds_train / 1e12:7.1f} TFLOP/s (useful FLOPs)")
      except Exception as error:  # cuDNN refuses some masks; say so and go on
        print(f"GPU {name:7s} unavailable for this case: {type(error).__name__}: {str(error)[:120]}")
  else:
    print("GPU TFLOP/s (pallas, cudnn, xla): pending: no GPU")
  print(f"varlen/dense attention speedup (forward+backward): {dense_train / var_train:.2f}x; bound from the work at "
        f"equal FLOP rates {tile_ratio:.2f}x (dense pairs / active tile pairs at {blocks.block_q}x{blocks.block_kv}) "
        f"(goal {ideal:.2f}x, the ideal FLOP ratio)")


if __name__ == "__main__":
  main()
