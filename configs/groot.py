"""GR00T-N1.5 fine-tuning on a robot dataset.

Launch (one host, all its GPUs):
  python -m ejax.main --config=configs/groot.py --workdir=runs/groot
CPU-sized run of the same config (the README's quickstart; ~1-2 minutes on 2 CPU cores, the
flow-matching loss falls from ~2 to well under half of that):
  python -m ejax.main --config=configs/groot.py:runlocal
Arg string: `runlocal`, `steps=N`, `batch=N`, e.g. configs/groot.py:runlocal,steps=50.

Until the GR00T model lands in ejax/models, both variants train the small flow-matching policy
(ejax/models/tiny.py) on the synthetic demonstrations (ejax/data/synthetic.py).
"""

from ml_collections.config_dict import placeholder

from configs import common
from ejax.models import tiny


def get_config(arg: str | None = None):
  args = common.parse_arg(arg, runlocal=False, steps=0, batch=0)
  config = common.base_config()
  config.model = tiny.default_config()
  config.data = dict(name="synthetic", path=placeholder(str), noise=0.0)
  config.train.steps = 30_000
  config.train.global_batch_size = 256
  config.train.learning_rate = 1e-4
  config.checkpoint.every_steps = 1000
  if args.runlocal:
    config.train.steps = 200
    config.train.global_batch_size = 32
    config.train.learning_rate = 3e-3
    config.train.compute_dtype = "float32"  # CPUs gain nothing from bf16
    config.checkpoint.every_steps = 100
    config.metrics.log_every_steps = 20
  if args.steps:
    config.train.steps = args.steps
  if args.batch:
    config.train.global_batch_size = args.batch
  return config
