"""DreamZero, NVIDIA's world action model (issue 32): a Wan DiT that denoises future video latents and
action chunks together, trained by ejax's one trainer.

Variants (the arg string): `5b` (default: Wan2.2-TI2V-5B, Wan2.2 VAE, 160x320 three-camera grid,
1,000 tokens a sample), `14b` (Wan2.1-I2V-14B, Wan2.1 VAE, 880 tokens a latent frame), `runlocal`
(the same architecture CPU-sized, on ejax.sim's recorded quickstart demonstrations like
configs/groot.py:runlocal); also `dataset=PATH` (a LeRobot dataset), `dataset=sim` (runlocal's
default), `dataset=synthetic` (runlocal on the camera-less ejax/data/synthetic.py), `steps=N`, `batch=N`.
Data (ejax/data/dreamzero_samples.py): a sample starts at any step: 1 + 4 x chunks x latent frames a
chunk video frames (the 5B: 33, 3 steps apart), every chunk's actions (4 x 24), the state before each
chunk, the cameras as a 2 x 2 grid (black where fewer than four); data.relative_action_dims=N makes the
first N action dims relative to the same state dims. The frozen VAE, umT5 and CLIP run in the train step,
or once ahead: the encode job writes their outputs to data.encoder_cache and training reads them
(ejax/train/encode.py; runlocal on the quickstart demos does so by default, writing the cache on first
use: 1.5x faster end to end on 2 cores, BENCHMARKS.md):
  python -m ejax.main --config=configs/dreamzero.py:5b --config.job=encode --config.data.path=/data/lerobot \
      --config.data.encoder_cache=/data/dz_cache     # then train with the same two settings
See the sizes and per-device memory without allocating anything:
  python -m ejax.main --config=configs/dreamzero.py:5b --config.job=summary
Expect (measured with nnx.eval_shape, 2026-11-27): 5B DiT 5.57B + action/state encoders and decoder
0.035B (published ~5.6B); 14B DiT 16.39B + 0.089B (published ~16.5B); umT5-XXL encoder 5.68B (5.7B);
CLIP ViT-H/14 0.632B (~0.63B); Wan2.1 VAE 0.127B; the Wan2.2 VAE here is shape-correct only (0.354B).
Import released weights first (the convert job; ejax/models/io/dreamzero.py):
  python -m ejax.main --config=configs/dreamzero.py:5b --config.job=convert --config.convert.direction=import \
      --config.convert.source=/ckpt/dreamzero --config.convert.destination=/ckpt/dreamzero_ejax
CPU smoke test of the training path (synthetic data has no cameras: its "video latents" are a fixed
function of the state and the chunks' actions, ejax/models/dreamzero/inputs.py):
  python -m ejax.main --config=configs/dreamzero.py:runlocal,dataset=synthetic
Expect (2026-11-27, 2 cores shared with other jobs): state ready in 1 s, the step compiled in 25-40 s,
then ~150 samples/s; 20 steps take the loss from 5.9 to 1.6 (video 3.0 -> 1.2, action 3.0 -> 0.4).
Sampling (ejax/models/dreamzero/model.py, unipc.py): the official 16-step UniPC with guidance on the
video, chunk by chunk over a KV cache of the clean context (tested equal to teacher forcing).
Closed loop on a CPU (issue 32 point 5): runlocal trains on the quickstart's recorded demos (recorded on
first use, as for GR00T), then the eval job runs it (20 unseen layouts a task, replanning every 2 steps):
  python -m ejax.main --config=configs/dreamzero.py:runlocal
  python -m ejax.main --config=configs/eval.py:runlocal --config.eval.checkpoint=runs/dreamzero_runlocal/checkpoints
runlocal hosts GR00T's quickstart perception (model.perception, _sim_perception below). Expect
(2026-11-27 evening, 2 cores shared with other agents' jobs, load ~7-15): 15-24 min of training (the
encoder cache ~2 min, compile ~75 s, then 12-91 samples/s; action loss 1.1 -> 0.17-0.34, video 1.9 ->
~0.2, the logged total adds the heatmap cross-entropy, ~4.5 at the end), the eval 3.5-4 min: 57 % [47, 66]
over the five tasks in each of two runs, 59 % [53, 65] each with eval's episodes=50 (lifts 55-62 /
30-40 %, drawers 95-100 %, the pick-and-place 0-2 %; GR00T's quickstart: 60-63 %; without the
perception module 35 % [26, 45], lifts 0 %). Its video prediction in closed loop, as an image and a
latent MSE against "nothing moves" (0.34 vs 0.43 on one rollout of each task, with the perception
module and without it): benchmarks/dreamzero_rollout.py.
Act (the eval and serve jobs, as for GR00T; ejax.train.policy): each observation becomes the grid of the
current frame, the state and the prompt; the model samples chunk 0 (actions_per_chunk actions) over the
KV cache of that frame with UniPC and guidance:
  python -m ejax.main --config=configs/dreamzero.py:runlocal --config.job=serve --config.serve.checkpoint=runs/dreamzero_runlocal
Not yet here (issue 32): a policy that keeps the episode's frames as later chunks' context (it acts
from the current frame alone).
"""

from configs import common
from ejax.config.validate import ConfigError
from ejax.models.dreamzero import inputs
from ejax.models.dreamzero import model as dreamzero


def get_config(arg: str | None = None):
  args = common.parse_arg(arg, runlocal=False, **{"5b": False, "14b": False}, steps=0, batch=0, dataset="")
  if sum(bool(args[name]) for name in ("runlocal", "5b", "14b")) > 1:
    raise ConfigError("configs/dreamzero.py takes one of runlocal, 5b, 14b, e.g. configs/dreamzero.py:14b")
  variant = "runlocal" if args.runlocal else "14b" if args["14b"] else "5b"
  config = common.base_config()
  config.model = dreamzero.model_config(variant)
  config.data.name = "synthetic"
  # FSDP over every device: the frozen encoders (6.5B) and the trained DiT with its Adam state.
  config.mesh = dict(data=1, fsdp=-1, tensor=1)
  # The official full fine-tune (scripts/train/droid_training_full_finetune_wan22.sh, groot/vla/configs/
  # conf.yaml): AdamW lr 1e-5, betas (0.95, 0.999), weight decay 1e-5, 5 % warmup, cosine, 200k steps;
  # the batch as RLinf runs the 5B: 32 samples a GPU with recompute, 8 GPUs.
  config.train.update(steps=200_000, global_batch_size=256, learning_rate=1e-5, b1=0.95, b2=0.999,
                      weight_decay=1e-5, warmup_fraction=0.05, remat=config.model.remat)
  config.checkpoint.every_steps = 1000
  if args.runlocal:
    config.mesh = dict(data=-1, fsdp=1, tensor=1)
    config.train.update(steps=100, global_batch_size=8, learning_rate=3e-3, compute_dtype="float32",
                        remat="none")
    config.checkpoint.every_steps = 50
    config.metrics.log_every_steps = 10
  if args.dataset == "synthetic":
    if not args.runlocal:
      raise ConfigError("dreamzero dataset=synthetic is the CPU-sized smoke-test data: use it as runlocal,dataset=synthetic")
  elif args.dataset in ("", "sim") and args.runlocal:
    # ejax.sim's scripted-expert demonstrations of the quickstart's five tasks (recorded once into
    # ~/.cache/ejax/sim_demos; two 64x64 cameras, 11-d state, 4-d actions; configs/demos.py).
    common.quickstart_demos(config)
  elif args.dataset:
    if args.dataset == "sim":
      raise ConfigError("dreamzero dataset=sim is the CPU quickstart's demonstrations: use it as runlocal,dataset=sim")
    config.data.update(name="lerobot", path=args.dataset)
  elif not args.runlocal:
    config.data.update(name="lerobot", normalization="quantile")   # the official q01 / q99 (set data.path)
  if config.data.name != "synthetic" and args.runlocal:
    _video_runlocal(config)
  if config.data.name == "sim_demos":
    _sim_perception(config)
  if config.data.name != "synthetic":
    # A sample: 1 + 4 * chunks * frames_per_chunk frames a step apart as the layout says, every chunk's
    # actions, the state before each chunk, each camera resized to a cell of the 2 x 2 grid
    # (ejax/data/dreamzero_samples.py).
    config.data.update(inputs.data_settings(config.model))
    config.data.relative_action_dims = 0   # > 0: the first N action dims relative to the same state dims
    # A directory of the frozen encoders' outputs written ahead by the encode job (ejax/train/encode.py):
    # training then reads it and skips the VAE, umT5 and CLIP; None encodes in the train step.
    # encoder_cache_refresh: data.encoder_cache is a folder of caches, one a setting and seed, the trainer
    # writing one first where it is missing or stale (else a missing or stale cache is an error).
    config.data.encoder_cache = common.placeholder(str)
    config.data.encoder_cache_refresh = False
    if config.data.name == "sim_demos":
      # Cached ahead: 1.5x faster end to end over runlocal's 1200 steps on 2 cores, the encode job included
      # (benchmarks/dreamzero_encode.py, BENCHMARKS.md); written on first use beside the recorded demos.
      config.data.update(encoder_cache="~/.cache/ejax/dreamzero_encoder_cache", encoder_cache_refresh=True)
  return common.apply_run_args(config, args)


def _video_runlocal(config) -> None:
  """runlocal on recorded cameras (ejax.sim's two 64 px ones): a 64 x 64 grid (32 px cells), a VAE whose
  first stage runs on 2 x 2 pixel patches as Wan 2.2's does (stride 8, 8 latent channels, one residual
  block a stage: the VAE's 3D convolutions were most of a CPU step, 10 -> ~30 samples/s at batch 32 on a
  loaded 2-core machine), 16 tokens a latent frame; 1200 steps of 32 at lr 1e-3 (~30 min on 2 cores)."""
  config.model.image_size = (64, 64)
  config.model.vae.update(version="2.2", dim=8, z_dim=8, dim_mult=(1, 2, 2), temporal_downsample=(True, True),
                          num_res_blocks=1)
  config.model.dit.update(in_dim=8, out_dim=8)
  config.train.update(steps=1200, global_batch_size=32, learning_rate=1e-3)
  config.checkpoint.every_steps = 400
  config.metrics.log_every_steps = 20


def _sim_perception(config) -> None:
  """GR00T's quickstart perception (configs/groot.py, _sim_keypoint_estimate) hosted the same way: two
  detectors per camera chosen by the instruction, trained on the recordings' keypoint labels on the
  64 px frames, and an estimate of the target and goal read from them (teacher-forced in training),
  written into every chunk's state. At this size umT5, CLIP and the VAE are random and frozen: nothing
  else tells the model where the objects are."""
  config.model.num_cameras = 2
  common.sim_perception(config)
