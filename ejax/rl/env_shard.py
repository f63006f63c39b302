"""Level 1: an env shard, a batch of environments stepped by one jitted call on its own thread.

A shard takes a segment ticket, waits for a policy recent enough for it (the staleness gate), then
for `segment_length` steps posts its observations to the inference server, executes the returned
action chunk in one jitted call, sleeps its sampled delay (a slow simulator or a real robot), and
finally queues the segment for the learner. Shards never wait for each other unless the pipeline
runs with a barrier (the synchronous baseline).

A shard whose step raises, or returns non-finite observations or rewards, is restarted: its
segment ticket goes back to the pool, its environments are reset, the restart is counted, and the
run goes on; past `max_restarts` the error stops the pipeline.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ejax.rl.coordination import (InferenceRequest, ParamStore, RequestBoard, SegmentTickets, Stopped,
                                  get_until_stopped, put_until_stopped)
from ejax.rl.delays import DelaySampler
from ejax.rl.timeline import ActivityLog


class ShardFault(RuntimeError):
  """An environment step produced unusable data (non-finite observations or rewards)."""


def _tree_where(condition: jax.Array, on_true: Any, on_false: Any) -> Any:
  return jax.tree.map(lambda a, b: jnp.where(jnp.reshape(condition, condition.shape + (1,) * (a.ndim - condition.ndim)), a, b),
                      on_true, on_false)


def make_chunk_step(env, actions_per_step: int, auto_reset: bool) -> Callable:
  """(states [n], action chunks [n, h, a], rngs [n]) -> (states, reward_sum, done, success): one
  jitted call executes the first `actions_per_step` actions of every env's chunk.

  An env whose episode ends inside the chunk ignores the rest of it; with auto_reset it starts a
  new episode at once, so the next observation is the new episode's first (done marks the cut).
  """

  def one_env(state, chunk, rng):
    def body(carry, action):
      state, reward_sum, ended, succeeded = carry
      next_state = env.step(state, action)
      reward_sum = reward_sum + jnp.where(ended, 0.0, next_state.reward)
      succeeded = succeeded | (~ended & next_state.success)
      state = _tree_where(ended, state, next_state)
      return (state, reward_sum, ended | next_state.done, succeeded), None

    initial = (state, jnp.zeros((), jnp.float32), jnp.zeros((), bool), jnp.zeros((), bool))
    (state, reward_sum, done, success), _ = jax.lax.scan(body, initial, chunk[:actions_per_step])
    if auto_reset:
      state = _tree_where(done, env.reset(rng), state)
    return state, reward_sum, done, success

  return jax.jit(jax.vmap(one_env))


def make_reset(env) -> Callable:
  return jax.jit(jax.vmap(env.reset))


_ENV_FUNCTIONS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def env_functions(env, actions_per_step: int, auto_reset: bool) -> tuple[Callable, Callable]:
  """(batched reset, chunk step) for `env`, jitted once per env object and reused by every shard
  and every pipeline that runs it: each new jit wrapper would compile again."""
  cache = _ENV_FUNCTIONS.setdefault(env, {})
  key = (actions_per_step, auto_reset)
  if key not in cache:
    cache[key] = (make_reset(env), make_chunk_step(env, actions_per_step, auto_reset))
  return cache[key]


class NativeSimEnv:
  """An ejax.sim task stepped by native MuJoCo in the env shards (rl.env.backend="native").

  The MJX env is one pure env that every shard jits and vmaps; native physics keeps one MjData per
  env, so each shard builds its own batch (`functions`). Same tasks, controller and task maths as MJX
  (ejax.sim.native), several times faster on a CPU, and no MJX solver loop on the learner's host.
  """

  def __init__(self, task: str, *, cameras: bool = False, image_size=(64, 64), num_threads: int | None = None):
    self.task, self.cameras, self.image_size, self.num_threads = task, cameras, tuple(image_size), num_threads

  def functions(self, num_envs: int, actions_per_step: int, auto_reset: bool) -> tuple[Callable, Callable]:
    """(reset(keys [n]) -> state, chunk_step(state, chunks [n, h, a], keys [n]) -> (state, reward_sum,
    done, success)) over a new batch of `num_envs` native envs: make_chunk_step's contract."""
    from ejax.sim.batched import make_batched
    batch = make_batched(self.task, num_envs, backend="native", cameras=self.cameras, image_size=self.image_size,
                         num_threads=self.num_threads)

    def reset(keys):
      return batch.reset(keys=keys)

    def chunk_step(state, chunks, keys):
      chunks = np.asarray(chunks, np.float32)
      reward_sum = np.zeros((num_envs,), np.float32)
      ended, succeeded = np.zeros((num_envs,), bool), np.zeros((num_envs,), bool)
      for k in range(min(actions_per_step, chunks.shape[1])):
        next_state = batch.step(state, chunks[:, k])
        reward_sum += np.where(ended, 0.0, np.asarray(next_state.reward, np.float32))
        succeeded |= ~ended & np.asarray(next_state.success, bool)
        state = jax.tree.map(lambda old, new: np.where(ended.reshape(ended.shape + (1,) * (np.ndim(new) - 1)), old, new),
                             state, next_state)
        ended |= np.asarray(next_state.done, bool)
      if auto_reset and ended.any():
        state = batch.reset(keys=keys, state=state, where=ended)
      return state, reward_sum, ended, succeeded

    return reset, chunk_step


class EnvShard:
  """One thread driving `num_envs` environments through segments of `segment_length` steps.

  mode "gae": environments reset themselves when an episode ends; segments cut across episodes.
  mode "grpo": each segment is one episode per env, every `group_size` consecutive envs start from
  the same reset key (the same task and initial state), finished envs are masked out (valid = 0).
  """

  def __init__(self, shard_id: int, env_functions: tuple[Callable, Callable], *, num_envs: int, segment_length: int,
               actions_per_step: int,
               mode: str, group_size: int, tickets: SegmentTickets, board: RequestBoard,
               segment_queue: queue.Queue, param_store: ParamStore, delay: DelaySampler,
               activity: ActivityLog, stop: threading.Event, seed: int, max_restarts: int,
               device: jax.Device | None = None, on_fatal: Callable[[BaseException], None] | None = None,
               fault_injector: Callable[[int, int, np.ndarray], np.ndarray] | None = None,
               success_bonus: float = 0.0, observation_filter: Callable[[dict], dict] | None = None):
    """env_functions: (batched reset, chunk step) from `env_functions`, shared by all shards of an env.
    fault_injector(shard_id, step, reward) -> reward runs after every step; tests raise from it or
    return corrupted rewards to exercise the restart path.
    success_bonus is added to the reward of the chunk in which an episode succeeds: success ends the
    episode, so without it a policy that hovers near the goal collecting dense reward would be worth
    more than one that finishes (the bonus stands for the reward a finished episode forgoes).
    observation_filter (FlowPolicy.select_observations) keeps what the policy reads: what the
    shard posts for inference and queues for the learner (e.g. no depth images)."""
    if mode not in ("gae", "grpo"):
      raise ValueError(f"env shard mode {mode!r}: use 'gae' or 'grpo'")
    if mode == "grpo" and num_envs % group_size:
      raise ValueError(f"GRPO needs envs per shard ({num_envs}) to be a multiple of group_size ({group_size})")
    self.shard_id, self.num_envs, self.segment_length = shard_id, num_envs, segment_length
    self.mode, self.group_size, self.actions_per_step = mode, group_size, actions_per_step
    self.tickets, self.board, self.segment_queue, self.param_store = tickets, board, segment_queue, param_store
    self.delay, self.activity, self.stop, self.device = delay, activity, stop, device
    self.max_restarts, self.on_fatal, self.fault_injector = max_restarts, on_fatal, fault_injector
    self.success_bonus = float(success_bonus)
    self.observation_filter = observation_filter or (lambda observation: observation)
    self.name = f"env{shard_id}"
    self._rng = jax.random.key(seed)
    self._reset, self._chunk_step = env_functions
    self._reply: queue.Queue = queue.Queue(maxsize=1)
    self._steps_done = 0  # chunk steps of this shard (used by fault injection in tests)
    self.restarts = 0
    self.env_steps = 0  # individual actions executed across this shard's envs
    self.segments = 0
    self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)

  # -- lifecycle -------------------------------------------------------------------------------

  def start(self) -> None:
    self.thread.start()

  def _next_rng(self) -> jax.Array:
    self._rng, rng = jax.random.split(self._rng)
    return rng

  def _reset_all(self, group_keys: bool = False):
    if group_keys:
      keys = jax.random.split(self._next_rng(), self.num_envs // self.group_size)
      keys = jnp.repeat(keys, self.group_size, axis=0)
    else:
      keys = jax.random.split(self._next_rng(), self.num_envs)
    if self.device is not None:
      keys = jax.device_put(keys, self.device)
    return self._reset(keys)

  def _run(self) -> None:
    try:
      self._run_with_restarts()
    finally:
      self.board.retire(self.shard_id)  # a barrier must never wait for a shard that has left

  def _run_with_restarts(self) -> None:
    while True:
      ticket = None
      try:
        state = self._reset_all()
        while True:
          ticket = self.tickets.take(self.shard_id)
          if ticket is None:
            return
          state = self._collect(ticket, state)
          ticket = None
      except Stopped:
        return
      except Exception as error:  # a simulator fault: restart this shard, keep the run going
        self.board.unregister(self.shard_id)
        if ticket is not None:
          self.tickets.give_back(ticket)
        self.restarts += 1
        if self.restarts > self.max_restarts:
          if self.on_fatal is not None:
            self.on_fatal(RuntimeError(f"env shard {self.shard_id} failed {self.restarts} times "
                                       f"(max_restarts={self.max_restarts}); last error: {error!r}"))
          return

  # -- one segment ---------------------------------------------------------------------------

  def _collect(self, ticket: int, state):
    required = self.tickets.required_version(ticket)
    self.board.register(self.shard_id, required)
    self.activity.wait("env_staleness_gate", self.param_store.wait_for_version(required, self.stop))
    if self.mode == "grpo":
      state = self._reset_all(group_keys=True)
    alive = np.ones((self.num_envs,), bool)
    steps = []
    for step in range(self.segment_length):
      observation = {key: np.asarray(value) for key, value in self.observation_filter(state.obs).items()}
      # The shard's own sampling key per env: a chunk does not depend on who shares the server's batch.
      keys = np.asarray(jax.random.key_data(jax.random.split(self._next_rng(), self.num_envs)))
      self.board.post(InferenceRequest(self.shard_id, observation, None, self._reply, time.perf_counter(), keys))
      (version, sample), waited = get_until_stopped(self._reply, self.stop)
      self.activity.wait("env_inference", waited)
      if step == self.segment_length - 1:
        self.board.unregister(self.shard_id)  # no more requests from this segment: do not wait for it

      start = self.activity.now()
      actions = jnp.asarray(sample["actions"]) if self.device is None else jax.device_put(sample["actions"], self.device)
      rngs = jax.random.split(self._next_rng(), self.num_envs)
      state, reward, done, success = self._chunk_step(state, actions, rngs)
      reward, done, success = np.asarray(reward), np.asarray(done), np.asarray(success)
      if self.success_bonus:
        reward = reward + self.success_bonus * success
      if self.fault_injector is not None:
        reward = self.fault_injector(self.shard_id, self._steps_done, reward)
      if not np.all(np.isfinite(reward)) or not all(
          np.all(np.isfinite(np.asarray(value))) for value in jax.tree.leaves(state.obs)
          if np.issubdtype(np.asarray(value).dtype, np.floating)):
        raise ShardFault(f"env shard {self.shard_id}: non-finite observation or reward at step {step}")
      time.sleep(self.delay.sample())
      self.activity.busy(self.name, start, self.activity.now())
      self._steps_done += 1
      self.env_steps += self.num_envs * min(self.actions_per_step, int(actions.shape[1]))

      steps.append({"observation": observation, "chain": sample["chain"], "step_index": sample["step_index"],
                    "log_prob": sample["log_prob"], "value": sample["value"],
                    "policy_version": np.full((self.num_envs,), version, np.int32),
                    "reward": reward.astype(np.float32), "done": done, "success": success, "valid": alive.copy(),
                    **({"context": sample["context"]} if "context" in sample else {})})
      if self.mode == "grpo":
        alive &= ~done

    segment = jax.tree.map(lambda *xs: np.stack(xs), *steps)  # every leaf [T, num_envs, ...]
    segment["bootstrap_observation"] = {key: np.asarray(value)
                                        for key, value in self.observation_filter(state.obs).items()}
    segment["ticket"], segment["shard_id"] = ticket, self.shard_id
    self.activity.wait("env_queue_put", put_until_stopped(self.segment_queue, segment, self.stop))
    self.tickets.finish(ticket)
    self.segments += 1
    return state
