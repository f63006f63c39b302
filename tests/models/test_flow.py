"""Flow matching: both time conventions, Euler sampling, and Flow-SDE log-probs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejax.models import flow

N, HORIZON, DIM = 4, 3, 2


def _target():
  return jax.random.normal(jax.random.key(1), (N, HORIZON, DIM))


def _exact_velocity(convention, target):
  """The velocity field that carries any noise to `target` exactly (a single data point)."""
  if convention == "openpi":
    return lambda x, t: (x - target) / t[:, None, None]
  return lambda x, t: (target - x) / (1.0 - t[:, None, None])


def test_sample_time_ranges_and_means():
  g = flow.sample_time(jax.random.key(0), 20000, convention="groot")
  o = flow.sample_time(jax.random.key(0), 20000, convention="openpi")
  # GR00T keeps (0.999 - s) / 0.999 as published: s near 1 gives t slightly below 0.
  assert float(g.min()) >= -0.001 - 1e-6 and float(g.max()) <= 1.0
  assert float(o.min()) >= 0.001 and float(o.max()) <= 1.0
  # Beta(1.5, 1) has mean 0.6.
  np.testing.assert_allclose(float(g.mean()), (0.999 - 0.6) / 0.999, atol=0.01)
  np.testing.assert_allclose(float(o.mean()), 0.6 * 0.999 + 0.001, atol=0.01)


def test_time_draws_follow_beta_without_loops():
  """Beta(1.5, 1) by its inverse CDF: the same law as jax.random.beta (Kolmogorov-Smirnov against the
  CDF x ** 1.5 and against jax's own draws), and no while loop in the program (a GPU host sync)."""
  draws = np.sort(np.asarray(flow.beta_alpha_one(jax.random.key(3), 1.5, (20000,))))
  cdf = draws ** 1.5
  ks = np.max(np.maximum(np.arange(1, draws.size + 1) / draws.size - cdf, cdf - np.arange(draws.size) / draws.size))
  assert ks < 1.63 / np.sqrt(draws.size)  # 1 % level
  theirs = np.sort(np.asarray(jax.random.beta(jax.random.key(4), 1.5, 1.0, (20000,))))
  both = np.sort(np.concatenate([draws, theirs]))
  gap = np.abs(np.searchsorted(draws, both, "right") - np.searchsorted(theirs, both, "right")).max() / draws.size
  assert gap < 1.63 * np.sqrt(2 / draws.size)
  assert draws.min() > 0 and draws.max() <= 1
  jaxpr = lambda fn: str(jax.make_jaxpr(fn)(jax.random.key(0)))  # random_gamma lowers to a while loop
  ours = jaxpr(lambda key: flow.sample_time(key, 8, convention="groot"))
  assert "random_gamma" not in ours and "while" not in ours
  assert "random_gamma" in jaxpr(lambda key: jax.random.beta(key, 1.5, 1.0, (8,)))


def test_interpolate_conventions_mirror_each_other():
  noise = jax.random.normal(jax.random.key(2), (N, HORIZON, DIM))
  actions = _target()
  t = jnp.array([0.0, 0.25, 0.5, 1.0])
  xg, vg = flow.interpolate(noise, actions, t, convention="groot")
  xo, vo = flow.interpolate(noise, actions, 1.0 - t, convention="openpi")
  np.testing.assert_allclose(xg, xo, atol=1e-6)
  np.testing.assert_allclose(vg, -vo, atol=1e-6)
  np.testing.assert_allclose(xg[0], noise[0])  # groot: t = 0 is noise
  np.testing.assert_allclose(xg[3], actions[3], atol=1e-6)
  np.testing.assert_array_equal(flow.groot_timestep_buckets(jnp.array([0.0, 0.2499, 0.75])), [0, 249, 750])


@pytest.mark.parametrize("convention", flow.CONVENTIONS)
def test_euler_reaches_the_data_point(convention):
  target = _target()
  noise = jax.random.normal(jax.random.key(3), target.shape)
  out = flow.euler_sample(_exact_velocity(convention, target), noise, 4, convention=convention)
  np.testing.assert_allclose(out, target, atol=1e-5)


def test_groot_sampler_feeds_exact_step_times():
  """GR00T buckets floor(t * 1000) with t = k / N: 1 - (1 - k / N) in float32 would drop a bucket."""
  def velocity_fn(x, t):  # depends only on the bucket the model would see
    return jnp.broadcast_to(-flow.groot_timestep_buckets(t)[:, None, None], x.shape)

  out = flow.euler_sample(velocity_fn, jnp.zeros((1, 1, 1)), 5, convention="groot")
  np.testing.assert_allclose(out, -(0 + 200 + 400 + 600 + 800) / 5, rtol=1e-6)


def _independent_log_prob(x, x_next, v, tau, num_steps, a):
  """Gaussian density written out again in numpy (noise-at-1 parameterisation)."""
  dt = 1.0 / num_steps
  sigma = a * math.sqrt(tau / max(1.0 - tau, dt))
  mean = x - dt * (v + sigma**2 / (2 * tau) * (x + (1 - tau) * v))
  std = sigma * math.sqrt(dt)
  return float(np.sum(-0.5 * ((x_next - mean) / std) ** 2 - math.log(std) - 0.5 * math.log(2 * math.pi)))


@pytest.mark.parametrize("convention", flow.CONVENTIONS)
def test_flow_sde_log_prob_matches_an_independent_gaussian(convention):
  num_steps, a = 5, 0.5
  weights = jax.random.normal(jax.random.key(4), (DIM, DIM)) * 0.3

  def velocity_fn(x, t):  # a non-trivial, time-dependent field
    return jnp.tanh(x @ weights) * (1.0 + t[:, None, None])

  noise = jax.random.normal(jax.random.key(5), (N, HORIZON, DIM))
  sample = flow.flow_sde_sample(velocity_fn, noise, num_steps, jax.random.key(6), convention=convention, noise_level=a)
  assert sample.chain.shape == (N, num_steps + 1, HORIZON, DIM)
  np.testing.assert_array_equal(sample.chain[:, 0], noise)
  np.testing.assert_array_equal(sample.chain[:, -1], sample.actions)
  recomputed = flow.flow_sde_log_prob(velocity_fn, sample.chain, sample.step_index, convention=convention, noise_level=a)
  np.testing.assert_allclose(recomputed, sample.log_prob, rtol=1e-5, atol=1e-4)

  chain = np.asarray(sample.chain, np.float64)
  for i in range(N):
    k = int(sample.step_index[i])
    for step in range(num_steps):
      tau = 1.0 - step / num_steps
      t_model = tau if convention == "openpi" else 1.0 - tau
      v_model = np.asarray(velocity_fn(jnp.asarray(chain[i:i + 1, step], jnp.float32), jnp.array([t_model])))[0]
      v = v_model if convention == "openpi" else -v_model
      if step == k:
        expected = _independent_log_prob(chain[i, step], chain[i, step + 1], v, tau, num_steps, a)
        np.testing.assert_allclose(float(sample.log_prob[i]), expected, rtol=1e-4)
      else:  # every other step is the deterministic Euler update
        np.testing.assert_allclose(chain[i, step + 1], chain[i, step] - v / num_steps, atol=1e-5)


def test_flow_sde_step_indices_cover_all_steps_and_mask_drops_entries():
  velocity_fn = lambda x, t: x
  noise = jax.random.normal(jax.random.key(7), (64, HORIZON, DIM))
  sample = flow.flow_sde_sample(velocity_fn, noise, 4, jax.random.key(8), convention="openpi")
  assert set(np.asarray(sample.step_index).tolist()) == {0, 1, 2, 3}
  mask = jnp.zeros((HORIZON, DIM)).at[:, 0].set(1.0)
  full = flow.flow_sde_log_prob(velocity_fn, sample.chain, sample.step_index, convention="openpi")
  half = flow.flow_sde_log_prob(velocity_fn, sample.chain, sample.step_index, convention="openpi", action_mask=mask)
  assert not np.allclose(full, half)
  assert np.all(np.isfinite(full))
