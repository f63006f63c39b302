"""pi0.5 (Physical Intelligence openpi): PaliGemma prefix + Gemma-300M action expert, flow matching.

    images --SigLIP So400m/14--> 256 tokens/image --projection--> \\
                                                                   prefix (Gemma-2B weights)
    "Task: ..., State: <256-bin state>;\\nAction: " --embed-->      /        |  ONE joint attention
    noisy actions --action_in_proj--> suffix (Gemma-300M weights, adaRMSNorm(time)) per layer
    suffix output --action_out_proj--> velocity (openpi convention: t = 1 noise, u = noise - action)

The prefix sees itself bidirectionally, the suffix sees the prefix and itself, the prefix never sees
the suffix (block-causal mask from per-token ar flags). Sampling fills the prefix KV cache once and
runs 10 Euler steps of the expert only.

model.perception (empty: as released) hooks the simulator-trained perception module
(ejax/models/perception/) as GR00T does: once per batch it reads each sample's cameras, its prompt's
text embeddings and its state vector (batch["state"], beside the prompt's bins), adds its own losses,
and what it writes into the state's slots joins the expert's adaRMS conditioning through a projection
that starts at zero. model.continuous_state (off as released) adds a projection of the state vector (the
module's slots written) to every action token, as pi0 reads its state continuously; with
model.discrete_state_input=False (openpi's switch) the prompt carries no state bins.

Packed inputs (built by `ejax.models.pi05_inputs`): the prefixes of several samples share a row of
`packing.row_length` tokens (segment ids, per-sample positions; no padding tokens and no tokens for
masked camera slots), and each row carries `packing.samples_per_row` action-chunk slots of
`action_horizon` tokens for its samples' suffixes. Per-sample arrays (actions, masks) are [n, ...];
`sample_row_offset` / `sample_slot` say where each sample's suffix sits (row indices relative to a
home row so that process-local batches concatenate; see pi05_inputs).

Batch keys: images [num_images, S, S, 3] uint8; prefix_tokens, prefix_is_image, prefix_image_index,
prefix_segment_ids, prefix_positions [rows, row_length]; suffix_segment_ids, suffix_positions
[rows, slots * horizon]; sample_row_offset, sample_slot [n]; actions, action_mask [n, horizon,
action_dim].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from ejax.kernels.fp8 import DELAYED_IMPLS as FP8_DELAYED_IMPLS
from ejax.kernels.fp8 import DENSE_IMPLS as FP8_IMPLS
from ejax.models import flow, gemma, layers, lora, perception, pi05_inputs
from ejax.models.config_upgrade import upgrade_model_config
from ejax.models.pi05_config import Pi05Config, read
from ejax.models.registry import ModelSpec
from ejax.models.siglip import SiglipVisionTransformer, normalize_images
from ejax.parallel import axes as ax
from ejax.parallel.shard_local import set_rows, take_rows

# Parameter path prefixes per reported component (ejax.models.summary).
COMPONENTS = {
    "siglip_so400m": ("vision",),
    "vision_projection": ("vision_projection",),
    "gemma_2b": ("llm",),
    # The action expert's adaRMSNorm modulation is reported apart: "Gemma-300M" is the plain decoder.
    "gemma_300m_adarms": ("expert/layers/pre_attention_norm", "expert/layers/pre_ffw_norm", "expert/final_norm"),
    "gemma_300m": ("expert",),
    "action_time_projections": ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"),
}

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
TIME_MIN_PERIOD = 4e-3
TIME_MAX_PERIOD = 4.0


def model_config(variant: str = "full") -> ml_collections.ConfigDict:
  """"full": the published pi0.5 sizes (openpi pi0_config, pi05=True); "runlocal": CPU-sized."""
  c = ml_collections.ConfigDict()
  c.name = "pi05"
  c.dtype = "bfloat16"
  c.param_dtype = "float32"
  c.vision = dict(width=1152, depth=27, mlp_dim=4304, num_heads=16, patch_size=14, image_size=224)
  c.paligemma = dict(width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1, head_dim=256,
                     vocab_size=gemma.PALIGEMMA_VOCAB_SIZE)
  c.action_expert = dict(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256)
  c.action_dim = 32                 # openpi pads every robot's actions (and state) to 32 dims
  c.action_horizon = 50
  c.max_state_dim = 32
  c.num_cameras = 3                 # base + two wrists; absent cameras cost no tokens
  c.max_token_len = 200             # prompt tokens (openpi pads to this; ejax packs instead)
  c.num_inference_steps = 10
  c.tokenizer_path = ""             # local paligemma_tokenizer.model (ejax.models.paligemma_tokenizer)
  # row_length 0: the packed row (tokens and samples a row) is chosen at start-up from the data's lengths
  # (ejax/data/row_plan.py: the train job measures the dataset's first probe_samples samples; example
  # batches use theirs: two cameras of three and a 45-100-token prompt, 557-612 tokens, one a row of 640,
  # 8.5 % padding; the earlier example, 1-3 cameras two a row of 2,048, padded 31-38 %).
  c.packing = dict(row_length=0, samples_per_row=0, max_images_per_sample=3, max_row_length=4096, probe_samples=512)
  c.remat = "full"
  c.attention_impl = "auto"
  # The PaliGemma expert's feed-forward (2048 <-> 16,384, the step's largest GEMMs) as FP8 GEMMs, forward
  # and backward (ejax.kernels.fp8; the action expert's 50 tokens a sample and SigLIP's 1152-wide GEMMs
  # stay bf16, FP8 gains little there). Off until a GPU shows the FP8 train-step arm faster
  # (BENCHMARKS.md, FP8).
  c.fp8 = False
  c.fp8_impl = "xla"                # xla (cuBLASLt, per-tensor scales) | xla_delayed (the same, scales from
  #                                   each GEMM's amax history, as Transformer Engine) | xla_delayed_fastacc
  #                                   (that, dX and dW with fast accumulation too) | xla_rowwise | blockwise
  # SigLIP's blocks unrolled (the decoders always scan, their weights stored stacked): a scan stacks the
  # trained SigLIP's weights every step; unrolled, the compile-only H100 prices the step (8 samples) at
  # 265.1 vs 269.2 ms, the same memory (BENCHMARKS.md).
  c.scan_layers = False             # True: SigLIP's blocks as one lax.scan
  c.perception = {}                 # simulator-trained perception aids (ejax/models/perception/); {}: as released
  c.perception_tokens = False       # with model.perception: its state slots also join each action token (zero-init)
  # The state vector (with model.perception's slots written) read continuously by the action expert: a
  # projection of it joins every action token's input. pi0.5 as released reads the state only as the
  # prompt's 256-bin tokens; pi0 feeds it continuously, as one state token its action tokens attend to.
  c.continuous_state = False
  c.discrete_state_input = True     # openpi's pi05 switch: the prompt carries the state's bins (False: no state in it)
  # openpi fine-tunes every parameter by default (pi05 configs have no freeze filter).
  c.train_vision = True
  c.train_llm = True
  if variant == "runlocal":
    c.dtype = "float32"
    c.vision = dict(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=8, image_size=32)
    c.paligemma = dict(width=64, depth=2, mlp_dim=128, num_heads=2, num_kv_heads=1, head_dim=16, vocab_size=1024)
    c.action_expert = dict(width=32, depth=2, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=16)
    c.action_dim = 4
    c.action_horizon = 8
    c.max_state_dim = 4
    c.num_cameras = 2
    c.max_token_len = 64
    c.num_inference_steps = 10
    c.packing = dict(row_length=192, samples_per_row=2, max_images_per_sample=2)
    c.remat = "none"
  elif variant != "full":
    raise ValueError(f"pi0.5 variant {variant!r} is not one of 'full', 'runlocal'")
  return c


def gemma_configs(config) -> tuple[gemma.GemmaConfig, gemma.GemmaConfig]:
  """(PaliGemma LLM, action expert) configs of a model config or its Pi05Config; the expert's norms are
  adaRMS on its own width."""
  settings = config if isinstance(config, Pi05Config) else read(config)
  return settings.paligemma, settings.action_expert


def time_embedding(t: jax.Array, width: int) -> jax.Array:
  """openpi's sine-cosine embedding of t [n] in [0, 1], periods 4e-3 .. 4 -> [n, width] fp32."""
  fraction = jnp.linspace(0.0, 1.0, width // 2)
  period = TIME_MIN_PERIOD * (TIME_MAX_PERIOD / TIME_MIN_PERIOD) ** fraction
  angles = t.astype(jnp.float32)[:, None] * (2.0 * jnp.pi / period)[None, :]
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class Pi05(nnx.Module):
  """pi0.5 with the registry interface: compute_loss and sample_actions on packed batches."""

  def __init__(self, config, rngs: nnx.Rngs):
    # The boundary: the config as saved, in today's layout (the io converters, LoRA and RL read it), and
    # read once into typed settings, which is all the model below sees (but for the freezing flags RL sets later).
    self.config = upgrade_model_config(config)
    self.settings = config = read(self.config)
    self.dtype = DTYPES[config.dtype]
    param_dtype = DTYPES[config.param_dtype]
    if config.fp8 and config.fp8_impl not in FP8_IMPLS:
      raise ValueError(f"model.fp8_impl={config.fp8_impl!r} is not one of {FP8_IMPLS}: set one of them")
    llm_config, expert_config, vision_config = config.paligemma, config.action_expert, config.vision
    common = dict(dtype=self.dtype, param_dtype=param_dtype, rngs=rngs)
    # Rematerialised per block like the decoders: the trained tower otherwise keeps every block's
    # activations of 3 images a sample. Full size, 32 samples a device: 101 -> 43 GiB of temporaries
    # per device (XLA:CPU's estimate, ejax.train.compile_report).
    self.vision = SiglipVisionTransformer(vision_config, remat=config.remat, attention_impl=config.attention_impl,
                                          scan_layers=config.scan_layers, **common)
    # openpi "img/head": SigLIP width -> PaliGemma width (PaliGemma's multi-modal projector).
    self.vision_projection = layers.Dense(vision_config.width, llm_config.width, axes=(ax.IN_FEATURES, ax.EMBED),
                                          **common)
    self.llm = gemma.GemmaDecoder(llm_config, rngs=rngs, param_dtype=param_dtype)
    if config.fp8 and config.fp8_impl in FP8_DELAYED_IMPLS:
      gemma.add_fp8_history(self.llm)
    self.expert = gemma.GemmaDecoder(expert_config, rngs=rngs, param_dtype=param_dtype)
    width = expert_config.width
    self.action_in_proj = layers.Dense(config.action_dim, width, axes=(ax.IN_FEATURES, ax.EMBED), **common)
    self.time_mlp_in = layers.Dense(width, width, axes=(ax.EMBED, ax.MLP), **common)
    self.time_mlp_out = layers.Dense(width, width, axes=(ax.MLP, ax.EMBED), **common)
    self.action_out_proj = layers.Dense(width, config.action_dim, axes=(ax.EMBED, ax.IN_FEATURES), **common)
    self.state_proj = nnx.data(None)
    if config.continuous_state:
      self.state_proj = layers.Dense(config.max_state_dim, width, axes=(ax.IN_FEATURES, ax.EMBED), **common)
    # The hook: model.perception's module (None: the released model). pi0.5 reads the state as prompt
    # tokens, so what the module writes into the state's slots reaches the action expert through the
    # adaRMS conditioning instead, by a projection that starts at zero (the released behaviour).
    settings = config.perception
    self.perception = self.perception_cond = self.perception_tokens = nnx.data(None)
    if settings is not None:
      if settings.image_size not in (0, vision_config.image_size):
        raise ValueError(f"pi0.5's model.perception.image_size must be the tower's ({vision_config.image_size}) or 0")
      self.perception = perception.Perception(settings, llm_config.width, **common)
      if settings.layout.reserved:
        self.perception_cond = layers.Dense(settings.layout.reserved, width, axes=(ax.IN_FEATURES, ax.EMBED),
                                            kernel_init=nnx.initializers.zeros, **common)
        # perception_tokens: the slots also join every action token's input (as GR00T's state token is
        # one the action head attends to), by a second projection that starts at zero.
        if config.perception_tokens:
          self.perception_tokens = layers.Dense(settings.layout.reserved, width, axes=(ax.IN_FEATURES, ax.EMBED),
                                                kernel_init=nnx.initializers.zeros, **common)

  # -- prefix -----------------------------------------------------------------------------------

  def embed_prefix(self, batch) -> gemma.Stream:
    """Image and prompt tokens laid out in packed rows: x [rows, row_length, llm width]."""
    dtype = self.dtype
    image_tokens = self.vision_projection(self.vision(normalize_images(batch["images"], dtype)))
    # train_vision is read here, not at construction: RL sets it after loading (as GR00T's tune_*). LoRA
    # adapters on the tower (model.lora.vision) train through it too.
    if not (self.config.train_vision or lora.has_adapters(self.vision)):
      image_tokens = jax.lax.stop_gradient(image_tokens)  # frozen tower: skip its backward pass
    patches = image_tokens.shape[1]
    image_tokens = image_tokens.reshape(-1, image_tokens.shape[-1])  # [num_images * patches, width]
    text = self.llm.embed(batch["prefix_tokens"], dtype)
    is_image = batch["prefix_is_image"]
    index = pi05_inputs.image_token_indices(batch, patches, xp=jnp)
    index = jnp.clip(jnp.where(is_image, index, 0), 0, image_tokens.shape[0] - 1)
    x = jnp.where(is_image[..., None], take_rows(image_tokens, index).astype(dtype), text)
    segment_ids = batch["prefix_segment_ids"]
    # ar flag 0 everywhere: the prefix is one bidirectional block (block id 0).
    return gemma.Stream(x=x, positions=batch["prefix_positions"], segment_ids=segment_ids,
                        block_ids=jnp.zeros_like(segment_ids))

  # -- suffix -----------------------------------------------------------------------------------

  def _suffix_layout(self, batch) -> tuple[int, int, int]:
    rows, suffix_len = batch["suffix_segment_ids"].shape
    horizon = self.settings.action_horizon
    if suffix_len % horizon:
      raise ValueError(f"suffix length {suffix_len} is not a multiple of action_horizon {horizon}")
    return rows, suffix_len // horizon, horizon

  def embed_suffix(self, batch, noisy_actions: jax.Array, t: jax.Array, seen=None) -> gemma.Stream:
    """Per-sample noisy chunks [n, H, A] and times [n] scattered into their rows' suffix slots; `seen`:
    what the perception module saw (its state slots join the conditioning; with continuous_state its
    state, else batch["state"], joins each action token)."""
    rows, slots, horizon = self._suffix_layout(batch)
    dtype = self.dtype
    tokens = self.action_in_proj(noisy_actions.astype(dtype))  # [n, H, W]
    cond = time_embedding(t, tokens.shape[-1]).astype(dtype)
    cond = jax.nn.swish(self.time_mlp_out(jax.nn.swish(self.time_mlp_in(cond))))  # [n, W]
    if seen is not None and self.perception_cond is not None:
      slots_written = seen.state[:, self.perception.config.layout.data_dims:]
      cond = cond + self.perception_cond(slots_written.astype(dtype))
      if self.perception_tokens is not None:
        tokens = tokens + self.perception_tokens(slots_written.astype(dtype))[:, None, :]
    if self.state_proj is not None:
      state = seen.state if seen is not None else jnp.asarray(batch["state"])
      tokens = tokens + self.state_proj(state.astype(dtype))[:, None, :]
    slot = pi05_inputs.sample_rows(batch, xp=jnp) * slots + batch["sample_slot"]  # [n] into rows x slots
    width = tokens.shape[-1]
    x = set_rows(jnp.zeros((rows * slots, horizon, width), dtype), slot, tokens)
    slot_cond = set_rows(jnp.zeros((rows * slots, width), dtype), slot, cond).reshape(rows, slots, width)
    segment_ids = batch["suffix_segment_ids"]
    # ar flag 1 on each chunk's first token: the prefix (block 0) cannot see it, it sees the prefix.
    # The prefix's flags are all 0, so the running sum over [prefix | suffix] restarts at the suffix:
    # computed on one row's suffix pattern and broadcast (a per-row cumsum over the whole row is a
    # constant XLA spends seconds folding at full size).
    first_of_chunk = (jnp.arange(slots * horizon) % horizon == 0).astype(jnp.int32)
    block_ids = jnp.broadcast_to(gemma.block_ids_from_ar_flags(first_of_chunk), segment_ids.shape)
    return gemma.Stream(x=x.reshape(rows, slots * horizon, width), positions=batch["suffix_positions"],
                        segment_ids=segment_ids, block_ids=block_ids, cond=slot_cond)

  def _velocity_from_suffix(self, batch, suffix_out: jax.Array) -> jax.Array:
    rows, slots, horizon = self._suffix_layout(batch)
    slot = pi05_inputs.sample_rows(batch, xp=jnp) * slots + batch["sample_slot"]
    out = take_rows(suffix_out.reshape(rows * slots, horizon, -1), slot)
    return self.action_out_proj(out).astype(jnp.float32)  # [n, H, A]

  # -- the registry interface -------------------------------------------------------------------

  def perceive(self, batch, rng=None):
    """The perception module's view of the batch, once (None without one): each sample's cameras, the
    mean of its prompt's text-token embeddings as the instruction, the state vector."""
    if self.perception is None:
      return None
    n, cameras = batch["sample_row_offset"].shape[0], self.settings.num_cameras
    if batch["images"].shape[0] != n * cameras:
      raise ValueError(f"model.perception reads {cameras} cameras a sample; the batch has {batch['images'].shape[0]} "
                       f"images for {n} samples: set packing.max_images_per_sample={cameras} and give every camera")
    rows = pi05_inputs.sample_rows(batch, xp=jnp)
    mask = ((batch["prefix_segment_ids"][rows] == (batch["sample_slot"] + 1)[:, None])
            & ~batch["prefix_is_image"][rows]).astype(jnp.float32)
    embedded = self.llm.embed(batch["prefix_tokens"][rows], jnp.float32)
    instruction = jnp.einsum("nl,nld->nd", mask, embedded) / jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
    images = normalize_images(batch["images"], self.dtype)
    return self.perception(images, instruction, jnp.asarray(batch["state"]), targets=batch, rng=rng)

  def _run(self, streams, **kwargs):
    return gemma.run_mixture([self.llm, self.expert], streams, dtype=self.dtype, remat=self.settings.remat,
                             attention_impl=self.settings.attention_impl,
                             fp8=(self.settings.fp8_impl if self.settings.fp8 else None, None), **kwargs)

  def compute_loss(self, batch, rng, *, time=None, noise=None, train: bool = True):
    """Flow-matching loss (openpi convention), one joint pass over prefix and suffix.

    `time` [n] / `noise` [n, H, A] fix the draws (tests); the per-sample loss is the mean squared
    velocity error over the real action entries (action_mask), the loss their mean over the batch.
    """
    time_rng, noise_rng = jax.random.split(rng)
    actions = batch["actions"].astype(jnp.float32)
    n = actions.shape[0]
    t = flow.sample_time(time_rng, n, convention="openpi") if time is None else time
    noise = jax.random.normal(noise_rng, actions.shape, jnp.float32) if noise is None else noise
    noisy, target = flow.interpolate(noise, actions, t, convention="openpi")
    # pi0.5 has no dropout: a training step's rng only noises the perception module's teacher
    seen = self.perceive(batch, jax.random.fold_in(rng, 2) if train else None)
    prefix = self.embed_prefix(batch)
    suffix = self.embed_suffix(batch, noisy, t, seen)
    (_, suffix_out), _ = self._run([prefix, suffix])
    velocity = self._velocity_from_suffix(batch, suffix_out)
    loss, metrics = flow.masked_loss(velocity, target, batch["action_mask"])
    if seen is not None:
      loss = self.perception.add_losses(loss, metrics, seen, batch)
    return loss, metrics

  def prefix_cache(self, batch):
    """(the prefix's KV cache, what the perception module saw (None without one)): everything the
    action expert reads besides its own tokens, once per batch (ejax.rl.vla_pi05 stores it per sample)."""
    prefix = self.embed_prefix(batch)
    _, cache = self._run([prefix, None], return_kv_cache=True)
    return cache, self.perceive(batch)

  def expert_velocity(self, batch, cache, seen, noisy_actions: jax.Array, t: jax.Array,
                      expert_weights: dict | None = None) -> jax.Array:
    """The action expert alone against a prefix_cache: velocity [n, H, A]; `batch` needs only the
    suffix layout (suffix_*, sample_row_offset, sample_slot, the prefix rows' count); `expert_weights`:
    the expert's gemma.layer_weights, made once by a sampling loop's caller."""
    (_, suffix_out), _ = self._run([None, self.embed_suffix(batch, noisy_actions, t, seen)], kv_cache=cache,
                                   weights=[None, expert_weights])
    return self._velocity_from_suffix(batch, suffix_out)

  def velocity_fn(self, batch):
    """velocity_fn(x [n, H, A], t [n]) for ejax.models.flow; the prefix KV cache and the expert's
    compute-dtype weights are made here, once, and every call runs only the action expert against them."""
    cache, seen = self.prefix_cache(batch)
    weights = gemma.layer_weights(self.expert, self.dtype)
    return lambda x, t: self.expert_velocity(batch, cache, seen, x, t, expert_weights=weights)

  def sample_actions(self, batch, rng, *, noise=None, num_steps=None):
    n = batch["sample_row_offset"].shape[0]
    shape = (n, self.settings.action_horizon, self.settings.action_dim)
    if noise is None:
      noise = jax.random.normal(rng, shape, jnp.float32)
    num_steps = num_steps or self.settings.num_inference_steps
    return flow.euler_sample(self.velocity_fn(batch), noise, num_steps, convention="openpi")


def create(config, rngs: nnx.Rngs) -> Pi05:
  return Pi05(config, rngs)


def trainable_filter(config):
  """nnx filter of the trained parameters. openpi fine-tunes all of pi0.5 (its pi05 configs set no
  freeze filter); train_vision / train_llm = False freeze SigLIP (+ projection) / the Gemma-2B."""
  frozen = []
  if not config.train_vision:
    frozen += [nnx.PathContains("vision"), nnx.PathContains("vision_projection")]
  if not config.train_llm:
    frozen.append(nnx.PathContains("llm"))
  if not frozen:
    return nnx.Param
  return nnx.All(nnx.Param, nnx.Not(nnx.Any(*frozen)))


def example_batch(model_config, batch_size: int, seed: int = 0):
  return pi05_inputs.example_batch(model_config, batch_size, seed)


def make_collate(model_config, data_config=None, *, inference: bool = False):
  """collate(list of pipeline samples) -> packed batch, tokenising with config.model.tokenizer_path
  (on ejax.sim's recorded demonstrations without one: a tokenizer built locally from the suites'
  instructions, ejax.models.paligemma_tokenizer.sim_suites_tokenizer); with model.perception, its targets
  from data.aux_state_key / aux_pixel_key. `inference`: a policy's batch, which may take more rows than
  a training batch's fixed count."""
  data = data_config if data_config is not None else {}
  keys = dict(aux_key=data.get("aux_state_key", None), pixel_key=data.get("aux_pixel_key", None),
              fit_rows=inference)
  if not model_config.tokenizer_path and data_config is not None and data_config.get("name") == "sim_demos":
    from ejax.models.paligemma_tokenizer import PaligemmaTokenizer, sim_suites_tokenizer
    return pi05_inputs.make_collate(model_config, PaligemmaTokenizer(sim_suites_tokenizer(),
                                                                     max_len=model_config.max_token_len), **keys)
  return pi05_inputs.make_collate(model_config, **keys)


SPEC = ModelSpec(create=create, example_batch=example_batch, trainable_filter=trainable_filter,
                 make_collate=make_collate, example_config=pi05_inputs.example_config)
