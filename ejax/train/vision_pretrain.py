"""Pre-training GR00T's vision tower and connector on rendered layouts (model.vision_pretrain).

The released GR00T fine-tunes on top of a pre-trained SigLIP2; a CPU run has no such weights, and a
tower trained only through the flow-matching loss on a few hundred demonstrations memorises their
layouts (ejax/sim/layouts.py has the figures). This stage gives the tower what pre-training gives
the released one, from ejax.sim itself: thousands of rendered layouts, each frame labelled with
where every object is.

The readout is built the way the action head reads the backbone: one learned query per object
cross-attends over the connector's tokens of all cameras and regresses the object's world position
and its offset from the hand. A head that flattens the tokens can read a position from *which*
token holds the object; cross-attention (the DiT's) only gets the tokens' content, so the tower must
put "where" into each token's content, which fixed sine-cosine position codes
(`vision.posemb_init="sincos2d"`) make easy. The readout is dropped afterwards; the tower and the
connector go into the train state (frozen when `tune_visual=False`, as GR00T fine-tunes them).

The result is cached under $EJAX_CACHE_DIR (default ~/.cache/ejax)/vision_pretrain/, keyed by the
settings and the tower's shape, and written atomically, so a second run, or another process, reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from ejax.data.transforms import resize
from ejax.models.connector import MLPConnector, mlp_settings  # keypoints are not pre-trained
from ejax.models.siglip import SiglipConfig, SiglipVisionTransformer, normalize_images

# Bump when the rendered data or the readout changes, so stale caches are not reused.
FORMAT = 1


class ObjectReadout(nnx.Module):
  """Connector tokens of every camera -> per object (world xyz, offset from the hand xyz)."""

  def __init__(self, width: int, num_cameras: int, num_points: int, *, rngs: nnx.Rngs):
    self.queries = nnx.Param(jax.random.normal(rngs.params(), (num_points, width)) * 0.5)
    self.camera = nnx.Param(jax.random.normal(rngs.params(), (num_cameras, 1, width)) * 0.02)
    self.attention = nnx.MultiHeadAttention(4, width, width, decode=False, rngs=rngs)
    self.hidden = nnx.Linear(width, 2 * width, rngs=rngs)
    self.out = nnx.Linear(2 * width, 6, rngs=rngs)

  def __call__(self, tokens: list[jax.Array]) -> jax.Array:
    x = jnp.concatenate([t + self.camera[i] for i, t in enumerate(tokens)], axis=1)
    q = jnp.broadcast_to(self.queries[...], (x.shape[0],) + self.queries.shape)
    return self.out(jax.nn.gelu(self.hidden(self.attention(q, x))))


class _Pretrainer(nnx.Module):

  def __init__(self, model_config, num_cameras: int, num_points: int, rngs: nnx.Rngs):
    self.vision = SiglipVisionTransformer(SiglipConfig(**model_config.vision), rngs=rngs)
    self.connector = MLPConnector(model_config.vision.width, model_config.llm.width,
                                  **mlp_settings(model_config.connector), rngs=rngs)
    self.readout = ObjectReadout(model_config.llm.width, num_cameras, num_points, rngs=rngs)

  def __call__(self, images: list[jax.Array]) -> jax.Array:
    n = images[0].shape[0]
    tokens = self.connector(self.vision(normalize_images(jnp.concatenate(images))))
    return self.readout([tokens[i * n:(i + 1) * n] for i in range(len(images))])


def _targets(frames: dict) -> np.ndarray:
  return np.concatenate([frames["points"], frames["points"] - frames["tcp"][:, None]], -1)  # [N, P, 6]


def pretrain(model_config, settings, tasks: str, image_size: tuple[int, int]) -> tuple[dict, dict]:
  """Renders the layouts and trains; -> ({"vision": ..., "connector": ...} as pure dicts of numpy
  arrays, a report with the held-out error per object in cm)."""
  from ejax.sim.layouts import POINT_NAMES, render_layouts
  size = int(model_config.vision.image_size)
  frames = render_layouts(settings.tasks or tasks, int(settings.layouts), steps_per_layout=int(settings.steps_per_layout),
                          image_size=tuple(image_size), perturb_prob=float(settings.perturb_prob), seed=int(settings.seed))
  cameras = sorted(key for key in frames if key.startswith("observation.images."))
  images = [np.stack([resize(image, (size, size)) for image in frames[key]]) if frames[key].shape[1] != size
            else frames[key] for key in cameras]
  targets, valid = _targets(frames), frames["valid"]
  mean = (targets * valid[..., None]).sum((0, 1)) / valid.sum()
  std = np.sqrt((((targets - mean) ** 2) * valid[..., None]).sum((0, 1)) / valid.sum()) + 1e-3
  normalised = ((targets - mean) / std).astype(np.float32)
  held_out = frames["layout"] >= int(settings.layouts) - max(1, int(settings.layouts) // 20)
  train_rows = np.flatnonzero(~held_out)

  model = _Pretrainer(model_config, len(cameras), len(POINT_NAMES), nnx.Rngs(int(settings.seed)))
  steps = int(settings.steps)
  schedule = optax.warmup_cosine_decay_schedule(0.0, float(settings.learning_rate), max(1, steps // 30), steps)
  optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=1e-5), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, images, target, mask):
    def loss_fn(model):
      err = jnp.mean((model(images) - target) ** 2, -1)
      return jnp.sum(err * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  predict = nnx.jit(lambda model, images: model(images))
  rng, start, loss = np.random.default_rng(int(settings.seed)), time.time(), np.nan
  for step in range(steps):
    rows = rng.choice(train_rows, int(settings.batch_size))
    loss = train_step(model, optimizer, [im[rows] for im in images], normalised[rows], valid[rows].astype(np.float32))
    if step % 500 == 0:
      logging.info("vision pre-training: step %d/%d, loss %.4f, %.0f s", step, steps, float(loss), time.time() - start)
  rows = np.flatnonzero(held_out)
  predicted = np.concatenate([np.asarray(predict(model, [im[rows[i:i + 256]] for im in images]))
                              for i in range(0, len(rows), 256)]) * std + mean
  truth, mask = targets[rows], valid[rows][..., None]
  error = _masked_rms(predicted - truth, mask)
  spread = _masked_rms(truth - (truth * mask).sum(0) / np.maximum(mask.sum(0), 1), mask)
  report = {"final_loss": float(loss), "seconds": time.time() - start, "frames": int(len(train_rows)),
            "held_out_layouts": int(len(np.unique(frames["layout"][rows]))),
            "held_out_xy_error_cm": {name: round(float(np.linalg.norm(error[i, :2])) * 100, 2)
                                     for i, name in enumerate(POINT_NAMES)},
            "held_out_offset_xy_error_cm": {name: round(float(np.linalg.norm(error[i, 3:5])) * 100, 2)
                                            for i, name in enumerate(POINT_NAMES)},
            # Close to the hand (within NEAR xy), where a grasp needs ~1 cm and the wrist camera sees it.
            "held_out_near_offset_xy_error_cm": _near_error(predicted, truth, valid[rows]),
            # What guessing each object's mean position would score: the errors' scale.
            "held_out_xy_spread_cm": {name: round(float(np.linalg.norm(spread[i, :2])) * 100, 2)
                                      for i, name in enumerate(POINT_NAMES)}}
  logging.info("vision pre-training: held-out world xy error (cm) %s", report["held_out_xy_error_cm"])
  weights = {name: jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(getattr(model, name), nnx.Param)))
             for name in ("vision", "connector")}
  return weights, report


def _masked_rms(diff: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """[N, P, 6] differences, [N, P, 1] mask -> per point and coordinate RMS over the masked frames."""
  return np.sqrt(np.where(mask, diff ** 2, 0).sum(0) / np.maximum(mask.sum(0), 1))


NEAR = 0.06  # metres


def _near_error(predicted: np.ndarray, truth: np.ndarray, valid: np.ndarray) -> dict[str, float | None]:
  """RMS xy error (cm) of the offset from the hand, over frames whose object is within NEAR of it."""
  from ejax.sim.layouts import POINT_NAMES
  near = valid & (np.linalg.norm(truth[..., 3:5], axis=-1) < NEAR)
  out = {}
  for i, name in enumerate(POINT_NAMES):
    err = predicted[near[:, i], i, 3:5] - truth[near[:, i], i, 3:5]
    out[name] = round(float(np.sqrt((err ** 2).sum(-1).mean())) * 100, 2) if len(err) else None
  return out


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
  out = {}
  for key, value in tree.items():
    path = f"{prefix}/{key}" if prefix else str(key)
    out.update(_flatten(value, path) if isinstance(value, dict) else {path: np.asarray(value)})
  return out


def _unflatten(flat) -> dict:
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    *parents, leaf = path.split("/")
    for key in parents:
      node = node.setdefault(int(key) if key.isdigit() else key, {})
    node[int(leaf) if leaf.isdigit() else leaf] = np.asarray(value)
  return tree


def cached_pretrain(model_config, tasks: str, image_size: tuple[int, int]) -> dict:
  """pretrain() once per settings, kept in the cache; -> {"vision": ..., "connector": ...}."""
  settings = model_config.vision_pretrain
  key = json.dumps([FORMAT, settings.to_dict(), tasks, list(image_size), model_config.vision.to_dict(),
                    model_config.connector.to_dict(), int(model_config.llm.width)], sort_keys=True, default=str)
  cache = os.path.join(os.path.expanduser(os.environ.get("EJAX_CACHE_DIR", "~/.cache/ejax")), "vision_pretrain")
  path = os.path.join(cache, hashlib.sha1(key.encode()).hexdigest()[:12] + ".npz")
  if os.path.exists(path):
    logging.info("vision pre-training: reusing %s", path)
    with np.load(path) as stored:
      return _unflatten({name: stored[name] for name in stored.files if name != "report"})
  logging.info("vision pre-training (once): %d layouts of %s, %d steps", int(settings.layouts),
               settings.tasks or tasks, int(settings.steps))
  weights, report = pretrain(model_config, settings, tasks, image_size)
  os.makedirs(cache, exist_ok=True)
  partial = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:6]}.npz"
  np.savez(partial, report=np.asarray(json.dumps(report)), **_flatten(weights))
  os.replace(partial, path)
  return weights


def load_into(state, weights: dict):
  """The train state with backbone/vision and backbone/connector replaced by `weights` (in whichever
  of params / frozen / ema_params holds them), each array on its leaf's sharding."""
  def replace(tree):
    if tree is None:
      return None
    pure = nnx.to_pure_dict(tree)
    backbone = pure.get("backbone", {})
    if not any(name in backbone for name in weights):
      return tree
    for name, value in weights.items():
      if name in backbone:
        backbone[name] = jax.tree.map(lambda old, new: jax.device_put(jnp.asarray(new, old.dtype), old.sharding),
                                      backbone[name], value)
    nnx.replace_by_pure_dict(tree, pure)
    return tree
  return state.replace(params=replace(state.params), frozen=replace(state.frozen),
                       ema_params=replace(state.ema_params))
