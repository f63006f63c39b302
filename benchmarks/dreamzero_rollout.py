"""What a DreamZero checkpoint's video prediction looks like in closed loop (issue 32, deliverable 5).

Runs the checkpoint's policy in ejax.sim on unseen layouts (the eval job's seed), one task an env. At each
replan the model samples chunk 0 from the current frame (as the eval job's policy does); this keeps the
chunk's predicted latent frames, executes the chunk's actions, then encodes the frames the simulator
really rendered with the same frozen VAE. Writes one PNG (rows: replans of the first env; columns: the
camera grid now | the grid after the chunk | its real latent | the predicted latent | |difference|; the
latents' first three channels as false colour, on one scale per row) and prints, over every env and
replan, the latent MSE of the prediction against that of "nothing moves" (the current frame's latent
as the guess) and how many episodes succeeded.

  python benchmarks/dreamzero_rollout.py --checkpoint=runs/dreamzero_runlocal/checkpoints \
      --out=runs/dreamzero_runlocal/rollout_predicted_vs_real.png
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image


def false_colour(latent: np.ndarray, low: np.ndarray, high: np.ndarray, size: int) -> np.ndarray:
  """[h, w, z] latent -> uint8 [size, size, 3] from its first three channels."""
  rgb = np.clip((latent[..., :3] - low) / np.maximum(high - low, 1e-6), 0, 1)
  return np.asarray(Image.fromarray((255 * rgb).astype(np.uint8)).resize((size, size), Image.NEAREST))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--out", required=True, help="the PNG to write")
  parser.add_argument("--tasks", default="", help="'+'-joined ejax.sim tasks (default: those it was trained on)")
  parser.add_argument("--seed", type=int, default=1234)
  parser.add_argument("--rows", type=int, default=6, help="replans of the first env shown")
  args = parser.parse_args()

  from ejax.data.dreamzero_samples import camera_grid
  from ejax.eval.evaluate import policy_observations
  from ejax.sim.batched import make_batched
  from ejax.train.policy import load_policy
  from ejax.train.state import model_parts

  policy = load_policy(args.checkpoint)
  config = policy.config
  model = nnx.merge(model_parts(config.model).graphdef, policy.model_state)
  lay = model.layout
  tasks = args.tasks.split("+") if args.tasks else policy.trained_tasks
  camera = policy.camera_size or (64, 64)
  env = make_batched(tasks, len(tasks), backend="native", cameras=True, image_size=camera)
  graphdef, state = nnx.split(model)

  @jax.jit
  def sample(state, batch, rng):
    return nnx.merge(graphdef, state).sample_chunk(batch, rng, chunk=0)

  @jax.jit
  def encode(state, video):
    return nnx.merge(graphdef, state).encode_video(video)

  grid_size = tuple(config.model.image_size)
  cameras = sorted(k for k in ("observation.images.agentview", "observation.images.wrist"))

  def grids(obs):
    return np.stack([camera_grid([np.asarray(obs[k][i]) for k in cameras], grid_size) for i in range(env.num_envs)])

  rng = jax.random.key(args.seed)
  sim = env.reset(rng)
  rows, errors, static_errors = [], [], []
  steps_per_chunk = lay.actions_per_chunk
  clip_frames = 1 + 4 * lay.frames_per_chunk            # the VAE's clip for one chunk
  for t in range(0, env.episode_length, steps_per_chunk):
    obs = policy_observations(sim, False)
    batch = policy.collate(policy._samples(obs, env.instructions))
    batch = {k: v for k, v in batch.items() if isinstance(v, np.ndarray) and v.dtype != object}
    actions, predicted = sample(state, batch, jax.random.fold_in(rng, t))
    actions = policy.env_actions(np.asarray(actions, np.float32))
    frames, alive = [grids(obs)], ~np.asarray(sim.done)
    for k in range(steps_per_chunk):
      sim = env.step(sim, actions[:, k])
      frames.append(grids(policy_observations(sim, False)))
    clip = np.stack(frames[:clip_frames], axis=1)          # [n, 1 + 4 * frames_per_chunk, H, W, 3]
    latents = np.asarray(encode(state, jnp.asarray(clip)))
    real, now, predicted = latents[:, 1:1 + lay.frames_per_chunk], latents[:, :1], np.asarray(predicted)
    for i in np.flatnonzero(alive):
      errors.append(float(np.mean((predicted[i] - real[i]) ** 2)))
      static_errors.append(float(np.mean((now[i] - real[i]) ** 2)))
    if alive[0] and len(rows) < args.rows:
      low, high = real[0, -1, ..., :3].min((0, 1)), real[0, -1, ..., :3].max((0, 1))
      size = grid_size[0]
      difference = np.abs(predicted[0, -1] - real[0, -1])
      rows.append(np.concatenate([frames[0][0], frames[-1][0], false_colour(real[0, -1], low, high, size),
                                  false_colour(predicted[0, -1], low, high, size),
                                  false_colour(difference, 0 * low, high - low, size)], axis=1))
    if np.asarray(sim.done).all():
      break
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  image = np.concatenate(rows, axis=0)
  Image.fromarray(image).resize((image.shape[1] * 3, image.shape[0] * 3), Image.NEAREST).save(args.out)
  success = np.asarray(sim.success)
  print(f"tasks {tasks}: {int(success.sum())}/{len(success)} succeeded; {len(errors)} chunk predictions: latent MSE "
        f"{np.mean(errors):.4f} (predicted) vs {np.mean(static_errors):.4f} (the current frame's latent, nothing moves); "
        f"image: {args.out} (first env: {env.instructions[0]!r}, rows = replans every {steps_per_chunk} steps)")


if __name__ == "__main__":
  main()
