"""RL-VLA3 across processes: who runs which shards, and how the processes agree on every update.

Every process of a `jax.distributed` run builds the same pipeline over its own share of the env
shards (rl.num_shards and rl.segments_per_update are global counts, split evenly), with its own
inference server on its local devices. The learner is one SPMD program over every process's learner
devices, so each process's learner thread must enter update k together with the others. Before each
update the processes exchange one small message through the coordination service's key-value
store (not a collective: a peer may take minutes to finish its segments): "ready", or "stopped, and
why" (SIGTERM, a failed shard, the end). All of them see the same messages, so all of them either
run update k or stop after update k - 1; the learner's last good state is then checkpointed once,
by every process together (orbax's multi-host save). A stop anywhere is also announced at once
under a stop key that a watcher thread in every process polls, so peers do not first finish their
current segments.

With one process every method here is trivial and nothing touches the key-value store.
"""

from __future__ import annotations

import itertools
import json
import threading
from typing import Any

import jax
import numpy as np

from ejax.parallel import distributed

AGREE_TIMEOUT_S = 3600.0  # a peer that has not reported for an hour is gone (jax.distributed's heartbeat ends it sooner)
WATCH_INTERVAL_S = 0.2


_PIPELINES = itertools.count()  # every process builds its pipelines in the same order


class ProcessGroup:
  """This process's place in the run: its index, the process count, and the run's message keys
  (a new prefix for each pipeline a process builds: keys are written once)."""

  def __init__(self, run_id: str | None = None, timeout_s: float = AGREE_TIMEOUT_S):
    self.index, self.count = jax.process_index(), jax.process_count()
    self.prefix = f"ejax_rl/{run_id or f'pipeline{next(_PIPELINES)}'}"
    self.timeout_s = timeout_s
    self._announced = False

  @property
  def multi(self) -> bool:
    return self.count > 1

  def share(self, total: int, setting: str) -> int:
    """This process's part of a global count that splits evenly across processes."""
    if total % self.count:
      raise ValueError(f"{setting}={total} does not split over {self.count} processes: make it a multiple of "
                       f"{self.count}")
    return total // self.count

  def shard_ids(self, num_shards: int) -> list[int]:
    """Global ids of this process's env shards: a contiguous block, so that concatenating every
    process's segments in process order is the one-process run's order."""
    local = self.share(num_shards, "rl.num_shards")
    return list(range(self.index * local, (self.index + 1) * local))

  # -- messages --------------------------------------------------------------------------------

  def exchange(self, name: str, message: dict) -> list[dict]:
    """Every process's `message` for the step `name` (a name is used once per run), in process order."""
    if not self.multi:
      return [message]
    distributed.kv_set(f"{self.prefix}/{name}/{self.index}", json.dumps(message, default=_json_default))
    return [json.loads(distributed.kv_wait(f"{self.prefix}/{name}/{q}", self.timeout_s)) for q in range(self.count)]

  def announce_stop(self, reason: str) -> None:
    """Tells every peer's watcher that this process is stopping (once)."""
    if not self.multi or self._announced:
      return
    self._announced = True
    distributed.kv_set(f"{self.prefix}/stop/{self.index}", reason)

  def peer_stop(self) -> str | None:
    """'process q: reason' for the first peer that announced a stop, or None."""
    for q in range(self.count):
      if q != self.index:
        reason = distributed.kv_try_get(f"{self.prefix}/stop/{q}")
        if reason is not None:
          return f"process {q}: {reason}"
    return None

  def watch(self, stop: threading.Event, on_peer_stop) -> threading.Thread | None:
    """A daemon thread calling on_peer_stop(reason) once a peer announces a stop (until `stop`)."""
    if not self.multi:
      return None

    def run():
      while not stop.wait(WATCH_INTERVAL_S):
        reason = self.peer_stop()
        if reason is not None:
          on_peer_stop(reason)
          return

    thread = threading.Thread(target=run, name="peer_watch", daemon=True)
    thread.start()
    return thread


def _json_default(value: Any):
  if isinstance(value, (np.integer, np.floating, np.bool_)):
    return value.item()
  raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def merge_statistics(parts: list[dict]) -> dict:
  """Per-process segment statistics (ejax.rl.learner.segment_statistics) -> the global batch's."""
  samples = sum(part["samples"] for part in parts)
  episodes = sum(part["episodes"] for part in parts)
  return {"lag_mean": sum(part["lag_mean"] * part["samples"] for part in parts) / max(samples, 1),
          "lag_p95": max(part["lag_p95"] for part in parts), "lag_max": max(part["lag_max"] for part in parts),
          "episodes": episodes, "successes": sum(part["successes"] for part in parts),
          "success_rate": sum(part["successes"] for part in parts) / max(episodes, 1),
          "reward_mean": sum(part["reward_mean"] * part["samples"] for part in parts) / max(samples, 1),
          "samples": samples}


# -- arrays across processes ----------------------------------------------------------------------


def global_devices(local_indexes: list[int]) -> list[jax.Device]:
  """Every process's local devices at `local_indexes` (empty: all of them), in process order."""
  devices = []
  for q in range(jax.process_count()):
    local = sorted((d for d in jax.devices() if d.process_index == q), key=lambda d: d.id)
    devices += [local[i] for i in local_indexes] if local_indexes else local
  return devices


def to_global(tree: Any, shardings: Any) -> Any:
  """Host values that every process holds in full (the same on all) -> global arrays laid out by
  `shardings`; each process fills only its own devices' shards, so nothing crosses processes."""
  def place(value, sharding):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
  return jax.tree.map(place, tree, shardings)


def localize(tree: Any, replicate=None) -> Any:
  """Global arrays -> copies on this process's first addressable device, for a local server.
  Arrays sharded across processes are first gathered by `replicate` (a jitted identity with
  replicated outputs: a collective every process runs at the same point, after the update)."""
  leaves = jax.tree.leaves(tree)
  if not any(isinstance(leaf, jax.Array) and not leaf.is_fully_addressable for leaf in leaves):
    return tree
  if replicate is not None and not all(leaf.sharding.is_fully_replicated for leaf in leaves if isinstance(leaf, jax.Array)):
    tree = replicate(tree)
  return jax.tree.map(lambda leaf: leaf.addressable_data(0) if isinstance(leaf, jax.Array) else leaf, tree)
