"""Dynamic batching of concurrent clients' requests on the device, on one thread.

The thread takes the oldest request, then whatever else is queued, and waits up to max_wait for
more while fewer requests than active clients are in hand (clients that sent a request within the
last second: a lone client never waits, nor do busy clients for idle connections). The
batch is concatenated, padded up to a size bucket (1, 2, 4, ... max_batch: one compilation each)
and sampled with one policy.act call; every request gets its own rows back. Concatenation, padding
and splitting are the RL inference server's (ejax/rl/inference.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import jax
import numpy as np

from ejax.rl.coordination import WAIT_SLICE_S
from ejax.rl.inference import batch_buckets, concat_rows, pad_rows, split_rows
from ejax.serve.spec import NOISE_KEY, PROMPT_KEY, ObservationSpec

logger = logging.getLogger(__name__)

ACTIVE_WINDOW_S = 1.0  # a client that sent a request this recently is expected to send the next one


@dataclasses.dataclass
class Request:
  inputs: dict[str, np.ndarray]  # ObservationSpec.check's output: [1, ...] per key
  future: asyncio.Future
  loop: asyncio.AbstractEventLoop
  queued_at: float


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
  if future.done():  # the client went away
    return
  if error is not None:
    future.set_exception(error)
  else:
    future.set_result(result)


class Batcher:
  """submit(inputs) -> {"actions": [horizon, action_dim], "infer_ms", "queue_ms", "batch_size"}."""

  def __init__(self, policy, spec: ObservationSpec, *, max_batch: int, max_wait_ms: float, seed: int = 0):
    if max_batch < 1:
      raise ValueError(f"serve.max_batch={max_batch}: needs at least 1")
    self.policy, self.spec = policy, spec
    self.buckets = batch_buckets(1, max_batch)
    self.max_batch, self.max_wait_s = max_batch, max_wait_ms / 1000.0
    self._last_request: dict[Any, float] = {}  # client -> when it last sent a request
    self.batch_sizes: list[int] = []
    self._noise_rng = np.random.default_rng(seed)
    self._key = jax.random.key(seed)  # act's rng; unused, since every request's noise is explicit
    self._queue: queue.Queue[Request] = queue.Queue()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="serve-batcher", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()

  def warmup(self) -> None:
    """Compiles every bucket's program now, so that no client waits for a compilation."""
    inputs = self.spec.check(self.spec.example())
    for bucket in self.buckets:
      start = time.perf_counter()
      self._act(pad_rows(self._with_noise(inputs), [bucket]))
      logger.info("serve: batch size %d compiled in %.1f s", bucket, time.perf_counter() - start)

  def forget(self, client: Any) -> None:
    """The client disconnected: batches stop expecting its requests."""
    self._last_request.pop(client, None)

  def _active_clients(self) -> int:
    recent = time.perf_counter() - ACTIVE_WINDOW_S
    return sum(1 for seen in list(self._last_request.values()) if seen >= recent)

  async def submit(self, inputs: dict[str, np.ndarray], client: Any = None) -> dict[str, Any]:
    """Queues one request of `client` (any hashable naming the connection) and awaits its result."""
    self._last_request[client] = time.perf_counter()
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    self._queue.put(Request(inputs, future, loop, time.perf_counter()))
    return await future

  def _with_noise(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if NOISE_KEY in inputs:
      return inputs
    noise = self._noise_rng.standard_normal((1, *self.spec.noise_shape)).astype(np.float32)
    return {**inputs, NOISE_KEY: noise}

  def _act(self, batch: dict[str, np.ndarray]) -> np.ndarray:
    batch = dict(batch)
    instructions = [str(prompt) for prompt in batch.pop(PROMPT_KEY)]
    noise = batch.pop(NOISE_KEY)
    return self.policy.act(batch, instructions, self._key, noise=noise)

  def _run(self) -> None:
    while not self._stop.is_set():
      try:
        first = self._queue.get(timeout=WAIT_SLICE_S)
      except queue.Empty:
        continue
      self._serve(self._gather(first))

  def _gather(self, first: Request) -> list[Request]:
    requests, deadline = [first], time.perf_counter() + self.max_wait_s
    expected = self._active_clients()
    while len(requests) < self.max_batch:
      try:
        requests.append(self._queue.get_nowait())
        continue
      except queue.Empty:
        pass
      remaining = deadline - time.perf_counter()
      if len(requests) >= expected or remaining <= 0:
        break
      try:
        requests.append(self._queue.get(timeout=remaining))
      except queue.Empty:
        break
    return requests

  def _serve(self, requests: list[Request]) -> None:
    start = time.perf_counter()
    try:
      batch, sizes = concat_rows([self._with_noise(request.inputs) for request in requests])
      actions = self._act(pad_rows(batch, self.buckets))
      results = split_rows({"actions": actions}, sizes)
    except Exception as error:  # the server keeps serving: every request of the batch gets the error
      logger.exception("serve: a batch of %d failed", len(requests))
      for request in requests:
        request.loop.call_soon_threadsafe(_resolve, request.future, None, error)
      return
    done = time.perf_counter()
    self.batch_sizes.append(len(requests))
    for request, rows in zip(requests, results):
      result = {"actions": rows["actions"][0], "infer_ms": 1000.0 * (done - start),
                "queue_ms": 1000.0 * (start - request.queued_at), "batch_size": len(requests)}
      request.loop.call_soon_threadsafe(_resolve, request.future, result, None)
