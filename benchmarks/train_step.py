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
  no_graphs    the configured step without CUDA graphs (train.cuda_graphs False): every kernel launched
               from the host on its own
  layout_checked  the configured step with train.check_attention_layout: Hopper's attention routes
               in a lax.cond beside ejax's exact kernel (XLA:GPU waits for the device at each), as
               before 2026-11-29's unchecked default
DreamZero's batch has no packed rows: its arms are configured, unscanned and attn_<impl> (the 5B on
accelerators, --dit_layers N to cut its DiT to what one GPU holds; runlocal on CPUs).
Every arm's step is lowered from shapes and compiled in worker threads (XLA compiles outside the GIL):
the first arm compiles alone while the others lower and is timed at once; then the rest compile side
by side (one thread per two cores) and are timed once their compiles have ended (train_step_run.py).
Per arm: state-ready seconds (built and on the device; "shared" where the arm before it has the same
state, which it then trains on), compile seconds (beside the other arms' compiles: --startup times one
alone), step ms at the trainer's cadence (each step dispatched before the last one's loss is read;
the median interval, as a long run sees it: the other arms' lowering in this process stalls the host
once in a while; beside it the median of steps each waited for on its own and the call's own
dispatch time), samples/s,
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
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.train_step_arms import (ALL_ARMS, arm_configs, other_layout,  # noqa: E402
                                        unpacked_arm_configs)
from benchmarks.train_step_run import STALLED_COMPILES, run_arms, save_json  # noqa: E402

GOAL_MFU = 40.0
NAMES = {"groot": "GR00T-N1.5", "pi05": "pi0.5", "dreamzero": "DreamZero"}
CONFIGS = {"groot": "configs/groot.py", "pi05": "configs/pi05.py", "dreamzero": "configs/dreamzero.py"}


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
    with sharding_context(mesh, rules):
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


def add_xla_flags(flags: str) -> None:
  """Appends `flags` to XLA_FLAGS. XLA reads them once, when the first backend starts: a flag of the
  client (the allocator) as well as of each program's compile."""
  from jax._src import xla_bridge
  if xla_bridge.backends_are_initialized():
    raise SystemExit(f"--xla_flags {flags}: jax's backend has already started in this process; XLA would not "
                     "read them")
  os.environ["XLA_FLAGS"] = " ".join(part for part in (os.environ.get("XLA_FLAGS", "").strip(), flags) if part)


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
  parser.add_argument("--xla_flags", default="",
                      help="XLA flags appended to XLA_FLAGS before the backend starts: a process-wide setting, "
                           "timed as a run of its own (e.g. --xla_gpu_command_buffer_update_mode=SKIP_TEMP)")
  args = parser.parse_args(argv)
  if args.xla_flags:
    add_xla_flags(args.xla_flags)
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
         "date": time.strftime("%Y-%m-%d %H:%M"), "xla_flags": os.environ.get("XLA_FLAGS", "")}
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
