"""The thread-safe meeting points of the RL pipeline: versioned parameters, segment tickets with
the staleness gate, the inference request board, and a bounded queue that never strands a thread.

Every blocking call here waits in short slices and returns (or raises `Stopped`) once the shared
stop event is set, so shutdown on error, on SIGTERM or at the end never leaves a thread hanging.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any

import jax

WAIT_SLICE_S = 0.05  # how often a blocked thread re-checks the stop event


class Stopped(Exception):
  """Raised inside a component when the pipeline is shutting down while it waited."""


class ParamStore:
  """Versioned parameters published by the learner and read by the inference server.

  Version 0 is the initial policy; the learner publishes version k + 1 after its update k. Readers
  take the newest reference without locking out the writer for longer than a pointer swap, so the
  server keeps serving while new parameters arrive.
  """

  def __init__(self, params: Any, version: int = 0, device_put=None):
    self._device_put = device_put or (lambda tree: tree)
    self._condition = threading.Condition()
    self._params = self._prepare(params)
    self._version = version

  def _prepare(self, params: Any) -> Any:
    params = self._device_put(params)
    # Hand over only finished arrays: the server thread would otherwise race the learner's still
    # running jitted update on the same buffers, and a thread that races a jitted call can hang.
    return jax.block_until_ready(params)

  def publish(self, params: Any, version: int) -> None:
    params = self._prepare(params)
    with self._condition:
      if version <= self._version:
        raise ValueError(f"published version {version} is not newer than the current {self._version}")
      self._params, self._version = params, version
      self._condition.notify_all()

  def latest(self) -> tuple[int, Any]:
    with self._condition:
      return self._version, self._params

  @property
  def version(self) -> int:
    with self._condition:
      return self._version

  def wait_for_version(self, minimum: int, stop: threading.Event) -> float:
    """Blocks until version >= minimum; returns the seconds waited."""
    start = time.perf_counter()
    with self._condition:
      while self._version < minimum:
        if stop.is_set():
          raise Stopped()
        self._condition.wait(WAIT_SLICE_S)
    return time.perf_counter() - start


class SegmentTickets:
  """Hands out the numbers of trajectory segments to collect and enforces bounded staleness.

  Segment j is consumed by learner update j // segments_per_update (the learner trains on segments
  in ticket order). A shard may start segment j only once the published version is at least
  j // segments_per_update - eta, so every sample of that segment comes from a policy at most eta
  versions behind the update that trains on it: lag <= eta by construction. A segment whose shard
  failed goes back into the pool, so the learner's ticket sequence never has a hole.
  """

  def __init__(self, total_segments: int, segments_per_update: int, eta: int, first_ticket: int = 0,
               fixed_shards: list[int] | None = None):
    """fixed_shards (the shard ids, in order): segment j always goes to shard fixed_shards[j % S]
    (the synchronous baseline: which shard collects which segment, and so the learner's batch order,
    no longer depends on thread timing). None: any shard takes the next free segment (async)."""
    self.total_segments = total_segments
    self.segments_per_update = segments_per_update
    self.eta = eta
    self._next = first_ticket
    self._fixed = list(fixed_shards) if fixed_shards else None
    self._shard_next: dict[int, int] = {}  # fixed_shards: each shard's next own segment
    self._returned: list[int] = []
    self._lock = threading.Lock()
    self.in_flight = 0  # segments taken and not yet finished or returned

  def _owner(self, ticket: int) -> int | None:
    return None if self._fixed is None else self._fixed[ticket % len(self._fixed)]

  def _next_of(self, shard_id: int) -> int:
    """fixed_shards: the shard's next segment, the first at or after the start that it owns."""
    position, count = self._fixed.index(shard_id), len(self._fixed)
    return self._shard_next.get(shard_id, self._next + (position - self._next) % count)

  def take(self, shard_id: int | None = None) -> int | None:
    """The next segment number for `shard_id`, or None when every segment of the run (of this shard,
    with fixed_shards) has been handed out."""
    with self._lock:
      if self._fixed is None:
        mine = self._returned
      else:
        mine = [ticket for ticket in self._returned if self._owner(ticket) == shard_id]
      if mine:
        ticket = min(mine)
        self._returned.remove(ticket)
      elif self._fixed is None:
        if self._next >= self.total_segments:
          return None
        ticket, self._next = self._next, self._next + 1
      else:
        ticket = self._next_of(shard_id)
        if ticket >= self.total_segments:
          return None
        self._shard_next[shard_id] = ticket + len(self._fixed)
      self.in_flight += 1
      return ticket

  def required_version(self, ticket: int) -> int:
    return max(0, ticket // self.segments_per_update - self.eta)

  def finish(self, ticket: int) -> None:
    with self._lock:
      self.in_flight -= 1

  def give_back(self, ticket: int) -> None:
    with self._lock:
      self._returned.append(ticket)
      self.in_flight -= 1

  def exhausted(self) -> bool:
    with self._lock:
      if self._fixed is not None:
        return not self._returned and min(map(self._next_of, self._fixed)) >= self.total_segments
      return not self._returned and self._next >= self.total_segments


@dataclasses.dataclass
class InferenceRequest:
  shard_id: int
  observation: dict            # {key: [num_envs, ...]} on the shard's device
  instructions: list[str] | None
  reply: "queue.Queue"         # maxsize 1: the shard waits on it for its actions
  posted_at: float
  keys: Any = None             # uint32 key data [num_envs, 2]: one sampling key per env (None: the server's)


class RequestBoard:
  """At most one pending observation batch per shard; the server takes whichever are ready.

  Each shard is either running a segment (registered with the policy version that segment needs),
  between segments (just started, finishing a segment, restarting), or retired (no work left). In
  barrier (synchronous) mode the server waits until every shard that is between segments or whose
  segment can run now (required version already published) has posted, so all shards of a round
  step in lockstep; shards waiting for a newer policy are not waited for, which is what keeps the
  barrier from deadlocking against the learner. Otherwise the server takes whatever is there
  (dynamic batching).
  """

  def __init__(self, current_version, shard_ids):
    self._current_version = current_version  # () -> the newest published policy version
    self._condition = threading.Condition()
    self._pending: dict[int, InferenceRequest] = {}
    self._registered: dict[int, int] = {}      # shard id -> required policy version
    self._between: set[int] = set(shard_ids)   # neither running a segment nor retired

  def register(self, shard_id: int, required_version: int) -> None:
    with self._condition:
      self._between.discard(shard_id)
      self._registered[shard_id] = required_version
      self._condition.notify_all()

  def unregister(self, shard_id: int) -> None:
    """The shard's segment needs no more actions (or failed); it is between segments."""
    with self._condition:
      self._registered.pop(shard_id, None)
      self._pending.pop(shard_id, None)
      self._between.add(shard_id)
      self._condition.notify_all()

  def retire(self, shard_id: int) -> None:
    with self._condition:
      self._registered.pop(shard_id, None)
      self._pending.pop(shard_id, None)
      self._between.discard(shard_id)
      self._condition.notify_all()

  def post(self, request: InferenceRequest) -> None:
    with self._condition:
      if request.shard_id in self._pending:
        raise RuntimeError(f"shard {request.shard_id} posted a second request before its first was served")
      self._pending[request.shard_id] = request
      self._condition.notify_all()

  def _barrier_complete(self) -> bool:
    version = self._current_version()
    runnable = sum(1 for required in self._registered.values() if required <= version)
    return len(self._pending) >= runnable + len(self._between)

  def take_batch(self, *, barrier: bool, max_shards: int, stop: threading.Event) -> list[InferenceRequest]:
    with self._condition:
      while True:
        if stop.is_set():
          raise Stopped()
        if self._pending and (not barrier or self._barrier_complete()):
          break
        self._condition.wait(WAIT_SLICE_S)
      shard_ids = sorted(self._pending, key=lambda shard_id: self._pending[shard_id].posted_at)[:max_shards]
      return [self._pending.pop(shard_id) for shard_id in shard_ids]


def put_until_stopped(target: queue.Queue, item: Any, stop: threading.Event) -> float:
  """Put into a bounded queue, re-checking the stop event; returns the seconds spent blocked."""
  start = time.perf_counter()
  while True:
    if stop.is_set():
      raise Stopped()
    try:
      target.put(item, timeout=WAIT_SLICE_S)
      return time.perf_counter() - start
    except queue.Full:
      continue


def get_until_stopped(source: queue.Queue, stop: threading.Event) -> tuple[Any, float]:
  """Get from a queue, re-checking the stop event; returns (item, seconds spent blocked)."""
  start = time.perf_counter()
  while True:
    if stop.is_set():
      raise Stopped()
    try:
      return source.get(timeout=WAIT_SLICE_S), time.perf_counter() - start
    except queue.Empty:
      continue
