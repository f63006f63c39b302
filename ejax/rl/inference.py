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
from typing import Any, Callable

import jax
import jax.numpy as jnp
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


def concat_rows(parts: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], list[int]]:
  """Requests' batches {key: [n_i, ...]} -> one batch {key: [sum n_i, ...]} and the sizes n_i."""
  sizes = [len(next(iter(part.values()))) for part in parts]
  return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}, sizes


def pad_rows(batch: dict[str, np.ndarray], buckets: list[int]) -> dict[str, np.ndarray]:
  """batch {key: [n, ...]} padded up to the smallest bucket >= n, so that only the buckets' shapes
  are ever compiled. Repeating the last row keeps the padding a valid input (no NaNs from zeros in
  norms); object arrays (instructions) pad the same way."""
  size = len(next(iter(batch.values())))
  bucket = next((b for b in buckets if b >= size), None)
  if bucket is None:
    raise ValueError(f"a batch of {size} exceeds the largest bucket {buckets[-1]}")
  if bucket == size:
    return batch
  return {key: np.concatenate([value, np.repeat(value[-1:], bucket - size, axis=0)]) for key, value in batch.items()}


def split_rows(result: dict[str, np.ndarray], sizes: list[int]) -> list[dict[str, np.ndarray]]:
  """The inverse of concat_rows on a (padded) result: each request's rows, padding dropped."""
  parts, offset = [], 0
  for size in sizes:
    parts.append(jax.tree.map(lambda value, start=offset: value[start:start + size], result))  # nested: a cached context
    offset += size
  return parts


def inference_weights(kind: str, device: jax.Device | None = None, *,
                      setting: str = "inference_weights") -> Callable[[Any], Any] | None:
  """What parameters go through on their way to an inference server (None: nothing): "same", or
  "fp8_block", where weight matrices take the values block-FP8 storage can hold (vectors: biases,
  norms, stay), then everything moves to `device` when one is given."""
  if kind not in ("same", "fp8_block"):
    raise ValueError(f"{setting}={kind!r}: use 'same' or 'fp8_block'")
  place = (lambda tree: jax.device_put(tree, device)) if device is not None else (lambda tree: tree)
  if kind == "same":
    return place if device is not None else None
  from ejax.kernels.fp8.quantize import dequantize, quantize_blockwise

  @jax.jit
  def block_fp8(tree):
    return jax.tree.map(lambda x: dequantize(quantize_blockwise(x), x.dtype)
                        if x.ndim == 2 and jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

  return lambda tree: place(block_fp8(tree))


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

  def _run(self) -> None:
    try:
      while True:
        requests, waited = self._take()
        self.activity.wait("inference_requests", waited)
        start = self.activity.now()
        version, params = self.param_store.latest()
        observation, sizes = concat_rows([request.observation for request in requests])
        keys = None
        if all(request.keys is not None for request in requests):  # the shards' own per-env keys
          keys = pad_rows({"keys": np.concatenate([request.keys for request in requests])}, self.buckets)["keys"]
        observation = pad_rows(observation, self.buckets)
        if self.device is not None:
          observation = jax.device_put(observation, self.device)
        self._rng, rng = jax.random.split(self._rng)
        if keys is not None:
          rng = jax.random.wrap_key_data(keys if self.device is None else jax.device_put(keys, self.device))
        # One host copy of the whole result, then numpy slices: cheaper than one device slice per leaf and shard.
        result = jax.device_get(self._sample(params, observation, rng))
        self.activity.busy("inference", start, self.activity.now())
        for request, rows in zip(requests, split_rows(result, sizes)):
          request.reply.put((version, rows))
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
