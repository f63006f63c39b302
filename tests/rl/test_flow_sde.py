"""Flow-SDE log-probs against an independent Gaussian density, and the policy's recomputation."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy import stats

from ejax.models import flow
from ejax.models.tiny import default_config as tiny_config
from ejax.rl.policy import tiny_flow_policy

N_STEPS, NOISE_LEVEL = 4, 0.5
W = np.array([[0.3, -0.2], [0.1, 0.4]], np.float32)


def groot_velocity(x, t):
  """A linear velocity field in GR00T time (t = 0 noise, t = 1 data): v = x W + 0.7 t."""
  return jnp.einsum("nha,ab->nhb", x, W) + 0.7 * t[:, None, None]


def test_flow_sde_log_prob_matches_independent_gaussian_density():
  noise = jax.random.normal(jax.random.key(0), (6, 3, 2))
  result = flow.flow_sde_sample(groot_velocity, noise, N_STEPS, jax.random.key(1), convention="groot",
                                noise_level=NOISE_LEVEL)
  chain, step_index = np.asarray(result.chain, np.float64), np.asarray(result.step_index)
  dt = 1.0 / N_STEPS
  assert len(set(step_index.tolist())) > 1  # the chosen stochastic step differs between samples
  for sample in range(noise.shape[0]):
    for step in range(N_STEPS):
      t = step / N_STEPS
      x = chain[sample, step]
      v = x @ W + 0.7 * t
      if step != step_index[sample]:
        np.testing.assert_allclose(chain[sample, step + 1], x + dt * v, rtol=1e-5, atol=1e-6)  # Euler
        continue
      # Forward-time SDE with the ODE's marginals: drift v + sigma^2 / 2 * score, where for
      # x = t a + (1 - t) eps the score is -(x - t v) / (1 - t); sigma = a sqrt((1 - t) / t), with
      # t floored at one step so the first step's scale is finite.
      sigma = NOISE_LEVEL * np.sqrt((1 - t) / max(t, dt))
      score = -(x - t * v) / (1 - t)
      mean = x + dt * (v + 0.5 * sigma**2 * score)
      expected = stats.norm.logpdf(chain[sample, step + 1], mean, sigma * np.sqrt(dt)).sum()
      np.testing.assert_allclose(result.log_prob[sample], expected, rtol=1e-4)
  recomputed = flow.flow_sde_log_prob(groot_velocity, result.chain, result.step_index, convention="groot",
                                      noise_level=NOISE_LEVEL)
  np.testing.assert_allclose(recomputed, result.log_prob, rtol=1e-5)


def test_policy_recomputes_the_log_prob_of_its_own_samples():
  model_config = tiny_config()
  model_config.update(width=16, depth=1, num_heads=2, state_dim=4, action_dim=2, horizon=2, num_tasks=4,
                      num_inference_steps=3)
  policy = tiny_flow_policy(model_config, rngs=nnx.Rngs(3), value_hidden=8)
  observation = {"observation.state": jax.random.normal(jax.random.key(0), (5, 4)),
                 "task_index": jnp.arange(5) % 4}
  sample = policy.sample(policy.initial_params, observation, jax.random.key(2))
  assert sample["actions"].shape == (5, 2, 2) and sample["chain"].shape == (5, 4, 2, 2)
  np.testing.assert_array_equal(sample["chain"][:, -1], sample["actions"])
  log_prob, value = policy.evaluate(policy.initial_params, observation, sample["chain"], sample["step_index"])
  np.testing.assert_allclose(log_prob, sample["log_prob"], rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(value, sample["value"], rtol=1e-6)
