"""Job `demos`: record scripted-expert episodes into a LeRobot v3 dataset (the README's default data).

    python -m ejax.main --config=configs/demos.py:runlocal --workdir=runs/demos

Episodes run batched (all chosen tasks mixed in one program) with cameras on; each env's frames are
kept up to and including the step where it succeeded (or ran out of time). Per frame:
  observation.state [11] f32, observation.environment_state [7] f32 (target, goal, held: LeRobot's
  name for a scene's object state), observation.environment_pixels [8] f32 (where the target and its
  goal appear in each camera, ejax.sim.env), observation.images.agentview / .wrist [H, W, 3] (video),
  action [4] f32
(the action taken after seeing that observation). Failed expert episodes are dropped unless
config.demos.keep_failures; the job reports the expert's success rate either way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid

import jax
import numpy as np
from absl import logging
from ml_collections import ConfigDict

from ejax.errors import UserError
from ejax.sim import registry
from ejax.sim.batched import BACKENDS, make_batched
from ejax.sim.env import CAMERA_NAMES

STATE_NAMES = [*(f"joint{i + 1}" for i in range(7)), "gripper_opening", "tcp_x", "tcp_y", "tcp_z"]
ACTION_NAMES = ["dx", "dy", "dz", "gripper"]
CAMERAS = CAMERA_NAMES  # the scene's cameras, in the order the dataset records them
ROBOT_TYPE = "ejax_franka_like"
ENVIRONMENT_STATE_NAMES = ["target_x", "target_y", "target_z", "goal_x", "goal_y", "goal_z", "holding"]
ENVIRONMENT_PIXEL_NAMES = [f"{camera}_{point}_{axis}" for camera in CAMERAS for point in ("target", "goal")
                           for axis in "xy"]
RECORDED_OBSERVATIONS = ("observation.state", "observation.environment_state", "observation.environment_pixels",
                         *(f"observation.images.{camera}" for camera in CAMERAS))


class TaskError(UserError, ValueError):
  """A task list naming no ejax.sim task (a ValueError too, for library callers)."""


def resolve_tasks(tasks, setting: str | None = None) -> list[str]:
  """"all", a suite name, "name,name" or "name+name" (config arg strings split on commas), or a list.
  An unknown name is a TaskError; `setting` (e.g. "eval.tasks") names the config field in its message."""
  given = tasks
  if isinstance(tasks, str):
    if tasks == "all":
      return registry.list_tasks()
    if tasks in registry.list_suites():
      return registry.list_tasks(tasks)
    tasks = [name.strip() for name in tasks.replace("+", ",").split(",") if name.strip()]
  names = list(tasks)
  unknown = [name for name in names if name not in registry.list_tasks()]
  if unknown or (setting and not names):
    if setting is None:
      registry.get_spec(unknown[0])  # raises with the list of valid names
    raise TaskError(f"{setting}={given!r} names no ejax.sim task: use all, a suite "
                    f"({', '.join(registry.list_suites())}) or task names joined by '+' "
                    f"({', '.join(registry.list_tasks()[:3])}, ...)")
  return names


def dataset_features(image_size: tuple[int, int]) -> dict[str, dict]:
  height, width = image_size
  features = {f"observation.images.{camera}": {"dtype": "video", "shape": [height, width, 3],
                                              "names": ["height", "width", "channels"]} for camera in CAMERAS}
  features["observation.state"] = {"dtype": "float32", "shape": [len(STATE_NAMES)], "names": STATE_NAMES}
  features["observation.environment_state"] = {"dtype": "float32", "shape": [len(ENVIRONMENT_STATE_NAMES)],
                                               "names": ENVIRONMENT_STATE_NAMES}
  features["observation.environment_pixels"] = {"dtype": "float32", "shape": [len(ENVIRONMENT_PIXEL_NAMES)],
                                                "names": ENVIRONMENT_PIXEL_NAMES}
  features["action"] = {"dtype": "float32", "shape": [len(ACTION_NAMES)], "names": ACTION_NAMES}
  return features


def perturb(actions: np.ndarray, noise_rng: np.random.Generator, action_noise: float = 0.0,
            perturb_prob: float = 0.0) -> np.ndarray:
  """What a recording executes instead of the expert's actions [N, 4] (whose labels it keeps):
  Gaussian noise on every dimension (DART, Laskey et al. 2017), and/or, with probability
  `perturb_prob` per step and env, a uniformly random hand move in place of the expert's (the gripper
  command is kept). The second pushes the hand centimetres off the expert's path at any phase, so the
  recording shows how to correct an offset at every height; Gaussian noise large enough to do that
  (std >= 0.2) keeps the expert from ever aligning to its 8 mm tolerance."""
  executed = actions
  if action_noise > 0:
    executed = np.clip(executed + noise_rng.normal(0, action_noise, actions.shape), -1, 1)
  if perturb_prob > 0:
    moves = noise_rng.uniform(-1, 1, (actions.shape[0], 3))
    chosen = noise_rng.random(actions.shape[0]) < perturb_prob
    executed = np.concatenate([np.where(chosen[:, None], moves, executed[:, :3]), executed[:, 3:]], axis=1)
  return np.asarray(executed, np.float32)


# offset_start_prob: the step of the approach at which the random hand move is made.
OFFSET_START_STEPS = (1, 6)
MISS_STEPS = 4  # a missed grasp: two steps sliding sideways (4 cm each), two rising, the fingers closing


def record_round(env, rng: jax.Array, action_noise: float, noise_rng: np.random.Generator,
                 perturb_prob: float = 0.0, offset_start_prob: float = 0.0,
                 miss_grasp_prob: float = 0.0) -> list[dict]:
  """Run one batch of expert episodes; -> per env {"frames": {key: [T, ...]}, "success", "task"}.

  offset_start_prob: that fraction of episodes makes one random hand move during the approach and is
  recorded from the step after it, so it starts with the hand off the expert's path and shows the
  correction. Unlike perturb_prob, every recorded action chunk is then the expert's own continuation
  (a chunk that spans a random move holds the expert's reaction to a move no policy can foresee).

  miss_grasp_prob: that fraction of episodes misses its first grasp: when the expert first closes on
  the target, the hand instead slides sideways and rises (MISS_STEPS) while the fingers close on
  air, and the expert (stateless) opens, returns and grasps again. Every frame is recorded: a closed,
  empty gripper beside the object, which demonstrations without misses never show (a policy trained
  on those believes, after a missed grasp, that the object is in its hand; BENCHMARKS.md)."""
  state = env.reset(rng)
  frames: list[list[dict]] = [[] for _ in range(env.num_envs)]
  finished = np.zeros(env.num_envs, bool)
  offset_at = np.full(env.num_envs, -1)
  if offset_start_prob > 0:  # off: the noise stream, and so every other recording, stays as it was
    offset_at = np.where(noise_rng.random(env.num_envs) < offset_start_prob,
                         noise_rng.integers(*OFFSET_START_STEPS, size=env.num_envs), -1)
  to_miss, missing = np.zeros(env.num_envs, bool), np.zeros(env.num_envs, int)
  if miss_grasp_prob > 0:  # off: the noise stream stays as it was
    to_miss = noise_rng.random(env.num_envs) < miss_grasp_prob
    angle = noise_rng.uniform(0, 2 * np.pi, env.num_envs)
    slide = np.stack([np.cos(angle), np.sin(angle)], -1)
  for t in range(env.episode_length):
    actions = env.expert_actions(state)
    executed = np.array(perturb(actions, noise_rng, action_noise, perturb_prob))  # a copy: the labels stay
    if to_miss.any() or missing.any():
      holding = np.asarray(jax.device_get(state.info["privileged"]["holding"]), bool).reshape(-1)
      start = to_miss & (actions[:, 3] > 0) & ~holding & ~finished
      missing[start], to_miss[start] = MISS_STEPS, False
      sliding = missing > 0
      rising = sliding & (missing <= MISS_STEPS // 2)   # then up, as a policy that believes it holds it would
      executed[sliding, :2] = np.where(rising[sliding, None], 0.0, slide[sliding])
      executed[sliding, 2], executed[sliding, 3] = np.where(rising[sliding], 1.0, 0.0), 1.0
      missing[sliding] -= 1
    obs = jax.device_get(state.obs)
    for i in np.flatnonzero(~finished):
      frame = {key: np.asarray(obs[key][i]) for key in RECORDED_OBSERVATIONS}
      frame["action"] = actions[i]
      frames[i].append(frame)
    moved = np.flatnonzero((offset_at == t) & ~finished)
    executed[moved, :3] = noise_rng.uniform(-1, 1, (len(moved), 3))
    for i in moved:
      frames[i] = []  # the recording starts after the move
    state = env.step(state, executed)
    finished = np.asarray(state.done)
    if finished.all():
      break
  success = np.asarray(state.success)
  episodes = []
  for i in range(env.num_envs):
    if not frames[i]:  # ended on its random move: nothing to record
      continue
    stacked = {key: np.stack([frame[key] for frame in frames[i]]) for key in frames[i][0]}
    episodes.append({"frames": stacked, "success": bool(success[i]), "task": env.instructions[i],
                     "task_name": env.env_tasks[i]})
  return episodes


def record(cfg, root: str) -> dict:
  """Records cfg's episodes (a config.demos section) into a new LeRobot v3 dataset at `root`;
  -> a summary: episodes written and the expert's success rate per task."""
  task_names = resolve_tasks(cfg.tasks)
  image_size = (int(cfg.image_height), int(cfg.image_width))
  envs_per_task = max(1, min(int(cfg.num_envs) // len(task_names), int(cfg.episodes_per_task)))
  env = make_batched(task_names, envs_per_task * len(task_names), backend=cfg.backend, cameras=True,
                     image_size=image_size)
  from ejax.data.lerobot import LeRobotV3Writer  # here: its video encoder needs PyAV, which serving lacks
  writer = LeRobotV3Writer(root, fps=env.control_hz, features=dataset_features(image_size), robot_type=ROBOT_TYPE,
                           video_codec=cfg.video_codec, video_lossless=bool(cfg.get("video_lossless", False)))
  rounds = -(-int(cfg.episodes_per_task) // envs_per_task)
  written = {name: 0 for name in task_names}
  attempted = {name: 0 for name in task_names}
  succeeded = {name: 0 for name in task_names}
  noise_rng = np.random.default_rng(int(cfg.seed))
  start = time.time()
  for round_index in range(rounds):
    for episode in record_round(env, jax.random.fold_in(jax.random.key(int(cfg.seed)), round_index),
                                float(cfg.action_noise), noise_rng, float(cfg.get("perturb_prob", 0.0)),
                                float(cfg.get("offset_start_prob", 0.0)), float(cfg.get("miss_grasp_prob", 0.0))):
      name = episode["task_name"]
      if attempted[name] >= cfg.episodes_per_task:
        continue
      attempted[name] += 1
      succeeded[name] += episode["success"]
      if episode["success"] or cfg.keep_failures:
        writer.add_episode(episode["frames"], task=episode["task"])
        written[name] += 1
    logging.info("demos: round %d/%d, %d episodes written, %.0f s", round_index + 1, rounds,
                 sum(written.values()), time.time() - start)
  writer.finalize()
  logging.info("demos: wrote %d episodes to %s", sum(written.values()), root)
  return {"root": root, "episodes_written": written, "expert_success_rate":
          {name: succeeded[name] / max(attempted[name], 1) for name in task_names},
          "image_size": list(image_size), "fps": env.control_hz, "seconds": time.time() - start}


def check_config(config, root: str) -> None:
  """The demos job's settings, checked before it builds a simulator: one line naming the setting and
  the fix (ejax.main prints it)."""
  from ejax.config.validate import ConfigError, require_one_of, require_positive, require_section
  cfg = require_section(config, "demos", "configs/demos.py")
  resolve_tasks(cfg.tasks, setting="demos.tasks")
  require_one_of("demos.backend", cfg.backend, BACKENDS)
  require_positive(cfg, "demos", "episodes_per_task", "num_envs", "image_height", "image_width")
  if os.path.exists(os.path.join(root, "meta", "info.json")):
    raise ConfigError(f"{root} already holds a LeRobot dataset: pass another --workdir or --config.demos.output_dir "
                      "(recording never overwrites one)")


def run_job(config, workdir: str) -> None:
  root = config.demos.output_dir or os.path.join(workdir, "dataset")
  check_config(config, root)
  summary = record(config.demos, root)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "demos_summary.json"), "w") as f:
    json.dump(summary, f, indent=2)


# Bump when what a recording holds changes (features, tasks, expert, physics), so stale caches are not
# reused. 2: the dynamic hand with contact grasps replaced the kinematic hand with attachment grasps.
# 3: the wrist camera re-aimed so that the object between the fingers sits mid-image (it was cut off
# at the bottom edge). 4: observation.environment_pixels (keypoint labels).
RECORDING_FORMAT = 4
LATER_OPTIONS = {"miss_grasp_prob": 0.0}


def settings_digest(settings) -> str:
  """What names a recording in the cache: the format, the task list and the settings; options added
  since the cache began (LATER_OPTIONS), at their defaults, leave the name as it was."""
  kept = {key: settings[key] for key in sorted(settings) if key != "output_dir"
          and not (key in LATER_OPTIONS and settings[key] == LATER_OPTIONS[key])}
  return hashlib.sha1(json.dumps([RECORDING_FORMAT, registry.list_tasks(), kept],
                                 sort_keys=True, default=str).encode()).hexdigest()[:10]


def cached_dataset(settings, path: str | None = None) -> str:
  """The LeRobot dataset that `settings` (a config.demos section) record, recorded on first use.

  At `path`, or else under $EJAX_CACHE_DIR (default ~/.cache/ejax)/sim_demos/ in a directory named
  by the settings. A recording goes to a temporary sibling that is renamed into place only once it
  is complete: an interrupted run never leaves something that looks like a dataset, and processes
  recording the same dataset at once (several hosts on one filesystem) cannot clash; the first
  rename wins and the others drop their copy.
  """
  settings = {key: settings[key] for key in sorted(settings.keys()) if key != "output_dir"}
  if not path:
    digest = settings_digest(settings)
    name = (f"{str(settings['tasks']).replace(',', '+')}-{settings['episodes_per_task']}ep-"
            f"{settings['image_height']}x{settings['image_width']}-seed{settings['seed']}-{digest}")
    cache = os.path.expanduser(os.environ.get("EJAX_CACHE_DIR", "~/.cache/ejax"))
    path = os.path.join(cache, "sim_demos", name)
  if os.path.exists(os.path.join(path, "meta", "info.json")):
    return path
  if os.path.exists(path) and os.listdir(path):
    raise UserError(f"{path} exists but holds no LeRobot dataset (no meta/info.json): remove it, or point "
                          f"data.path elsewhere to record the simulated demonstrations there")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  partial = f"{path}.recording-{os.getpid()}-{uuid.uuid4().hex[:6]}"
  logging.info("recording simulated demonstrations (once) to %s: %s", path, settings)
  try:
    record(ConfigDict(settings), partial)
    if os.path.isdir(path) and not os.listdir(path):
      os.rmdir(path)
    os.rename(partial, path)
  except OSError:
    if not os.path.exists(os.path.join(path, "meta", "info.json")):
      raise
    logging.info("another process recorded %s first; using its copy", path)
  finally:
    shutil.rmtree(partial, ignore_errors=True)
  return path
