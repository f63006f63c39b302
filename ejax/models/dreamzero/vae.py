"""The Wan video VAE (frozen): video [b, T, H, W, 3] in [-1, 1] <-> latents [b, 1 + (T - 1) / 4, H / s, W / s, z].

Wan 2.1's architecture (dim 96, z 16, stride 4 x 8 x 8): causal 3D convolutions (time padded on the
past only), residual blocks of channel RMS norm -> SiLU -> conv, one single-head spatial attention in
the middle, 2x spatial resampling between stages and 2x temporal resampling in the last two (the first
frame passes unresampled, so 1 + 4k frames make 1 + k latents). The official code runs the first frame,
then chunks of 4 frames (decoding: one latent frame at a time) through per-layer caches of past frames;
for causal convolutions that is the same as one pass over the whole clip, which is what this does.

Wan 2.2 (z 48, stride 4 x 16 x 16) is here shape-correct, not parameter-compatible: the 2.1 stages with
dim 160 behind a 2x2 pixel patchify (12 channels), as Wan 2.2 patchifies; the released 2.2 VAE also adds
averaged-down shortcuts around each stage (Down_ResidualBlock), which this does not have.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ejax.kernels.attention import attention
from ejax.models import layers
from ejax.parallel.axes import EMBED


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
  version: str = "2.1"
  dim: int = 96
  z_dim: int = 16
  dim_mult: tuple[int, ...] = (1, 2, 4, 4)
  num_res_blocks: int = 2
  temporal_downsample: tuple[bool, ...] = (False, True, True)
  patch: int = 1                  # pixel patchify before the encoder (2.2: 2)

  @classmethod
  def for_version(cls, version: str = "2.1", **overrides) -> "WanVAEConfig":
    if version not in ("2.1", "2.2"):
      raise ValueError(f"error: Wan VAE version {version!r} is not one of 2.1, 2.2")
    base = dict(version="2.1") if version == "2.1" else dict(version="2.2", dim=160, z_dim=48, patch=2)
    base.update(overrides)
    base["dim_mult"] = tuple(base.get("dim_mult", cls.dim_mult))
    return cls(**base)

  @property
  def spatial_stride(self) -> int:
    return self.patch * 2 ** (len(self.dim_mult) - 1)

  @property
  def in_channels(self) -> int:
    return 3 * self.patch * self.patch


# Fan-in scaled over the kernel window and input channels ([..., in, out] kernels).
_conv_init = nnx.initializers.lecun_normal()


class CausalConv3d(nnx.Module):
  """Conv3d on [b, t, h, w, c], zero-padded 2 * pad_t frames in the past, pad_h / pad_w each side."""

  def __init__(self, in_ch: int, out_ch: int, kernel=(3, 3, 3), *, stride=(1, 1, 1), padding=(1, 1, 1), common: dict):
    # Output channels named EMBED so that FSDP shards the kernels (the 2.2 VAE is 1.4 GB in fp32).
    self.kernel = layers.make_param(common["rngs"], _conv_init, (*kernel, in_ch, out_ch), (None,) * 4 + (EMBED,),
                                    common["param_dtype"])
    self.bias = layers.make_param(common["rngs"], layers.ZEROS, (out_ch,), (None,), common["param_dtype"])
    self.stride, self.padding, self.dtype = tuple(stride), tuple(padding), common["dtype"]

  def __call__(self, x):
    pt, ph, pw = self.padding
    x = jnp.pad(x.astype(self.dtype), [(0, 0), (2 * pt, 0), (ph, ph), (pw, pw), (0, 0)])
    kernel = self.kernel[...].astype(self.dtype)
    if jax.default_backend() == "cpu":
      y = _time_folded_conv(x, kernel, self.stride)
    else:
      y = jax.lax.conv_general_dilated(x, kernel, self.stride, "VALID", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))
    return y + self.bias[...].astype(self.dtype)


def _time_folded_conv(x, kernel, stride):
  """The same VALID Conv3d as one Conv2d over every output frame, its time taps side by side in the
  input channels: XLA:CPU runs 3D convolutions ~7x slower than 2D ones (measured on the runlocal
  VAE's 3x3x3 convs, 2026-11-27), which made the VAE most of a CPU train step."""
  kt, kh, kw, cin, cout = kernel.shape
  st, sh, sw = stride
  b, t = x.shape[:2]
  frames = (t - kt) // st + 1
  taps = jnp.concatenate([x[:, dt:dt + st * (frames - 1) + 1:st] for dt in range(kt)], axis=-1)
  folded = kernel.transpose(1, 2, 0, 3, 4).reshape(kh, kw, kt * cin, cout)
  y = jax.lax.conv_general_dilated(taps.reshape(b * frames, *taps.shape[2:]), folded, (sh, sw), "VALID",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return y.reshape(b, frames, *y.shape[1:])


class Conv2d(nnx.Module):
  """3x3 Conv2d applied to every frame of [b, t, h, w, c]."""

  def __init__(self, in_ch: int, out_ch: int, *, stride: int = 1, padding=((1, 1), (1, 1)), common: dict):
    self.kernel = layers.make_param(common["rngs"], _conv_init, (3, 3, in_ch, out_ch), (None,) * 3 + (EMBED,),
                                    common["param_dtype"])
    self.bias = layers.make_param(common["rngs"], layers.ZEROS, (out_ch,), (None,), common["param_dtype"])
    self.stride, self.padding, self.dtype = stride, padding, common["dtype"]

  def __call__(self, x):
    b, t = x.shape[:2]
    y = jax.lax.conv_general_dilated(x.reshape(b * t, *x.shape[2:]).astype(self.dtype),
                                     self.kernel[...].astype(self.dtype), (self.stride,) * 2, self.padding,
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return (y + self.bias[...].astype(self.dtype)).reshape(b, t, *y.shape[1:])


class ChannelRMSNorm(nnx.Module):
  """Wan's RMS_norm: x / ||x|| * sqrt(channels) * gamma over the channel axis."""

  def __init__(self, dim: int, *, common: dict):
    self.gamma = layers.make_param(common["rngs"], layers.ONES, (dim,), (None,), common["param_dtype"])
    self.scale = dim**0.5

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    norm = jnp.maximum(jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True)), 1e-12)
    return (xf / norm * self.scale * self.gamma[...].astype(jnp.float32)).astype(x.dtype)


class ResidualBlock(nnx.Module):
  def __init__(self, in_dim: int, out_dim: int, *, common: dict):
    self.norm1, self.conv1 = ChannelRMSNorm(in_dim, common=common), CausalConv3d(in_dim, out_dim, common=common)
    self.norm2, self.conv2 = ChannelRMSNorm(out_dim, common=common), CausalConv3d(out_dim, out_dim, common=common)
    self.shortcut = (CausalConv3d(in_dim, out_dim, (1, 1, 1), padding=(0, 0, 0), common=common)
                     if in_dim != out_dim else None)

  def __call__(self, x):
    h = self.conv2(jax.nn.silu(self.norm2(self.conv1(jax.nn.silu(self.norm1(x))))))
    return h + (x if self.shortcut is None else self.shortcut(x))


class AttentionBlock(nnx.Module):
  """One-head attention over each frame's pixels (1x1 convs for qkv and the projection)."""

  def __init__(self, dim: int, *, common: dict):
    self.norm = ChannelRMSNorm(dim, common=common)
    self.to_qkv = layers.Dense(dim, 3 * dim, axes=(None, EMBED), dtype=common["dtype"],
                               param_dtype=common["param_dtype"], rngs=common["rngs"])
    self.proj = layers.Dense(dim, dim, axes=(None, EMBED), dtype=common["dtype"], param_dtype=common["param_dtype"],
                             rngs=common["rngs"])

  def __call__(self, x):
    b, t, h, w, c = x.shape
    q, k, v = jnp.split(self.to_qkv(self.norm(x)).reshape(b * t, h * w, 1, 3 * c), 3, axis=-1)
    return x + self.proj(attention(q, k, v).reshape(x.shape))


class Resample(nnx.Module):
  """2x down / up in space (down: zero pad right and bottom, 3x3 stride 2; up: nearest, 3x3 to dim / 2),
  and in time for the "3d" modes (the first frame passes as it is)."""

  def __init__(self, dim: int, mode: str, *, common: dict):
    self.mode = mode
    if mode.startswith("down"):
      self.conv = Conv2d(dim, dim, stride=2, padding=((0, 1), (0, 1)), common=common)
    else:
      self.conv = Conv2d(dim, dim // 2, common=common)
    time_conv = None
    if mode == "downsample3d":
      time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1), padding=(0, 0, 0), common=common)
    elif mode == "upsample3d":
      time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0), common=common)
    self.time_conv = time_conv

  def __call__(self, x):
    if self.mode == "upsample3d" and x.shape[1] > 1:
      doubled = self.time_conv(x[:, 1:])                            # [b, t - 1, h, w, 2c]
      b, t, h, w, c2 = doubled.shape
      doubled = doubled.reshape(b, t, h, w, 2, c2 // 2).transpose(0, 1, 4, 2, 3, 5).reshape(b, 2 * t, h, w, -1)
      x = jnp.concatenate([x[:, :1], doubled], axis=1)
    if self.mode.startswith("up"):
      x = jnp.repeat(jnp.repeat(x, 2, axis=2), 2, axis=3)
    x = self.conv(x)
    if self.mode == "downsample3d" and x.shape[1] > 1:
      x = jnp.concatenate([x[:, :1], self.time_conv(x)], axis=1)
    return x


class Encoder(nnx.Module):
  def __init__(self, config: WanVAEConfig, *, common: dict):
    dims = [config.dim * m for m in (1,) + config.dim_mult]
    self.conv1 = CausalConv3d(config.in_channels, dims[0], common=common)
    stages = []
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
      for _ in range(config.num_res_blocks):
        stages.append(ResidualBlock(in_dim, out_dim, common=common))
        in_dim = out_dim
      if i != len(config.dim_mult) - 1:
        mode = "downsample3d" if config.temporal_downsample[i] else "downsample2d"
        stages.append(Resample(out_dim, mode, common=common))
    self.downsamples = nnx.List(stages)
    self.middle = nnx.List([ResidualBlock(dims[-1], dims[-1], common=common), AttentionBlock(dims[-1], common=common),
                            ResidualBlock(dims[-1], dims[-1], common=common)])
    self.head_norm = ChannelRMSNorm(dims[-1], common=common)
    self.head_conv = CausalConv3d(dims[-1], 2 * config.z_dim, common=common)

  def __call__(self, x):
    x = self.conv1(x)
    for layer in list(self.downsamples) + list(self.middle):
      x = layer(x)
    return self.head_conv(jax.nn.silu(self.head_norm(x)))


class Decoder(nnx.Module):
  def __init__(self, config: WanVAEConfig, *, common: dict):
    dims = [config.dim * m for m in (config.dim_mult[-1],) + config.dim_mult[::-1]]
    temporal_upsample = config.temporal_downsample[::-1]
    self.conv1 = CausalConv3d(config.z_dim, dims[0], common=common)
    self.middle = nnx.List([ResidualBlock(dims[0], dims[0], common=common), AttentionBlock(dims[0], common=common),
                            ResidualBlock(dims[0], dims[0], common=common)])
    stages = []
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
      if i in (1, 2, 3):
        in_dim //= 2  # the previous stage's upsample halved the channels
      for _ in range(config.num_res_blocks + 1):
        stages.append(ResidualBlock(in_dim, out_dim, common=common))
        in_dim = out_dim
      if i != len(config.dim_mult) - 1:
        mode = "upsample3d" if temporal_upsample[i] else "upsample2d"
        stages.append(Resample(out_dim, mode, common=common))
    self.upsamples = nnx.List(stages)
    self.head_norm = ChannelRMSNorm(dims[-1], common=common)
    self.head_conv = CausalConv3d(dims[-1], config.in_channels, common=common)

  def __call__(self, z):
    x = self.conv1(z)
    for layer in list(self.middle) + list(self.upsamples):
      x = layer(x)
    return self.head_conv(jax.nn.silu(self.head_norm(x)))


class WanVAE(nnx.Module):
  def __init__(self, config: WanVAEConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.encoder = Encoder(config, common=common)
    self.conv1 = CausalConv3d(2 * config.z_dim, 2 * config.z_dim, (1, 1, 1), padding=(0, 0, 0), common=common)
    self.conv2 = CausalConv3d(config.z_dim, config.z_dim, (1, 1, 1), padding=(0, 0, 0), common=common)
    self.decoder = Decoder(config, common=common)

  def _patchify(self, video):
    p = self.config.patch
    if p == 1:
      return video
    b, t, h, w, c = video.shape
    # Wan 2.2's "b c t (h q) (w r) -> b (c r q) t h w"
    x = video.reshape(b, t, h // p, p, w // p, p, c).transpose(0, 1, 2, 4, 6, 5, 3)
    return x.reshape(b, t, h // p, w // p, c * p * p)

  def _unpatchify(self, x):
    p = self.config.patch
    if p == 1:
      return x
    b, t, h, w, _ = x.shape
    x = x.reshape(b, t, h, w, 3, p, p).transpose(0, 1, 2, 6, 3, 5, 4)
    return x.reshape(b, t, h * p, w * p, 3)

  def encode(self, video: jax.Array) -> jax.Array:
    """video [b, 1 + 4k, H, W, 3] in [-1, 1] -> the latent means [b, 1 + k, H / s, W / s, z]."""
    frames, height, width = video.shape[1:4]
    stride = self.config.spatial_stride
    if (frames - 1) % 4 or height % stride or width % stride:
      raise ValueError(f"error: the Wan VAE takes 1 + 4k frames of a multiple of {stride} pixels, got {frames} "
                       f"frames of {height}x{width}; resize or trim the clip")
    moments = self.conv1(self.encoder(self._patchify(video)))
    return moments[..., :self.config.z_dim]

  def decode(self, latents: jax.Array) -> jax.Array:
    return jnp.clip(self._unpatchify(self.decoder(self.conv2(latents))), -1.0, 1.0)
