"""Scripted-expert demonstrations of every ejax.sim task, recorded as a LeRobot v3 dataset.

Launch (CPU):
  python -m ejax.main --config=configs/demos.py:runlocal --workdir=runs/demos_local
    2 episodes x 15 tasks at 64x64 in a few minutes on 2 cores (most of it compiling); writes
    runs/demos_local/dataset (LeRobot v3: parquet + h264 mp4) and demos_summary.json.
  python -m ejax.main --config=configs/demos.py --workdir=runs/demos
    50 episodes x 15 tasks at 128x128 (the README's default training set); the expert succeeds on
    >= 95 % of seeds per task and failed episodes are dropped.
Arg string: `runlocal`, `episodes=N` (per task), `tasks=all|spatial|object|goal|name+name`, `size=PX`.
"""

from ml_collections import ConfigDict

from configs import common


def get_config(arg: str | None = None):
  args = common.parse_arg(arg, runlocal=False, episodes=0, tasks="", size=0)
  config = common.base_config()
  config.job = "demos"
  config.demos = ConfigDict(common.demo_settings())
  config.demos.output_dir = ""  # default: <workdir>/dataset
  if args.runlocal:
    config.demos.update(episodes_per_task=2, num_envs=30, image_height=64, image_width=64)
  if args.episodes:
    config.demos.episodes_per_task = args.episodes
  if args.tasks:
    config.demos.tasks = args.tasks
  if args.size:
    config.demos.image_height = config.demos.image_width = args.size
  return config
