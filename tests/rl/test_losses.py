"""The pure RL objectives against hand-computed cases and the textbook clipped PPO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejax.rl import losses


def test_gae_matches_hand_computed_case():
  # Column 0 ends its episode at step 1; column 1 runs through and bootstraps from 0.
  rewards = jnp.array([[1.0, 0.0], [0.0, 0.0], [2.0, 1.0]])
  values = jnp.array([[0.5, 0.0], [1.0, 0.0], [0.0, 0.0]])
  dones = jnp.array([[0, 0], [1, 0], [0, 0]])
  bootstrap = jnp.array([3.0, 0.0])
  advantages, returns = losses.gae(rewards, values, dones, bootstrap, gamma=0.9, lam=0.8)
  # By hand: delta_2 = 2 + .9*3 = 4.7; step 1 is terminal: delta_1 = -1, A_1 = -1;
  # delta_0 = 1 + .9*1 - .5 = 1.4, A_0 = 1.4 + .72*(-1) = 0.68.  Column 1: A = .72^2, .72, 1.
  np.testing.assert_allclose(advantages, [[0.68, 0.5184], [-1.0, 0.72], [4.7, 1.0]], rtol=1e-6)
  np.testing.assert_allclose(returns, [[1.18, 0.5184], [0.0, 0.72], [4.7, 1.0]], rtol=1e-6)


def test_gae_invalid_steps_contribute_nothing():
  rewards = jnp.array([[1.0], [5.0]])
  values = jnp.array([[0.0], [7.0]])
  advantages, _ = losses.gae(rewards, values, jnp.array([[1], [0]]), jnp.array([9.0]),
                             gamma=1.0, lam=1.0, valid=jnp.array([[1.0], [0.0]]))
  np.testing.assert_allclose(advantages, [[1.0], [0.0]])


def _random_batch(seed, n=64):
  keys = jax.random.split(jax.random.key(seed), 4)
  log_prob = jax.random.normal(keys[0], (n,)) * 0.3
  behaviour = log_prob + jax.random.normal(keys[1], (n,)) * 0.4
  advantages = jax.random.normal(keys[2], (n,))
  return log_prob, behaviour, advantages


def test_decoupled_loss_equals_clipped_ppo_when_proximal_is_behaviour():
  log_prob, behaviour, advantages = _random_batch(0)
  def decoupled(lp):
    return losses.decoupled_ppo_loss(lp, behaviour, behaviour, advantages, clip_epsilon=0.2,
                                     behaviour_weight_threshold=2.0, dual_clip=None)[0]
  def reference(lp):
    return losses.clipped_ppo_loss(lp, behaviour, advantages, clip_epsilon=0.2)
  np.testing.assert_allclose(decoupled(log_prob), reference(log_prob), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(decoupled)(log_prob), jax.grad(reference)(log_prob), rtol=1e-5, atol=1e-7)
  # Ratios far from 1 exist, so the clipping is exercised, not bypassed.
  assert float(losses.clip_fraction(jnp.exp(log_prob - behaviour), 0.2)) > 0.2


def test_decoupled_loss_weights_drops_and_dual_clips():
  log_prob = jnp.log(jnp.array([1.0, 1.0, 10.0]))
  proximal = jnp.zeros(3)
  behaviour = jnp.log(jnp.array([0.8, 0.2, 1.0]))   # behaviour weights 1.25, 5 (dropped), 1
  advantages = jnp.array([1.0, 1.0, -1.0])
  loss, metrics = losses.decoupled_ppo_loss(log_prob, proximal, behaviour, advantages, clip_epsilon=0.2,
                                            behaviour_weight_threshold=2.0, dual_clip=3.0)
  # Sample 0: ratio 1 -> -1 * 1.25.  Sample 1: dropped.  Sample 2: ratio 10, A = -1: PPO gives 10,
  # the dual clip caps it at 3.  Mean over the two kept samples.
  np.testing.assert_allclose(loss, (-1.25 + 3.0) / 2, rtol=1e-6)
  np.testing.assert_allclose(metrics["dropped_fraction"], 1 / 3, rtol=1e-6)


def test_grpo_advantages_are_group_normalised():
  returns = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
  advantages = losses.grpo_advantages(returns, group_size=4)
  np.testing.assert_allclose(advantages[:4], [1.0, -1.0, -1.0, 1.0], rtol=1e-5)
  np.testing.assert_allclose(advantages[4:], 0.0)
  with pytest.raises(ValueError, match="multiple of group_size"):
    losses.grpo_advantages(returns, group_size=3)


def test_value_loss_and_clipping():
  values, returns, old = jnp.array([1.0, 3.0]), jnp.array([0.0, 0.0]), jnp.array([0.0, 0.0])
  np.testing.assert_allclose(losses.value_loss(values, returns), 0.25 * (1 + 9))
  # Clipped: the clipped prediction (0.5, 0.5) is closer, so the pessimistic max keeps the raw error.
  np.testing.assert_allclose(losses.value_loss(values, returns, old_values=old, clip_range=0.5), 0.25 * (1 + 9))
  np.testing.assert_allclose(losses.value_loss(values, jnp.array([2.0, 6.0]), old_values=old, clip_range=0.5),
                             0.25 * (1.5**2 + 5.5**2))


def test_approx_kl_matches_exact_kl_for_gaussians():
  samples = jax.random.normal(jax.random.key(1), (200_000,))  # drawn from the reference N(0, 1)
  shifted_log_prob = -0.5 * (samples - 0.3) ** 2
  reference_log_prob = -0.5 * samples**2
  np.testing.assert_allclose(losses.approx_kl(shifted_log_prob, reference_log_prob), 0.5 * 0.3**2, rtol=0.05)
