"""Success-rate statistics: Wilson score intervals (well behaved at 0 % and 100 %, unlike +-1.96 se)."""

from __future__ import annotations

import math

Z_95 = 1.959963984540054


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
  """(low, high) of the Wilson score interval for a binomial proportion; (0, 1) with no trials."""
  if trials <= 0:
    return 0.0, 1.0
  if not 0 <= successes <= trials:
    raise ValueError(f"successes={successes} must lie in [0, trials={trials}]")
  p = successes / trials
  denominator = 1 + z * z / trials
  centre = (p + z * z / (2 * trials)) / denominator
  half_width = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
  # Exact at the ends: rounding left 0 successes of 3 a low bound of 5.6e-17 (above the rate: a
  # negative error bar that matplotlib refuses).
  low = 0.0 if successes == 0 else max(0.0, centre - half_width)
  high = 1.0 if successes == trials else min(1.0, centre + half_width)
  return low, high
