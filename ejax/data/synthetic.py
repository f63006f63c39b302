"""A synthetic demonstration dataset that needs no download: the trainer's default data.

Sample i is generated from (seed, i) alone, so any process can produce any sample, iteration
order is exact on resume, and the data is learnable: the action chunk is a smooth function of the
state and the task (a per-task linear map through tanh, unrolled over the horizon), plus optional
noise. A policy that learns it drives the flow-matching loss far below its starting value.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from ml_collections import ConfigDict


class SyntheticDemos:
  """Random access: `sample(i)` -> the per-sample schema of ejax's data pipeline."""

  def __init__(self, *, state_dim: int, action_dim: int, horizon: int, num_tasks: int,
               seed: int = 0, noise: float = 0.0, pad_fraction: float = 0.1):
    self.state_dim, self.action_dim, self.horizon = state_dim, action_dim, horizon
    self.num_tasks, self.seed, self.noise, self.pad_fraction = num_tasks, seed, noise, pad_fraction
    world = np.random.default_rng([seed, 2**31 - 1])
    self.task_maps = world.standard_normal((num_tasks, state_dim, action_dim)) / np.sqrt(state_dim)
    self.task_drift = world.standard_normal((num_tasks, action_dim)) * 0.5

  def sample(self, index: int) -> dict[str, Any]:
    rng = np.random.default_rng([self.seed, index])
    task = int(rng.integers(self.num_tasks))
    state = rng.standard_normal(self.state_dim).astype(np.float32)
    phase = np.linspace(0.0, 1.0, self.horizon)[:, None]
    action = np.tanh(state @ self.task_maps[task])[None] * (1.0 - phase) + self.task_drift[task] * phase
    action = action + self.noise * rng.standard_normal(action.shape)
    # Episode ends cut some chunks short: those steps are padding, as in real datasets.
    valid = self.horizon
    if rng.random() < self.pad_fraction:
      valid = int(rng.integers(1, self.horizon))
    is_pad = np.arange(self.horizon) >= valid
    action[is_pad] = 0.0
    return {
        "observation.state": state,
        "action": action.astype(np.float32),
        "action_is_pad": is_pad,
        "task_index": np.int32(task),
        "index": np.int64(index),
    }


class SyntheticIterator:
  """Process-local batches of SyntheticDemos with exact, checkpointable position.

  Global batch k holds samples k*G .. k*G + G - 1 (G = batch_size * process_count), process p
  reading the p-th contiguous slice: the same global batches for any number of processes, so runs
  on different topologies see the same data. Restoring `{"next_index": n}` (samples this process
  has read) continues on exactly the next unseen sample.
  """

  def __init__(self, demos: SyntheticDemos, *, batch_size: int, process_index: int = 0, process_count: int = 1,
               collate: Callable[[list[dict]], dict] | None = None):
    self.demos, self.batch_size = demos, batch_size
    self.collate = collate or stack_samples
    self.process_index, self.process_count = process_index, process_count
    self.next_index = 0  # in units of this process's samples

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    samples = []
    for _ in range(self.batch_size):
      batch_number, offset = divmod(self.next_index, self.batch_size)
      global_index = (batch_number * self.process_count + self.process_index) * self.batch_size + offset
      samples.append(self.demos.sample(global_index))
      self.next_index += 1
    return self.collate(samples)

  def get_state(self) -> dict[str, int]:
    return {"next_index": self.next_index}

  def set_state(self, state: dict[str, int]) -> None:
    self.next_index = int(state["next_index"])


def stack_samples(samples: list[dict]) -> dict[str, np.ndarray]:
  return {key: np.stack([s[key] for s in samples]) for key in samples[0]}


def make_iterator(model_config: ConfigDict, data_config: ConfigDict, *, batch_size: int, seed: int,
                  process_index: int, process_count: int,
                  collate: Callable[[list[dict]], dict] | None = None) -> SyntheticIterator:
  demos = SyntheticDemos(
      state_dim=model_config.state_dim, action_dim=model_config.action_dim, horizon=model_config.horizon,
      num_tasks=model_config.num_tasks, seed=seed, noise=data_config.get("noise", 0.0))
  return SyntheticIterator(demos, batch_size=batch_size, process_index=process_index, process_count=process_count,
                           collate=collate)
