"""The routes that need packed rows: tokamax's and ejax's Mosaic GPU kernels over each query's key
range, and cuDNN over the segments as offsets (impls "tokamax", "tokamax_fwd", "mosaic", "mosaic_own",
"cudnn_packed"; ops.py says what each runs).

Each holds only where the rows are packed (each segment contiguous, order keys rising along it), which
the device checks (intervals.py). Where it does not, the call runs ejax's exact kernel instead, beside
the route in a `lax.cond`; under `unchecked_layout()` the route runs unconditionally and such a batch
gives NaN.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from ejax.kernels import platform
from ejax.kernels.attention import (blockwise, cudnn_packed, intervals, mosaic_backward, mosaic_common,
                                    mosaic_forward, pallas_gpu, tokamax_gpu)
from ejax.kernels.attention.tiles import CPU_BLOCK_SIZES, GPU_BLOCK_SIZES, MaskInputs, normalise_mask, pad_to_blocks

RANGE_IMPLS = ("tokamax", "tokamax_fwd", "mosaic", "mosaic_own")  # each query's keys as one range
PACKED_IMPLS = (*RANGE_IMPLS, "cudnn_packed")
MOSAIC_BACKWARD_IMPLS = ("mosaic", "mosaic_own")
# Mask kinds only ejax's own kernels take: a "wam" query's keys are two ranges (the shared context up
# to its position, and its own chunk), which neither tokamax's one range nor cuDNN's segments express.
OWN_KERNEL_ONLY = ("wam",)


def applies(impl: str, q, k, mask_kind: str) -> bool:
  """Whether `impl` takes this case on a GPU (shapes, mask kind, installed libraries)."""
  if mask_kind in OWN_KERNEL_ONLY and impl in PACKED_IMPLS:
    return False
  if impl == "pallas":
    return pallas_gpu.supports(q, k)
  if impl == "tokamax":
    return tokamax_gpu.available() and q.dtype in (jnp.bfloat16, jnp.float16)
  if impl == "tokamax_fwd":
    return applies("tokamax", q, k, mask_kind) and pallas_gpu.supports(q, k)
  if impl == "mosaic":
    return applies("tokamax", q, k, mask_kind) and applies("mosaic_own", q, k, mask_kind)
  if impl == "mosaic_own":
    return (mosaic_backward.available() is None and q.dtype in (jnp.bfloat16, jnp.float16)
            and mosaic_backward.head_dim_fits(q.shape[-1], persistent=mosaic_backward.persistent_at(q.shape[-1])))
  if impl == "cudnn_packed":
    return (mask_kind in cudnn_packed.MASK_KINDS and q.shape[1] == k.shape[1]
            and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0 and q.dtype in (jnp.bfloat16, jnp.float16))
  return impl in ("xla", "reference", "cudnn")


_UNCHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("ejax_attention_unchecked", default=False)


@contextlib.contextmanager
def unchecked_layout(unchecked: bool = True):
  """Inside the block (as calls are traced), the routes that need packed rows (tokamax, tokamax_fwd,
  mosaic, mosaic_own, cudnn_packed) run their kernels unconditionally instead of in a `lax.cond` beside
  ejax's exact kernel, and a batch whose rows are not packed makes their output NaN instead of exact.

  XLA:GPU runs a conditional by copying its predicate to the host and waiting for the device (36 waits
  in a GR00T step on Hopper's route); the train step enters this block unless
  train.check_attention_layout, and the trainer's non-finite guard stops a run whose batch was not
  packed (ejax's packer makes only packed rows). Evaluation, serving and sampling keep the check."""
  token = _UNCHECKED.set(unchecked)
  try:
    yield
  finally:
    _UNCHECKED.reset(token)


@jax.custom_jvp
def _poisoned(out: jax.Array, valid: jax.Array) -> jax.Array:
  """`out` where `valid` (a scalar), NaN everywhere otherwise. Its derivative passes the tangent through,
  so the backward adds no pass over d_out; the forward's select fuses into the route's own elementwise
  pass over its output (tokamax's zeroing of queries without keys)."""
  return jnp.where(valid, out, jnp.asarray(jnp.nan, out.dtype))


@_poisoned.defjvp
def _poisoned_jvp(primals, tangents):
  return _poisoned(*primals), tangents[0]


_KERNEL_SETTINGS = (mosaic_common, mosaic_forward, mosaic_backward)
_ONCE_PER_SHAPE: dict = {}


def _once_per_shape(kernel, **static):
  """`kernel` with `static` bound, as one jax.jit for each binding and each value of ejax's Mosaic GPU
  kernels' module settings (their upper-case names, read as the call is traced). A model's repeated
  layers call it with the same shapes, and jax traces and lowers an inner jit once per program for
  each shape: GR00T's full train step has 99 Mosaic GPU kernel calls, lowered one by one in 41 s on a
  2-core CPU (37.6 s on an H200's host with tokamax's forward, 2026-11-29), each lowering a Mosaic GPU
  module of its own. Used for ejax's kernels and tokamax's forward (its config is hashable)."""
  settings = tuple((module.__name__, name, value) for module in _KERNEL_SETTINGS for name, value in vars(module).items()
                   if name.isupper() and isinstance(value, (bool, int, float, str, type(None))))
  key = (kernel, tuple(sorted(static.items())), settings)
  if key not in _ONCE_PER_SHAPE:
    _ONCE_PER_SHAPE[key] = jax.jit(functools.partial(kernel, **static))
  return _ONCE_PER_SHAPE[key]


_pad_rows = lambda x, n: jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2))


def _mosaic_ranges(ranges, q_len: int):
  """(k_start, k_end, q_pad): the ranges padded to whole tiles of the Mosaic GPU kernels, an empty
  range (0, 0) where a query sees no key and for the padded queries."""
  k_start, k_end, has_keys = ranges
  q_pad = -q_len % mosaic_backward.LENGTH_MULTIPLE
  return (_pad_rows(jnp.where(has_keys, k_start, 0), q_pad), _pad_rows(jnp.where(has_keys, k_end, 0), q_pad),
          q_pad)


def _mosaic_forward(plan: blockwise.Plan, q, k, v, ranges):
  """mosaic_forward's kernel on copies padded to whole tiles: (out, lse), 0 where a query sees no key."""
  q_len, kv_len = q.shape[1], k.shape[1]
  k_start, k_end, q_pad = _mosaic_ranges(ranges, q_len)
  kv_pad = -kv_len % mosaic_backward.LENGTH_MULTIPLE
  forward = _once_per_shape(mosaic_forward.forward, scale=plan.scale, interpret=not platform.on_gpu())
  out, lse = forward(_pad_rows(q, q_pad), _pad_rows(k, kv_pad), _pad_rows(v, kv_pad), k_start, k_end)
  return out[:, :q_len], lse[..., :q_len]


def _mosaic_backward(plan: blockwise.Plan, q, k, v, ranges, out, lse, d_out):
  """mosaic_backward's kernels on copies padded to whole tiles (padded queries see no key)."""
  q_len, kv_len = q.shape[1], k.shape[1]
  k_start, k_end, q_pad = _mosaic_ranges(ranges, q_len)
  kv_pad = -kv_len % mosaic_backward.LENGTH_MULTIPLE
  lse = jnp.pad(lse, [(0, 0), (0, 0), (0, q_pad)])
  backward = _once_per_shape(mosaic_backward.backward, scale=plan.scale, interpret=not platform.on_gpu())
  dq, dk, dv = backward(_pad_rows(q, q_pad), _pad_rows(k, kv_pad), _pad_rows(v, kv_pad), _pad_rows(out, q_pad), lse,
                        _pad_rows(d_out, q_pad), k_start, k_end)
  return dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ranged(plan: blockwise.Plan, options, q, k, v, k_start, k_end, has_keys, *mask):
  """Attention over each query's key range; options (tokamax config, on_gpu, impl)."""
  return _ranged_fwd(plan, options, q, k, v, k_start, k_end, has_keys, *mask)[0]


def _ranged_fwd(plan: blockwise.Plan, options, q, k, v, k_start, k_end, has_keys, *mask):
  config, on_gpu, impl = options
  if impl == "mosaic_own":
    out, lse = _mosaic_forward(plan, q, k, v, (k_start, k_end, has_keys))
  else:
    ranges = intervals.KeyRanges(k_start, k_end, has_keys, jnp.bool_(True))
    forward = _once_per_shape(tokamax_gpu.forward_with_lse, scale=plan.scale, on_gpu=on_gpu, config=config)
    out, lse = forward(q, k, v, ranges)
  return out, (q, k, v, (k_start, k_end, has_keys), MaskInputs(*mask), out, lse)


def _ranged_bwd(plan: blockwise.Plan, options, residuals, d_out):
  """ejax's backward from the forward's out and lse: the Mosaic GPU kernels over the key ranges
  (impls "mosaic", "mosaic_own"), or the blockwise one over the mask on block-padded copies
  ("tokamax_fwd")."""
  q, k, v, ranges, mask, out, lse = residuals
  if options[2] in MOSAIC_BACKWARD_IMPLS:
    return _mosaic_backward(plan, q, k, v, ranges, out, lse, d_out) + (None,) * (3 + len(mask))
  q_len, kv_len = q.shape[1], k.shape[1]
  q_p, k_p, v_p, mask_p = pad_to_blocks(q, k, v, mask, plan.blocks)
  q_pad = q_p.shape[1] - q_len
  pad_rows = lambda x: jnp.pad(x, [(0, 0), (0, q_pad), (0, 0), (0, 0)])
  lse_p = jnp.pad(lse, [(0, 0), (0, 0), (0, q_pad)])
  if plan.backend == "xla":  # its lse is [batch, kv_heads, groups, len]; q head h reads kv head h // groups
    lse_p = lse_p.reshape(lse.shape[0], k.shape[2], -1, lse_p.shape[-1])
  dq, dk, dv = blockwise.backward(plan, q_p, k_p, v_p, mask_p, pad_rows(out), lse_p, pad_rows(d_out))
  return (dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len]) + (None,) * (3 + len(mask))


_ranged.defvjp(_ranged_fwd, _ranged_bwd)


def attention(impl, q, k, v, mask_kind: str, mask_kwargs: dict, scale: float, block_sizes, interpret,
              tokamax_config, exact_attention):
  """`impl`'s route where the rows are packed, `exact_attention(q, k, v, impl=..., scale=...,
  block_sizes=..., interpret=..., **mask_kwargs)` (ops.flash_attention, given ejax's own kernel) for any
  other batch."""
  batch, q_len, _, _ = q.shape
  kv_len = k.shape[1]
  on_gpu = platform.on_gpu()
  if mask_kind in OWN_KERNEL_ONLY:
    raise ValueError(f"attention impl={impl!r} does not take mask_kind={mask_kind!r} (each query's keys "
                     "are two ranges); use impl='auto', 'pallas' or 'xla'")
  if impl == "cudnn_packed":
    if not on_gpu:
      raise ValueError(f"attention impl='cudnn_packed' needs a GPU, the backend is "
                       f"{platform.target_backend()!r}; use impl='auto'")
    if not applies(impl, q, k, mask_kind):
      raise ValueError(f"attention impl='cudnn_packed' takes self-attention (q_len == kv_len, here "
                       f"{q_len} and {kv_len}) with mask_kind in {cudnn_packed.MASK_KINDS} (here "
                       f"{mask_kind!r}), bf16/fp16 and head_dim <= 256 a multiple of 8 (here {q.dtype}, "
                       f"{q.shape[-1]}); use impl='auto'")
  elif impl != "mosaic_own" and not tokamax_gpu.available():
    raise ValueError(f"attention impl={impl!r}: {tokamax_gpu.unavailable_reason()}; use impl='auto'")
  mask, ordered = normalise_mask(batch, q_len, kv_len, **mask_kwargs)
  k, v = k.astype(q.dtype), v.astype(q.dtype)
  if impl == "tokamax":
    ranges = intervals.key_ranges(mask, ordered)
    valid = ranges.valid
    fast = lambda q, k, v: tokamax_gpu.attention(q, k, v, ranges, scale=scale, on_gpu=on_gpu,
                                                 config=tokamax_config)
  elif impl == "tokamax_fwd":
    if on_gpu and not pallas_gpu.supports(q, k):
      need = platform.triton_missing() or f"it needs head_dim in {pallas_gpu.SUPPORTED_HEAD_DIMS}, got {q.shape[-1]}"
      raise ValueError(f"attention impl='tokamax_fwd' runs ejax's Pallas backward: {need}; use impl='auto'")
    ranges = intervals.key_ranges(mask, ordered)
    valid = ranges.valid
    blocks = (block_sizes or (GPU_BLOCK_SIZES if on_gpu else CPU_BLOCK_SIZES)).fitted(q_len, kv_len)
    plan = blockwise.Plan("pallas" if on_gpu else "xla", ordered, scale, blocks, False)
    fast = lambda q, k, v: _ranged(plan, (tokamax_config, on_gpu, "ejax"), q, k, v, ranges.k_start,
                                   ranges.k_end, ranges.has_keys, *mask)
  elif impl in MOSAIC_BACKWARD_IMPLS:
    if not applies(impl, q, k, mask_kind):
      missing = mosaic_backward.available()
      raise ValueError(f"attention impl={impl!r}: {missing}; use impl='auto'" if missing else
                       f"attention impl={impl!r} runs Mosaic GPU kernels that take bf16/f16 and head_dim "
                       f"up to {mosaic_backward.MAX_HEAD_DIM}, got {q.dtype} and {q.shape[-1]}; use impl='auto'")
    ranges = intervals.key_ranges(mask, ordered)
    valid = ranges.valid
    plan = blockwise.Plan("mosaic", ordered, scale, CPU_BLOCK_SIZES, False)
    fast = lambda q, k, v: _ranged(plan, (tokamax_config, on_gpu, impl), q, k, v, ranges.k_start,
                                   ranges.k_end, ranges.has_keys, *mask)
  else:
    segments = intervals.packed_segments(mask, ordered, cudnn_packed.MAX_SEGMENTS)
    valid = segments.valid
    fast = lambda q, k, v: cudnn_packed.attention(q, k, v, segments, scale=scale, causal=ordered)
  if _UNCHECKED.get():
    return _poisoned(fast(q, k, v), valid)
  fallback = "pallas" if on_gpu and pallas_gpu.supports(q, k) else "xla"
  exact = functools.partial(exact_attention, scale=scale, impl=fallback, block_sizes=block_sizes,
                            interpret=interpret, **mask_kwargs)
  return jax.lax.cond(valid, fast, exact, q, k, v)
