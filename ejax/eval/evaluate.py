"""Job `eval`: closed-loop evaluation of a policy over tasks and seeds, batched in simulation.

    python -m ejax.main --config=configs/eval.py:runlocal --workdir=runs/eval_local \
        --config.eval.policy=checkpoint --config.eval.checkpoint=runs/groot_local/checkpoints

A policy served by job `serve` (ejax/serve) evaluates the same way with
--config.eval.policy=remote --config.eval.address=HOST:PORT: same episodes, same actions.

Writes into <workdir>/eval (or config.eval.output_dir):
  summary.json  per-task episodes, successes, success rate, 95 % Wilson interval; per suite; overall
  summary.txt   the same as a text table
  success.png   bar plot with the intervals
  videos/<task>_<k>.mp4  the first config.eval.videos_per_task episodes of each task (agentview | wrist)
With --config.metrics.wandb=True the table, the success rates, the plot and the videos also go to the
launch's Weights & Biases run (log_to_wandb).
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import logging

from ejax.config.validate import ConfigError, require_one_of, require_path, require_positive, require_section
from ejax.eval import plots, stats, videos
from ejax.eval.policies import PRIVILEGED_PREFIX, ExpertPolicy, RandomPolicy
from ejax.sim import registry
from ejax.sim.batched import BACKENDS, BatchedEnv, make_batched
from ejax.sim.demos import resolve_tasks
from ejax.train import wandb_run

POLICIES = ("random", "expert", "checkpoint", "rl", "remote")
KEYPOINT_GEOMETRY = ("checkpoint", "sim", "off")


def check_config(config) -> None:
  """Every setting the eval job needs, checked before it loads a policy or builds a simulator: one
  line naming the setting and the fix (ejax.main prints it)."""
  cfg = require_section(config, "eval", "configs/eval.py")
  require_one_of("eval.policy", cfg.policy, POLICIES)
  require_one_of("eval.backend", cfg.backend, BACKENDS)
  require_one_of("eval.keypoint_geometry", cfg.get("keypoint_geometry", "checkpoint"), KEYPOINT_GEOMETRY)
  require_positive(cfg, "eval", "episodes_per_task", "num_envs", "replan_every")
  if cfg.tasks:
    resolve_tasks(cfg.tasks, setting="eval.tasks")
  if cfg.policy == "remote" and not cfg.address:
    raise ConfigError("eval.policy='remote' needs --config.eval.address=<host:port of a serve job> "
                      "(README \"Deploy\")")
  if cfg.policy in ("checkpoint", "rl"):
    _check_checkpoint(cfg.policy, cfg.checkpoint)


def _check_checkpoint(policy: str, checkpoint: str) -> None:
  """eval.checkpoint holds what eval.policy loads: a train job's checkpoints (checkpoint) or an rl job's
  rl_checkpoints (rl), told apart on disk as the serve job does."""
  from ejax.checkpoint.kinds import IMPORTED, RL, TRAIN, checkpoint_kind
  wanted, other = (TRAIN, RL) if policy == "checkpoint" else (RL, TRAIN)
  folder = {TRAIN: "checkpoints", RL: "rl_checkpoints"}
  what = {TRAIN: "a train job's <workdir>/checkpoints", RL: "an rl job's <workdir>/rl_checkpoints"}
  path = require_path("eval.checkpoint", checkpoint, what[wanted] + f" (eval.policy={policy!r})")
  kind = checkpoint_kind(path)
  if kind == wanted == TRAIN:
    _check_trained_for_the_simulator(checkpoint, path)
  if kind == wanted:
    return
  setting = f"eval.checkpoint={checkpoint!r}"
  if kind == other:
    right = "checkpoint" if other == TRAIN else "rl"
    raise ConfigError(f"{setting} is {what[other]}, not {what[wanted]}: evaluate it with "
                      f"--config.eval.policy={right}")
  if kind == IMPORTED:
    raise ConfigError(f"{setting} holds weights imported by the convert job, without the data config and statistics "
                      "a policy acts with: serve them (job serve with data.stats_path, README \"Deploy\") and evaluate "
                      "with --config.eval.policy=remote")
  if checkpoint_kind(os.path.join(path, folder[wanted])) == wanted:
    raise ConfigError(f"{setting} is a workdir: point it at {os.path.join(checkpoint, folder[wanted])}")
  raise ConfigError(f"{setting} holds no checkpoint: point it at {what[wanted]} (eval.policy={policy!r})")


def _check_trained_for_the_simulator(checkpoint: str, path: str) -> None:
  """A train checkpoint acts in ejax.sim only when it learnt from observations the simulator makes (its
  recorded demonstrations, or a LeRobot / RLDS dataset of them): not from synthetic data."""
  from ejax.checkpoint.kinds import saved_config
  saved = saved_config(path)
  data, model = saved.get("data") or {}, (saved.get("model") or {}).get("name")
  if data.get("name") == "synthetic":
    raise ConfigError(f"eval.checkpoint={checkpoint!r} holds a {model!r} model trained on synthetic data "
                      "(data.name='synthetic'), whose observations no simulator task makes: evaluate a checkpoint "
                      "trained on ejax.sim's demonstrations (configs/groot.py:runlocal, README \"Configs and jobs\")")


def make_policy(config, action_size: int):
  kind = config.eval.policy
  if kind == "random":
    return RandomPolicy(action_size, horizon=int(config.eval.replan_every))
  if kind == "expert":
    return ExpertPolicy()
  if kind == "checkpoint":
    if not config.eval.checkpoint:
      raise ConfigError("config.eval.policy='checkpoint' needs --config.eval.checkpoint=<checkpoint dir>")
    from ejax.train.policy import load_policy
    from ejax.sim.scene import camera_calibration
    choices = {"checkpoint": None, "sim": camera_calibration(), "off": False}
    geometry = config.eval.get("keypoint_geometry", "checkpoint")
    if geometry not in choices:
      raise ConfigError(f"config.eval.keypoint_geometry={geometry!r}: use checkpoint, sim or off")
    policy = load_policy(config.eval.checkpoint, geometry=choices[geometry],
                         num_inference_steps=int(config.eval.get("num_inference_steps", 0)))
    if config.eval.get("true_estimate", False):
      try:
        policy.use_true_estimate()
      except ValueError as error:
        raise ConfigError(f"{error}: unset eval.true_estimate for this checkpoint") from None
    return policy
  if kind == "rl":
    if not config.eval.checkpoint:
      raise ConfigError("config.eval.policy='rl' needs --config.eval.checkpoint=<workdir of the rl job>/rl_checkpoints")
    from ejax.rl.build import load_rl_policy
    return load_rl_policy(config.eval.checkpoint, version=config.eval.get("version", -1))
  if kind == "remote":
    from ejax.serve.client import RemotePolicy
    return RemotePolicy(config.eval.address, api_key=config.eval.api_key,
                        connections=int(config.eval.remote_connections))
  raise ConfigError(f"unknown config.eval.policy {kind!r}: use random, expert, checkpoint, rl or remote")


def policy_observations(state, uses_privileged_state: bool) -> dict[str, np.ndarray]:
  obs = {key: np.asarray(value) for key, value in jax.device_get(state.obs).items()}
  if uses_privileged_state:
    for key, value in jax.device_get(state.info["privileged"]).items():
      obs[PRIVILEGED_PREFIX + key] = np.asarray(value)
  return obs


def rollout(env, policy, rng: jax.Array, replan_every: int, video_envs: list[int],
            observe=None) -> tuple[np.ndarray, np.ndarray, dict]:
  """One batch of episodes. -> (success [N] bool, episode length [N], {env index: frames [T, H, 2W, 3]}).

  The layouts come from env.reset(rng), exactly as ejax.sim.demos records a round: with the same
  seed, tasks and number of envs, evaluation replays the recorded layouts (the oracle and overfit
  diagnostics rely on it; the default eval seed differs from the demos' so layouts are unseen).
  `observe(state)`, if given, sees every state an action is taken from (probes measure with it)."""
  state = env.reset(rng)
  frames = {i: [] for i in video_envs}
  lengths = np.full(env.num_envs, env.episode_length)
  unstable = np.zeros(env.num_envs, bool)
  chunk, position = None, 0
  for t in range(env.episode_length):
    if chunk is None or position >= min(replan_every, chunk.shape[1]):
      obs = policy_observations(state, getattr(policy, "uses_privileged_state", False))
      chunk = np.asarray(policy.act(obs, env.instructions, jax.random.fold_in(rng, t + 1)), np.float32)
      if chunk.ndim != 3 or chunk.shape[0] != env.num_envs or chunk.shape[2] != env.action_size:
        raise ValueError(f"policy.act returned {chunk.shape}; expected [num_envs={env.num_envs}, horizon, "
                         f"action_dim={env.action_size}]")
      position = 0
    if observe is not None:
      observe(state)
    done_before = np.asarray(state.done)
    for i in video_envs:
      if not done_before[i]:
        frames[i].append(np.concatenate([np.asarray(state.obs["observation.images.agentview"][i]),
                                         np.asarray(state.obs["observation.images.wrist"][i])], axis=1))
    state = env.step(state, chunk[:, position])
    position += 1
    done = np.asarray(state.done)
    lengths = np.where(done & ~done_before, t + 1, lengths)
    unstable |= done & ~done_before & (np.asarray(state.metrics["unstable"]) > 0)
    if done.all():
      break
  if unstable.any():  # the backends end such an episode on the state before the step (ejax.sim.env.assess)
    logging.warning("eval: %d of %d episodes ended when their physics diverged (tasks %s); counted as failures",
                    unstable.sum(), env.num_envs, sorted({env.env_tasks[i] for i in np.flatnonzero(unstable)}))
  return np.asarray(state.success), lengths, {i: np.stack(f) for i, f in frames.items() if f}


def summary_rows(task_names: list[str], successes: dict, trials: dict) -> list[dict]:
  rows = []
  for name in task_names:
    low, high = stats.wilson_interval(successes[name], trials[name])
    spec = registry.get_spec(name)
    rows.append({"task": name, "suite": spec.suite, "instruction": spec.instruction, "episodes": trials[name],
                 "successes": successes[name], "success_rate": successes[name] / max(trials[name], 1),
                 "ci_low": low, "ci_high": high})
  return rows


def aggregate(rows: list[dict], label: str) -> dict:
  successes, episodes = sum(r["successes"] for r in rows), sum(r["episodes"] for r in rows)
  low, high = stats.wilson_interval(successes, episodes)
  return {"task": label, "episodes": episodes, "successes": successes,
          "success_rate": successes / max(episodes, 1), "ci_low": low, "ci_high": high}


def format_table(rows: list[dict], groups: list[dict]) -> str:
  lines = [f"{'task':<34} {'episodes':>8} {'success':>8} {'95% CI':>15}"]
  for row in rows + groups:
    lines.append(f"{row['task']:<34} {row['episodes']:>8} {row['success_rate']:>8.3f} "
                 f"  [{row['ci_low']:.3f}, {row['ci_high']:.3f}]")
  return "\n".join(lines)


def evaluate_policy(policy, cfg, output_dir: str, label: str) -> dict:
  """Runs `policy` over cfg.tasks x cfg.episodes_per_task in simulation and writes the summary, table,
  plot and videos into output_dir. -> the summary dict (also summary.json)."""
  task_names = resolve_tasks(cfg.tasks)
  envs_per_task = max(1, min(int(cfg.num_envs) // len(task_names), int(cfg.episodes_per_task)))
  env = make_batched(task_names, envs_per_task * len(task_names), backend=cfg.backend, cameras=True,
                     image_size=(int(cfg.image_height), int(cfg.image_width)),
                     episode_length=int(cfg.episode_length) or None)
  os.makedirs(os.path.join(output_dir, "videos"), exist_ok=True)
  successes = {name: 0 for name in task_names}
  trials = {name: 0 for name in task_names}
  videos_per_task = min(int(cfg.videos_per_task), envs_per_task)
  rounds = -(-int(cfg.episodes_per_task) // envs_per_task)
  start = time.time()
  for round_index in range(rounds):
    video_envs = list(range(len(task_names) * videos_per_task)) if round_index == 0 else []
    rng = jax.random.fold_in(jax.random.key(int(cfg.seed)), round_index)
    success, _, frames = rollout(env, policy, rng, int(cfg.replan_every), video_envs)
    for i, name in enumerate(env.env_tasks):
      if trials[name] < cfg.episodes_per_task:
        trials[name] += 1
        successes[name] += int(success[i])
    for i, clip in frames.items():
      videos.write_mp4(os.path.join(output_dir, "videos", f"{env.env_tasks[i]}_{i // len(task_names)}.mp4"),
                       clip, env.control_hz)
    logging.info("eval: round %d/%d done, %.0f s", round_index + 1, rounds, time.time() - start)
  rows = summary_rows(task_names, successes, trials)
  suites = sorted({row["suite"] for row in rows})
  groups = [aggregate([r for r in rows if r["suite"] == suite], f"suite:{suite}") for suite in suites]
  groups.append(aggregate(rows, "overall"))
  summary = {"policy": label, "checkpoint": cfg.get("checkpoint", ""), "backend": cfg.backend,
             "replan_every": int(cfg.replan_every), "tasks": rows, "suites": groups[:-1], "overall": groups[-1],
             "seconds": time.time() - start}
  with open(os.path.join(output_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  table = format_table(rows, groups)
  with open(os.path.join(output_dir, "summary.txt"), "w") as f:
    f.write(table + "\n")
  plots.success_bar_plot(os.path.join(output_dir, "success.png"), rows,
                         f"{label} policy: overall {groups[-1]['success_rate']:.2f}")
  logging.info("eval (%s):\n%s", label, table)
  log_to_wandb(summary, output_dir)
  return dict(summary, table=table)


TABLE_COLUMNS = ("task", "suite", "episodes", "successes", "success_rate", "ci_low", "ci_high")


def log_to_wandb(summary: dict, output_dir: str) -> None:
  """The success table (tasks, suites, overall), the success rates as scalars, the plot and the videos, into
  the launch's W&B run when config.metrics.wandb is on, under the output folder's name ("eval", or
  the rl job's "eval_before" / "eval_after")."""
  run = wandb_run.active_run()
  if run is None:
    return
  import wandb
  prefix = os.path.basename(os.path.normpath(output_dir))
  rows = summary["tasks"] + summary["suites"] + [summary["overall"]]
  values = {f"{prefix}/success": wandb.Table(columns=list(TABLE_COLUMNS),
                                             data=[[row.get(column, "") for column in TABLE_COLUMNS] for row in rows])}
  for row in rows:
    values[f"{prefix}/success_rate/{row['task']}"] = row["success_rate"]
  plot = os.path.join(output_dir, "success.png")
  if os.path.isfile(plot):
    values[f"{prefix}/success_plot"] = wandb.Image(plot)
  video_dir = os.path.join(output_dir, "videos")
  for name in sorted(os.listdir(video_dir)) if os.path.isdir(video_dir) else []:
    if name.endswith(".mp4"):
      values[f"{prefix}/videos/{name[:-4]}"] = wandb.Video(os.path.join(video_dir, name), caption=name[:-4])
  run.log(values)


def resolve_defaults(cfg, policy):
  """cfg with its "from the checkpoint" settings filled in: tasks "" -> the tasks the policy was
  trained on (a train-job checkpoint's saved data config; all tasks otherwise), image size 0 -> the
  camera size it was trained at (128 otherwise)."""
  cfg = cfg.copy_and_resolve_references()
  if not cfg.tasks:
    trained = getattr(policy, "trained_tasks", None)
    cfg.tasks = "+".join(trained) if trained else "all"
  size = getattr(policy, "camera_size", None) or (128, 128)
  if not cfg.image_height:
    cfg.image_height = size[0]
  if not cfg.image_width:
    cfg.image_width = size[1]
  return cfg


def run_job(config, workdir: str) -> None:
  check_config(config)
  policy = make_policy(config, BatchedEnv.action_size)
  cfg = resolve_defaults(config.eval, policy)
  label = cfg.policy + (" (true estimate)" if cfg.get("true_estimate", False) else "")
  if cfg.policy == "checkpoint" and cfg.get("keypoint_geometry", "checkpoint") != "checkpoint":
    label += f" (keypoint geometry: {cfg.keypoint_geometry})"
  if cfg.policy == "checkpoint" and int(cfg.get("num_inference_steps", 0)):
    label += f" ({int(cfg.num_inference_steps)} flow steps)"
  print(evaluate_policy(policy, cfg, cfg.output_dir or os.path.join(workdir, "eval"), label)["table"])
