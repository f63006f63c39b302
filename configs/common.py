"""Defaults every ejax config starts from: mesh, sharding rules, optimiser, checkpoints, metrics.

A config file calls `base_config()` and fills in `model` and `data`; variants come through the arg
string (`configs/groot.py:runlocal`), and one-off changes through `--config.x=y`.
"""

from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder

from ejax.parallel import axes as ax

# The one table from logical axis names to mesh axes. The first rule that names an axis wins;
# mesh axes that do not divide a dimension are dropped for it (see ejax/parallel/rules.py).
SHARDING_RULES = (
    (ax.ACT_BATCH, (ax.DATA, ax.FSDP)),
    (ax.ACT_LEN, None),
    (ax.ACT_EMBED, None),
    (ax.ACT_HEADS, ax.TENSOR),
    (ax.ACT_MLP, ax.TENSOR),
    (ax.ACT_VOCAB, ax.TENSOR),
    (ax.EMBED, ax.FSDP),
    (ax.MLP, ax.TENSOR),
    (ax.HEADS, ax.TENSOR),
    (ax.KV_HEADS, ax.TENSOR),
    (ax.HEAD_DIM, None),
    (ax.VOCAB, (ax.TENSOR, ax.FSDP)),
    (ax.EMBODIMENT, None),
    (ax.IN_FEATURES, None),
    (ax.NORM, None),
    (ax.LAYERS, None),
)


def base_config() -> ConfigDict:
  config = ConfigDict()
  config.job = "train"
  config.seed = 0
  # Compiled programs persist here, so resumed and repeated runs skip compilation ("" disables); on CPUs
  # in a subdirectory a kind of host CPU (ejax.config.runtime.host_cpu_tag).
  config.compilation_cache_dir = "~/.cache/ejax/xla"

  # Devices: sizes of the (data, fsdp, tensor) mesh; one may be -1 ("all remaining devices").
  config.mesh = ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  config.sharding_rules = [list(rule) for rule in SHARDING_RULES]
  # Multi-host: leave empty on one process; see README "Multi-host".
  config.distributed = ConfigDict(dict(
      coordinator_address=placeholder(str), num_processes=placeholder(int), process_id=-1,
      initialization_timeout=300,
      peer_lost_after=40.0))  # s a peer's heartbeat may stand still before every process ends naming it
                              # (ejax/parallel/watchdog.py; 10 s to below jax's heartbeat timeout, 150 s)

  config.model = ConfigDict()
  config.data = data_defaults()

  config.train = ConfigDict(dict(
      steps=1000,
      global_batch_size=32,
      grad_accum_steps=1,        # micro-batches per step (gradients summed before the update)
      learning_rate=1e-4,
      warmup_fraction=0.05,
      min_learning_rate_ratio=0.0,  # cosine decays to lr * this
      b1=0.95, b2=0.999, eps=1e-8,
      weight_decay=1e-5,
      grad_clip_norm=1.0,
      param_dtype="float32",     # master weights
      compute_dtype="bfloat16",  # forward/backward
      compute_copy=False,        # keep the trained weights also in compute_dtype, written by the optimizer,
                                 # for the forward to read (the same numbers; +2 bytes a weight; ejax/train/optim.py)
      frozen_fp8=False,          # frozen projections (GR00T's SigLIP and LLM) run as FP8 GEMMs from e4m3
                                 # copies made once with the state (+1 byte a frozen weight; ejax/train/frozen_fp8.py)
      command_buffers=False,     # GPU: loops (scanned blocks) in CUDA graphs too (ejax/train/step.py)
      cuda_graphs=True,          # GPU: runs of kernels as CUDA graphs, XLA:GPU's default (False: each kernel
                                 # launched from the host, the no_graphs arm; ejax/train/step.py)
      triton_gemm=False,         # GPU: XLA's Triton GEMM fusions (False: every matmul a cuBLAS call, as the
                                 # benchmarks measure; ejax/train/step.py)
      check_attention_layout=False,  # Hopper attention routes in a lax.cond beside ejax's exact kernel, for
                                 # batches whose rows are not packed (False: unconditionally, such a batch
                                 # stops the run with a NaN loss; ejax.kernels.attention.unchecked_layout)
      remat="none",              # none | dots | dots_no_batch | full (ejax/parallel/remat.py)
      ema_decay=0.0,             # 0 disables the EMA copy of the parameters
      embodiment_rows="all",     # per-embodiment tables: rows the optimizer updates ("all" | "data": the
                                 # ids data.embodiment_id names | "0,31"; ejax/train/rows.py)
      transfer_guard="disallow",  # accidental host<->device copies in the loop are errors
      stop_at=0,                 # >0: end this run after that step (to fit a time slice); resume later
      step_timeout=0.0,          # s a step, save or exchange may take before every process ends with one
                                 # line (multi-process; 0: max(300 s, 20x the median warmed-up step))
      init_weights="",           # weights imported by the convert job: loaded into the fresh state, never
                                 # initialised (a resumed run reads its own checkpoint instead)
  ))
  config.checkpoint = ConfigDict(dict(
      every_steps=500, keep=3, async_save=True,
      resume=True,          # False over existing checkpoints refuses to start, unless move_aside
      move_aside=False,     # with resume=False: move the old run's outputs to <workdir>/previous-<time>/
      step=placeholder(int),  # resume from this step (None: the newest); later steps are moved aside
      allow_changes="",     # settings that may differ from the checkpoint's: "train.steps,..." or "all"
  ))
  config.metrics = ConfigDict(dict(
      log_every_steps=10, tensorboard=True, progress_bar=True,
      peak_flops_per_device=placeholder(float),  # else from ejax/train/metrics.py's table
      # Weights & Biases (pip install -e ".[wandb]"): the same scalars as TensorBoard, the config, and
      # the eval job's success table and videos. mode "offline" writes the run under <workdir>/wandb
      # with no network (`wandb sync` uploads it later); "online" needs `wandb login` or WANDB_API_KEY.
      wandb=False, wandb_project="ejax", wandb_entity="",
      wandb_name="",     # "": the workdir's name
      wandb_mode="online"))  # online | offline | disabled
  config.serve = serve_defaults()
  # Job `convert` (ejax/models/io/convert.py): released weights <-> ejax parameters.
  config.convert = ConfigDict(dict(
      direction="",    # import (released -> ejax) | export (ejax -> released)
      source="",       # import: the released checkpoint; export: an earlier import's destination
      destination="",  # a new path: the job never overwrites
  ))
  return config


def serve_defaults() -> ConfigDict:
  """Job `serve` (ejax/serve/server.py, README "Deploy"): a policy behind openpi's websocket
  protocol, concurrent clients batched on the device. serve.checkpoint is any of (ejax/serve/load.py
  tells them apart on disk): a train job's <workdir>/checkpoints; an rl job's <workdir>/rl_checkpoints
  of a GR00T actor (state-based actors are refused: they read privileged simulator state); or weights
  imported by the convert job, built from this config's model and data with the statistics at
  data.stats_path. A workdir holding checkpoints/ or rl_checkpoints/ stands for it."""
  return ConfigDict(dict(
      checkpoint="",              # train checkpoints, rl_checkpoints or imported weights; "": the workdir's
      version=-1,                 # the train step or RL version to serve (-1: the newest)
      host="127.0.0.1",           # any other address (0.0.0.0: every interface) needs api_key
      port=8000,                  # openpi's default; 0 picks a free port
      api_key="",                 # clients send "Authorization: Api-Key <key>"; others are refused
      max_batch=16,               # requests batched in one call (compiled sizes 1, 2, 4, ... max_batch)
      max_wait_ms=5.0,            # how long a batch waits for other active clients' requests
      max_message_bytes=16 * 2**20,  # larger messages close their connection (code 1009)
      weights="same",             # same | fp8_block (weight matrices at block-FP8 values)
      warmup=True,                # compile every batch size before accepting clients
      seed=0,                     # the flow noise of requests that bring none
  ))


def demo_settings() -> dict:
  """What configs/demos.py records (and data.name="sim_demos" records on first use): ejax.sim's
  scripted experts on every task, one LeRobot v3 dataset (ejax/sim/demos.py)."""
  return dict(
      tasks="all",            # "all", a suite ("spatial" | "object" | "goal"), or "name,name"
      episodes_per_task=50,
      num_envs=60,            # envs stepped together (split evenly over the tasks)
      backend="native",       # "native" (faster on CPU) or "mjx"
      image_height=128,
      image_width=128,
      action_noise=0.0,       # > 0: execute expert + N(0, noise) but record the expert's action
      perturb_prob=0.0,       # > 0: on this fraction of steps execute a random hand move instead
                              # (the expert's action is recorded): corrections from off-path states
      offset_start_prob=0.0,  # > 0: this fraction of episodes starts after one random hand move in the
                              # approach (clean corrective chunks; ejax/sim/demos.py record_round)
      miss_grasp_prob=0.0,    # > 0: this fraction of episodes misses its first grasp (the fingers close
                              # on air beside the object) and grasps again (record_round)
      keep_failures=False,
      video_codec="h264",
      video_lossless=True,    # h264 yuv444p at crf 0: the frames the policy trains on are the ones the
                              # simulator renders at evaluation (LeRobot's yuv420p halves the colour
                              # resolution: a 3-pixel block's colour smears; ejax/data/video.py)
      seed=0,
  )


# The CPU quickstart's tasks (configs/groot.py:runlocal, configs/pi05.py:runlocal,dataset=sim): five
# tasks in one scene whose instructions pick the object or the goal (two lifts of different objects,
# both drawer directions, a pick-and-place), so the policy must read the instruction.
QUICKSTART_TASKS = "goal_lift_green_block+object_lift_cylinder+goal_open_drawer+goal_close_drawer+goal_red_block_to_plate"
QUICKSTART_DEMOS_PER_TASK = 60


def quickstart_demos(config: ConfigDict) -> None:
  """data: ejax.sim's scripted-expert demonstrations of the quickstart tasks (recorded on first use
  into ~/.cache/ejax/sim_demos, native MuJoCo, two 64x64 cameras; see configs/demos.py)."""
  config.data.name = "sim_demos"
  config.data.sim_demos.update(tasks=QUICKSTART_TASKS, episodes_per_task=QUICKSTART_DEMOS_PER_TASK,
                               image_height=64, image_width=64)


def sim_perception(config: ConfigDict) -> None:
  """The quickstart's perception module (model.perception, ejax/models/perception/) on a model whose
  num_cameras is set: two detectors per camera chosen by the instruction, trained on the recordings'
  keypoint labels (observation.environment_pixels) on the 64 px frames, and an estimate of the target
  and goal read from their keypoints (observation.environment_state), written into the state's slots
  after ejax.sim's 11-d state (the 7-d estimate, 2 points x 2 cameras x (x, y): 26 with two cameras)."""
  from ejax.models import perception
  from ejax.sim.env import ENVIRONMENT_STATE_SIZE, STATE_SIZE
  config.model.perception = perception.default_config()   # image_size 64, 1 free + 2 chosen points, 7-d estimate
  config.model.perception.estimate.dim = ENVIRONMENT_STATE_SIZE
  config.model.max_state_dim = STATE_SIZE + perception.state_slots(config.model.perception, config.model.num_cameras)
  config.data.update(aux_state_key="observation.environment_state", aux_pixel_key="observation.environment_pixels")


def sim_suites_recipe(config: ConfigDict) -> None:
  """The longer CPU recipe on all 15 tasks of ejax.sim's three suites (issue 14, point 3), on a config
  that already has the quickstart's perception (model.perception): detectors that see a neighbourhood
  (a bowl's rim from a plate's flat disc of the same random colour: two residual 3x3 convolutions, the
  second dilated 2) and a learnt position term (the left / nearest of three identical blocks; gain 40:
  at 10 the detectors memorised the layouts instead), more steps, the keypoints through the calibrated
  cameras, and demos with missed grasps. On GR00T: 60 / 150 / 100 demos a task, 6000 / 6000 / 7000
  steps with the learnt readout: 52.7 / 54.7 / 54.5 %; + geometry 69.7 %, + missed grasps 75.9 %, + the
  goal from the agentview alone and local 78.0 %, + two flow steps 81.3 % (BENCHMARKS.md). The
  model's packed row is its own (configs/groot.py, configs/pi05.py: `suites`)."""
  from ejax.sim.scene import camera_calibration  # lazy: only the simulator recipes need MuJoCo's scene
  config.data.sim_demos.update(tasks="all", episodes_per_task=100)
  config.model.perception.detectors.update(context_layers=2, context_dilation=2, position_scale=40.0)
  # ejax.sim's cameras are calibrated: at inference the estimate places the target and the goal by
  # their keypoints through them (ejax/models/perception/geometry.py) instead of the readout's x, y, which
  # memorises the recorded layouts (54.5 % -> 68-70 % on the same checkpoint). Not in the quickstart:
  # its per-patch detectors put a drawer's handle 17-23 px off, which the readout absorbs (59 % -> 39 %).
  # Both points are soft-argmaxes local to their peak, and the goal is the agentview's alone (the wrist
  # camera sees the held block where the goal is): model.perception.geometry's radius / tolerance
  # defaults (75.3 % -> 78.0 % on one checkpoint).
  config.model.perception.geometry.cameras = camera_calibration()
  # 30 % of the demonstrations miss their first grasp and grasp again (ejax/sim/demos.py): without
  # them, a closed gripper always held the target, and after a missed grasp the detectors and the
  # readout found the target in the empty hand (46 of 75 failures). 69 % -> 75.9 %.
  config.data.sim_demos.miss_grasp_prob = 0.3
  # Two Euler steps of the flow per chunk instead of four: fewer steps land nearer the mean chunk,
  # which is what a block on a 2 cm tolerance needs (one GR00T checkpoint, 750 episodes: 10 / 4 / 2 / 1
  # steps 72.0 / 78.0 / 81.3 / 79.9 %; one step lost the drawers, 96 -> 86 %). Inference only.
  config.model.num_inference_steps = 2
  config.train.steps = 7000
  config.checkpoint.every_steps = 1000


def data_defaults() -> ConfigDict:
  """Every field the input pipeline reads (ejax/data/pipeline.py), so each can be overridden."""
  return ConfigDict(dict(
      name="synthetic",               # synthetic | lerobot | rlds | sim_demos
      path=placeholder(str),          # dataset root (LeRobot) or TFDS data dir (RLDS); sim_demos: where
                                      # to keep the recording (None: ~/.cache/ejax/sim_demos/<settings>)
      sim_demos=demo_settings(),      # sim_demos: what to record when data.path holds no dataset yet
      rlds_name=placeholder(str),     # RLDS builder name
      split="train",
      rlds_state_field="state",
      rlds_instruction_field="language_instruction",
      horizon=16,                     # action chunk length
      observation_offsets=[0],        # frames of observation history, in steps
      cameras=placeholder(list),      # None: every camera in the dataset
      image_size=placeholder(tuple),  # (height, width) after resizing; None keeps the dataset's
      state_key="observation.state",
      action_key="action",
      aux_state_key=placeholder(str),  # a per-frame vector for a model's training-only auxiliary target
      aux_pixel_key=placeholder(str),  # a per-frame vector of image keypoint labels, read as it is (not
                                       # normalised): e.g. ejax.sim's observation.environment_pixels
      embodiment_id=0,                # an int, or {robot_type: id}
      tolerance_s=1e-4,               # video frame timestamp tolerance
      shuffle=True,
      num_epochs=placeholder(int),    # None: endless
      num_workers=0,                  # grain worker processes (0: in-process)
      prefetch=2,
      read_threads=0,
      normalization="mean_std",       # mean_std | quantile (q01/q99) | none
      stats_path=placeholder(str),    # None: the dataset's meta/stats.json
      augment=dict(crop_scale=1.0, brightness=0.0, contrast=0.0, saturation=0.0),
      on_bad_sample="error",          # error | skip (count and log)
      max_open_videos=32,
      noise=0.0,                      # synthetic only: action noise
      skip_limit=100,                 # skip: stop after this many bad samples in a row
  ))


def apply_run_args(config: ConfigDict, args: ConfigDict) -> ConfigDict:
  """The arg-string overrides every training config takes: `steps=N`, `batch=N`."""
  if args.get("steps"):
    config.train.steps = args.steps
  if args.get("batch"):
    config.train.global_batch_size = args.batch
  return config


def parse_arg(arg: str | None, **defaults):
  """'runlocal,steps=20' -> ConfigDict(runlocal=True, steps=20) over the given defaults."""
  from ejax.config import parse_arg as _parse
  return _parse(arg, **defaults)
