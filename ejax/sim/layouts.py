"""Rendered layouts with every object's position: data for pre-training a vision tower.

Why: a vision tower trained from scratch on a few hundred demonstrations memorises their layouts
instead of learning to find objects. Measured with the runlocal SigLIP tower regressing the green
block's position from both cameras (BENCHMARKS.md, closed-loop section): 0.1 cm on the training
layouts and 6.3 cm on unseen ones with 50 layouts, 3.3 cm with 150, 1.3 cm with 550. Expert
episodes cost a video encode each; a rendered frame costs ~1.5 ms, so thousands of layouts are
cheap.

What: fresh layouts of the given tasks, each stepped `steps_per_layout` times by the scripted
expert with a random hand move on `perturb_prob` of the steps, so that the wrist camera sees objects
from near and far. Every frame records both cameras and the positions of the seven things in the
scene (four objects, the drawer handle, the bowl, the plate: `POINT_NAMES`). Three blocks of one
colour (the spatial suite) cannot be told apart in an image, so their rows are masked out there.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import logging

from ejax.sim import control, registry
from ejax.sim import env as env_lib
from ejax.sim.batched import make_batched
from ejax.sim.demos import perturb, resolve_tasks

POINT_NAMES = ("block_0", "block_1", "block_2", "cylinder", "drawer_handle", "bowl", "plate")
_BLOCKS = slice(0, 3)


def render_layouts(tasks: str | list[str], num_layouts: int, *, steps_per_layout: int = 8,
                   image_size: tuple[int, int] = (64, 64), perturb_prob: float = 0.3, seed: int = 0,
                   num_envs: int = 60, backend: str = "native") -> dict[str, np.ndarray]:
  """-> {"observation.images.<camera>": uint8 [N, H, W, 3], "points": float32 [N, 7, 3] (world,
  metres), "valid": bool [N, 7], "tcp": float32 [N, 3], "layout": int32 [N]}, N = layouts x steps."""
  task_names = resolve_tasks(tasks) if isinstance(tasks, str) else list(tasks)
  num_envs = max(1, min(num_envs, num_layouts))
  env = make_batched(task_names, num_envs, backend=backend, cameras=True, image_size=tuple(image_size))
  same_colour = np.array([registry.get_spec(name).same_colour_blocks for name in env.env_tasks])
  noise_rng = np.random.default_rng(seed)
  frames: dict[str, list[np.ndarray]] = {}
  start, rounds = time.time(), -(-num_layouts // num_envs)
  for round_index in range(rounds):
    state = env.reset(jax.random.fold_in(jax.random.key(seed), round_index))
    for _ in range(steps_per_layout):
      obs = jax.device_get(state.obs)
      qpos, mocap = np.asarray(state.data["qpos"]), np.asarray(state.data["mocap_pos"])
      points = np.stack([np.concatenate([control.graspable_positions(qpos[i]), env_lib.fixture_positions(mocap[i])])
                         for i in range(env.num_envs)])
      valid = np.ones(points.shape[:2], bool)
      valid[same_colour, _BLOCKS] = False
      entry = {name: np.asarray(obs[name]) for name in obs if name.startswith("observation.images.")}
      entry.update(points=points.astype(np.float32), valid=valid,
                   tcp=np.stack([control.tcp_position(q) for q in qpos]).astype(np.float32),
                   layout=(round_index * env.num_envs + np.arange(env.num_envs)).astype(np.int32))
      for key, value in entry.items():
        frames.setdefault(key, []).append(value)
      state = env.step(state, perturb(env.expert_actions(state), noise_rng, 0.0, perturb_prob))
  out = {key: np.concatenate(values) for key, values in frames.items()}
  keep = out["layout"] < num_layouts
  logging.info("rendered %d layouts x %d steps of %s in %.0f s", num_layouts, steps_per_layout,
               "+".join(task_names), time.time() - start)
  return {key: value[keep] for key, value in out.items()}
