"""Trace-driven RL-VLA3: recorded stage timings of the real components, replayed, and the bound they allow.

A trace (benchmarks/rl_trace.py writes one; benchmarks/traces/rl_components.json is this repo's)
holds, in milliseconds, samples of every stage of the pipeline measured alone on one machine:

    env[task]["cameras" | "no_cameras"]["chunk_ms"]   one shard's chunk step (16 native MuJoCo envs,
                                                      4 actions, resets of finished episodes included)
    actors[actor]["inference_ms"][batch]              the actor's sampler at each padded batch size
    actors[actor]["learner"]["update_ms"]             one learner update over `samples` chunk samples

`Setting` says how a pipeline is laid out over those components (which task each shard runs,
cameras, actor, shards, segments per update, and where inference and the learner run), `Replay`
makes a real ejax.rl.pipeline.RLPipeline spend the traced time in each stage (shards sleep an
empirical delay, the server's sampler and the learner's update are padded to a traced duration),
and `speedup_bound` computes from the trace alone what asynchrony can gain over the synchronous
baseline for that setting.

The bound. Synchronous (eta = 0 and a barrier), one update is ceil(B / S) segment rounds of T
steps, each step the inference of every shard's batch then the slowest shard's env step, and then
the learner's update, alone:
    t_sync = ceil(B / S) T (I(S n) + E[max_i e_i]) + L
(when S does not divide B the last round has fewer shards: its batch and max are theirs).
Asynchronous, each resource bounds the time of one update from below:
    env shards   B T / sum_i 1 / (E[e_i] + I_min)   (a shard's step also waits for its own inference,
                                                      at least one batch of the smallest padded size)
    server       B T min_k I(bucket(k n)) / k          (the cheapest inference per shard step)
    learner      L
and a device that runs both inference and the learner ("colocated") serialises them: server + L;
worse, while it updates no shard gets actions, so the shards' steps must fit between the updates.
Over a run of N updates the first update's data must be collected before the learner starts and
the last update cannot overlap anything, so
    t_async >= max(N c_env + L, N c_server + L, c + N L,
                   colocated: N (c_server + L), N L + (N B T - (2 N + 1) S) c_env / (B T)),
c = max(c_env, c_server),
and the bound is N t_sync / t_async. It reduces to E[max]/E[mean] of the env step times when
inference and the learner take no time, and to (E + I + L) / max(E, I + L) or / max(E, I, L) for
homogeneous shards: what overlapping the stages can give (at most 3x for three equal stages, 2x
when inference and the learner share a device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from ejax.rl.delays import DelaySampler, DelaySpec
from ejax.rl.inference import batch_buckets

PLACEMENTS = ("colocated", "separated")


@dataclasses.dataclass(frozen=True)
class Setting:
  """How a pipeline uses the traced components.

  tasks: shard i runs tasks[i % len(tasks)] (its env step times come from that task's samples);
  placement: "colocated" = inference server and learner on one device (rl.placement's default:
  inference_device -1 and no learner_devices), so their work is serialised; "separated" = on
  devices of their own (rl.placement.inference_device and rl.placement.learner_devices disjoint),
  so the two overlap. full_batch_only: rl.inference_full_batch_only (every batch padded to all shards).
  """
  name: str
  actor: str = "groot"
  cameras: bool = True
  tasks: tuple[str, ...] = ("goal_lift_green_block",)
  placement: str = "separated"
  num_shards: int = 4
  envs_per_shard: int = 16
  segment_length: int = 8
  segments_per_update: int = 8
  full_batch_only: bool = True
  eta: int = 2
  description: str = ""

  def __post_init__(self):
    if self.placement not in PLACEMENTS:
      raise ValueError(f"placement {self.placement!r}: use one of {PLACEMENTS}")
    object.__setattr__(self, "tasks", tuple(self.tasks))

  def shard_tasks(self) -> list[str]:
    return [self.tasks[i % len(self.tasks)] for i in range(self.num_shards)]

  @property
  def buckets(self) -> list[int]:
    buckets = batch_buckets(self.envs_per_shard, self.num_shards)
    return buckets[-1:] if self.full_batch_only else buckets

  def bucket(self, size: int) -> int:
    return next(b for b in self.buckets if b >= size)


class Trace:
  """A recorded trace (see the module docstring); every time it returns is in seconds."""

  def __init__(self, data: dict):
    self.data = data
    self.shape = data.get("shape", {})
    self.recorded = data.get("recorded", {})

  @classmethod
  def load(cls, path: str) -> "Trace":
    with open(path) as f:
      return cls(json.load(f))

  @property
  def tasks(self) -> list[str]:
    return sorted(self.data["env"])

  def env_seconds(self, task: str, cameras: bool) -> np.ndarray:
    if task not in self.data["env"]:
      raise KeyError(f"task {task!r} is not in the trace (it has {self.tasks})")
    return 1e-3 * np.asarray(self.data["env"][task]["cameras" if cameras else "no_cameras"]["chunk_ms"], np.float64)

  def inference_seconds(self, actor: str, batch: int) -> np.ndarray:
    """Samples at `batch`; a size beyond the largest recorded one scales its samples linearly."""
    recorded = {int(size): samples for size, samples in self.data["actors"][actor]["inference_ms"].items()}
    if batch in recorded:
      return 1e-3 * np.asarray(recorded[batch], np.float64)
    size = min((s for s in recorded if s >= batch), default=max(recorded))
    return 1e-3 * np.asarray(recorded[size], np.float64) * max(1.0, batch / size)

  def learner_seconds(self, actor: str, samples: int | None = None) -> np.ndarray:
    """Update times; for a batch of `samples` chunk samples, scaled linearly from the recorded batch."""
    learner = self.data["actors"][actor]["learner"]
    scale = 1.0 if samples is None else samples / learner["samples"]
    return 1e-3 * scale * np.asarray(learner["update_ms"], np.float64)

  def episode_lengths(self, task: str, cameras: bool = False) -> list[int]:
    return list(self.data["env"][task]["cameras" if cameras else "no_cameras"]["episode_length"])

  def shard_specs(self, setting: Setting, time_scale: float = 1.0) -> list[DelaySpec]:
    """Each shard's env step time, an empirical delay over its task's recorded chunk times."""
    return [DelaySpec(kind="empirical", samples=tuple(time_scale * self.env_seconds(task, setting.cameras)))
            for task in setting.shard_tasks()]


def speedup_bound(trace: Trace, setting: Setting, num_updates: int, *, time_scale: float = 1.0,
                  samples: int = 100_000, seed: int = 0) -> dict[str, Any]:
  """What the trace allows for `setting` over `num_updates` updates (see the module docstring):
  {"bound", "sync_seconds", "async_seconds" (a lower bound), "limit" (the resource that sets it),
  per-update terms, and E[max] / E[mean] of the shards' env steps}. Monte Carlo for E[max]."""
  s, n, t, b = setting.num_shards, setting.envs_per_shard, setting.segment_length, setting.segments_per_update
  specs = trace.shard_specs(setting, time_scale)
  env = np.stack([DelaySampler(spec, seed + i).sample(samples) for i, spec in enumerate(specs)])  # [S, samples]
  env_max, env_means = float(env.max(axis=0).mean()), np.array([spec.expected() for spec in specs])
  inference = {size: time_scale * float(np.mean(trace.inference_seconds(setting.actor, size)))
               for size in setting.buckets}
  learner = time_scale * float(np.mean(trace.learner_seconds(setting.actor, b * t * n)))

  # Synchronous: segment j is collected by shard j mod S, so round r of an update's segments has
  # min(S, B - r S) shards at the barrier (the first ones).
  rounds = [min(s, b - r * s) for r in range(math.ceil(b / s))]
  sync_update = learner + sum(t * (inference[setting.bucket(k * n)] + float(env[:k].max(axis=0).mean()))
                              for k in rounds)
  smallest = inference[setting.bucket(n)]
  env_update = b * t / float(np.sum(1.0 / (env_means + smallest)))
  server_update = b * t * min(inference[setting.bucket(k * n)] / k for k in range(1, s + 1))
  collect = max(env_update, server_update)
  terms = {"env shards": num_updates * env_update + learner, "inference server": num_updates * server_update + learner,
           "learner": collect + num_updates * learner}
  if setting.placement == "colocated":
    # One device: its inference and updates add up; and while it updates, no shard gets actions,
    # so each shard can finish at most the one step it holds actions for (S steps per update, and
    # S more per gap between updates for the partial cycles at their edges).
    steps = max(0, num_updates * b * t - (2 * num_updates + 1) * s)
    terms["inference + learner (one device)"] = num_updates * (server_update + learner)
    terms["env shards between updates (one device)"] = num_updates * learner + steps * env_update / (b * t)
  limit = max(terms, key=terms.get)
  async_run, sync_run = terms[limit], num_updates * sync_update
  return {"bound": sync_run / async_run, "sync_seconds": sync_run, "async_seconds": async_run, "limit": limit,
          "sync_update_seconds": sync_update, "env_update_seconds": env_update,
          "server_update_seconds": server_update, "learner_seconds": learner,
          "inference_seconds": inference, "env_max_seconds": env_max, "env_mean_seconds": float(env_means.mean()),
          "env_max_over_mean": env_max / float(env_means.mean())}


class _TracedPolicy:
  """A FlowPolicy whose jit_sample takes the traced time (everything else is the policy's own)."""

  def __init__(self, policy, jit_sample: Callable):
    self._policy = policy
    self.jit_sample = jit_sample

  def __getattr__(self, name):
    return getattr(self._policy, name)


class Replay:
  """Makes a real RLPipeline spend the traced time in each stage of `setting`.

  - env shards: config.shard_delays = `shard_delays()` (empirical delays over each shard's task);
  - inference: `policy(p)` wraps p.jit_sample: the real call, then a sleep up to a duration drawn
    from the trace at the batch's padded size;
  - learner: `update_wrapper` (RLPipeline's argument) does the same with the traced update time.
  With placement "colocated" both hold one lock for their whole traced duration: one device.
  time_scale multiplies every traced time (the ratio of the two arms does not depend on it as long
  as the real, untraced work stays small beside it).
  """

  def __init__(self, trace: Trace, setting: Setting, *, time_scale: float = 1.0, seed: int = 0):
    self.trace, self.setting, self.time_scale = trace, setting, time_scale
    self.device = threading.Lock() if setting.placement == "colocated" else contextlib.nullcontext()
    self._inference_rng = np.random.default_rng(seed + 1)
    self._learner_rng = np.random.default_rng(seed + 2)
    self._inference = {size: time_scale * trace.inference_seconds(setting.actor, size) for size in setting.buckets}
    samples = setting.segments_per_update * setting.segment_length * setting.envs_per_shard
    self._learner = time_scale * trace.learner_seconds(setting.actor, samples)
    self.inference_calls: list[tuple[int, float]] = []  # (padded batch, seconds): what the replay spent
    self.learner_calls: list[float] = []

  def shard_delays(self) -> list[dict]:
    return [dict(kind="empirical", samples=list(spec.samples)) for spec in self.trace.shard_specs(self.setting,
                                                                                                  self.time_scale)]

  def _inference_time(self, size: int) -> float:
    samples = self._inference.get(size)
    if samples is None:  # a size the setting's buckets do not have (the caller padded differently)
      samples = self.time_scale * self.trace.inference_seconds(self.setting.actor, size)
    return float(samples[self._inference_rng.integers(len(samples))])

  def policy(self, policy):
    inner = policy.jit_sample

    def jit_sample(params, observation, rng):
      size = len(jax.tree.leaves(observation)[0])
      with self.device:
        start, target = time.perf_counter(), self._inference_time(size)
        result = jax.block_until_ready(inner(params, observation, rng))
        _sleep_until(start + target)
        self.inference_calls.append((size, time.perf_counter() - start))
      return result

    return _TracedPolicy(policy, jit_sample)

  def update_wrapper(self, update_fn: Callable) -> Callable:
    def update(*args, **kwargs):
      with self.device:
        start = time.perf_counter()
        target = float(self._learner[self._learner_rng.integers(len(self._learner))])
        result = jax.block_until_ready(update_fn(*args, **kwargs))
        _sleep_until(start + target)
        self.learner_calls.append(time.perf_counter() - start)
      return result

    return update


def _sleep_until(deadline: float) -> None:
  remaining = deadline - time.perf_counter()
  if remaining > 0:
    time.sleep(remaining)
