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
from flax import nnx

from ejax.models import flow, groot_inputs, layers, lora, perception
from ejax.models.config_upgrade import upgrade_model_config
from ejax.models.connector import MLPConnector
from ejax.models.dit import DiT, VLSelfAttentionTransformer
from ejax.models.embodiment import CategorySpecificMLP, MultiEmbodimentActionEncoder
from ejax.models.groot_inputs import image_token_indices, sample_rows, tokens_per_image  # noqa: F401
from ejax.models.groot_config import GrootConfig, read
from ejax.models.qwen3 import Qwen3
from ejax.models.registry import ModelSpec
from ejax.models.siglip import SiglipVisionTransformer, normalize_images
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
  c.fp8 = False                      # the DiT's and the VL transformer's feed-forwards through
  #                                    ejax.kernels.fp8 (off: the train step's FP8 arm ran at 0.92x the
  #                                    bf16 one with the DiT's alone, the VL transformer's 2048 <-> 8192
  #                                    GEMMs over 8,704 tokens are priced, not measured; BENCHMARKS.md, FP8)
  c.fp8_impl = "xla"                 # with fp8: xla (cuBLASLt FP8, per-tensor scales; 1.30x bf16 over
  #                                    the DiT and LLM GEMMs) | xla_delayed (the same, scales from amax
  #                                    histories) | xla_rowwise (1.12x) | blockwise (Pallas, 0.33x)
  # Trained blocks unrolled and not rematerialised: on jaxlib 0.11.2's compile-only H100 the step
  # (32 samples) prices at 100 vs 115 ms scanned with remat "full" (fewer launches, no per-step weight
  # stacking, no recomputed forwards) for 7.2 vs 3.6 GiB of temporaries and a longer compile
  # (BENCHMARKS.md, "Unrolled, not rematerialised"). remat "full" and scan_layers=True give the memory
  # back, e.g. with tune_llm / tune_visual on an 80 GB GPU.
  c.remat = "none"                   # per-block rematerialisation (ejax.parallel.remat)
  c.attention_impl = "auto"          # every attention call: ejax.kernels.attention IMPLS ("auto": per backend)
  c.scan_layers = False              # repeated blocks as one lax.scan (one block compiled per kind)
  c.vision = dict(width=1152, depth=27, mlp_dim=4304, num_heads=16, patch_size=14, image_size=224)
  c.connector = dict(num_layers=1, use_pixel_shuffle=False)   # released: mlp1.0 = Linear(1152, 2048)
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
  # Simulator-trained perception aids (ejax/models/perception/: keypoints the instruction chooses and an
  # estimate read from them, in the state's last slots); {}: the released model.
  c.perception = {}
  # Freezing (LeRobot's fine-tuning defaults; the released pre-training config had tune_visual=True).
  c.tune_llm = False
  c.tune_visual = False
  c.tune_projector = True
  c.tune_diffusion_model = True
  if variant == "runlocal":
    c.dtype = "float32"
    c.vision = dict(width=32, depth=2, mlp_dim=64, num_heads=2, patch_size=8, image_size=32)
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


class GrootBackbone(nnx.Module):
  """Eagle 2.5: vision tower + connector + truncated Qwen3 -> VL features on packed rows."""

  def __init__(self, config: GrootConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    blocks = dict(remat=config.remat, attention_impl=config.attention_impl)
    # A frozen tower's blocks run unrolled: a scan would stack (copy) their weights every step though
    # they never change, and forward-only blocks compile quickly (full size, a compile-only H100: 402
    # fewer launches and 0.4 ms less floor a step, the step's compile 2.6 s longer; BENCHMARKS.md).
    self.vision = SiglipVisionTransformer(config.vision, **blocks, scan_layers=config.scan_layers and config.tune_visual,
                                          **common)
    self.connector = MLPConnector(config.vision.width, config.llm.width, num_layers=config.connector.num_layers,
                                  use_pixel_shuffle=config.connector.use_pixel_shuffle, **common)
    self.llm = Qwen3(config.llm, **blocks, scan_layers=config.scan_layers and config.tune_llm, **common)
    self.image_token_id = config.image_token_id
    self.vision_image_size = config.vision.image_size

  def encode_images(self, batch) -> jax.Array | None:
    """The connector's image tokens [num_images, tokens_per_image, llm width]; None without cameras."""
    if not batch["images"].shape[0]:
      return None
    images = normalize_images(batch["images"], self.llm.dtype)
    size = self.vision_image_size
    if images.shape[1] != size:  # model.perception.image_size: larger images for its detectors
      factor = images.shape[1] // size
      images = images.reshape(images.shape[0], size, factor, size, factor, images.shape[-1]).mean(axis=(2, 4))
    return self.connector(self.vision(images))

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

  def __init__(self, config: GrootConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    blocks = dict(remat=config.remat, attention_impl=config.attention_impl, scan_layers=config.scan_layers)
    width = config.dit.width                                             # input_embedding_dim (1536)
    self.vlln = layers.LayerNorm(config.llm.width, eps=1e-5, **common)
    self.vl_self_attention = VLSelfAttentionTransformer(config.vl_transformer, fp8=config.fp8 and config.fp8_impl,
                                                        **blocks, **common)
    self.dit = DiT(config.dit, fp8=config.fp8 and config.fp8_impl, **blocks, **common)
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
    self.dtype = dtype

  def encode_vl(self, features: jax.Array, segment_ids: jax.Array, rng=None) -> jax.Array:
    return self.vl_self_attention(self.vlln(features), segment_ids, rng)

  def velocity(self, noisy_actions, timestep_buckets, state_tokens, vl, batch, rng=None, dit_stacked=None) -> jax.Array:
    """Predicted velocity (action - noise) [n, horizon, max_action_dim]; `dit_stacked`: the DiT's
    stacked weights, made once by a sampling loop's caller (DiT.stack_blocks)."""
    embodiment = batch["embodiment_id"]
    horizon = noisy_actions.shape[1]
    action_tokens = self.action_encoder(noisy_actions, timestep_buckets, embodiment)
    action_tokens = action_tokens + self.position_embedding[:horizon].astype(action_tokens.dtype)
    future = jnp.broadcast_to(self.future_tokens[...].astype(action_tokens.dtype),
                              (noisy_actions.shape[0],) + self.future_tokens.shape)
    tokens = jnp.concatenate([state_tokens.astype(action_tokens.dtype), future, action_tokens], axis=1)
    out = self.dit(tokens, timestep_buckets, vl_tokens=vl, vl_segment_ids=batch["vl_segment_ids"],
                   sample_row=sample_rows(batch, xp=jnp), sample_segment=batch["sample_segment"], rng=rng,
                   stacked=dit_stacked)
    return self.action_decoder(out, embodiment)[:, -horizon:].astype(jnp.float32)


class Groot(nnx.Module):
  """GR00T-N1.5 with the registry interface: compute_loss and sample_actions."""

  def __init__(self, config, rngs: nnx.Rngs):
    # The boundary: the config as saved, in today's layout (the io converters, LoRA and RL read it), and
    # read once into typed settings, which is all the modules below see (but for the freezing flags RL sets later).
    self.config = upgrade_model_config(config)
    self.settings = settings = read(self.config)
    dtype, param_dtype = DTYPES[settings.dtype], DTYPES[settings.param_dtype]
    self.backbone = GrootBackbone(settings, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.action_head = GrootActionHead(settings, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    # The hook: model.perception's module, or None for the released model.
    self.perception = nnx.data(None if settings.perception is None else perception.Perception(
        settings.perception, settings.llm.width, dtype=dtype, param_dtype=param_dtype, rngs=rngs))

  def _context(self, batch, rng=None):
    """(VL tokens after the VL transformer, the state vector the state encoder reads, what the
    perception module saw or None): everything upstream of the flow."""
    features = self.backbone(batch)
    # The one config read after construction: RL freezes the context of a loaded model by setting these
    # flags on model.config (ejax.rl.vla, VlaKind.freeze_context), and its learner masks rather than
    # splits the frozen parameters, so this is what skips their backward there.
    # LoRA adapters on the backbone (model.lora.llm) train through it too.
    if not (self.config.tune_llm or self.config.tune_visual or lora.has_adapters(self.backbone)):
      features = jax.lax.stop_gradient(features)  # nothing below is trained: skip their backward
    vl = self.action_head.encode_vl(features, batch["vl_segment_ids"], rng)
    state, seen = jnp.asarray(batch["state"]), None
    if self.perception is not None:
      images = normalize_images(batch["images"], self.action_head.dtype)
      seen = self.perception(images, self.instruction_embedding(batch), state, targets=batch, rng=rng)
      state = seen.state
    return vl, state, seen

  def context_inputs(self, batch, rng=None):
    """(VL tokens after the VL transformer, the state vector [n, max_state_dim] the state encoder reads)."""
    vl, state, _ = self._context(batch, rng)
    return vl, state

  def context(self, batch, rng=None):
    """VL tokens after the action head's VL transformer, and the state token, per sample."""
    vl, state = self.context_inputs(batch, rng)
    return vl, self.action_head.state_encoder(state[:, None, :], batch["embodiment_id"])

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
    buckets = self.settings.num_timestep_buckets
    # The DiT's scanned weights stacked here, once, not in every step of the caller's sampling loop.
    stacked = self.action_head.dit.stack_blocks()

    def fn(x, t):
      return self.action_head.velocity(x, flow.groot_timestep_buckets(t, buckets), state_tokens, vl, batch,
                                       dit_stacked=stacked)
    return fn

  def compute_loss(self, batch, rng, *, time=None, noise=None, train: bool = True):
    """Flow-matching loss; `time` [n] / `noise` fix the draws (tests), train=False drops dropout."""
    time_rng, noise_rng, dropout_rng = jax.random.split(rng, 3)
    actions = batch["actions"].astype(jnp.float32)
    n = actions.shape[0]
    t = flow.sample_time(time_rng, n, convention="groot") if time is None else time
    noise = jax.random.normal(noise_rng, actions.shape, jnp.float32) if noise is None else noise
    dropout_rng = dropout_rng if train else None
    vl, state, seen = self._context(batch, None if dropout_rng is None else jax.random.fold_in(dropout_rng, 0))
    state_tokens = self.action_head.state_encoder(state[:, None, :], batch["embodiment_id"])
    noisy, target = flow.interpolate(noise, actions, t, convention="groot")
    buckets = flow.groot_timestep_buckets(t, self.settings.num_timestep_buckets)
    pred = self.action_head.velocity(noisy, buckets, state_tokens, vl, batch,
                                     rng=None if dropout_rng is None else jax.random.fold_in(dropout_rng, 1))
    loss, metrics = flow.masked_loss(pred, target, batch["action_mask"])  # GR00T: mean over every real entry
    if seen is not None:
      loss = self.perception.add_losses(loss, metrics, seen, batch)
    return loss, metrics

  def sample_actions(self, batch, rng, *, noise=None, num_steps=None):
    n = batch["state"].shape[0]
    shape = (n, self.settings.action_horizon, self.settings.max_action_dim)
    if noise is None:
      noise = jax.random.normal(rng, shape, jnp.float32)
    num_steps = num_steps or self.settings.num_inference_steps
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
    frozen += [nnx.PathContains("vision"), nnx.PathContains("connector")]
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


def make_collate(model_config, data_config=None, *, inference: bool = False):
  """collate(list of pipeline samples) -> packed batch, tokenising with config.model.tokenizer_path;
  `inference`: a policy's batch, which may take more rows than a training batch's fixed count."""
  aux_key = data_config.get("aux_state_key", None) if data_config is not None else None
  pixel_key = data_config.get("aux_pixel_key", None) if data_config is not None else None
  return groot_inputs.make_collate(model_config, aux_key=aux_key, pixel_key=pixel_key, fit_rows=inference)


SPEC = ModelSpec(create=create, example_batch=example_batch, trainable_filter=trainable_filter,
                 make_collate=make_collate, example_config=groot_inputs.example_config)
