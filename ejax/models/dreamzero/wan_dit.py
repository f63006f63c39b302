"""The Wan DiT as DreamZero runs it: per-token timesteps, the WAM mask, summed text + image cross-attention.

Block (Wan 2.1 / 2.2, `CausalWanAttentionBlock`), with e = modulation + time_projection(temb) per token:
  x += gate_msa * self_attn(norm1(x) * (1 + scale_msa) + shift_msa)       (RoPE, mask kind "wam")
  x += cross_attn(norm3(x), [257 image tokens | 512 text tokens])         (two softmaxes, outputs summed)
  x += gate_mlp * ffn(norm2(x) * (1 + scale_mlp) + shift_mlp)
norm1/norm2 are parameter-free LayerNorms, norm3 is affine; q and k pass an RMSNorm over the whole
width. The action and state tokens come from GR00T's per-embodiment encoders (ejax/models/embodiment.py)
and the action decoder reads the action tokens back; as in the official CausalWanModel, those three
live inside the DiT (one embodiment table). Parameter names follow the official keys (io/dreamzero.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ejax.kernels.attention import attention, with_attention_impl
from ejax.models import layers
from ejax.models.embodiment import CategorySpecificMLP, MultiEmbodimentActionEncoder, sinusoidal_encoding
from ejax.parallel import constrain
from ejax.parallel.axes import ACT_BATCH, ACT_EMBED, ACT_LEN, EMBED, IN_FEATURES, MLP, NORM


@dataclasses.dataclass(frozen=True)
class WanDiTConfig:
  dim: int = 3072
  ffn_dim: int = 14336
  num_heads: int = 24
  num_layers: int = 30
  in_dim: int = 48                 # latent channels (+ 20 for the 14B's concatenated first-frame condition)
  out_dim: int = 48
  patch_size: tuple[int, int, int] = (1, 2, 2)
  freq_dim: int = 256
  text_dim: int = 4096             # umT5-XXL width
  image_dim: int = 1280            # CLIP ViT-H/14 width
  eps: float = 1e-6
  action_dim: int = 32
  max_state_dim: int = 64
  hidden_size: int = 1024          # state-encoder / action-decoder hidden width
  num_embodiments: int = 1         # the official model keeps one table (max_num_embodiments = 1)

  @property
  def head_dim(self) -> int:
    return self.dim // self.num_heads

  @property
  def patch_features(self) -> int:
    return self.in_dim * self.patch_size[0] * self.patch_size[1] * self.patch_size[2]


def timestep_sinusoid(timesteps: jax.Array, dim: int) -> jax.Array:
  """Wan's sinusoidal_embedding_1d: [cos(t * f_i), sin(t * f_i)], f_i = 10000^(-i / (dim / 2))."""
  half = dim // 2
  freqs = jnp.power(10000.0, -jnp.arange(half, dtype=jnp.float32) / half)
  angles = timesteps.astype(jnp.float32)[..., None] * freqs
  return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


def apply_rope_pairs(x: jax.Array, angles: jax.Array) -> jax.Array:
  """Rotates adjacent channel pairs (x[2i], x[2i+1]) by angles [len, head_dim / 2] (Wan's complex RoPE)."""
  xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
  cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
  real, imag = xf[..., 0], xf[..., 1]
  out = jnp.stack([real * cos - imag * sin, real * sin + imag * cos], axis=-1)
  return out.reshape(x.shape).astype(x.dtype)


def encode_actions(encoder: MultiEmbodimentActionEncoder, actions, timesteps, embodiment_ids):
  """GR00T's action encoder with one timestep per action token ([b, A]; GR00T's own call takes one per
  sample): W3(swish(W2([W1 a, sinusoid(t)])))."""
  a = encoder.W1(actions, embodiment_ids)
  tau = sinusoidal_encoding(timesteps, encoder.width).astype(a.dtype)
  return encoder.W3(jax.nn.swish(encoder.W2(jnp.concatenate([a, tau], axis=-1), embodiment_ids)), embodiment_ids)


def _dense(in_features, out_features, axes, common):
  return layers.Dense(in_features, out_features, axes=axes, **common)


class WanSelfAttention(nnx.Module):
  def __init__(self, config: WanDiTConfig, *, common: dict):
    dim, norm = config.dim, dict(eps=config.eps, dtype=common["dtype"], param_dtype=common["param_dtype"],
                                 rngs=common["rngs"])
    self.num_heads = config.num_heads
    self.q, self.k, self.v = (_dense(dim, dim, (EMBED, MLP), common) for _ in range(3))
    self.o = _dense(dim, dim, (MLP, EMBED), common)
    self.norm_q, self.norm_k = layers.RMSNorm(dim, **norm), layers.RMSNorm(dim, **norm)

  def _heads(self, x):
    return x.reshape(*x.shape[:2], self.num_heads, -1)

  def __call__(self, x, angles, mask_keys, mask_groups, prefix=None):
    """Attention of x's tokens over [prefix | x] (prefix: a KV cache (k, v, keys, groups) of earlier
    tokens, e.g. the clean context); returns the output and x's own (k, v) for a cache."""
    q = apply_rope_pairs(self._heads(self.norm_q(self.q(x))), angles)
    k = apply_rope_pairs(self._heads(self.norm_k(self.k(x))), angles)
    v = self._heads(self.v(x))
    k_all, v_all, kv_keys, kv_groups = k, v, mask_keys, mask_groups
    if prefix is not None:
      prefix_k, prefix_v, prefix_keys, prefix_groups = prefix
      k_all, v_all = jnp.concatenate([prefix_k, k], 1), jnp.concatenate([prefix_v, v], 1)
      kv_keys, kv_groups = jnp.concatenate([prefix_keys, mask_keys]), jnp.concatenate([prefix_groups, mask_groups])
    rows = lambda ids: jnp.broadcast_to(ids, (x.shape[0], ids.shape[0]))
    out = attention(q, k_all, v_all, mask_kind="wam", q_positions=rows(mask_keys), kv_positions=rows(kv_keys),
                    q_block_ids=rows(mask_groups), kv_block_ids=rows(kv_groups))
    return self.o(out.reshape(*x.shape[:2], -1)), (k, v)


class WanI2VCrossAttention(nnx.Module):
  """Queries attend the text tokens and, separately, the image tokens; the two outputs are summed."""

  def __init__(self, config: WanDiTConfig, *, common: dict):
    dim, norm = config.dim, dict(eps=config.eps, dtype=common["dtype"], param_dtype=common["param_dtype"],
                                 rngs=common["rngs"])
    self.num_heads = config.num_heads
    self.q, self.k, self.v, self.k_img, self.v_img = (_dense(dim, dim, (EMBED, MLP), common) for _ in range(5))
    self.o = _dense(dim, dim, (MLP, EMBED), common)
    self.norm_q, self.norm_k, self.norm_k_img = (layers.RMSNorm(dim, **norm) for _ in range(3))

  def _heads(self, x):
    return x.reshape(*x.shape[:2], self.num_heads, -1)

  def __call__(self, x, text, image):
    q = self._heads(self.norm_q(self.q(x)))
    out = attention(q, self._heads(self.norm_k(self.k(text))), self._heads(self.v(text)))
    out = out + attention(q, self._heads(self.norm_k_img(self.k_img(image))), self._heads(self.v_img(image)))
    return self.o(out.reshape(*x.shape[:2], -1))


class WanFFN(nnx.Module):
  def __init__(self, config: WanDiTConfig, *, common: dict):
    self.fc1 = _dense(config.dim, config.ffn_dim, (EMBED, MLP), common)
    self.fc2 = _dense(config.ffn_dim, config.dim, (MLP, EMBED), common)

  def __call__(self, x):
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


class WanBlock(nnx.Module):
  def __init__(self, config: WanDiTConfig, *, common: dict):
    dtype, rngs = common["dtype"], common["rngs"]
    self.norm1 = layers.LayerNorm(config.dim, eps=config.eps, elementwise_affine=False, dtype=dtype, rngs=rngs)
    self.norm2 = layers.LayerNorm(config.dim, eps=config.eps, elementwise_affine=False, dtype=dtype, rngs=rngs)
    self.norm3 = layers.LayerNorm(config.dim, eps=config.eps, dtype=dtype, param_dtype=common["param_dtype"],
                                  rngs=rngs)
    self.self_attn = WanSelfAttention(config, common=common)
    self.cross_attn = WanI2VCrossAttention(config, common=common)
    self.ffn = WanFFN(config, common=common)
    # Wan: randn / sqrt(dim) (a jax.nn initializer, so that the trainer draws it on the host)
    self.modulation = layers.make_param(rngs, nnx.initializers.normal(config.dim**-0.5), (6, config.dim),
                                        (None, NORM), common["param_dtype"])

  def __call__(self, x, e, *, token_slots, angles, mask_keys, mask_groups, text, image, prefix=None, with_kv=True):
    """x [b, L, dim]; e [b, slots, 6, dim] fp32 modulation per timestep slot and token_slots [L] each
    token's slot (per-token AdaLN without a [b, L, 6, dim] tensor kept across the blocks); text / image
    [b, *, dim]; prefix: the layer's KV cache of earlier tokens. Returns x and its tokens' (k, v), or
    without with_kv x alone (a block of layers.run_blocks)."""
    e = jnp.take(e, token_slots, axis=1) + self.modulation[...].astype(jnp.float32)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (e[:, :, i] for i in range(6))
    modulate = lambda h, shift, scale: (h.astype(jnp.float32) * (1 + scale) + shift).astype(x.dtype)
    y, kv = self.self_attn(modulate(self.norm1(x), shift_msa, scale_msa), angles, mask_keys, mask_groups, prefix)
    x = (x + y * gate_msa).astype(x.dtype)
    x = x + self.cross_attn(self.norm3(x), text, image)
    y = self.ffn(modulate(self.norm2(x), shift_mlp, scale_mlp))
    x = (x + y * gate_mlp).astype(x.dtype)
    x = constrain(x, (ACT_BATCH, ACT_LEN, ACT_EMBED))
    return (x, kv) if with_kv else x


class Sequential2(nnx.Module):
  """Linear -> activation -> Linear, named fc1 / fc2 (Wan's text and time embeddings)."""

  def __init__(self, in_features, hidden, out_features, act: str, *, common: dict):
    self.act = act
    self.fc1 = _dense(in_features, hidden, (IN_FEATURES if in_features < 1024 else EMBED, MLP), common)
    self.fc2 = _dense(hidden, out_features, (MLP, EMBED), common)

  def __call__(self, x):
    return self.fc2(layers.activation(self.act)(self.fc1(x)))


class ImageProjection(nnx.Module):
  """Wan's MLPProj: LayerNorm -> Linear -> GELU -> Linear -> LayerNorm, CLIP width to the DiT's."""

  def __init__(self, in_dim: int, dim: int, *, common: dict):
    dtype, pdtype, rngs = common["dtype"], common["param_dtype"], common["rngs"]
    self.norm_in = layers.LayerNorm(in_dim, eps=1e-5, dtype=dtype, param_dtype=pdtype, rngs=rngs)
    self.fc1 = _dense(in_dim, in_dim, (EMBED, MLP), common)
    self.fc2 = _dense(in_dim, dim, (MLP, EMBED), common)
    self.norm_out = layers.LayerNorm(dim, eps=1e-5, dtype=dtype, param_dtype=pdtype, rngs=rngs)

  def __call__(self, x):
    return self.norm_out(self.fc2(jax.nn.gelu(self.fc1(self.norm_in(x)), approximate=False)))


class WanDiT(nnx.Module):
  """Patchified latents + action / state tokens -> video velocity tokens and action velocities."""

  def __init__(self, config: WanDiTConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, remat: str = "none",
               attention_impl: str = "auto", scan_layers: bool = True, rngs: nnx.Rngs):
    self.config = config
    self.remat = remat
    self.scan_layers = scan_layers    # teacher forcing's blocks as one lax.scan (layers.run_blocks)
    self.attention_impl = attention_impl
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    dim = config.dim
    self.patch_embedding = _dense(config.patch_features, dim, (IN_FEATURES, EMBED), common)
    self.text_embedding = Sequential2(config.text_dim, dim, dim, "gelu_tanh", common=common)
    self.time_embedding = Sequential2(config.freq_dim, dim, dim, "silu", common=common)
    self.time_projection = _dense(dim, 6 * dim, (EMBED, MLP), common)
    self.img_emb = ImageProjection(config.image_dim, dim, common=common)
    self.blocks = nnx.List([WanBlock(config, common=common) for _ in range(config.num_layers)])
    self.head_norm = layers.LayerNorm(dim, eps=config.eps, elementwise_affine=False, dtype=dtype, rngs=rngs)
    self.head = _dense(dim, config.out_dim * config.patch_size[0] * config.patch_size[1] * config.patch_size[2],
                       (EMBED, MLP), common)
    self.head_modulation = layers.make_param(rngs, nnx.initializers.normal(dim**-0.5), (2, dim), (None, NORM),
                                             param_dtype)
    self.state_encoder = CategorySpecificMLP(config.num_embodiments, config.max_state_dim, config.hidden_size, dim,
                                             **common)
    self.action_encoder = MultiEmbodimentActionEncoder(config.num_embodiments, config.action_dim, dim, **common)
    self.action_decoder = CategorySpecificMLP(config.num_embodiments, dim, config.hidden_size, config.action_dim,
                                              layer1_axes=(EMBED, MLP), layer2_axes=(MLP, IN_FEATURES), **common)

  def embed_text(self, text_states: jax.Array) -> jax.Array:
    """Batch-sharded like x: every block's cross-attention reads it (and its gradient sums there)."""
    return constrain(self.text_embedding(text_states), (ACT_BATCH, ACT_LEN, ACT_EMBED))

  def embed_image(self, clip_tokens: jax.Array) -> jax.Array:
    return constrain(self.img_emb(clip_tokens), (ACT_BATCH, ACT_LEN, ACT_EMBED))

  def time_embed(self, timesteps: jax.Array) -> jax.Array:
    """[..., dim] fp32 time embedding of timesteps on the 0..1000 grid."""
    return self.time_embedding(timestep_sinusoid(timesteps, self.config.freq_dim)).astype(jnp.float32)

  def _modulation(self, timesteps):
    # per sample (batch-sharded): the loss draws the timesteps inside the step, unsharded, and XLA ran
    # the time projection on the whole global batch with its FSDP-sharded width all-reduced (2 GiB a step)
    timesteps = constrain(timesteps, (ACT_BATCH, None))
    temb = constrain(self.time_embed(timesteps), (ACT_BATCH, None, None))
    e = constrain(self.time_projection(jax.nn.silu(temb)).astype(jnp.float32), (ACT_BATCH, None, None))
    return temb, e.reshape(*e.shape[:2], 6, -1)

  def _blocks(self, x, e, *, caches=None, **kwargs):
    """All blocks; caches: per layer (k, v) of a prefix plus its keys / groups. Returns x and the
    per-layer (k, v) of x's tokens. These are the KV-cache paths (each layer reads or writes its own
    cache), so they run block by block; teacher forcing goes through _scanned_blocks."""
    kvs = []
    for i, block in enumerate(self.blocks):
      prefix = None if caches is None else (*caches["kv"][i], caches["keys"], caches["groups"])
      x, kv = layers.run_block(block, x, e, prefix=prefix, remat=self.remat, **kwargs)
      kvs.append(kv)
    return x, kvs

  def _scanned_blocks(self, x, e, **kwargs):
    """All blocks for x alone (no cache in or out): one lax.scan over the stacked block weights unless
    scan_layers is off, so the train step compiles one block instead of num_layers."""
    return layers.run_blocks(self.blocks, x, e, remat=self.remat, scan=self.scan_layers, with_kv=False, **kwargs)

  @staticmethod
  def _slots(video_tokens: int, num_frames: int, num_actions: int, num_states: int) -> np.ndarray:
    """[tokens] int32: each token's timestep slot: its latent frame's, then one per action and state."""
    frames = np.repeat(np.arange(num_frames), video_tokens // num_frames)
    return np.concatenate([frames, num_frames + np.arange(num_actions + num_states)]).astype(np.int32)

  def _outputs(self, x, temb, token_slots, video, num_actions, embodiment_ids):
    """The head on x's noisy-video tokens (slice `video`) and the action decoder on the actions after them."""
    temb = jnp.take(temb, token_slots[video], axis=1)
    shift, scale = (temb[:, :, None] + self.head_modulation[...].astype(jnp.float32)).transpose(2, 0, 1, 3)
    video_out = self.head((self.head_norm(x[:, video]).astype(jnp.float32) * (1 + scale) + shift).astype(x.dtype))
    action_out = self.action_decoder(x[:, video.stop:video.stop + num_actions], embodiment_ids)
    return video_out, action_out

  def _tokens(self, video_tokens, actions, action_timesteps, states, embodiment_ids):
    x_video = self.patch_embedding(video_tokens)
    action_tokens = encode_actions(self.action_encoder, actions, action_timesteps, embodiment_ids)
    state_tokens = self.state_encoder(states, embodiment_ids)
    x = jnp.concatenate([x_video, action_tokens.astype(x_video.dtype), state_tokens.astype(x_video.dtype)], axis=1)
    return constrain(x, (ACT_BATCH, ACT_LEN, ACT_EMBED))

  @with_attention_impl
  def __call__(self, video_tokens: jax.Array, video_timesteps: jax.Array, actions: jax.Array,
               action_timesteps: jax.Array, states: jax.Array, state_timesteps: jax.Array, *,
               embodiment_ids: jax.Array, angles: jax.Array, mask_keys: jax.Array, mask_groups: jax.Array,
               text: jax.Array, image: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Teacher forcing. video_tokens [b, 2 Lv, patch_features] (clean then noisy); video_timesteps per
    latent frame of both streams [b, 2 F], the others per token ([b, A], [b, S]); actions [b, A,
    action_dim]; states [b, S, max_state_dim]; text / image already embedded ([b, *, dim]); angles / mask
    ids for the whole sequence. Returns noisy-video outputs [b, Lv, out patch features] and action
    velocities [b, A, action_dim]."""
    x = self._tokens(video_tokens, actions, action_timesteps, states, embodiment_ids)
    temb, e = self._modulation(jnp.concatenate([video_timesteps, action_timesteps, state_timesteps], axis=1))
    slots = self._slots(video_tokens.shape[1], video_timesteps.shape[1], actions.shape[1], states.shape[1])
    x = self._scanned_blocks(x, e, token_slots=slots, angles=angles, mask_keys=mask_keys, mask_groups=mask_groups,
                             text=text, image=image)
    video_len = video_tokens.shape[1] // 2
    return self._outputs(x, temb, slots, slice(video_len, 2 * video_len), actions.shape[1], embodiment_ids)

  @with_attention_impl
  def context_cache(self, clean_tokens: jax.Array, *, angles: jax.Array, mask_keys: jax.Array,
                    mask_groups: jax.Array, text: jax.Array, image: jax.Array) -> dict:
    """The KV cache of clean context tokens [b, Lc, patch_features] (timestep 0): per layer their
    (k, v), with their mask keys and groups. Clean tokens attend only clean tokens, so their k / v are
    the teacher-forced pass's."""
    x = constrain(self.patch_embedding(clean_tokens), (ACT_BATCH, ACT_LEN, ACT_EMBED))
    _, e = self._modulation(jnp.zeros((clean_tokens.shape[0], 1), jnp.float32))  # one slot: t = 0
    slots = np.zeros(clean_tokens.shape[1], np.int32)
    _, kvs = self._blocks(x, e, token_slots=slots, angles=angles, mask_keys=mask_keys, mask_groups=mask_groups,
                          text=text, image=image)
    return {"kv": kvs, "keys": mask_keys, "groups": mask_groups}

  @with_attention_impl
  def chunk(self, video_tokens: jax.Array, video_timesteps: jax.Array, actions: jax.Array,
            action_timesteps: jax.Array, states: jax.Array, state_timesteps: jax.Array, *, cache: dict,
            embodiment_ids: jax.Array, angles: jax.Array, mask_keys: jax.Array, mask_groups: jax.Array,
            text: jax.Array, image: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One chunk [noisy video | actions | states] over a context KV cache (context_cache, cut to the
    clean tokens before the chunk): the teacher-forced outputs of that chunk, at a chunk's cost.
    video_timesteps per latent frame of the chunk [b, frames]."""
    x = self._tokens(video_tokens, actions, action_timesteps, states, embodiment_ids)
    temb, e = self._modulation(jnp.concatenate([video_timesteps, action_timesteps, state_timesteps], axis=1))
    slots = self._slots(video_tokens.shape[1], video_timesteps.shape[1], actions.shape[1], states.shape[1])
    x, _ = self._blocks(x, e, caches=cache, token_slots=slots, angles=angles, mask_keys=mask_keys,
                        mask_groups=mask_groups, text=text, image=image)
    return self._outputs(x, temb, slots, slice(0, video_tokens.shape[1]), actions.shape[1], embodiment_ids)
