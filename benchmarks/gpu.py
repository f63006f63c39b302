"""Every GPU figure in one command, for a short window on a bare GPU machine.

GPU time comes in short windows (minutes) on a machine that starts bare: an image with jax 0.11.x
and CUDA but without ml-collections, mujoco or grain, and no network. This script installs what the
image lacks from wheels carried beside the checkout (.whl/, made by benchmarks/download_wheels.py), then
runs each figure's benchmark in its own process under its own time limit, most important first,
skipping what no longer fits the total budget, and writes all.json and most figures' own JSON to --out.
First it checks auto's Hopper attention routes (check_routes) and leaves out of the figures one that
fails. The figures:

  attention   benchmarks/attention.py at 8 x 4,096 tokens, 16 heads x 128, every implementation
  attention_profile  attention.py --profile_kernel: mosaic_own's kernels under Mosaic GPU's on-device
              profiler, the cycles of each of their scopes (waits, wgmmas, softmax) per warpgroup
  train_step_no_graphs  benchmarks/train_step.py: GR00T-N1.5's step with every kernel launched from the
              host (no CUDA graphs), beside the train_step figure's configured arm
  mosaic_own_check  attention.py --check_variants: whether mosaic_own's gradients and values are right
              under each setting of its GPU code path at head sizes 64 and 128
  train_step  benchmarks/train_step.py: GR00T-N1.5's full-size train step, configured (profiled: ms a
              step per kind of op, the top kernels, the host's spans; XLA's log of the CUDA graphs it
              re-records, summed up), all-FP8
  train_step_pi05  the same for pi0.5: configured, its scanned decoders in CUDA graphs (graphs), FP8
                   (fp8_xla_delayed)
  dispatch    benchmarks/dispatch.py: how long a train-step call holds the host, on the TrainState
              against on its leaves (GR00T's full state structure, no device work)
  fp8         benchmarks/fp8.py: FP8 vs bf16 GEMMs at the DiT and LLM shapes, every FP8 route
  packing     benchmarks/packing.py, the GPU-sized case
  sim         benchmarks/sim.py --gpu: MJX batches
  serve       benchmarks/serve.py: served vs in-process chunks per second
  startup     benchmarks/train_step.py --startup: full GR00T state and step compiled from shapes
  train_step_more, train_step_pi05_more  the two models' other arms (FP8 routes, seed-padded, scanned,
              padded)
  dreamzero   benchmarks/train_step.py --models dreamzero --dit_layers 2,6: the 5B's step at two DiT
              depths one GPU holds, extrapolated to its 30 blocks (issue 32; 10.3 samples/s on an
              H200, 2026-11-29)

A window's first call fits the route check, the attention figure, the profile, train_step_no_graphs and
the variant checks (~8 minutes), then starts train_step in what is left of its budget; a second call
runs the rest with `--only`, e.g. `--only train_step,train_step_pi05 --skip_route_check --budget 235`
(on 2026-11-30 train_step's four arms took 225 s).

  python benchmarks/download_wheels.py        # here, once: the wheels into .whl/ (git-ignored)
  python benchmarks/gpu.py --out $OUT/gpu     # there: ~9 minutes, then record BENCHMARKS.md
  python benchmarks/gpu.py --smoke            # any machine: the same figures at CPU sizes, seconds each

The last line: `GPU figures: <n> of <m> ran (goal all)`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(REPO, ".whl")
SITE = "/tmp/ejax-site"
# Modules ejax imports that the GPU image lacks (its jax, optax, orbax, numpy, safetensors stay).
PROFILE = "/tmp/ejax-profile"  # traces stay on the machine; their summary goes into the figure's JSON
KERNEL_PROFILE = "/tmp/ejax-kernel-profile"  # the same for attention_profile's Mosaic GPU trace
NEEDED = ("ml_collections", "grain", "mujoco", "mujoco.mjx", "tensorboardX", "websockets", "openpi_client",
          "tokenizers")

# XLA's log of each CUDA graph it re-records before a run (command_buffer_thunk.cc at VLOG level 3): the
# allocations whose addresses moved since the last run, and how long the re-recording took.
_UPDATE = re.compile(r"Update command buffer on device #\d+ .*?after (\d+) executions.*?num_commands=(\d+); "
                     r"updated_allocs=(\d+)")
_UPDATED = re.compile(r"Updated command buffer in (\d+) \S+; num_commands=(\d+)")
COMMAND_BUFFER_LOG = (("TF_CPP_VMODULE", "command_buffer_thunk=3"), ("TF_CPP_MIN_LOG_LEVEL", "0"))


@dataclasses.dataclass(frozen=True)
class Figure:
  name: str
  args: tuple[str, ...]          # on a GPU
  smoke_args: tuple[str, ...]    # --smoke: CPU-sized
  limit: float                   # seconds on a GPU
  json_flag: bool = True         # the script takes --json PATH
  own_file: bool = True          # its JSON beside all.json (a device call brings back 8 files at most)
  smoke_limit: float = 0         # --smoke: seconds (0: twice the GPU limit)
  env: tuple[tuple[str, str], ...] = ()  # on a GPU: more environment for its process


FIGURES = (
    # Attention, the one goal still unmet (forward 300 TFLOP/s; 276.5 and 283.3 on the evening of 2026-12-04,
    # forward+backward 212 against 200), first: the block-causal rows' arms, pallas, mosaic_own as
    # configured, the form before 2026-12-04 as the control, the forward with each edge masked alone and
    # the unneeded halves of its 128-key edge tiles skipped (together, apart, persistent), the variants
    # closest on that evening, the mosaic route, the rest; the causal rows after them are cut off at the limit. Each arm's calls are timed back
    # to back (the call-by-call figure beside). The dense baseline (4.4-4.8x, two windows) is skipped.
    Figure("attention", ("benchmarks/attention.py", "--rows", "8", "--row_length", "4096", "--heads", "16",
                         "--head_dim", "128", "--skip_dense"),
           ("benchmarks/attention.py", "--rows", "1", "--row_length", "1024", "--heads", "2", "--repeats", "1"), 150),
    # Where mosaic_own's kernels spend their cycles (2026-11-30: ~2 us a 64-key forward step whose wgmmas
    # take ~0.5): the forward and backward once under Mosaic GPU's on-device profiler, each kernel's
    # scopes' cycles per warpgroup. One of the figure's eight rows (512 forward CTAs, ~4 waves on 132
    # SMs) keeps the three traces near half a million events, which Python writes and reads in
    # seconds. Not in --smoke: the profiler runs on a GPU only (tests/kernels/test_kernel_profile.py
    # reads a trace written by jax's own dumper).
    # The forward with each edge masked alone and the unneeded halves of its edge tiles skipped
    # (mosaic_forward.MASK_EACH_EDGE, EDGE_HALVES), timed beside the configured one and profiled: on the evening of 2026-12-04 the configured 128-key forward's
    # step took 3,378 cycles against 2,048 of wgmmas, and a quarter of an item was outside its steps.
    Figure("attention_profile", ("benchmarks/attention.py", "--rows", "1", "--row_length", "4096", "--heads", "16",
                                 "--head_dim", "128", "--profile_kernel", KERNEL_PROFILE, "--profile_variant",
                                 "each edge masked alone, 128-key tiles' unneeded halves skipped"), (), 75,
           own_file=False),
    # GR00T's step with no CUDA graph (train.cuda_graphs False: every kernel launched from the host), the
    # train_step figure's second arm until 2026-12-04, cut by its limit in three windows. At the cadence the
    # configured step takes 77-78 ms against ~49 ms of kernels, and the ~28 ms between them stayed when the
    # call's hold on the host fell from 58 to 38, 30 and (graphs' temporary buffers at fixed addresses,
    # XLA's SKIP_TEMP, 2026-12-04 evening) 15 ms: whether the gaps come with the graphs is what this tells,
    # against train_step's configured arm of the same window. Its 2,036 launches from the host are priced
    # at ~10 ms.
    Figure("train_step_no_graphs", ("benchmarks/train_step.py", "--models", "groot", "--arms", "no_graphs",
                                    "--steps", "8"),
           ("benchmarks/train_step.py", "--models", "groot", "--arms", "no_graphs", "--steps", "1"), 150,
           own_file=False),
    # mosaic_own's gradients and values under each setting that changes its GPU code path, at head sizes
    # 64 and 128, each line printed as it is done: first the gradients as configured and under head size
    # 128's defaults at 64 too with each edge masked alone and the unneeded halves skipped (MASK_EACH_EDGE,
    # EDGE_HALVES, which no GPU has run; without them right at 64 on the evening of 2026-12-04), then the mosaic route's backward variants, then the
    # forward's load-once control (0.86-0.88 off at 64 on 2026-12-04, the configured form right). Not in
    # --smoke: interpret mode takes ~13 s a forward case and ~40 s a backward one
    # (tests/kernels/test_attention_mosaic.py runs the forms at small sizes).
    Figure("mosaic_own_check", ("benchmarks/attention.py", "--check_variants", "--row_length", "1024"), (), 120,
           own_file=False),
    # On an H200 (2026-11-29) the configured full-size GR00T arm lowered in 37.6 s, compiled in 80 s
    # alone and built its state in 12.8 s; the 5-arm list of that window timed none in 240 s (the arms
    # all lowered before the first was timed, since fixed in train_step_run.run_arms). The first arm compiles
    # alone while the next ones lower and is timed (profiled) at once; the rest then compile side by
    # side on the host's cores and run, each on the last arm's state where it has the same one. Two
    # arms: configured (profiled, with each call's dispatch: the step on its leaves, first timed), then
    # fp8_all (1.18x in both 2026-11-30 windows); no_graphs is train_step_no_graphs's. Each arm's
    # figures are saved as it ends. With XLA's command-buffer log on: how many allocations moved before
    # each graph run and how long re-recording took (the call held the host 30.5 ms, 15.1 with
    # SKIP_TEMP, on the evening of 2026-12-04), summed up in the figure's JSON. seed_padded (1.33x twice), fp8_frozen (1.12x) and the others
    # are `train_step_more`'s.
    Figure("train_step", ("benchmarks/train_step.py", "--models", "groot", "--arms",
                          "configured,fp8_all", "--steps", "8", "--profile", PROFILE),
           ("benchmarks/train_step.py", "--models", "groot", "--arms", "configured,padded", "--steps", "1",
            "--profile", PROFILE), 300, env=COMMAND_BUFFER_LOG),
    # pi0.5 (2026-11-30: 38.3-38.7 samples/s; its call held the host 207.4 of its 208.7 ms). Its two
    # Gemma decoders are each one lax.scan, a while loop whose body XLA:GPU launches kernel by kernel
    # from the host outside CUDA graphs (5,838 launches a step): its `graphs` arm (train.command_buffers:
    # the loops in CUDA graphs, unrolled there) goes first, then the FP8 arm (model.fp8 with delayed
    # scaling, priced 1.09-1.15x). fp8_xla_delayed_fastacc and fp8_xla are train_step_pi05_more's.
    Figure("train_step_pi05", ("benchmarks/train_step.py", "--models", "pi05", "--arms",
                               "configured,graphs,fp8_xla_delayed", "--steps", "5"),
           (), 150),  # --smoke: the same script as train_step's
    # How long a train-step call holds the host, on the TrainState against on its leaves (what the step
    # is jitted over since 2026-11-30: on that evening's H200 GR00T's call held the host 58.2 of its
    # 78.2 ms and pi0.5's 207.4 of 208.7). Seconds: the full state's structure from shapes, 4-element leaves.
    Figure("dispatch", ("benchmarks/dispatch.py",),
           ("benchmarks/dispatch.py", "--config", "configs/tiny.py:runlocal", "--calls", "3"), 40, json_flag=False,
           own_file=False),
    # fp8.py stops starting arms after --budget_s, so its last line comes inside the limit.
    Figure("fp8", ("benchmarks/fp8.py", "--budget_s", "40"), ("benchmarks/fp8.py", "--tokens", "128"), 60),
    Figure("packing", ("benchmarks/packing.py", "--width", "1024", "--depth", "8", "--heads", "8", "--samples", "192",
                       "--padded_batch", "32", "--rows_per_batch", "8"),
           ("benchmarks/packing.py", "--samples", "8", "--padded_batch", "4", "--rounds", "1", "--width", "32",
            "--depth", "1"), 50, json_flag=False),
    # sim.py --gpu runs MJX's GPU batches first: on 2026-11-30 the host's native rows took the 40 s limit.
    Figure("sim", ("benchmarks/sim.py", "--gpu"), ("benchmarks/sim.py", "--quick", "--tasks", "2", "--camera-envs", "2",
                                                   "--camera-steps", "1", "--camera-rounds", "1"), 60, json_flag=False,
           smoke_limit=240),
    Figure("serve", ("benchmarks/serve.py", "--seconds", "3", "--rounds", "1"),
           ("benchmarks/serve.py", "--clients", "1", "2", "--seconds", "0.5", "--rounds", "1"), 35, json_flag=False,
           own_file=False, smoke_limit=180),  # at CPU size its compile alone took 63 s at load 9
    # The compile from shapes, after the figures the issue lists: the train_step figure's configured arm
    # already times a state made on the GPU (the <= 20 s goal) and a compile of its own (the first
    # arm compiles alone).
    Figure("startup", ("benchmarks/train_step.py", "--startup", "--config=configs/groot.py"),
           ("benchmarks/train_step.py", "--startup", "--config=configs/tiny.py:runlocal", "--per_device_batch", "4"),
           100, own_file=False),  # the full step's compile alone took 73 s on an H200
    # GR00T's other arms: the trained feed-forwards' FP8 (model.fp8 with delayed scaling, priced 1.05x),
    # the seed's padded rows and the frozen towers' FP8 again (1.33x and 1.12x on 2026-11-30), the
    # scanned blocks (the default until 2026-11-28), one sample a row of 384 (the 2026-11-28 baseline:
    # 1.18x) and the attention layout checked on device (0.97x on 2026-11-30).
    Figure("train_step_more", ("benchmarks/train_step.py", "--models", "groot", "--arms",
                               "configured,fp8_xla_delayed,seed_padded,fp8_frozen,scanned,padded,layout_checked",
                               "--steps", "8"),
           (), 300),  # --smoke: the same script as train_step's
    Figure("train_step_pi05_more", ("benchmarks/train_step.py", "--models", "pi05", "--arms",
                                    "configured,fp8_xla_delayed_fastacc,fp8_xla", "--steps", "5"), (), 200),
    Figure("dreamzero", ("benchmarks/train_step.py", "--models", "dreamzero", "--dit_layers", "2,6", "--steps", "3"),
           ("benchmarks/train_step.py", "--models", "dreamzero", "--dit_layers", "1,2", "--steps", "1"), 240),
)


# Before the figures, each of auto's Hopper attention routes (ops.HOPPER_AUTO, in order) is checked
# on small rows in a process of its own (`attention.py --check`: values and gradients against impl
# xla), until one for every head size passes. A route that fails, is off or hangs is left out of every later figure through
# EJAX_HOPPER_AUTO: every GR00T arm takes auto's route, and a route never run on a GPU (the mosaic
# route's backward, restructured on 2026-11-29) could otherwise cost the whole window.
ROUTE_CHECK_LIMIT = 60.0
FALLBACK_ROUTE = "pallas"  # ejax's Triton kernel: measured in every window


def hopper_routes(env: dict) -> list[str]:
  """auto's Hopper routes: $EJAX_HOPPER_AUTO, else HOPPER_AUTO read from ops.py's source (nothing imported)."""
  if env.get("EJAX_HOPPER_AUTO", "").strip():
    return [part.strip() for part in env["EJAX_HOPPER_AUTO"].split(",") if part.strip()]
  with open(os.path.join(REPO, "ejax", "kernels", "attention", "ops.py")) as f:
    tree = ast.parse(f.read())
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "HOPPER_AUTO" for t in node.targets):
      return list(ast.literal_eval(node.value))
  raise SystemExit("benchmarks/gpu.py: ejax/kernels/attention/ops.py defines no HOPPER_AUTO")


def check_routes(out_dir: str, env: dict, limit: float, run=None) -> dict:
  """Checks auto's Hopper routes in order until one for every head size passes (a route limited to
  head sizes, "mosaic_own@128", hands the others on, so the checks go on past it); a route that fails
  is dropped: env's EJAX_HOPPER_AUTO is then set to the routes that passed and those after the last one
  checked (FALLBACK_ROUTE where no route for every head size passed). Returns {route: the check's line
  or its failure}."""
  run = run or run_figure
  routes, report, kept = hopper_routes(env), {}, []
  for index, route in enumerate(routes):
    figure = Figure(f"route_{route}", ("benchmarks/attention.py", "--check", route, "--row_length", "1024"), (),
                    limit, own_file=False)
    result = run(figure, out_dir, limit, False, env)
    report[route] = (result.get("line") or "") + ("  [timed out]" if result.get("timed_out") else "")
    if result.get("returncode") == 0:
      if "@" not in route:
        kept += routes[index:]
        break
      kept.append(route)
  else:
    kept.append(FALLBACK_ROUTE)
  if kept != routes:
    env["EJAX_HOPPER_AUTO"] = ",".join(kept)
  if "EJAX_HOPPER_AUTO" in env:
    report["EJAX_HOPPER_AUTO"] = env["EJAX_HOPPER_AUTO"]
    print(f"--- attention routes: EJAX_HOPPER_AUTO={env['EJAX_HOPPER_AUTO']} for the figures", flush=True)
  return report


def missing_modules() -> list[str]:
  out = []
  for name in NEEDED:
    try:
      if importlib.util.find_spec(name) is None:
        out.append(name)
    except ModuleNotFoundError:
      out.append(name)
  return out


def install_wheels() -> str:
  """Installs .whl/*.whl (and tokamax's, .whl/tokamax/*.whl) into SITE when the image lacks a module;
  the PYTHONPATH the figures run with. The image's flax stays unless it cannot import on its jax; then
  the carried flax 0.12.12 (.whl/tokamax/flax/) goes in (flax 0.12.6, the CPU pin, cannot import on 0.11)."""
  path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
  missing = missing_modules()
  if not missing:
    return path
  wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")) + glob.glob(os.path.join(WHEELS, "tokamax", "*.whl")))
  if not wheels:
    raise SystemExit(f"this python lacks {', '.join(missing)} and {WHEELS} holds no wheels: run "
                     "`python benchmarks/download_wheels.py` where pip reaches PyPI and carry .whl along")
  start = time.time()
  pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
         "--upgrade", "--target", SITE]
  subprocess.run(pip + wheels, check=True)
  flax_ok = subprocess.run([sys.executable, "-c", "import flax.nnx"], capture_output=True).returncode == 0
  fallback = glob.glob(os.path.join(WHEELS, "tokamax", "flax", "*.whl"))
  if not flax_ok and fallback:
    subprocess.run(pip + fallback, check=True)
  print(f"installed {len(wheels)} wheels into {SITE} in {time.time() - start:.0f} s"
        f"{'' if flax_ok else ' (and the carried flax: the image' + chr(39) + 's did not import)'}", flush=True)
  return os.pathsep.join((REPO, SITE, os.environ.get("PYTHONPATH", ""))).rstrip(os.pathsep)


def environment() -> dict:
  info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": sys.version.split()[0]}
  for command in (["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.sm,temperature.gpu",
                   "--format=csv,noheader"], ["uptime"]):
    try:
      info[command[0]] = subprocess.run(command, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
      info[command[0]] = f"unavailable: {error}"
  return info


GPU_SAMPLE = ("nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,utilization.gpu",
              "--format=csv,noheader,nounits", "-lms", "1000")


def start_gpu_samples():
  """nvidia-smi writing the GPU's SM clock, power, temperature and use once a second (None without it):
  whether a figure ran at full clocks (2026-11-29: GR00T's steps slowed from 93 to 98 ms waited for)."""
  try:
    return subprocess.Popen(GPU_SAMPLE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  except OSError:
    return None


def gpu_samples_summary(process) -> dict:
  """The samples' range: SM clock MHz (min / median / max), power W (max), temperature C (max), use % (median)."""
  if process is None:
    return {}
  process.terminate()
  try:
    text, _ = process.communicate(timeout=10)
  except subprocess.TimeoutExpired:
    process.kill()
    text, _ = process.communicate()
  rows = []
  for line in text.splitlines():
    try:
      rows.append([float(part) for part in line.split(",")])
    except ValueError:
      continue
  if not rows:
    return {}
  column = lambda i: sorted(row[i] for row in rows)
  clocks, use = column(0), column(3)
  return {"samples": len(rows), "sm_clock_mhz": [clocks[0], clocks[len(clocks) // 2], clocks[-1]],
          "power_w_max": column(1)[-1], "temperature_c_max": column(2)[-1], "utilization_median": use[len(use) // 2]}


def last_figure_line(output: str, stdout: str = "") -> str:
  """The benchmark's `<figure>: <value> (goal <goal>)` line (the last line that has one), else the last
  line it printed to stdout (the startup line), else the output's last. `output` holds stderr too, whose
  warnings come after stdout (jax 0.12 printed a DeprecationWarning there)."""
  lines = [line for line in output.strip().splitlines() if "(goal" in line]
  return lines[-1] if lines else (stdout.strip().splitlines() or output.strip().splitlines() or [""])[-1]


def command_buffer_updates(output: str) -> dict:
  """What XLA's command-buffer log (COMMAND_BUFFER_LOG) says of the graphs re-recorded in a run: how many
  times, the allocations that moved each time, the commands and the microseconds each re-recording took
  (medians, and the largest); {} where the log has none."""
  updates = [tuple(map(int, found.groups())) for found in _UPDATE.finditer(output)]
  timed = [tuple(map(int, found.groups())) for found in _UPDATED.finditer(output)]
  if not updates and not timed:
    return {}
  median = lambda values: float(sorted(values)[len(values) // 2]) if values else 0.0
  return dict(updates=len(updates), executions_between_median=median([u[0] for u in updates]),
              updated_allocs_median=median([u[2] for u in updates]),
              commands_median=median([u[1] for u in updates] or [t[1] for t in timed]),
              update_us_median=median([t[0] for t in timed]), update_us_max=float(max((t[0] for t in timed), default=0)))


def run_figure(figure: Figure, out_dir: str, limit: float, smoke: bool, env: dict) -> dict:
  path = os.path.join(out_dir, f"{figure.name}.json")
  args = list(figure.smoke_args if smoke else figure.args)
  data_path = os.path.join(out_dir, f".{figure.name}.data.json")
  if figure.json_flag:
    args += ["--json", data_path]
  command = [sys.executable, *args]
  print(f"--- {figure.name}: {' '.join(args)} (limit {limit:.0f} s)", flush=True)
  start, sampler = time.time(), (None if smoke else start_gpu_samples())
  try:
    done = subprocess.run(command, cwd=REPO, env={**env, **({} if smoke else dict(figure.env))}, capture_output=True,
                          text=True, timeout=limit)
    stdout, code, timed_out = done.stdout, done.returncode, False
    output = stdout + done.stderr
  except subprocess.TimeoutExpired as error:
    stdout = ((error.stdout or b"").decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or ""))
    output = stdout + ((error.stderr or b"").decode(errors="replace") if isinstance(error.stderr, bytes) else (error.stderr or ""))
    code, timed_out = None, True
  seconds = time.time() - start
  # tokamax logs one line per kernel shape its autotuning cache lacks (thousands of characters each)
  output = "\n".join(line for line in output.splitlines() if "Autotuning cache miss" not in line)
  updates = command_buffer_updates(output)  # and XLA's command-buffer log, summed up, one line a graph run
  output = "\n".join(line for line in output.splitlines() if "command_buffer_thunk.cc" not in line)
  result = {"name": figure.name, "command": " ".join(args), "returncode": code, "timed_out": timed_out,
            "seconds": round(seconds, 1), "line": last_figure_line(output, stdout), "output": output[-20000:],
            "gpu": gpu_samples_summary(sampler)}
  if updates:
    result["command_buffer_updates"] = updates
  if os.path.exists(data_path):
    with open(data_path) as f:
      result["data"] = json.load(f)
    os.remove(data_path)
  if figure.own_file:
    with open(path, "w") as f:
      json.dump(result, f, indent=1)
  tail = "\n".join(output.strip().splitlines()[-25:])
  print(tail, flush=True)
  if updates:
    print(f"CUDA graphs re-recorded {updates['updates']} times: {updates['updated_allocs_median']:.0f} allocations moved "
          f"(median), {updates['commands_median']:.0f} commands, {updates['update_us_median'] / 1e3:.1f} ms a "
          f"re-recording (median; most {updates['update_us_max'] / 1e3:.1f})", flush=True)
  status = "timed out" if timed_out else f"exit {code}"
  print(f"--- {figure.name}: {status} after {seconds:.0f} s" + (f"; GPU {json.dumps(result['gpu'])}" if result["gpu"] else ""),
        flush=True)
  return result


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "gpu"))
  parser.add_argument("--budget", type=float, default=560.0, help="seconds for all figures together")
  parser.add_argument("--only", default="", help="figures to run, comma-separated (default: all)")
  parser.add_argument("--smoke", action="store_true", help="CPU-sized arguments, short limits (the CPU test)")
  parser.add_argument("--limits", default="", help="per-figure seconds, e.g. train_step=170,fp8=60")
  parser.add_argument("--skip_route_check", action="store_true",
                      help="take auto's Hopper attention routes unchecked (a window that checked them already)")
  args = parser.parse_args(argv)
  deadline = time.time() + args.budget
  os.makedirs(args.out, exist_ok=True)
  env = dict(os.environ, PYTHONPATH=install_wheels(), PYTHONUNBUFFERED="1")
  # cuBLAS for every GEMM: XLA's Triton GEMM autotuning stalled the FP8 figure's compiles on the first
  # H200 window (2026-11-27); the second ran with this (MaxText sets it for GPUs too). The train step
  # compiles with the same option of its own (train.triton_gemm False), as the train job does.
  if not args.smoke:
    env.setdefault("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false")
  summary = {"environment": environment(), "figures": {}}
  print(json.dumps(summary["environment"], indent=1), flush=True)
  if not args.smoke and not args.skip_route_check:
    summary["attention_routes"] = check_routes(args.out, env, ROUTE_CHECK_LIMIT)
  chosen = [f for f in FIGURES if (not args.only or f.name in args.only.split(",")) and (f.smoke_args or not args.smoke)]
  limits = {name: float(seconds) for name, _, seconds in (part.partition("=") for part in args.limits.split(",") if part)}
  chosen = [dataclasses.replace(f, limit=limits.get(f.name, f.limit)) for f in chosen]
  for figure in chosen:
    left = deadline - time.time()
    limit = min((figure.smoke_limit or 2 * figure.limit) if args.smoke else figure.limit, left)
    if limit < 15:
      summary["figures"][figure.name] = {"skipped": f"{left:.0f} s of the budget left"}
      print(f"--- {figure.name}: skipped, {left:.0f} s of the budget left", flush=True)
      continue
    summary["figures"][figure.name] = run_figure(figure, args.out, limit, args.smoke, env)
  for name, result in summary["figures"].items():
    if next(f for f in FIGURES if f.name == name).own_file:
      result.pop("output", None)
    elif "output" in result:
      result["output"] = result["output"][-4000:]
  with open(os.path.join(args.out, "all.json"), "w") as f:
    json.dump(summary, f, indent=1)
  print("\n=== figures")
  if "attention_routes" in summary:
    print(f"attention routes checked: {json.dumps(summary['attention_routes'])}")
  for name, result in summary["figures"].items():
    print(f"{name:>11}: {result.get('line') or result.get('skipped')}"
          f"{'  [timed out]' if result.get('timed_out') else ''}")
  ran = sum(1 for r in summary["figures"].values() if r.get("returncode") == 0)
  print(f"GPU figures: {ran} of {len(chosen)} ran (goal all)")


if __name__ == "__main__":
  main()
