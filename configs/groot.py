"""GR00T-N1.5 fine-tuning on a LeRobot dataset.

Launch (one host, all its GPUs; the dataset and Qwen3's tokenizer.json are local files):
  python -m ejax.main --config=configs/groot.py --workdir=runs/groot \
      --config.data.path=/data/my_lerobot_dataset --config.model.tokenizer_path=/ckpt/groot/tokenizer.json
Start from the released GR00T-N1.5-3B weights by importing them first (the convert job), and see
the model's size and per-device memory without allocating it:
  python -m ejax.main --config=configs/groot.py --config.job=summary
Expect: ~2.4B parameters (DiT 0.55B, VL self-attention 0.20B, per-embodiment MLPs 0.32B, Qwen3
truncated at layer 12 0.92B, SigLIP2 0.4B), LLM and vision frozen as LeRobot fine-tunes them; the
flow-matching loss falls from ~1.5 to ~0.05 over a fine-tuning run.

CPU-sized run of the same architecture (the README's quickstart): it trains on the built-in
synthetic demonstrations, needs no download, and takes a few minutes on 2 CPU cores; the
flow-matching loss falls to well under half its start:
  python -m ejax.main --config=configs/groot.py:runlocal
Train on simulated demonstrations instead (record them with configs/demos.py), then evaluate in
closed loop with configs/eval.py:
  python -m ejax.main --config=configs/groot.py:runlocal,dataset=runs/demos_local/dataset
Arg string: `runlocal`, `steps=N`, `batch=N`, `dataset=PATH` (a LeRobot dataset: both cameras,
state up to 16 dims), e.g. configs/groot.py:runlocal,steps=50.
"""

from configs import common
from ejax.models import groot


def get_config(arg: str | None = None):
  args = common.parse_arg(arg, runlocal=False, steps=0, batch=0, dataset="")
  config = common.base_config()
  config.model = groot.model_config("runlocal" if args.runlocal else "full")
  config.data.update(name="lerobot", horizon=config.model.action_horizon,
                     image_size=[config.model.vision.image_size] * 2, normalization="mean_std")
  # FSDP over every device: 2.4B parameters with Adam state for the trainable 1.1B.
  config.mesh = dict(data=1, fsdp=-1, tensor=1)
  # LeRobot's GR00T fine-tuning defaults (REFERENCE.md).
  config.train.update(steps=30_000, global_batch_size=256, learning_rate=1e-4, b1=0.95, b2=0.999,
                      weight_decay=1e-5, warmup_fraction=0.05, remat=config.model.remat)
  config.checkpoint.every_steps = 1000
  if args.runlocal:
    config.data.name = "synthetic"
    config.mesh = dict(data=-1, fsdp=1, tensor=1)
    config.train.update(steps=200, global_batch_size=32, learning_rate=3e-3, compute_dtype="float32",
                        remat="none")
    config.checkpoint.every_steps = 100
    config.metrics.log_every_steps = 20
  if args.dataset:
    # A recorded dataset (e.g. ejax.sim demos): the cameras it has, the state it records.
    config.data.update(name="lerobot", path=args.dataset)
    config.model.update(num_cameras=2, max_state_dim=16)
    config.model.packing.row_length = 3 * config.model.packing.row_length  # two images + text, two samples a row
    if args.runlocal:
      config.train.update(steps=400, learning_rate=1e-3)
  return common.apply_run_args(config, args)
