"""Where do instruction-chosen heatmap detectors put each task's target and goal? A standalone probe.

    python benchmarks/heatmap_probe.py DATASET [--context=2 --dilation=2 --position --steps=1200]
    python benchmarks/heatmap_probe.py DATASET --context=2 --dilation=2 --position --position-scale=40 \
        --tasks='the block ' --stride=1      # the spatial suite's five tasks, every frame
    ... --corner                          # + the running max of the features in four directions

DATASET: a recorded ejax.sim demo set with keypoint labels (observation.environment_pixels), e.g.
$EJAX_CACHE_DIR/sim_demos/all-60ep-64x64-seed0-<hash> (recorded by configs/groot.py:suites on first
use). The detectors are GR00T's (ejax/models/perception/, model.perception.detectors): one dense layer over each 2x2-pixel
patch of the 64 px frames, optional residual 3x3 convolutions over the patch grid (the first plain, the
later ones dilated: detectors.context_layers, context_dilation), and per task two
detector queries (target, goal) plus an optional learnt position term (detectors.position_scale).
Here the query is a per-task embedding (the model reads it from the instruction), trained alone by
the same cross-entropy against the labels, batch 32, on every second frame of 5/6 of the episodes.
Prints, per camera and task, the median error in 64 px image pixels on the held-out episodes (soft-argmax,
as the action head reads it, and argmax) and the fraction of frames whose argmax is > 4 px off, of
all frames and of the episodes' first frames (before the arm moves: the spatial suite's choice of block).
Every frame of the 15-task set is ~10 k frames (~1 min to decode); ~2-4 min of training on 2 cores.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ejax.data.lerobot import LeRobotSource
from ejax.models.perception.keypoints import heatmap_loss, pixel_grid
from ejax.models.siglip import patchify

POSITION_SCALE = 10.0   # the position term's gain before the suites recipe raised it to 40


def load(root: str, stride: int):
  src = LeRobotSource(root, horizon=1, raw_keys=["observation.environment_pixels"])
  frames = [src[int(i)] for i in range(0, len(src), stride)]
  tasks = sorted({f["task"] for f in frames})
  cams = [np.stack([f[k] for f in frames]) for k in ("observation.images.agentview", "observation.images.wrist")]
  pixels = np.stack([f["observation.environment_pixels"] for f in frames])
  return (cams, pixels, np.array([f["episode_index"] for f in frames]),
          np.array([tasks.index(f["task"]) for f in frames]), tasks, np.array([f["frame_index"] for f in frames]))


def directional_max(grid):
  """[n, h, w, d] -> [n, h, w, 4 d]: per cell, the max of each feature over the cells strictly to its
  left, right, above and below (-1 where there are none): what a cell cannot see through a few 3x3
  convolutions, e.g. whether another block of its colour lies anywhere to its left (CornerNet's corner
  pooling, in four directions)."""
  out = []
  for axis in (2, 1):
    for reverse in (False, True):
      running = jax.lax.cummax(grid, axis=axis, reverse=reverse)
      pad = jnp.full_like(jax.lax.slice_in_dim(grid, 0, 1, axis=axis), -1.0)
      if reverse:
        out.append(jnp.concatenate([jax.lax.slice_in_dim(running, 1, None, axis=axis), pad], axis))
      else:
        out.append(jnp.concatenate([pad, jax.lax.slice_in_dim(running, 0, -1, axis=axis)], axis))
  return jnp.concatenate(out, -1)


class Detectors(nnx.Module):
  def __init__(self, num_tasks: int, cameras: int, context: int, dilation: int, position: bool, rngs: nnx.Rngs,
               hidden: int = 32, separable: bool = False, position_scale: float = POSITION_SCALE,
               target_local: bool = False, corner: bool = False):
    self.hidden = hidden
    # corner: each cell also reads the running max of the features in each of the four directions
    # (what is to my left / right / above / below: "the leftmost block" is a block with none of its
    # colour to its left), mixed back by a dense layer, residual
    self.corner = nnx.data(nnx.Linear(4 * hidden, hidden, rngs=rngs) if corner else None)
    self.target_local = target_local
    self.position_scale = position_scale
    self.features = nnx.Linear(12, hidden, rngs=rngs)
    # separable: each 3x3 convolution per channel, then a 1x1 mixing the channels (~7x fewer FLOPs)
    self.context = nnx.List([nnx.Conv(hidden, hidden, (3, 3), kernel_dilation=(dilation if i else 1,) * 2,
                                      feature_group_count=hidden if separable else 1, rngs=rngs)
                             for i in range(context)])
    self.mix = nnx.List([nnx.Linear(hidden, hidden, rngs=rngs) for _ in range(context if separable else 0)])
    self.queries = nnx.Embed(num_tasks, 2 * hidden, rngs=rngs)
    self.position = nnx.data(nnx.Embed(num_tasks, cameras * 2 * 2, embedding_init=nnx.initializers.zeros, rngs=rngs)
                             if position else None)
    self.cameras = cameras

  def __call__(self, images, task, camera: int):
    x = jax.nn.gelu(self.features(patchify(images.astype(jnp.float32) / 127.5 - 1, 2)))
    n, cells, _ = x.shape
    side = int(round(cells ** 0.5))
    local = x
    if len(self.context):
      grid = x.reshape(n, side, side, self.hidden)
      for i, conv in enumerate(self.context):
        grid = grid + jax.nn.gelu(self.mix[i](conv(grid)) if len(self.mix) else conv(grid))
      x = grid.reshape(n, cells, self.hidden)
    if self.corner is not None:
      grid = x.reshape(n, side, side, self.hidden)
      x = x + jax.nn.gelu(self.corner(directional_max(grid).reshape(n, cells, 4 * self.hidden)))
    queries = self.queries(task).reshape(n, 2, self.hidden)
    logits = jnp.einsum("nph,nqh->npq", x, queries)
    if self.target_local:  # the target's detector reads each patch alone: three identical blocks look alike
      logits = logits.at[..., 0].set(jnp.einsum("nph,nh->np", local, queries[:, 0]))
    if self.position is not None:
      w = self.position(task).reshape(n, self.cameras, 2, 2)[:, camera]
      logits = logits + self.position_scale * jnp.einsum("pd,nqd->npq", jnp.asarray(pixel_grid(side, side)), w)
    return logits


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("dataset")
  parser.add_argument("--context", type=int, default=0, help="residual 3x3 convolutions over the patch grid")
  parser.add_argument("--dilation", type=int, default=1, help="dilation of the convolutions after the first")
  parser.add_argument("--position", action="store_true", help="the learnt position term")
  parser.add_argument("--separable", action="store_true", help="depthwise 3x3 + 1x1 context convolutions")
  parser.add_argument("--position-scale", type=float, default=POSITION_SCALE, help="the position term's gain")
  parser.add_argument("--target-local", action="store_true",
                      help="the target's detector reads the patch features before the context convolutions")
  parser.add_argument("--corner", action="store_true", help="directional max features after the context convolutions")
  parser.add_argument("--tasks", default="", help="substrings of the instructions to keep, |-separated (e.g. 'the block |left')")
  parser.add_argument("--steps", type=int, default=1200)
  parser.add_argument("--cameras", type=int, default=2, help="1: the agentview only")
  parser.add_argument("--stride", type=int, default=2, help="every N-th frame")
  args = parser.parse_args()
  cams, pixels, episodes, task, names, frame = load(args.dataset, args.stride)
  if args.tasks:
    keep = np.array([any(part in names[t] for part in args.tasks.split("|")) for t in task])
    cams, pixels, episodes, task, frame = [c[keep] for c in cams], pixels[keep], episodes[keep], task[keep], frame[keep]
  cams = cams[:args.cameras]
  rng = np.random.default_rng(0)
  held = rng.choice(np.unique(episodes), len(np.unique(episodes)) // 6, replace=False)
  test = np.isin(episodes, held)
  model = Detectors(len(names), args.cameras, args.context, args.dilation, args.position, nnx.Rngs(0),
                    separable=args.separable, position_scale=args.position_scale, target_local=args.target_local, corner=args.corner)
  opt = nnx.Optimizer(model, optax.adam(optax.warmup_cosine_decay_schedule(0, 3e-3, 50, args.steps)), wrt=nnx.Param)
  side = cams[0].shape[1] // 2

  def loss_fn(m, images, t, labels):
    total = 0.0
    for c, im in enumerate(images):
      loss, seen = heatmap_loss(m(im, t, c), labels[:, 4 * c:4 * c + 4].reshape(-1, 2, 2), (side, side))
      total = total + jnp.sum(loss) / jnp.maximum(jnp.sum(seen), 1)
    return total

  @nnx.jit
  def step(m, opt, images, t, labels):
    loss, grads = nnx.value_and_grad(loss_fn)(m, images, t, labels)
    opt.update(m, grads)
    return loss

  train = np.flatnonzero(~test)
  start = time.time()
  for i in range(args.steps):
    b = rng.choice(train, 32)
    loss = step(model, opt, [c[b] for c in cams], task[b], pixels[b])
    if i % 200 == 0 or i == args.steps - 1:
      print(f"step {i} loss {float(loss):.3f} ({time.time() - start:.0f} s)", flush=True)

  grid = jnp.asarray(pixel_grid(side, side))

  @nnx.jit
  def predict(m, images, t, camera):
    logits = m(images, t, camera)
    return jnp.einsum("npq,pd->nqd", jax.nn.softmax(logits, axis=1), grid), grid[jnp.argmax(logits, axis=1)]

  index = np.flatnonzero(test)
  print(vars(args))
  for c, images in enumerate(cams):
    out = [predict(model, images[index[j:j + 512]], task[index[j:j + 512]], c) for j in range(0, len(index), 512)]
    soft, hard = (np.concatenate(z) for z in zip(*out))
    labels = pixels[index, 4 * c:4 * c + 4].reshape(-1, 2, 2)
    seen = np.all(np.abs(labels) < 1, -1)
    px = cams[0].shape[1] / 2   # [-1, 1] -> image pixels
    soft_err, hard_err = (np.linalg.norm(z - labels, axis=-1) * px for z in (soft, hard))
    print(f"{('agentview', 'wrist')[c]}: median px error, soft-argmax (target goal) / argmax (target goal); "
          "argmax > 4 px (target goal); on the first frame")
    for t, name in enumerate(names):
      m = task[index] == t
      if not np.any(m):  # left out by --tasks
        continue
      med = [np.median(e[m & seen[:, q], q]) if np.any(m & seen[:, q]) else np.nan
             for e in (soft_err, hard_err) for q in (0, 1)]
      far = [np.mean(hard_err[m & seen[:, q] & first, q] > 4) if np.any(m & seen[:, q] & first) else np.nan
             for first in (True, frame[index] == 0) for q in (0, 1)]
      print(f"  {name[:52]:52s} {med[0]:5.1f} {med[1]:5.1f} / {med[2]:5.1f} {med[3]:5.1f}   {far[0]:.2f} {far[1]:.2f}"
            f"; {far[2]:.2f} {far[3]:.2f}")


if __name__ == "__main__":
  main()
