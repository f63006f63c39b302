"""The trainer's own train step, full size, timed: samples/s, model TFLOP/s and MFU per arm.

For GR00T-N1.5, pi0.5 and DreamZero (configs/groot.py, configs/pi05.py, configs/dreamzero.py; DreamZero
only with --models dreamzero) on the devices present, this builds
what the train job builds (ejax.train.state.create_train_state, ejax.train.step.jit_train_step) and
feeds it the model's own example batch, in arms timed back to back in one process:
  configured   the config as it is
  padded       one sample a row, the row as long as the longest sample (rounded up to 128)
  seed_padded  one sample a row of the seed's fixed shape (every camera slot, the prompt padded to 200)
  best_fit     samples a row and row length chosen from the batch's lengths (ejax.data.row_plan)
  fp8_<impl>   model.fp8 through each FP8 route (model.fp8_impl): GR00T's DiT and VL-transformer
               feed-forwards, pi0.5's PaliGemma feed-forward
  fp8_frozen   train.frozen_fp8: the frozen towers' projections (GR00T's SigLIP and LLM) as FP8 GEMMs
               from e4m3 copies of their weights made with the state (ejax/train/frozen_fp8.py)
  fp8_all      both: train.frozen_fp8 and model.fp8 with fp8_impl "xla_delayed"
  attn_<impl>  the configured layout with model.attention_impl=<impl>, for each implementation
  unscanned    where the config scans repeated blocks (ejax.models.layers.run_blocks), every block
               unrolled (model.scan_layers=False)
  scanned      where the config unrolls them, repeated blocks scanned and rematerialised
               (model.scan_layers=True, model.remat="full": GR00T's default until 2026-11-28)
  graphs       the configured step compiled with train.command_buffers: XLA:GPU puts loops (the
               scanned blocks) and their bodies in CUDA graphs too (ejax.train.step.compiler_options)
  layout_checked  the configured step with train.check_attention_layout: Hopper's attention routes
               in a lax.cond beside ejax's exact kernel (XLA:GPU waits for the device at each), as
               before 2026-11-29's unchecked default
DreamZero's batch has no packed rows: its arms are configured, unscanned and attn_<impl> (the 5B on
accelerators, --dit_layers N to cut its DiT to what one GPU holds; runlocal on CPUs).
Every arm's step is lowered from shapes and compiled in worker threads (XLA compiles outside the GIL):
the first arm compiles alone while the others lower and is timed at once; then the rest compile side
by side (one thread per two cores) and are timed once their compiles have ended (run_arms). Per arm: state-ready seconds (built and on the device; "shared" where the arm before it has
the same state, which it then trains on), compile seconds (beside the other arms' compiles: --startup
times one alone), step ms at the trainer's
cadence (each step dispatched before the last one's loss is read; beside it the median of steps each
waited for on its own), samples/s,
model TFLOP/s and MFU (ejax.train.flops: forward + backward, no recomputation; the device's dense
bf16 peak), peak memory (XLA's buffer assignment of the step). Beside the packing arms it prints the
FLOP bound between them (the same samples' model FLOPs padded vs packed). On a CPU it runs the
runlocal sizes. Last line, the fastest arm's figure (the line before names the arm):
  GR00T-N1.5 train step on <device>: <x> samples/s, MFU <y> % (goal 40 %)

  python benchmarks/train_step.py                       # both models, every arm
  python benchmarks/train_step.py --models groot --arms configured,padded --steps 5
  python benchmarks/train_step.py --startup --config=configs/groot.py

--startup compiles the full-size state and train step from shapes, allocating nothing (as
ejax.train.compile_report does), and prints
  startup configs/groot.py: state <a> s, train step compile <b> s (<device>)
With --unscanned it first compiles the same step in the other block layout (unrolled where the config
scans, scanned and rematerialised where it unrolls: other_layout) and prints that compile beside the
configured one, with both steps' memory (XLA's buffer assignment).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.train_step_arms import (ALL_ARMS, arm_configs, other_layout,  # noqa: E402
                                        unpacked_arm_configs)

GOAL_MFU = 40.0
NAMES = {"groot": "GR00T-N1.5", "pi05": "pi0.5", "dreamzero": "DreamZero"}
CONFIGS = {"groot": "configs/groot.py", "pi05": "configs/pi05.py", "dreamzero": "configs/dreamzero.py"}
STALLED_COMPILES: list[str] = []  # run_arms' arms whose compile had not ended when the others were done


def load_config(path: str, arg: str | None):
  from ejax.train.compile_report import load_config_file
  return load_config_file(os.path.join(REPO, path), arg)


def on_cpu() -> bool:
  return jax.default_backend() == "cpu"


def model_config_for(name: str, dit_layers: int = 0):
  """The config of `name` at the size this machine runs: full on accelerators, runlocal on CPUs
  (DreamZero's DiT cut to `dit_layers` blocks when given)."""
  # On CPUs GR00T's runlocal without the simulator's perception aids (ejax.sim's demonstrations switch
  # them on): the model as released, at CPU size.
  cpu_args = {"groot": "runlocal,dataset=synthetic", "pi05": "runlocal", "dreamzero": "runlocal,dataset=synthetic"}
  config = load_config(CONFIGS[name], cpu_args[name] if on_cpu() else {"dreamzero": "5b"}.get(name))
  config.mesh = dict(data=1, fsdp=-1, tensor=1)
  if name == "dreamzero" and dit_layers:
    config.model.dit.num_layers = dit_layers
  return config


def sample_model_flops(model_config, arrays: dict) -> tuple[float, float]:
  """(model FLOPs a sample, tokens a sample): ejax.train.flops for the packed models, the analytic
  count of benchmarks/dreamzero_scaling.py for DreamZero."""
  if model_config.name == "dreamzero":
    from benchmarks.dreamzero_scaling import sample_flops
    flops = sample_flops(model_config)
    return flops["model"], flops["tokens"]
  from ejax.train import flops as flops_lib
  layout = flops_lib.layout_of_batch(model_config, arrays)
  return flops_lib.train_flops_per_sample(model_config, layout).model, layout.row_tokens


# --- One arm -----------------------------------------------------------------------------------


def state_signature(config, tx, mesh, rules) -> tuple:
  """What makes two arms' train states interchangeable: the tree, shapes, dtypes and shardings of the
  state (from shapes alone); the packing, the compile options and the attention route leave it as it is."""
  from ejax.train.state import abstract_train_state
  return _signature(*abstract_train_state(config.model, config.train, tx, mesh, rules))


def _signature(abstract, shardings) -> tuple:
  leaves, tree = jax.tree.flatten(abstract)
  return (tree, tuple((leaf.shape, str(leaf.dtype)) for leaf in leaves),
          tuple(str(getattr(s, "spec", s)) for s in jax.tree.leaves(shardings)))


@dataclasses.dataclass
class PreparedArm:
  """One arm's step, lowered from the state's shapes, its compile running in a worker thread."""
  config: Any
  arrays: dict          # the example's numpy arrays, on the rows the config trains
  mesh: Any
  rules: list
  tx: Any
  batch: dict           # on the devices
  signature: tuple      # state_signature
  lower_seconds: float
  compile: Callable[[], tuple[Any, float]]          # -> (compiled, compile seconds)
  compiling: concurrent.futures.Future | None = None  # compile() handed to a worker thread


def prepare_arm(config, example: dict) -> PreparedArm:
  """Lowers the arm's train step from shapes (ejax.train.compile_report.lower_train_step); its compile
  is left to run_arms, which runs it in a worker thread: XLA compiles outside the GIL, so arms compile
  side by side (a GPU host's cores compiled GR00T's arms one at a time, ~50 s each, on 2026-11-28)."""
  from ejax.parallel import global_batch, make_mesh
  from ejax.train import rows as embodiment_rows
  from ejax.train.compile_report import lower_train_step
  from ejax.train.step import compiler_options

  mesh = make_mesh(config.mesh.to_dict())
  rules = [tuple(rule) for rule in config.sharding_rules]
  arrays = {k: v for k, v in example.items() if isinstance(v, np.ndarray) and v.dtype != object}
  rows = embodiment_rows.from_train(config.train)
  if rows and "embodiment_id" in arrays:  # the example's samples on the rows the config trains
    arrays["embodiment_id"] = np.resize(np.asarray(rows.rows, np.int32), arrays["embodiment_id"].shape)
  start = time.perf_counter()
  batch = global_batch(arrays, mesh, rules)
  lowered, abstract, shardings, tx = lower_train_step(config, mesh, batch)
  lower_seconds = time.perf_counter() - start
  options = compiler_options(config.train)

  def compile_it():
    begun = time.perf_counter()
    compiled = lowered.compile(options)
    return compiled, time.perf_counter() - begun

  return PreparedArm(config, arrays, mesh, rules, tx, batch, _signature(abstract, shardings), lower_seconds,
                     compile_it)


def compile_workers(arms: int) -> int:
  """Arms compiled at once: one per two cores (XLA's own codegen threads take the rest), eight at most."""
  return max(1, min(arms, (os.cpu_count() or 2) // 2, 8))


def run_arm(prepared: PreparedArm, steps: int, profile_dir: str = "", shared: dict | None = None) -> dict:
  """Builds the state, waits for the arm's compile, times `steps` steps on its batch; a dict of figures
  (with `profile_dir`, also where three more steps spend their time: benchmarks/profile_summary.py).

  With `shared` (a dict kept across arms), an arm whose state has the last arm's signature trains on
  that arm's state instead of building its own (state_shared; ~13 s of a GPU window an arm, 2026-11-28);
  its figures then start from a few steps in, which the timings do not see."""
  from ejax.parallel.rules import sharding_context
  from ejax.train.metrics import peak_flops_per_device
  from ejax.train.state import create_train_state

  config, mesh, rules, batch = prepared.config, prepared.mesh, prepared.rules, prepared.batch
  arrays, signature = prepared.arrays, prepared.signature
  reused = shared is not None and shared.get("signature") == signature
  if shared is not None and not reused:
    shared.clear()  # the last arm's state goes before this one's is made
    gc.collect()
  with mesh, sharding_context(mesh, rules):
    start = time.perf_counter()
    if reused:
      state = shared.pop("state")
    else:
      state, _ = create_train_state(config.model, config.train, prepared.tx, mesh, rules, seed=0)
    jax.block_until_ready(state)
    state_seconds = time.perf_counter() - start
    compiled, compile_seconds = prepared.compiling.result()
    times = []  # each step on its own: dispatch, run, wait
    for i in range(steps + 2):
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics["loss"])
      if i >= 2:  # two warm-up steps
        times.append(time.perf_counter() - start)
    # The trainer's cadence (ejax.train.loop): step i is dispatched before step i-1's loss is read, so
    # the host's dispatch overlaps the device's work. Timed in steady state, as a long run sees it: from
    # the first loss read (the next step already queued) to the last, `steps` steps apart. A mean from
    # the first dispatch on also holds the one dispatch the device waits for (2026-11-29: 107.7 ms
    # over 5 steps that ran 96.5 ms each waited for).
    state, metrics = compiled(state, batch)
    cadence = []
    for _ in range(steps + 1):
      previous, (state, metrics) = metrics, compiled(state, batch)
      float(previous["loss"])
      cadence.append(time.perf_counter())
    jax.block_until_ready(metrics["loss"])
    cadence = [later - earlier for earlier, later in zip(cadence, cadence[1:])]
    trainer_seconds = sum(cadence) / steps
    loss = float(metrics["loss"])
    profile = None
    if profile_dir:
      from benchmarks.profile_summary import describe as describe_profile, profile_steps

      def run_one():
        nonlocal state, metrics
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])

      profile = profile_steps(run_one, 3, profile_dir)
      print(describe_profile(profile), flush=True)
  program = kernel_model(compiled)
  if profile and program and "floor_ms_by_kind" in program:
    profile["measured_vs_floor"] = measured_vs_floor(profile, program)
    print(f"  {profile['measured_vs_floor']}", flush=True)
  memory = compiled.memory_analysis()
  step_bytes = sum(int(getattr(memory, f"{name}_size_in_bytes", 0) or 0) for name in ("argument", "output", "temp"))
  step_bytes -= int(getattr(memory, "alias_size_in_bytes", 0) or 0)
  samples = int(arrays["actions"].shape[0])
  per_sample_model, row_tokens = sample_model_flops(config.model, arrays)
  median = statistics.median(times)
  samples_per_second = samples / trainer_seconds
  model_flops = per_sample_model * samples_per_second
  peak = peak_flops_per_device()
  stats = jax.devices()[0].memory_stats() or {}
  if shared is not None:
    shared.update(signature=signature, state=state)
  del state, compiled
  prepared.compiling = None  # the executable goes with this arm
  gc.collect()
  return dict(
      state_seconds=state_seconds, state_shared=reused, compile_seconds=compile_seconds,
      lower_seconds=prepared.lower_seconds, step_ms=1e3 * trainer_seconds,
      blocked_step_ms=1e3 * median, step_ms_all=[1e3 * t for t in times],
      cadence_step_ms_all=[1e3 * t for t in cadence], samples=samples, samples_per_second=samples_per_second,
      model_tflops=model_flops / 1e12, mfu_percent=(100 * model_flops / (peak * mesh.size)) if peak else None,
      model_flops_per_sample=per_sample_model, row_tokens=row_tokens, loss=loss,
      packing=dict(config.model.get("packing", {})), step_peak_gib=step_bytes / 2**30,
      device_peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30, **({"profile": profile} if profile else {}),
      **({"kernels": program} if program else {}))


def kernel_model(compiled) -> dict | None:
  """On an H100 / H200: what the compiled step launches and the time its work allows
  (ejax.parallel.gpu_program), printed beside the measured step so that a GPU run checks the model."""
  kind = jax.devices()[0].device_kind
  device = next((name for name in ("h200", "h100") if name in kind.lower()), None)
  if device is None:
    return None
  from ejax.parallel import gpu_program
  from ejax.train.compile_report import text_with_operand_shapes
  try:
    summary = gpu_program.read(text_with_operand_shapes(compiled)).summary(device)
  except Exception as error:  # noqa: BLE001 (the model must not cost a GPU window its timings)
    return {"error": f"{type(error).__name__}: {error}"[:300]}
  out = {key: summary[key] for key in ("device", "launches", "syncing_loops", "syncing_conditionals",
                                       "floor_seconds", "launch_seconds",
                                       "estimate_seconds", "calibrated_seconds")}
  out["floor_ms_by_kind"] = {kind: 1e3 * row["floor_seconds"] for kind, row in summary["kinds"].items()}
  return out


# The profile's kinds (benchmarks/profile_summary.py) that the kernel model's kinds correspond to.
PROFILE_KINDS = {"gemm": ("matmul",), "pallas": ("attention",), "fusion": ("fusion",), "copy": ("copy",)}


def measured_vs_floor(profile: dict, kernels: dict) -> str:
  """Per kind of kernel: ms a step in the profile beside the kernel model's floor (where the step's
  time goes past what its work allows)."""
  floors, measured = kernels.get("floor_ms_by_kind", {}), profile.get("by_kind", {})
  parts = []
  for kind, names in PROFILE_KINDS.items():
    ms = sum(measured.get(name, 0.0) for name in names)
    if kind in floors or ms:
      parts.append(f"{kind} {ms:.1f} / {floors.get(kind, 0.0):.1f}")
  return "measured / floor ms a step: " + ", ".join(parts)


def describe(name: str, result: dict) -> str:
  if "error" in result:
    return f"  {name:<16} failed: {result['error']}"
  mfu = f"{result['mfu_percent']:.1f} %" if result["mfu_percent"] is not None else "n/a"
  packing = result["packing"]
  row = f"row {packing.get('row_length')} x {packing.get('samples_per_row')}  " if packing else ""   # DreamZero: no rows
  state = "shared  " if result.get("state_shared") else f"{result['state_seconds']:6.1f} s"
  beside = f"  (timed beside {result['compiles_running']} compiles)" if result.get("compiles_running") else ""
  return (f"  {name:<16} state {state}  compile {result['compile_seconds']:6.1f} s  "
          f"step {result['step_ms']:8.1f} ms ({result.get('blocked_step_ms', result['step_ms']):.1f} each waited for)  "
          f"{result['samples_per_second']:8.1f} samples/s  "
          f"{result['model_tflops']:7.1f} TFLOP/s  MFU {mfu:>7}  {row}({result['row_tokens']:.0f} tokens/sample)  "
          f"step peak {result['step_peak_gib']:.1f} GiB{beside}" + _describe_kernels(result.get("kernels", {})))


def _describe_kernels(kernels: dict) -> str:
  if "launches" not in kernels:
    return ""
  return (f"\n  {'':<16} model of its program: {kernels['launches']:,} launches, "
          f"{kernels.get('syncing_conditionals', 0)} conditionals (each waits for the host outside a CUDA graph), "
          f"floor {1e3 * kernels['floor_seconds']:.1f} ms, with launches {1e3 * kernels['estimate_seconds']:.1f} ms, "
          f"as the timed GR00T step ran {1e3 * kernels['calibrated_seconds']:.1f} ms")


def save_json(path: str, out: dict) -> None:
  if path:
    with open(path, "w") as f:
      json.dump(out, f, indent=1)


def record_arm(results: dict, label: str, prepared: PreparedArm | Exception, steps: int, out: dict, json_path: str,
               profile_dir: str = "", shared: dict | None = None, compiles_running: int = 0) -> None:
  """Runs one arm into results[label], prints it and rewrites the JSON (every figure so far)."""
  try:
    if isinstance(prepared, Exception):
      raise prepared
    results[label] = run_arm(prepared, steps, profile_dir, shared)
    if compiles_running:  # the device was not the arm's own while it was timed
      results[label]["compiles_running"] = compiles_running
  except Exception as error:  # one arm failing (memory, a kernel the device lacks) must not stop the rest
    message = str(error).strip().splitlines()
    results[label] = {"error": f"{type(error).__name__}: {message[0] if message else ''}"[:300]}
    if shared is not None:
      shared.clear()  # its state may be half donated
    gc.collect()
  print(describe(label, results[label]), flush=True)
  save_json(json_path, out)


def run_arms(results: dict, arms: dict, steps: int, out: dict, json_path: str, profile_dir: str = "",
             workers: int = 0, wait_s: float = 300.0) -> None:
  """Every arm (label -> (config, example)) lowered from shapes and compiled in worker threads (XLA
  compiles outside the GIL), each timed on a device no compile is using: a GPU compile autotunes its
  GEMMs on the device, which must not share it with a timed step.

  The first arm compiles alone while the others lower (until its compile ends), then builds its state
  and is timed (and profiled into `profile_dir` when given): the headline figure comes as early as
  when arms ran one after another, its autotuning ran on an idle device, and it fills XLA's in-process
  autotuning cache for the others' GEMMs (mostly the same shapes). Then the rest lower and compile
  side by side, `workers` at a time (compile_workers), and are timed in order once all have ended. A
  compile that has not ended `wait_s` after its wait began (one stalled, as XLA's Triton GEMM
  autotuning did on 2026-11-27) holds back no other arm: the compiled arms are timed (their figures
  say how many compiles still ran) and it comes after them, or is given up on when no compile has
  ended for another `wait_s`. Arms with the same state train on one (run_arm)."""
  workers = workers or compile_workers(len(arms))
  prepared = {}
  start = time.perf_counter()
  pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile")
  first, lower_seconds, to_lower = None, {}, list(arms)

  def lower_next() -> str:
    label = to_lower.pop(0)
    try:
      prepared[label] = prepare_arm(*arms[label])
      lower_seconds[label] = prepared[label].lower_seconds
    except Exception as error:  # noqa: BLE001 (recorded as the arm's figure)
      prepared[label] = error
    return label

  while to_lower and first is None:
    label = lower_next()
    if isinstance(prepared[label], PreparedArm):
      first = label
      prepared[label].compiling = pool.submit(prepared[label].compile)
  # The others lower only while the first compiles: a full-size GR00T arm lowered in 37.6 s on an H200's
  # host (2026-11-29), and lowering all nine before timing the first left no figure in 240 s.
  while to_lower and first is not None and not prepared[first].compiling.done():
    lower_next()
  compiling = {}  # future -> label
  shared = {}     # arms with the same state train on one (run_arm)
  timed = []

  def time_arm(label: str) -> None:
    record_arm(results, label, prepared[label], steps, out, json_path,
               os.path.join(profile_dir, label.replace(" ", "_")) if profile_dir and not timed else "", shared,
               compiles_running=sum(1 for future in compiling if not future.done()))
    prepared[label] = None  # its executable and batch go before the next arm runs
    timed.append(label)

  def time_compiled(labels) -> None:
    for label in labels:
      if label not in timed and (not isinstance(prepared[label], PreparedArm) or prepared[label].compiling.done()):
        time_arm(label)

  if first is not None:
    compiling[prepared[first].compiling] = first
    concurrent.futures.wait(compiling, timeout=wait_s)
    time_compiled([first])
  def compile_lowered() -> None:
    for label, arm in prepared.items():
      if isinstance(arm, PreparedArm) and arm.compiling is None:
        arm.compiling = pool.submit(arm.compile)
        compiling[arm.compiling] = label

  compile_lowered()
  while to_lower:  # the rest lower while the lowered ones compile
    lower_next()
    compile_lowered()
  rest = [future for future, label in compiling.items() if label not in timed]
  concurrent.futures.wait(rest, timeout=wait_s)
  finished = {label: future.result()[1] for future, label in compiling.items()
              if future.done() and not future.exception()}
  if finished:
    each = sum(finished.values()) + sum(lower_seconds[label] for label in finished)
    print(f"  {len(finished)} arms' steps compiled {time.perf_counter() - start:.1f} s after the start, the first alone "
          f"and timed, the rest {min(workers, max(1, len(rest)))} at a time ({each:.1f} s of lowering and "
          f"compiling one after another)" + (f"; {len(rest) - sum(f.done() for f in rest)} still compiling"
                                             if not all(f.done() for f in rest) else ""), flush=True)
  out.setdefault("compile_ahead", {})[",".join(arms)] = dict(
      arms=len(finished), workers=workers, seconds=time.perf_counter() - start)
  time_compiled(list(prepared))  # in their order: failed ones and the compiled rest
  late = {future for future, label in compiling.items() if label not in timed}
  while late:
    ended, late = concurrent.futures.wait(late, timeout=wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
    if not ended:  # stalled: given up on, so that the figure's last line comes
      for future in late:
        results[compiling[future]] = {"error": f"its compile had not ended {wait_s:g} s after the last arm"}
        print(describe(compiling[future], results[compiling[future]]), flush=True)
      save_json(json_path, out)
      break
    time_compiled([label for label in prepared if label in {compiling[future] for future in ended}])
  shared.clear()
  pool.shutdown(wait=False)
  if not all(future.done() for future in compiling):
    STALLED_COMPILES.append(",".join(arms))


def bench_model(name: str, arms: list[str], per_device_batch: int, steps: int, out: dict, json_path: str,
                profile_dir: str = "", dit_layers: int = 0) -> None:
  config = model_config_for(name, dit_layers)
  samples = per_device_batch * jax.device_count()
  results = out.setdefault(name, {})
  print(f"{NAMES[name]} ({'runlocal' if on_cpu() else 'full size'}), {samples} samples a step on "
        f"{jax.device_count()} x {jax.devices()[0].device_kind}:", flush=True)
  run_arms(results, arm_configs(config, arms, samples), steps, out, json_path,
           os.path.join(profile_dir, name) if profile_dir else "")
  for baseline in ("padded", "seed_padded"):
    padded = results.get(baseline, {})
    if "samples_per_second" not in padded:
      continue
    for arm in ("configured", "best_fit"):
      result = results.get(arm, {})
      if "samples_per_second" in result:
        bound = padded["model_flops_per_sample"] / result["model_flops_per_sample"]
        print(f"  {arm}/{baseline}: {result['samples_per_second'] / padded['samples_per_second']:.2f}x "
              f"(FLOP bound {bound:.2f}x)")
  configured = results.get("configured", {})
  for arm, result in results.items():  # issue 31's FP8 goal: an FP8 arm at >= 1.1x the bf16 step
    if arm.startswith("fp8_") and "samples_per_second" in result and "samples_per_second" in configured:
      print(f"  {arm}/configured: {result['samples_per_second'] / configured['samples_per_second']:.2f}x "
            f"(goal 1.1x)")


def dreamzero_by_depth(depths: list[int], per_device_batch: int, steps: int, out: dict, json_path: str) -> str:
  """DreamZero's configured step at each DiT depth (what one GPU holds), a straight line through the
  step times against depth, and the full depth's samples/s from it (issue 32: goal 8 a GPU for the 5B;
  RLinf 4.44)."""
  full = model_config_for("dreamzero").model.dit.num_layers
  samples = per_device_batch * jax.device_count()
  results = out.setdefault("dreamzero", {})
  print(f"DreamZero ({'runlocal' if on_cpu() else '5B'}), {samples} samples a step, DiT cut to {depths} of "
        f"{full} blocks, on {jax.device_count()} x {jax.devices()[0].device_kind}:", flush=True)
  run_arms(results, {f"{depth} blocks": unpacked_arm_configs(model_config_for("dreamzero", depth), ["configured"],
                                                              samples)["configured"] for depth in depths},
           steps, out, json_path)
  timed = [(depth, results[f"{depth} blocks"]["step_ms"]) for depth in depths
           if "step_ms" in results[f"{depth} blocks"]]
  if len(timed) < 2:
    return f"DreamZero train step on {jax.devices()[0].device_kind}: n/a samples/s a device (goal 8)"
  slope, intercept = np.polyfit([d for d, _ in timed], [ms for _, ms in timed], 1)
  step_ms = intercept + slope * full
  results["extrapolated"] = dict(blocks=full, step_ms=step_ms, ms_per_block=slope, ms_outside_blocks=intercept,
                                 samples_per_second=samples / (step_ms / 1e3) / jax.device_count())
  print(f"  {slope:.1f} ms a DiT block, {intercept:.1f} ms outside them: {full} blocks {step_ms:.1f} ms a step")
  return (f"DreamZero train step on {jax.devices()[0].device_kind}: "
          f"{results['extrapolated']['samples_per_second']:.2f} samples/s a device at {full} DiT blocks, "
          f"from {', '.join(str(d) for d, _ in timed)} (goal 8; RLinf 4.44)")


# --- Startup -----------------------------------------------------------------------------------


def startup(config_path: str, per_device_batch: int, unscanned: bool = False) -> str:
  """Compiles the state and the step from shapes; the startup line."""
  from ejax.checkpoint import abstract_target
  from ejax.parallel import make_mesh
  from ejax.train.compile_report import abstract_batch
  from ejax.parallel.rules import sharding_context
  from ejax.train.optim import make_optimizer
  from ejax.train.state import compile_state_init, model_parts, plan_train_state
  from ejax.train.step import jit_train_step, make_train_step

  path, _, arg = config_path.partition(":")
  config = load_config(path, arg or None)
  mesh = make_mesh(config.mesh.to_dict())
  rules = [tuple(rule) for rule in config.sharding_rules]
  tx, schedule = make_optimizer(config.train)
  start = time.perf_counter()
  plan = plan_train_state(config.model, config.train, tx, mesh, rules)
  planned = time.perf_counter() - start
  state_report = compile_state_init(plan)
  state_seconds = planned + state_report["lower_seconds"] + state_report["compile_seconds"]
  batch = abstract_batch(config.model, per_device_batch * mesh.size, mesh, rules,
                         int(config.train.grad_accum_steps))
  abstract_state = abstract_target(plan.abstract, plan.shardings)

  def compile_step(model_config):
    step = jit_train_step(make_train_step(model_parts(model_config), tx, schedule, config.train), plan.shardings,
                          {k: v.sharding for k, v in batch.items()}, mesh)
    start, cpu_start = time.perf_counter(), time.process_time()
    with mesh, sharding_context(mesh, rules):
      compiled = step.lower(abstract_state, batch).compile()
    memory = compiled.memory_analysis()
    return (time.perf_counter() - start, time.process_time() - cpu_start,
            int(getattr(memory, "temp_size_in_bytes", 0) or 0) / 2**30)

  other_name, other = other_layout(config.model) if unscanned else ("", None)
  if other is not None:
    other_seconds, other_cpu, other_temp = compile_step(other)
  step_seconds, step_cpu, temp = compile_step(config.model)
  if other is not None:  # CPU seconds: what a shared machine's load does not inflate
    print(f"  train step compile: configured {step_seconds:.1f} s ({step_cpu:.1f} CPU s), {other_name} "
          f"{other_seconds:.1f} s ({other_cpu:.1f} CPU s): {other_cpu / step_cpu:.2f}x the CPU; "
          f"temporaries {temp:.1f} / {other_temp:.1f} GiB a device")
  print(f"  state: model built from shapes {planned:.1f} s; {state_report['host_initialised']} parameters drawn on "
        f"the host (no program), {state_report['device_initialised']} in {state_report['device_groups']} device "
        f"init groups; {state_report['programs']} programs lowered {state_report['lower_seconds']:.1f} s, "
        f"compiled {state_report['compile_seconds']:.1f} s")
  return (f"startup {config_path}: state {state_seconds:.1f} s, train step compile {step_seconds:.1f} s "
          f"({jax.devices()[0].device_kind})")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="groot,pi05")
  parser.add_argument("--arms", default=",".join(ALL_ARMS),
                      help="configured, padded, best_fit, fp8 (every FP8 route) or fp8_<impl>, attn (every "
                           "attention implementation) or attn_<impl>")
  parser.add_argument("--per_device_batch", type=int, default=0,
                      help="samples a step per device (0: 32 for GR00T and 8 for pi0.5 on GPUs, 8 on CPUs)")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per arm (after two warm-up steps)")
  parser.add_argument("--json", default="", help="write every figure here (rewritten after each arm)")
  parser.add_argument("--startup", action="store_true", help="compile the state and step from shapes only")
  parser.add_argument("--config", default="configs/groot.py", help="--startup: the config (':arg' allowed)")
  parser.add_argument("--profile", default="",
                      help="trace three more steps of each model's first arm here and print where the time goes")
  parser.add_argument("--unscanned", action="store_true",
                      help="--startup: also compile the step in the other block layout (other_layout), side by side")
  parser.add_argument("--dit_layers", default="0",
                      help="DreamZero: cut the 5B's DiT to this many blocks (0: all 30); two or more, e.g. "
                           "2,6: time the configured step at each depth and extrapolate to the full depth")
  parser.add_argument("--cache", action="store_true",
                      help="use the persistent compilation cache (off: every figure is a cold compile)")
  args = parser.parse_args(argv)
  if args.cache:
    from ejax.config.runtime import enable_compilation_cache
    enable_compilation_cache("~/.cache/ejax/xla")
  if args.startup:
    line = startup(args.config, args.per_device_batch or 32, args.unscanned)
    if args.json:
      with open(args.json, "w") as f:
        json.dump({"line": line}, f)
    print(line)
    return
  out = {"device": jax.devices()[0].device_kind, "devices": jax.device_count(), "jax": jax.__version__,
         "date": time.strftime("%Y-%m-%d %H:%M")}
  arms = [a for a in args.arms.split(",") if a]
  unknown = sorted(a for a in arms if a not in ALL_ARMS and a.split("_")[0] not in ("fp8", "attn"))
  if unknown:
    raise SystemExit(f"--arms {','.join(unknown)}: not one of {','.join(ALL_ARMS)}")
  depths = [int(n) for n in args.dit_layers.split(",") if n]
  depth_line = None
  for name in [m for m in args.models.split(",") if m]:
    default_batch = 8 if on_cpu() or name == "pi05" else 32
    if name == "dreamzero" and len(depths) > 1:
      depth_line = dreamzero_by_depth(depths, args.per_device_batch or default_batch, args.steps, out, args.json)
      continue
    bench_model(name, arms, args.per_device_batch or default_batch, args.steps, out, args.json, args.profile,
                depths[0] if depths else 0)
  headline = "groot" if "groot" in out else next((m for m in NAMES if m in out), "groot")
  if depth_line and headline == "dreamzero":  # DreamZero by depth alone: its extrapolation is the figure
    line = depth_line
  else:
    if depth_line:
      print(depth_line)
    # The fastest arm's figure; the line before names it (an FP8 or packing arm may beat the default).
    best_arm, best = max(((arm, r) for arm, r in out.get(headline, {}).items()
                          if isinstance(r, dict) and "samples_per_second" in r),
                         key=lambda item: item[1]["samples_per_second"], default=(None, None))
    if best_arm:
      print(f"fastest {NAMES[headline]} arm: {best_arm}")
      out["best_arm"] = best_arm
    samples = f"{best['samples_per_second']:.1f}" if best else "n/a"
    mfu = f"{best['mfu_percent']:.1f}" if best and best["mfu_percent"] is not None else "n/a"
    line = (f"{NAMES[headline]} train step on {out['device']}: {samples} samples/s, MFU {mfu} % "
            f"(goal {GOAL_MFU:.0f} %)")
  out["line"] = line
  save_json(args.json, out)
  print(line, flush=True)
  if STALLED_COMPILES:  # a compile thread still running would hold the interpreter's exit until the limit
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
  main()
