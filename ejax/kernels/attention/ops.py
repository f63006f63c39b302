"""ejax's attention op: one signature, several implementations, gradients through custom_vjp.

impl:
- "reference": the dense jnp specification (reference.py); autodiff gives its gradients.
- "xla": blockwise online softmax in plain XLA that loops only over active tiles (xla.py; blockwise.py
  puts it and the Pallas kernel behind one custom_vjp); the CPU path and the GPU fallback. Memory is
  one tile of scores, cost follows segment lengths.
- "pallas": the Pallas/Triton varlen flash kernel (pallas_gpu.py). On a backend other than GPU it
  runs in interpret mode (slow; for tests).
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` with the dense mask (cudnn.py); GPU
  only, and only where cuDNN accepts the case (it raises otherwise).
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
  unconditionally and such a batch gives NaN. routes.py holds the five.
- "auto": on a GPU, a call with no mask at all goes to cuDNN where it takes the head size unpadded
  (cudnn.takes_unmasked); any other on a Hopper GPU to the first of `HOPPER_AUTO` that applies (a route
  may be limited to head sizes, "mosaic_own@128"), else pallas on GPU when the kernel supports the
  shapes, else xla (EJAX_HOPPER_AUTO replaces that list);
  dense reference for tiny shapes off GPU, where loop overhead would dominate.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ejax.kernels import platform
from ejax.kernels.attention import blockwise, cudnn, mosaic_backward, pallas_gpu, routes
from ejax.kernels.attention.reference import MASK_KINDS, attention_reference
from ejax.kernels.attention.tiles import (CPU_BLOCK_SIZES, GPU_BLOCK_SIZES, XLA_GPU_BLOCK_SIZES, BlockSizes,
                                          normalise_mask, pad_to_blocks)
from ejax.parallel.axes import ACT_BATCH, ACT_HEADS
from ejax.parallel.rules import current_context, logical_to_spec

IMPLS = ("auto", "reference", "xla", "pallas", "cudnn", "tokamax", "tokamax_fwd", "mosaic", "mosaic_own",
         "cudnn_packed")
# What "auto" runs on a Hopper GPU (compute capability 9.x): the first of these that applies (else
# "pallas"), ordered by benchmarks/attention.py's TFLOP/s at 8 x 4,096 tokens, 16 heads x 128
# (BENCHMARKS.md): on an H200 forward / forward+backward mosaic_own 276-283 / 212 (2026-12-04 evening,
# calls back to back; mosaic 188-193 / 192, pallas 67-68 / 81 there), tokamax_fwd 152 / 91 and tokamax
# 135 / 68 (2026-11-28). mosaic_own
# and mosaic take head sizes 64 and 128; pi0.5's 256 goes on to tokamax_fwd. A route "impl@128"
# applies at head size 128 only ("impl@64+128": either). mosaic_own was wrong at head size 64 on two
# H200s (2026-11-30): ptxas gave the softmax weights Q's registers; with Q loaded every step there
# (mosaic_common.RELOAD_OPERANDS) an H200 found it right at 64 on 2026-12-04 (errors 2.8e-3, the
# load-once control 0.86-0.88), so it takes every head size. Its speed at 64 against mosaic's is
# unmeasured.
HOPPER_AUTO = ("mosaic_own", "mosaic", "tokamax_fwd")
# EJAX_HOPPER_AUTO="tokamax_fwd,pallas" (say) replaces HOPPER_AUTO in this process: a route that fails
# on some machine (benchmarks/gpu.py checks each before its figures) is left out without an edit.
HOPPER_AUTO_ENV = "EJAX_HOPPER_AUTO"


def parse_route(route: str) -> tuple[str, tuple[int, ...]]:
  """(impl, the head sizes it is limited to, () for any) of a HOPPER_AUTO route "impl" or "impl@64+128".
  Raises ValueError naming the route if it is not one."""
  impl, qualified, sizes = route.strip().partition("@")
  try:
    head_dims = tuple(int(size) for size in sizes.split("+")) if qualified else ()
  except ValueError:
    head_dims = None
  if impl not in IMPLS or impl == "auto" or head_dims is None or (qualified and not head_dims):
    raise ValueError(f"attention route {route!r}: not an attention impl of {IMPLS[1:]}, optionally limited to "
                     "head sizes as impl@128 or impl@64+128")
  return impl, head_dims
# Below this many (query, key) pairs per head the dense reference is the fastest path off GPU.
_TINY_PAIRS = 256 * 256

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
  wrong = [route for route in routes if not _is_route(route)]
  if wrong:
    raise ValueError(f"{HOPPER_AUTO_ENV}={value!r}: {', '.join(map(repr, wrong))} not attention impls; give a "
                     f"comma-separated list of {IMPLS[1:]}, each optionally limited to head sizes as impl@128 "
                     f"(or unset it for {','.join(HOPPER_AUTO)})")
  return routes


def _is_route(route: str) -> bool:
  try:
    parse_route(route)
  except ValueError:
    return False
  return True


def _route_applies(route: str, q, k, mask_kind: str) -> bool:
  impl, head_dims = parse_route(route)
  return (not head_dims or q.shape[-1] in head_dims) and routes.applies(impl, q, k, mask_kind)


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
      chosen = next((route for route in hopper_auto() if _route_applies(route, q, k, mask_kind)), None)
      if chosen:
        return parse_route(chosen)[0]
    return "pallas" if pallas_gpu.supports(q, k) else "xla"
  return "reference" if q.shape[1] * k.shape[1] <= _TINY_PAIRS else "xla"


def _kernel_head_dim(q, impl: str) -> int:
  """The head size the GPU kernels run `q` at: its own, or the next one they support when the call
  would take a GPU kernel (impl pallas / tokamax / tokamax_fwd / mosaic / mosaic_own, or auto on a GPU) and they
  lack it. The Mosaic GPU backward takes multiples of 64 (128-byte swizzled rows)."""
  head_dim = q.shape[-1]
  impl = _SCOPED_IMPL.get() if impl == "auto" else impl  # a model's attention_impl (default_impl)
  wants_kernel = impl in ("pallas", *routes.RANGE_IMPLS) or (impl == "auto" and platform.on_gpu())
  if not wants_kernel or head_dim > pallas_gpu.SUPPORTED_HEAD_DIMS[-1] or not jnp.issubdtype(q.dtype, jnp.floating):
    return head_dim
  sizes = (64, mosaic_backward.MAX_HEAD_DIM) if impl in routes.MOSAIC_BACKWARD_IMPLS else pallas_gpu.SUPPORTED_HEAD_DIMS
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
  if (_SCOPED_IMPL.get() if impl == "auto" else impl) == "auto" and cudnn.takes_unmasked(q, k, mask_kind, mask_kwargs):
    try:
      return cudnn.unmasked(q, k.astype(q.dtype), v.astype(q.dtype), scale)
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
    return cudnn.dense(q, k, v, scale, **mask_kwargs)
  if impl in routes.PACKED_IMPLS:
    return routes.attention(impl, q, k, v, mask_kind, mask_kwargs, scale, block_sizes, interpret,
                            tokamax_config, exact_attention=flash_attention)
  if impl == "pallas" and not pallas_gpu.supports(q, k):
    need = platform.triton_missing() or (f"it needs head_dim in {pallas_gpu.SUPPORTED_HEAD_DIMS} and a float "
                                         f"dtype, got head_dim={head_dim} {q.dtype}")
    raise ValueError(f"attention impl='pallas': {need}; use impl='auto'")

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
  plan = blockwise.Plan(impl, ordered, scale, blocks, bool(interpret and impl == "pallas"))
  k, v = k.astype(q.dtype), v.astype(q.dtype)
  q_p, k_p, v_p, mask_p = pad_to_blocks(q, k, v, mask, blocks)
  out = blockwise.attention(plan, q_p, k_p, v_p, *mask_p)
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
