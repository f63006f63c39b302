"""benchmarks/gpu.py, the one prepared GPU run, at CPU sizes: every figure runs, writes its JSON, and
the train-step benchmark's arms and startup line come out with numbers (issue 31, points 1 and 2)."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.train.helpers import REPO


@pytest.mark.timeout(900)
def test_every_gpu_figure_runs_at_cpu_size(tmp_path):
  out = tmp_path / "gpu"
  # One CPU device, as a GPU machine has one GPU a process; compiled as the suite compiles (tests/conftest.py:
  # level 1 here, and jax_disable_most_optimizations inherited): the figures at CPU sizes are compile-bound.
  env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=1"}
  done = subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", "--out", str(out), "--budget", "840"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=880)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  names = ("dispatch", "train_step", "train_step_no_graphs", "attention", "fp8", "startup", "packing", "sim",
           "serve", "dreamzero")  # pi0.5's: train_step's script
  summary = json.loads((out / "all.json").read_text())
  for name in names:
    own = out / f"{name}.json"
    figure = json.loads(own.read_text()) if own.exists() else summary["figures"][name]
    assert figure["returncode"] == 0, f"{name}: {figure['output'][-2000:]}"
    assert "(goal" in figure["line"] or name == "startup", f"{name}: {figure['line']}"
    assert summary["figures"][name]["returncode"] == 0
  assert len(list(out.iterdir())) <= 8  # what one device call brings back
  assert done.stdout.strip().splitlines()[-1] == f"GPU figures: {len(names)} of {len(names)} ran (goal all)"

  train_step = json.loads((out / "train_step.json").read_text())
  arms = train_step["data"]["groot"]
  for arm in ("configured", "padded"):
    assert arms[arm]["samples_per_second"] > 0 and arms[arm]["compile_seconds"] > 0, arms[arm]
    assert arms[arm]["state_seconds"] >= 0 and arms[arm]["step_peak_gib"] > 0
    assert arms[arm]["model_flops_per_sample"] > 0 and arms[arm]["loss"] == arms[arm]["loss"]  # finite
  # The padded arm has the configured arm's state (only the rows differ), so it trains on that one.
  assert arms["configured"]["state_seconds"] > 0 and not arms["configured"]["state_shared"]
  assert arms["padded"]["state_shared"]
  # Both arms were lowered from shapes and compiled before either was timed (run_arms).
  assert train_step["data"]["compile_ahead"]["configured,padded"]["arms"] == 2
  assert arms["configured"]["lower_seconds"] > 0
  profile = arms["configured"]["profile"]  # where the step's time goes, from a jax.profiler trace
  assert profile["device_busy_ms"] > 0 and profile["top"] and sum(profile["by_kind"].values()) > 0
  # The padded arm computes more row tokens per sample than the packed one.
  assert arms["padded"]["row_tokens"] > arms["configured"]["row_tokens"]
  assert re.fullmatch(r"GR00T-N1\.5 train step on cpu: [0-9.]+ samples/s, MFU n/a % \(goal 40 %\)", train_step["line"])

  dreamzero = json.loads((out / "dreamzero.json").read_text())  # two DiT depths, a line through them
  extrapolated = dreamzero["data"]["dreamzero"]["extrapolated"]
  assert extrapolated["samples_per_second"] > 0 and "ms_per_block" in extrapolated, extrapolated
  assert re.fullmatch(r"DreamZero train step on cpu: [0-9.]+ samples/s a device at \d+ DiT blocks, from 1, 2 "
                      r"\(goal 8; RLinf 4\.44\)", dreamzero["line"])

  dispatch = summary["figures"]["dispatch"]["line"]  # the step's call on the TrainState and on its leaves
  assert re.fullmatch(r"train-step call on cpu, configs/tiny\.py:runlocal's state \(\d+ leaves\): [0-9.]+ ms on its "
                      r"leaves against [0-9.]+ ms on the TrainState: [0-9.]+x less \(goal 3x\)", dispatch), dispatch

  startup = summary["figures"]["startup"]
  assert re.fullmatch(r"startup configs/tiny\.py:runlocal: state [0-9.]+ s, train step compile [0-9.]+ s \(cpu\)",
                      startup["line"]), startup["line"]


def test_profile_summary_counts_innermost_device_ops_once():
  """A loop's span encloses the ops it runs: the summary counts the ops, per step, by kind; a GPU
  trace's device streams are read, not the host's threads."""
  from benchmarks.profile_summary import summarize
  meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/host:CPU")),
          dict(ph="M", name="process_name", pid=2, args=dict(name="/device:GPU:0")),
          dict(ph="M", name="thread_name", pid=2, tid=7, args=dict(name="Stream #13"))]
  ops = [dict(ph="X", pid=2, tid=7, ts=0, dur=1000, name="while.3"),
         dict(ph="X", pid=2, tid=7, ts=0, dur=600, name="sm90_xmma_gemm_bf16", args=dict(hlo_op="dot.1")),
         dict(ph="X", pid=2, tid=7, ts=600, dur=400, name="loop_add_fusion", args=dict(hlo_op="add_fusion.2")),
         dict(ph="X", pid=2, tid=7, ts=2000, dur=600, name="sm90_xmma_gemm_bf16", args=dict(hlo_op="dot.1")),
         dict(ph="X", pid=2, tid=7, ts=2600, dur=200, name="ncclAllGather", args=dict(hlo_op="all-gather.4")),
         dict(ph="X", pid=1, tid=1, ts=0, dur=9000, name="PjitFunction(step)")]
  summary = summarize(meta + ops, steps=2, step_seconds=[0.002, 0.002])
  assert summary["device_busy_ms"] == (600 + 400 + 600 + 200) / 1e3 / 2
  assert summary["by_kind"] == {"matmul": 0.6, "fusion": 0.2, "collective": 0.1}
  assert summary["top"][0] == dict(name="sm90_xmma_gemm_bf16", hlo_op="dot.1", kind="matmul", calls=1.0,
                                   ms_per_step=0.6)
  # The host's spans, inclusive, per step: where the time goes when the device waits on the host.
  assert summary["host"] == [dict(name="PjitFunction(step)", calls=0.5, ms_per_step=4.5)]


def test_profile_summary_reads_kernel_names_inside_cuda_graphs():
  """jaxlib 0.11 runs most of a step as CUDA graphs: every kernel's HLO op is `command_buffer_N`, so the
  kind comes from the kernel's name (as on the 2026-11-28 H200 trace, where all of it read "other")."""
  from benchmarks.profile_summary import summarize
  meta = [dict(ph="M", name="process_name", pid=2, args=dict(name="/device:GPU:0"))]
  names = ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "dkv_kernel_mosaic_gpu_kernel",
           "flash_attention_sm90_mosaic_gpu_kernel", "loop_select_fusion_13", "loop_concatenate_fusion_8")
  ops = [dict(ph="X", pid=2, tid=7, ts=1000 * i, dur=500, name=name, args=dict(hlo_op="command_buffer_207"))
         for i, name in enumerate(names)]
  summary = summarize(meta + ops, steps=1, step_seconds=[0.005])
  assert summary["by_kind"] == {"attention": 1.0, "copy": 0.5, "matmul": 0.5, "fusion": 0.5}


def test_train_step_sets_the_profile_beside_the_kernel_models_floor():
  from benchmarks.train_step_run import measured_vs_floor
  line = measured_vs_floor({"by_kind": {"matmul": 60.0, "attention": 8.0, "fusion": 30.0, "other": 1.0}},
                           {"floor_ms_by_kind": {"gemm": 39.5, "fusion": 22.5, "pallas": 2.8}})
  assert line == "measured / floor ms a step: gemm 60.0 / 39.5, pallas 8.0 / 2.8, fusion 30.0 / 22.5"


def test_the_layout_arms_flip_blocks_between_scanned_and_unrolled():
  """GR00T's full config unrolls its blocks, so its comparison arm is the scanned, rematerialised
  layout it had before; DreamZero's 5B scans, so its arm unrolls."""
  from benchmarks.train_step import load_config
  from benchmarks.train_step_arms import other_layout
  groot = load_config("configs/groot.py", None).model
  assert (groot.scan_layers, groot.remat) == (False, "none")
  name, other = other_layout(groot)
  assert name == "scanned" and (other.scan_layers, other.remat) == (True, "full")
  assert (groot.scan_layers, groot.remat) == (False, "none")  # a copy, the config unchanged
  name, other = other_layout(load_config("configs/dreamzero.py", "5b").model)
  assert name == "unscanned" and other.scan_layers is False


def test_the_graphs_arms_are_the_configured_step_with_loops_in_cuda_graphs_or_no_graph_at_all():
  from benchmarks.train_step import load_config
  from benchmarks.train_step_arms import arm_configs
  arms = arm_configs(load_config("configs/pi05.py", "runlocal"), ["configured", "graphs", "no_graphs"], 2)
  (configured, batch), (graphs, graphs_batch) = arms["configured"], arms["graphs"]
  assert graphs.train.command_buffers and not configured.train.command_buffers
  assert graphs.model == configured.model and batch.keys() == graphs_batch.keys()
  no_graphs = arms["no_graphs"][0]  # the same step with no CUDA graph at all
  assert configured.train.cuda_graphs and not no_graphs.train.cuda_graphs and not no_graphs.train.command_buffers
  assert no_graphs.model == configured.model


def test_the_layout_checked_arm_is_the_configured_step_with_the_attention_layout_checked():
  from benchmarks.gpu import FIGURES
  from benchmarks.train_step import load_config
  from benchmarks.train_step_arms import arm_configs
  arms = arm_configs(load_config("configs/groot.py", "runlocal"), ["configured", "layout_checked"], 2)
  (configured, _), (checked, _) = arms["configured"], arms["layout_checked"]
  assert checked.train.check_attention_layout and not configured.train.check_attention_layout
  assert checked.model == configured.model
  groot = next(f for f in FIGURES if f.name == "train_step_more").args  # measured in the first figure once
  assert "layout_checked" in groot[groot.index("--arms") + 1].split(",")


def test_the_fp8_frozen_arm_is_the_configured_step_with_frozen_fp8_copies():
  from benchmarks.train_step import load_config
  from benchmarks.train_step_arms import arm_configs
  arms = arm_configs(load_config("configs/groot.py", "runlocal"), ["configured", "fp8"], 2)
  (configured, _), (frozen, _) = arms["configured"], arms["fp8_frozen"]
  assert frozen.train.frozen_fp8 and not configured.train.frozen_fp8 and frozen.model == configured.model
  assert {"fp8_xla", "fp8_xla_delayed", "fp8_frozen", "fp8_all"} <= arms.keys() and arms["fp8_xla"][0].model.fp8
  assert not arms["fp8_xla"][0].train.frozen_fp8 and not frozen.model.fp8
  both = arms["fp8_all"][0]
  assert both.train.frozen_fp8 and both.model.fp8 and both.model.fp8_impl == "xla_delayed"
  from benchmarks.gpu import FIGURES  # the first figure times both halves' whole, the later one the frozen half
  arms_of = lambda name: next(f for f in FIGURES if f.name == name).args
  groot, more = arms_of("train_step"), arms_of("train_step_more")
  assert "fp8_all" in groot[groot.index("--arms") + 1].split(",")
  assert "fp8_frozen" in more[more.index("--arms") + 1].split(",")
  # and a figure of its own, right after attention, times the step without CUDA graphs (cut as
  # train_step's second arm in three windows)
  no_graphs = arms_of("train_step_no_graphs")
  assert no_graphs[no_graphs.index("--arms") + 1] == "no_graphs"
  assert [f.name for f in FIGURES].index("train_step_no_graphs") < [f.name for f in FIGURES].index("train_step")


def test_arms_share_a_state_only_where_its_shapes_agree():
  from benchmarks.train_step_run import state_signature
  from ejax.parallel import make_mesh
  from ejax.train.optim import make_optimizer
  from tests.train.helpers import tiny_config

  def signature(config):
    rules = [tuple(rule) for rule in config.sharding_rules]
    return state_signature(config, make_optimizer(config.train)[0], make_mesh(config.mesh.to_dict()), rules)

  config = tiny_config()
  graphs = tiny_config()
  graphs.train.command_buffers = True
  wider = tiny_config()
  wider.model.width = 64
  assert signature(config) == signature(graphs)
  assert signature(config) != signature(wider)


def _scheduled_arms(monkeypatch, compiles: dict, wait_s: float) -> dict:
  """run_arms over arms whose compiles are `compiles[label]()` and whose timing is a stand-in (the
  real arms run in the smoke test above): the order and figures run_arms gives them."""
  from benchmarks import train_step_run as train_step

  def prepare(config, example):
    return train_step.PreparedArm(config, {}, None, [], None, {}, ("state",), 0.01, compiles[config])

  def run(prepared, steps, profile_dir="", shared=None):
    return dict(state_seconds=0.0, state_shared=False, compile_seconds=prepared.compiling.result()[1], step_ms=1.0,
                samples_per_second=1.0, model_tflops=0.0, mfu_percent=None, packing={}, row_tokens=1.0,
                step_peak_gib=0.0)

  monkeypatch.setattr(train_step, "prepare_arm", prepare)
  monkeypatch.setattr(train_step, "run_arm", run)
  monkeypatch.setattr(train_step, "STALLED_COMPILES", [])
  results = {}
  train_step.run_arms(results, {label: (label, {}) for label in compiles}, 1, {"groot": results}, "",
                      workers=2, wait_s=wait_s)
  return results


def test_a_stalled_compile_holds_back_no_other_arm(monkeypatch):
  """An arm whose compile has not ended `wait_s` after its wait began is timed after the others, which
  are timed meanwhile and say that a compile still ran beside them (run_arms). Here the stalled arm is
  the first, which compiles alone: the others' compiles start `wait_s` later."""
  import time

  slow = lambda: (time.sleep(2.0), ("compiled", 2.0))[1]
  quick = lambda: ("compiled", 0.01)
  results = _scheduled_arms(monkeypatch, {"configured": slow, "padded": quick, "best_fit": quick}, wait_s=0.5)
  assert list(results) == ["padded", "best_fit", "configured"], results
  assert results["padded"]["compiles_running"] == 1 and results["best_fit"]["compiles_running"] == 1
  assert "compiles_running" not in results["configured"]


def test_a_compile_that_never_ends_is_given_up_on(monkeypatch):
  import threading

  from benchmarks import train_step_run as train_step

  release = threading.Event()
  try:
    results = _scheduled_arms(monkeypatch, {"configured": lambda: ("compiled", 0.01),
                                            "padded": lambda: (release.wait(), ("compiled", 9.0))[1]}, wait_s=0.5)
  finally:
    release.set()
  # The first arm compiled alone and was timed before the others' compiles began.
  assert results["configured"]["samples_per_second"] == 1.0 and "compiles_running" not in results["configured"]
  assert results["padded"] == {"error": "its compile had not ended 0.5 s after the last arm"}
  assert train_step.STALLED_COMPILES == ["configured,padded"]


def test_the_first_arm_is_timed_before_the_others_compile(monkeypatch):
  """The first arm compiles alone and is timed on a device no compile uses; the rest compile after."""
  events = []

  def compile_of(label):
    return lambda: (events.append(f"compile {label}"), ("compiled", 0.01))[1]

  from benchmarks import train_step_run as train_step
  real_record = train_step.record_arm
  monkeypatch.setattr(train_step, "record_arm", lambda results, label, *args, **kwargs: (
      events.append(f"time {label}"), real_record(results, label, *args, **kwargs))[1])
  results = _scheduled_arms(monkeypatch, {name: compile_of(name) for name in ("configured", "padded", "scanned")},
                            wait_s=5.0)
  assert events[:2] == ["compile configured", "time configured"], events
  assert events[-2:] == ["time padded", "time scanned"] and list(results) == ["configured", "padded", "scanned"]


def test_an_attention_route_that_fails_its_check_is_left_out_of_the_figures(tmp_path):
  """gpu.py checks auto's Hopper routes in order before its figures and stops at the first that passes
  for every head size (a route limited to head sizes, "mosaic_own@128", hands the others on, so the
  checks go on past it); one that fails or hangs is dropped for every later figure (EJAX_HOPPER_AUTO),
  and ejax's Triton kernel takes over when none for every head size passes."""
  from benchmarks import gpu
  from ejax.kernels.attention import ops

  assert gpu.hopper_routes({}) == list(ops.HOPPER_AUTO)  # read from ops.py's source
  assert gpu.hopper_routes({"EJAX_HOPPER_AUTO": "tokamax_fwd, pallas"}) == ["tokamax_fwd", "pallas"]

  def runner(outcomes, calls):
    def run(figure, out_dir, limit, smoke, env):
      route = figure.args[figure.args.index("--check") + 1]
      calls.append(route)
      code, timed_out = outcomes[route]
      return {"returncode": code, "timed_out": timed_out, "line": f"attention route {route}: ..."}
    return run

  # The defaults: the first route for every head size passes, and nothing else is checked.
  env, calls = {}, []
  gpu.check_routes(str(tmp_path), env, 5.0, run=runner({ops.HOPPER_AUTO[0]: (0, False)}, calls))
  assert "@" not in ops.HOPPER_AUTO[0] and calls == [ops.HOPPER_AUTO[0]] and "EJAX_HOPPER_AUTO" not in env

  # A route limited to head sizes, then routes for all of them.
  routes = ("mosaic_own@128", "mosaic", "tokamax_fwd")
  first, second, third = routes
  given = ",".join(routes)
  after_first = ",".join(routes[1:])  # the routes from the one that passed on
  last_fails = {route: (1, False) for route in routes}
  for outcomes, calls_wanted, env_wanted in (
      ({first: (0, False), second: (0, False)}, [first, second], given),          # the list stands
      ({first: (1, False), second: (0, False)}, [first, second], after_first),    # off, or an error
      ({first: (None, True), second: (0, False)}, [first, second], after_first),  # hung
      ({first: (0, False), second: (1, False), third: (0, False)}, [first, second, third], f"{first},{third}"),
      ({**last_fails, first: (0, False)}, list(routes), f"{first},{gpu.FALLBACK_ROUTE}"),
      (last_fails, list(routes), gpu.FALLBACK_ROUTE)):
    env, calls = {"EJAX_HOPPER_AUTO": given}, []
    report = gpu.check_routes(str(tmp_path), env, 5.0, run=runner(outcomes, calls))
    assert calls == calls_wanted and env.get("EJAX_HOPPER_AUTO") == env_wanted, (outcomes, calls, env)
    assert set(calls) <= set(report) and report.get("EJAX_HOPPER_AUTO") == env_wanted
  assert "[timed out]" in gpu.check_routes(str(tmp_path), {"EJAX_HOPPER_AUTO": given}, 5.0, run=runner(
      {first: (None, True), second: (0, False)}, []))[first]


def test_the_route_check_compares_values_and_gradients_with_xla():
  """attention.py --check ROUTE: one line, exit status 0 when the route's values and gradients are
  within tolerance of impl xla in fp32 over the train step's kinds of call (here pallas, in Pallas
  interpret mode on the CPU)."""
  done = subprocess.run([sys.executable, "benchmarks/attention.py", "--check", "pallas", "--row_length", "1024"], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  line = done.stdout.strip().splitlines()[-1]
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert re.fullmatch(r"attention route pallas: ok on cpu, float32 \(error of values/gradients against xla in "
                      r"fp32: block-causal .*, causal .*, segments .*, cross .*; tolerance 1e-04\)", line), line
  wrong = subprocess.run([sys.executable, "benchmarks/attention.py", "--check", "nonsense"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
  assert wrong.returncode == 1 and "attention route nonsense: fails: ValueError" in wrong.stderr, wrong.stderr[-500:]


def test_the_gpu_samples_beside_a_figure_give_its_clock_and_power_range():
  """gpu.py samples nvidia-smi once a second during each figure: the SM clock's range says whether a
  figure's steps ran at full clocks. Lines it cannot read are skipped; without nvidia-smi, nothing."""
  from benchmarks import gpu

  class Sampler:
    def terminate(self):
      self.stopped = True

    def communicate(self, timeout=None):
      return "1980, 650.5, 61, 99\n1755, 700.1, 70, 100\n[N/A], [N/A], 65, 0\n1830, 690.0, 66, 98\n", ""

  assert gpu.gpu_samples_summary(Sampler()) == {"samples": 3, "sm_clock_mhz": [1755.0, 1830.0, 1980.0],
                                                "power_w_max": 700.1, "temperature_c_max": 70.0,
                                                "utilization_median": 99.0}
  assert gpu.gpu_samples_summary(None) == {}


def test_a_figure_line_is_found_before_the_warnings_printed_after_it():
  """A figure's line is its last `(goal` line, else the last line it printed to stdout: warnings on
  stderr come after it in the output (jax 0.12's `with mesh:` deprecation did, and the startup
  figure's line became the warning's source line)."""
  from benchmarks import gpu

  stdout = "state: built\nstartup configs/groot.py: state 1.6 s, train step compile 45.7 s (cpu)\n"
  stderr = "train_step.py:181: DeprecationWarning: `with mesh:` is deprecated\n  with mesh, sharding_context(mesh, rules):\n"
  assert gpu.last_figure_line(stdout + stderr, stdout) == stdout.splitlines()[-1]
  figure = "attention: 179.1 TFLOP/s (goal 300)\n"
  assert gpu.last_figure_line(figure + "more\n" + stderr, figure + "more\n") == figure.strip()
  assert gpu.last_figure_line("only stderr\n") == "only stderr"


def test_the_profiled_attention_variant_is_one_the_figure_times():
  """gpu.py's attention_profile names any mosaic_own variant it profiles by label: a label the attention
  figure's variants no longer carry would end that figure in one line on the GPU, not here."""
  from benchmarks.attention_variants import MOSAIC_OWN_VARIANTS
  from benchmarks.gpu import FIGURES
  profile = next(f for f in FIGURES if f.name == "attention_profile")
  assert "--profile_kernel" in profile.args
  if "--profile_variant" in profile.args:
    assert profile.args[profile.args.index("--profile_variant") + 1] in dict(MOSAIC_OWN_VARIANTS)


def test_a_profiled_ring_steps_bound_counts_its_keys():
  """The profile's bound for a ring step is its wgmmas at 4,096 flops a clock: a forward step of 128 keys
  (head size 128's tiles) needs twice a 64-key one's (on 2026-12-04 the 64-key bound was printed for it)."""
  from benchmarks.attention_variants import step_bound_cycles
  from ejax.kernels.attention import mosaic_backward, mosaic_forward
  assert step_bound_cycles("forward", 128, [(mosaic_forward, "BLOCK_KV", 128)]) == 2048
  assert step_bound_cycles("forward", 128, [(mosaic_forward, "BLOCK_KV", 64)]) == 1024
  assert step_bound_cycles("forward", 64, [(mosaic_forward, "BLOCK_KV", 64)]) == 512
  assert step_bound_cycles("dQ", 128) == 1536
  assert step_bound_cycles("dK/dV", 128, [(mosaic_backward, "DKV_WGS", 2)]) == 2048

def test_train_step_xla_flags_reach_xla_only_before_the_backend_starts(tmp_path):
  """train_step.py --xla_flags: a process-wide XLA setting (such as XLA's command-buffer update mode
  SKIP_TEMP, a GPU figure on 2026-12-04) appended to XLA_FLAGS before the backend starts; here a dump folder shows
  XLA read it. Once the backend has started it says so in one line instead of running unchanged."""
  script = f"""
import sys
sys.path.insert(0, {REPO!r})
from benchmarks.train_step import add_xla_flags
add_xla_flags("--xla_dump_to={tmp_path / 'dump'}")
import jax
jax.jit(lambda x: x + 1)(1.0)
add_xla_flags("--xla_dump_to=/nonexistent")
"""
  done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                        env={**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=1"})
  assert done.returncode == 1 and "jax's backend has already started" in done.stderr, done.stderr[-2000:]
  assert any((tmp_path / "dump").iterdir())


def test_xlas_command_buffer_log_is_summed_up_and_kept_out_of_the_figures_output():
  """The train_step figure runs with XLA's command-buffer log (gpu.COMMAND_BUFFER_LOG): each graph run's
  re-recording is summed up (how often, the allocations that moved, the milliseconds), and the log's
  lines stay out of the output, whose last lines carry the figure."""
  from benchmarks import gpu

  log = "".join(
      f"I1205 10:00:0{i}.000000    2614 command_buffer_thunk.cc:262] Update command buffer on device #0 by recoding "
      f"command buffer cmd sequence after 1 executions since last update; num_commands=2036; updated_allocs={moved}\n"
      f"I1205 10:00:0{i}.000001    2614 command_buffer_thunk.cc:280] Updated command buffer in {us} \u03bcs; "
      f"num_commands=2036\n" for i, (moved, us) in enumerate([(812, 14200), (13, 900), (812, 15100)]))
  assert gpu.command_buffer_updates(log) == dict(
      updates=3, executions_between_median=1.0, updated_allocs_median=812.0, commands_median=2036.0,
      update_us_median=14200.0, update_us_max=15100.0)
  assert gpu.command_buffer_updates("no log here\n") == {}
  figure = next(f for f in gpu.FIGURES if f.name == "train_step")
  assert dict(figure.env)["TF_CPP_VMODULE"] == "command_buffer_thunk=3"
  script = "import sys; sys.stderr.write(sys.argv[1]); print('step: 77.4 ms (goal 40 %)')"
  fake = gpu.Figure("fake", ("-c", script, log), (), 30, json_flag=False, own_file=False, env=gpu.COMMAND_BUFFER_LOG)
  result = gpu.run_figure(fake, "/tmp", 30, False, dict(os.environ))
  assert result["command_buffer_updates"]["updates"] == 3
  assert "command_buffer_thunk" not in result["output"] and result["line"] == "step: 77.4 ms (goal 40 %)"
