"""GR00T-N1.5: Eagle 2.5 VL backbone + flow-matching DiT action head, on packed VL rows.

    images -> SigLIP -> connector (mlp1) --+
    instruction tokens -> Qwen3 embedding -+-> first 12 Qwen3 layers -> VL features [rows, L, 2048]
    VL features -> LayerNorm (vlln) -> 4-layer self-attention         (per segment, packed rows)
    state -> per-embodiment MLP -> 1 token ; 32 learned future tokens ; noisy actions -> 16 tokens
    DiT (16 blocks, AdaLN(t), even blocks cross-attend to the sample's own VL segment)
    -> per-embodiment decoder -> velocity for the 16 action steps

Batch layout (see `ejax.models.groot_inputs`): the VL stream is packed into rows
(vl_tokens / vl_segment_ids / vl_positions / vl_image_slot [rows, L], images [num_images, H, W, 3]),
while state, actions and masks are per sample ([n, ...]) with (sample_row_offset, sample_segment)
saying where each sample's VL tokens live (indices relative to home rows, so that process-local
batches concatenate into a correct global batch). Sizes come from the released GR00T-N1.5-3B config.json
(`model_config("full")`); `model_config("runlocal")` shrinks every width for CPU runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from ejax.models import flow, geometry, groot_inputs, layers
from ejax.models.connector import (KEYPOINT_HIDDEN, MLPConnector, PixelKeypoints, heatmap_loss, mlp_settings,
                                   pixel_grid)
from ejax.models.dit import DiT, DiTConfig, VLSelfAttentionTransformer, VLTransformerConfig
from ejax.models.embodiment import CategorySpecificMLP, MultiEmbodimentActionEncoder
from ejax.models.groot_inputs import image_token_indices, sample_rows, tokens_per_image  # noqa: F401
from ejax.models.qwen3 import Qwen3, Qwen3Config
from ejax.models.registry import ModelSpec
from ejax.models.siglip import SiglipConfig, SiglipVisionTransformer, normalize_images
from ejax.parallel.axes import EMBED, IN_FEATURES, MLP
from ejax.parallel.shard_local import take_rows

# Parameter path prefixes of each reported component (ejax.models.summary).
COMPONENTS = {
    "vision": ("backbone/vision",),
    "connector": ("backbone/connector",),
    "llm": ("backbone/llm",),
    "vl_self_attention": ("action_head/vlln", "action_head/vl_self_attention"),
    "dit": ("action_head/dit",),
    "per_embodiment": ("action_head/state_encoder", "action_head/action_encoder", "action_head/action_decoder"),
    "action_head_embeddings": ("action_head/future_tokens", "action_head/position_embedding"),
}

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# aux_heatmap_position: logits gain this times w . (x, y), (x, y) in [-1, 1], so that an O(1) weight
# moves a detector by a few nats across the image (learns at the detectors' learning rate).
AUX_POSITION_SCALE = 10.0


# model.aux_geometry_* defaults (also for checkpoints saved before those keys existed).
GEOMETRY_POINTS, GEOMETRY_TCP_DIMS, GEOMETRY_RADIUS, GEOMETRY_TOLERANCE = (0, 3), (8, 9, 10), (2, 2), (0.04, 0.0)


def model_config(variant: str = "full") -> ml_collections.ConfigDict:
  """"full": the released GR00T-N1.5-3B sizes; "runlocal": the same architecture, CPU-sized.

  runlocal on ejax/data/synthetic.py (AdamW 3e-3 with 5 % warmup + cosine, clip 1, batch 32, 200
  steps, 1 CPU device): flow-matching loss 2.42 at step 0 (1.44 mean of the first 10 steps) ->
  0.42 mean of the last 20; ~30 s of steps after ~1 min of compilation on 2 busy cores.
  """
  c = ml_collections.ConfigDict()
  c.name = "groot"
  c.dtype = "bfloat16"
  c.param_dtype = "float32"
  c.fp8 = False                      # DiT feed-forward through ejax.kernels.fp8 (off: at the DiT's
  #                                    1536-wide GEMMs FP8 measured 1.12x of bf16 on an H200, the
  #                                    train step's FP8 arm is unmeasured; BENCHMARKS.md, FP8)
  c.fp8_impl = "xla"                 # with fp8: xla (cuBLASLt FP8, per-tensor scales; 1.30x bf16 over
  #                                    the DiT and LLM GEMMs) | xla_rowwise (1.12x) | blockwise (Pallas, 0.33x)
  c.remat = "full"                   # per-block rematerialisation (ejax.parallel.remat)
  c.attention_impl = "auto"          # every attention call: ejax.kernels.attention IMPLS ("auto": per backend)
  c.vision = dict(width=1152, depth=27, mlp_dim=4304, num_heads=16, patch_size=14, image_size=224, conv_stem=(),
                  posemb_init="normal")
  c.connector = dict(num_layers=1, use_pixel_shuffle=False,   # released: mlp1.0 = Linear(1152, 2048)
                     keypoints=0)   # > 0: that many spatial-softmax pixel keypoint tokens per image too (connector.py)
  c.llm = dict(vocab_size=151680, width=2048, mlp_dim=6144, num_heads=16, num_kv_heads=8, head_dim=128,
               num_layers=12, rope_theta=1_000_000.0)          # Qwen3-1.7B, select_layer = 12
  c.vl_transformer = dict(num_layers=4, num_heads=32, head_dim=64, dropout=0.2)
  c.dit = dict(num_layers=16, num_heads=32, head_dim=48, output_dim=1024, dropout=0.2)
  c.hidden_size = 1024               # state-encoder hidden, DiT output and decoder width
  c.max_num_embodiments = 32
  c.max_state_dim = 64
  c.max_action_dim = 32
  c.action_horizon = 16
  c.num_future_tokens = 32
  c.max_seq_len = 1024               # rows of the action position-embedding table
  c.num_inference_steps = 4
  c.num_timestep_buckets = 1000
  c.num_cameras = 1
  c.image_token_id = 151669          # <IMG_CONTEXT> in Eagle 2.5's Qwen3 vocabulary
  c.tokenizer_path = ""              # a local tokenizer.json (ejax.models.qwen_tokenizer)
  c.text_first = False               # instruction before the images in the prompt (qwen_tokenizer.eagle_prompt)
  # row_length 0: the packed row (tokens and samples a row) is chosen at start-up from the data's lengths
  # (ejax/data/row_plan.py: the train job measures the dataset's first probe_samples samples; example
  # batches use theirs). The example batch's 261-269 tokens: 8 a row of 2,176, 2.6 % padding (two a row
  # of 1,024, as before, padded 48 %).
  c.packing = dict(row_length=0, samples_per_row=0, max_row_length=4096, probe_samples=512)
  # Training-only auxiliary target (0: off): a head on the mean of each sample's VL tokens (what the DiT
  # cross-attends to) regresses the sample's normalised privileged state (data.aux_state_key, e.g.
  # ejax.sim's target and goal positions), which teaches the vision and language path to say where the
  # instructed object is. Not part of the released recipe; inference ignores it.
  c.aux_state_dim = 0
  c.aux_loss_weight = 1.0
  # With the target on, also hand the estimate to the action head, in the state vector's last
  # aux_state_dim slots (which must be padding): a state estimator read from the images, trained by
  # the auxiliary target, that the policy acts on at inference too.
  c.aux_state_input = False
  # With aux_state_input: train the action head on the target itself (plus Gaussian noise of this std,
  # in normalised units, about the estimate's error) wherever a sample has one, and the estimator only
  # through its own loss (stop-gradient); at inference the estimate takes the target's place. A head
  # trained on a jointly trained estimate learns early, while it is noise, to ignore those slots.
  c.aux_teacher_forcing = False
  c.aux_teacher_noise = 0.1
  # With teacher forcing: this fraction of the samples that have a target (drawn per training step)
  # get the estimate instead, as at inference, so that the head also learns how far off the estimate
  # is, task by task (a drawer's handle estimated 3.5 cm off along the drawer's axis missed the handle
  # when the head trusted it like the true target).
  c.aux_teacher_mix = 0.0
  # > 0 (with the target on): that many spatial-softmax keypoints per image (connector.PixelKeypoints
  # on 2x2 pixel patches, coordinates only) that the auxiliary head reads, with the instruction's text
  # embeddings and the state, instead of the pooled VL tokens: the estimate is trained straight from
  # the pixels (a colour detector that moves with the object), not through a from-scratch tower that
  # memorises the demonstrations' layouts. Two hidden layers of aux_keypoint_width.
  c.aux_keypoints = 0
  c.aux_keypoint_width = 256
  # > 0 (with aux_keypoints): that many more keypoints per image whose detectors the instruction
  # chooses (a linear map of its text embeddings), each trained by a cross-entropy on its heatmap
  # against where that point appears in the image (data.aux_pixel_key, e.g. ejax.sim's
  # observation.environment_pixels: the target and its goal in each camera). Supervised where the
  # object is, a detector learns in a few hundred steps what the estimate's loss alone never taught it
  # (from 60 demos per task the readout learnt to copy the hand's position instead).
  c.aux_heatmaps = 0
  c.aux_heatmap_weight = 1.0
  # With aux_heatmaps: hand the instruction's keypoints ((x, y) of each point in each camera, the
  # model's own, gradient stopped) to the action head in the state's last slots (after the estimate's,
  # with aux_state_input). Trained on what it will see at inference, the head learns how far to trust
  # each (the target in the agentview to ~0.7 px; a drawer's handle under the gripper much less).
  c.aux_heatmap_input = False
  # With aux_heatmaps: a 3x3 convolution over the grid of patch features (residual) before the
  # instruction's detectors, so that a detector sees a patch's neighbourhood (a dark bar on the
  # cabinet's front is a drawer handle; a dark disc on the table is not), not only its colour.
  c.aux_heatmap_context = False
  # With aux_heatmap_context: more residual 3x3 convolutions after the first (each dilated by
  # aux_heatmap_context_dilation), so a detector sees a larger neighbourhood: a bowl's rim and a
  # plate's flat disc of the same random colour are told apart only over ~10 px (a probe on the
  # 15 tasks' recorded frames: the goal keypoint 13-24 px off with no context, 2.5-16 px with one
  # layer, ~1 px with two, the second dilated 2; BENCHMARKS.md).
  c.aux_heatmap_context_layers = 1
  c.aux_heatmap_context_dilation = 1
  # With aux_heatmaps: a learnt position term per instruction-chosen detector and camera, logit +
  # AUX_POSITION_SCALE * w . (x, y) with w read from the instruction (zero at initialisation), so a
  # detector can prefer the leftmost / nearest of identical blocks (the spatial suite).
  c.aux_heatmap_position = False
  # The position term's gain (AUX_POSITION_SCALE by default): larger makes "the left / nearest one"
  # cheaper to say with the position term than to memorise the demonstrations' layouts in the
  # detectors' context features (the spatial suite's detectors did the latter at 10).
  c.aux_heatmap_position_scale = AUX_POSITION_SCALE
  # With aux_heatmaps: whether the estimate's loss also trains the instruction's detectors (through
  # the keypoints and strengths the readout reads). False: they learn from their own labels only. A
  # heatmap's cross-entropy leaves its logits' level free, so a strength the readout reads is a
  # channel the estimate's loss can fill with whatever fits the recorded layouts.
  c.aux_estimate_trains_heatmaps = True
  # Which entries of the state the estimate's readout reads (with aux_keypoints); (): all. Leaving out
  # the gripper (ejax.sim's index 7) keeps the readout from learning "closed gripper: the target is in
  # the hand", true in every demonstration and false after a missed grasp.
  c.aux_proprio_dims = ()
  # Neither helped the 15-task recipe (configs/groot.py:suites, 54.5 %): both 47.5 %, the gripper
  # left out alone 51.3 % (BENCHMARKS.md).

  # With aux_state_input and aux_heatmaps: calibrated cameras, {camera name: dict(mount="world" or "tcp",
  # position=(x, y, z) (the camera's, or its offset from the tool centre point for a camera on the
  # hand), rotation=9 floats row-major camera -> world, fovy=degrees)}, one per camera of the batch
  # (which stacks them sorted by name). Set, the estimate's positions of the instruction's points are
  # their keypoints back-projected through these cameras (ejax/models/geometry.py) at the readout's
  # heights, instead of the readout's x, y: a learnt readout memorises the layouts it was trained on.
  # Empty: the readout alone. ejax.sim's calibration: ejax.sim.scene.camera_calibration().
  c.aux_geometry_cameras = {}
  c.aux_geometry_points = GEOMETRY_POINTS      # where each instruction point's (x, y, z) starts in the estimate
  c.aux_geometry_tcp_dims = GEOMETRY_TCP_DIMS  # the raw state's tool-centre-point entries (for hand cameras)
  # Per point: a soft-argmax over the cells within this many of the heatmap's peak (0: the whole map).
  # The target's map has other blocks of its colour as weaker peaks, and so has a goal that is a block
  # (stacking); the global soft-argmax averages them in.
  c.aux_geometry_radius = GEOMETRY_RADIUS
  # Metres, one for all points or one per point: a hand camera's point replaces the world camera's
  # within this; 0: the world camera's alone. The goal's is 0: carrying the target over its goal, the
  # hand camera sees the held block where the goal is (median goal error while holding, ejax.sim's
  # eight bowl and plate tasks: 1.6-2.3 cm with it, 1.1-1.5 cm without, 1.0-1.3 cm local; BENCHMARKS.md).
  c.aux_geometry_tolerance = GEOMETRY_TOLERANCE
  # > 0: on the world cameras' maps of the points with a radius, the peak the soft-argmax centres on
  # is chosen by the instruction's position term among the detections (local maxima of the logits
  # without it, within this many of their largest: geometry.relational_peak) instead of the logits'
  # argmax. 0: the argmax. On ejax.sim's spatial suite it picks the instructed one of three identical
  # blocks on more first frames (83.5 % -> 92.5 % at 4), yet along rollouts the 15 tasks lost 10 points
  # (other objects' detections within the margin; BENCHMARKS.md), so it is off.
  c.aux_geometry_relation_margin = 0.0
  # > 0 (with the margin): the detections are scored by the logits plus this many times the position
  # term instead of by the position term alone (3: -3.5 points on the same 15 tasks).
  c.aux_geometry_relation_gain = 0.0
  # The statistics that map the estimate and the state to metres ((centre, scale) lists by key
  # "state" / "estimate"): the policy fills them from the checkpoint's (train/policy.py); without
  # them (training: the head is teacher-forced anyway) the readout's estimate stands.
  c.aux_geometry_norm = {}

  # With aux_keypoints: the batch's images at this size (0: the vision tower's) for the keypoints,
  # average-pooled to vision.image_size for the tower (a multiple of it).
  c.aux_image_size = 0
  # Which entries of the (normalised) state vector the action head reads; the others are zeroed (the
  # dataset's mean). (): all. A policy that reads the arm's pose can replay its demonstrations' paths
  # from proprioception alone and never learn to look (causal confusion); reading only the gripper
  # (ejax.sim's state index 7) leaves the cameras to say where the hand is relative to the object.
  c.state_dims = ()
  # Pre-training the vision tower and connector on ejax.sim layouts rendered with every object's
  # position, before training (ejax/train/vision_pretrain.py); layouts=0: off. tasks "": the
  # recorded demonstrations' tasks (data.sim_demos.tasks).
  c.vision_pretrain = dict(layouts=0, steps_per_layout=8, perturb_prob=0.3, tasks="", steps=3000, batch_size=32,
                           learning_rate=1e-3, seed=0)
  # Freezing (LeRobot's fine-tuning defaults; the released pre-training config had tune_visual=True).
  c.tune_llm = False
  c.tune_visual = False
  c.tune_projector = True
  c.tune_diffusion_model = True
  if variant == "runlocal":
    c.dtype = "float32"
    c.remat = "none"
    c.vision = dict(width=32, depth=2, mlp_dim=64, num_heads=2, patch_size=8, image_size=32, conv_stem=(),
                    posemb_init="normal")
    c.llm = dict(vocab_size=512, width=64, mlp_dim=128, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2,
                 rope_theta=10_000.0)
    c.vl_transformer = dict(num_layers=1, num_heads=4, head_dim=16, dropout=0.0)
    c.dit = dict(num_layers=2, num_heads=4, head_dim=16, output_dim=64, dropout=0.0)
    c.hidden_size = 64
    c.max_num_embodiments = 2
    c.max_state_dim = 8
    c.max_action_dim = 4
    c.action_horizon = 8
    c.num_future_tokens = 4
    c.max_seq_len = 32
    c.image_token_id = 511
    c.packing = dict(row_length=64, samples_per_row=2)
    # Shapes of ejax/data/synthetic.py's demonstrations (the trainer's default data): no cameras.
    c.num_cameras = 0
    c.state_dim, c.action_dim, c.horizon, c.num_tasks = 6, 4, 8, 4
  elif variant != "full":
    raise ValueError(f"GR00T variant {variant!r} is not one of 'full', 'runlocal'")
  return c


def keep_state_dims(state: jax.Array, dims) -> jax.Array:
  """`state` [n, d] with the entries not in `dims` zeroed (the dataset's mean); (): all kept."""
  if not dims:
    return state
  keep = np.zeros(state.shape[-1], bool)
  keep[[i for i in dims if i < state.shape[-1]]] = True
  return jnp.where(keep, state, 0)


class GrootBackbone(nnx.Module):
  """Eagle 2.5: vision tower + connector + truncated Qwen3 -> VL features on packed rows."""

  def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    attention_impl = config.get("attention_impl", "auto")
    self.vision = SiglipVisionTransformer(SiglipConfig(**config.vision), remat=config.remat,
                                          attention_impl=attention_impl, **common)
    self.connector = MLPConnector(config.vision.width, config.llm.width, **mlp_settings(config.connector), **common)
    keypoints = config.connector.get("keypoints", 0)
    self.keypoints = nnx.data(PixelKeypoints(keypoints, config.llm.width, **common) if keypoints else None)
    self.llm = Qwen3(Qwen3Config(**config.llm), remat=config.remat, attention_impl=attention_impl, **common)
    self.image_token_id = config.image_token_id
    self.vision_image_size = int(config.vision.image_size)

  def encode_images(self, batch) -> jax.Array | None:
    """The connector's image tokens [num_images, tokens_per_image, llm width]; None without cameras."""
    if not batch["images"].shape[0]:
      return None
    images = normalize_images(batch["images"], self.llm.dtype)
    size = self.vision_image_size
    if images.shape[1] != size:  # model.aux_image_size: larger images for the keypoint heatmaps
      factor = images.shape[1] // size
      images = images.reshape(images.shape[0], size, factor, size, factor, images.shape[-1]).mean(axis=(2, 4))
    tokens = self.connector(self.vision(images))
    if self.keypoints is not None:
      tokens = jnp.concatenate([tokens, self.keypoints(images).astype(tokens.dtype)], axis=1)
    return tokens

  def __call__(self, batch) -> jax.Array:
    embeddings = self.llm.embed(batch["vl_tokens"])
    image_tokens = self.encode_images(batch)
    if image_tokens is not None:  # datasets without cameras have text-only prompts
      flat = image_tokens.reshape(-1, image_tokens.shape[-1])
      index = image_token_indices(batch, image_tokens.shape[1], xp=jnp)
      is_image = batch["vl_tokens"] == self.image_token_id
      index = jnp.clip(jnp.where(is_image, index, 0), 0, flat.shape[0] - 1)
      embeddings = jnp.where(is_image[..., None], take_rows(flat, index), embeddings)
    return self.llm(embeddings, batch["vl_segment_ids"], batch["vl_positions"])


class GrootActionHead(nnx.Module):

  def __init__(self, config, *, dtype, param_dtype, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    vl_width = config.llm.width
    dit_config = DiTConfig(cross_attention_dim=vl_width, **config.dit)
    width = dit_config.width                                             # input_embedding_dim (1536)
    self.config = config
    self.vlln = layers.LayerNorm(vl_width, eps=1e-5, **common)
    attention_impl = config.get("attention_impl", "auto")
    self.vl_self_attention = VLSelfAttentionTransformer(VLTransformerConfig(**config.vl_transformer),
                                                        remat=config.remat, attention_impl=attention_impl, **common)
    fp8 = config.fp8 and config.get("fp8_impl", True)
    self.dit = DiT(dit_config, fp8=fp8, remat=config.remat, attention_impl=attention_impl, **common)
    self.state_encoder = CategorySpecificMLP(config.max_num_embodiments, config.max_state_dim, config.hidden_size,
                                             width, **common)
    self.action_encoder = MultiEmbodimentActionEncoder(config.max_num_embodiments, config.max_action_dim, width,
                                                       **common)
    self.action_decoder = CategorySpecificMLP(config.max_num_embodiments, config.hidden_size, config.hidden_size,
                                              config.max_action_dim, layer1_axes=(EMBED, MLP),
                                              layer2_axes=(EMBED, IN_FEATURES), **common)
    normal = nnx.initializers.normal(0.02)
    self.future_tokens = layers.make_param(rngs, normal, (config.num_future_tokens, width), (None, EMBED), param_dtype)
    self.position_embedding = layers.make_param(rngs, normal, (config.max_seq_len, width), (None, EMBED), param_dtype)
    self.aux_state_head = self.aux_state_out = self.aux_keypoints = self.aux_keypoint_in = nnx.data(None)
    self.aux_state_mid = self.aux_proprio_in = self.aux_queries = nnx.data(None)
    self.heatmap_context = self.heatmap_context_bias = nnx.data(None)
    self.heatmap_context_more = self.heatmap_context_more_bias = self.aux_query_position = nnx.data(None)
    self.num_cameras = config.num_cameras
    self.heatmap_context_dilation = int(config.get("aux_heatmap_context_dilation", 1))
    self.heatmap_position_scale = float(config.get("aux_heatmap_position_scale", AUX_POSITION_SCALE))
    self.heatmap_points = config.get("aux_heatmaps", 0) if config.get("aux_keypoints", 0) else 0
    if config.get("aux_state_dim", 0) and config.get("aux_keypoints", 0) and config.num_cameras:
      # A keypoint readout needs depth and width: which keypoint (by instruction) and the camera's
      # projection (pixel -> world) are both non-linear. Two hidden layers of aux_keypoint_width.
      width = config.get("aux_keypoint_width", 256)
      self.aux_keypoints = PixelKeypoints(config.aux_keypoints, 0, pixel_patch=2, **common)
      self.aux_state_head = layers.Dense(vl_width, width, axes=(EMBED, MLP), **common)
      if self.heatmap_points:
        self.aux_queries = layers.Dense(vl_width, self.heatmap_points * KEYPOINT_HIDDEN, axes=(EMBED, None), **common)
        if config.get("aux_heatmap_context", False):
          self.heatmap_context = layers.make_param(rngs, nnx.initializers.lecun_normal(),
                                                   (3, 3, KEYPOINT_HIDDEN, KEYPOINT_HIDDEN), (None, None, None, MLP),
                                                   param_dtype)
          self.heatmap_context_bias = layers.make_param(rngs, nnx.initializers.zeros, (KEYPOINT_HIDDEN,), (MLP,),
                                                        param_dtype)
          more = int(config.get("aux_heatmap_context_layers", 1)) - 1
          if more > 0:
            self.heatmap_context_more = layers.make_param(
                rngs, nnx.initializers.lecun_normal(in_axis=(1, 2, 3), out_axis=4, batch_axis=(0,)),
                (more, 3, 3, KEYPOINT_HIDDEN, KEYPOINT_HIDDEN), (None, None, None, None, MLP), param_dtype)
            self.heatmap_context_more_bias = layers.make_param(rngs, nnx.initializers.zeros, (more, KEYPOINT_HIDDEN),
                                                               (None, MLP), param_dtype)
        if config.get("aux_heatmap_position", False):
          self.aux_query_position = layers.Dense(vl_width, config.num_cameras * self.heatmap_points * 2,
                                                 axes=(EMBED, None), kernel_init=nnx.initializers.zeros, **common)
      self.aux_keypoint_in = layers.Dense(config.num_cameras * (config.aux_keypoints + self.heatmap_points) * 3,
                                          width, axes=(None, MLP), **common)
      # and the arm's state: the wrist camera sees the object relative to the hand
      self.aux_proprio_in = layers.Dense(config.max_state_dim, width, axes=(None, MLP), **common)
      self.aux_state_mid = layers.Dense(width, width, axes=(MLP, None), **common)
      self.aux_state_out = layers.Dense(width, config.aux_state_dim, axes=(None, None), **common)
    elif config.get("aux_state_dim", 0):
      self.aux_state_head = layers.Dense(vl_width, config.hidden_size, axes=(EMBED, MLP), **common)
      self.aux_state_out = layers.Dense(config.hidden_size, config.aux_state_dim, axes=(MLP, None), **common)
    self.dtype = dtype

  def encode_vl(self, features: jax.Array, segment_ids: jax.Array, rng=None) -> jax.Array:
    return self.vl_self_attention(self.vlln(features), segment_ids, rng)

  def aux_state(self, vl: jax.Array, batch, instruction: jax.Array | None = None,
                heatmap_logits: jax.Array | None = None) -> jax.Array:
    """The auxiliary state prediction [n, aux_state_dim] from the mean of each sample's VL tokens: a
    pooled readout, so the tokens the DiT attends to must carry where things are in their content.
    With aux_keypoints: from the keypoints, the state and `instruction` [n, vl width] (the sample's
    pooled text embeddings, Groot.aux_estimate) instead: the VL tokens also carry the vision tower's features,
    which memorise the demonstrations' layouts and would let the estimate do the same."""
    rows = sample_rows(batch, xp=jnp)
    if self.aux_keypoints is None:
      mask = (batch["vl_segment_ids"][rows] == batch["sample_segment"][:, None]).astype(vl.dtype)   # [n, L]
      pooled = jnp.einsum("nl,nld->nd", mask, vl[rows]) / jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
      return self.aux_state_out(jax.nn.gelu(self.aux_state_head(pooled))).astype(jnp.float32)
    images = normalize_images(batch["images"], self.dtype)
    logits = self.aux_keypoints.heatmaps(images)
    if self.aux_queries is not None:
      chosen = self.heatmap_logits(images, instruction) if heatmap_logits is None else heatmap_logits
      if not self.config.get("aux_estimate_trains_heatmaps", True):
        chosen = jax.lax.stop_gradient(chosen)
      logits = jnp.concatenate([logits, chosen], -1)
    points = self.aux_keypoints.summary(images, logits=logits)  # per image
    hidden = (self.aux_state_head(instruction.astype(self.dtype))
              + self.aux_keypoint_in(points.reshape(rows.shape[0], -1).astype(self.dtype))   # per sample
              # the state as the batch has it (its aux_state_dim last slots are still zero padding)
              + self.aux_proprio_in(keep_state_dims(jnp.asarray(batch["state"]),
                                                    self.config.get("aux_proprio_dims", ())).astype(self.dtype)))
    hidden = self.aux_state_mid(jax.nn.gelu(hidden))
    return self.aux_state_out(jax.nn.gelu(hidden)).astype(jnp.float32)

  @staticmethod
  def _standardise(instruction: jax.Array) -> jax.Array:
    # The mean byte embedding is small and alike across instructions, and the detectors it chose
    # stayed flat for hundreds of steps (cross-entropy on the target 3.1 vs 1.7 at 300).
    centred = instruction - jnp.mean(instruction, axis=-1, keepdims=True)
    return centred * jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + 1e-6)

  def _heatmap_queries(self, instruction: jax.Array) -> jax.Array | None:
    """The instruction's detectors [n images, points, KEYPOINT_HIDDEN] (each sample's cameras in turn)."""
    if self.aux_queries is None:
      return None
    centred = self._standardise(instruction)
    queries = self.aux_queries(centred.astype(self.dtype)).reshape(instruction.shape[0], self.heatmap_points, -1)
    return jnp.repeat(queries, self.num_cameras, axis=0)

  def heatmap_position_weights(self, instruction: jax.Array) -> jax.Array | None:
    """aux_heatmap_position: the instruction's position weights [n images, points, 2] (each sample's
    cameras in turn; each camera its own), or None."""
    if self.aux_query_position is None:
      return None
    weights = self.aux_query_position(self._standardise(instruction).astype(self.dtype))
    return weights.reshape(instruction.shape[0] * self.num_cameras, self.heatmap_points, 2)

  def heatmap_logits(self, images: jax.Array, instruction: jax.Array) -> jax.Array:
    """The instruction's detectors' logits [n images, cells, points] over each image's patch grid."""
    x = self.aux_keypoints.features(images)
    if self.heatmap_context is not None:
      grid = [size // self.aux_keypoints.pixel_patch for size in images.shape[1:3]]
      cells = x.reshape(x.shape[0], *grid, x.shape[-1])
      context = jax.lax.conv_general_dilated(cells, self.heatmap_context[...].astype(x.dtype), (1, 1), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
      x = x + jax.nn.gelu(context + self.heatmap_context_bias[...].astype(x.dtype)).reshape(x.shape)
      if self.heatmap_context_more is not None:
        dilation = int(self.heatmap_context_dilation)
        for kernel, bias in zip(self.heatmap_context_more[...], self.heatmap_context_more_bias[...]):
          cells = x.reshape(x.shape[0], *grid, x.shape[-1])
          context = jax.lax.conv_general_dilated(cells, kernel.astype(x.dtype), (1, 1), "SAME",
                                                 rhs_dilation=(dilation, dilation),
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
          x = x + jax.nn.gelu(context + bias.astype(x.dtype)).reshape(x.shape)
    queries = self._heatmap_queries(instruction)
    logits = jnp.einsum("nph,nqh->npq", x, queries.astype(x.dtype)).astype(jnp.float32)
    position = self.heatmap_position(images, instruction)
    return logits if position is None else logits + position

  def heatmap_position(self, images: jax.Array, instruction: jax.Array) -> jax.Array | None:
    """aux_heatmap_position: the instruction's position term [n images, cells, points] that
    heatmap_logits adds to the detectors' logits, or None."""
    weights = self.heatmap_position_weights(instruction)
    if weights is None:
      return None
    grid = [size // self.aux_keypoints.pixel_patch for size in images.shape[1:3]]
    return self.heatmap_position_scale * jnp.einsum("pd,nqd->npq", jnp.asarray(pixel_grid(*grid)),
                                                    weights.astype(jnp.float32))

  def heatmap_loss(self, batch, instruction: jax.Array, logits: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy [n] of the instruction's heatmaps against the labels batch["aux_pixels"]
    ([n, cameras * points * 2]) over the (camera, point) pairs in view; 0 where none is."""
    images = normalize_images(batch["images"], self.dtype)
    logits = self.heatmap_logits(images, instruction) if logits is None else logits
    grid = tuple(size // self.aux_keypoints.pixel_patch for size in images.shape[1:3])
    labels = jnp.asarray(batch["aux_pixels"], jnp.float32).reshape(images.shape[0], self.heatmap_points, 2)
    loss, in_view = heatmap_loss(logits, labels, grid)
    loss, in_view = (v.reshape(instruction.shape[0], -1).astype(jnp.float32) for v in (loss, in_view))
    return jnp.sum(loss, axis=1) / jnp.maximum(jnp.sum(in_view, axis=1), 1.0)

  def velocity(self, noisy_actions, timestep_buckets, state_tokens, vl, batch, rng=None) -> jax.Array:
    """Predicted velocity (action - noise) [n, horizon, max_action_dim]."""
    embodiment = batch["embodiment_id"]
    horizon = noisy_actions.shape[1]
    action_tokens = self.action_encoder(noisy_actions, timestep_buckets, embodiment)
    action_tokens = action_tokens + self.position_embedding[:horizon].astype(action_tokens.dtype)
    future = jnp.broadcast_to(self.future_tokens[...].astype(action_tokens.dtype),
                              (noisy_actions.shape[0],) + self.future_tokens.shape)
    tokens = jnp.concatenate([state_tokens.astype(action_tokens.dtype), future, action_tokens], axis=1)
    out = self.dit(tokens, timestep_buckets, vl_tokens=vl, vl_segment_ids=batch["vl_segment_ids"],
                   sample_row=sample_rows(batch, xp=jnp), sample_segment=batch["sample_segment"], rng=rng)
    return self.action_decoder(out, embodiment)[:, -horizon:].astype(jnp.float32)


class Groot(nnx.Module):
  """GR00T-N1.5 with the registry interface: compute_loss and sample_actions."""

  def __init__(self, config, rngs: nnx.Rngs):
    dtype, param_dtype = DTYPES[config.dtype], DTYPES[config.param_dtype]
    self.config = config
    self.backbone = GrootBackbone(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.action_head = GrootActionHead(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def context(self, batch, rng=None, heatmap_logits=None):
    """VL tokens after the action head's VL transformer, and the state token, per sample."""
    vl, state = self.context_inputs(batch, rng, heatmap_logits)
    return vl, self.action_head.state_encoder(state[:, None, :], batch["embodiment_id"])

  def context_inputs(self, batch, rng=None, heatmap_logits=None):
    """(VL tokens after the VL transformer, the state vector the state encoder reads [n, max_state_dim]
    with the keypoints and the estimate in their slots): everything upstream of the flow."""
    features = self.backbone(batch)
    if not (self.config.tune_llm or self.config.tune_visual):
      features = jax.lax.stop_gradient(features)  # nothing below is trained: skip their backward
    vl = self.action_head.encode_vl(features, batch["vl_segment_ids"], rng)
    state = keep_state_dims(jnp.asarray(batch["state"]), self.config.get("state_dims", ()))
    head = self.action_head
    if heatmap_logits is None and head.aux_queries is not None and (
        self.config.get("aux_heatmap_input", False) or self.config.get("aux_state_input", False)):
      # once for the keypoints, the estimate and its geometry (compute_loss passes its own)
      heatmap_logits = head.heatmap_logits(normalize_images(batch["images"], head.dtype),
                                           self.instruction_embedding(batch))
    keypoint_slots = 0
    if self.config.get("aux_heatmap_input", False):
      keypoints = jax.lax.stop_gradient(self.heatmap_keypoints(batch, heatmap_logits))
      keypoint_slots = keypoints.shape[-1]
      state = state.at[:, -keypoint_slots:].add(keypoints.astype(state.dtype))
    if self.config.get("aux_state_input", False):
      # The estimate rides in the state's last aux_state_dim slots (zero padding; the collate checks).
      estimate = self.aux_estimate(vl, batch, heatmap_logits)
      if self.config.get("aux_geometry_cameras") and self.config.get("aux_geometry_norm"):
        estimate = self.geometric_estimate(batch, estimate, heatmap_logits)
      if self.config.get("aux_teacher_forcing", False):
        estimate = jax.lax.stop_gradient(estimate)
        if "aux_state" in batch:
          target = jnp.asarray(batch["aux_state"], jnp.float32)
          forced = jnp.asarray(batch["aux_mask"]) > 0
          if rng is not None:
            target = target + self.config.aux_teacher_noise * jax.random.normal(jax.random.fold_in(rng, 7), target.shape)
            mix = self.config.get("aux_teacher_mix", 0.0)
            if mix:
              forced = forced & (jax.random.uniform(jax.random.fold_in(rng, 8), forced.shape) >= mix)
          estimate = jnp.where(forced[:, None], target, estimate)
      end = state.shape[-1] - keypoint_slots
      state = state.at[:, end - self.config.aux_state_dim:end].add(estimate.astype(state.dtype))
    return vl, state

  def aux_estimate(self, vl: jax.Array, batch, heatmap_logits=None) -> jax.Array:
    """The auxiliary head's estimate [n, aux_state_dim]; with aux_keypoints it reads the instruction
    as the mean of the sample's text-token embeddings (no image content)."""
    instruction = self.instruction_embedding(batch) if self.action_head.aux_keypoints is not None else None
    return self.action_head.aux_state(vl, batch, instruction, heatmap_logits)

  def geometric_estimate(self, batch, estimate: jax.Array, logits=None) -> jax.Array:
    """The estimate [n, aux_state_dim] (normalised) with the instruction's points placed by their
    keypoints through the calibrated cameras (model.aux_geometry_cameras) at the readout's heights."""
    c, head = self.config, self.action_head
    names = sorted(c.aux_geometry_cameras)
    if len(names) != c.num_cameras:
      raise ValueError(f"model.aux_geometry_cameras calibrates {names} but the model has {c.num_cameras} cameras")
    images = normalize_images(batch["images"], head.dtype)
    if logits is None:
      logits = head.heatmap_logits(images, self.instruction_embedding(batch))
    n = batch["state"].shape[0]
    state_centre, state_scale = (jnp.asarray(v, jnp.float32) for v in c.aux_geometry_norm["state"])
    centre, scale = (jnp.asarray(v, jnp.float32) for v in c.aux_geometry_norm["estimate"])
    state = jnp.asarray(batch["state"], jnp.float32)[:, :state_centre.shape[0]] * state_scale + state_centre
    metres = estimate.astype(jnp.float32) * scale + centre
    starts = [int(s) for s in c.get("aux_geometry_points", GEOMETRY_POINTS)]
    heights = jnp.stack([metres[:, s + 2] for s in starts], -1)
    cameras = [c.aux_geometry_cameras[name] for name in names]
    tcp = state[:, jnp.asarray(c.get("aux_geometry_tcp_dims", GEOMETRY_TCP_DIMS))]
    tolerance = np.asarray(c.get("aux_geometry_tolerance", GEOMETRY_TOLERANCE), np.float32)
    grid = [size // head.aux_keypoints.pixel_patch for size in images.shape[1:3]]
    radius = tuple(c.get("aux_geometry_radius", GEOMETRY_RADIUS))
    centres = jnp.argmax(logits, axis=1)                                               # [n * cameras, K]
    margin = float(c.get("aux_geometry_relation_margin", 0.0))
    if margin > 0 and head.aux_query_position is not None:
      # the world cameras' maps: the relation chooses among the detections (geometry.relational_peak)
      position = head.heatmap_position(images, self.instruction_embedding(batch))
      content, gain = logits - position, float(c.get("aux_geometry_relation_gain", 0.0))
      chosen = geometry.relational_peak(content, content + gain * position if gain else position, tuple(grid), margin)
      world = np.tile([cam["mount"] == "world" for cam in cameras], n)
      centres = jnp.where(jnp.asarray(world)[:, None], chosen, centres)
    coords, _ = head.aux_keypoints.coordinates(images, logits=logits)                  # [n * cameras, K, 2]
    for k, r in enumerate(radius):
      if r:
        local = geometry.local_soft_argmax(logits[..., k:k + 1], pixel_grid(*grid), int(r), 2.0 / grid[1],
                                           centre=centres[:, k:k + 1])
        coords = coords.at[:, k].set(local[:, 0])
    points_xy = coords.reshape(n, c.num_cameras, -1, 2)
    world_xyz = geometry.locate(points_xy[:, :, :len(starts)], heights, tcp, cameras, tolerance)
    for k, s in enumerate(starts):
      metres = metres.at[:, s:s + 3].set(world_xyz[:, k])
    return ((metres - centre) / scale).astype(estimate.dtype)

  def heatmap_keypoints(self, batch, logits=None) -> jax.Array:
    """[n, cameras * points * 2]: where the instruction's detectors put each point in each camera
    (soft-argmax (x, y) in [-1, 1]; the layout of batch["aux_pixels"])."""
    head = self.action_head
    images = normalize_images(batch["images"], head.dtype)
    if logits is None:
      logits = head.heatmap_logits(images, self.instruction_embedding(batch))
    coords, _ = head.aux_keypoints.coordinates(images, logits=logits)
    return coords.reshape(batch["state"].shape[0], -1).astype(jnp.float32)

  def instruction_embedding(self, batch) -> jax.Array:
    """[n, vl width]: the mean of each sample's text-token embeddings (no image content)."""
    rows = sample_rows(batch, xp=jnp)
    tokens = batch["vl_tokens"][rows]
    mask = ((batch["vl_segment_ids"][rows] == batch["sample_segment"][:, None])
            & (tokens != self.backbone.image_token_id)).astype(jnp.float32)
    embedded = self.backbone.llm.embed(tokens).astype(jnp.float32)
    return jnp.einsum("nl,nld->nd", mask, embedded) / jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)

  def velocity_fn(self, batch, *, vl=None, state_tokens=None):
    """velocity_fn(x [n, horizon, dim], t [n]) in the GR00T convention, for ejax.models.flow."""
    if vl is None:
      vl, state_tokens = self.context(batch)
    buckets = self.config.num_timestep_buckets

    def fn(x, t):
      return self.action_head.velocity(x, flow.groot_timestep_buckets(t, buckets), state_tokens, vl, batch)
    return fn

  def compute_loss(self, batch, rng, *, time=None, noise=None, train: bool = True):
    """Flow-matching loss; `time` [n] / `noise` fix the draws (tests), train=False drops dropout."""
    time_rng, noise_rng, dropout_rng = jax.random.split(rng, 3)
    actions = batch["actions"].astype(jnp.float32)
    n = actions.shape[0]
    t = flow.sample_time(time_rng, n, convention="groot") if time is None else time
    noise = jax.random.normal(noise_rng, actions.shape, jnp.float32) if noise is None else noise
    dropout_rng = dropout_rng if train else None
    # The instruction's heatmaps once, for the keypoints, the estimate and their own loss: separate
    # calls gave each its own backward pass through the detectors' context convolutions (a suites
    # train step: 17.6 -> 12.9 GFLOP).
    head, instruction, heatmap_logits = self.action_head, None, None
    if head.aux_queries is not None:
      instruction = self.instruction_embedding(batch)
      heatmap_logits = head.heatmap_logits(normalize_images(batch["images"], head.dtype), instruction)
    vl, state_tokens = self.context(batch, None if dropout_rng is None else jax.random.fold_in(dropout_rng, 0),
                                    heatmap_logits)
    noisy, target = flow.interpolate(noise, actions, t, convention="groot")
    buckets = flow.groot_timestep_buckets(t, self.config.num_timestep_buckets)
    pred = self.action_head.velocity(noisy, buckets, state_tokens, vl, batch,
                                     rng=None if dropout_rng is None else jax.random.fold_in(dropout_rng, 1))
    mask = batch["action_mask"].astype(jnp.float32)
    squared = jnp.square(pred - target) * mask
    per_sample_mask = jnp.sum(mask, axis=(1, 2))
    per_sample_loss = jnp.sum(squared, axis=(1, 2)) / jnp.maximum(per_sample_mask, 1.0)
    # Like GR00T: the mean over every real action entry of the batch.
    loss = jnp.sum(squared) / jnp.maximum(jnp.sum(per_sample_mask), 1.0)
    metrics = {"per_sample_loss": per_sample_loss, "flow_loss": loss}
    if self.action_head.aux_state_head is not None:
      aux_error = jnp.mean(jnp.square(self.aux_estimate(vl, batch, heatmap_logits) - batch["aux_state"]), axis=-1)
      aux_mask = batch["aux_mask"].astype(jnp.float32)
      metrics["aux_state_loss"] = jnp.sum(aux_error * aux_mask) / jnp.maximum(jnp.sum(aux_mask), 1.0)
      loss = loss + self.config.aux_loss_weight * metrics["aux_state_loss"]
      if self.action_head.aux_queries is not None:
        heatmap = head.heatmap_loss(batch, instruction, heatmap_logits)
        metrics["aux_heatmap_loss"] = jnp.sum(heatmap * aux_mask) / jnp.maximum(jnp.sum(aux_mask), 1.0)
        loss = loss + self.config.aux_heatmap_weight * metrics["aux_heatmap_loss"]
    return loss, metrics

  def sample_actions(self, batch, rng, *, noise=None, num_steps=None):
    n = batch["state"].shape[0]
    shape = (n, self.config.action_horizon, self.config.max_action_dim)
    if noise is None:
      noise = jax.random.normal(rng, shape, jnp.float32)
    num_steps = num_steps or self.config.num_inference_steps
    return flow.euler_sample(self.velocity_fn(batch), noise, num_steps, convention="groot")


def create(config, rngs: nnx.Rngs) -> Groot:
  return Groot(config, rngs)


def trainable_filter(config):
  """nnx filter of the parameters the trainer updates, as GR00T sets requires_grad: LLM frozen
  unless tune_llm; vision tower and connector (mlp1) frozen unless tune_visual; the projector
  (state/action encoders, decoder, position embedding) and the DiT by their flags; vlln, the VL
  self-attention and the future tokens always train."""
  frozen = []
  if not config.tune_llm:
    frozen.append(nnx.PathContains("llm"))
  if not config.tune_visual:
    frozen += [nnx.PathContains("vision"), nnx.PathContains("connector"), nnx.PathContains("keypoints")]
  if not config.tune_projector:
    frozen += [nnx.PathContains(name) for name in
               ("state_encoder", "action_encoder", "action_decoder", "position_embedding")]
  if not config.tune_diffusion_model:
    frozen.append(nnx.PathContains("dit"))
  if not frozen:
    return nnx.Param
  return nnx.All(nnx.Param, nnx.Not(nnx.Any(*frozen)))


def example_batch(model_config, batch_size: int, seed: int = 0):
  return groot_inputs.example_batch(model_config, batch_size, seed)


def make_collate(model_config, data_config=None):
  """collate(list of pipeline samples) -> packed batch, tokenising with config.model.tokenizer_path."""
  aux_key = data_config.get("aux_state_key", None) if data_config is not None else None
  pixel_key = data_config.get("aux_pixel_key", None) if data_config is not None else None
  return groot_inputs.make_collate(model_config, aux_key=aux_key, pixel_key=pixel_key)


SPEC = ModelSpec(create=create, example_batch=example_batch, trainable_filter=trainable_filter,
                 make_collate=make_collate, example_config=groot_inputs.example_config)
