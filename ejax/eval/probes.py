"""Does a policy look? Camera reliance on the expert's own states.

    reliance = camera_reliance(policy, env, jax.random.key(0), expert_steps=2)

Runs the scripted expert `expert_steps` steps from reset (so the states are ones the demonstrations
visit), then asks the policy for its first action twice with the same flow noise: once with each
env's own camera images, once with the images of another env of the same task (another layout,
same instruction and state). Per task it reports the mean absolute change of the hand move (x, y)
and, as the scale that change should reach, the expert's own spread of x, y moves over those envs.
A policy that finds its target in the images changes its move about as much as the expert's moves
differ; one that acts from proprioception and instruction alone does not change at all.

Found with it (2026-11-25, BENCHMARKS.md): the GR00T runlocal quickstart policies move their hand
0.00-0.10 when shown another layout, against an expert spread of ~0.6: they do not use the cameras
to choose where to go, which is why the lifts fail.
"""

from __future__ import annotations

import jax
import numpy as np

from ejax.train.policy import IMAGE_PREFIX


def _same_task_permutation(tasks: list[str]) -> np.ndarray:
  """Env i -> another env of the same task (a cyclic shift within each task; itself when alone)."""
  permutation = np.arange(len(tasks))
  for name in sorted(set(tasks)):
    members = np.flatnonzero(np.asarray(tasks) == name)
    permutation[members] = np.roll(members, 1)
  return permutation


def camera_reliance(policy, env, rng: jax.Array, *, expert_steps: int = 2) -> dict[str, dict[str, float]]:
  """-> {task: {"move_change": mean |d(x, y)| of the first action, "expert_spread": mean |x, y - mean|}}.

  `policy.act(obs, instructions, rng, noise=...)` as ejax.train.policy.CheckpointPolicy's; `env` a
  BatchedEnv with cameras and at least two envs per task."""
  state = env.reset(rng)
  for _ in range(expert_steps):
    state = env.step(state, env.expert_actions(state))
  obs = jax.device_get(state.obs)
  expert = env.expert_actions(state)
  noise = np.asarray(jax.random.normal(jax.random.fold_in(rng, 1), (env.num_envs, *policy.noise_shape)))
  key = jax.random.fold_in(rng, 2)
  own = policy.act(obs, env.instructions, key, noise=noise)
  permutation = _same_task_permutation(env.env_tasks)
  swapped = {k: (v[permutation] if k.startswith(IMAGE_PREFIX) else v) for k, v in obs.items()}
  other = policy.act(swapped, env.instructions, key, noise=noise)
  change = np.abs(own[:, 0, :2] - other[:, 0, :2]).mean(axis=1)
  result = {}
  for name in sorted(set(env.env_tasks)):
    members = np.flatnonzero(np.asarray(env.env_tasks) == name)
    moves = expert[members, :2]
    result[name] = {"move_change": float(change[members].mean()),
                    "expert_spread": float(np.abs(moves - moves.mean(axis=0)).mean())}
  return result
