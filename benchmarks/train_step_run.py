"""How benchmarks/train_step.py times its arms: each arm's step lowered from shapes and compiled in a
worker thread, its state built (or the last arm's reused), its steps timed each waited for and at the
trainer's cadence, and the figures (samples/s, model TFLOP/s, MFU, memory, the kernel model of its
program on an H100 / H200) recorded per arm (run_arms, run_arm)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import json
import os
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np

STALLED_COMPILES: list[str] = []  # run_arms' arms whose compile had not ended when the others were done


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
  with sharding_context(mesh, rules):
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
    # `dispatch`: how long the call itself holds the host (what a host-bound cadence is made of; on the
    # H200 of 2026-11-30 GR00T's device was busy 49 ms of a 79 ms cadence). The step is the median
    # interval: a one-off stall of the host (~0.4-0.6 s once an arm on 2026-11-30, while the other
    # arms lowered in this process's threads and held the GIL) is not the trainer's steady state, and
    # the mean of 8 intervals carried it (fp8_all's 115.8 ms mean of intervals of 59-73 ms).
    state, metrics = compiled(state, batch)
    cadence, dispatch = [], []
    for _ in range(steps + 1):
      start = time.perf_counter()
      previous, (state, metrics) = metrics, compiled(state, batch)
      dispatch.append(time.perf_counter() - start)
      float(previous["loss"])
      cadence.append(time.perf_counter())
    jax.block_until_ready(metrics["loss"])
    cadence = [later - earlier for earlier, later in zip(cadence, cadence[1:])]
    trainer_seconds = statistics.median(cadence)
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
      cadence_step_ms_all=[1e3 * t for t in cadence], cadence_mean_ms=1e3 * sum(cadence) / len(cadence),
      dispatch_ms=1e3 * statistics.median(dispatch), samples=samples, samples_per_second=samples_per_second,
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
          f"step {result['step_ms']:8.1f} ms ({result.get('blocked_step_ms', result['step_ms']):.1f} each waited for"
          + (f", {result['dispatch_ms']:.1f} dispatching" if "dispatch_ms" in result else "") + ")  "
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
