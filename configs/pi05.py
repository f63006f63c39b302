"""pi0.5 fine-tuning on a LeRobot dataset (openpi's pi05 recipe on ejax's packed inputs).

Launch (one host, all its GPUs; the dataset and PaliGemma's tokenizer are local files):
  python -m ejax.main --config=configs/pi05.py --workdir=runs/pi05 \
      --config.data.path=/data/libero --config.model.tokenizer_path=/ckpt/paligemma_tokenizer.model
Start from released weights by importing them first (openpi tree or LeRobot safetensors):
  python -m ejax.main --config=configs/pi05.py --config.job=convert --config.convert.direction=import \
      --config.convert.source=/ckpt/pi05_base --config.convert.destination=/ckpt/pi05_ejax
LoRA fine-tuning (openpi's gemma_2b_lora + gemma_300m_lora: only the adapters, SigLIP and the
projections train; the adapters are merged into the weights by the convert job's export):
  python -m ejax.main --config=configs/pi05.py:lora --config.train.init_weights=/ckpt/pi05_ejax ...
Model summary without allocating it (3.3B parameters: Gemma-2B 2.51B, Gemma-300M 0.31B + its
adaRMS 0.11B, SigLIP So400m 0.41B):
  python -m ejax.main --config=configs/pi05.py --config.job=summary
openpi's pi05_libero recipe: batch 256, lr 5e-5 cosine, 10k warmup, clip 1.0, EMA 0.999, horizon
10. The packed prefix row is chosen at start-up from the dataset's first 512 samples and logged
(model.packing.row_length 0, ejax/data/row_plan.py: one LIBERO-like sample of two cameras a row of 640
tokens, ~8.5 % padding); set model.packing.row_length and samples_per_row to fix one.
Full-size training has not been run in ejax yet (no GPU in the session that wrote this), so
there is no measured loss curve to quote for it. What was measured: on 8 fake CPU devices under
fsdp=8, the full-size train step (batch 8, bf16 compute, remat "full") lowers and compiles through
the trainer (~4 + ~10 min on a loaded 2-core CPU), holding 6.25 GiB of arguments per device (fp32
parameters + Adam state, sharded 8 ways) and ~10.7 GiB of XLA:CPU-estimated temporaries.

CPU-sized run of the same recipe (same architecture at toy widths, fp32):
  python -m ejax.main --config=configs/pi05.py:runlocal --config.data.path=<small LeRobot dataset> \
      --config.model.tokenizer_path=<sentencepiece .model>
Measured on a 2-core CPU shared with other jobs, on a 16-episode LeRobot v3 dataset (two 32 px
video cameras, 3-dim state and action, 4 tasks): compile ~70 s, then 200 steps in ~15 s; the
flow-matching loss fell from 1.93 (step 20) to 0.56 (step 200). tests/models/test_pi05_inputs.py
trains the runlocal model on pipeline-schema samples and checks the loss falls below half.
All 15 tasks with GR00T's longer recipe (common.sim_suites_recipe: 100 demos a task with missed grasps,
detectors that see a neighbourhood, the calibrated cameras, two flow steps, 7000 steps):
  python -m ejax.main --config=configs/pi05.py:suites --workdir=runs/pi05_suites
  python -m ejax.main --config=configs/eval.py:runlocal,episodes=50 --config.eval.checkpoint=runs/pi05_suites/checkpoints
Measured 2026-11-27 (2 cores, recording cached): training 22-24 min, then 67.1 % [63.6, 70.3] and, seed 1,
66.8 % [63.4, 70.1] over 750 unseen episodes each (GR00T's `suites`: 81.3 %; BENCHMARKS.md, "pi0.5 on the
15 tasks").
Arg string: `runlocal`, `suites`, `steps=N`, `batch=N`, `horizon=N`, `dataset=PATH|sim`, `lora`, e.g.
configs/pi05.py:runlocal,steps=50. `runlocal,dataset=sim` trains on the GR00T quickstart's recorded
ejax.sim demonstrations with a tokenizer built locally from the suites' instructions (nothing to
download), and the eval job judges it like any checkpoint:
  python -m ejax.main --config=configs/pi05.py:runlocal,dataset=sim --workdir=runs/pi05_sim
  python -m ejax.main --config=configs/eval.py:runlocal --config.eval.checkpoint=runs/pi05_sim/checkpoints
`dataset=sim` turns on GR00T's quickstart perception (model.perception, _sim_keypoint_estimate below;
issue 33), and the action expert reads the state continuously (model.continuous_state: a projection of
the state vector, the module's slots written, joins every action token, as pi0 reads its state) with the
prompt the instruction alone (model.discrete_state_input=False, openpi's switch). Measured 2026-11-27 on
the 2 shared cores, demos cached, 2500 steps of batch 32 (the default): the two commands above, training
7 min 26 s (19:20-19:28, load 7-8, five samples a row; from a clean cache on idle cores, 21:35-21:41,
4 min 58 s with the recording, the same result), then the eval command: 69 % [59.4, 77.2] over
100 episodes (lifts 100 / 75 %, drawers 85 / 80 %, the pick-and-place 5 %); with --config.seed=1 56 %
[46.2, 65.3] (6 min 19 s, load 4-7): together 62.5 % [55.6, 68.9] of 200. Earlier, 1500 steps: training
9 min 15 s (18:54-19:04, load 11-12; compile 55 s, ~97 samples/s, five samples a row), flow loss ~0.31
over the last 250 steps (heatmap cross-entropy ~4.3); 47 % [37.5, 56.7] (lifts 75 / 55 %, drawers 55 /
45 %, the pick-and-place 5 %); its first run (three a row, 18 min at load ~11) 48 % [38.5, 57.7]:
together 47.5 % [40.7, 54.4] of 200. On the way (one run each, 100 episodes): the state as the prompt's
256-bin tokens only (as released) 20 % [13.3, 28.9] (lifts 35 / 20 %, drawers 25 / 20 %), against 1.3 %
without perception; with the slots also on each action token (--config.model.perception_tokens=True,
left off) 16 % [10.1, 24.4]; bins and continuous_state 43 % [33.7, 52.8]; a 64-wide expert 38 % [29.1,
47.8] with the bins, 45 % [35.6, 54.8] without. Judged on the simulator's true target and goal
(--config.eval.true_estimate=True) the 20 % checkpoint reached 35 %, the 43 % one 55 % [45.2, 64.4].
"""

from configs import common
from ejax.config.validate import ConfigError
from ejax.models import pi05


def get_config(arg: str | None = None):
  args = common.parse_arg(arg, runlocal=False, suites=False, steps=0, batch=0, horizon=0, dataset="", lora=False)
  if args.suites:
    # the longer CPU recipe on all 15 tasks is runlocal on the simulator's demonstrations (_suites)
    args.runlocal, args.dataset = True, "sim"
  config = common.base_config()
  config.model = pi05.model_config("runlocal" if args.runlocal else "full")
  # pi05_libero: 10-step chunks; the model's horizon and the pipeline's are one number.
  config.model.action_horizon = args.horizon or 10
  # LoRA adapters (ejax/models/lora.py), rank 0 = off; `lora` in the arg gives openpi's
  # gemma_2b_lora + gemma_300m_lora (its pi05 LoRA fine-tuning: rank 16 / 32 on attention and MLP).
  config.model.lora = dict(llm=dict(rank=16 if args.lora else 0, alpha=16.0, targets="attn,ffn"),
                           expert=dict(rank=32 if args.lora else 0, alpha=32.0, targets="attn,ffn"))
  config.data.update(
      name="lerobot", horizon=config.model.action_horizon,
      image_size=(config.model.vision.image_size,) * 2, normalization="quantile")  # openpi: q01/q99
  # FSDP over every device: the 3.3B parameters and their Adam state do not fit replicated.
  config.mesh = dict(data=1, fsdp=-1, tensor=1)
  config.train.update(steps=30_000, global_batch_size=256, learning_rate=5e-5, warmup_fraction=10_000 / 30_000,
                      b1=0.9, b2=0.95, weight_decay=1e-10, grad_clip_norm=1.0, ema_decay=0.999,
                      remat=config.model.remat)
  config.checkpoint.every_steps = 1000
  # Under LoRA the frozen Gemma weights are kept in bf16 (openpi does the same): 2.8B of them; and,
  # as openpi's low-memory LoRA recipes, no EMA.
  config.train.frozen_dtype = "bfloat16" if args.lora else ""
  if args.lora:
    config.train.ema_decay = 0.0
  if args.runlocal:
    config.mesh = dict(data=-1, fsdp=1, tensor=1)
    config.train.update(steps=200, global_batch_size=8, learning_rate=1e-3, warmup_fraction=0.05,
                        weight_decay=0.0, ema_decay=0.0, compute_dtype="float32", remat="none")
    config.checkpoint.every_steps = 100
    config.metrics.log_every_steps = 20
  if args.dataset == "sim":
    # The GR00T quickstart's data (configs/groot.py:runlocal): recorded ejax.sim demonstrations of its
    # five tasks, two cameras, the 11-d state; the tokenizer is built locally from the suites'
    # instructions when none is given (ejax.models.paligemma_tokenizer.sim_suites_tokenizer).
    if not args.runlocal:
      raise ConfigError("pi05 dataset=sim is the CPU-sized simulator recipe: use it as runlocal,dataset=sim")
    common.quickstart_demos(config)
    config.model.update(num_cameras=2, max_state_dim=16)
    # The action expert reads the state (and the perception module's slots) continuously, as pi0 does,
    # and the prompt is the instruction alone (openpi's discrete_state_input=False): 20 % with the state
    # as the prompt's 256-bin tokens only, 43 % with both, 47-48 % continuous only (the docstring's runs).
    config.model.update(continuous_state=True, discrete_state_input=False)
    # 2500 steps: 56-69 % where 1500 gave 45-48 % (the docstring's runs); 6-7.5 min on the loaded 2 cores.
    config.train.update(steps=2500, global_batch_size=32)
    config.checkpoint.every_steps = 500
    _sim_keypoint_estimate(config)
    if args.suites:
      _suites(config)
  elif args.dataset:
    config.data.path = args.dataset
  return common.apply_run_args(config, args)


def _sim_keypoint_estimate(config) -> None:
  """GR00T's quickstart perception (configs/groot.py, _sim_keypoint_estimate) on pi0.5: two detectors
  per camera chosen by the instruction, trained on the recordings' keypoint labels on the 64 px frames,
  and an estimate of the target and goal read from their keypoints. The pi0.5 hook reads every camera
  of a sample and the detectors' frames at the tower's own size, so the tower reads the 64 px frames
  with 16 px patches (16 tokens an image, as the 32 px frames with 8 px patches gave)."""
  config.data.image_size = (64, 64)
  config.model.vision.update(image_size=64, patch_size=16)
  config.model.packing.max_images_per_sample = config.model.num_cameras
  # Five samples a row of 232: 32 image tokens and a 9-13-token prompt each (no state bins; with the 11
  # bins, 34-38 tokens, three a row of 216 left 8 % padding, two a row of 192 27 %).
  config.model.packing.update(row_length=232, samples_per_row=5)
  common.sim_perception(config)


def _suites(config) -> None:
  """The longer CPU recipe on all 15 tasks, as GR00T's `suites` (common.sim_suites_recipe: 100 demos a
  task with missed grasps, detectors that see a neighbourhood, the calibrated cameras, two flow steps,
  7000 steps), with pi0.5's own row."""
  common.sim_suites_recipe(config)
  # The suites' prompts are 9-18 tokens with the local tokenizer (41-50 with the two images' 32 tokens,
  # mean 45): five a row of 240 never overflowed 2,000 random batches of 32 (14 % padding; 232 did).
  config.model.packing.update(row_length=240, samples_per_row=5)
