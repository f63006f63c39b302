"""The perception module a VLA hooks: keypoints the instruction chooses, and an estimate read from them.

    seen = perception(images, instruction, state, rng=rng, targets=batch)   # once per batch
    seen.state      the state vector with the estimate and the keypoints in their slots (StateLayout)
    perception.losses(seen, batch)                                          # its own losses

images [n * cameras, H, W, 3] in [-1, 1] (each sample's cameras in turn); instruction [n, width]: the
host's embedding of the sample's instruction (e.g. the mean of its text-token embeddings); state
[n, max_state_dim]. The module reads nothing else of its host and never calls back into it.

Per image, a shared layer reads each 2x2-pixel patch (keypoints.PixelKeypoints); the instruction chooses
`detectors.points` detectors over those features (e.g. "the target" and "its goal"), trained by a
heatmap cross-entropy on where each point appears (batch["aux_pixels"]); free detectors add
keypoints the readout uses as it likes. A readout of the keypoints, the instruction and the state
estimates the privileged state (batch["aux_state"], e.g. the target's and goal's positions). Where
the cameras are calibrated and the policy has handed over the statistics, the instruction's points are
placed by their keypoints through the cameras instead (geometry.py). During training the action head
reads the target in the estimate's place (teacher forcing, noised), the estimate learning by its own loss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ejax.models import layers
from ejax.models.perception import geometry
from ejax.models.perception.config import PerceptionConfig
from ejax.models.perception.keypoints import KEYPOINT_HIDDEN, PixelKeypoints, heatmap_loss, pixel_grid
from ejax.parallel.axes import EMBED, MLP

# rng folds of the teacher's noise and mix (the host's context rng)
_NOISE_FOLD, _MIX_FOLD = 7, 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Seen:
  logits: jax.Array | None     # the instruction's detectors [n * cameras, cells, points]
  keypoints: jax.Array         # their (x, y) [n, cameras * points * 2] (batch["aux_pixels"]'s layout)
  readout: jax.Array           # the readout's estimate [n, estimate.dim] (normalised units)
  estimate: jax.Array          # what the action head reads: the readout, placed by the geometry or teacher-forced
  state: jax.Array             # the state with the estimate and the keypoints in their slots


def standardise(instruction: jax.Array) -> jax.Array:
  # The mean byte embedding is small and alike across instructions, and the detectors it chose
  # stayed flat for hundreds of steps (cross-entropy on the target 3.1 vs 1.7 at 300).
  centred = instruction - jnp.mean(instruction, axis=-1, keepdims=True)
  return centred * jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + 1e-6)


class Perception(nnx.Module):

  def __init__(self, config: PerceptionConfig, text_width: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    if not config.num_cameras:
      raise ValueError("model.perception reads the cameras, and the model has num_cameras=0")
    if config.layout.data_dims < 0:
      raise ValueError(f"model.perception writes {config.layout.reserved} state entries, more than "
                       f"max_state_dim={config.max_state_dim}")
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.config, self.dtype = config, dtype
    detectors, estimate, cameras = config.detectors, config.estimate, config.num_cameras
    # Creation order is the rng order: the same draws as when these lived in GR00T's action head.
    self.pixels = PixelKeypoints(detectors.free, pixel_patch=2, **common)
    self.readout_instruction = layers.Dense(text_width, estimate.width, axes=(EMBED, MLP), **common)
    self.queries = self.context = self.context_bias = self.context_more = self.context_more_bias = nnx.data(None)
    self.position = nnx.data(None)
    if detectors.points:
      self.queries = layers.Dense(text_width, detectors.points * KEYPOINT_HIDDEN, axes=(EMBED, None), **common)
      if detectors.context_layers:
        # residual 3x3 convolutions: a detector sees a patch's neighbourhood (a dark bar on the
        # cabinet's front is a handle, a dark disc on the table is not), the later ones dilated
        self.context = layers.make_param(rngs, nnx.initializers.lecun_normal(),
                                         (3, 3, KEYPOINT_HIDDEN, KEYPOINT_HIDDEN), (None, None, None, MLP), param_dtype)
        self.context_bias = layers.make_param(rngs, nnx.initializers.zeros, (KEYPOINT_HIDDEN,), (MLP,), param_dtype)
        more = detectors.context_layers - 1
        if more > 0:
          self.context_more = layers.make_param(
              rngs, nnx.initializers.lecun_normal(in_axis=(1, 2, 3), out_axis=4, batch_axis=(0,)),
              (more, 3, 3, KEYPOINT_HIDDEN, KEYPOINT_HIDDEN), (None, None, None, None, MLP), param_dtype)
          self.context_more_bias = layers.make_param(rngs, nnx.initializers.zeros, (more, KEYPOINT_HIDDEN),
                                                     (None, MLP), param_dtype)
      if detectors.position_scale:
        # logit + scale * w . (x, y), w read from the instruction (zero at first): "the left one"
        self.position = layers.Dense(text_width, cameras * detectors.points * 2, axes=(EMBED, None),
                                     kernel_init=nnx.initializers.zeros, **common)
    self.readout_keypoints = layers.Dense(cameras * (detectors.free + detectors.points) * 3, estimate.width,
                                          axes=(None, MLP), **common)
    # and the arm's state: the wrist camera sees the object relative to the hand
    self.readout_state = layers.Dense(config.max_state_dim, estimate.width, axes=(None, MLP), **common)
    self.readout_mid = layers.Dense(estimate.width, estimate.width, axes=(MLP, None), **common)
    self.readout_out = layers.Dense(estimate.width, estimate.dim, axes=(None, None), **common)

  # --- The instruction's detectors -------------------------------------------------------------
  def heatmap_position(self, images: jax.Array, instruction: jax.Array) -> jax.Array | None:
    """The instruction's position term [n * cameras, cells, points], or None."""
    if self.position is None:
      return None
    n, points = instruction.shape[0], self.config.detectors.points
    weights = self.position(standardise(instruction).astype(self.dtype))
    weights = weights.reshape(n * self.config.num_cameras, points, 2)
    grid = jnp.asarray(pixel_grid(*self.pixels.grid(images)))
    return self.config.detectors.position_scale * jnp.einsum("pd,nqd->npq", grid, weights.astype(jnp.float32))

  def heatmap_logits(self, images: jax.Array, instruction: jax.Array) -> jax.Array:
    """The instruction's detectors' logits [n * cameras, cells, points] over each image's patch grid."""
    x = self.pixels.features(images)
    if self.context is not None:
      grid = self.pixels.grid(images)
      dilation = self.config.detectors.context_dilation
      convolutions = [(self.context[...], self.context_bias[...], 1)]
      if self.context_more is not None:
        convolutions += [(k, b, dilation) for k, b in zip(self.context_more[...], self.context_more_bias[...])]
      for kernel, bias, rate in convolutions:
        cells = x.reshape(x.shape[0], *grid, x.shape[-1])
        context = jax.lax.conv_general_dilated(cells, kernel.astype(x.dtype), (1, 1), "SAME", rhs_dilation=(rate, rate),
                                               dimension_numbers=("NHWC", "HWIO", "NHWC"))
        x = x + jax.nn.gelu(context + bias.astype(x.dtype)).reshape(x.shape)
    queries = self.queries(standardise(instruction).astype(self.dtype))
    queries = jnp.repeat(queries.reshape(instruction.shape[0], self.config.detectors.points, -1),
                         self.config.num_cameras, axis=0)
    logits = jnp.einsum("nph,nqh->npq", x, queries.astype(x.dtype)).astype(jnp.float32)
    position = self.heatmap_position(images, instruction)
    return logits if position is None else logits + position

  # --- The estimate ------------------------------------------------------------------------------
  def read_out(self, images, instruction, state, logits) -> jax.Array:
    """The readout's estimate [n, estimate.dim] from every keypoint (free and chosen), the
    instruction and the state as the batch has it (its slots still zero)."""
    all_logits = self.pixels.heatmaps(images)
    if logits is not None:
      all_logits = jnp.concatenate([all_logits, logits], -1)
    points = self.pixels.summary(images, logits=all_logits)
    hidden = (self.readout_instruction(instruction.astype(self.dtype))
              + self.readout_keypoints(points.reshape(instruction.shape[0], -1).astype(self.dtype))
              + self.readout_state(state.astype(self.dtype)))
    hidden = self.readout_mid(jax.nn.gelu(hidden))
    return self.readout_out(jax.nn.gelu(hidden)).astype(jnp.float32)

  def placed(self, images, state, readout, logits) -> jax.Array:
    """The readout [n, estimate.dim] (normalised) with the instruction's points placed by their
    keypoints through the calibrated cameras, at the readout's heights."""
    c, g = self.config, self.config.geometry
    names = sorted(g.cameras)
    if len(names) != c.num_cameras:
      raise ValueError(f"model.perception.geometry.cameras calibrates {names} but the model has "
                       f"{c.num_cameras} cameras")
    n = state.shape[0]
    state_centre, state_scale = (jnp.asarray(v, jnp.float32) for v in g.norm["state"])
    centre, scale = (jnp.asarray(v, jnp.float32) for v in g.norm["estimate"])
    raw_state = jnp.asarray(state, jnp.float32)[:, :state_centre.shape[0]] * state_scale + state_centre
    metres = readout.astype(jnp.float32) * scale + centre
    starts = [int(s) for s in g.points]
    heights = jnp.stack([metres[:, s + 2] for s in starts], -1)
    cameras = [g.cameras[name] for name in names]
    tcp = raw_state[:, jnp.asarray(g.tcp_dims)]
    grid = self.pixels.grid(images)
    coords, _ = self.pixels.coordinates(images, logits=logits)                         # [n * cameras, K, 2]
    for k, radius in enumerate(g.radius):
      if radius:
        local = geometry.local_soft_argmax(logits[..., k:k + 1], pixel_grid(*grid), int(radius), 2.0 / grid[1])
        coords = coords.at[:, k].set(local[:, 0])
    points_xy = coords.reshape(n, c.num_cameras, -1, 2)
    world = geometry.locate(points_xy[:, :, :len(starts)], heights, tcp, cameras, np.asarray(g.tolerance, np.float32))
    for k, s in enumerate(starts):
      metres = metres.at[:, s:s + 3].set(world[:, k])
    return ((metres - centre) / scale).astype(readout.dtype)

  def teacher_forced(self, estimate, targets, rng) -> jax.Array:
    """The target (noised when training) where a sample has one, the estimate elsewhere."""
    teacher = self.config.teacher
    estimate = jax.lax.stop_gradient(estimate)
    if targets is None or "aux_state" not in targets:
      return estimate
    target = jnp.asarray(targets["aux_state"], jnp.float32)
    forced = jnp.asarray(targets["aux_mask"]) > 0
    if rng is not None:
      target = target + teacher.noise * jax.random.normal(jax.random.fold_in(rng, _NOISE_FOLD), target.shape)
      if teacher.mix:
        forced = forced & (jax.random.uniform(jax.random.fold_in(rng, _MIX_FOLD), forced.shape) >= teacher.mix)
    return jnp.where(forced[:, None], target, estimate)

  # --- The hook ----------------------------------------------------------------------------------
  def __call__(self, images: jax.Array, instruction: jax.Array, state: jax.Array, *, targets=None,
               rng=None) -> Seen:
    """Everything once per batch; targets: the batch's training targets (aux_state, aux_mask), rng the
    training step's (None: inference)."""
    c, state = self.config, jnp.asarray(state)
    logits = self.heatmap_logits(images, instruction) if self.queries is not None else None
    if logits is not None:
      coords, _ = self.pixels.coordinates(images, logits=logits)
      keypoints = coords.reshape(state.shape[0], -1).astype(jnp.float32)
    else:
      keypoints = jnp.zeros((state.shape[0], 0), jnp.float32)
    readout = self.read_out(images, instruction, state, logits)
    estimate = self.placed(images, state, readout, logits) if c.geometry.active else readout
    if c.teacher.forcing:
      estimate = self.teacher_forced(estimate, targets, rng)
    layout, written = c.layout, state
    if c.detectors.to_state:
      written = written.at[:, layout.keypoints].add(jax.lax.stop_gradient(keypoints).astype(state.dtype))
    if c.estimate.to_state:
      written = written.at[:, layout.estimate].add(estimate.astype(state.dtype))
    return Seen(logits=logits, keypoints=keypoints, readout=readout, estimate=estimate, state=written)

  def add_losses(self, loss: jax.Array, metrics: dict, seen: Seen, batch) -> jax.Array:
    """The host's loss plus this module's weighted losses; each also goes into `metrics`."""
    for name, (weight, value) in self.losses(seen, batch, batch["images"]).items():
      metrics[name] = value
      loss = loss + weight * value
    return loss

  def losses(self, seen: Seen, batch, images: jax.Array) -> dict[str, tuple[float, jax.Array]]:
    """{metric name: (weight, loss)} over the samples with a target (batch["aux_mask"])."""
    mask = batch["aux_mask"].astype(jnp.float32)
    total = jnp.maximum(jnp.sum(mask), 1.0)
    error = jnp.mean(jnp.square(seen.readout - batch["aux_state"]), axis=-1)
    losses = {"aux_state_loss": (self.config.estimate.weight, jnp.sum(error * mask) / total)}
    if seen.logits is not None:
      labels = jnp.asarray(batch["aux_pixels"], jnp.float32).reshape(images.shape[0], -1, 2)
      loss, in_view = heatmap_loss(seen.logits, labels, self.pixels.grid(images))
      loss, in_view = (v.reshape(mask.shape[0], -1).astype(jnp.float32) for v in (loss, in_view))
      per_sample = jnp.sum(loss, axis=1) / jnp.maximum(jnp.sum(in_view, axis=1), 1.0)
      losses["aux_heatmap_loss"] = (self.config.detectors.weight, jnp.sum(per_sample * mask) / total)
    return losses
