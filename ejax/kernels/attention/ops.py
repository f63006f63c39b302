"""ejax's attention op: one signature, several implementations, gradients through custom_vjp.

impl:
- "reference": the dense jnp specification (reference.py); autodiff gives its gradients.
- "xla": blockwise online softmax in plain XLA that loops only over active tiles (xla.py); the CPU
  path and the GPU fallback. Memory is one tile of scores, cost follows segment lengths.
- "pallas": the Pallas/Triton varlen flash kernel (pallas_gpu.py). On a backend other than GPU it
  runs in interpret mode (slow; for tests).
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` with the dense mask; GPU only, and
  only where cuDNN accepts the case (it raises otherwise).
- "tokamax": tokamax's Pallas Mosaic GPU kernel (wgmma + TMA) with each query's keys as one range
  (tokamax_gpu.py, intervals.py); needs tokamax (jax >= 0.11.1, Python >= 3.12). Off GPU it runs
  tokamax's XLA op (tests).
- "tokamax_fwd": tokamax's forward with ejax's backward (Pallas on GPU): tokamax's SM90 backward skips
  causal blocks only, so over packed rows it does the dense row's work; ejax's skips by segment.
- "mosaic": tokamax's forward with ejax's Mosaic GPU backward (mosaic_backward.py: wgmma + TMA, its
  loops bounded by the key ranges); needs what tokamax needs. Off GPU the backward runs in Mosaic GPU
  interpret mode (tests).
- "mosaic_own": ejax's Mosaic GPU kernels both ways (mosaic_forward.py, whose warpgroups compute only
  the tiles their own queries' ranges touch, and mosaic_backward.py); needs jax >= 0.11, not tokamax.
  Off GPU both run in Mosaic GPU interpret mode (tests).
- "cudnn_packed": cuDNN flash attention over the segments as offsets (cudnn_packed.py); GPU (Hopper)
  only, self-attention with the "bidirectional" or "causal" mask kind.
  The five run where the rows are packed (each segment contiguous, order keys rising along it); a batch
  that is not runs ejax's own kernel instead (a `lax.cond` on a check made on device), so every impl
  gives reference.py's answer. Under `unchecked_layout()` (the train step's default) they run
  unconditionally and such a batch gives NaN.
- "auto": on a GPU, a call with no mask at all goes to cuDNN where it takes the head size unpadded
  (_cudnn_takes_unmasked); any other on a Hopper GPU to the first of `HOPPER_AUTO` that applies, else
  pallas on GPU when the kernel supports the shapes, else xla (EJAX_HOPPER_AUTO replaces that list);
  dense reference for tiny shapes off GPU, where loop overhead would dominate.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ejax.kernels import platform
from ejax.kernels.attention import (cudnn_packed, intervals, mosaic_backward, mosaic_common, mosaic_forward,
                                    pallas_gpu, tokamax_gpu, xla)
from ejax.kernels.attention.reference import MASK_KINDS, attention_mask, attention_reference
from ejax.kernels.attention.tiles import (CPU_BLOCK_SIZES, GPU_BLOCK_SIZES, XLA_GPU_BLOCK_SIZES,
                                          BlockSizes, MaskInputs, normalise_mask, pad_to_blocks)
from ejax.parallel.axes import ACT_BATCH, ACT_HEADS
from ejax.parallel.rules import current_context, logical_to_spec

IMPLS = ("auto", "reference", "xla", "pallas", "cudnn", "tokamax", "tokamax_fwd", "mosaic", "mosaic_own",
         "cudnn_packed")
_RANGE_IMPLS = ("tokamax", "tokamax_fwd", "mosaic", "mosaic_own")  # each query's keys as one range
_MOSAIC_BACKWARD_IMPLS = ("mosaic", "mosaic_own")
# What "auto" runs on a Hopper GPU (compute capability 9.x): the first of these that applies (else
# "pallas"), ordered by benchmarks/attention.py's TFLOP/s at 8 x 4,096 tokens, 16 heads x 128
# (BENCHMARKS.md): on an H200 forward / forward+backward mosaic_own 179 / 178 and mosaic 163 / 163
# (2026-11-29), tokamax_fwd 152 / 91, tokamax 135 / 68, pallas 64 / 73 (2026-11-28). mosaic_own and
# mosaic take head sizes 64 and 128; pi0.5's 256 goes on to tokamax_fwd.
HOPPER_AUTO = ("mosaic_own", "mosaic", "tokamax_fwd")
# EJAX_HOPPER_AUTO="tokamax_fwd,pallas" (say) replaces HOPPER_AUTO in this process: a route that fails
# on some machine (benchmarks/gpu.py checks each before its figures) is left out without an edit.
HOPPER_AUTO_ENV = "EJAX_HOPPER_AUTO"
# Below this many (query, key) pairs per head the dense reference is the fastest path off GPU.
_TINY_PAIRS = 256 * 256


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static choices of one blockwise call (hashable: it is a nondiff argument of the custom_vjp)."""
  backend: str  # "xla" | "pallas"
  ordered: bool
  scale: float
  blocks: BlockSizes
  interpret: bool


def _launch(plan: _Plan) -> dict:
  return dict(num_warps=plan.blocks.num_warps, num_stages=plan.blocks.num_stages)


def _forward(plan: _Plan, q, k, v, mask: MaskInputs):
  kwargs = dict(ordered=plan.ordered, scale=plan.scale, block_q=plan.blocks.block_q,
                block_kv=plan.blocks.block_kv)
  if plan.backend == "pallas":
    return pallas_gpu.forward(q, k, v, mask, interpret=plan.interpret, **kwargs, **_launch(plan))
  return xla.forward(q, k, v, mask, **kwargs)


def _backward(plan: _Plan, q, k, v, mask: MaskInputs, out, lse, d_out):
  kwargs = dict(ordered=plan.ordered, scale=plan.scale, block_q=plan.blocks.block_q_bwd,
                block_kv=plan.blocks.block_kv_bwd)
  if plan.backend == "pallas":
    return pallas_gpu.backward(q, k, v, mask, out, lse, d_out, interpret=plan.interpret, **kwargs,
                               **_launch(plan))
  return xla.backward(q, k, v, mask, out, lse, d_out, **kwargs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise(plan: _Plan, q, k, v, q_segment_ids, kv_segment_ids, q_keys, kv_keys, q_groups, kv_groups):
  mask = MaskInputs(q_segment_ids, kv_segment_ids, q_keys, kv_keys, q_groups, kv_groups)
  return _forward(plan, q, k, v, mask)[0]


def _blockwise_fwd(plan: _Plan, q, k, v, q_segment_ids, kv_segment_ids, q_keys, kv_keys, q_groups, kv_groups):
  mask = MaskInputs(q_segment_ids, kv_segment_ids, q_keys, kv_keys, q_groups, kv_groups)
  out, lse = _forward(plan, q, k, v, mask)
  return out, (q, k, v, mask, out, lse)


def _blockwise_bwd(plan: _Plan, residuals, d_out):
  q, k, v, mask, out, lse = residuals
  dq, dk, dv = _backward(plan, q, k, v, mask, out, lse, d_out)
  return dq, dk, dv, None, None, None, None, None, None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ranged(plan: _Plan, options, q, k, v, k_start, k_end, has_keys, *mask):
  """Attention over each query's key range; options (tokamax config, on_gpu, impl)."""
  return _ranged_fwd(plan, options, q, k, v, k_start, k_end, has_keys, *mask)[0]


def _ranged_fwd(plan: _Plan, options, q, k, v, k_start, k_end, has_keys, *mask):
  config, on_gpu, impl = options
  if impl == "mosaic_own":
    out, lse = _mosaic_forward(plan, q, k, v, (k_start, k_end, has_keys))
  else:
    ranges = intervals.KeyRanges(k_start, k_end, has_keys, jnp.bool_(True))
    forward = _once_per_shape(tokamax_gpu.forward_with_lse, scale=plan.scale, on_gpu=on_gpu, config=config)
    out, lse = forward(q, k, v, ranges)
  return out, (q, k, v, (k_start, k_end, has_keys), MaskInputs(*mask), out, lse)


_pad_rows = lambda x, n: jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2))


def _mosaic_ranges(ranges, q_len: int):
  """(k_start, k_end, q_pad): the ranges padded to whole tiles of the Mosaic GPU kernels, an empty
  range (0, 0) where a query sees no key and for the padded queries."""
  k_start, k_end, has_keys = ranges
  q_pad = -q_len % mosaic_backward.LENGTH_MULTIPLE
  return (_pad_rows(jnp.where(has_keys, k_start, 0), q_pad), _pad_rows(jnp.where(has_keys, k_end, 0), q_pad),
          q_pad)


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


def _mosaic_forward(plan: _Plan, q, k, v, ranges):
  """mosaic_forward's kernel on copies padded to whole tiles: (out, lse), 0 where a query sees no key."""
  q_len, kv_len = q.shape[1], k.shape[1]
  k_start, k_end, q_pad = _mosaic_ranges(ranges, q_len)
  kv_pad = -kv_len % mosaic_backward.LENGTH_MULTIPLE
  forward = _once_per_shape(mosaic_forward.forward, scale=plan.scale, interpret=not platform.on_gpu())
  out, lse = forward(_pad_rows(q, q_pad), _pad_rows(k, kv_pad), _pad_rows(v, kv_pad), k_start, k_end)
  return out[:, :q_len], lse[..., :q_len]


def _mosaic_backward(plan: _Plan, q, k, v, ranges, out, lse, d_out):
  """mosaic_backward's kernels on copies padded to whole tiles (padded queries see no key)."""
  q_len, kv_len = q.shape[1], k.shape[1]
  k_start, k_end, q_pad = _mosaic_ranges(ranges, q_len)
  kv_pad = -kv_len % mosaic_backward.LENGTH_MULTIPLE
  lse = jnp.pad(lse, [(0, 0), (0, 0), (0, q_pad)])
  backward = _once_per_shape(mosaic_backward.backward, scale=plan.scale, interpret=not platform.on_gpu())
  dq, dk, dv = backward(_pad_rows(q, q_pad), _pad_rows(k, kv_pad), _pad_rows(v, kv_pad), _pad_rows(out, q_pad), lse,
                        _pad_rows(d_out, q_pad), k_start, k_end)
  return dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len]


def _ranged_bwd(plan: _Plan, options, residuals, d_out):
  """ejax's backward from the forward's out and lse: the Mosaic GPU kernels over the key ranges
  (impls "mosaic", "mosaic_own"), or the blockwise one over the mask on block-padded copies
  ("tokamax_fwd")."""
  q, k, v, ranges, mask, out, lse = residuals
  if options[2] in _MOSAIC_BACKWARD_IMPLS:
    return _mosaic_backward(plan, q, k, v, ranges, out, lse, d_out) + (None,) * (3 + len(mask))
  q_len, kv_len = q.shape[1], k.shape[1]
  q_p, k_p, v_p, mask_p = pad_to_blocks(q, k, v, mask, plan.blocks)
  q_pad = q_p.shape[1] - q_len
  pad_rows = lambda x: jnp.pad(x, [(0, 0), (0, q_pad), (0, 0), (0, 0)])
  lse_p = jnp.pad(lse, [(0, 0), (0, 0), (0, q_pad)])
  if plan.backend == "xla":  # its lse is [batch, kv_heads, groups, len]; q head h reads kv head h // groups
    lse_p = lse_p.reshape(lse.shape[0], k.shape[2], -1, lse_p.shape[-1])
  dq, dk, dv = _backward(plan, q_p, k_p, v_p, mask_p, pad_rows(out), lse_p, pad_rows(d_out))
  return (dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len]) + (None,) * (3 + len(mask))


_ranged.defvjp(_ranged_fwd, _ranged_bwd)


def _cudnn_attention(q, k, v, scale: float, **mask_kwargs):
  if not platform.on_gpu():
    raise ValueError(f"attention impl='cudnn' needs a GPU, the backend is {platform.target_backend()!r}; "
                     "use impl='auto'")
  batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
  mask = attention_mask(q_len, kv_len, batch=batch, **mask_kwargs)
  out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                     implementation="cudnn")
  # cuDNN averages over all keys for a query with none allowed; the spec says zeros.
  return out * mask.any(-1)[:, :, None, None].astype(out.dtype)


# Mask kinds only ejax's own kernels take: a "wam" query's keys are two ranges (the shared context up
# to its position, and its own chunk), which neither tokamax's one range nor cuDNN's segments express.
_OWN_KERNEL_ONLY = ("wam",)

_SCOPED_IMPL: contextvars.ContextVar[str] = contextvars.ContextVar("ejax_attention_impl", default="auto")


@contextlib.contextmanager
def default_impl(impl: str):
  """Inside the block, attention calls that say impl="auto" run `impl` (a model's attention_impl).

  How a model's `attention_impl` reaches the attention calls of shared layers (layers.Attention) that
  take no impl argument. It acts while the calls are traced, like platform.lowering_for.
  """
  if impl not in IMPLS:
    raise ValueError(f"attention impl={impl!r} is not one of {IMPLS}")
  token = _SCOPED_IMPL.set(impl)
  try:
    yield
  finally:
    _SCOPED_IMPL.reset(token)


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


def with_attention_impl(method):
  """Decorates a module method: its attention calls run the module's `attention_impl` (default_impl)."""
  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    with default_impl(getattr(self, "attention_impl", "auto")):
      return method(self, *args, **kwargs)
  return wrapped


def _hopper() -> bool:
  """Whether the kernels run on a Hopper GPU (not when lowering for a GPU from a CPU host)."""
  if jax.default_backend() != "gpu":
    return False
  return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def hopper_auto() -> tuple[str, ...]:
  """What "auto" tries on a Hopper GPU, in order: $EJAX_HOPPER_AUTO when set, else HOPPER_AUTO."""
  value = os.environ.get(HOPPER_AUTO_ENV, "").strip()
  if not value:
    return HOPPER_AUTO
  routes = tuple(part.strip() for part in value.split(",") if part.strip())
  wrong = [route for route in routes if route not in IMPLS or route == "auto"]
  if wrong:
    raise ValueError(f"{HOPPER_AUTO_ENV}={value!r}: {', '.join(map(repr, wrong))} not attention impls; give a "
                     f"comma-separated list of {IMPLS[1:]} (or unset it for {','.join(HOPPER_AUTO)})")
  return routes


def _applies(impl: str, q, k, mask_kind: str) -> bool:
  """Whether `impl` takes this case on a GPU (shapes, mask kind, installed libraries)."""
  if mask_kind in _OWN_KERNEL_ONLY and impl in (*_RANGE_IMPLS, "cudnn_packed"):
    return False
  if impl == "pallas":
    return pallas_gpu.supports(q, k)
  if impl == "tokamax":
    return tokamax_gpu.available() and q.dtype in (jnp.bfloat16, jnp.float16)
  if impl == "tokamax_fwd":
    return _applies("tokamax", q, k, mask_kind) and pallas_gpu.supports(q, k)
  if impl == "mosaic":
    return _applies("tokamax", q, k, mask_kind) and _applies("mosaic_own", q, k, mask_kind)
  if impl == "mosaic_own":
    return (mosaic_backward.available() is None and q.dtype in (jnp.bfloat16, jnp.float16)
            and mosaic_backward.head_dim_fits(q.shape[-1]))
  if impl == "cudnn_packed":
    return (mask_kind in cudnn_packed.MASK_KINDS and q.shape[1] == k.shape[1]
            and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0 and q.dtype in (jnp.bfloat16, jnp.float16))
  return impl in ("xla", "reference", "cudnn")


def choose_impl(q, k, impl: str = "auto", mask_kind: str = "bidirectional") -> str:
  """The implementation `impl` resolves to for these operands on the current backend."""
  if impl not in IMPLS:
    raise ValueError(f"attention impl={impl!r} is not one of {IMPLS}")
  if impl == "auto":
    impl = _SCOPED_IMPL.get()
  if impl != "auto":
    return impl
  if platform.on_gpu():
    if _hopper():
      chosen = next((impl for impl in hopper_auto() if _applies(impl, q, k, mask_kind)), None)
      if chosen:
        return chosen
    return "pallas" if pallas_gpu.supports(q, k) else "xla"
  return "reference" if q.shape[1] * k.shape[1] <= _TINY_PAIRS else "xla"


def _external_attention(impl, q, k, v, mask_kind: str, mask_kwargs: dict, scale: float,
                        block_sizes, interpret, tokamax_config):
  """tokamax or cuDNN packed where the rows are packed, ejax's own kernel for any other batch."""
  batch, q_len, _, _ = q.shape
  kv_len = k.shape[1]
  on_gpu = platform.on_gpu()
  if mask_kind in _OWN_KERNEL_ONLY:
    raise ValueError(f"attention impl={impl!r} does not take mask_kind={mask_kind!r} (each query's keys "
                     "are two ranges); use impl='auto', 'pallas' or 'xla'")
  if impl == "cudnn_packed":
    if not on_gpu:
      raise ValueError(f"attention impl='cudnn_packed' needs a GPU, the backend is "
                       f"{platform.target_backend()!r}; use impl='auto'")
    if not _applies(impl, q, k, mask_kind):
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
      raise ValueError(f"attention impl='tokamax_fwd' runs ejax's Pallas backward, which needs head_dim in "
                       f"{pallas_gpu.SUPPORTED_HEAD_DIMS}, got {q.shape[-1]}; use impl='auto'")
    ranges = intervals.key_ranges(mask, ordered)
    valid = ranges.valid
    blocks = (block_sizes or (GPU_BLOCK_SIZES if on_gpu else CPU_BLOCK_SIZES)).fitted(q_len, kv_len)
    plan = _Plan("pallas" if on_gpu else "xla", ordered, scale, blocks, False)
    fast = lambda q, k, v: _ranged(plan, (tokamax_config, on_gpu, "ejax"), q, k, v, ranges.k_start,
                                   ranges.k_end, ranges.has_keys, *mask)
  elif impl in _MOSAIC_BACKWARD_IMPLS:
    if not _applies(impl, q, k, mask_kind):
      missing = mosaic_backward.available()
      raise ValueError(f"attention impl={impl!r}: {missing}; use impl='auto'" if missing else
                       f"attention impl={impl!r} runs Mosaic GPU kernels that take bf16/f16 and head_dim "
                       f"up to {mosaic_backward.MAX_HEAD_DIM}, got {q.dtype} and {q.shape[-1]}; use impl='auto'")
    ranges = intervals.key_ranges(mask, ordered)
    valid = ranges.valid
    plan = _Plan("mosaic", ordered, scale, CPU_BLOCK_SIZES, False)
    fast = lambda q, k, v: _ranged(plan, (tokamax_config, on_gpu, impl), q, k, v, ranges.k_start,
                                   ranges.k_end, ranges.has_keys, *mask)
  else:
    segments = intervals.packed_segments(mask, ordered, cudnn_packed.MAX_SEGMENTS)
    valid = segments.valid
    fast = lambda q, k, v: cudnn_packed.attention(q, k, v, segments, scale=scale, causal=ordered)
  if _UNCHECKED.get():
    return _poisoned(fast(q, k, v), valid)
  fallback = "pallas" if on_gpu and pallas_gpu.supports(q, k) else "xla"
  exact = functools.partial(flash_attention, scale=scale, impl=fallback, block_sizes=block_sizes,
                            interpret=interpret, **mask_kwargs)
  return jax.lax.cond(valid, fast, exact, q, k, v)


def _cudnn_takes_unmasked(q, k, mask_kind: str, mask_kwargs: dict) -> bool:
  """Whether "auto" gives this call to cuDNN's fused attention: on a GPU, a call with no mask at all
  (SigLIP's patches, GR00T's DiT self-attention over one sample's tokens) whose head size cuDNN takes
  as it is (a multiple of 8 up to 128: SigLIP's 72, the DiT's 48), where ejax's and tokamax's kernels
  would run it zero-padded to 128 and 64, and a cuDNN that jax can use is installed. Odd lengths
  are padded to even ones first (_cudnn_unmasked)."""
  if (mask_kind != "bidirectional" or any(value is not None for name, value in mask_kwargs.items() if name != "mask_kind")
      or q.dtype not in (jnp.bfloat16, jnp.float16) or q.shape[-1] % 8 or q.shape[-1] > 128
      or not platform.on_gpu()):
    return False
  try:
    from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
    check_cudnn_version()
  except Exception:  # no cuDNN (a CPU-only jaxlib lowering for a GPU), or one jax cannot use
    return False
  return True


def _cudnn_unmasked(q, k, v, scale: float):
  """cuDNN attention over every key, lengths padded to even ones: jax's cuDNN attention refuses to
  train on an odd length (its training check counts the empty bias it passes as a bias; jax 0.11.2),
  and under jax.checkpoint it says so only when the backward is traced, where no fallback can catch it
  (DreamZero's 257 image tokens, rematerialised). A padded query row is cut off again; a padded key is
  masked out, which makes the call a masked one (a [1, 1, q, k] bias: GR00T's DiT runs 49 tokens)."""
  q_len, kv_len = q.shape[1], k.shape[1]
  even = lambda x, n: jnp.pad(x, [(0, 0), (0, 1), (0, 0), (0, 0)]) if n % 2 else x
  mask = None
  if kv_len % 2:
    mask = jnp.broadcast_to(jnp.arange(kv_len + 1) < kv_len, (1, 1, q_len + q_len % 2, kv_len + 1))
  out = jax.nn.dot_product_attention(even(q, q_len), even(k, kv_len), even(v, kv_len), mask=mask, scale=scale,
                                     implementation="cudnn")
  return out[:, :q_len]


def _kernel_head_dim(q, impl: str) -> int:
  """The head size the GPU kernels run `q` at: its own, or the next one they support when the call
  would take a GPU kernel (impl pallas / tokamax / tokamax_fwd / mosaic / mosaic_own, or auto on a GPU) and they
  lack it. The Mosaic GPU backward takes multiples of 64 (128-byte swizzled rows)."""
  head_dim = q.shape[-1]
  impl = _SCOPED_IMPL.get() if impl == "auto" else impl  # a model's attention_impl (default_impl)
  wants_kernel = impl in ("pallas", *_RANGE_IMPLS) or (impl == "auto" and platform.on_gpu())
  if not wants_kernel or head_dim > pallas_gpu.SUPPORTED_HEAD_DIMS[-1] or not jnp.issubdtype(q.dtype, jnp.floating):
    return head_dim
  sizes = (64, mosaic_backward.MAX_HEAD_DIM) if impl in _MOSAIC_BACKWARD_IMPLS else pallas_gpu.SUPPORTED_HEAD_DIMS
  return next((d for d in sizes if d >= head_dim), head_dim)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    mask_kind: str = "bidirectional",
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    q_block_ids: jax.Array | None = None,
    kv_block_ids: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "auto",
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    tokamax_config=None,
) -> jax.Array:
  """`attention` with the tuning knobs exposed: tile sizes and launch settings, Pallas interpret
  mode, and a tokamax kernel config (`tokamax_gpu.sm90_config`; None: tokamax's heuristics)."""
  batch, q_len, q_heads, head_dim = q.shape
  _, kv_len, kv_heads, _ = k.shape
  if mask_kind not in MASK_KINDS:
    raise ValueError(f"attention mask_kind={mask_kind!r} is not one of {MASK_KINDS}")
  if q_heads % kv_heads:
    raise ValueError(f"attention: q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
  if k.shape != v.shape or k.shape[0] != batch or k.shape[-1] != head_dim:
    raise ValueError(f"attention: k {k.shape} and v {v.shape} must match each other and q {q.shape} "
                     "in batch and head_dim")
  mask_kwargs = dict(mask_kind=mask_kind, q_segment_ids=q_segment_ids,
                     kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                     kv_positions=kv_positions, q_block_ids=q_block_ids, kv_block_ids=kv_block_ids)
  scale = float(head_dim**-0.5 if scale is None else scale)
  if (_SCOPED_IMPL.get() if impl == "auto" else impl) == "auto" and _cudnn_takes_unmasked(q, k, mask_kind, mask_kwargs):
    try:
      return _cudnn_unmasked(q, k.astype(q.dtype), v.astype(q.dtype), scale)
    except (ValueError, NotImplementedError, RuntimeError):
      pass  # a shape this cuDNN refuses while tracing: the kernels below take it
  padded = _kernel_head_dim(q, impl)
  if padded != head_dim:
    # SigLIP's 72-wide and GR00T's DiT's 48-wide heads: the GPU kernels take power-of-two head sizes,
    # and the XLA path's tile loops launch small kernels per tile on a GPU. Zero columns change no
    # score and give zero output columns, so the padded heads compute the same attention.
    widen = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, padded - head_dim)])
    out = flash_attention(widen(q), widen(k), widen(v), scale=scale, impl=impl, block_sizes=block_sizes,
                          interpret=interpret, tokamax_config=tokamax_config, **mask_kwargs)
    return out[..., :head_dim]
  impl = choose_impl(q, k, impl, mask_kind)
  if impl == "reference":
    return attention_reference(q, k, v, scale=scale, **mask_kwargs)
  if impl == "cudnn":
    return _cudnn_attention(q, k, v, scale, **mask_kwargs)
  if impl in (*_RANGE_IMPLS, "cudnn_packed"):
    return _external_attention(impl, q, k, v, mask_kind, mask_kwargs, scale, block_sizes, interpret,
                               tokamax_config)
  if impl == "pallas" and not pallas_gpu.supports(q, k):
    raise ValueError(f"attention impl='pallas' needs head_dim in {pallas_gpu.SUPPORTED_HEAD_DIMS} "
                     f"and a float dtype, got head_dim={head_dim} {q.dtype}; use impl='auto'")

  mask, ordered = normalise_mask(batch, q_len, kv_len, mask_kind, q_segment_ids, kv_segment_ids,
                                 q_positions, kv_positions, q_block_ids, kv_block_ids)
  on_gpu = platform.on_gpu()
  if block_sizes is None:
    if impl == "pallas":
      block_sizes = GPU_BLOCK_SIZES
    else:
      block_sizes = XLA_GPU_BLOCK_SIZES if on_gpu else CPU_BLOCK_SIZES
  blocks = block_sizes.fitted(q_len, kv_len)
  interpret = (not on_gpu) if interpret is None else interpret
  plan = _Plan(impl, ordered, scale, blocks, bool(interpret and impl == "pallas"))
  k, v = k.astype(q.dtype), v.astype(q.dtype)
  q_p, k_p, v_p, mask_p = pad_to_blocks(q, k, v, mask, blocks)
  out = _blockwise(plan, q_p, k_p, v_p, *mask_p)
  return out[:, :q_len]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    mask_kind: str = "bidirectional",
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    q_block_ids: jax.Array | None = None,
    kv_block_ids: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> jax.Array:
  """Attention with segment ids (0 = padding), a mask kind and grouped kv heads.

  q [batch, q_len, q_heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim]. The semantics are
  reference.py's; `impl` picks the implementation (module docstring). Returns q's shape and dtype.
  """
  rows = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
              kv_positions=kv_positions, q_block_ids=q_block_ids, kv_block_ids=kv_block_ids)
  rows = {name: value for name, value in rows.items() if value is not None}
  run = functools.partial(flash_attention, mask_kind=mask_kind, scale=scale, impl=impl)
  return _per_shard(lambda q, k, v, rows: run(q, k, v, **rows), q, k, v, rows)


def _four(spec: P) -> tuple:
  return tuple(spec) + (None,) * (4 - len(spec))


def _per_shard(run, q, k, v, rows):
  """run(q, k, v, rows) on each device's rows (and heads) when a sharding context is active.

  Attention is independent per batch row, but neither its loops (the XLA path's data-dependent
  tile loops) nor its custom calls (Pallas, cuDNN) say so to XLA's SPMD partitioner, which then
  gathers q, k and v of the whole global batch onto every device and computes all of it there.
  Under jax.shard_map each device attends its own rows: batch over the ACT_BATCH mesh axes, heads
  over ACT_HEADS's where both q's and k's head counts split (k and v stay whole for one kv head).
  """
  context = current_context()
  if context is None:
    return run(q, k, v, rows)
  mesh, rules = context
  names = (ACT_BATCH, None, ACT_HEADS, None)
  q_spec = _four(logical_to_spec(names, rules, shape=q.shape, mesh=mesh))
  k_spec = _four(logical_to_spec(names, rules, shape=k.shape, mesh=mesh))
  heads = kv_heads = q_spec[2]
  if k.shape[2] == 1:
    kv_heads = None  # one kv head (MQA): every device's query heads read it whole
  elif k_spec[2] != heads:
    heads = kv_heads = None  # grouped heads that do not split alike: keep the heads whole
  q_spec = (q_spec[0], None, heads, None)
  kv_spec = (q_spec[0], None, kv_heads, None)
  if q_spec == (None,) * 4:
    return run(q, k, v, rows)
  body = run
  if heads is not None and kv_heads is None:
    # Every device's query heads read the one kv head: typed as varying over the head axes, its
    # gradient is summed over them on the way back (the transpose of the cast is a psum).
    head_axes = (heads,) if isinstance(heads, str) else tuple(heads)

    def body(q, k, v, rows):
      cast = lambda x: jax.lax.pcast(x, head_axes, to="varying")
      return run(q, cast(k), cast(v), rows)

  row_spec = P(q_spec[0])
  return jax.shard_map(body, mesh=mesh, in_specs=(P(*q_spec), P(*kv_spec), P(*kv_spec), {n: row_spec for n in rows}),
                       out_specs=P(*q_spec))(q, k, v, rows)
