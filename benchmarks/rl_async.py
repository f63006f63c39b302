"""RL-VLA3 throughput: the asynchronous pipeline against its synchronous baseline, same work, replaying
the recorded timings of ejax's real components.

Both arms run the same code (ejax.rl.pipeline.RLPipeline), the same total env steps, batch per
update and number of updates; the synchronous arm is eta = 0 with a barrier at every step.

Trace-driven (the default). benchmarks/traces/rl_components.json holds per-stage timings measured
alone on this machine by benchmarks/rl_trace.py: native MuJoCo chunk steps of 16 envs per ejax.sim
task with and without cameras (resets of finished episodes included), the GR00T-runlocal RL actor's
inference at each padded batch size, the learner's update over the runlocal batch (and the same for
the state-based MLP actor). Each setting (SETTINGS below) lays a pipeline over them: every shard
sleeps the traced chunk-step times of its task, the inference server's sampler and the learner's
update are padded to traced durations (ejax.rl.trace.Replay), on a cheap env and policy whose own
work is small beside them. "colocated" puts the server and the learner on one device (their work
serialised), "separated" on devices of their own. Besides the measured ratio it prints the bound
the trace allows (ejax.rl.trace.speedup_bound: the synchronous round time against the busiest
resource of the asynchronous pipeline, all from the trace).

Run:  python benchmarks/rl_async.py                 (no arguments: groot_colocated, then the headline
                                                     groot_separated; ~7 min on 2 CPUs)
      python benchmarks/rl_async.py --setting all    (every setting of SETTINGS; ~20 min)
      python benchmarks/rl_async.py --synthetic      (the earlier lognormal-delay case on the toy task)
      python benchmarks/rl_async.py --scaling 1,2,4  (the headline setting on 1, 2 and 4 local processes,
                                                     jax.distributed, each with its own shards and server)
Goal: the trace-driven ratio >= 90 % of its printed bound (the seed: +59 % on LIBERO, +126.67 %
= 2.27x with tuned separation; BENCHMARKS.md says which setting is which).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from ejax.models.tiny import default_config as tiny_config  # noqa: E402
from ejax.rl.delays import ideal_async_speedup  # noqa: E402
from ejax.rl.inference import batch_buckets  # noqa: E402
from ejax.rl.pipeline import RLPipeline, default_config, shard_delay_specs  # noqa: E402
from ejax.rl.point_env import PointReach  # noqa: E402
from ejax.rl.policy import tiny_flow_policy  # noqa: E402
from ejax.rl.trace import Replay, Setting, Trace, speedup_bound  # noqa: E402

GOAL = 2.27
GOAL_OF_BOUND = 0.9
DEFAULT_TRACE = os.path.join(REPO, "benchmarks", "traces", "rl_components.json")
nnx.use_eager_sharding(False)  # parameters carry logical names; placement comes from the pipeline

LIFT = ("goal_lift_green_block",)
# Four LIBERO-like suites' tasks of different cost: a shard per task.
MIXED = ("goal_open_drawer", "object_lift_cylinder", "spatial_stack_left_on_right", "goal_lift_green_block")
SETTINGS = {setting.name: setting for setting in [
    Setting("groot_runlocal", actor="groot", cameras=True, tasks=LIFT, placement="colocated", full_batch_only=True,
            description="configs/rl_vla3.py:runlocal,actor=groot exactly: 4 shards x 16 envs of the lift with "
                        "cameras, GR00T inference and learner on one device (rl.placement's default), every "
                        "batch padded to all shards (rl.inference_full_batch_only)"),
    Setting("groot_colocated", actor="groot", cameras=True, tasks=LIFT, placement="colocated", full_batch_only=False,
            description="4 shards x 16 envs of the lift with cameras, GR00T inference and learner on one device "
                        "(rl.placement's default: the reading of the seed's LIBERO +59 %), batches padded to "
                        "the next bucket only (rl.inference_full_batch_only=False)"),
    Setting("groot_separated", actor="groot", cameras=True, tasks=LIFT, placement="separated", full_batch_only=False,
            description="4 shards x 16 envs of the lift with cameras, GR00T server and learner on devices of "
                        "their own (rl.placement.inference_device / learner_devices disjoint: the seed's tuned "
                        "separation, 2.27x), batches padded to the next bucket only"),
    Setting("groot_mixed8_separated", actor="groot", cameras=True, tasks=MIXED, placement="separated",
            num_shards=8, full_batch_only=False,
            description="separated as groot_separated, 8 shards over 4 tasks (drawer, cylinder lift, stacking, "
                        "block lift)"),
    Setting("mlp_mixed", actor="mlp", cameras=False, tasks=MIXED, placement="colocated", full_batch_only=True,
            description="the state-based MLP actor (the config's default), no cameras, a task per shard "
                        "(drawer, cylinder lift, stacking, block lift)"),
]}
DEFAULT_SETTINGS = ("groot_colocated", "groot_separated")  # the last one is the headline


def toy_policy_and_env():
  model_config = tiny_config()
  model_config.update(width=32, depth=1, num_heads=2, state_dim=8, action_dim=2, horizon=4, num_tasks=4,
                      num_inference_steps=4)
  policy = tiny_flow_policy(model_config, rngs=nnx.Rngs(0), value_hidden=32)
  env = PointReach(num_tasks=4, state_dim=8, action_dim=2, max_steps=24)
  return policy, env


def warm_up(policy, env, make_config, num_shards: int, envs_per_shard: int) -> None:
  """Compiles everything the timed runs call: env functions, the learner update, and the sampler
  at every batch bucket for both the initial and the updated (non weak-typed) parameters."""
  for mode in ("sync", "async"):
    config = make_config(mode)
    config.update(num_updates=2, shard_delays=[])
    config.delay.update(kind="none")
    pipeline = RLPipeline(config, env, policy)
    pipeline.run()
  observation = {key: np.asarray(value) for key, value in
                 jax.vmap(env.reset)(jax.random.split(jax.random.key(0), envs_per_shard * num_shards)).obs.items()}
  for params in (policy.initial_params, pipeline.local_learner_params()):
    for bucket in batch_buckets(envs_per_shard, num_shards):
      keys = jax.random.split(jax.random.key(1), bucket)  # one key per env, as the shards send them
      jax.block_until_ready(policy.jit_sample(params, {k: v[:bucket] for k, v in observation.items()}, keys))


def report(mode: str, summary: dict) -> None:
  busy = ", ".join(f"{name} {fraction:.2f}" for name, fraction in sorted(summary["busy_fraction"].items()))
  print(f"  {mode:>5}: {summary['env_steps']} env steps in {summary['wall_seconds']:.2f} s = "
        f"{summary['env_steps_per_s']:.0f} env steps/s, {summary['learner_updates_per_s']:.3f} updates/s, "
        f"lag mean {summary['lag_mean']:.2f} p95 {summary['lag_p95']:.1f} max {summary['lag_max']}, "
        f"shards per inference batch {summary['inference_shards_per_batch']:.2f}")
  print(f"         busy: {busy}", flush=True)


def run_pair(make_config, env, make_policy, update_wrapper, timeline_dir: str, name: str) -> dict:
  results = {}
  for mode in ("sync", "async"):
    pipeline = RLPipeline(make_config(mode), env, make_policy(), update_wrapper=update_wrapper)
    summary = pipeline.run()
    pipeline.plot(os.path.join(timeline_dir, f"timeline_{name}_{mode}.png"))
    results[mode] = summary
    report(mode, summary)
  if results["sync"]["env_steps"] != results["async"]["env_steps"]:
    raise RuntimeError("the two runs did different amounts of work; the comparison would be unfair")
  return results


# -- trace-driven ---------------------------------------------------------------------------------

def trace_config(mode: str, setting: Setting, replay: Replay, updates: int, processes: int = 1):
  """The pipeline config of `setting`; over several processes, each runs the setting's shards and
  segments (rl.num_shards and rl.segments_per_update are global counts)."""
  config = default_config()
  config.update(mode=mode, eta=setting.eta, num_shards=processes * setting.num_shards,
                envs_per_shard=setting.envs_per_shard, segment_length=setting.segment_length, actions_per_step=4,
                segments_per_update=processes * setting.segments_per_update, num_updates=updates,
                queue_size=2 * setting.segments_per_update, num_epochs=1, num_minibatches=2, seed=0,
                inference_full_batch_only=setting.full_batch_only, shard_delays=replay.shard_delays() * processes)
  return config


def run_setting(trace: Trace, setting: Setting, policy, env, args, timeline_dir: str) -> tuple[float, float]:
  bound = speedup_bound(trace, setting, args.updates, time_scale=args.time_scale)
  inference = ", ".join(f"{size}: {1e3 * seconds:.0f}" for size, seconds in bound["inference_seconds"].items())
  print(f"setting {setting.name}: {setting.description}")
  print(f"  shards: {', '.join(setting.shard_tasks())} ({'cameras' if setting.cameras else 'no cameras'}); "
        f"{args.updates} updates x {setting.segments_per_update} segments x {setting.segment_length} steps x "
        f"{setting.envs_per_shard} envs x 4 actions; async eta {setting.eta}")
  print(f"  trace (x{args.time_scale:g}): env chunk step mean {1e3 * bound['env_mean_seconds']:.0f} ms, "
        f"E[max over shards] {1e3 * bound['env_max_seconds']:.0f} ms ({bound['env_max_over_mean']:.2f}x); "
        f"{setting.actor} inference ms per padded batch {{{inference}}}; learner update "
        f"{bound['learner_seconds']:.2f} s", flush=True)
  replay = Replay(trace, setting, time_scale=args.time_scale)
  results = run_pair(lambda mode: trace_config(mode, setting, replay, args.updates), env,
                     lambda: replay.policy(policy), replay.update_wrapper, timeline_dir, setting.name)
  ratio = results["async"]["env_steps_per_s"] / results["sync"]["env_steps_per_s"]
  print(f"  predicted from the trace: sync {bound['sync_seconds']:.1f} s, async >= {bound['async_seconds']:.1f} s "
        f"(limited by the {bound['limit']}); measured sync {results['sync']['wall_seconds']:.1f} s, "
        f"async {results['async']['wall_seconds']:.1f} s")
  print(f"  {setting.name}: async/sync {ratio:.2f}x, bound {bound['bound']:.2f}x = "
        f"{100 * ratio / bound['bound']:.0f} % of the bound", flush=True)
  return ratio, bound["bound"]


# -- scaling over local processes -----------------------------------------------------------------

def scaling_worker(args) -> None:
  """One process of a --scaling run: the headline setting's shards and server here, the learner
  shared with the other processes; process 0 prints the run's summary as one JSON line."""
  import json
  from ml_collections import ConfigDict
  from configs.common import SHARDING_RULES
  from ejax.parallel import initialize_distributed
  initialize_distributed(ConfigDict(dict(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                         process_id=args.process_id, initialization_timeout=300)))
  trace, setting = Trace.load(args.trace), SETTINGS[args.setting.split(",")[-1]]
  policy, env = toy_policy_and_env()
  processes = args.num_processes
  make = lambda mode, replay, updates: trace_config(mode, setting, replay, updates, processes)
  for mode in ("sync", "async"):  # warm-up: compile every function the timed runs use
    replay = Replay(trace, setting, time_scale=0.0)
    config = make(mode, replay, 2)
    config.update(shard_delays=[])
    RLPipeline(config, env, replay.policy(policy), update_wrapper=replay.update_wrapper,
               sharding_rules=SHARDING_RULES).run()
  results = {}
  for mode in ("sync", "async"):
    replay = Replay(trace, setting, time_scale=args.time_scale)
    pipeline = RLPipeline(make(mode, replay, args.updates), env, replay.policy(policy),
                          update_wrapper=replay.update_wrapper, sharding_rules=SHARDING_RULES)
    summary = pipeline.run()
    results[mode] = {key: summary[key] for key in ("env_steps", "env_steps_per_s", "learner_updates_per_s", "lag_mean",
                                                   "lag_max", "wall_seconds", "env_steps_per_process",
                                                   "learner_batch_envs", "num_processes")}
  if args.process_id == 0:
    print("SCALING " + json.dumps(results), flush=True)


def run_scaling(args) -> None:
  """The headline setting on 1, 2, 4 ... local processes (two CPU devices each), sync and async."""
  import json
  import socket
  import subprocess
  setting = SETTINGS[args.setting.split(",")[-1]]
  bound = speedup_bound(Trace.load(args.trace), setting, args.updates, time_scale=args.time_scale)
  print(f"scaling {setting.name} ({setting.description}): each process {setting.num_shards} shards x "
        f"{setting.envs_per_shard} envs, {setting.segments_per_update} segments per update; one SPMD learner over "
        f"every process's devices; {args.updates} updates; one process's bound from the trace {bound['bound']:.2f}x")
  rows = []
  for processes in [int(p) for p in args.scaling.split(",")]:
    with socket.socket() as sock:
      sock.bind(("127.0.0.1", 0))
      port = sock.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    command = [sys.executable, os.path.abspath(__file__), "--scaling_worker", f"--trace={args.trace}",
               f"--setting={setting.name}", f"--updates={args.updates}", f"--time_scale={args.time_scale}",
               f"--coordinator=127.0.0.1:{port}", f"--num_processes={processes}"]
    procs = [subprocess.Popen(command + [f"--process_id={i}"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(processes)]
    outputs = [proc.communicate()[0] for proc in procs]
    if any(proc.returncode for proc in procs):
      failed = next(i for i, proc in enumerate(procs) if proc.returncode)
      raise RuntimeError(f"{processes}-process run: process {failed} failed:\n{outputs[failed][-3000:]}")
    result = json.loads(next(line for line in outputs[0].splitlines() if line.startswith("SCALING "))[8:])
    rows.append((processes, result))
    sync, asyn = result["sync"], result["async"]
    print(f"  {processes} x {setting.num_shards} shards: sync {sync['env_steps_per_s']:.0f} env steps/s, "
          f"async {asyn['env_steps_per_s']:.0f} env steps/s ({asyn['env_steps_per_s'] / sync['env_steps_per_s']:.2f}x), "
          f"{asyn['learner_updates_per_s']:.3f} updates/s, learner batch {asyn['learner_batch_envs']} envs, "
          f"lag mean {asyn['lag_mean']:.2f} max {asyn['lag_max']}", flush=True)
  base = rows[0][1]["async"]["env_steps_per_s"]
  print("| processes x shards | sync env steps/s | async env steps/s | async/sync | async vs 1 process | "
        "learner updates/s (async) | learner batch (envs) | lag mean / max |")
  print("|---|---|---|---|---|---|---|---|")
  for processes, result in rows:
    sync, asyn = result["sync"], result["async"]
    print(f"| {processes} x {setting.num_shards} | {sync['env_steps_per_s']:.0f} | {asyn['env_steps_per_s']:.0f} | "
          f"{asyn['env_steps_per_s'] / sync['env_steps_per_s']:.2f}x | {asyn['env_steps_per_s'] / base:.2f}x | "
          f"{asyn['learner_updates_per_s']:.3f} | {asyn['learner_batch_envs']} | "
          f"{asyn['lag_mean']:.2f} / {asyn['lag_max']} |")


# -- synthetic (the earlier version of this benchmark) -------------------------------------------

def synthetic_config(mode: str, args):
  config = default_config()
  config.update(mode=mode, eta=args.eta, num_shards=args.shards, envs_per_shard=16,
                segment_length=8, actions_per_step=4, segments_per_update=args.shards,
                num_updates=10, queue_size=2 * args.shards, num_epochs=1, num_minibatches=2, seed=0)
  config.delay.update(kind="lognormal", median=args.median_delay, sigma=args.sigma)
  return config


def run_synthetic(policy, env, args, timeline_dir: str) -> None:
  make_config = lambda mode: synthetic_config(mode, args)
  ideal = ideal_async_speedup(shard_delay_specs(make_config("sync")))
  print(f"synthetic: {args.shards} shards x 16 envs, per-step delay lognormal(median {args.median_delay * 1e3:.0f} ms, "
        f"sigma {args.sigma}); 10 updates x {args.shards} segments x 8 steps; async eta {args.eta}")
  warm_up(policy, env, make_config, args.shards, 16)
  results = run_pair(make_config, env, lambda: policy, None, timeline_dir, "synthetic")
  ratio = results["async"]["env_steps_per_s"] / results["sync"]["env_steps_per_s"]
  print(f"ideal ratio E[max]/E[mean] of shard step times: {ideal:.2f}x; measured {ratio:.2f}x = "
        f"{100 * ratio / ideal:.0f} % of ideal (goal >= 90 %)")
  print(f"async/sync env steps per second (synthetic): {ratio:.2f}x (goal {GOAL:.2f}x)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trace", default=DEFAULT_TRACE)
  parser.add_argument("--setting", default=",".join(DEFAULT_SETTINGS),
                      help=f"comma-separated, the last is the headline; 'all' or of {', '.join(SETTINGS)}")
  parser.add_argument("--updates", type=int, default=12)
  parser.add_argument("--time_scale", type=float, default=0.5,
                      help="every traced time times this (shorter runs; the ratio does not depend on it)")
  parser.add_argument("--synthetic", action="store_true", help="the earlier synthetic lognormal-delay case instead")
  parser.add_argument("--shards", type=int, default=6, help="synthetic only")
  parser.add_argument("--eta", type=int, default=3, help="synthetic only")
  parser.add_argument("--median_delay", type=float, default=0.05, help="synthetic only")
  parser.add_argument("--sigma", type=float, default=1.0, help="synthetic only")
  parser.add_argument("--timeline_dir", default=None, help="where to write the timeline PNGs")
  parser.add_argument("--scaling", default="", help="e.g. 1,2,4: the headline setting on that many local processes")
  parser.add_argument("--scaling_worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
  parser.add_argument("--num_processes", type=int, default=1, help=argparse.SUPPRESS)
  parser.add_argument("--process_id", type=int, default=0, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.scaling_worker:
    scaling_worker(args)
    return
  if args.scaling:
    run_scaling(args)
    return

  policy, env = toy_policy_and_env()
  timeline_dir = args.timeline_dir or tempfile.mkdtemp(prefix="rl_async_")
  os.makedirs(timeline_dir, exist_ok=True)
  load = os.getloadavg()
  print(f"machine: {os.cpu_count()} CPU cores, jax {jax.__version__} on {jax.devices()[0].platform}; "
        f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
  if args.synthetic:
    run_synthetic(policy, env, args, timeline_dir)
    return

  trace = Trace.load(args.trace)
  recorded = trace.recorded
  load_of = lambda line: line.split("load average:")[-1].strip() if "load average:" in line else line
  print(f"trace: {os.path.relpath(args.trace)}, recorded on {recorded.get('machine')}, jax {recorded.get('jax')}; "
        + "; ".join(f"{stage} {entry.get('date')} (load {load_of(entry.get('uptime_before', '?'))})"
                    for stage, entry in trace.data.get("stages", {}).items()))
  names = (list(SETTINGS) if args.setting == "all"
           else [name.strip() for name in args.setting.split(",") if name.strip()])
  unknown = [name for name in names if name not in SETTINGS]
  if unknown:
    parser.error(f"unknown setting(s) {unknown}: use {', '.join(SETTINGS)} or 'all'")
  settings = [SETTINGS[name] for name in names]
  print("warming up (compiling every function the timed runs use) ...", flush=True)
  shape = lambda s: (s.num_shards, s.envs_per_shard, s.segment_length, s.segments_per_update)
  for setting in {shape(s): s for s in settings}.values():  # one warm-up per pipeline shape
    warm_up(policy, env, lambda mode, setting=setting: trace_config(mode, setting, Replay(trace, setting), 2),
            setting.num_shards, setting.envs_per_shard)
  results = [run_setting(trace, setting, policy, env, args, timeline_dir) for setting in settings]
  print(f"timelines: {timeline_dir}/timeline_<setting>_<mode>.png")
  for setting, (ratio, bound) in zip(settings[:-1], results[:-1]):
    print(f"  {setting.name}: {ratio:.2f}x, bound {bound:.2f}x")
  ratio, bound = results[-1]
  print(f"async/sync env steps per second (trace-driven): {ratio:.2f}x, bound {bound:.2f}x "
        f"(goal >= {100 * GOAL_OF_BOUND:.0f} % of the bound)")


if __name__ == "__main__":
  main()
