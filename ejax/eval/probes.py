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

Where does a grasping policy go? Approach errors in closed loop:

    errors = approach_errors(policy, env, jax.random.key(0), replan_every=2)

Rolls the policy out like the eval job and, per task whose target is an object, reports how often
the hand, once down among the objects, came nearest the instructed object rather than another one,
and how close (x, y) it ever got to it. It separates "went to the wrong object" from "went to the
right one and missed by centimetres" (a grasp needs ~1.2 cm: expert.GRASP_TOLERANCE).
"""

from __future__ import annotations

import jax
import numpy as np

from ejax.eval.evaluate import rollout
from ejax.sim import control, scene
from ejax.train.policy import IMAGE_PREFIX

# The hand counts as down among the objects below this height above the tallest object's centre [m].
LOW_ABOVE_OBJECTS = 0.04


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


def approach_errors(policy, env, rng: jax.Array, *, replan_every: int = 2) -> dict[str, dict[str, float]]:
  """-> {task: {"success", "went_low", "nearest_is_target", "min_target_xy_cm" (median over episodes)}}
  for the tasks whose target is one of the four objects (drawer tasks are skipped).

  `policy.act(obs, instructions, rng)` -> chunks [num_envs, horizon, 4], as the eval job calls it;
  `env` a BatchedEnv (native or MJX) with whatever cameras the policy needs."""
  num_objects = len(scene.OBJECT_NAMES)
  nearest = np.full((env.num_envs, num_objects), np.inf)   # min x, y distance to each object while low
  min_target = np.full(env.num_envs, np.inf)
  target = np.zeros(env.num_envs, np.int64)

  def observe(state):
    live = ~np.asarray(state.done)
    data = state.data
    qpos = np.asarray(jax.device_get(data["qpos"] if isinstance(data, dict) else data.qpos))
    tcp = np.asarray(jax.device_get(state.info["privileged"]["tcp"]))
    objects = np.stack([control.graspable_positions(q)[:num_objects] for q in qpos])      # [n, 4, 3]
    distance = np.linalg.norm(objects[:, :, :2] - tcp[:, None, :2], axis=-1)
    low = live & (tcp[:, 2] < objects[:, :, 2].max(axis=1) + LOW_ABOVE_OBJECTS)
    nearest[...] = np.where(low[:, None], np.minimum(nearest, distance), nearest)
    target[...] = np.asarray(jax.device_get(state.info["target"]))
    own = distance[np.arange(env.num_envs), np.minimum(target, num_objects - 1)]
    min_target[...] = np.where(live & (target < num_objects), np.minimum(min_target, own), min_target)

  success, _, _ = rollout(env, policy, rng, replan_every, [], observe=observe)
  result = {}
  for name in sorted(set(env.env_tasks)):
    members = np.flatnonzero((np.asarray(env.env_tasks) == name) & (target < num_objects))
    if not members.size:
      continue
    went_low = np.isfinite(nearest[members]).any(axis=1)
    right = went_low & (nearest[members].argmin(axis=1) == target[members])
    result[name] = {"success": float(success[members].mean()), "went_low": float(went_low.mean()),
                    "nearest_is_target": float(right.mean()),
                    "min_target_xy_cm": float(100 * np.median(min_target[members]))}
  return result
