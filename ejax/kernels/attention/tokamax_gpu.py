"""tokamax's Pallas Mosaic GPU flash attention (wgmma + TMA on Hopper) fed ejax's mask as key ranges.

tokamax (a DeepMind kernel library, jax >= 0.11.1, Python >= 3.12) has no segment ids in its public
`dot_product_attention`, but its Mosaic GPU op takes a `Mask(k_start=..., k_end=...)`: per query one
range of keys, and its SM90 kernel skips the kv blocks outside each q block's ranges, forward and
backward. intervals.py turns packed segment masks into such ranges (routes.py keeps ejax's own kernel
for layouts that are not). Off GPU the same call runs tokamax's plain XLA op, for tests.

tokamax imports `xprof` (a 31 MB wheel) at import time for its profiling benchmark helper only, which
ejax does not use; where xprof is missing a stand-in module is registered so tokamax imports.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types

import jax
import jax.numpy as jnp

from ejax.kernels.attention.intervals import KeyRanges


@functools.cache
def _modules():
  """(base, pallas_mosaic_gpu) from tokamax, or the error that says why it cannot be used here."""
  if sys.version_info < (3, 12):
    return ImportError(f"tokamax needs Python >= 3.12, this is {sys.version.split()[0]}")
  try:
    importlib.import_module("xprof.cli.tools")
  except ImportError:
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
      sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
  try:
    base = importlib.import_module("tokamax._src.ops.attention.base")
    mosaic = importlib.import_module("tokamax._src.ops.attention.pallas_mosaic_gpu")
  except Exception as error:  # ImportError, or an API of this jax that tokamax does not know
    return ImportError(f"tokamax is not importable here ({type(error).__name__}: {error}); it needs "
                       f"jax >= 0.11.1 (this is {jax.__version__}) and `pip install tokamax`")
  return base, mosaic


def available() -> bool:
  return not isinstance(_modules(), Exception)


def unavailable_reason() -> str:
  modules = _modules()
  return str(modules) if isinstance(modules, Exception) else ""


def _require():
  modules = _modules()
  if isinstance(modules, Exception):
    raise ValueError(f"attention impl='tokamax': {modules}; use impl='auto'")
  return modules


def sm90_config(block_q: int = 64, block_kv: int = 128, num_stages: int = 2, persistent: bool = False):
  """A tokamax SM90 kernel config (the benchmark sweeps a few; None leaves tokamax's heuristics)."""
  _, mosaic = _require()
  return mosaic.ConfigSM90(block_q=block_q, block_kv=block_kv, num_stages=num_stages,
                           persistent=persistent)


def _op(on_gpu: bool, config):
  base, mosaic = _require()
  if not on_gpu:
    return base.DotProductAttention()
  if config is None:
    return mosaic.PallasMosaicGpuFlashAttention()
  return mosaic.PallasMosaicGpuFlashAttention(config=config)


def _mask(ranges: KeyRanges):
  base, _ = _require()
  # A query with no allowed key gets a one-key range (key 0) and its output is zeroed: an empty
  # range would divide by a zero softmax sum inside the kernel, and NaNs would reach the gradients.
  k_start = jnp.where(ranges.has_keys, ranges.k_start, 0)
  k_end = jnp.where(ranges.has_keys, ranges.k_end, 1)
  return base.Mask(k_start=k_start[:, None, :], k_end=k_end[:, None, :])  # [batch, 1 (heads), q_len]


def attention(q, k, v, ranges: KeyRanges, *, scale: float, on_gpu: bool, config=None):
  """out [batch, q_len, heads, d]: attention over each query's key range; zeros where it is empty.

  Differentiable (tokamax's op is a custom_vjp with its own Mosaic GPU backward kernels on GPU).
  """
  out = _op(on_gpu, config)(q, k, v, mask=_mask(ranges), logits_scale=scale)
  return jnp.where(ranges.has_keys[:, :, None, None], out, jnp.zeros((), out.dtype))


def forward_with_lse(q, k, v, ranges: KeyRanges, *, scale: float, on_gpu: bool, config=None):
  """(out, lse [batch, heads, q_len] fp32) in ejax's convention (zeros where a query sees no key), for
  a backward pass by ejax's kernel: tokamax's SM90 backward skips only causal blocks, not key ranges."""
  out, (row_max, row_sum) = _op(on_gpu, config)(q, k, v, mask=_mask(ranges), logits_scale=scale,
                                                 return_residuals=True)
  seen = ranges.has_keys[:, None, :]
  lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), 0.0).astype(jnp.float32)
  return jnp.where(ranges.has_keys[:, :, None, None], out, jnp.zeros((), out.dtype)), lse
