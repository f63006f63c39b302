"""GR00T-N1.5 fine-tuning on a LeRobot dataset.

Launch (one host, all its GPUs; the dataset and Qwen3's tokenizer.json are local files):
  python -m ejax.main --config=configs/groot.py --workdir=runs/groot \
      --config.data.path=/data/my_lerobot_dataset --config.model.tokenizer_path=/ckpt/groot/tokenizer.json
Start from the released GR00T-N1.5-3B weights by importing them first (the convert job) and naming
the import (its parameters are read straight into their shardings, never randomly initialised):
  python -m ejax.main --config=configs/groot.py --config.job=convert --config.convert.direction=import \
      --config.convert.source=/ckpt/GR00T-N1.5-3B --config.convert.destination=/ckpt/groot_ejax
  python -m ejax.main --config=configs/groot.py --workdir=runs/groot --config.train.init_weights=/ckpt/groot_ejax ...
See the model's size and per-device memory without allocating it:
  python -m ejax.main --config=configs/groot.py --config.job=summary
Expect: ~2.4B parameters (DiT 0.55B, VL self-attention 0.20B, per-embodiment MLPs 0.32B, Qwen3
truncated at layer 12 0.92B, SigLIP2 0.4B), LLM and vision frozen as LeRobot fine-tunes them; the
flow-matching loss falls from ~1.5 to ~0.05 over a fine-tuning run.
The packed VL row is chosen at start-up from the dataset's first 512 samples and logged (model.packing.
row_length 0, ejax/data/row_plan.py: e.g. 8 samples a row of 2,176 tokens for 261-269-token samples,
2.6 % padding); set model.packing.row_length and samples_per_row to fix one.

CPU-sized run of the same architecture (the README's quickstart): the first run records ejax.sim's
scripted-expert demonstrations of five tasks that share one scene and differ by instruction ("lift
the green block", "pick up the yellow cylinder", "open / close the drawer", "put the red block on
the plate"; 60 episodes each, two 64x64 cameras, kept in ~/.cache/ejax/sim_demos or
$EJAX_CACHE_DIR), then trains 1500 steps of batch 32 with the vision tower and the LLM trained too
(nothing is pre-trained at this size); no download. Then evaluate it in closed loop with
configs/eval.py (by default on the tasks it was trained on, 20 unseen layouts each):
  python -m ejax.main --config=configs/groot.py:runlocal
  python -m ejax.main --config=configs/eval.py:runlocal --config.eval.checkpoint=runs/groot_runlocal/checkpoints
What to expect (2026-11-25 night, 2 idle cores): 7 min 36 s from a clean cache (recording ~1 min, then
~130 samples/s); the flow-matching loss falls from ~1.7 to ~0.26 (the logged total adds the keypoint
heatmaps' cross-entropy, ~3.8 at the end: a point label on a many-pixel object cannot reach 0); the
eval command above (replanning every 2 steps) measures 60 % [50, 69] over the five tasks (lifts 75 / 55 %,
drawers 100 / 65 %, the pick-and-place 5 %; 7 min 36 s for recording and training, 59 s for the eval);
re-run 2026-11-27 with the host-drawn initial weights (ejax.train.host_init): 63 % [53, 72].
The perception that gets there is _sim_keypoint_estimate's (below); without it the same model
measured 18-33 %.
The longer CPU recipe on all 15 tasks of ejax.sim's suites (issue 14, point 3): `suites` (see _suites)
  python -m ejax.main --config=configs/groot.py:suites
  python -m ejax.main --config=configs/eval.py:runlocal,episodes=50 --config.eval.checkpoint=runs/groot_suites/checkpoints
records 100 demos of each of the 15 tasks (30 % of them miss their first grasp and grasp again; ~6 min),
then trains 7000 steps of batch 32 with detectors that see a 14 px neighbourhood and a learnt position
term; at inference the target and goal are placed by their keypoints through the calibrated cameras
(the goal by the agentview alone), and each chunk is sampled with two flow steps.
What to expect (2026-11-26 21:45-22:35, 2 idle cores): 45 min 38 s from a clean cache, recording (4 min)
included (~85-105 samples/s; 56 min on a busier evening); flow loss ~0.24 at the end (heatmap
cross-entropy ~1.2); the eval command above (50 unseen layouts per task, 3 min 39 s) measured 81.3 %
[78.4, 84.0] over 750 episodes: spatial suite 62 % (stacking 32 %), object suite 93 %, goal suite 89 %
(BENCHMARKS.md, "Decoding the keypoints ... and two flow steps").
Arg string: `runlocal`, `suites`, `steps=N`, `batch=N`, `dataset=PATH` (another LeRobot dataset, e.g. one
recorded with configs/demos.py: both cameras, state up to 16 dims) or `dataset=synthetic` (the
camera-less synthetic smoke-test data, ejax/data/synthetic.py, 200 steps in well under a minute),
e.g. configs/groot.py:runlocal,steps=50. Record other demonstrations on first use with
--config.data.sim_demos.tasks=goal_open_drawer+goal_close_drawer (or .episodes_per_task=N, ...).
"""

from configs import common
from ejax.config.validate import ConfigError
from ejax.models import groot

def get_config(arg: str | None = None):
  args = common.parse_arg(arg, runlocal=False, suites=False, steps=0, batch=0, dataset="")
  if args.suites:
    args.runlocal = True  # the longer CPU recipe is runlocal on all 15 tasks (_suites)
  config = common.base_config()
  config.model = groot.model_config("runlocal" if args.runlocal else "full")
  # LoRA adapters (ejax/models/lora.py) on the DiT's or the frozen LLM's attention and MLP; rank 0 = off,
  # e.g. --config.model.lora.dit.rank=32 (adapters train, the adapted weights stay frozen).
  config.model.lora = dict(llm=dict(rank=0, alpha=0.0, targets="attn,ffn"),
                           dit=dict(rank=0, alpha=0.0, targets="attn,ffn"))
  config.data.update(name="lerobot", horizon=config.model.action_horizon,
                     image_size=(config.model.vision.image_size,) * 2, normalization="mean_std")
  # FSDP over every device: 2.4B parameters with Adam state for the trainable 1.1B.
  config.mesh = dict(data=1, fsdp=-1, tensor=1)
  # LeRobot's GR00T fine-tuning defaults (REFERENCE.md).
  config.train.update(steps=30_000, global_batch_size=256, learning_rate=1e-4, b1=0.95, b2=0.999,
                      weight_decay=1e-5, warmup_fraction=0.05, remat=config.model.remat)
  config.checkpoint.every_steps = 1000
  if args.runlocal:
    # The README's default data: ejax.sim's scripted-expert demonstrations of the quickstart's five
    # tasks, recorded once into ~/.cache/ejax/sim_demos (native MuJoCo, 64x64 cameras; configs/demos.py).
    common.quickstart_demos(config)
    # From random initialisation nothing is pre-trained: the vision tower and the LLM must learn too
    # (frozen at random weights, the policy saw cameras and instruction only through noise features).
    config.model.update(tune_visual=True, tune_llm=True)
    # Finer patches for small objects: 4 px patches of the 32 px images in a wider vision tower, pixel
    # shuffle back to 16 tokens per image (the LLM's sequence is unchanged). Seen: 35 % vs 29-32 %
    # with 8 px patches (BENCHMARKS.md, closed-loop policy quality).
    config.model.vision.update(patch_size=4, width=64, mlp_dim=128)
    config.model.connector.use_pixel_shuffle = True
    # Tried before the keypoint heatmaps and not kept (BENCHMARKS.md, closed-loop sections: 17-41 %
    # each; their knobs were removed in issue 33): an auxiliary object-state target, a conv stem, a
    # deeper DiT, sin-cos position codes, perturbed demos, 150-500 demos per task, a vision tower
    # pre-trained on rendered layouts, pixel keypoint tokens, a teacher-forced estimate read from free
    # keypoints.
    config.mesh = dict(data=-1, fsdp=1, tensor=1)
    config.train.update(steps=1500, global_batch_size=32, learning_rate=1e-3, compute_dtype="float32",
                        remat="none")
    config.checkpoint.every_steps = 500
    config.metrics.log_every_steps = 20
  else:
    # The optimizer updates the embodiment tables' rows the data uses (data.embodiment_id), not all 32:
    # the others' gradients are zero and dense AdamW would only decay them (ejax/train/rows.py).
    config.train.embodiment_rows = "data"
    # The frozen towers (SigLIP, the LLM) stored in bf16, the dtype the step computes them in: the same
    # numbers, 2.5 GiB less a GPU and no cast of 1.3B weights every step (~2.6 ms of an H200 step priced on
    # the compile-only H100; BENCHMARKS.md). An export then writes them in bf16. Towers trained with
    # tune_llm / tune_visual keep fp32 master weights.
    config.train.frozen_dtype = "bfloat16"
    # The trained weights kept in bf16 too, written by the optimizer's update: the forward reads them as
    # they are instead of casting 0.75B fp32 weights every step (the same numbers; +1.5 GiB of state;
    # ~1.7 ms of an H200 step priced on the compile-only H100, BENCHMARKS.md).
    config.train.compute_copy = True
    # train.frozen_fp8 (off): the frozen towers' projections as FP8 GEMMs from e4m3 copies made with the
    # state; priced 1.03-1.11x the bf16 step alone (the fp8_frozen arm of benchmarks/train_step.py,
    # unmeasured). With model.fp8 too (the fp8_all arm) an H200 ran 1.18x the bf16 step at the trainer's
    # cadence and 0.99x waited for (2026-11-30, one window). It costs the towers' features precision.
  if args.dataset == "synthetic":
    # ejax/data/synthetic.py: no cameras, no simulator, the shapes model_config("runlocal") sets.
    if not args.runlocal:
      raise ConfigError("groot dataset=synthetic is the CPU-sized smoke-test data: use it as runlocal,dataset=synthetic")
    config.data.name = "synthetic"
    config.train.update(steps=200, learning_rate=3e-3)
  elif args.dataset:
    config.data.update(name="lerobot", path=args.dataset)
  if config.data.name == "sim_demos" or args.dataset not in ("", "synthetic"):
    # A recorded dataset (ejax.sim demos: two cameras, 11-d state): the cameras it has, the state it records.
    config.model.update(num_cameras=2, max_state_dim=16)
    # Each sample is two images and a byte-level prompt: 72-87 tokens at CPU size for the quickstart's
    # instructions (up to ~110 for ejax.sim's longest; ~300 with the released tokenizer and 64-token
    # images). For the quickstart's demos, three a row of 264 leaves ~12 % padding (two a row of 256:
    # 38 %), which doubles the CPU quickstart's samples/s (50 -> 100, 2026-11-25); other datasets keep
    # two a row of 256 at CPU size, and a prompt that does not fit gets the collate's one-line fix. At
    # full size the row is chosen from the dataset's lengths at start-up (model.packing.row_length 0).
    if args.runlocal and config.data.name == "sim_demos":
      config.model.packing.update(row_length=264, samples_per_row=3)
      _sim_keypoint_estimate(config)
      if args.suites:
        _suites(config)
    elif args.runlocal:
      config.model.packing.row_length = 256
  return common.apply_run_args(config, args)


def _sim_keypoint_estimate(config) -> None:
  """The quickstart's perception: where the instructed object is, from the pixels (model.perception,
  ejax/models/perception/). The tower alone never learnt to find a 3-pixel block from 60 demos a task
  (its policies chose where to go from the arm's pose and the instruction); the recordings' keypoint
  labels (observation.environment_pixels) train two detectors per camera, chosen by the instruction, on
  the 64 px frames (the tower reads them pooled to 32 px); the action head reads their keypoints and an
  estimate of the target and goal read from them (trained on the true ones, slightly noised)."""
  config.data.image_size = (64, 64)
  common.sim_perception(config)


def _suites(config) -> None:
  """The longer CPU recipe (issue 14, point 3) on GR00T: common.sim_suites_recipe (all 15 tasks, the
  detectors that see a neighbourhood, the calibrated cameras, missed grasps, two flow steps; 81.3 %)
  with GR00T's VL row."""
  common.sim_suites_recipe(config)
  # Four samples a row of 440: the suites' prompts are 72-110 tokens (mean 90), so any 32 fit in 8
  # rows (16 % padding; three a row of 384 padded 30 %).
  config.model.packing.update(row_length=440, samples_per_row=4)
