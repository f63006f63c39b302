"""RL-VLA3: asynchronous RL fine-tuning of a flow-matching policy beside batched environments.

Launch (CPU-sized, ~1-3 minutes on 2 cores; SFT warm start on scripted-expert demos, then 30
asynchronous PPO updates on PointReach with 4 lognormal-delayed env shards):
  python -m ejax.main --config=configs/rl_vla3.py:runlocal --workdir=runs/rl_local
Expect: closed-loop success 0.28 after SFT rising to ~0.5-0.6 after RL (256 judged episodes; seen
0.277 -> 0.598 in 65 s on a shared 2-core CPU, 2026-11-21),
policy lag max <= eta = 2, all threads joined; workdir gets rl_summary.json, rl_history.jsonl,
timeline.png and rl_checkpoints/ (run again to resume).
The default variant is the same recipe at GPU scale (16 shards x 64 envs, 200 updates).
Synchronous baseline of either: --config.rl.mode=sync.
Arg string: `runlocal`, `updates=N`, `mode=sync|async`, `task=NAME` (an ejax.sim task instead of
PointReach, e.g. `task=spatial_left_block_to_bowl`: SFT on its scripted expert, judged by the eval
job's rollout; MJX on a CPU makes this a long run, it is meant for a GPU).
"""

from ml_collections import ConfigDict

from configs import common
from ejax.rl.pipeline import default_config as pipeline_config


def get_config(arg: str | None = None):
  args = common.parse_arg(arg, runlocal=False, updates=0, mode="", task="")
  config = common.base_config()
  config.job = "rl"
  rl = pipeline_config()
  rl.update(mode="async", eta=2, num_shards=16, envs_per_shard=64, segment_length=8, actions_per_step=4,
            segments_per_update=16, num_updates=200, queue_size=32, num_epochs=2, num_minibatches=8,
            learning_rate=3e-4, gamma=0.95, checkpoint_every_updates=20)
  rl.delay.update(kind="lognormal", median=0.01, sigma=1.0)
  rl.env = ConfigDict(dict(name="point_reach", kwargs=dict(num_tasks=4, state_dim=4, action_dim=2, max_steps=16)))
  rl.policy = ConfigDict(dict(kind="mlp_flow", state_dim=4, action_dim=2, horizon=4, num_tasks=4, num_steps=4,
                              hidden=64, noise_level=0.5))
  rl.warm_start = ConfigDict(dict(demo_episodes=8, action_noise=0.8, steps=200, batch_size=64, learning_rate=1e-3))
  rl.judge = ConfigDict(dict(episodes=256, seed=5))
  config.rl = rl
  if args.runlocal:
    rl.update(num_shards=4, envs_per_shard=16, segments_per_update=4, num_updates=30, num_minibatches=4,
              queue_size=8, inference_full_batch_only=True, checkpoint_every_updates=10, learning_rate=1e-3)
    rl.delay.update(median=0.002)
  if args.updates:
    rl.num_updates = args.updates
  if args.mode:
    rl.mode = args.mode
  if args.task:
    # An ejax.sim task (MJX physics, state-only policy): 11-d state, [dx, dy, dz, gripper] actions.
    rl.env = ConfigDict(dict(name=args.task, kwargs={}, judge_backend="mjx"))
    rl.policy.update(state_dim=11, action_dim=4, num_tasks=1, hidden=128)
    rl.warm_start.update(demo_episodes=32, action_noise=0.3, steps=500)
    rl.judge.episodes = 32 if args.runlocal else 256
  return config
