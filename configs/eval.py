"""Closed-loop evaluation of a policy on the ejax.sim suites (success rates, plot, videos).

Launch (CPU):
  python -m ejax.main --config=configs/eval.py:runlocal --workdir=runs/eval_local \
      --config.eval.checkpoint=runs/groot_local/checkpoints
    20 episodes of each task the checkpoint was trained on (its saved data config names them; other
    checkpoints: all 15), cameras at the size its demonstrations were recorded at, replanning every
    2 steps, one video per task, on layouts of seed 1234 (the demos job records seed 0's: the
    policy never saw these).
    Writes runs/eval_local/eval/{summary.json, summary.txt, success.png, videos/*.mp4}; summary.json
    holds overall.success_rate and one row per task with its 95 % Wilson interval.
  Baselines: --config.eval.policy=random (floor, ~0 %) or expert (scripted, >= 95 % per task).
  An RL run's policy: --config.eval.policy=rl --config.eval.checkpoint=runs/rl/rl_checkpoints
    (newest version; --config.eval.version=0 is its SFT starting point).
  A served policy (job `serve`, README "Deploy"): --config.eval.policy=remote --config.eval.address=127.0.0.1:8000
    (the same success rates and actions as evaluating its checkpoint in-process, same seeds).
  python -m ejax.main --config=configs/eval.py --workdir=runs/eval   (50 episodes per task, LIBERO's count)
  Perception ablations of a checkpoint with model.perception's estimate (configs/groot.py's sim recipes):
    --config.eval.true_estimate=True (act on the simulator's true target and goal) and
    --config.eval.keypoint_geometry=sim|off (place them through ejax.sim's calibrated cameras with the
    model's current keypoint decoding, or by the learnt readout alone; default: as the checkpoint was
    trained).
Arg string: `runlocal`, `policy=random|expert|checkpoint|rl|remote`, `episodes=N`, `tasks=all|suite|name+name`.
"""

from ml_collections import ConfigDict

from configs import common


def get_config(arg: str | None = None):
  args = common.parse_arg(arg, runlocal=False, policy="", episodes=0, tasks="")
  config = common.base_config()
  config.job = "eval"
  config.eval = ConfigDict(dict(
      policy="checkpoint",   # random | expert | checkpoint | rl | remote
      checkpoint="",         # checkpoint directory: the train job's (policy=checkpoint, ejax.train.policy)
                             # or an rl job's rl_checkpoints (policy=rl, ejax.rl.build.load_rl_policy)
      version=-1,            # policy=rl: which saved policy version (-1: the newest)
      address="",            # policy=remote: host:port (or ws://...) of a serve job (ejax/serve)
      api_key="",            # policy=remote: the server's serve.api_key, when it has one
      remote_connections=16,  # policy=remote: envs' requests in flight at once (the server batches them)
      tasks="",              # "all", a suite ("spatial" | "object" | "goal"), "name+name", or "": the
                             # tasks the checkpoint was trained on (its saved data config), else all
      episodes_per_task=50,
      num_envs=60,           # envs stepped together (split evenly over the tasks)
      backend="native",      # native (faster on CPU) | mjx (GPU)
      image_height=0,        # camera size; 0: the size the checkpoint's demonstrations were recorded
      image_width=0,         # at (its saved data config), else 128
      replan_every=8,        # execute this many actions of each chunk open-loop
      episode_length=0,      # 0: each task's own limit
      videos_per_task=2,
      output_dir="",         # default: <workdir>/eval
      seed=1234,             # different from configs/demos.py's seed: evaluation layouts are unseen
      true_estimate=False,   # policy=checkpoint trained with a teacher-forced estimate of the object
                             # state (configs/groot.py's sim recipes): act on the simulator's true state
                             # in its place, to measure what the policy's perception costs
      keypoint_geometry="checkpoint",  # policy=checkpoint with a keypoint estimate: "checkpoint" places
                             # its points as trained (model.perception.geometry.cameras); "sim" through
                             # ejax.sim's calibrated cameras, decoded with today's radius / tolerance
                             # defaults (perception.config.Geometry); "off" by the learnt readout alone
      num_inference_steps=0,  # policy=checkpoint: the flow's Euler steps per chunk (0: as the checkpoint's
                             # model config says)
  ))
  if args.runlocal:
    # Replanning every 2 steps: the quickstart policy solves the drawers 100 % (65-85 % executing 8).
    config.eval.update(episodes_per_task=20, num_envs=60, videos_per_task=1, replan_every=2)
  if args.policy:
    config.eval.policy = args.policy
  if args.episodes:
    config.eval.episodes_per_task = args.episodes
  if args.tasks:
    config.eval.tasks = args.tasks
  return config
