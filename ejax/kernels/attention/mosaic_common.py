"""What ejax's Mosaic GPU attention kernels share (mosaic_forward.py, mosaic_backward.py).

Their layout: a warpgroup issues the TMA copies and compute warpgroups of 64 rows do the wgmmas. A CTA
runs one work item (a tile of rows of one head and batch row), or, persistent, one CTA an SM loops
over the work items round-robin. The copying warpgroup loads each item's own tiles into one of two
buffers and streams the other operand through a ring of `stages` shared-memory slots, both carried
from one item to the next. Here: the loop over items, the ring's and the buffers' copying loops, the
kv tile spans the loops are bounded by (computed in XLA from each query's key range), the kernel
settings and the matmul helper that interpret mode can run.
"""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax

from ejax.kernels import platform

LENGTH_MULTIPLE = 128  # q_len and kv_len: whole CTA tiles of the kernels (routes.py pads to it)
MEMORY_REGISTERS = 40  # a thread of the copying warpgroup (setmaxnreg); the compute ones share the rest
SMEM_BYTES = 227 * 1024  # an H100's / H200's shared memory a CTA
# Kept free beside the tiles for barriers and buffers aligned to 1 KB: a 6-slot forward ring at head
# size 128 came to 2.8 KB more than its tiles, 248 bytes over a CTA's shared memory.
SMEM_SLACK = 4 * 1024
H100_SMS = 132  # an H100's / H200's SMs: a persistent kernel's CTAs when lowered off a GPU
LOG2E = math.log2(math.e)
# The ring's slots at most (the deepest that fits shared memory is taken up to this). A ring step's
# copy for step i + stages is issued once step i's slot is freed, so the ring hides a copy's latency
# (~1-2 us from L2 or HBM under load) only if stages - 1 steps take longer: a 64-key step of the
# forward's two warpgroups is ~0.56 us of an H200 SM's tensor cores.
MAX_STAGES = 6
# Registers bound the head size first: a dK/dV warpgroup holds two f32 [64, head_dim] accumulators and
# two f32 [64, 64] score tiles: 192 of its 256 registers a thread at 128, all 256 at 192.
MAX_HEAD_DIM = 128
# Mosaic GPU's on-device profiler (`benchmarks/attention.py --profile_kernel`). Where PROFILE_DIR is set,
# the kernels built on a GPU record the clock at the start and end of each of their named scopes
# (jax.named_scope), a warpgroup's first PROFILE_SCOPES of them (later ones dropped), and each call
# dumps them to that folder as a Perfetto trace. Their buffer takes shared memory from the rings.
PROFILE_DIR: str | None = None
PROFILE_SCOPES = 256  # the benchmark's VLA rows: up to 27 steps of 8 scopes a CTA
MAX_WARPGROUPS = 3  # the most a kernel here has (two compute and the copying one)


# Whether a kernel's wgmma operands held in registers across its loop (the forward's Q; with
# mosaic_backward.OPERANDS_IN_REGISTERS the backward's Q and dO, or K) are loaded from shared memory again
# every step instead of once an item (None: in the forms whose SASS needs it, reloads_operands).
# jaxlib 0.11.2's ptxas (compile-only H100) gives registers that hold such an operand to a value the
# step computes after it, in the forward's softmax weights' case at head size 64 and at head size 128
# with 128-key tiles, and in the backward's forms at 64 (the PTX keeps them apart): from an item's second
# step on, the wgmma reads that value instead. That was the forward's errors of 0.84-0.88 at head size
# 64 and the wrong gradients of its 128-key tiles on two H200s (BENCHMARKS.md). A value loaded in the
# step is not live across it, so there is nothing to overwrite. tests/kernels/test_attention_mosaic.py
# checks every form's SASS (tests/kernels/sass.py).
RELOAD_OPERANDS: bool | None = None


def at_head_dim(setting, head_dim: int | None):
  """A kernel setting's value at a head size: a dict maps head sizes to values (its None entry: every
  other head size); any other setting is its own value at every head size."""
  if isinstance(setting, dict):
    return setting[head_dim] if head_dim in setting else setting[None]
  return setting


def reloads_operands(head_dim: int, block_kv: int = 64) -> bool:
  """Whether operands held in registers are loaded every step (RELOAD_OPERANDS, else where the SASS of
  the load-once form has ptxas overwrite them: head size 64, or 128-key tiles)."""
  return RELOAD_OPERANDS if RELOAD_OPERANDS is not None else head_dim == 64 or block_kv > 64


def compute_registers(compute_wgs: int) -> int:
  """Registers a compute thread raises itself to: the SM's 64K over 128-thread warpgroups, less the
  copying warpgroup's, shared out, at most 256, in steps of 8 (as jax's warp-specialized pipeline)."""
  return int(min(256, (512 - MEMORY_REGISTERS) / compute_wgs) // 8 * 8)


def available() -> str | None:
  """None where this jax has Pallas Mosaic GPU with interpret mode, else why not."""
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: F401
    plgpu.InterpretGPUParams  # noqa: B018 (jax >= 0.11)
    plgpu.broadcasted_iota  # noqa: B018
  except (ImportError, AttributeError) as error:
    return f"Pallas Mosaic GPU (jax >= 0.11) is missing here: {type(error).__name__}: {error}"
  return None


def _key_spans(k_start, k_end, tile_q: int):
  """Per tile of tile_q queries: the least start and the greatest end of their ranges, in keys (queries
  with an empty range left out; an all-empty tile gives hi 0)."""
  batch = k_start.shape[0]
  nonempty = k_end > k_start
  lo = jnp.where(nonempty, k_start, jnp.iinfo(jnp.int32).max).reshape(batch, -1, tile_q).min(-1)
  return lo, jnp.where(nonempty, k_end, 0).reshape(batch, -1, tile_q).max(-1)


def kv_spans(k_start, k_end, tile_q: int, block_kv: int):
  """Loop bounds [lo, hi) in kv tiles of block_kv keys, int32 [batch, q_len // tile_q]: the tiles the
  ranges of each tile_q queries touch (one span; 0, 0 where none). Any query layout is right; on packed
  rows the span is tight."""
  lo, hi = _key_spans(k_start, k_end, tile_q)
  return (jnp.where(hi > 0, lo // block_kv, 0).astype(jnp.int32),
          jnp.where(hi > 0, -(-hi // block_kv), 0).astype(jnp.int32))


def inner_ranges(k_start, k_end, block_q: int):
  """Per block of block_q queries, int32 [batch, q_len // block_q]: keys [inner_lo, inner_hi) lie in
  every one of its queries' ranges, so a tile inside them needs no element-wise mask (most tiles of
  long segments). A query with no key empties it."""
  batch = k_start.shape[0]
  return (k_start.reshape(batch, -1, block_q).max(-1).astype(jnp.int32),
          k_end.reshape(batch, -1, block_q).min(-1).astype(jnp.int32))


def own_buffers(persistent: bool) -> int:
  """Buffers of a work item's own tiles: two when persistent (the next item's copied during the last
  one's compute), else one (a CTA runs one item)."""
  return 2 if persistent else 1


def ring_stages(fixed_bytes: int, stage_bytes: int, stages: int | None = None) -> int:
  """`stages`, or where None the deepest ring that fits a CTA's shared memory beside `fixed_bytes`, at
  most MAX_STAGES (0 where not even one slot fits)."""
  if stages is not None:
    return stages
  free = SMEM_BYTES - SMEM_SLACK - profile_bytes() - fixed_bytes
  return int(max(0, min(MAX_STAGES, free // stage_bytes)))


# A phase of a kernel, named (jax.named_scope): Mosaic GPU's on-device profiler times each where it is
# on (PROFILE_DIR); otherwise the names only label the code (the SASS is the same).
scope = jax.named_scope


def profile_bytes() -> int:
  """Shared memory the on-device profiler's buffer takes (0 unless PROFILE_DIR is set): a scope's start
  and end, each a tag and a clock of 4 bytes, for each warpgroup."""
  return 0 if PROFILE_DIR is None else MAX_WARPGROUPS * PROFILE_SCOPES * 2 * 2 * 4


def kernel_params(interpret: bool) -> tuple[dict, str, str]:
  """(plgpu.kernel keyword arguments, the output's and the scratch's keyword names) of ejax's Mosaic GPU
  kernels. jax 0.11 says out_type / scratch_types, 0.9 out_shape / scratch_shapes (with 0.9's CUDA
  plugin the kernels build into a program for a compile-only H100 here)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  options = dict(approx_math=True)
  if PROFILE_DIR is not None and not interpret:
    if "profile_bounds_check" not in inspect.signature(plgpu.CompilerParams).parameters:
      raise ValueError("mosaic_common.PROFILE_DIR: the kernel profile needs jax >= 0.11 (profile_bounds_check); "
                       "unset PROFILE_DIR or upgrade jax")
    options.update(profile_space=PROFILE_SCOPES, profile_dir=PROFILE_DIR, profile_bounds_check=True)
  params = dict(compiler_params=plgpu.CompilerParams(**options), thread_name="wg")
  if interpret:
    params["interpret"] = plgpu.InterpretGPUParams()
  new_names = "out_type" in inspect.signature(plgpu.kernel).parameters
  return (params,) + (("out_type", "scratch_types") if new_names else ("out_shape", "scratch_shapes"))


def load(ref, layout, optimized: bool = True):
  """The whole of `ref` into registers in `layout` (plgpu.load): jax 0.11 takes an index after the ref
  (`()`: all of it), jax 0.12 takes the ref alone (index it with .at first)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, (), layout=layout, optimized=optimized)
  return plgpu.load(ref, layout=layout, optimized=optimized)


def register_operand(ref, layout, held: bool, reload: bool):
  """A wgmma's A operand over an item's steps, as a function a step calls: `ref` itself (shared memory,
  SS), or with `held` its fragments in registers (RS), loaded once here or, with `reload`, in each step
  (reloads_operands)."""
  once = load(ref, layout) if held and not reload else ref
  return (lambda: load(ref, layout)) if held and reload else (lambda: once)


def mma(acc, lhs, rhs, interpret: bool, meanwhile=None):
  """acc + lhs @ rhs (lhs in registers, rhs in shared memory; acc None: the product alone, f32) on the
  tensor cores, waited for. `meanwhile()`, if given, runs after the wgmma is issued and before it is
  waited for (a barrier wait for the next step's operand, as jax's Mosaic GPU attention example does).
  Interpret mode runs neither a register operand nor an accumulator-initialised wgmma (run_state), so
  there the same sum is a dot of the values."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  if interpret:
    if meanwhile is not None:
      meanwhile()
    product = jnp.dot(lhs, rhs[...], preferred_element_type=jnp.float32)
    return product if acc is None else acc + product

  def accumulate(ref):
    plgpu.wgmma(ref, lhs, rhs)
    if meanwhile is not None:
      meanwhile()
    return ref[...] if acc is None else None

  if acc is None:  # a fresh accumulator, zero-initialised by the wgmma itself; read waits for it
    return pl.run_scoped(accumulate, plgpu.ACC((lhs.shape[0], rhs.shape[1]), jnp.float32))
  return pl.run_state(accumulate)(plgpu.ACC.init(acc))  # waits for the wgmma before it returns


def wgmma_wait_after(work_done, pending: int = 0):
  """Wait until at most `pending` wgmma groups are in flight, scheduled after the work in program order
  before it. ptxas moves a wgmma.wait_group, which has no operands, up to the top of its basic block,
  ahead of work written to run while the wgmmas do (the SASS, compile-only H100: the forward's wait for
  the PV before the softmax's row maxima). A wait behind a branch it cannot decide stays below the work.
  `work_done`: a runtime boolean ptxas cannot know (true in practice); correctness does not rest on it:
  the caller's own wait, unconditional, follows (a wgmma accumulator's read, say)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  @pl.when(work_done)
  def _():
    plgpu.wgmma_wait(pending)


# The hardware named barrier (bar.sync) two compute warpgroups may take turns at: Mosaic GPU itself syncs
# on barrier 0 (the CTA) and 1 + a warpgroup's index (its warpgroup), of the SM's 16.
TURN_BARRIER = 15


def named_barrier_sync(barrier: int, threads: int):
  """bar.sync: wait until `threads` threads (this warpgroup's among them) have reached hardware barrier
  `barrier`: a rendezvous of warpgroups with no shared-memory barrier to arrive on and poll (FlashAttention-3's
  turns). A GPU only: Mosaic GPU's interpret mode runs no inline PTX."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax.experimental.pallas import mosaic_gpu as plgpu

  @plgpu.inline_mgpu()
  def sync(ctx):
    del ctx
    mgpu_utils.inline_ptx(f"bar.sync {barrier}, {threads};", has_side_effects=True)

  sync()


def mma_pair(accs, lhss, rhss, interpret: bool):
  """(acc + lhs @ rhs for each of the two), both wgmmas issued before either is waited for, then waited
  for together (mma's operands: lhs in registers, rhs in shared memory; interpret mode: dots)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  if interpret:
    return tuple(acc + jnp.dot(lhs, rhs[...], preferred_element_type=jnp.float32)
                 for acc, lhs, rhs in zip(accs, lhss, rhss, strict=True))

  def both(refs):
    for ref, lhs, rhs in zip(refs, lhss, rhss, strict=True):
      plgpu.wgmma(ref, lhs, rhs)
    plgpu.wgmma_wait(0)

  return pl.run_state(both)(tuple(plgpu.ACC.init(acc) for acc in accs))


def persistent_ctas(num_items: int, persistent: bool, ctas: int | None = None) -> int:
  """CTAs of a kernel over `num_items` work items: one an item, or persistent, one an SM (or `ctas`)
  each looping over items round-robin."""
  if not persistent:
    return num_items
  if ctas is None:
    device = jax.devices()[0]
    ctas = int(getattr(device, "core_count", 0) or H100_SMS) if platform.on_gpu() else H100_SMS
  return min(num_items, ctas)


def item_part(lo_ref, hi_ref, b, item, j, wg, wgs: int, rows: int):
  """A compute warpgroup's part of work item `item` (row tile of batch row b, the CTA's j-th item):
  (the item's first ring tile, how many it streams, the warpgroup's block index, its `rows` rows as a
  pl.ds, its buffer of the item's own tiles, double-buffered by j; a kernel of a CTA an item has j 0
  and one buffer)."""
  from jax.experimental import pallas as pl
  lo = lo_ref[b, item]
  block = item * wgs + wg
  return lo, hi_ref[b, item] - lo, block, pl.ds(block * rows, rows), lax.rem(j, 2) * wgs + wg


def work_items(items: tuple, lo_ref, hi_ref, body):
  """body(h, t, b, j, g) for each of this CTA's work items (h, t, b) of the grid `items` (heads, tiles,
  batch), over the launch axis "ctas" (plgpu.nd_loop). j counts the CTA's items (a double-buffered
  operand uses buffer j % 2), g the ring steps before the item (its step i uses slot (g + i) % stages);
  an item's steps are hi_ref[b, t] - lo_ref[b, t]. Returns (items, steps) done."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def loop_body(info, carry):
    (h, t, b), (j, g) = info.index, carry
    body(h, t, b, j, g)
    return j + 1, g + hi_ref[b, t] - lo_ref[b, t]

  return plgpu.nd_loop(items, collective_axes="ctas", init_carry=(jnp.int32(0), jnp.int32(0)))(loop_body)


def copying_warpgroup(items: tuple, lo_ref, hi_ref, own, ring, buffer_free, ring_frees, stages: int):
  """A kernel's copying warpgroup over this CTA's work items (work_items). For item j (h, t, b) (in
  named scopes for the on-device profiler: "own", each ring copy's "wait_free"):
  - its own tiles into buffer j % 2 once the item two before has freed it (an arrive on `buffer_free`
    there): the (source, destination, barrier) TMA copies of own(h, t, b, half);
  - its ring steps, step i in slot (g + i) % stages: the copies of ring(h, t, b, lo_ref[b, t] + i, slot),
    the n-th once the compute warpgroups have freed its slot (an arrive on the n-th of `ring_frees`);
  then the frees not waited for yet (the last two buffers', the last slots'), so every barrier phase is
  observed by each thread that waits on it, which Mosaic GPU's interpret mode checks."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def copy(copies):
    for source, destination, barrier in copies:
      plgpu.copy_gmem_to_smem(source, destination, barrier)

  def item(h, t, b, j, g):
    with scope("own"):
      pl.when(j >= 2)(lambda: plgpu.barrier_wait(buffer_free.at[lax.rem(j, 2)]))
      copy(own(h, t, b, lax.rem(j, 2)))
    lo = lo_ref[b, t]

    @pl.loop(0, hi_ref[b, t] - lo)
    def _fetch(i):
      slot = lax.rem(g + i, stages)

      # Each copy waits only for its own free: K's slot is refilled once K is read, not after V too.
      for free, one in zip(ring_frees, ring(h, t, b, lo + i, slot), strict=True):
        with scope("wait_free"):
          pl.when(g + i >= stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
        copy([one])

  plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
  items_done, steps_done = work_items(items, lo_ref, hi_ref, item)
  pl.loop(lax.max(items_done - 2, 0), items_done)(
      lambda j: plgpu.barrier_wait(buffer_free.at[lax.rem(j, 2)]))

  @pl.loop(lax.max(steps_done - stages, 0), steps_done)
  def _ring(t):
    for free in ring_frees:
      plgpu.barrier_wait(free.at[lax.rem(t, stages)])


def kv_ring(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, groups: int, block_kv: int):
  """ring(h, t, b, tile, slot) of copying_warpgroup for kernels that stream K and V (the forward, dQ):
  kv tile `tile` of the kv head that q head h reads."""
  from jax.experimental import pallas as pl

  def ring(h, t, b, tile, slot):
    keys, hk = pl.ds(tile * block_kv, block_kv), lax.div(h, jnp.array(groups, h.dtype))
    return [(k_ref.at[b, keys, hk], k_smem.at[slot], k_bar.at[slot]),
            (v_ref.at[b, keys, hk], v_smem.at[slot], v_bar.at[slot])]

  return ring


def store_item(copies, free, j):
  """A compute warpgroup's end of item j: its results, written to shared memory, go out by TMA (the
  (source, destination) `copies`); once they are read, buffer j % 2 is freed for a later item."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  plgpu.commit_smem()
  for source, destination in copies:
    plgpu.copy_smem_to_gmem(source, destination)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  plgpu.barrier_arrive(free.at[lax.rem(j, 2)])
