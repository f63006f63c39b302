"""Records the per-stage timings of RL-VLA3's real components into a small trace file.

    python benchmarks/rl_trace.py                       # ~10-15 minutes on 2 CPU cores
    python benchmarks/rl_trace.py --tasks goal_lift_green_block --chunks 16   # a quick look

What it times, each stage alone (nothing else of the pipeline runs beside it), with the shapes of
`configs/rl_vla3.py:runlocal` (16 envs per shard, chunks of 4 actions, 64x64 cameras):

- env: one shard's chunk step exactly as the RL env shards run it (ejax.rl.env_shard.NativeSimEnv:
  native MuJoCo, 4 actions per chunk, finished episodes reset inside the step), per ejax.sim task,
  with and without cameras. Actions: the scripted expert's, held for the chunk, plus Gaussian noise
  (sigma `--action_noise`): episodes end by success (a third on the drawers, a few on the lifts) or
  by time-out, and reset inside the step either way. Per chunk: its time and how many envs reset in it; per task: the
  episode lengths seen and the success rate.
- inference: the GR00T-runlocal RL actor's sampler (ejax.rl.vla.groot_flow_policy, configs/
  rl_vla3.py:runlocal,actor=groot: cached context, Flow-SDE chain) at every padded batch size the
  server uses (ejax.rl.inference.batch_buckets: 16, 32, 64 for the config's 4 shards x 16 envs,
  and 128 for 8 shards), and the state-based MLP actor's (the config's default actor) at the same sizes.
- learner: one jitted update of each actor over a batch of the runlocal size (8 segments x 8 steps
  x 16 envs = 1024 chunk samples, the config's epochs and minibatches).

The GR00T actor needs an SFT checkpoint: the recorder makes a small one first (2 scripted demos,
2 training steps of configs/groot.py:runlocal; timing does not depend on the weights).

Writes benchmarks/traces/rl_components.json (~20 KB): the samples of every stage in ms, the
machine, its load (`uptime`) before and after each stage, the date and the jax version. Stages left
out with --skip keep their samples (and dates) from the file's earlier recording. benchmarks/rl_async.py
replays it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACE = os.path.join(REPO, "benchmarks", "traces", "rl_components.json")
if REPO not in sys.path:  # configs/ imports as a package from the repository root
  sys.path.insert(0, REPO)


def uptime() -> str:
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
  except OSError:
    return "unknown"


def load_config(path: str, arg: str | None = None):
  spec = importlib.util.spec_from_file_location("config_for_trace", os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def ms(seconds: float) -> float:
  return round(1e3 * seconds, 2)


# -- env ---------------------------------------------------------------------------------------

def record_env(task: str, *, cameras: bool, num_envs: int, actions_per_step: int, chunks: int, image_size: int,
               action_noise: float, seed: int) -> dict:
  """One shard's chunk steps on `task`: {"chunk_ms", "resets", "episode_length", "success"}."""
  from ejax.rl.env_shard import NativeSimEnv
  from ejax.sim import batched as batched_lib
  reset, chunk_step = NativeSimEnv(task, cameras=cameras, image_size=(image_size, image_size)).functions(
      num_envs, actions_per_step, auto_reset=True)
  rng = np.random.default_rng(seed)
  key = jax.random.key(seed)
  state = reset(jax.random.split(key, num_envs))

  def chunk(state):
    expert = np.asarray(batched_lib._expert_actions(jax.tree.map(np.asarray, state.info["privileged"])))
    actions = np.repeat(expert[:, None], actions_per_step, axis=1)
    return np.clip(actions + rng.normal(0, action_noise, actions.shape), -1, 1).astype(np.float32)

  keys = lambda i: jax.random.split(jax.random.fold_in(key, i), num_envs)
  for i in range(2):  # compilation of the jitted finish, and its second shape
    state, *_ = chunk_step(state, chunk(state), keys(10_000 + i))
  state = reset(jax.random.split(jax.random.fold_in(key, 99), num_envs))
  times, resets, lengths, successes = [], [], [], []
  steps = np.zeros((num_envs,), int)
  for i in range(chunks):
    actions = chunk(state)
    start = time.perf_counter()
    state, _, done, success = chunk_step(state, actions, keys(i))
    times.append(ms(time.perf_counter() - start))
    done, success = np.asarray(done), np.asarray(success)
    resets.append(int(done.sum()))
    steps += actions_per_step
    for env in np.flatnonzero(done):
      lengths.append(int(steps[env]))
      successes.append(bool(success[env]))
      steps[env] = 0
  return {"chunk_ms": times, "resets": resets, "episode_length": lengths,
          "success": round(float(np.mean(successes)), 3) if successes else None}


# -- policies ------------------------------------------------------------------------------------

def make_sft_checkpoint(root: str, task: str, image_size: int) -> str:
  """A small GR00T-runlocal checkpoint of the train job (2 demos, 2 steps): its checkpoints dir."""
  from ejax.sim import demos
  from ejax.train.loop import train
  config = load_config("configs/demos.py", f"runlocal,tasks={task},episodes=2,size={image_size}")
  config.demos.num_envs = 2
  demos.run_job(config, os.path.join(root, "demos"))
  config = load_config("configs/groot.py", f"runlocal,dataset={os.path.join(root, 'demos', 'dataset')},steps=2,batch=8")
  config.metrics.update(tensorboard=False, progress_bar=False)
  config.checkpoint.update(async_save=False, every_steps=2)
  train(config, os.path.join(root, "sft"))
  return os.path.join(root, "sft", "checkpoints")


def observations(task: str, num_envs: int, image_size: int, cameras: bool, batch: int) -> dict:
  """`batch` observations of `task` (num_envs reset envs, repeated), as the shards post them."""
  from ejax.rl.env_shard import NativeSimEnv
  reset, _ = NativeSimEnv(task, cameras=cameras, image_size=(image_size, image_size)).functions(num_envs, 4, True)
  obs = reset(jax.random.split(jax.random.key(0), num_envs)).obs
  obs = {key: np.asarray(value) for key, value in obs.items()}
  return {key: np.concatenate([value] * (batch // num_envs)) for key, value in obs.items()}


def time_calls(fn, repeats: int) -> list[float]:
  jax.block_until_ready(fn())  # compilation
  jax.block_until_ready(fn())
  out = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(ms(time.perf_counter() - start))
  return out


def record_policy(rl, policy, obs: dict, buckets: list[int], inference_repeats: int, learner_repeats: int) -> dict:
  """Sampler time per padded batch size, and the learner's update time over the runlocal batch."""
  from ejax.rl.learner import make_update_fn
  from ejax.rl.pipeline import make_optimizer
  obs = policy.select_observations(obs)
  params = policy.initial_params
  inference = {}
  for bucket in buckets:
    part = {key: value[:bucket] for key, value in obs.items()}
    inference[str(bucket)] = time_calls(lambda: policy.jit_sample(params, part, jax.random.key(1)), inference_repeats)
    print(f"    inference batch {bucket}: median {np.median(inference[str(bucket)]):.1f} ms", flush=True)

  # One update's batch: segments_per_update segments of segment_length steps of envs_per_shard envs.
  n, steps, envs = rl.envs_per_shard, rl.segment_length, rl.segments_per_update * rl.envs_per_shard
  sample = jax.device_get(policy.jit_sample(params, {key: value[:n] for key, value in obs.items()}, jax.random.key(2)))
  tile = lambda x: np.broadcast_to(np.concatenate([np.asarray(x)] * rl.segments_per_update)[None],
                                   (steps, envs) + np.shape(x)[1:]).copy()
  rng = np.random.default_rng(0)
  batch = {"observation": {key: tile(value[:n]) for key, value in obs.items()},
           "chain": tile(sample["chain"]), "step_index": tile(sample["step_index"]),
           "log_prob": tile(sample["log_prob"]), "value": tile(sample["value"]),
           "reward": rng.normal(size=(steps, envs)).astype(np.float32), "done": rng.random((steps, envs)) < 0.05,
           "success": np.zeros((steps, envs), bool), "valid": np.ones((steps, envs), bool),
           "bootstrap_observation": {key: np.concatenate([value[:n]] * rl.segments_per_update)
                                     for key, value in obs.items()}}
  if "context" in sample:
    batch["context"] = jax.tree.map(tile, sample["context"])
  optimizer = make_optimizer(rl, getattr(policy, "trainable_mask", None))
  update = jax.jit(make_update_fn(
      policy, optimizer, algorithm=rl.algorithm, gamma=rl.gamma, gae_lambda=rl.gae_lambda,
      clip_epsilon=rl.clip_epsilon, behaviour_weight_threshold=rl.behaviour_weight_threshold, dual_clip=rl.dual_clip,
      value_coef=rl.value_coef, num_epochs=rl.num_epochs, num_minibatches=rl.num_minibatches,
      group_size=rl.group_size, train_actor=True, target_kl=None))  # no early stop: every step timed
  opt_state = optimizer.init(params)
  learner = time_calls(lambda: update(params, opt_state, batch, jax.random.key(3)), learner_repeats)
  print(f"    learner update over {steps * envs} samples: median {np.median(learner):.0f} ms", flush=True)
  return {"inference_ms": inference,
          "learner": {"samples": steps * envs, "num_epochs": rl.num_epochs, "num_minibatches": rl.num_minibatches,
                      "update_ms": learner}}


def main() -> None:
  from ejax.rl.inference import batch_buckets
  from ejax.sim import registry
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tasks", default="all", help="'all' or task names joined by '+'")
  parser.add_argument("--chunks", type=int, default=40, help="timed chunk steps per task and camera setting")
  parser.add_argument("--action_noise", type=float, default=0.3)
  parser.add_argument("--inference_repeats", type=int, default=8)
  parser.add_argument("--learner_repeats", type=int, default=4)
  parser.add_argument("--skip", default="", help="stages to leave out, joined by '+': env, groot, mlp")
  parser.add_argument("--max_shards", type=int, default=8,
                      help="inference is timed at every padded batch size of up to this many shards")
  parser.add_argument("--output", default=DEFAULT_TRACE)
  args = parser.parse_args()
  skip = set(filter(None, args.skip.split("+")))

  rl = load_config("configs/rl_vla3.py", "runlocal").rl  # state-based actor: the config's default
  image_size = 64
  tasks = registry.list_tasks() if args.tasks == "all" else args.tasks.split("+")
  trace = {"version": 1, "recorded": {
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "machine": f"{platform.node()}: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
      "jax": jax.__version__, "platform": jax.devices()[0].platform, "uptime_before": uptime()},
      "shape": {"envs_per_shard": rl.envs_per_shard, "actions_per_step": rl.actions_per_step,
                "segment_length": rl.segment_length, "segments_per_update": rl.segments_per_update,
                "num_shards": rl.num_shards, "image_size": image_size,
                "buckets": batch_buckets(rl.envs_per_shard, max(rl.num_shards, args.max_shards))},
      "env": {}, "actors": {}, "stages": {}}
  if os.path.exists(args.output):  # stages left out keep their earlier samples, and when they were taken
    with open(args.output) as f:
      previous = json.load(f)
    for key in ("env", "actors", "stages"):
      trace[key] = previous.get(key, {})
  buckets = trace["shape"]["buckets"]

  def stamp(stage: str, before: str) -> None:
    trace["stages"][stage] = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                              "uptime_before": before, "uptime_after": uptime()}

  if "env" not in skip:
    before = uptime()
    for task in tasks:
      entry = {"max_episode_length": int(registry.get_spec(task).episode_length)}
      for cameras in (False, True):
        record = record_env(task, cameras=cameras, num_envs=rl.envs_per_shard, actions_per_step=rl.actions_per_step,
                            chunks=args.chunks, image_size=image_size, action_noise=args.action_noise, seed=0)
        entry["cameras" if cameras else "no_cameras"] = record
        print(f"  {task:32s} cameras={cameras!s:5}: chunk median {np.median(record['chunk_ms']):6.1f} ms, "
              f"mean {np.mean(record['chunk_ms']):6.1f}, max {np.max(record['chunk_ms']):6.1f}; "
              f"{len(record['episode_length'])} episodes, success {record['success']}", flush=True)
      trace["env"][task] = entry
    stamp("env", before)

  if "mlp" not in skip:
    from ejax.rl.runner import make_policy
    print("  MLP actor (state-based, configs/rl_vla3.py:runlocal)", flush=True)
    before = uptime()
    policy = make_policy(rl.policy, 0)
    obs = observations(rl.env.name, rl.envs_per_shard, image_size, False, buckets[-1])
    trace["actors"]["mlp"] = dict(record_policy(rl, policy, obs, buckets, args.inference_repeats, args.learner_repeats),
                                  cameras=False)
    stamp("mlp", before)

  if "groot" not in skip:
    from ejax.rl.runner import make_policy
    with tempfile.TemporaryDirectory(prefix="rl_trace_") as root:
      print("  GR00T actor: making a small SFT checkpoint ...", flush=True)
      checkpoint = make_sft_checkpoint(root, rl.env.name, image_size)
      before = uptime()
      groot_rl = load_config("configs/rl_vla3.py", f"runlocal,actor=groot,sft={checkpoint}").rl
      policy = make_policy(groot_rl.policy, 0)
      obs = observations(groot_rl.env.name, groot_rl.envs_per_shard, image_size, True, buckets[-1])
      trace["actors"]["groot"] = dict(record_policy(groot_rl, policy, obs, buckets, args.inference_repeats,
                                                    args.learner_repeats), cameras=True)
      stamp("groot", before)

  trace["recorded"]["uptime_after"] = uptime()
  os.makedirs(os.path.dirname(args.output), exist_ok=True)
  with open(args.output, "w") as f:
    json.dump(trace, f, separators=(",", ":"))
    f.write("\n")
  print(f"wrote {args.output} ({os.path.getsize(args.output) / 1024:.1f} KB)")


if __name__ == "__main__":
  main()
