"""Variable-length attention vs dense masked attention on the same packed rows.

Rows are packed (ejax.data.packing) from the VLA length mix of benchmarks/packing.py (1-3 cameras x
256 tokens, a 5-60 token instruction, 1 state + 16 action tokens). Every arm computes the same
block-causal, segment-masked attention; dense (jax.nn.dot_product_attention's XLA path, the
baseline, and ejax's reference op) materialises every (query, key) score of the row,
varlen (impl "xla" on CPU, the Pallas kernel on GPU) runs only the tiles a segment pair allows.
The measured speedup is printed next to the ideal FLOP ratio, sum over rows of row_length^2
divided by the sum of squared segment lengths, and next to the tile-granular ratio the kernel can
reach at its block size.

On GPU it then measures every route side by side in TFLOP/s, forward and forward+backward, with the
FLOPs counted over the (query, key) pairs the mask allows (4 * pairs * head_dim * heads forward,
3.5x that with the backward): ejax's Triton-backend kernel ("pallas"), tokamax's Mosaic GPU kernel
("tokamax"; "tokamax_fwd": its forward with ejax's Triton backward; "mosaic": its forward with ejax's
Mosaic GPU backward, whose loops are bounded by each query's key range; "mosaic_own": ejax's Mosaic GPU
kernels both ways, its forward's warpgroups computing only their own queries' tiles), cuDNN over the segments as offsets
("cudnn_packed": causal rows only, it has no block-causal form), cuDNN with the dense mask ("cudnn")
and the XLA loop ("xla"), on the VLA rows (block-causal) and on the same rows as causal LM segments. `--sweep` adds tile / launch settings of
ejax's kernel and tokamax configs. An arm that fails prints its error and the others go on;
`--json PATH` writes every number (rewritten after each arm). The last line is the figure: the
speedup on CPU, on GPU the fastest forward+backward TFLOP/s.

`--profile_kernel DIR` (a GPU) instead runs mosaic_own's three Mosaic GPU kernels (forward, dQ,
dK/dV) under Mosaic GPU's on-device profiler and prints, per kernel, the cycles of each named scope
(barrier waits, wgmmas, softmax) per warpgroup beside a ring step's bound (benchmarks/kernel_profile.py).

  python benchmarks/attention.py          # headline: 4 rows x 2048 tokens, 4 heads x 32, CPU fp32
  python benchmarks/attention.py --rows 8 --row_length 4096 --heads 16 --head_dim 128 --sweep \
      --json attention.json               # Hopper: goal 300 TFLOP/s forward, 200 forward+backward
  python benchmarks/attention.py --rows 1 --row_length 4096 --heads 16 --head_dim 128 \
      --profile_kernel /tmp/ejax-kernel-profile   # Hopper: where the kernels' cycles go
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from ejax.kernels.attention import (BlockSizes, attention_mask, flash_attention, intervals, mosaic_backward,
                                    mosaic_forward, ops, tokamax_gpu)
from ejax.kernels.attention.mosaic_common import at_head_dim
from ejax.kernels.attention.ops import choose_impl
from ejax.kernels.attention.tiles import (CPU_BLOCK_SIZES, GPU_BLOCK_SIZES, XLA_GPU_BLOCK_SIZES,
                                          MaskInputs, active_fraction, normalise_mask)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # benchmarks/ imports as a package from the repository root
  sys.path.insert(0, REPO)
from benchmarks import kernel_profile  # noqa: E402
from benchmarks.attention_variants import (BACKWARD_PER_ITEM, BACKWARD_RS, BACKWARD_VARIANTS, CHECK_TOLERANCE, DKV_1,  # noqa: E402
                                           FORWARD_GRADIENT_VARIANTS, FORWARD_VARIANTS, MOSAIC_OWN_VARIANTS,
                                           PROFILED_KERNELS, TIMED_BEFORE_MOSAIC, check_route, check_variants,
                                           packed_rows, profile_kernels, relative_error, timed, timed_each,
                                           with_settings)

# Goals of issue 31 point 6 at 8 x 4,096 tokens, 16 heads x 128 on one H100/H200 (TFLOP/s).
GOAL_FORWARD, GOAL_TRAIN = 300.0, 200.0
# ejax kernel settings the sweep tries beside the default (forward tiles, backward tiles, warps,
# stages): wider q tiles and deeper pipelines, the usual Hopper choices for head_dim 128.
# (Few: every arm compiles its forward and forward+backward, and the GPU run has two minutes.)
PALLAS_SWEEP = (BlockSizes(128, 64, 64, 64, num_warps=8, num_stages=3),
                BlockSizes(128, 128, 64, 64, num_warps=8, num_stages=2))
# tokamax SM90 configs beside its own heuristics (which pick a persistent kernel for these masks).
TOKAMAX_SWEEP = (dict(block_q=64, block_kv=128, num_stages=2, persistent=False),)
# The mosaic route's forward (tokamax's kernel) at other configs than its heuristics' (64 x 128, 2
# stages, persistent), timed after ejax's own kernels' settings. First 64-key tiles: its CTAs of 128
# queries then visit 27.2M pairs of the VLA rows' 18.7M allowed (69 % useful) against 29.3M (64 %).
MOSAIC_FORWARD_CONFIGS = (dict(block_q=64, block_kv=64, num_stages=3, persistent=True),
                          dict(block_q=64, block_kv=128, num_stages=3, persistent=True),
                          dict(block_q=64, block_kv=128, num_stages=2, persistent=False))
# An arm kwarg make() takes off before flash_attention: ((module, name, value), ...) set while it traces.
SETTINGS = "_module_settings"
# Arms also timed on the causal rows (the rest, baselines and the sweep, on the VLA rows only).
CAUSAL_ARMS = ("pallas", "tokamax", "tokamax_fwd", "mosaic", "mosaic_own", "cudnn_packed")


def allowed_pairs(mask: dict, rows: int, row_length: int) -> int:
  """(query, key) pairs the mask allows, summed over rows (one row's dense mask at a time, on host)."""
  total = 0
  for r in range(rows):
    row = {name: value[r:r + 1] if isinstance(value, np.ndarray) else value for name, value in mask.items()}
    total += int(np.asarray(attention_mask(row_length, row_length, batch=1, **row)).sum())
  return total


def arms(on_gpu: bool, sweep: bool, all_arms: bool):
  """(label, impl, extra flash_attention kwargs) of the TFLOP/s comparison."""
  if not (on_gpu or all_arms):
    return []
  # pallas first (the other arms' gradients are checked against it), then mosaic_own and its first
  # variants (attention_variants.MOSAIC_OWN_VARIANTS), the mosaic route (auto's Hopper route at head size
  # 64 until 2026-12-04), mosaic_own's other variants; the routes measured in every H200 window last,
  # where the figure's time limit cuts first.
  variants = [(f"mosaic_own, {label}", "mosaic_own", {SETTINGS: settings}) for label, settings in MOSAIC_OWN_VARIANTS]
  listed = [("pallas", "pallas", {}), ("mosaic_own", "mosaic_own", {})] + variants[:TIMED_BEFORE_MOSAIC]
  listed += [("mosaic", "mosaic", {})] + variants[TIMED_BEFORE_MOSAIC:]
  listed += [("mosaic, backward operands in registers", "mosaic", {SETTINGS: BACKWARD_RS}),
             ("mosaic, backward a CTA an item", "mosaic", {SETTINGS: BACKWARD_PER_ITEM}),
             ("mosaic, dK/dV in 1 warpgroup", "mosaic", {SETTINGS: DKV_1})]
  if on_gpu and tokamax_gpu.available():
    for config in MOSAIC_FORWARD_CONFIGS:
      label = (f"mosaic, forward {config['block_q']}x{config['block_kv']} s{config['num_stages']}"
               + (" persistent" if config["persistent"] else ""))
      listed.append((label, "mosaic", dict(tokamax_config=tokamax_gpu.sm90_config(**config))))
  listed += [("tokamax_fwd", "tokamax_fwd", {}), ("cudnn_packed", "cudnn_packed", {}), ("tokamax", "tokamax", {}),
             ("cudnn (dense mask)", "cudnn", {}), ("xla", "xla", {})]
  if sweep:
    for blocks in PALLAS_SWEEP:
      label = (f"pallas {blocks.block_q}x{blocks.block_kv}/{blocks.block_q_bwd}x{blocks.block_kv_bwd} "
               f"w{blocks.num_warps} s{blocks.num_stages}")
      listed.append((label, "pallas", dict(block_sizes=blocks)))
    if tokamax_gpu.available():
      for config in TOKAMAX_SWEEP:
        label = (f"tokamax {config['block_q']}x{config['block_kv']} s{config['num_stages']}"
                 + (" persistent" if config["persistent"] else ""))
        listed.append((label, "tokamax", dict(tokamax_config=tokamax_gpu.sm90_config(**config))))
    # The kernel alone: what the on-device layout check and its lax.cond cost the "tokamax" arm.
    listed.append(("tokamax kernel, no layout check", "tokamax_unchecked", {}))
  return listed


def mosaic_work(mask: dict, pairs: int, head_dim: int) -> str:
  """The pairs the Mosaic GPU kernels' tile loops visit on these rows at their settings for this head size
  (mosaic_backward / mosaic_forward)."""
  rows, row_length = mask["q_segment_ids"].shape
  names = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions", "q_block_ids", "kv_block_ids")
  arrays = {name: jnp.asarray(mask[name]) if name in mask else None for name in names}
  inputs, ordered = normalise_mask(rows, row_length, row_length, mask["mask_kind"], **arrays)
  ranges = intervals.key_ranges(inputs, ordered)
  if not bool(ranges.valid) or row_length % mosaic_backward.LENGTH_MULTIPLE:
    return "the mosaic backward does not take these rows"
  k_start = jnp.where(ranges.has_keys, ranges.k_start, 0)
  k_end = jnp.where(ranges.has_keys, ranges.k_end, 0)
  dq, dkv = mosaic_backward.visited_pairs(k_start, k_end, row_length, head_dim=head_dim)
  block_kv = at_head_dim(mosaic_forward.BLOCK_KV, head_dim)
  computed, streamed = mosaic_forward.visited_pairs(k_start, k_end, block_kv=block_kv)
  halves = ""
  if mosaic_forward.halves_apply(block_kv):
    halved, _ = mosaic_forward.visited_pairs(k_start, k_end, block_kv=block_kv, edge_halves=True)
    halves = f" ({halved / 1e6:.1f}M, {pairs / halved:.0%} allowed, with the unneeded halves skipped)"
  return (f"the mosaic backward visits {dq / 1e6:.1f}M (dQ) / {dkv / 1e6:.1f}M (dK/dV) pairs, "
          f"{pairs / max(dq, dkv):.0%} allowed; mosaic_own's forward computes {computed / 1e6:.1f}M "
          f"({pairs / computed:.0%} allowed){halves} of the {streamed / 1e6:.1f}M its CTAs stream; the dense rows "
          f"are {rows * row_length**2 / 1e6:.0f}M")


def unchecked_tokamax(q, k, v, mask: dict, on_gpu: bool):
  """tokamax on the key ranges without ops.py's layout check (valid here: the rows are packed)."""
  names = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions", "q_block_ids", "kv_block_ids")
  normal, ordered = normalise_mask(q.shape[0], q.shape[1], k.shape[1], mask["mask_kind"],
                                   *(mask.get(name) for name in names))
  return tokamax_gpu.attention(q, k, v, intervals.key_ranges(normal, ordered), scale=q.shape[-1]**-0.5,
                               on_gpu=on_gpu)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=4)
  parser.add_argument("--row_length", type=int, default=2048)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head_dim", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5, help="timed rounds (the median; a round is 10 calls "
                      "back to back, or one call of 50 ms or more)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--sweep", action="store_true",
                      help="also time ejax's kernel at other tiles / launch settings and tokamax configs")
  parser.add_argument("--all_arms", action="store_true",
                      help="run the GPU comparison's arms on any backend (a dry run of the script off GPU)")
  parser.add_argument("--skip_dense", action="store_true", help="skip the dense arms (and the speedup)")
  parser.add_argument("--masks", default="block_causal,causal",
                      help="rows of the TFLOP/s comparison: block_causal (the VLA rows), causal (the same as LM segments)")
  parser.add_argument("--json", default=None, help="write every number to this path")
  parser.add_argument("--dtype", default=None, help="q, k, v dtype (default bfloat16 on GPU, float32 elsewhere; "
                                                    "the mosaic arm takes 16-bit floats only)")
  parser.add_argument("--check_variants", action="store_true",
                      help="only check mosaic_own's forward values under each of FORWARD_VARIANTS at head sizes 64 "
                           "and 128 (which code path is wrong on a GPU), then the backward's gradients under "
                           "each of BACKWARD_VARIANTS")
  parser.add_argument("--check", default=None, metavar="ROUTE",
                      help="only check one route's values and gradients against impl xla on small rows "
                           "(benchmarks/gpu.py does, for each of auto's Hopper routes, before its figures); "
                           "exit status 1 when it is off or fails")
  parser.add_argument("--profile_kernel", default=None, metavar="DIR",
                      help="only run mosaic_own's forward and backward on the block-causal rows under Mosaic GPU's "
                           "on-device profiler (a GPU): a trace a kernel into DIR, then the cycles of each scope")
  parser.add_argument("--profile_variant", default=None, metavar="LABEL",
                      help="with --profile_kernel: profile mosaic_own under this variant of MOSAIC_OWN_VARIANTS "
                           "(its forward also timed beside the configured one)")
  parser.add_argument("--sm_clock_mhz", type=float, default=1980.0,
                      help="the SM clock the profile's cycles are converted at (an H100 / H200 SXM's boost)")
  args = parser.parse_args()

  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.dtype(args.dtype) if args.dtype else (jnp.bfloat16 if on_gpu else jnp.float32)
  if args.check_variants:
    tolerance = CHECK_TOLERANCE[jnp.dtype(dtype)]
    # The backward's variants through the mosaic route where tokamax's forward runs (a GPU), else
    # through mosaic_own (interpret mode here).
    backward_impl = "mosaic" if on_gpu and tokamax_gpu.available() else "mosaic_own"
    errors = {"forward": {}, "backward": {}, "forward_gradients": {}}
    # Most telling first, each line printed as its variant is done (the figure's time limit may cut the
    # rest): the gradients as configured and under head size 128's defaults at 64 too with the unneeded
    # halves skipped, the backward's variants, the forward as configured and its load-once control, then
    # what 2026-12-04 answered (the head-128 defaults at 64, the 128-key tiles and their control) and the
    # forward's other settings.
    for part, impl, variants, gradients in (("forward_gradients", "mosaic_own", FORWARD_GRADIENT_VARIANTS[:2], True),
                                            ("backward", backward_impl, BACKWARD_VARIANTS, True),
                                            ("forward", "mosaic_own", FORWARD_VARIANTS[:2], False),
                                            ("forward_gradients", "mosaic_own", FORWARD_GRADIENT_VARIANTS[2:], True),
                                            ("forward", "mosaic_own", FORWARD_VARIANTS[2:], False)):
      def report(label, by_case, impl=impl, part=part, gradients=gradients):
        cells = ", ".join(f"{name} {e:.1e}" if isinstance(e, float) else f"{name} {e}" for name, e in by_case.items())
        print(f"{impl} {'gradients' if gradients else 'values'}, {part} {label}: {cells}", flush=True)

      errors[part].update(check_variants(args.row_length, dtype, impl, variants, gradients, report))
    if args.json:
      with open(args.json, "w") as file:
        json.dump(dict(dtype=jnp.dtype(dtype).name, errors=errors, tolerance=tolerance), file)
    right = {part: [label for label, by_case in by_variant.items()
                    if all(isinstance(e, float) and e <= tolerance for e in by_case.values())]
             for part, by_variant in errors.items()}
    print(f"mosaic_own forward variants right at every case: {len(right['forward'])} of {len(errors['forward'])} "
          f"({', '.join(right['forward']) or 'none'}); backward variants {len(right['backward'])} of "
          f"{len(errors['backward'])}; mosaic_own's gradients under forward variants {len(right['forward_gradients'])} of "
          f"{len(errors['forward_gradients'])} ({', '.join(right['forward_gradients']) or 'none'}) (goal all)")
    return
  if args.check:
    try:
      errors = check_route(args.check, args.row_length, dtype)
    except Exception as error:  # noqa: BLE001  (the route fails on this machine: say how, in one line)
      raise SystemExit(f"attention route {args.check}: fails: {type(error).__name__}: {str(error)[:400]}")
    worst = max(max(pair) for pair in errors.values())
    cases = ", ".join(f"{name} {out:.1e}/{grad:.1e}" for name, (out, grad) in errors.items())
    verdict = "ok" if worst <= CHECK_TOLERANCE[jnp.dtype(dtype)] else "off"
    if args.json:
      with open(args.json, "w") as file:
        json.dump(dict(route=args.check, dtype=jnp.dtype(dtype).name, errors=errors, verdict=verdict), file)
    print(f"attention route {args.check}: {verdict} on {jax.devices()[0].device_kind}, {jnp.dtype(dtype).name} "
          f"(error of values/gradients against xla in fp32: {cases}; tolerance {CHECK_TOLERANCE[jnp.dtype(dtype)]:.0e})")
    raise SystemExit(0 if verdict == "ok" else 1)
  if args.profile_variant is not None and args.profile_variant not in dict(MOSAIC_OWN_VARIANTS):
    raise SystemExit(f"attention.py --profile_variant {args.profile_variant!r}: not a mosaic_own variant; pick one of: "
                     + "; ".join(label for label, _ in MOSAIC_OWN_VARIANTS))
  if args.profile_kernel and not on_gpu:
    raise SystemExit(f"attention.py --profile_kernel: Mosaic GPU's on-device profiler needs a GPU (the backend here "
                     f"is {jax.default_backend()}); run it where benchmarks/gpu.py runs")
  segment_ids, block_ids, positions, segment_lengths = packed_rows(args.rows, args.row_length, args.seed)
  shape = (args.rows, args.row_length, args.heads, args.head_dim)
  keys = jax.random.split(jax.random.key(args.seed), 4)
  q, k, v, d_out = (jax.random.normal(key, shape, dtype) for key in keys)
  host_masks = {
      "block_causal": dict(mask_kind="block_causal", q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                           q_block_ids=block_ids, kv_block_ids=block_ids),
      "causal": dict(mask_kind="causal", q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                     q_positions=positions, kv_positions=positions),
  }
  as_device = lambda mask: {name: jnp.asarray(value) if isinstance(value, np.ndarray) else value
                            for name, value in mask.items()}
  mask = as_device(host_masks["block_causal"])
  if args.profile_kernel:
    profile = profile_kernels(q, k, v, d_out, mask, args.profile_kernel, args.sm_clock_mhz, args.repeats,
                              dict(MOSAIC_OWN_VARIANTS).get(args.profile_variant, ()))
    steps = []
    for name, *_ in PROFILED_KERNELS:
      print(f"{name}:")
      if "error" in profile["kernels"][name]:
        print(f"  {profile['kernels'][name]['error']}")
        continue
      for line in kernel_profile.describe(profile["kernels"][name]):
        print(f"  {line}")
      compute = profile["kernels"][name]["roles"].get("compute", {})
      step = compute.get("scopes", {}).get("step", {}).get("cycles_per_call", 0.0)
      steps.append(f"{name} {step:,.0f} ({profile['kernels'][name]['step_bound_cycles']:,.0f})")
    if args.json:
      with open(args.json, "w") as file:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, args=vars(args), profile=profile),
                  file, indent=1)
    variant = (f"; {args.profile_variant}: forward {profile['variant_forward_ms']:.2f} ms, profiled"
               if args.profile_variant else "")
    print(f"mosaic_own on {jax.devices()[0].device_kind}: forward {profile['forward_ms']:.2f} ms{variant} (profiled "
          f"forward and backward, compile and dumps included: {profile['profiled_s']:.0f} s); cycles a ring step "
          "(bound: its wgmmas at the tensor cores' rate): " + ", ".join(steps))
    return
  varlen_impl = choose_impl(q, k, "auto", "block_causal") if on_gpu else "xla"
  # The tiles the op picks for this impl and backend (ops.flash_attention).
  blocks = (XLA_GPU_BLOCK_SIZES if varlen_impl == "xla" and on_gpu else
            CPU_BLOCK_SIZES if varlen_impl == "xla" else GPU_BLOCK_SIZES)

  segment_pairs = float(np.sum(segment_lengths.astype(float)**2))
  ideal = args.rows * args.row_length**2 / segment_pairs
  tiles = MaskInputs(*(jnp.asarray(x) for x in (segment_ids, segment_ids, block_ids, block_ids)))
  tile_ratio = 1.0 / float(active_fraction(tiles, blocks, ordered=True))
  device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
  print(f"device: {device}, jax {jax.__version__}, {jnp.dtype(dtype).name}")
  print(f"{args.rows} rows x {args.row_length} tokens, {len(segment_lengths)} segments "
        f"({segment_lengths.min()}..{segment_lengths.max()}), {args.heads} heads x {args.head_dim}, "
        f"padding {float((segment_ids == 0).mean()):.1%}")
  print(f"ideal FLOP ratio (row_length^2 / sum len^2): {ideal:.2f}x; tile-granular ratio at "
        f"{blocks.block_q}x{blocks.block_kv} tiles: {tile_ratio:.2f}x")
  for mask_kind, host_mask in host_masks.items():
    pairs = allowed_pairs(host_mask, args.rows, args.row_length)
    print(f"{mask_kind} rows: {mosaic_work(host_mask, pairs, args.head_dim)}")
  report = dict(device=device, jax=jax.__version__, dtype=jnp.dtype(dtype).name, args=vars(args),
                segments=len(segment_lengths), segment_pairs=segment_pairs, ideal_ratio=ideal,
                tile_ratio=tile_ratio, tile_blocks=[blocks.block_q, blocks.block_kv],
                auto_impl=varlen_impl, hopper_auto=ops.hopper_auto(),
                tokamax=tokamax_gpu.available() or tokamax_gpu.unavailable_reason(), arms={})

  def save():
    if args.json:
      with open(args.json, "w") as file:
        json.dump(report, file, indent=1)

  def make(impl, mask, **kwargs):
    if SETTINGS in kwargs:  # the Mosaic GPU kernels' module settings, read as they trace
      settings = kwargs.pop(SETTINGS)
      forward, train = make(impl, mask, **kwargs)
      return with_settings(forward, settings), with_settings(train, settings)
    if impl == "dense":  # XLA's dense masked attention: the baseline (faster than the reference)
      dense_mask = attention_mask(args.row_length, args.row_length, batch=args.rows, **mask)[:, None]
      attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense_mask, implementation="xla")
    elif impl == "tokamax_unchecked":
      attend = lambda q, k, v: unchecked_tokamax(q, k, v, mask, on_gpu)
    else:
      attend = lambda q, k, v: flash_attention(q, k, v, impl=impl, **mask, **kwargs)
    forward = jax.jit(attend)
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))
    return forward, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  speedup = None
  if not args.skip_dense:
    results = {}
    # On GPU the reference (fp32 scores of every pair, ~30 GB at 8 x 4,096 x 16 heads) is left out.
    dense_arms = (("dense masked (jax.nn, xla)", "dense"),) + (
        () if on_gpu else (("dense masked (ejax reference)", "reference"),))
    for name, impl in dense_arms + ((f"varlen ({varlen_impl})", varlen_impl),):
      try:  # the reference's fp32 scores of a GPU-sized case may not fit: say so, go on
        forward, train = make(impl, mask)
        results[impl] = (timed(forward, q, k, v, repeats=args.repeats),
                         timed(train, q, k, v, repeats=args.repeats))
        del forward, train
      except Exception as error:
        report.setdefault("dense_errors", {})[name] = f"{type(error).__name__}: {error}"
        print(f"{name:30s} unavailable: {type(error).__name__}: {str(error)[:300]}")
        continue
      print(f"{name:30s} forward {results[impl][0] * 1e3:9.1f} ms   forward+backward {results[impl][1] * 1e3:9.1f} ms")
    report["dense_ms"] = {impl: [1e3 * t for t in times] for impl, times in results.items()}
    if "dense" in results and varlen_impl in results:
      (dense_fwd, dense_train), (var_fwd, var_train) = results["dense"], results[varlen_impl]
      speedup = dense_train / var_train
      print(f"speedup over jax.nn dense: forward {dense_fwd / var_fwd:.2f}x, forward+backward {speedup:.2f}x")
      report.update(speedup_forward=dense_fwd / var_fwd, speedup_train=speedup)
    save()

  # TFLOP/s over the pairs each mask allows; forward+backward is 3.5x the forward's matmul FLOPs.
  best, first_grads = {}, {}
  listed = arms(on_gpu, args.sweep, args.all_arms)
  if not listed:
    print("GPU TFLOP/s (pallas, tokamax, tokamax_fwd, mosaic, mosaic_own, cudnn_packed, cudnn, xla): pending: no GPU")
  for mask_kind in args.masks.split(",") if listed else ():
    pairs = allowed_pairs(host_masks[mask_kind], args.rows, args.row_length)
    flops = 4.0 * pairs * args.head_dim * args.heads
    report.setdefault("allowed_pairs", {})[mask_kind] = pairs
    print(f"{mask_kind} rows: {pairs / 1e6:.1f}M allowed pairs ({pairs / segment_pairs:.1%} of the segments' "
          f"pairs), {flops / 1e9:.1f} GFLOP forward")
    device_mask = as_device(host_masks[mask_kind])
    for label, impl, kwargs in listed:
      default_settings = not kwargs and impl in ops.IMPLS
      if mask_kind == "causal" and not (default_settings and impl in CAUSAL_ARMS):
        continue
      entry = dict(mask_kind=mask_kind, impl=impl, label=label, default_settings=default_settings)
      try:
        forward, train = make(impl, device_mask, **kwargs)
        seconds_fwd = timed(forward, q, k, v, repeats=args.repeats)
        seconds_train = timed(train, q, k, v, repeats=args.repeats)
        entry.update(forward_ms=1e3 * seconds_fwd, train_ms=1e3 * seconds_train,
                     forward_tflops=flops / seconds_fwd / 1e12, train_tflops=3.5 * flops / seconds_train / 1e12,
                     # each call waited for: the figures' method until 2026-12-04
                     forward_ms_each=1e3 * timed_each(forward, q, k, v, repeats=args.repeats),
                     train_ms_each=1e3 * timed_each(train, q, k, v, repeats=args.repeats))
        # Gradients against the first arm's (ejax's tested Pallas kernel): a fast arm must also be right.
        grads = train(q, k, v)[1]
        first_grads.setdefault(mask_kind, grads)
        entry["grad_error"] = max(float(relative_error(g, r)) for g, r in zip(grads, first_grads[mask_kind]))
        print(f"  {label:44s} forward {entry['forward_tflops']:6.1f} TFLOP/s ({entry['forward_ms']:7.2f} ms)   "
              f"forward+backward {entry['train_tflops']:6.1f} TFLOP/s ({entry['train_ms']:7.2f} ms)   "
              f"grads vs the first arm {entry['grad_error']:.1e}   each waited for {entry['forward_ms_each']:.2f} / "
              f"{entry['train_ms_each']:.2f} ms")
        for figure in ("forward_tflops", "train_tflops"):
          if entry[figure] > best.get(figure, (0.0,))[0]:
            best[figure] = (entry[figure], f"{label} ({mask_kind})")
      except Exception as error:  # a route that refuses the case or fails to build: say so, go on
        entry["error"] = f"{type(error).__name__}: {error}"
        entry["traceback"] = traceback.format_exc()[-4000:]
        print(f"  {label:44s} unavailable: {type(error).__name__}: {str(error)[:300]}")
      report["arms"][f"{mask_kind}: {label}"] = entry
      save()
  if best:
    report["best"] = {figure: dict(tflops=value, arm=arm) for figure, (value, arm) in best.items()}
    by_impl = {}
    for entry in report["arms"].values():
      if entry["mask_kind"] == "block_causal" and "train_tflops" in entry and entry["default_settings"]:
        by_impl[entry["impl"]] = entry["train_tflops"]
    if by_impl:
      fastest = max(by_impl, key=by_impl.get)
      report["fastest_default_impl"] = fastest
      print(f"fastest route at its default settings (VLA rows, forward+backward): {fastest} "
            f"(auto's Hopper routes here: {ops.hopper_auto()!r})")
    save()
  if speedup is not None:
    print(f"varlen/dense attention speedup (forward+backward): {speedup:.2f}x; bound from the work at "
          f"equal FLOP rates {tile_ratio:.2f}x (dense pairs / active tile pairs at {blocks.block_q}x{blocks.block_kv}) "
          f"(goal {ideal:.2f}x, the ideal FLOP ratio)")
  if best:
    (train_value, train_arm), (fwd_value, fwd_arm) = best["train_tflops"], best["forward_tflops"]
    print(f"fastest attention forward+backward TFLOP/s: {train_value:.1f} by {train_arm}; forward "
          f"{fwd_value:.1f} by {fwd_arm} (goal {GOAL_TRAIN:.0f}; forward {GOAL_FORWARD:.0f})")


if __name__ == "__main__":
  main()
