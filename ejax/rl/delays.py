"""Per-shard delay samplers: model heterogeneous or real-world environments whose steps take time.

An env shard sleeps for one sampled delay per step on top of its own compute, the way a real robot
or a slow simulator would keep a worker busy. Each shard draws from its own seeded stream, so a run
is reproducible and shards differ even with the same distribution.
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("none", "constant", "uniform", "exponential", "lognormal", "empirical")


@dataclasses.dataclass(frozen=True)
class DelaySpec:
  """kind: one of KINDS. Parameters in seconds:
  constant: `mean`; uniform: [low, high]; exponential: `mean`;
  lognormal: `median` and `sigma` (of the underlying normal), mean = median * exp(sigma^2 / 2);
  empirical: `samples`, recorded delays replayed (each draw one of them, uniformly, with
  replacement: the recorded distribution itself; see ejax.rl.trace).
  """
  kind: str = "none"
  mean: float = 0.0
  low: float = 0.0
  high: float = 0.0
  median: float = 0.0
  sigma: float = 0.0
  samples: tuple[float, ...] = ()

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"unknown delay kind {self.kind!r}: use one of {', '.join(KINDS)}")
    object.__setattr__(self, "samples", tuple(float(x) for x in self.samples))  # lists from configs
    if self.kind == "empirical" and (not self.samples or min(self.samples) < 0):
      raise ValueError("an empirical delay needs a non-empty `samples` of delays >= 0 (seconds)")
    if self.kind == "uniform" and not 0 <= self.low <= self.high:
      raise ValueError(f"uniform delay needs 0 <= low <= high, got low={self.low}, high={self.high}")

  def expected(self) -> float:
    """E[delay] in seconds."""
    if self.kind == "none":
      return 0.0
    if self.kind in ("constant", "exponential"):
      return self.mean
    if self.kind == "uniform":
      return 0.5 * (self.low + self.high)
    if self.kind == "empirical":
      return float(np.mean(self.samples))
    return self.median * float(np.exp(0.5 * self.sigma**2))


class DelaySampler:
  """Draws one step delay at a time from a DelaySpec with its own random stream."""

  def __init__(self, spec: DelaySpec, seed: int):
    self.spec = spec
    self._rng = np.random.default_rng(seed)
    self._samples = np.asarray(spec.samples, np.float64)

  def sample(self, size: int | None = None) -> float | np.ndarray:
    spec = self.spec
    shape = () if size is None else (size,)
    if spec.kind == "none":
      value = np.zeros(shape)
    elif spec.kind == "constant":
      value = np.full(shape, spec.mean)
    elif spec.kind == "uniform":
      value = self._rng.uniform(spec.low, spec.high, shape)
    elif spec.kind == "exponential":
      value = self._rng.exponential(spec.mean, shape)
    elif spec.kind == "empirical":
      value = self._samples[self._rng.integers(0, len(self._samples), shape)]
    else:
      value = spec.median * np.exp(spec.sigma * self._rng.standard_normal(shape))
    return float(value) if size is None else value


def delay_spec_from_config(config) -> DelaySpec:
  """A DelaySpec from a config dict with the same field names (missing fields default)."""
  fields = {field.name for field in dataclasses.fields(DelaySpec)}
  values = {key: config[key] for key in config.keys() if key in fields} if config is not None else {}
  return DelaySpec(**values)


def ideal_async_speedup(specs: list[DelaySpec], compute_seconds: float = 0.0, samples: int = 200_000,
                        seed: int = 0) -> float:
  """E[max_i time_i] / E[mean_i time_i] for one step of every shard: what a synchronous barrier
  loses against shards that each run at their own pace (Monte Carlo over the delay distributions)."""
  samplers = [DelaySampler(spec, seed + index) for index, spec in enumerate(specs)]
  times = np.stack([sampler.sample(samples) for sampler in samplers]) + compute_seconds  # [shards, samples]
  return float(times.max(axis=0).mean() / times.mean())
