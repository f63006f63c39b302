"""RL-VLA3: env shards, inference server and learner wired together, run, measured and shut down.

    env shard 0..S-1 --observations--> request board --dynamic batch--> inference server
         ^                                                                      |
         +------------------ action chunks tagged with policy_version ---------+
    env shards --segments (bounded queue)--> learner --versioned params--> param store --> server

The synchronous baseline is this same code with eta = 0 and a barrier (the server waits for every
shard each step): `mode="sync"`, where segment j is always collected by shard j mod S and every env
samples with its own key, so a sync run is the same on any number of processes.

Several processes (jax.distributed, the same config on each): every process runs its share of the
shards (rl.num_shards and rl.segments_per_update are global) and its own inference server on its
local devices; the learner is one SPMD program over every process's learner devices, its batch the
global array of every process's segments; each new version is published to every process's server;
the processes agree before every update and stop together (ejax.rl.multihost). Everything blocking waits in short slices on one stop event, so
the end of the run, an error in any component or a SIGTERM shuts every thread down; the learner's
last good state is checkpointed on the way out.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.sharding import NamedSharding
from ml_collections import ConfigDict

from ejax.parallel import ACT_BATCH, global_batch, logical_to_spec, make_mesh, replicated, tree_shardings
from ejax.parallel.watchdog import Watchdog
from ejax.rl.checkpoint import RLCheckpointer
from ejax.rl.coordination import ParamStore, RequestBoard, SegmentTickets
from ejax.rl.delays import DelaySampler, DelaySpec, delay_spec_from_config
from ejax.rl.env_shard import EnvShard, NativeSimEnv, env_functions
from ejax.rl.inference import InferenceServer, inference_weights
from ejax.rl.learner import Learner, make_update_fn
from ejax.rl import multihost
from ejax.rl.timeline import ActivityLog, plot_timeline

JOIN_TIMEOUT_S = 30.0


def _part(path) -> str:
  """Which of the optimizer's parts a parameter belongs to: "critic" (ActorCritic's {"critic": ...}),
  "perception" (a VLA actor's perception module, trained by its own loss on the rollouts: see
  ejax.rl.vla, rl.policy.perception_loss) or "actor"."""
  if getattr(path[0], "key", None) == "critic":
    return "critic"
  return "perception" if any(getattr(part, "key", None) == "perception" for part in path) else "actor"


PARTS = ("actor", "critic", "perception")


def _per_part(transform: Callable[[Any, str], Any]) -> optax.GradientTransformation:
  """A stateless transformation applied to each part's updates separately (`_part`)."""
  def update(updates, state, params=None):
    del params
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    parts = {part: [leaf for path, leaf in flat if _part(path) == part] for part in PARTS}
    done = {part: iter(transform(leaves, part)) if leaves else iter(()) for part, leaves in parts.items()}
    return jax.tree_util.tree_unflatten(treedef, [next(done[_part(path)]) for path, _ in flat]), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(config: ConfigDict, trainable_mask: Any = None) -> optax.GradientTransformation:
  """Adam, with the actor's, the critic's and a trained perception module's gradients clipped (global
  norm) and scaled separately: the value loss's gradients (returns can be large) must not eat the
  actor's share of one clip, nor the perception's supervised loss the policy gradient's; the critic
  may learn faster than the actor. The state is plain Adam moments shaped like the parameters, so it
  shards like them.

  trainable_mask (FlowPolicy.trainable_mask, bools shaped like the params): parameters marked
  False (a VLA's frozen LLM and vision tower) get a zero update and no Adam moments."""
  rates = {"actor": config.learning_rate, "critic": config.critic_learning_rate or config.learning_rate,
           "perception": config.get("perception_learning_rate", 0.0) or config.learning_rate}

  def clip(leaves, part):
    norm = optax.tree.norm(leaves)
    scale = jnp.minimum(1.0, config.grad_clip_norm / jnp.maximum(norm, 1e-12))
    return [leaf * scale for leaf in leaves]

  def rate(leaves, part):
    return [-rates[part] * leaf for leaf in leaves]

  optimizer = optax.chain(_per_part(clip), optax.scale_by_adam(), _per_part(rate))
  if trainable_mask is None:
    return optimizer
  labels = jax.tree.map(lambda trainable: "trainable" if trainable else "frozen", trainable_mask)
  return optax.multi_transform({"trainable": optimizer, "frozen": optax.set_to_zero()}, labels)


def default_config() -> ConfigDict:
  """The `rl` section of a config: pipeline shape, staleness, algorithm, placement, faults."""
  return ConfigDict(dict(
      mode="async",              # async | sync (sync = eta 0 + a barrier every step: the baseline)
      eta=2,                     # max policy versions between a sample's policy and the update using it
      num_shards=4, envs_per_shard=8, segment_length=8, actions_per_step=4,
      segments_per_update=4, num_updates=10, queue_size=8,
      delay=ConfigDict(dict(kind="none", mean=0.0, low=0.0, high=0.0, median=0.0, sigma=0.0)),
      shard_delays=[],           # optional per-shard overrides: list of dicts like `delay`
      algorithm="ppo",           # ppo (value head + GAE) | grpo (group-normalised success)
      group_size=4, gamma=0.99, gae_lambda=0.95, clip_epsilon=0.2, behaviour_weight_threshold=2.0,
      dual_clip=3.0, value_coef=0.5, num_epochs=2, num_minibatches=4, learning_rate=3e-4, grad_clip_norm=1.0,
      critic_learning_rate=0.0,  # 0: learning_rate; actor and critic are clipped and stepped separately
      perception_learning_rate=0.0,  # 0: learning_rate; a VLA's perception module (rl.policy.perception_loss)
      critic_warmup_updates=0,   # first updates train only the value head (PPO)
      target_kl=0.0,             # > 0: skip an update's remaining gradient steps once approx KL exceeds it
      noise_level=0.5,
      # Device indexes; empty / -1 = the default device. Several learner devices form learner_mesh.
      placement=ConfigDict(dict(env_devices=[], inference_device=-1, learner_devices=[],
                                learner_mesh=ConfigDict(dict(data=-1, fsdp=1, tensor=1)))),
      inference_weights="same",  # same | fp8_block: the server sees block-FP8 (e4m3, 128x128) weights
      inference_full_batch_only=False,  # pad every inference batch to all shards: fewer compilations
      success_bonus=0.0,         # added to the reward of the chunk where an episode succeeds (see EnvShard)
      max_restarts=3, checkpoint_every_updates=0, seed=0,
  ))


def shard_delay_specs(config: ConfigDict) -> list[DelaySpec]:
  overrides = list(config.shard_delays)
  return [delay_spec_from_config(ConfigDict(overrides[i]) if i < len(overrides) else config.delay)
          for i in range(config.num_shards)]


class RLRunError(RuntimeError):
  """A component failed; the run stopped every thread and saved the learner's last good state."""


class RLPipeline:
  def __init__(self, config: ConfigDict, env, policy, *, checkpoint_dir: str | None = None,
               fault_injector: Callable[[int, int, np.ndarray], np.ndarray] | None = None,
               update_wrapper: Callable[[Callable], Callable] | None = None, sharding_rules=None):
    """env: pure reset(rng) / step(state, action) (ejax.sim's Env interface), shared by the shards,
    or an ejax.rl.env_shard.NativeSimEnv (native MuJoCo, one batch per shard);
    policy: a FlowPolicy. fault_injector(shard_id, step, reward) -> reward runs after each shard
    step (tests raise from it or return NaNs); update_wrapper wraps the learner's jitted update (tests make it fail); sharding_rules: the
    logical-axis table (config.sharding_rules) for a learner on several devices."""
    self.config = config
    sync = config.mode == "sync"
    if config.mode not in ("sync", "async"):
      raise ValueError(f"rl.mode {config.mode!r}: use 'sync' or 'async'")
    self.eta = 0 if sync else int(config.eta)
    self.stop = threading.Event()
    self.activity = ActivityLog()
    self.errors: list[BaseException] = []
    self._error_lock = threading.Lock()
    self.stop_reason: str | None = None
    self.group = multihost.ProcessGroup()
    # Several processes: an update exchange that stalls, or a lost peer, ends all of them in one line.
    self.watchdog = Watchdog("rl", unit="update", timeout_s=float(config.get("step_timeout", 0.0)),
                             resume_from=self._saved_version, key=self.group.prefix)
    self.shard_ids = self.group.shard_ids(config.num_shards)  # this process's shards (global ids)
    segments_per_update = self.group.share(config.segments_per_update, "rl.segments_per_update")
    local = jax.local_devices()
    placement = config.placement
    env_devices = [local[i] for i in placement.env_devices] or [None]
    inference_device = local[placement.inference_device] if placement.inference_device >= 0 else None
    learner_devices = (multihost.global_devices(list(placement.learner_devices)) if self.group.multi
                       else [local[i] for i in placement.learner_devices])

    # Learner state, placed, then resumed from the newest checkpoint when there is one (restored
    # straight into this run's layout, whatever the process count that wrote it).
    self.policy = policy
    self.optimizer = make_optimizer(config, getattr(policy, "trainable_mask", None))
    params = policy.initial_params
    opt_state = self.optimizer.init(params)
    params, opt_state, put_batch, put_rng, self._replicate = self._place_learner(
        params, opt_state, learner_devices, placement, sharding_rules)
    self.checkpointer = RLCheckpointer(checkpoint_dir) if checkpoint_dir else None
    start_version, self.resumed_metadata = 0, None
    if self.checkpointer is not None and self.checkpointer.latest_version() is not None:
      params, opt_state, self.resumed_metadata = self.checkpointer.restore(params, opt_state)
      start_version = int(self.resumed_metadata["version"])
    self.start_version = start_version

    # The server's copy: on this process's own device (gathered from the learner's layout first).
    serve = self._inference_weights(config, inference_device) or (lambda tree: tree)
    self.param_store = ParamStore(params, start_version,
                                  device_put=lambda tree: serve(multihost.localize(tree, self._replicate)))
    total_segments = config.num_updates * segments_per_update
    self.tickets = SegmentTickets(total_segments, segments_per_update, self.eta,
                                  first_ticket=start_version * segments_per_update,
                                  fixed_shards=self.shard_ids if sync else None)
    self.board = RequestBoard(lambda: self.param_store.version, self.shard_ids)
    self.segment_queue: queue.Queue = queue.Queue(maxsize=config.queue_size)

    delays = shard_delay_specs(config)
    auto_reset = config.algorithm != "grpo"
    if isinstance(env, NativeSimEnv):  # one native batch per shard (each holds its own MjData)
      functions = lambda shard_id: env.functions(config.envs_per_shard, config.actions_per_step, auto_reset)
    else:  # one pure env, jitted once and shared by every shard
      shared = env_functions(env, config.actions_per_step, auto_reset)
      functions = lambda shard_id: shared
    self.shards = [EnvShard(
        shard_id, functions(shard_id), num_envs=config.envs_per_shard, segment_length=config.segment_length,
        actions_per_step=config.actions_per_step, mode="grpo" if config.algorithm == "grpo" else "gae",
        group_size=config.group_size, tickets=self.tickets, board=self.board, segment_queue=self.segment_queue,
        param_store=self.param_store, delay=DelaySampler(delays[shard_id], config.seed * 1000 + shard_id),
        activity=self.activity, stop=self.stop, seed=config.seed * 1000 + 100 + shard_id + 7919 * start_version,
        max_restarts=config.max_restarts, device=env_devices[shard_id % len(env_devices)],
        on_fatal=self._fatal, fault_injector=fault_injector, success_bonus=config.success_bonus,
        observation_filter=getattr(policy, "select_observations", None))
        for shard_id in self.shard_ids]
    self.server = InferenceServer(policy.jit_sample, board=self.board, param_store=self.param_store,
                                  num_shards=len(self.shard_ids), envs_per_shard=config.envs_per_shard, barrier=sync,
                                  activity=self.activity, stop=self.stop, seed=config.seed + 17 + start_version,
                                  device=inference_device, full_batch_only=config.inference_full_batch_only,
                                  on_fatal=self._fatal)
    update_fn = self._jitted_update(policy, config)
    if update_wrapper is not None:
      update_fn = update_wrapper(update_fn)
    warmup_fn = self._jitted_update(policy, config, train_actor=False) if config.critic_warmup_updates else None
    self.learner = Learner(update_fn, params, opt_state, start_version=start_version, num_updates=config.num_updates,
                           segments_per_update=segments_per_update, eta=self.eta,
                           segment_queue=self.segment_queue, param_store=self.param_store, activity=self.activity,
                           stop=self.stop, seed=config.seed + 29, put_batch=put_batch, on_update=self._on_update,
                           on_fatal=self._fatal, warmup_update_fn=warmup_fn,
                           warmup_updates=config.critic_warmup_updates, put_rng=put_rng, group=self.group,
                           on_peer_stop=self._stop_from_peer, stop_reason=lambda: self.stop_reason or "stopped",
                           watchdog=self.watchdog)
    self.wall_seconds = 0.0

  def _jitted_update(self, policy, config: ConfigDict, train_actor: bool = True) -> Callable:
    """The learner's update, jitted once per policy and hyper-parameters (pipelines that share a
    policy, like a run and its resume, share the compilation). No donation: on the colocated
    placement the published parameters share buffers with the learner's, and the last good state
    must outlive a failed update to be checkpointed."""
    hyper = dict(algorithm=config.algorithm, gamma=config.gamma, gae_lambda=config.gae_lambda,
                 clip_epsilon=config.clip_epsilon, behaviour_weight_threshold=config.behaviour_weight_threshold,
                 dual_clip=config.dual_clip, value_coef=config.value_coef, num_epochs=config.num_epochs,
                 num_minibatches=config.num_minibatches, group_size=config.group_size, train_actor=train_actor,
                 target_kl=config.get("target_kl") or None)
    key = ("update", config.learning_rate, config.critic_learning_rate, config.grad_clip_norm,
           tuple(sorted(hyper.items())))
    if key not in policy.compiled:
      update = make_update_fn(policy, self.optimizer, **hyper)
      # The key travels as raw data (uint32 [2]): placed like any other array on a multi-process mesh.
      policy.compiled[key] = jax.jit(lambda params, opt_state, batch, key_data: update(
          params, opt_state, batch, jax.random.wrap_key_data(key_data)))
    return policy.compiled[key]

  @staticmethod
  def _inference_weights(config: ConfigDict, device) -> Callable[[Any], Any] | None:
    """What publishing does to the learner's parameters on their way to the server. With block-FP8
    weights the behaviour log-probs come from those weights, and the decoupled objective's
    behaviour weight corrects for the gap to the learner's full-precision policy."""
    return inference_weights(config.inference_weights, device, setting="rl.inference_weights")

  @staticmethod
  def _place_learner(params, opt_state, devices, placement: ConfigDict, sharding_rules):
    """Learner state and batches on the learner's devices -> (params, opt_state, put_batch, put_rng,
    replicate). Several devices form a (data, fsdp, tensor) mesh sharded by the same logical-axis
    rules as SFT training: parameters and optimizer moments by their axis names, batches along the
    env axis. Over several processes the mesh is global: each process fills its own devices' shards
    of the state, and its segments are its rows of the batch. replicate (or None) gathers the
    parameters for a server where the mesh shards them across processes."""
    keep = lambda tree: tree
    if not devices:
      return params, opt_state, keep, keep, None
    if len(devices) == 1:
      put = lambda tree: jax.device_put(tree, devices[0])
      return *put((params, opt_state)), put, keep, None
    if sharding_rules is None:
      raise ValueError("rl.placement.learner_devices names several devices (or several processes run): pass "
                       "sharding_rules (config.sharding_rules) so the learner can be sharded like SFT training")
    mesh = make_mesh(dict(placement.learner_mesh), devices=devices)
    param_shardings = tree_shardings(params, mesh, sharding_rules)
    opt_shardings = tree_shardings(opt_state, mesh, sharding_rules)
    time_major = NamedSharding(mesh, logical_to_spec((None, ACT_BATCH), sharding_rules, mesh=mesh))  # [T, N, ...]
    env_major = NamedSharding(mesh, logical_to_spec((ACT_BATCH,), sharding_rules, mesh=mesh))       # [N, ...]
    layout = lambda key: (env_major, 0) if key == "bootstrap_observation" else (time_major, 1)
    replicated_sharding = replicated(mesh)
    if jax.process_count() == 1:
      return (jax.device_put(params, param_shardings), jax.device_put(opt_state, opt_shardings),
              lambda batch: {key: jax.device_put(value, layout(key)[0]) for key, value in batch.items()}, keep, None)

    def put_batch(batch):  # SFT's global_batch: each process's rows, concatenated along the env axis
      def place(value, axis):
        if isinstance(value, dict):
          return global_batch(value, mesh, sharding_rules, batch_axis=axis)
        return global_batch({"x": value}, mesh, sharding_rules, batch_axis=axis)["x"]
      return {key: place(value, layout(key)[1]) for key, value in batch.items()}

    replicate = jax.jit(lambda tree: tree, out_shardings=replicated_sharding)
    return (multihost.to_global(params, param_shardings), multihost.to_global(opt_state, opt_shardings),
            put_batch, lambda key_data: multihost.to_global(key_data, replicated_sharding), replicate)

  def local_learner_params(self) -> Any:
    """The learner's current parameters on this process's device (every process calls it at the
    same point: where the learner's mesh spans processes, this gathers them)."""
    return multihost.localize(self.learner.params, self._replicate)

  # -- control -------------------------------------------------------------------------------

  def _saved_version(self) -> int | None:
    """The newest version finished on disk (orbax's own latest may be a save still being written;
    the lost-peer line must name one a relaunch can restore)."""
    from ejax.train.workdir import saved_steps
    checkpointer = getattr(self, "checkpointer", None)
    versions = saved_steps(checkpointer.directory) if checkpointer is not None else []
    return versions[-1] if versions else None

  def _fatal(self, error: BaseException) -> None:
    with self._error_lock:
      self.errors.append(error)
      self.stop_reason = self.stop_reason or f"error: {error!r}"
    self.stop.set()
    self.group.announce_stop(self.stop_reason)

  def request_stop(self, reason: str) -> None:
    """From a signal handler or another thread: stop at the next wait slice, then checkpoint
    (every process of a multi-process run stops with this one)."""
    self.stop_reason = self.stop_reason or reason
    self.stop.set()
    self.group.announce_stop(self.stop_reason)

  def _stop_from_peer(self, reason: str) -> None:
    """Another process stopped (its reason): stop here too, at the same version."""
    self.stop_reason = self.stop_reason or reason
    self.stop.set()

  def _on_update(self, version: int, params, opt_state, record: dict) -> None:
    logging.info("RL update %d: %d episodes ended, success %.3f (with exploration), reward %.3f, approx KL %.3f, "
                 "clip %.2f, stopped %.2f, value loss %.3g, lag max %d", version, record["episodes"],
                 record["success_rate"], record["reward_mean"], record.get("approx_kl_behaviour", 0.0),
                 record.get("clip_fraction", 0.0), record.get("stopped_fraction", 0.0), record.get("value_loss", 0.0),
                 record["lag_max"])
    every = self.config.checkpoint_every_updates
    if self.checkpointer is not None and every and version % every == 0:
      self.save_checkpoint()

  def save_checkpoint(self, *, starting_point: bool = False) -> None:
    """Saves the learner's version. Version 0 (the SFT starting point) only when asked for, so a
    run that stops before its first update leaves nothing new behind."""
    if self.checkpointer is None or self.learner.version == self.checkpointer.latest_version():
      return  # this version is already saved
    if self.learner.version == 0 and not starting_point:
      return
    # The policy's own config travels with it, so the eval job can rebuild it (policy=rl).
    policy_config = self.config.get("policy")
    self.checkpointer.save(self.learner.version, self.learner.params, self.learner.opt_state,
                           {"env_steps": int(sum(shard.env_steps for shard in self.shards)),
                            "samples_consumed": self.learner.samples_consumed,
                            "policy": policy_config.to_dict() if policy_config is not None else None})

  @property
  def threads(self) -> list[threading.Thread]:
    return [shard.thread for shard in self.shards] + [self.server.thread, self.learner.thread]

  def run(self) -> dict:
    """Runs to num_updates (or until an error / request_stop), joins every thread, returns metrics."""
    start = time.perf_counter()
    for component in [self.learner, self.server, *self.shards]:
      component.start()
    self.group.watch(self.stop, self._stop_from_peer)
    try:
      while self.learner.thread.is_alive() and not self.stop.is_set():
        self.learner.thread.join(timeout=0.1)
    finally:
      self.stop.set()
      self.wall_seconds = time.perf_counter() - start
      for thread in self.threads:
        thread.join(timeout=JOIN_TIMEOUT_S)
      hanging = [thread.name for thread in self.threads if thread.is_alive()]
      if self.checkpointer is not None and self.learner.version > self.start_version:
        self.save_checkpoint()  # the last good state: at the end, on error and on SIGTERM alike
      # Every process's counters, for the run's summary (a no-op with one process).
      self.process_reports = self.group.exchange("summary", self._process_report())
      self.watchdog.close()
      if hanging:
        raise RLRunError(f"threads still running after shutdown: {hanging}")
    if self.errors:
      raise RLRunError(f"RL run stopped at version {self.learner.version} after {self.errors[0]!r}; "
                       f"last good state checkpointed") from self.errors[0]
    return self.summary()

  # -- metrics -------------------------------------------------------------------------------

  def _process_report(self) -> dict:
    lags = np.concatenate(self.learner.lags).astype(np.int64) if self.learner.lags else np.zeros((0,), np.int64)
    return {"env_steps": int(sum(shard.env_steps for shard in self.shards)),
            "samples_consumed": int(self.learner.samples_consumed),
            "lag_counts": np.bincount(lags - lags.min(initial=0)).tolist(), "lag_min": int(lags.min(initial=0)),
            "segments": {str(shard.shard_id): shard.segments for shard in self.shards},
            "restarts": {str(shard.shard_id): shard.restarts for shard in self.shards}}

  def summary(self) -> dict:
    """The run's figures over every process (lags of every consumed sample, env steps of every shard)."""
    wall = max(self.wall_seconds, 1e-9)
    history = self.learner.history
    reports = getattr(self, "process_reports", None) or [self._process_report()]
    lags = np.concatenate([np.repeat(np.arange(len(r["lag_counts"])) + r["lag_min"], r["lag_counts"]) for r in reports])
    lags = lags if lags.size else np.zeros((1,))
    env_steps = sum(report["env_steps"] for report in reports)
    segments = {int(k): v for report in reports for k, v in report["segments"].items()}
    restarts = {int(k): v for report in reports for k, v in report["restarts"].items()}
    result = {
        "mode": self.config.mode, "eta": self.eta, "wall_seconds": wall, "version": self.learner.version,
        "stop_reason": self.stop_reason, "env_steps": env_steps, "env_steps_per_s": env_steps / wall,
        "num_processes": len(reports), "env_steps_per_process": [report["env_steps"] for report in reports],
        "segments_per_shard": [segments[k] for k in sorted(segments)],
        "learner_batch_envs": history[-1]["batch_envs"] if history else 0,
        "learner_updates_per_s": len(history) / wall,
        "samples_consumed_per_s": sum(report["samples_consumed"] for report in reports) / wall,
        "lag_mean": float(lags.mean()), "lag_p95": float(np.percentile(lags, 95)), "lag_max": int(lags.max()),
        "shard_restarts": [restarts[k] for k in sorted(restarts)],
        "inference_batches": self.server.batches,
        "inference_shards_per_batch": float(np.mean(self.server.batch_shards)) if self.server.batch_shards else 0.0,
        "busy_fraction": self.activity.busy_fractions(wall),
        **self.activity.wait_summary(),
        "success_vs_time": [(record["time"], record["success_rate"]) for record in history],
    }
    for key in ("approx_kl_behaviour", "clip_fraction", "loss", "value_loss"):
      if history:
        result[key] = float(np.mean([record[key] for record in history]))
    return result

  def plot(self, path: str) -> None:
    plot_timeline(self.activity, path, title=f"RL-VLA3 {self.config.mode} (eta={self.eta})")
