"""mosaic_own's variants and the checks of attention routes on a GPU (benchmarks/attention.py's figure,
--check, --check_variants and --profile_kernel).

Here: the VLA rows the figure and the checks run on; the Mosaic GPU kernels' module settings a variant
sets (read as a kernel traces, so each variant gets a program of its own) and the variants the figure
times, in order; the route check (values and gradients of a route against impl xla in fp32 over the
kinds of call a train step makes); the variant check (which of mosaic_own's code paths is right on a
GPU); the on-device profile of mosaic_own's kernels.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ejax.data.packing import pack_sequences
from ejax.kernels.attention import flash_attention, mosaic_backward, mosaic_common, mosaic_forward, ops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # benchmarks/ imports as a package from the repository root
  sys.path.insert(0, REPO)
from benchmarks import kernel_profile  # noqa: E402
from benchmarks.timing import back_to_back  # noqa: E402

# Settings of ejax's Mosaic GPU kernels beside their defaults, as (module, name, value), each one value
# at every head size. The defaults (2026-12-04; some by head size, mosaic_common.at_head_dim): a CTA a
# forward work item, its two compute warpgroups taking turns, rings as deep as shared memory allows; at
# head size 128 128-key forward tiles with Q from shared memory, the turns at a named barrier, two dK/dV
# warpgroups and the backward persistent; at 64 64-key tiles with Q in registers, mbarrier turns, one
# dK/dV warpgroup, a CTA a backward item.
RING_OF_2 = ((mosaic_forward, "STAGES", 2), (mosaic_backward, "STAGES", 2))
PERSISTENT = ((mosaic_forward, "PERSISTENT", True), (mosaic_backward, "PERSISTENT", True))
# The backward a CTA a work item at every head size: its default until 2026-12-01 (since then persistent
# at head size 128), timed beside it.
BACKWARD_PER_ITEM = ((mosaic_backward, "PERSISTENT", False),)
# dK/dV in two compute warpgroups, a work item of 128 keys: the streamed Q and dO tiles feed both, and one
# warpgroup's exp2 and mask run beside the other's wgmmas (168 registers, no spills; with WGMMA_PAIRS it
# spills 44 bytes a thread at head size 128, so the two are not timed together).
DKV_2 = ((mosaic_backward, "DKV_WGS", 2),)
DKV_1 = ((mosaic_backward, "DKV_WGS", 1),)
BACKWARD_RS = ((mosaic_backward, "OPERANDS_IN_REGISTERS", True),)  # the score wgmmas' own operands
# Each step's QK and the last PV issued together, the softmax between their waits; the warpgroups pass a
# token once a step (with PINGPONG False, no turns).
OVERLAP = ((mosaic_forward, "OVERLAP_SOFTMAX", True),)
ROW_SUM = ((mosaic_forward, "ROW_SUM_DEFERRED", True),)  # each step's row sums during the next step's QK
# The PV into a fresh accumulator, the running one rescaled after it (its 64 FMULs out of the softmax).
RESCALE = ((mosaic_forward, "RESCALE_AFTER_PV", True),)
NAMED = ((mosaic_forward, "NAMED_TURNS", True),)  # the turns at a hardware named barrier (bar.sync)
PAIRED = ((mosaic_backward, "WGMMA_PAIRS", True),)  # the backward's wgmmas two at a time (dQ's exp2 during dP)
# FlashAttention-3's forward tiles at head size 128: 128 keys a step, Q read by the scores' wgmma from shared
# memory (SS), P from registers. Half as many steps a row, so half the turns, waits and barrier round trips
# of 64-key steps, at 77 % useful pairs on the figure's rows against 84 % (mosaic_forward.visited_pairs).
# The SS form has no register A operand for ptxas to overwrite (the 128-key RS form's fault), 168
# registers, no spills (compile-only H100, 2026-12-02); with the named turns the default at head size 128
# since 2026-12-04.
WIDE = ((mosaic_forward, "BLOCK_KV", 128),)  # 128-key forward tiles (Q in registers unless set)
WIDE_SS = WIDE + ((mosaic_forward, "Q_IN_REGISTERS", False),)
# The forward's form at head size 128 before 2026-12-04 (and still at 64): 64-key tiles, Q in registers,
# the turns at an mbarrier.
FORM_64 = ((mosaic_forward, "BLOCK_KV", 64), (mosaic_forward, "Q_IN_REGISTERS", True),
           (mosaic_forward, "NAMED_TURNS", False))
# A span's first and last steps over the half of their 128-key tile its queries need (mosaic_forward.EDGE_HALVES):
# on the figure's rows 8 % fewer pairs computed, the 64-key tiles' 84 % useful at the 128-key tiles' steps.
EDGE = ((mosaic_forward, "EDGE_HALVES", True),)
# A tile crossing its queries' starts only, or their ends only, masked by that edge's compare alone
# (mosaic_forward.MASK_EACH_EDGE): 130 instructions a thread in the SASS against 261 for both edges.
EACH_EDGE = ((mosaic_forward, "MASK_EACH_EDGE", True),)
# In timing order, beside the defaults: first the form they replaced at head size 128 (the control: on the
# evening of 2026-12-04, timed back to back, 259-261 / 188-190 TFLOP/s against 276-283 / 212), then what no
# GPU has timed (each edge masked alone and the unneeded halves skipped, together, apart and in the
# persistent forward, whose next item's Q is copied during the last one: a quarter of a 128-key forward
# item was its start, end and passes in that evening's profile), then the variants that came closest on
# that evening, then the rest.
MOSAIC_OWN_VARIANTS = (("the form before 2026-12-04: 64-key tiles, Q in registers, mbarrier turns, dK/dV in 1 "
                        "warpgroup", FORM_64 + DKV_1),
                       ("each edge masked alone, 128-key tiles' unneeded halves skipped", EACH_EDGE + EDGE),
                       ("128-key tiles' unneeded halves skipped", EDGE),
                       ("each edge masked alone", EACH_EDGE),
                       ("each edge masked alone, unneeded halves skipped, persistent",
                        EACH_EDGE + EDGE + PERSISTENT[:1]),
                       ("persistent", PERSISTENT),
                       ("softmax beside its own PV, no turns", OVERLAP + ((mosaic_forward, "PINGPONG", False),)),
                       ("rings of 2 slots", RING_OF_2),
                       ("dK/dV in 1 warpgroup", DKV_1),
                       ("turns at an mbarrier", ((mosaic_forward, "NAMED_TURNS", False),)),
                       ("softmax beside its own PV", OVERLAP),
                       ("64-key tiles, Q in registers", FORM_64[:2]),
                       ("row sums during the next QK", ROW_SUM),
                       ("rescaled after the PV", RESCALE),
                       ("dK/dV in 1 warpgroup, its wgmmas in pairs", DKV_1 + PAIRED),
                       ("backward a CTA an item", BACKWARD_PER_ITEM),
                       ("128-key tiles, Q in registers", ((mosaic_forward, "Q_IN_REGISTERS", True),)),
                       ("K waited for during PV", ((mosaic_forward, "K_WAIT_DURING_PV", True),)),
                       ("persistent, backward operands in registers", PERSISTENT + DKV_1 + BACKWARD_RS),
                       ("no ping-pong", ((mosaic_forward, "PINGPONG", False),)))
TIMED_BEFORE_MOSAIC = 7  # the variants through the softmax beside its own PV without turns


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
  positions = np.zeros_like(segment_ids)
  segment_lengths = []
  for r, members in enumerate(rows):
    offset = 0
    for segment, i in enumerate(members, start=1):
      n = int(lengths[i])
      segment_ids[r, offset:offset + n] = segment
      positions[r, offset:offset + n] = np.arange(n)
      block_ids[r, offset + n - 17:offset + n - 16] = 1  # state token opens block 1
      block_ids[r, offset + n - 16:offset + n] = 2       # action tokens: block 2
      segment_lengths.append(n)
      offset += n
  return segment_ids, block_ids, positions, np.array(segment_lengths)


def timed(fn, *args, repeats: int, calls: int = 10) -> float:
  """Seconds a call: the median over `repeats` rounds of `calls` calls issued back to back and waited for
  once, after two warm-up calls. Issued back to back, as a train step issues its kernels, the next call's
  dispatch overlaps the device's work on the last: a sub-millisecond kernel timed call by call also counts
  the host's dispatch and the wait's round trip (on 2026-12-04 one program's forward timed call by call
  spread from 0.72 to 0.85 ms across arms). A call of 50 ms or more makes a round alone."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  if time.perf_counter() - start >= 0.05:
    calls = 1
  return back_to_back(fn, *args, repeats=repeats, calls=calls)


def timed_each(fn, *args, repeats: int) -> float:
  """Best of `repeats` calls, each waited for (the figures' method until 2026-12-04; min is robust to a
  shared machine)."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def with_settings(jitted, settings):
  """`jitted` traced (on its first call) with each (module, name, value) of `settings` set: the Mosaic
  GPU kernels' module settings, read as they trace (mosaic_backward.DKV_WGS, mosaic_forward.PINGPONG...).
  `jitted` must wrap a function no other setting has been traced with: jax.jit shares compiled programs
  between all jax.jit wrappers of one Python function, and a second wrapper would not trace again."""
  def call(*args):
    saved = [(module, name, getattr(module, name)) for module, name, _ in settings]
    try:
      for module, name, value in settings:
        setattr(module, name, value)
      return jitted(*args)
    finally:
      for module, name, value in saved:
        setattr(module, name, value)
  return call


@jax.jit
def relative_error(got, want):
  """max |got - want| / max |want|, on the device (only the number comes back)."""
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  return jnp.abs(got - want).max() / jnp.abs(want).max()


# check_route: the most a route's values and gradients may differ from impl "xla" in fp32 on the same
# inputs (max |error| / max |xla's|); bf16 routes measured 2.3e-3 to 4.6e-3 on the H200s.
CHECK_TOLERANCE = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 1e-2, jnp.dtype(jnp.float32): 1e-4}


def route_cases(row_length: int, seed: int = 0):
  """(name, head_dim, q_len, mask kwargs) of the attention calls a train step makes: block-causal VLA rows
  and causal LM segments at head size 128, packed segments (a VL transformer's) and a cross-attention of
  each sample's queries to its own segment of the row (GR00T's DiT) at 64."""
  segment_ids, block_ids, positions, _ = packed_rows(2, row_length, seed)
  cross_q = np.repeat(np.arange(1, 3, dtype=np.int32), 64)[None].repeat(2, 0)  # 64 queries a sample
  return (("block-causal", 128, row_length, dict(mask_kind="block_causal", q_segment_ids=segment_ids,
                                                   kv_segment_ids=segment_ids, q_block_ids=block_ids,
                                                   kv_block_ids=block_ids)),
          ("causal", 128, row_length, dict(mask_kind="causal", q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                           q_positions=positions, kv_positions=positions)),
          ("segments", 64, row_length, dict(mask_kind="bidirectional", q_segment_ids=segment_ids,
                                            kv_segment_ids=segment_ids)),
          ("cross", 64, cross_q.shape[1], dict(mask_kind="bidirectional", q_segment_ids=cross_q,
                                               kv_segment_ids=segment_ids)))


def attention_outputs(impl: str, mask: dict, d_out=None):
  """(q, k, v) -> (attention through `impl` under `mask`,), or given d_out the gradients of q, k, v of
  its sum against d_out; unjitted: the checks below compare these between impls and module settings."""
  attend = lambda q, k, v: flash_attention(q, k, v, impl=impl, **mask)
  if d_out is None:
    return lambda q, k, v: (attend(q, k, v),)
  return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * d_out), argnums=(0, 1, 2))


def largest_error(got, want) -> float:
  """The largest relative_error over paired outputs (attention_outputs')."""
  return max(float(relative_error(g, w)) for g, w in zip(got, want, strict=True))


def check_route(route: str, row_length: int, dtype) -> dict:
  """Values and gradients of attention `route` (an impl, or one limited to head sizes as auto's Hopper
  routes may be, "mosaic_own@128": the cases at those sizes) against impl "xla" in fp32 over
  route_cases, each case compiled and run on its own. Raises on an error; returns {case: (out error,
  grad error)}."""
  route, head_dims = ops.parse_route(route)
  errors = {}
  for name, head_dim, q_len, mask in route_cases(row_length):
    if head_dims and head_dim not in head_dims:
      continue
    keys = jax.random.split(jax.random.key(len(errors)), 4)
    heads = 2
    q = jax.random.normal(keys[0], (2, q_len, heads, head_dim), dtype)
    k, v = (jax.random.normal(key, (2, row_length, heads, head_dim), dtype) for key in keys[1:3])
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    device_mask = {key: jnp.asarray(value) if isinstance(value, np.ndarray) else value for key, value in mask.items()}
    both = lambda impl: jax.jit(lambda q, k, v: (attention_outputs(impl, device_mask)(q, k, v),
                                                 attention_outputs(impl, device_mask, d_out)(q, k, v)))
    out, grads = both(route)(q, k, v)
    want_out, want_grads = both("xla")(*(x.astype(jnp.float32) for x in (q, k, v)))
    errors[name] = (largest_error(out, want_out), largest_error(grads, want_grads))
  return errors


# check_variants' forward part: mosaic_own's forward under each setting that changes its GPU code path, on
# bidirectional packed segments and block-causal rows at head sizes 64 and 128. On the H200 of
# 2026-11-30 its values were right at 128 (block-causal, causal) and wrong at 64 (segments, cross),
# where Mosaic GPU interpret mode (tests) agrees with the reference: a setting that mends 64 names the
# code path at fault. (That evening's run of this check ran one program for every variant: fixed.)
# Q's register fragments loaded once an item (mosaic_common.RELOAD_OPERANDS False): the form whose SASS has
# ptxas overwrite them at head size 64 and with 128-key tiles; the control beside "as configured", which
# loads them every step there.
Q_ONCE = ((mosaic_common, "RELOAD_OPERANDS", False),)
FORWARD_VARIANTS = (("as configured", ()), ("Q loaded once an item", Q_ONCE),
                    ("Q in shared memory", ((mosaic_forward, "Q_IN_REGISTERS", False),)),
                    ("rings of 2 slots", ((mosaic_forward, "STAGES", 2),)),
                    ("no ping-pong", ((mosaic_forward, "PINGPONG", False),)),
                    ("128-key tiles", WIDE),
                    ("persistent", ((mosaic_forward, "PERSISTENT", True),)),
                    ("softmax beside its own PV", OVERLAP), ("row sums during the next QK", ROW_SUM),
                    ("rescaled after the PV", RESCALE), ("turns at a named barrier", NAMED),
                    ("turns at a named barrier, row sums during the next QK", NAMED + ROW_SUM),
                    ("turns at a named barrier, rescaled after the PV", NAMED + RESCALE))

# check_variants' backward part: the backward's settings that 2026-11-30's timings favour (persistent: 2.20 ms
# against 2.62 with deep rings, 2.38 with rings of 2; as configured since 2026-12-01 at head size 128) but
# no GPU has checked at head size 64, through the mosaic route (tokamax's forward, ejax's backward): auto's
# Hopper routes share this backward.
BACKWARD_VARIANTS = (("as configured", ()), ("persistent", ((mosaic_backward, "PERSISTENT", True),)),
                     ("a CTA an item", BACKWARD_PER_ITEM),
                     ("rings of 2 slots", ((mosaic_backward, "STAGES", 2),)),
                     ("backward wgmmas in pairs", PAIRED), ("backward wgmmas in pairs, persistent", PAIRED + PERSISTENT[1:]),
                     ("dK/dV in 2 warpgroups", DKV_2))
# And mosaic_own's gradients under the forward's 128-key tiles (its out and lse feed the backward): on the
# H200 of 2026-11-30 the attention figure's "128-key tiles" arm had gradients 1.9 off, the other arms'
# 4.6e-3; interpret mode agrees with the reference (tests).
# First the defaults of head size 128 at every head size with each edge masked alone and the unneeded halves
# skipped (MASK_EACH_EDGE, EDGE_HALVES: no GPU has run them), then without them (right at 64 too on the evening of 2026-12-04: 4.3-4.9e-3).
HEAD_128_FORM = "128-key tiles, Q in shared memory, turns at a named barrier, dK/dV in 2 warpgroups"
FORWARD_GRADIENT_VARIANTS = (("as configured", ()), (f"{HEAD_128_FORM}, each edge masked alone, unneeded halves skipped",
                                                     WIDE_SS + NAMED + DKV_2 + EACH_EDGE + EDGE),
                             (HEAD_128_FORM, WIDE_SS + NAMED + DKV_2), ("128-key tiles", WIDE),
                             ("128-key tiles, Q loaded once an item", WIDE + Q_ONCE),
                             ("128-key tiles, Q in shared memory", WIDE_SS))


def _variant_cases(row_length: int, dtype):
  """(name, q, k, v, mask) of the variant checks: bidirectional packed segments and block-causal rows,
  each at head sizes 64 and 128."""
  segment_ids, block_ids, _, _ = packed_rows(2, row_length, 0)
  segments = dict(mask_kind="bidirectional", q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
  block_causal = dict(mask_kind="block_causal", q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                      q_block_ids=block_ids, kv_block_ids=block_ids)
  cases = (("segments@64", 64, segments), ("segments@128", 128, segments), ("block-causal@64", 64, block_causal),
           ("block-causal@128", 128, block_causal))
  for name, head_dim, mask in cases:
    q, k, v = (jax.random.normal(key, (2, row_length, 2, head_dim), dtype) for key in jax.random.split(jax.random.key(1), 3))
    yield name, q, k, v, {key: jnp.asarray(value) if isinstance(value, np.ndarray) else value for key, value in mask.items()}


# profile_kernels: each Mosaic GPU kernel of mosaic_own, its trace's file prefix, its compute warpgroups
# (the copying one after them), its GEMMs a ring step per warpgroup, each 64 x 64 x head_dim, and the
# setting of the keys a step where a step has more than 64 (the bound: an H100's / H200's 4,096 dense
# flops a clock an SM; on 2026-12-04 the forward's was printed for 64 keys while its steps had 128).
PROFILED_KERNELS = (("forward", "forward_kernel", (mosaic_forward, "FWD_WGS"), 2, (mosaic_forward, "BLOCK_KV")),
                    ("dQ", "dq_kernel", (mosaic_backward, "DQ_WGS"), 3, None),
                    ("dK/dV", "dkv_kernel", (mosaic_backward, "DKV_WGS"), 4, None))


def setting_under(settings, module, name: str, head_dim: int):
  """A kernel setting's value at a head size under a variant's `settings` (else the module's)."""
  value = next((value for owner, key, value in settings if owner is module and key == name), getattr(module, name))
  return mosaic_common.at_head_dim(value, head_dim)


def step_bound_cycles(kernel: str, head_dim: int, settings=()) -> float:
  """Cycles a ring step of a PROFILED_KERNELS kernel needs for its wgmmas at the tensor cores' rate."""
  _, _, (module, setting), gemms, keys = next(entry for entry in PROFILED_KERNELS if entry[0] == kernel)
  wgs = setting_under(settings, module, setting, head_dim)
  step_keys = setting_under(settings, *keys, head_dim) if keys else 64
  return gemms * wgs * 2 * 64 * step_keys * head_dim / 4096


def profile_kernels(q, k, v, d_out, mask: dict, folder: str, clock_mhz: float, repeats: int,
                    settings=()) -> dict:
  """mosaic_own's forward on these rows timed as built and under `settings` (a variant's module
  settings, MOSAIC_OWN_VARIANTS); then its forward and backward under them run once with Mosaic GPU's
  on-device profiler on (mosaic_common.PROFILE_DIR; a trace a kernel written into `folder`), each trace
  summed up by kernel_profile.summarize, beside its ring step's bound in cycles. (The attention figure
  times the forward+backward; here a second compile of it would cost the window.)"""
  forward_ms = 1e3 * timed(jax.jit(attention_outputs("mosaic_own", mask)), q, k, v, repeats=repeats)
  variant_ms = (1e3 * timed(with_settings(jax.jit(attention_outputs("mosaic_own", mask)), settings), q, k, v,
                            repeats=repeats) if settings else forward_ms)
  os.makedirs(folder, exist_ok=True)
  profiled = with_settings(jax.jit(attention_outputs("mosaic_own", mask, d_out)),
                           tuple(settings) + ((mosaic_common, "PROFILE_DIR", folder),))
  start = time.perf_counter()
  jax.block_until_ready(profiled(q, k, v))
  jax.effects_barrier()  # the traces are written by host callbacks
  timings = dict(forward_ms=forward_ms, variant_forward_ms=variant_ms, profiled_s=time.perf_counter() - start)
  kernels = {}
  for name, prefix, (module, setting), *_ in PROFILED_KERNELS:
    wgs = setting_under(settings, module, setting, q.shape[-1])
    roles = {**{w: "compute" for w in range(wgs)}, wgs: "copying"}
    try:  # a kernel whose trace is missing is said so, and the others summed up
      events = kernel_profile.load(kernel_profile.newest_trace(folder, prefix))
    except FileNotFoundError as error:
      kernels[name] = dict(error=str(error))
      continue
    kernels[name] = dict(kernel_profile.summarize(events, wgs + 1, roles, clock_mhz),
                         step_bound_cycles=step_bound_cycles(name, q.shape[-1], settings))
  return dict(timings, kernels=kernels)


def check_variants(row_length: int, dtype, impl: str, variants, gradients: bool, report=None) -> dict:
  """{variant: {case: error against impl "xla" in fp32}} of `impl` under each variant's module settings:
  of its values, or with `gradients` of its gradients of q, k, v (the largest of the three). A variant
  that does not build here gets its error's first line instead. `report(variant, {case: error})` is
  called as each variant is done (a time limit may end the run before the last)."""
  inputs = {}
  for name, q, k, v, mask in _variant_cases(row_length, dtype):
    d_out = jax.random.normal(jax.random.key(2), q.shape, jnp.float32) if gradients else None
    want = jax.jit(attention_outputs("xla", mask, d_out))(*(x.astype(jnp.float32) for x in (q, k, v)))
    inputs[name] = (q, k, v, mask, d_out, want)
  errors = {}
  for label, settings in variants:
    errors[label] = {}
    for name, (q, k, v, mask, d_out, want) in inputs.items():
      # A new function for each variant: jax.jit keys its compiled programs by the Python function, one
      # cache for all its jax.jit wrappers, so a function reused here ran the first variant's program
      # under every later variant's settings (on the H200 of 2026-11-30 the seven forward variants gave
      # one set of errors: 128-key tiles' forward, wrong in the figure's gradients, never ran here).
      run = attention_outputs(impl, mask, d_out)
      try:
        errors[label][name] = largest_error(with_settings(jax.jit(run), settings)(q, k, v), want)
      except Exception as error:  # noqa: BLE001  (a variant that does not build here: say so, go on)
        errors[label][name] = f"{type(error).__name__}: {str(error)[:120]}"
    if report is not None:
      report(label, errors[label])
  return errors
