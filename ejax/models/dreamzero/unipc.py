"""UniPC multistep sampling for flow matching, as DreamZero's policy denoises (16 steps, shift 5).

The official FlowUniPCMultistepScheduler (Wan's; order 2, B(h) = e^h - 1 ("bh2"), data prediction,
lower order at the first and last steps, no thresholding): the model's velocity v at sigma becomes a
clean-sample prediction x0 = x - sigma v; a corrector (UniC) first refines the current sample with the
new prediction, then a predictor (UniP) steps to the next sigma from the last two predictions. With
alpha = 1 - sigma and lambda = log(alpha / sigma), every coefficient depends only on the sigma grid,
so they are computed once here in float64 and the sample updates are plain jnp arithmetic.

Grid: linspace(0.999, 0, steps + 1)[:-1] shifted (s * sigma / (1 + (s - 1) * sigma)), then a final 0;
the model sees the timesteps int(sigma * 1000), as the official scheduler hands them out.
"""

from __future__ import annotations

import numpy as np

SOLVER_ORDER = 2


def sigmas(num_steps: int, shift: float = 5.0, num_train_timesteps: int = 1000) -> np.ndarray:
  """[num_steps + 1] float64: the shifted grid and a final 0."""
  base = np.linspace(1.0 - 1.0 / num_train_timesteps, 0.0, num_steps + 1)[:-1]
  return np.append(shift * base / (1 + (shift - 1) * base), 0.0)


def timesteps(grid: np.ndarray, num_train_timesteps: int = 1000) -> np.ndarray:
  return (grid[:-1] * num_train_timesteps).astype(np.int64).astype(np.float64)


def _lambda(sigma: float) -> float:
  with np.errstate(divide="ignore"):
    return float(np.log(1.0 - sigma) - np.log(sigma))


def _phis(h: float, order: int):
  """h_phi_1 = e^-h - 1, B(h) = e^-h - 1 and the b vector of UniPC's linear system (data prediction)."""
  hh = -h
  h_phi_1 = np.expm1(hh)
  h_phi_k = h_phi_1 / hh - 1 if np.isfinite(hh) else -1.0
  b, factorial = [], 1
  for i in range(1, order + 1):
    b.append(h_phi_k * factorial / h_phi_1)
    factorial *= i + 1
    h_phi_k = h_phi_k / hh - 1 / factorial if np.isfinite(hh) else -1 / factorial
  return h_phi_1, np.asarray(b)


class UniPC:
  """Stateful over one sampling run: `step(velocity, sample)` per grid point, as the official `step`."""

  def __init__(self, num_steps: int, shift: float = 5.0):
    self.sigmas = sigmas(num_steps, shift)
    self.num_steps = num_steps
    self.index = 0
    self.predictions: list = []      # the last SOLVER_ORDER x0 predictions
    self.last_sample = None
    self.order = 1

  @property
  def timestep(self) -> float:
    return float(timesteps(self.sigmas)[self.index])

  def _update(self, sample, m0, differences, sigma_t: float, sigma_s0: float, rhos, model_t=None):
    """x_t = sigma_t / sigma_s0 x - alpha_t h_phi_1 m0 - alpha_t B(h) (sum_k rho_k D_k [+ rho_t (m_t - m0)])."""
    h = _lambda(sigma_t) - _lambda(sigma_s0)
    h_phi_1, _ = _phis(h, 1)
    alpha_t = 1.0 - sigma_t
    x = sigma_t / sigma_s0 * sample - alpha_t * h_phi_1 * m0
    residual = 0.0
    for rho, difference in zip(rhos, differences):
      residual = residual + rho * difference
    if model_t is not None:
      residual = residual + rhos[-1] * (model_t - m0)
    return x - alpha_t * h_phi_1 * residual

  def _coefficients(self, step_index: int, order: int, corrector: bool):
    """rks and rhos of UniP (predictor, from step_index to step_index + 1) or UniC (corrector, the
    step that ended at step_index)."""
    if corrector:
      sigma_t, sigma_s0 = self.sigmas[step_index], self.sigmas[step_index - 1]
    else:
      sigma_t, sigma_s0 = self.sigmas[step_index + 1], self.sigmas[step_index]
    h = _lambda(sigma_t) - _lambda(sigma_s0)
    rks = []
    for i in range(1, order):
      si = step_index - (i + 1) if corrector else step_index - i
      rks.append((_lambda(self.sigmas[si]) - _lambda(sigma_s0)) / h)
    rks.append(1.0)
    _, b = _phis(h, order)
    R = np.stack([np.power(np.asarray(rks), i - 1) for i in range(1, order + 1)])
    if corrector:
      rhos = [0.5] if order == 1 else list(np.linalg.solve(R, b))
    else:
      rhos = [] if order == 1 else ([0.5] if order == 2 else list(np.linalg.solve(R[:-1, :-1], b[:-1])))
    return float(sigma_t), float(sigma_s0), rks, rhos

  def step(self, velocity, sample):
    """The sample at the next grid point, from the model's velocity at the current one."""
    i = self.index
    prediction = sample - self.sigmas[i] * velocity
    if i > 0 and self.last_sample is not None:
      sigma_t, sigma_s0, rks, rhos = self._coefficients(i, self.order, corrector=True)
      m0 = self.predictions[-1]
      differences = [(self.predictions[-(k + 1)] - m0) / rks[k - 1] for k in range(1, self.order)]
      sample = self._update(self.last_sample, m0, differences, sigma_t, sigma_s0, rhos, model_t=prediction)
    self.predictions = (self.predictions + [prediction])[-SOLVER_ORDER:]
    order = min(SOLVER_ORDER, self.num_steps - i)          # lower order at the last step
    self.order = min(order, len(self.predictions))           # and while the history is short
    self.last_sample = sample
    sigma_t, sigma_s0, rks, rhos = self._coefficients(i, self.order, corrector=False)
    m0 = self.predictions[-1]
    differences = [(self.predictions[-(k + 1)] - m0) / rks[k - 1] for k in range(1, self.order)]
    self.index += 1
    return self._update(sample, m0, differences, sigma_t, sigma_s0, rhos)
