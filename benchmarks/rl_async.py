"""RL-VLA3 throughput: the asynchronous pipeline against its synchronous baseline, same work.

Both runs use the same code (ejax.rl.pipeline), the same policy, env, total env steps, batch per
update (segments_per_update x segment_length x envs_per_shard samples) and number of updates. The
synchronous run is eta = 0 with a barrier at every step; the asynchronous run lets each shard go at
its own pace with staleness bounded by eta.

Heterogeneity: 6 env shards whose every step takes a lognormal delay (median 50 ms, sigma 1.0, so
mean 82 ms and a long tail), like real robots or simulators of uneven cost. Behind a barrier every
step waits for the slowest shard, so the ideal speed-up of going asynchronous is E[max]/E[mean] of
the per-step shard times (Monte Carlo from the delay distribution).

Run:  python benchmarks/rl_async.py            (no arguments; a few minutes on a CPU)
Goal: async/sync >= 2.27x (the seed's +126.67 %) and >= 90 % of the ideal ratio.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ejax.models.tiny import default_config as tiny_config  # noqa: E402
from ejax.rl.delays import ideal_async_speedup  # noqa: E402
from ejax.rl.inference import batch_buckets  # noqa: E402
from ejax.rl.pipeline import RLPipeline, default_config, shard_delay_specs  # noqa: E402
from ejax.rl.point_env import PointReach  # noqa: E402
from ejax.rl.policy import tiny_flow_policy  # noqa: E402

GOAL = 2.27
nnx.use_eager_sharding(False)  # parameters carry logical names; placement comes from the pipeline


def make_config(mode: str, args):
  config = default_config()
  config.update(mode=mode, eta=args.eta, num_shards=args.shards, envs_per_shard=args.envs_per_shard,
                segment_length=args.segment_length, actions_per_step=4, segments_per_update=args.shards,
                num_updates=args.updates, queue_size=2 * args.shards, num_epochs=1, num_minibatches=2, seed=0)
  config.delay.update(kind="lognormal", median=args.median_delay, sigma=args.sigma)
  return config


def warm_up(policy, env, args) -> None:
  """Compiles everything the timed runs call: env functions, the learner update, and the sampler
  at every batch bucket for both the initial and the updated (non weak-typed) parameters."""
  for mode in ("sync", "async"):
    config = make_config(mode, args)
    config.update(num_updates=2)
    config.delay.update(kind="none")
    pipeline = RLPipeline(config, env, policy)
    pipeline.run()
  observation = {key: np.asarray(value) for key, value in
                 jax.vmap(env.reset)(jax.random.split(jax.random.key(0), args.envs_per_shard * args.shards)).obs.items()}
  for params in (policy.initial_params, pipeline.learner.params):
    for bucket in batch_buckets(args.envs_per_shard, args.shards):
      jax.block_until_ready(policy.jit_sample(params, {k: v[:bucket] for k, v in observation.items()}, jax.random.key(1)))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shards", type=int, default=6)
  parser.add_argument("--envs_per_shard", type=int, default=16)
  parser.add_argument("--segment_length", type=int, default=8)
  parser.add_argument("--updates", type=int, default=10)
  parser.add_argument("--eta", type=int, default=3)
  parser.add_argument("--median_delay", type=float, default=0.05)
  parser.add_argument("--sigma", type=float, default=1.0)
  parser.add_argument("--timeline_dir", default=None, help="where to write the two timeline PNGs")
  args = parser.parse_args()

  model_config = tiny_config()
  model_config.update(width=32, depth=1, num_heads=2, state_dim=8, action_dim=2, horizon=4, num_tasks=4,
                      num_inference_steps=4)
  policy = tiny_flow_policy(model_config, rngs=nnx.Rngs(0), value_hidden=32)
  env = PointReach(num_tasks=4, state_dim=8, action_dim=2, max_steps=24)

  specs = shard_delay_specs(make_config("sync", args))
  ideal = ideal_async_speedup(specs)
  print(f"machine: {os.cpu_count()} CPU cores, jax {jax.__version__} on {jax.devices()[0].platform}; "
        f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
  print(f"heterogeneity: {args.shards} shards x {args.envs_per_shard} envs, per-step delay lognormal(median "
        f"{args.median_delay * 1e3:.0f} ms, sigma {args.sigma}), mean {specs[0].expected() * 1e3:.1f} ms")
  print(f"work per run: {args.updates} updates x {args.shards} segments x {args.segment_length} steps "
        f"x {args.envs_per_shard} envs x 4 actions; async eta = {args.eta}")
  print("warming up (compiling every function the timed runs use) ...", flush=True)
  warm_up(policy, env, args)

  timeline_dir = args.timeline_dir or tempfile.mkdtemp(prefix="rl_async_")
  os.makedirs(timeline_dir, exist_ok=True)
  results = {}
  for mode in ("sync", "async"):
    pipeline = RLPipeline(make_config(mode, args), env, policy)
    summary = pipeline.run()
    pipeline.plot(os.path.join(timeline_dir, f"timeline_{mode}.png"))
    results[mode] = summary
    busy = ", ".join(f"{name} {fraction:.2f}" for name, fraction in sorted(summary["busy_fraction"].items()))
    print(f"{mode:>5}: {summary['env_steps']} env steps in {summary['wall_seconds']:.2f} s = "
          f"{summary['env_steps_per_s']:.0f} env steps/s, {summary['learner_updates_per_s']:.2f} updates/s, "
          f"lag mean {summary['lag_mean']:.2f} p95 {summary['lag_p95']:.1f} max {summary['lag_max']}, "
          f"shards per inference batch {summary['inference_shards_per_batch']:.2f}")
    print(f"       busy: {busy}")
  if results["sync"]["env_steps"] != results["async"]["env_steps"]:
    raise RuntimeError("the two runs did different amounts of work; the comparison would be unfair")
  ratio = results["async"]["env_steps_per_s"] / results["sync"]["env_steps_per_s"]
  print(f"timelines: {timeline_dir}/timeline_sync.png, timeline_async.png")
  print(f"ideal ratio E[max]/E[mean] of shard step times: {ideal:.2f}x; measured {ratio:.2f}x = "
        f"{100 * ratio / ideal:.0f} % of ideal (goal >= 90 %)")
  print(f"async/sync env steps per second: {ratio:.2f}x (goal {GOAL:.2f}x)")


if __name__ == "__main__":
  main()
