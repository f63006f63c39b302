"""Level 2: the inference server, dynamic batching over whichever env shards are ready.

One thread takes the pending observation batches of every shard that has posted (all registered
shards in barrier mode), concatenates them, pads the batch up to a size bucket so that only a few
shapes are ever compiled, samples action chunks with Flow-SDE, and answers each shard with its
slice, tagged with the policy version that produced it. Before every batch it picks up the newest
published parameters: the learner never has to stop the server to update it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import jax
import numpy as np

from ejax.rl.coordination import ParamStore, RequestBoard, Stopped
from ejax.rl.timeline import ActivityLog


def batch_buckets(envs_per_shard: int, num_shards: int) -> list[int]:
  """Padded batch sizes: envs_per_shard times 1, 2, 4, ... shards, and all shards."""
  buckets, shards = [], 1
  while shards < num_shards:
    buckets.append(shards * envs_per_shard)
    shards *= 2
  return buckets + [num_shards * envs_per_shard]


class InferenceServer:
  def __init__(self, sample_fn: Callable, *, board: RequestBoard, param_store: ParamStore, num_shards: int,
               envs_per_shard: int, barrier: bool, activity: ActivityLog, stop: threading.Event, seed: int,
               device: jax.Device | None = None, full_batch_only: bool = False, on_fatal: Callable[[BaseException], None] | None = None):
    """sample_fn(params, observation, rng) -> dict of [n, ...] arrays: a jitted FlowPolicy.sample.
    full_batch_only pads every batch to all shards: one compilation instead of one per bucket."""
    self._sample = sample_fn
    self.board, self.param_store, self.barrier = board, param_store, barrier
    self.num_shards, self.activity, self.stop, self.device, self.on_fatal = num_shards, activity, stop, device, on_fatal
    self.buckets = batch_buckets(envs_per_shard, num_shards)[-1:] if full_batch_only else batch_buckets(envs_per_shard, num_shards)
    self._rng = jax.random.key(seed)
    self.batches = 0
    self.samples = 0
    self.batch_shards: list[int] = []  # shards served per batch (dynamic batching at work)
    self.thread = threading.Thread(target=self._run, name="inference", daemon=True)

  def start(self) -> None:
    self.thread.start()

  def _padded(self, observation: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    bucket = next(b for b in self.buckets if b >= size)
    if bucket == size:
      return observation
    # Repeating the last row keeps the padding a valid observation (no NaNs from zeros in norms).
    return {key: np.concatenate([value, np.repeat(value[-1:], bucket - size, axis=0)]) for key, value in observation.items()}

  def _run(self) -> None:
    try:
      while True:
        requests, waited = self._take()
        self.activity.wait("inference_requests", waited)
        start = self.activity.now()
        version, params = self.param_store.latest()
        sizes = [len(next(iter(request.observation.values()))) for request in requests]
        observation = {key: np.concatenate([request.observation[key] for request in requests])
                       for key in requests[0].observation}
        observation = self._padded(observation, sum(sizes))
        if self.device is not None:
          observation = jax.device_put(observation, self.device)
        self._rng, rng = jax.random.split(self._rng)
        # One host copy of the whole result, then numpy slices: cheaper than one device slice per leaf and shard.
        result = jax.device_get(self._sample(params, observation, rng))
        self.activity.busy("inference", start, self.activity.now())
        offset = 0
        for request, size in zip(requests, sizes):
          request.reply.put((version, {key: value[offset:offset + size] for key, value in result.items()}))
          offset += size
        self.batches += 1
        self.samples += sum(sizes)
        self.batch_shards.append(len(requests))
    except Stopped:
      return
    except Exception as error:
      if self.on_fatal is not None:
        self.on_fatal(error)

  def _take(self):
    start = time.perf_counter()
    requests = self.board.take_batch(barrier=self.barrier, max_shards=self.num_shards, stop=self.stop)
    return requests, time.perf_counter() - start
