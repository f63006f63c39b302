"""The small flow-matching transformer policy on synthetic demonstrations: a smoke test of the
whole stack (launcher, sharding, trainer, checkpoints, metrics) that runs anywhere in a minute.

  python -m ejax.main --config=configs/tiny.py:runlocal
Expect on 2 CPU cores: 200 steps in about a minute after compilation; the flow-matching loss falls
from ~1.9 to below 0.4. Full variant (`configs/tiny.py`): 30k steps at batch 256, for checking
throughput and scaling of the trainer on accelerators without a VLA's cost.
Arg string: `runlocal`, `steps=N`, `batch=N`.
"""

from configs import common
from ejax.models import tiny


def get_config(arg: str | None = None):
  args = common.parse_arg(arg, runlocal=False, steps=0, batch=0)
  config = common.base_config()
  config.model = tiny.default_config()
  config.data.name = "synthetic"
  config.train.update(steps=30_000, global_batch_size=256, learning_rate=1e-4)
  config.checkpoint.every_steps = 1000
  if args.runlocal:
    config.train.update(steps=200, global_batch_size=32, learning_rate=3e-3, compute_dtype="float32")
    config.checkpoint.every_steps = 100
    config.metrics.log_every_steps = 20
  return common.apply_run_args(config, args)
