"""DreamZero: the world action model as one nnx.Module, its configs, flow-matching loss and registry entry.

Trained: the Wan DiT with GR00T's per-embodiment action / state encoders and action decoder inside it.
Frozen: umT5-XXL (text, 512 tokens), CLIP ViT-H/14 (first frame, 257 tokens), the Wan VAE (video ->
latents; batches may carry latents computed ahead instead of video).

Flow matching as the official WANPolicyHead trains it: sigmas on a 1,000-step grid shifted by 5
(s * sigma / (1 + (s - 1) * sigma)); one timestep id per latent frame, shared by the frames of a chunk
and by the chunk's actions (and, subsampled, its states); x_t = (1 - sigma) x + sigma * noise; target
noise - x; video MSE per frame and action MSE per step, each weighted by the scheduler's
bell-shaped training weight, added 1:1.

model.perception (empty: as released) hooks ejax's perception module (ejax/models/perception/) as
GR00T and pi0.5 do: once per batch it reads the current frame's cameras (batch["images"]), the mean of
the prompt's umT5 token embeddings and the state before chunk 0; its estimate and keypoints go into
the state slots of every chunk's state token, and its own losses join the flow-matching loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from ejax.models import perception
from ejax.models.dreamzero import sequence, unipc
from ejax.models.dreamzero.image_encoder import ClipVisionConfig, ClipVisionTower
from ejax.models.dreamzero.text_encoder import UMT5Config, UMT5Encoder
from ejax.models.dreamzero.vae import WanVAE, WanVAEConfig
from ejax.models.dreamzero.wan_dit import WanDiT, WanDiTConfig
from ejax.models.perception.targets import targets as perception_targets
from ejax.models.siglip import normalize_images

COMPONENTS = {
    "per_embodiment": ("dit/state_encoder", "dit/action_encoder", "dit/action_decoder"),
    "dit": ("dit",),
    "text_encoder": ("text_encoder",),
    "image_encoder": ("image_encoder",),
    "vae": ("vae",),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
NUM_TRAIN_TIMESTEPS = 1000
SHIFT = 5.0


def model_config(variant: str = "5b") -> ml_collections.ConfigDict:
  """"5b": Wan2.2-TI2V-5B + Wan2.2 VAE; "14b": Wan2.1-I2V-14B + Wan2.1 VAE; "runlocal": CPU-sized."""
  if variant not in ("5b", "14b", "runlocal"):
    raise ValueError(f"error: dreamzero variant {variant!r} is not one of 5b, 14b, runlocal")
  c = ml_collections.ConfigDict()
  c.name = "dreamzero"
  c.variant = variant
  c.dtype = "bfloat16"
  c.param_dtype = "float32"
  c.remat = "full"
  c.attention_impl = "auto"
  c.scan_layers = True               # the DiT's (teacher forcing) and the encoders' blocks as one lax.scan
  c.text = dict()                    # UMT5Config fields (umT5-XXL by default)
  c.image = dict()                   # ClipVisionConfig fields (ViT-H/14 by default)
  # A sample: 1 + 4 x 2 latent frames (33 video frames), 4 chunks of 24 actions, 1 state a chunk.
  c.layout = dict(num_chunks=4, frames_per_chunk=2, actions_per_chunk=24, states_per_chunk=1)
  c.text_length = 512
  c.image_size = (160, 320)          # the three-camera 2x2 grid, video pixels
  c.max_state_dim = 64
  c.action_dim = 32
  c.num_inference_steps = 16
  c.cfg_scale = 5.0                  # classifier-free guidance of the video velocity (the official policy's)
  # Simulator-trained perception aids (ejax/models/perception/; with them model.num_cameras says how many
  # cameras batch["images"] holds a sample); {}: the released model.
  c.perception = {}
  # ejax/data/synthetic.py's sample shape (the smoke-test data; ejax/models/dreamzero/inputs.py)
  c.state_dim = 8
  c.num_tasks = 4
  if variant == "5b":
    c.dit = dict(dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_dim=48, out_dim=48)
    c.vae = dict(version="2.2")      # 48 channels, 4 x 16 x 16: 160 x 320 -> 10 x 20 latents, 5 x 10 patches
  elif variant == "14b":
    # I2V: the noisy latents (16) + a first-frame mask (4) + the first frame's latents (16) in.
    c.dit = dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40, in_dim=36, out_dim=16)
    c.vae = dict(version="2.1")      # 16 channels, 4 x 8 x 8: 352 x 640 -> 44 x 80 latents, 880 patches a frame
    c.image_size = (352, 640)
  else:
    c.dtype = "float32"
    c.remat = "none"
    c.dit = dict(dim=64, ffn_dim=128, num_heads=4, num_layers=2, in_dim=4, out_dim=4, text_dim=32, image_dim=32,
                 hidden_size=64, freq_dim=32)
    c.text = dict(vocab_size=512, dim=32, ffn_dim=64, num_heads=4, num_layers=2)
    c.image = dict(image_size=28, patch_size=14, dim=32, mlp_dim=64, num_heads=2, num_layers=2, use_layers=1)
    c.vae = dict(version="2.1", dim=8, z_dim=4, dim_mult=(1, 2, 2, 2))
    c.layout = dict(num_chunks=2, frames_per_chunk=1, actions_per_chunk=4, states_per_chunk=1)
    c.text_length = 32               # the quickstart's instructions in UTF-8 bytes (up to 30) and </s>
    c.image_size = (32, 32)          # 4 x 4 latents a frame at 8x, 2 x 2 patches
    c.max_state_dim = 16             # ejax.sim's 11-d state
    c.action_dim = 4
    c.num_inference_steps = 4
  c.horizon = c.layout.num_chunks * c.layout.actions_per_chunk  # every chunk's actions in one sample
  c.action_horizon = c.layout.actions_per_chunk                  # what the policy acts: one chunk
  c.tokenizer_path = ""              # umT5's tokenizer.json; "": UTF-8 bytes (CPU size, tokenizer.py)
  return c


def dit_config(config) -> WanDiTConfig:
  return WanDiTConfig(**config.dit, action_dim=config.action_dim, max_state_dim=config.max_state_dim)


def vae_config(config) -> WanVAEConfig:
  return WanVAEConfig.for_version(**config.vae)


def layout(config) -> sequence.Layout:
  vae = vae_config(config)
  patch = dit_config(config).patch_size
  height, width = config.image_size
  grid = (height // vae.spatial_stride // patch[1], width // vae.spatial_stride // patch[2])
  return sequence.Layout(grid_height=grid[0], grid_width=grid[1], **config.layout)


def shifted_sigmas(num_steps: int = NUM_TRAIN_TIMESTEPS, shift: float = SHIFT) -> np.ndarray:
  """The scheduler's sigma grid: linspace(1, 0, num_steps + 1)[:-1], shifted."""
  sigmas = np.linspace(1.0, 0.0, num_steps + 1)[:-1]
  return shift * sigmas / (1 + (shift - 1) * sigmas)


def training_weights(num_steps: int = NUM_TRAIN_TIMESTEPS, shift: float = SHIFT) -> np.ndarray:
  """FlowMatchScheduler's training weight per grid step: a bell over the timesteps, mean 1."""
  timesteps = shifted_sigmas(num_steps, shift) * NUM_TRAIN_TIMESTEPS
  bell = np.exp(-2 * ((timesteps - num_steps / 2) / num_steps) ** 2)
  shifted = bell - bell.min()
  return shifted * (num_steps / shifted.sum())


def patchify(latents: jax.Array, patch: tuple[int, int, int], *, channels_last: bool = False) -> jax.Array:
  """[b, F, H, W, C] -> [b, F/pt * H/ph * W/pw, features]: features in the patch embedding's Conv3d
  kernel order (C, t, h, w), or with channels_last the head's output order (t, h, w, C: Wan's unpatchify)."""
  b, f, h, w, c = latents.shape
  pt, ph, pw = patch
  x = latents.reshape(b, f // pt, pt, h // ph, ph, w // pw, pw, c)
  order = (0, 1, 3, 5, 2, 4, 6, 7) if channels_last else (0, 1, 3, 5, 7, 2, 4, 6)
  return x.transpose(order).reshape(b, (f // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify(tokens: jax.Array, patch: tuple[int, int, int], grid: tuple[int, int, int]) -> jax.Array:
  """Head outputs [b, F/pt * H/ph * W/pw, pt * ph * pw * C] (channels last) -> latents [b, F, H, W, C]."""
  b = tokens.shape[0]
  f, h, w = grid
  pt, ph, pw = patch
  x = tokens.reshape(b, f // pt, h // ph, w // pw, pt, ph, pw, -1)
  return x.transpose(0, 1, 4, 2, 5, 3, 6, 7).reshape(b, f, h, w, -1)


class DreamZero(nnx.Module):
  def __init__(self, config, rngs: nnx.Rngs):
    self.config = config
    common = dict(dtype=DTYPES[config.dtype], param_dtype=DTYPES[config.param_dtype], rngs=rngs)
    scan = config.get("scan_layers", True)   # scanning keeps the parameter layout: older configs scan too
    self.dit = WanDiT(dit_config(config), remat=config.remat, attention_impl=config.attention_impl, scan_layers=scan,
                      **common)
    self.text_encoder = UMT5Encoder(UMT5Config(**config.text), scan_layers=scan, **common)
    self.image_encoder = ClipVisionTower(ClipVisionConfig(**config.image), scan_layers=scan, **common)
    self.vae = WanVAE(vae_config(config), **common)
    self.layout = layout(config)
    # The hook: model.perception's module, or None for the released model.
    settings = perception.read(config)
    self.perception = nnx.data(None if settings is None else perception.Perception(
        settings, UMT5Config(**config.text).dim, **common))

  def perceive(self, batch, rng=None):
    """(the batch with what model.perception writes in every chunk's state slots, what it saw); the
    batch unchanged and None without the module. rng: the training step's (None: inference)."""
    if self.perception is None:
      return batch, None
    mask = batch["text_mask"].astype(jnp.float32)
    embedded = jnp.take(self.text_encoder.token_embedding[...], batch["text_ids"], axis=0).astype(jnp.float32)
    instruction = jnp.einsum("nl,nld->nd", mask, embedded) / jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
    state = jnp.asarray(batch["state"], jnp.float32)
    seen = self.perception(normalize_images(batch["images"]), jax.lax.stop_gradient(instruction), state[:, 0],
                           targets=batch, rng=rng)
    slots = slice(self.perception.config.layout.data_dims, None)
    state = state.at[:, :, slots].set(jnp.broadcast_to(seen.state[:, None, slots], state[:, :, slots].shape))
    return dict(batch, state=state), seen

  # -- frozen encoders --------------------------------------------------------------------------
  def encode_context(self, batch):
    """(text [b, 512, dim], image [b, 257, dim], latents [b, F, h, w, C]) with no gradient; each read from the
    batch where it comes computed ahead (text_embeddings, image_embeddings, latents: the encode job's cache,
    ejax/models/dreamzero/encode.py), then the frozen encoder does not run."""
    text = (batch["text_embeddings"] if "text_embeddings" in batch
            else self.text_encoder(batch["text_ids"], batch["text_mask"]))
    image = batch["image_embeddings"] if "image_embeddings" in batch else self.image_encoder(batch["first_frame"])
    latents = batch["latents"] if "latents" in batch else self.encode_video(batch["video"])
    return jax.lax.stop_gradient(text), jax.lax.stop_gradient(image), jax.lax.stop_gradient(latents)

  def encode_video(self, video):
    """The camera grid (uint8 [b, T, H, W, 3], or floats in [-1, 1]) -> latents [b, latent_frames, h, w, z].
    A shorter clip (the policy's one observed frame) is padded with zero latents after its own: the
    causal VAE's first latent frame depends on the first frame alone, and sampling chunk 0 reads no other."""
    if video.dtype == jnp.uint8:
      video = video.astype(jnp.float32) / 127.5 - 1.0
    latents = self.vae.encode(video)
    missing = self.layout.latent_frames - latents.shape[1]
    if missing > 0:
      latents = jnp.concatenate([latents, jnp.zeros((latents.shape[0], missing, *latents.shape[2:]), latents.dtype)], 1)
    return latents

  def _condition(self, latents):
    """The 14B's I2V input channels beside the noisy latents: a 4-channel first-frame mask and the
    first frame's latents (the rest zero); none for the 5B (first frame through CLIP only)."""
    extra = self.dit.config.in_dim - latents.shape[-1]
    if extra == 0:
      return None
    b, f, h, w, c = latents.shape
    if extra != c + 4:
      raise ValueError(f"error: dit.in_dim={self.dit.config.in_dim} with {c} latent channels: set in_dim to "
                       f"{c} or {2 * c + 4}")
    mask = jnp.zeros((b, f, h, w, 4), latents.dtype).at[:, 0].set(1)
    first = jnp.zeros_like(latents).at[:, 0].set(latents[:, 0])
    return jnp.concatenate([mask, first], axis=-1)

  def _sequence(self, clean, noisy, actions, video_t, action_t, batch):
    """The teacher-forced sequence's DiT inputs: tokens, per-token timesteps, states, mask ids, angles."""
    lay, dit = self.layout, self.dit
    condition = self._condition(clean)
    with_condition = lambda x: x if condition is None else jnp.concatenate([x, condition], -1)
    patch = dit.config.patch_size
    tokens = jnp.concatenate([patchify(with_condition(clean), patch), patchify(with_condition(noisy), patch)], 1)
    # per latent frame of both streams: clean frames at t = 0, noisy frames at theirs
    video_timesteps = jnp.concatenate([jnp.zeros((clean.shape[0], lay.latent_frames), jnp.float32),
                                       video_t.astype(jnp.float32)], axis=1)
    stride = lay.actions_per_chunk // lay.states_per_chunk
    keys, groups = (jnp.asarray(x) for x in sequence.wam_mask_ids(lay))
    angles = jnp.asarray(sequence.rope_angles(lay, dit.config.head_dim))
    return dict(tokens=tokens, video_timesteps=video_timesteps, actions=actions, action_timesteps=action_t,
                states=batch["state"].astype(jnp.float32), state_timesteps=action_t[:, ::stride],
                keys=keys, groups=groups, angles=angles)

  def _velocity(self, clean, noisy, actions, video_t, action_t, batch, text, image):
    """DiT outputs for noisy latents / actions at per-frame (video_t [b, F]) and per-action timesteps."""
    s, dit = self._sequence(clean, noisy, actions, video_t, action_t, batch), self.dit
    return dit(s["tokens"], s["video_timesteps"], s["actions"], s["action_timesteps"], s["states"],
               s["state_timesteps"], embodiment_ids=batch["embodiment_id"], angles=s["angles"],
               mask_keys=s["keys"], mask_groups=s["groups"], text=dit.embed_text(text), image=dit.embed_image(image))

  def chunk_cache(self, clean, batch, text, image, chunk: int) -> dict:
    """The KV cache of the clean frames before chunk `chunk` (text / image: the encoders' outputs)."""
    lay, dit = self.layout, self.dit
    b = clean.shape[0]
    zeros_actions = jnp.zeros((b, lay.num_actions, self.config.action_dim), jnp.float32)
    s = self._sequence(clean, clean, zeros_actions, jnp.zeros((b, lay.latent_frames)),
                       jnp.zeros((b, lay.num_actions)), batch)
    context = sequence.chunk_indices(lay, chunk)["context"]
    return dit.context_cache(s["tokens"][:, context], angles=s["angles"][context], mask_keys=s["keys"][context],
                             mask_groups=s["groups"][context], text=dit.embed_text(text), image=dit.embed_image(image))

  def chunk_step(self, cache, clean, noisy, actions, video_t, action_t, batch, text, image, chunk: int):
    """Chunk `chunk`'s DiT outputs over its context cache: noisy / actions / timesteps are full-sample
    arrays (only the chunk's part is read)."""
    s, dit, lay = self._sequence(clean, noisy, actions, video_t, action_t, batch), self.dit, self.layout
    where = sequence.chunk_indices(lay, chunk)
    own = np.concatenate([where["video"], where["actions"], where["states"]])
    first_action, first_state = 2 * lay.video_tokens, 2 * lay.video_tokens + lay.num_actions
    pick = lambda name, index, offset: s[name][:, index - offset]
    frames = lay.latent_frames + 1 + chunk * lay.frames_per_chunk + np.arange(lay.frames_per_chunk)
    return dit.chunk(s["tokens"][:, where["video"]], s["video_timesteps"][:, frames],
                     pick("actions", where["actions"], first_action), pick("action_timesteps", where["actions"], first_action),
                     pick("states", where["states"], first_state), pick("state_timesteps", where["states"], first_state),
                     cache=cache, embodiment_ids=batch["embodiment_id"], angles=s["angles"][own],
                     mask_keys=s["keys"][own], mask_groups=s["groups"][own], text=dit.embed_text(text),
                     image=dit.embed_image(image))

  def chunk_velocity(self, clean, noisy, actions, video_t, action_t, batch, text, image, chunk: int):
    """Chunk `chunk`'s outputs the inference way: the clean frames before it as a KV cache, then one
    pass over the chunk's noisy video, actions and states. Equals the teacher-forced outputs there."""
    cache = self.chunk_cache(clean, batch, text, image, chunk)
    return self.chunk_step(cache, clean, noisy, actions, video_t, action_t, batch, text, image, chunk)

  def compute_loss(self, batch, rng):
    lay = self.layout
    batch, seen = self.perceive(batch, jax.random.fold_in(rng, 3))
    text, image, latents = self.encode_context(batch)
    latents = latents.astype(jnp.float32)
    actions = batch["actions"].astype(jnp.float32)
    b = latents.shape[0]
    id_rng, video_rng, action_rng = jax.random.split(rng, 3)
    # One timestep id for the first frame and one per chunk, shared by its frames and its actions.
    ids = jax.random.randint(id_rng, (b, 1 + lay.num_chunks), 0, NUM_TRAIN_TIMESTEPS)
    frame_ids = jnp.concatenate([ids[:, :1], jnp.repeat(ids[:, 1:], lay.frames_per_chunk, axis=1)], axis=1)
    action_ids = jnp.repeat(ids[:, 1:], lay.actions_per_chunk, axis=1)
    sigmas, weights = jnp.asarray(shifted_sigmas(), jnp.float32), jnp.asarray(training_weights(), jnp.float32)
    frame_sigma, action_sigma = sigmas[frame_ids], sigmas[action_ids]
    noise = jax.random.normal(video_rng, latents.shape, jnp.float32)
    action_noise = jax.random.normal(action_rng, actions.shape, jnp.float32)
    noisy = (1 - frame_sigma[:, :, None, None, None]) * latents + frame_sigma[:, :, None, None, None] * noise
    noisy_actions = (1 - action_sigma[..., None]) * actions + action_sigma[..., None] * action_noise
    video_out, action_out = self._velocity(latents, noisy, noisy_actions, frame_sigma * NUM_TRAIN_TIMESTEPS,
                                           action_sigma * NUM_TRAIN_TIMESTEPS, batch, text, image)
    target = patchify(noise - latents, self.dit.config.patch_size, channels_last=True)
    video_error = jnp.square(video_out.astype(jnp.float32) - target).reshape(b, lay.latent_frames, -1).mean(-1)
    video_loss = video_error * weights[frame_ids]                                   # [b, F]
    action_mask = batch.get("action_mask", jnp.ones_like(actions)).astype(jnp.float32)
    action_error = (jnp.square(action_out.astype(jnp.float32) - (action_noise - actions)) * action_mask).mean(-1)
    action_loss = action_error * weights[action_ids]                                 # [b, A]
    per_sample = video_loss.mean(1) + action_loss.mean(1)
    metrics = dict(per_sample_loss=per_sample, video_loss=video_loss.mean(), action_loss=action_loss.mean())
    loss = per_sample.mean()
    if seen is not None:
      loss = self.perception.add_losses(loss, metrics, seen, batch)
    return loss, metrics

  def sample_chunk(self, batch, rng, *, chunk: int = 0, noise=None, num_steps=None, cfg_scale=None):
    """Chunk `chunk`'s actions [b, actions_per_chunk, action_dim] and predicted latents [b, frames_per_chunk,
    h, w, z], from the observed frames before it (batch["latents"]' first 1 + chunk * frames_per_chunk).

    As the official policy acts: the clean context is a KV cache computed once (one with the prompt,
    one with an empty prompt for guidance); each denoising step runs the chunk alone over it; the
    video velocity is guided (uncond + cfg_scale * (cond - uncond)), the actions take the conditional
    one; video and actions each step with UniPC (unipc.py) on the shift-5 grid, 16 steps by default.
    """
    lay, dit = self.layout, self.dit
    batch, _ = self.perceive(batch)
    text, image, latents = self.encode_context(batch)
    latents = latents.astype(jnp.float32)
    b = latents.shape[0]
    empty = jnp.zeros_like(batch["text_mask"])
    unconditional = jax.lax.stop_gradient(self.text_encoder(batch["text_ids"], empty))
    scale = self.config.get("cfg_scale", 5.0) if cfg_scale is None else cfg_scale
    caches = [self.chunk_cache(latents, batch, context, image, chunk) for context in (text, unconditional)]
    video_rng, action_rng = jax.random.split(rng)
    frames = slice(1 + chunk * lay.frames_per_chunk, 1 + (chunk + 1) * lay.frames_per_chunk)
    actions_at = slice(chunk * lay.actions_per_chunk, (chunk + 1) * lay.actions_per_chunk)
    chunk_video = jax.random.normal(video_rng, latents[:, frames].shape, jnp.float32)
    chunk_actions = (jax.random.normal(action_rng, (b, lay.actions_per_chunk, self.config.action_dim), jnp.float32)
                     if noise is None else noise)
    steps = num_steps or self.config.num_inference_steps
    video_solver, action_solver = unipc.UniPC(steps, SHIFT), unipc.UniPC(steps, SHIFT)
    grid = latents.shape[2:4]
    for _ in range(steps):
      noisy = latents.at[:, frames].set(chunk_video)
      actions = jnp.zeros((b, lay.num_actions, self.config.action_dim), jnp.float32).at[:, actions_at].set(chunk_actions)
      t = jnp.full((b, lay.latent_frames), video_solver.timestep, jnp.float32)
      at = jnp.full((b, lay.num_actions), action_solver.timestep, jnp.float32)
      (video_cond, action_cond), (video_uncond, _) = (
          self.chunk_step(cache, latents, noisy, actions, t, at, batch, context, image, chunk)
          for cache, context in zip(caches, (text, unconditional)))
      video_velocity = video_uncond + scale * (video_cond - video_uncond)
      video_velocity = unpatchify(video_velocity.astype(jnp.float32), dit.config.patch_size,
                                  (lay.frames_per_chunk, *grid))
      chunk_video = video_solver.step(video_velocity, chunk_video)
      chunk_actions = action_solver.step(action_cond.astype(jnp.float32), chunk_actions)
    return chunk_actions, chunk_video

  def sample_actions(self, batch, rng, *, noise=None, num_steps=None):
    """The first chunk's actions from the first observed frame (the registry's policy entry point); with
    relative actions (batch["action_reference"], inputs.lerobot_collate) the reference is added back."""
    actions = self.sample_chunk(batch, rng, chunk=0, noise=noise, num_steps=num_steps)[0]
    if "action_reference" in batch:
      actions = actions + batch["action_reference"][:, :actions.shape[1]].astype(actions.dtype)
    return actions


def create(config, rngs: nnx.Rngs) -> DreamZero:
  return DreamZero(config, rngs)


def trainable_filter(config):
  """The DiT (with the action / state encoders and decoder) and model.perception's module train; umT5,
  CLIP and the VAE are frozen."""
  del config
  return nnx.All(nnx.Param, nnx.Any(nnx.PathContains("dit"), nnx.PathContains("perception")))


def example_batch(model_config, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
  """A batch shaped like the input pipeline's: VAE latents computed ahead, text ids, the first frame."""
  rng = np.random.default_rng(seed)
  lay = layout(model_config)
  vae = vae_config(model_config)
  height, width = model_config.image_size
  grid = (height // vae.spatial_stride, width // vae.spatial_stride)
  text_len = model_config.text_length
  lengths = rng.integers(1, text_len + 1, batch_size)
  image = ClipVisionConfig(**model_config.image).image_size
  state = rng.standard_normal((batch_size, lay.num_states, model_config.max_state_dim)).astype(np.float32)
  settings = perception.read(model_config)
  if settings is not None:
    state[..., settings.layout.data_dims:] = 0.0   # the module's slots
  return {
      "latents": rng.standard_normal((batch_size, lay.latent_frames, *grid, vae.z_dim)).astype(np.float32),
      "text_ids": rng.integers(1, UMT5Config(**model_config.text).vocab_size, (batch_size, text_len)).astype(np.int32),
      "text_mask": (np.arange(text_len)[None] < lengths[:, None]),
      "first_frame": rng.uniform(-1, 1, (batch_size, image, image, 3)).astype(np.float32),
      "state": state,
      "actions": rng.uniform(-1, 1, (batch_size, lay.num_actions, model_config.action_dim)).astype(np.float32),
      "action_mask": np.ones((batch_size, lay.num_actions, model_config.action_dim), np.float32),
      "embodiment_id": np.zeros((batch_size,), np.int32),
      **perception_inputs(model_config, batch_size, rng),
  }


def perception_image_size(model_config) -> int:
  """The side of batch["images"] (model.perception's view of each camera): its image_size, or else one
  cell of the camera grid."""
  settings = perception.read(model_config)
  return settings.image_size or min(model_config.image_size) // 2


def perception_inputs(model_config, batch_size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """With model.perception: random uint8 images [n * cameras, S, S, 3] and its targets (none labelled)."""
  settings = perception.read(model_config)
  if settings is None:
    return {}
  size = perception_image_size(model_config)
  images = rng.integers(0, 256, (batch_size * settings.num_cameras, size, size, 3)).astype(np.uint8)
  return dict(images=images, **perception_targets(settings, batch_size))
