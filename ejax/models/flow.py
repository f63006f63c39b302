"""Flow matching shared by GR00T and pi0.5: training-time sampling, Euler sampling, Flow-SDE for RL.

Two time conventions exist in the published models and both are kept exactly, because released
weights were trained with them:

  "groot"  (Isaac-GR00T): t = 0 is noise, t = 1 is data.
           x_t = (1 - t) * noise + t * action;  target velocity = action - noise;
           t = (0.999 - s) / 0.999 with s ~ Beta(1.5, 1); the model sees floor(t * 1000).
  "openpi" (pi0 / pi0.5): t = 1 is noise, t = 0 is data.
           x_t = t * noise + (1 - t) * action;  target velocity = noise - action;
           t = Beta(1.5, 1) * 0.999 + 0.001.

Internally the samplers work in the openpi parameterisation ("tau", noise at tau = 1, velocity
noise - action) and convert at the boundary: tau = 1 - t_groot and v = -v_groot. A velocity
function always receives and returns its own convention: `velocity_fn(x [n, horizon, dim],
t [n]) -> velocity [n, horizon, dim]`, with a per-sample time because Flow-SDE evaluates every
sample at its own chosen step.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

CONVENTIONS = ("groot", "openpi")
BETA_ALPHA = 1.5
BETA_BETA = 1.0  # sample_time draws by beta_alpha_one, which holds for Beta(alpha, 1) only
GROOT_NOISE_S = 0.999
GROOT_TIMESTEP_BUCKETS = 1000

VelocityFn = Callable[[jax.Array, jax.Array], jax.Array]


def _check(convention: str) -> None:
  if convention not in CONVENTIONS:
    raise ValueError(f"flow convention {convention!r} is not one of {CONVENTIONS}")


def beta_alpha_one(rng: jax.Array, alpha: float, shape: tuple[int, ...]) -> jax.Array:
  """Beta(alpha, 1) draws by inverting its CDF, x ** alpha: u ** (1 / alpha) for uniform u. The same
  distribution as jax.random.beta(rng, alpha, 1.0), without its gamma draws' rejection loops: on a
  GPU each of their iterations waits for the host (a data-dependent while loop)."""
  u = jax.random.uniform(rng, shape, jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
  return u ** (1.0 / alpha)


def sample_time(rng: jax.Array, batch_size: int, *, convention: str) -> jax.Array:
  """Training times [batch_size] in the convention's own time, float32."""
  _check(convention)
  s = beta_alpha_one(rng, BETA_ALPHA, (batch_size,))  # Beta(BETA_ALPHA, BETA_BETA = 1)
  if convention == "groot":
    return (GROOT_NOISE_S - s) / GROOT_NOISE_S
  return s * 0.999 + 0.001


def interpolate(noise: jax.Array, actions: jax.Array, t: jax.Array, *, convention: str) -> tuple[jax.Array, jax.Array]:
  """(x_t, target velocity) for actions/noise [n, horizon, dim] at times t [n]."""
  _check(convention)
  t = t.astype(actions.dtype)[:, None, None]
  if convention == "groot":
    return (1.0 - t) * noise + t * actions, actions - noise
  return t * noise + (1.0 - t) * actions, noise - actions


def masked_loss(velocity: jax.Array, target: jax.Array, mask: jax.Array) -> tuple[jax.Array, dict]:
  """The flow-matching loss over the real action entries (mask [n, H, A]): the mean over every real
  entry of the batch (GR00T's and openpi's), with per-sample means and the flow loss as metrics."""
  mask = mask.astype(jnp.float32)
  squared = jnp.square(velocity - target) * mask
  real = jnp.sum(mask, axis=(1, 2))
  loss = jnp.sum(squared) / jnp.maximum(jnp.sum(real), 1.0)
  return loss, {"per_sample_loss": jnp.sum(squared, axis=(1, 2)) / jnp.maximum(real, 1.0), "flow_loss": loss}


def groot_timestep_buckets(t: jax.Array, num_buckets: int = GROOT_TIMESTEP_BUCKETS) -> jax.Array:
  """GR00T feeds its timestep encoders floor(t * 1000) (an integer-valued float here)."""
  return jnp.floor(t * num_buckets)


def _tau_velocity(velocity_fn: VelocityFn, convention: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """velocity(x, step [n]) in the noise-at-1 parameterisation, whatever the model's convention.

  The model's time is computed from the step directly (GR00T: step / N, exactly as Isaac-GR00T
  does before bucketing), not as 1 - tau, whose rounding would move floor(t * 1000) down a bucket.
  """
  def velocity(x, step, num_steps):
    step = step.astype(jnp.float32)
    if convention == "groot":
      return -velocity_fn(x, step / num_steps)
    return velocity_fn(x, 1.0 - step / num_steps)
  return velocity


def _tau_at(step: jax.Array | int, num_steps: int) -> jax.Array:
  return 1.0 - jnp.asarray(step, jnp.float32) / num_steps


def euler_sample(velocity_fn: VelocityFn, noise: jax.Array, num_steps: int, *, convention: str) -> jax.Array:
  """Integrates the flow from noise to actions with `num_steps` Euler steps.

  GR00T evaluates at t = 0, 1/N, ..., (N-1)/N; openpi at t = 1, 1 - 1/N, ..., 1/N: the same grid
  in tau, so one loop serves both.
  """
  _check(convention)
  velocity = _tau_velocity(velocity_fn, convention)
  dt = 1.0 / num_steps
  n = noise.shape[0]

  def body(step, x):
    return x - dt * velocity(x, jnp.full((n,), step), num_steps).astype(x.dtype)

  return jax.lax.fori_loop(0, num_steps, body, noise)


class SDESample(NamedTuple):
  actions: jax.Array     # [n, horizon, dim] the final state of the chain
  chain: jax.Array       # [n, num_steps + 1, horizon, dim] x_0 = noise ... x_N = actions
  step_index: jax.Array  # [n] int32, the one stochastic step of each sample
  log_prob: jax.Array    # [n] float32, log density of chain[step_index + 1] given chain[step_index]


def _sde_sigma(tau: jax.Array, num_steps: int, noise_level: float) -> jax.Array:
  """sigma_tau = a * sqrt(tau / (1 - tau)); at tau = 1 the denominator uses one step (1/N) instead
  of 0, as RL implementations of Flow-SDE do, so the first step has a finite noise scale."""
  return noise_level * jnp.sqrt(tau / jnp.maximum(1.0 - tau, 1.0 / num_steps))


def _sde_transition(x: jax.Array, v: jax.Array, tau: jax.Array, num_steps: int, noise_level: float):
  """Mean and std of x_{tau - dt} under the SDE with the ODE's marginals (Flow-GRPO).

  With score = -(x + (1 - tau) v) / tau (rectified flow), the reverse step is
  x - dt * (v + sigma^2 / (2 tau) * (x + (1 - tau) v)) + sigma * sqrt(dt) * eps.
  """
  dt = 1.0 / num_steps
  sigma = _sde_sigma(tau, num_steps, noise_level)[:, None, None]
  tau_b = tau[:, None, None]
  mean = x - dt * (v + sigma**2 / (2.0 * tau_b) * (x + (1.0 - tau_b) * v))
  std = sigma * math.sqrt(dt)
  return mean, jnp.broadcast_to(std, x.shape)


def _gaussian_log_prob(sample: jax.Array, mean: jax.Array, std: jax.Array, mask: jax.Array | None) -> jax.Array:
  """Sum over all non-batch elements of the diagonal Gaussian log density (masked entries skip)."""
  z = (sample - mean) / std
  per_element = -0.5 * z**2 - jnp.log(std) - 0.5 * math.log(2.0 * math.pi)
  if mask is not None:
    per_element = per_element * mask
  return jnp.sum(per_element.reshape(per_element.shape[0], -1), axis=-1)


def per_row_keys(rng: jax.Array) -> bool:
  """Whether `rng` is a batch of typed keys [n], one per sample, rather than one key for the batch.
  Per-row keys make a sample's draws depend on its own key only, not on which other samples share
  its batch (an RL inference server batches whichever env shards are ready)."""
  return jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.ndim == 1


def normal_per_row(rng: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """N(0, 1) draws of `shape` [n, ...]: from one key, or row i from key i of a batch of keys [n]."""
  if per_row_keys(rng):
    return jax.vmap(lambda key: jax.random.normal(key, shape[1:], jnp.float32))(rng)
  return jax.random.normal(rng, shape, jnp.float32)


def _sde_draws(rng: jax.Array, shape: tuple[int, ...], num_choices: int) -> tuple[jax.Array, jax.Array]:
  """The stochastic step index [n] and its Gaussian noise [n, ...] (per row for a batch of keys)."""
  if per_row_keys(rng):
    def one(key):
      step_key, eps_key = jax.random.split(key)
      return (jax.random.randint(step_key, (), 0, num_choices, dtype=jnp.int32),
              jax.random.normal(eps_key, shape[1:], jnp.float32))
    return jax.vmap(one)(rng)
  step_rng, eps_rng = jax.random.split(rng)
  return (jax.random.randint(step_rng, shape[:1], 0, num_choices, dtype=jnp.int32),
          jax.random.normal(eps_rng, shape, jnp.float32))


def flow_sde_sample(
    velocity_fn: VelocityFn,
    noise: jax.Array,
    num_steps: int,
    rng: jax.Array,
    *,
    convention: str,
    noise_level: float = 0.5,
    action_mask: jax.Array | None = None,
    noisy_steps: int = 0,
) -> SDESample:
  """Samples with one Gaussian transition at a random step per sample (all others are Euler).

  `action_mask` ([n, horizon, dim] or broadcastable, 1 = real) restricts the log-prob to real
  action entries; padded entries still move but do not count. `noisy_steps` > 0 draws the
  stochastic step from the first `noisy_steps` steps only: their noise scale is the largest
  (sigma_tau shrinks with tau), so the log-prob of a chain is less sharp in the policy's
  parameters and RL's trust region allows larger moves for the same exploration.
  `rng`: one key, or a batch of keys [n] (one per sample: see `per_row_keys`).
  """
  _check(convention)
  velocity = _tau_velocity(velocity_fn, convention)
  n = noise.shape[0]
  step_index, eps = _sde_draws(rng, noise.shape, min(noisy_steps or num_steps, num_steps))
  dt = 1.0 / num_steps
  mask = None if action_mask is None else jnp.broadcast_to(action_mask, noise.shape).astype(jnp.float32)

  def body(step, carry):
    x, chain, log_prob = carry
    steps = jnp.full((n,), step)
    tau = _tau_at(steps, num_steps)
    v = velocity(x, steps, num_steps).astype(jnp.float32)
    xf = x.astype(jnp.float32)
    mean, std = _sde_transition(xf, v, tau, num_steps, noise_level)
    stochastic = mean + std * eps
    chosen = (step_index == step)[:, None, None]
    x_next = jnp.where(chosen, stochastic, xf - dt * v)
    step_log_prob = _gaussian_log_prob(stochastic, mean, std, mask)
    log_prob = jnp.where(step_index == step, step_log_prob, log_prob)
    chain = chain.at[:, step + 1].set(x_next.astype(chain.dtype))
    return x_next.astype(x.dtype), chain, log_prob

  chain = jnp.zeros((n, num_steps + 1) + noise.shape[1:], noise.dtype).at[:, 0].set(noise)
  actions, chain, log_prob = jax.lax.fori_loop(
      0, num_steps, body, (noise, chain, jnp.zeros((n,), jnp.float32)))
  return SDESample(actions=actions, chain=chain, step_index=step_index, log_prob=log_prob)


def flow_sde_log_prob(
    velocity_fn: VelocityFn,
    chain: jax.Array,
    step_index: jax.Array,
    *,
    convention: str,
    noise_level: float = 0.5,
    action_mask: jax.Array | None = None,
) -> jax.Array:
  """Recomputes the log-prob [n] of each stored chain's stochastic step with ONE velocity call
  (under the current parameters: this is what the RL learner differentiates)."""
  _check(convention)
  velocity = _tau_velocity(velocity_fn, convention)
  n, num_states = chain.shape[:2]
  num_steps = num_states - 1
  rows = jnp.arange(n)
  x = chain[rows, step_index].astype(jnp.float32)
  x_next = chain[rows, step_index + 1].astype(jnp.float32)
  tau = _tau_at(step_index, num_steps)
  v = velocity(x.astype(chain.dtype), step_index, num_steps).astype(jnp.float32)
  mean, std = _sde_transition(x, v, tau, num_steps, noise_level)
  mask = None if action_mask is None else jnp.broadcast_to(action_mask, x.shape).astype(jnp.float32)
  return _gaussian_log_prob(x_next, mean, std, mask)
