"""Job `rl`: SFT warm start, RL-VLA3 fine-tuning, and success judged before and after.

    python -m ejax.main --config=configs/rl_vla3.py:runlocal

1. Build the env (config.rl.env) and the flow policy (config.rl.policy): a state-based flow actor,
   or GR00T / pi0.5 from a train job's checkpoint (kinds "groot", ejax.rl.vla, and "pi05",
   ejax.rl.vla_pi05; the env then renders the cameras the checkpoint was trained on).
2. Warm start: resume an interrupted RL run from workdir/rl_checkpoints if there is one; otherwise
   start from SFT: the GR00T checkpoint's weights, or behaviour cloning on the env's scripted
   expert (config.rl.warm_start; an ejax.sim task uses its privileged-state expert).
3. Judge the starting policy's closed-loop success rate. ejax.sim tasks are judged by the eval
   job's evaluation (ejax.eval.evaluate.evaluate_policy: table, Wilson intervals, plot, videos in
   workdir/eval_before), on layouts of its own seed; the SFT policy is saved as version 0.
4. Run the asynchronous pipeline (ejax.rl.pipeline) to config.rl.num_updates; SIGTERM stops it
   cleanly and checkpoints.
5. Judge again (workdir/eval_after); write rl_summary.json, rl_history.jsonl and timeline.png.
Several processes (jax.distributed, configured exactly as for SFT: config.distributed.* or the
cluster's environment, the same command on every process) share the env shards and one SPMD learner
(ejax.rl.pipeline); process 0 judges and writes the outputs, every process checkpoints together.
Any saved version can be judged again later by the eval job itself:
    python -m ejax.main --config=configs/eval.py --config.eval.policy=rl \
        --config.eval.checkpoint=WORKDIR/rl_checkpoints --config.eval.tasks=TASK [--config.eval.version=0]
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import jax
from absl import logging
from ml_collections import ConfigDict

from ejax.config.validate import ConfigError, require_one_of, require_path, require_section
from ejax.parallel import barrier, initialize_distributed
from ejax.rl import warm_start
from ejax.rl.build import load_rl_policy, make_env, make_policy  # noqa: F401 (load_rl_policy: re-exported)
from ejax.rl.checkpoint import RLCheckpointer
from ejax.rl.pipeline import RLPipeline
from ejax.train import wandb_run


@contextlib.contextmanager
def stop_on_sigterm(pipeline: RLPipeline):
  """SIGTERM (a preempted job) asks the pipeline to stop, checkpoint and join its threads."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: pipeline.request_stop("SIGTERM"))
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


def judge_config(rl: ConfigDict) -> ConfigDict:
  """The eval job's settings for judging an RL run on its ejax.sim task (see configs/eval.py)."""
  judge = rl.judge
  return ConfigDict(dict(tasks=rl.env.name, episodes_per_task=judge.episodes, num_envs=judge.episodes,
                         backend=judge.get("backend", "mjx"), image_height=judge.get("image_size", 64),
                         image_width=judge.get("image_size", 64), replan_every=rl.actions_per_step,
                         episode_length=judge.get("episode_length", 0),  # 0: the task's own limit
                         videos_per_task=judge.get("videos", 2), seed=judge.seed, checkpoint=""))


POLICY_KINDS = ("mlp_flow", "tiny_flow", "groot", "pi05")


def check_config(config: ConfigDict) -> None:
  """The rl job's settings, checked before any process connects, records demos or compiles: one line
  naming the setting and the fix (ejax.main prints it)."""
  rl = require_section(config, "rl", "configs/rl_vla3.py")
  require_one_of("rl.mode", rl.mode, ("async", "sync"))
  from ejax.sim import registry
  require_one_of("rl.env.name", rl.env.name, ("point_reach", *registry.list_tasks()))
  require_one_of("rl.env.backend", rl.env.get("backend", "mjx"), ("mjx", "native"))
  require_one_of("rl.policy.kind", rl.policy.kind, POLICY_KINDS)
  if rl.policy.kind in ("groot", "pi05"):
    _check_sft_checkpoint(rl.policy)


def _check_sft_checkpoint(policy: ConfigDict) -> None:
  """rl.policy.checkpoint (the arg string's sft=) holds a train job's checkpoints of rl.policy.kind's model."""
  from ejax.checkpoint.kinds import RL, TRAIN, checkpoint_kind, saved_config
  title = {"groot": "GR00T", "pi05": "pi0.5"}[policy.kind]
  what = (f"a {title} train job's <workdir>/checkpoints (configs/rl_vla3.py:...,actor={policy.kind},sft=PATH)")
  path = require_path("rl.policy.checkpoint", policy.checkpoint, what)
  kind = checkpoint_kind(path)
  if kind != TRAIN:
    if checkpoint_kind(os.path.join(path, "checkpoints")) == TRAIN:
      raise ConfigError(f"rl.policy.checkpoint={policy.checkpoint!r} is a workdir: point sft= at "
                        f"{os.path.join(policy.checkpoint, 'checkpoints')}")
    held = "an rl job's rl_checkpoints" if kind == RL else "no train checkpoint"
    raise ConfigError(f"rl.policy.checkpoint={policy.checkpoint!r} holds {held}: point sft= at {what}")
  step = int(policy.get("step", -1))
  model = (saved_config(path, None if step < 0 else step).get("model") or {}).get("name")
  if model not in (policy.kind, None):  # None: unreadable, which the loader reports
    raise ConfigError(f"rl.policy.checkpoint={policy.checkpoint!r} holds a {model!r} model; actor={policy.kind} "
                      f"fine-tunes a {title} checkpoint (configs/{policy.kind}.py's train job): point sft= at one")


def log_updates_to_wandb(learner) -> None:
  """Every learner update's scalars (losses, approx KL, success and reward of the episodes it saw, lag),
  against the policy version (rl/version), into the launch's W&B run when config.metrics.wandb is on;
  the judging before and after logs through the eval job's evaluation (ejax.eval.evaluate.log_to_wandb)."""
  run = wandb_run.active_run()
  if run is None:
    return
  run.define_metric("rl/version")
  run.define_metric("rl/*", step_metric="rl/version")
  previous = learner.on_update

  def on_update(version: int, params, opt_state, record: dict) -> None:
    if previous is not None:
      previous(version, params, opt_state, record)
    run.log({"rl/version": version, **{f"rl/{key}": float(value) for key, value in record.items()
                                        if key not in ("version", "time") and isinstance(value, (int, float))}})

  learner.on_update = on_update


def run_job(config: ConfigDict, workdir: str) -> dict:
  check_config(config)
  rl = config.rl
  initialize_distributed(config.distributed)  # several processes: before anything touches a device
  lead = jax.process_index() == 0  # judges and writes the outputs
  os.makedirs(workdir, exist_ok=True)
  env = make_env(rl.env)
  policy = make_policy(rl.policy, config.seed)
  checkpoint_dir = os.path.join(workdir, "rl_checkpoints")
  resuming = RLCheckpointer.has_versions(checkpoint_dir)
  if jax.process_count() > 1:  # process 0 decides for all: a peer that looked later could see this run's version 0
    from ejax.rl.multihost import ProcessGroup
    resuming = ProcessGroup("rl_job").exchange("resuming", {"resuming": resuming})[0]["resuming"]
  simulated = rl.env.name != "point_reach"
  if simulated:
    from ejax.eval.evaluate import evaluate_policy
    from ejax.sim.batched import make_batched

    def judge(params, stage: str) -> float:
      summary = evaluate_policy(warm_start.EvalPolicy(policy, params), judge_config(rl),
                                os.path.join(workdir, f"eval_{stage}"), label=f"rl ({stage} RL)")
      return summary["overall"]["success_rate"]
  else:
    judge = lambda params, stage: warm_start.success_rate(
        policy, params, env, num_episodes=rl.judge.episodes, actions_per_step=rl.actions_per_step,
        rng=jax.random.key(rl.judge.seed))

  # -- warm start ----------------------------------------------------------------------------
  if not resuming and rl.warm_start.steps > 0:
    start = time.perf_counter()
    demo_rng = jax.random.key(config.seed)
    if simulated:
      demos = warm_start.collect_batched_expert_demos(
          make_batched(rl.env.name, rl.warm_start.demo_episodes, backend=rl.env.get("demo_backend", "mjx")),
          horizon=rl.policy.horizon, action_noise=rl.warm_start.action_noise, rng=demo_rng)
    else:
      demos = warm_start.collect_expert_demos(env, num_episodes=rl.warm_start.demo_episodes, horizon=rl.policy.horizon,
                                              action_noise=rl.warm_start.action_noise, rng=demo_rng)
    policy.initial_params = warm_start.behaviour_clone(
        policy, policy.initial_params, demos, steps=rl.warm_start.steps, batch_size=rl.warm_start.batch_size,
        learning_rate=rl.warm_start.learning_rate, rng=jax.random.key(config.seed + 1))
    logging.info("SFT warm start: %d demo samples, %d steps, %.1f s", demos["actions"].shape[0],
                 rl.warm_start.steps, time.perf_counter() - start)
    if jax.process_count() > 1:  # every process cloned the same demos; process 0's weights are the start
      from jax.experimental import multihost_utils
      barrier("rl_warm_start")
      policy.initial_params = multihost_utils.broadcast_one_to_all(policy.initial_params)

  pipeline = RLPipeline(rl, env, policy, checkpoint_dir=checkpoint_dir, sharding_rules=config.sharding_rules)
  if lead:
    log_updates_to_wandb(pipeline.learner)
  if not resuming:
    pipeline.save_checkpoint(starting_point=True)  # version 0: the SFT policy, for later judging
  params = pipeline.local_learner_params()  # every process (a gather where the mesh spans them)
  success_before = judge(params, "before") if lead else None
  if lead:
    logging.info("success rate before RL (version %d): %.3f", pipeline.start_version, success_before)

  # -- RL ------------------------------------------------------------------------------------
  with stop_on_sigterm(pipeline):
    summary = pipeline.run()
  params = pipeline.local_learner_params()
  success_after = judge(params, "after") if lead else None
  if not lead:
    logging.info("RL done on process %d: %d env steps here, lag max %d (eta %d); process 0 writes the outputs",
                 jax.process_index(), summary["env_steps_per_process"][jax.process_index()], summary["lag_max"],
                 summary["eta"])
    return summary
  logging.info("success rate after RL (version %d): %.3f", pipeline.learner.version, success_after)

  # -- outputs -------------------------------------------------------------------------------
  summary.update(success_before=success_before, success_after=success_after, resumed=resuming,
                 start_version=pipeline.start_version,
                 threads_alive=[thread.name for thread in pipeline.threads if thread.is_alive()])
  pipeline.plot(os.path.join(workdir, "timeline.png"))
  with open(os.path.join(workdir, "rl_summary.json"), "w") as file:
    json.dump(summary, file, indent=1, default=float)
  with open(os.path.join(workdir, "rl_history.jsonl"), "a") as file:
    for record in pipeline.learner.history:
      file.write(json.dumps(record, default=float) + "\n")
  logging.info("RL done: %.0f env steps/s, %.2f updates/s, lag mean %.2f max %d (eta %d), busy %s",
               summary["env_steps_per_s"], summary["learner_updates_per_s"], summary["lag_mean"], summary["lag_max"],
               summary["eta"], {name: round(value, 2) for name, value in summary["busy_fraction"].items()})
  return summary
