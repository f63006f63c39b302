"""Level 3: the learner, decoupled PPO (value head + GAE) or GRPO on trajectory segments.

The learner pulls segments from the bounded trajectory queue, puts them back in ticket order
(shards finish out of order; update k trains on tickets [k B, (k + 1) B) exactly, which is what
makes the staleness bound hold), checks that no sample is more than eta versions old, runs one
jitted update over shuffled micro-batches, and publishes the new version to the inference server.
"""

from __future__ import annotations

import contextlib

import queue
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ejax.rl import losses
from ejax.rl.coordination import ParamStore, Stopped, get_until_stopped
from ejax.rl.multihost import ProcessGroup, merge_statistics
from ejax.rl.timeline import ActivityLog


class StalenessError(RuntimeError):
  """A sample older than eta versions reached the learner: the staleness gate is broken."""


def _flatten_time(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), tree)


def _pushed_histories(grads: Any, mask: Any) -> tuple[Any, Any]:
  """(grads for the optimizer, FP8 histories' new values). The "gradient" of a delayed-scaling FP8
  history is the history with this step's amaxes pushed in (ejax.kernels.fp8.Fp8History), not a
  gradient: the optimizer gets zeros there (Adam's moments stay 0, so its update is 0)."""
  if mask is None:
    return grads, None
  return jax.tree.map(lambda m, g: jnp.zeros_like(g) if m else g, mask, grads), grads


def _with_histories(params: Any, pushed: Any, mask: Any) -> Any:
  """params with each FP8 history replaced by its pushed value where the loss ran its GEMM. A history
  the loss left at zero (a layer it did not run, as a cached backbone's) keeps its value."""
  if mask is None:
    return params
  return jax.tree.map(lambda m, p, new: jnp.where(jnp.any(new != 0), new, p) if m else p, mask, params, pushed)


def make_update_fn(policy, optimizer: optax.GradientTransformation, *, algorithm: str, gamma: float, gae_lambda: float,
                   clip_epsilon: float, behaviour_weight_threshold: float | None, dual_clip: float | None,
                   value_coef: float, num_epochs: int, num_minibatches: int, group_size: int,
                   normalize_advantages: bool = True, train_actor: bool = True,
                   target_kl: float | None = None) -> Callable:
  """(params, opt_state, batch, rng) -> (params, opt_state, metrics): one policy version's update.

  target_kl: PPO's early stop. Once a minibatch finds the policy more than target_kl (approx KL)
  from the proximal policy, that and every later gradient step of this update is skipped
  (metric "stopped_fraction"). Flow-SDE log-probs are sharp: a few steps too many can move the
  policy far, and the clip only stops the gradient of samples already outside the trust region.

  train_actor=False is the critic warm-up: the same update with the policy loss left out of the
  gradient (it is still reported), so the value head learns the SFT policy's returns before its
  advantages steer the actor.

  A policy with `auxiliary_inputs` (FlowPolicy: a VLA actor whose perception module keeps learning,
  rl.policy.perception_loss) adds its actor's supervised loss on each minibatch's observations to the
  total, from the first update on; its metrics join the update's.

  Delayed-scaling FP8 layers (model.fp8_impl "xla_delayed*") keep the amaxes each gradient step's
  GEMMs push into their histories, as the train step does, so their scales follow the RL loss's
  activations and gradients rather than staying the SFT checkpoint's.

  batch: time-major segments concatenated along the env axis ([T, N, ...] leaves plus
  "bootstrap_observation" [N, ...]). The proximal policy is `params` as passed in: log-probs and
  values under it are computed once, before the first gradient step.
  """
  if algorithm not in ("ppo", "grpo"):
    raise ValueError(f"RL algorithm {algorithm!r}: use 'ppo' or 'grpo'")
  history_mask = getattr(policy, "history_mask", None)
  auxiliary = getattr(policy, "auxiliary_inputs", None) is not None

  def update(params, opt_state, batch, rng):
    steps, envs = batch["reward"].shape
    observation = _flatten_time(batch["observation"])
    chain, step_index = _flatten_time(batch["chain"]), _flatten_time(batch["step_index"])
    context = _flatten_time(batch["context"]) if "context" in batch else None  # an actor's cached context
    valid = batch["valid"].astype(jnp.float32)
    proximal_log_prob, values = policy.evaluate(params, observation, chain, step_index, context)

    if algorithm == "ppo":
      bootstrap_value = policy.value(params, batch["bootstrap_observation"])
      advantages, returns = losses.gae(batch["reward"], values.reshape(steps, envs), batch["done"], bootstrap_value,
                                       gamma=gamma, lam=gae_lambda, valid=valid)
      if normalize_advantages:
        advantages = losses.normalize_advantages(advantages, valid)
    else:
      # Sparse success reward per episode; every step of an episode shares its group-normalised advantage.
      episode_success = jnp.any(batch["success"] & batch["valid"], axis=0).astype(jnp.float32)  # [N]
      advantages = jnp.broadcast_to(losses.grpo_advantages(episode_success, group_size=group_size), (steps, envs)) * valid
      returns = jnp.zeros_like(advantages)

    samples = {"observation": observation, "chain": chain, "step_index": step_index, "context": context,
               "behaviour_log_prob": _flatten_time(batch["log_prob"]), "proximal_log_prob": proximal_log_prob,
               "old_value": values, "advantage": advantages.reshape(-1), "return": returns.reshape(-1),
               "valid": valid.reshape(-1)}
    num_samples = steps * envs
    minibatch_size = num_samples // num_minibatches

    def loss_fn(params, minibatch):
      log_prob, value = policy.evaluate(params, minibatch["observation"], minibatch["chain"], minibatch["step_index"],
                                        minibatch["context"])
      policy_loss, metrics = losses.decoupled_ppo_loss(
          log_prob, minibatch["proximal_log_prob"], minibatch["behaviour_log_prob"], minibatch["advantage"],
          clip_epsilon=clip_epsilon, behaviour_weight_threshold=behaviour_weight_threshold, dual_clip=dual_clip,
          mask=minibatch["valid"])
      value_error = losses.value_loss(value, minibatch["return"], mask=minibatch["valid"])
      total = (policy_loss if train_actor else 0.0) + (value_coef * value_error if algorithm == "ppo" else 0.0)
      if auxiliary:  # the actor's own supervised loss on the rollouts (a VLA's perception module), every update
        auxiliary_loss, auxiliary_metrics = policy.auxiliary_loss(params, minibatch["observation"])
        total = total + auxiliary_loss
        metrics = dict(metrics, **auxiliary_metrics)
      return total, dict(metrics, policy_loss=policy_loss, value_loss=value_error)

    def minibatch_step(carry, minibatch):
      params, opt_state, stopped = carry
      (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, minibatch)
      grads, pushed = _pushed_histories(grads, history_mask)
      updates, new_opt_state = optimizer.update(grads, opt_state, params)
      new_params = _with_histories(optax.apply_updates(params, updates), pushed, history_mask)
      if target_kl is not None and train_actor:
        stopped = stopped | (metrics["approx_kl_proximal"] > target_kl)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(stopped, b, a), new, old)
        new_params, new_opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
      metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), stopped_fraction=stopped.astype(jnp.float32))
      return (new_params, new_opt_state, stopped), metrics

    def epoch(carry, epoch_rng):
      order = jax.random.permutation(epoch_rng, num_samples)[:minibatch_size * num_minibatches]
      shuffled = jax.tree.map(lambda x: x[order].reshape((num_minibatches, minibatch_size) + x.shape[1:]), samples)
      return jax.lax.scan(minibatch_step, carry, shuffled)

    (params, opt_state, _), metrics = jax.lax.scan(epoch, (params, opt_state, jnp.zeros((), bool)),
                                                   jax.random.split(rng, num_epochs))
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics["value_mean"] = jnp.mean(values)
    metrics["advantage_abs_mean"] = jnp.sum(jnp.abs(advantages) * valid) / jnp.maximum(jnp.sum(valid), 1.0)
    return params, opt_state, metrics

  return update


def segment_statistics(batch: dict[str, np.ndarray], update: int) -> dict[str, float]:
  """Policy lag and episode outcomes of one update's batch (host-side, numpy)."""
  valid = batch["valid"].astype(bool)
  lag = update - batch["policy_version"][valid]
  finished = batch["done"] & valid
  episodes = int(finished.sum())
  successes = int((batch["success"] & finished).sum())
  return {"lag_mean": float(lag.mean()), "lag_p95": float(np.percentile(lag, 95)), "lag_max": int(lag.max()),
          "episodes": episodes, "successes": successes, "success_rate": successes / max(episodes, 1),
          "reward_mean": float(batch["reward"][valid].mean()), "samples": int(valid.sum())}


class Learner:
  def __init__(self, update_fn: Callable, params: Any, opt_state: Any, *, start_version: int, num_updates: int,
               segments_per_update: int, eta: int, segment_queue: queue.Queue, param_store: ParamStore,
               activity: ActivityLog, stop: threading.Event, seed: int,
               put_batch: Callable[[dict], dict] = lambda batch: batch,
               on_update: Callable[[int, Any, Any, dict], None] | None = None,
               on_fatal: Callable[[BaseException], None] | None = None,
               warmup_update_fn: Callable | None = None, warmup_updates: int = 0,
               put_rng: Callable[[np.ndarray], Any] = lambda key_data: key_data,
               group: ProcessGroup | None = None, on_peer_stop: Callable[[str], None] | None = None,
               stop_reason: Callable[[], str] = lambda: "stopped", watchdog=None):
    """put_batch places a host batch on the learner's devices (several processes: this process's
    segments become its rows of the global batch); put_rng the update's key data likewise.
    on_update(version, params, opt_state, metrics) runs after each publish (metrics logging,
    periodic checkpoints). The first `warmup_updates` versions use warmup_update_fn (the critic
    warm-up) instead of update_fn. group (several processes): before each update every process's
    learner reports ready or stopped (ejax.rl.multihost); all run the update together, or all stop
    and on_peer_stop(reason) hears why when the stop came from another process."""
    self._update = update_fn  # jitted by the caller (no donation: see ejax.rl.pipeline)
    self._warmup_update, self.warmup_updates = warmup_update_fn, warmup_updates
    self.params, self.opt_state = params, opt_state
    self.version, self.num_updates = start_version, num_updates
    self.segments_per_update, self.eta = segments_per_update, eta
    self.segment_queue, self.param_store, self.activity, self.stop = segment_queue, param_store, activity, stop
    self.put_batch, self.put_rng, self.on_update, self.on_fatal = put_batch, put_rng, on_update, on_fatal
    self.group, self.on_peer_stop, self.stop_reason = group or ProcessGroup(), on_peer_stop, stop_reason
    self.watchdog = watchdog  # several processes: ends all of them if an update exchange stalls
    self._rng = jax.random.fold_in(jax.random.key(seed), start_version)
    self._buffer: dict[int, dict] = {}
    self.history: list[dict] = []
    self.samples_consumed = 0
    self.lags: list[np.ndarray] = []  # every consumed sample's policy lag, for exact run statistics
    self.error: BaseException | None = None
    self.thread = threading.Thread(target=self._run, name="learner", daemon=True)

  def start(self) -> None:
    self.thread.start()

  def _gather(self, update: int) -> dict[str, np.ndarray]:
    first = update * self.segments_per_update
    wanted = range(first, first + self.segments_per_update)
    while any(ticket not in self._buffer for ticket in wanted):
      segment, waited = get_until_stopped(self.segment_queue, self.stop)
      self.activity.wait("learner_queue_get", waited)
      self._buffer[segment["ticket"]] = segment
    segments = [self._buffer.pop(ticket) for ticket in wanted]
    arrays = [{key: value for key, value in segment.items() if key not in ("ticket", "shard_id")} for segment in segments]
    # Time-major leaves concatenate along the env axis (1); bootstrap observations along axis 0.
    batch = {key: jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *[a[key] for a in arrays])
             for key in arrays[0] if key != "bootstrap_observation"}
    batch["bootstrap_observation"] = jax.tree.map(lambda *xs: np.concatenate(xs, axis=0),
                                                  *[a["bootstrap_observation"] for a in arrays])
    return batch

  def _agree(self, update: int, statistics: dict | None, reason: str) -> dict | None:
    """Several processes: every learner's report for `update` -> the global batch's statistics,
    or None when any process stopped (all of them then stop here, before the update)."""
    if not self.group.multi:
      return statistics
    self._reported = update
    reports = self.group.exchange(f"update/{update}", {"ready": statistics is not None, "reason": reason,
                                                      "statistics": statistics})
    stopped = [(q, report["reason"]) for q, report in enumerate(reports) if not report["ready"]]
    if stopped:
      peers = [f"process {q}: {why}" for q, why in stopped if q != self.group.index]
      if peers and self.on_peer_stop is not None:
        self.on_peer_stop(peers[0])
      self.stop.set()
      return None
    return merge_statistics([report["statistics"] for report in reports])

  def _run(self) -> None:
    self._reported = -1
    try:
      while self.version < self.num_updates:
        update = self.version
        try:
          batch = self._gather(update)
        except Stopped:
          if not self.group.multi:
            return
          batch = None
        local = None
        if batch is not None:
          local = segment_statistics(batch, update)
          self.lags.append(update - batch["policy_version"][batch["valid"].astype(bool)])
          if local["lag_max"] > self.eta or local["lag_mean"] < 0:
            raise StalenessError(f"update {update} got samples {local['lag_max']} versions old, more than eta={self.eta}")
        with self.watchdog.watch("update exchange", update + 1) if self.watchdog else contextlib.nullcontext():
          statistics = self._agree(update, local, self.stop_reason())
        if statistics is None:
          return
        start = self.activity.now()
        self._rng, rng = jax.random.split(self._rng)
        device_batch = self.put_batch({key: value for key, value in batch.items() if key != "policy_version"})
        update_fn = self._warmup_update if update < self.warmup_updates and self._warmup_update else self._update
        with self.watchdog.watch("update", update + 1) if self.watchdog else contextlib.nullcontext():
          params, opt_state, metrics = update_fn(self.params, self.opt_state, device_batch,
                                                 self.put_rng(np.asarray(jax.random.key_data(rng))))
          self.param_store.publish(params, update + 1)  # blocks until the arrays are ready (see ParamStore)
        self.params, self.opt_state, self.version = params, opt_state, update + 1
        end = self.activity.now()
        self.activity.busy("learner", start, end)
        self.samples_consumed += int(batch["valid"].sum())
        record = {"version": self.version, "time": end, "update_seconds": end - start,
                  "batch_envs": int(device_batch["reward"].shape[1]),  # global: every process's segments
                  **statistics, **{key: float(value) for key, value in jax.device_get(metrics).items()}}
        self.history.append(record)
        if self.on_update is not None:
          self.on_update(self.version, params, opt_state, record)
    except Stopped:
      return
    except Exception as error:
      self.error = error
      if self.on_fatal is not None:
        self.on_fatal(error)
      if self.group.multi and self._reported < self.version:  # peers wait for this update's report
        self.group.exchange(f"update/{self.version}", {"ready": False, "reason": f"error: {error!r}",
                                                       "statistics": None})
