"""Pure RL objectives: GAE, the decoupled PPO loss, GRPO advantages, value loss and diagnostics.

Everything here is a jnp function of arrays, jit- and grad-friendly, with no knowledge of threads,
queues or models. Time-major layout throughout: [T, n] = [segment steps, environments].

The decoupled objective (AReaL, "asynchronous RL with decoupled PPO") separates two policies that
synchronous PPO conflates:
  pi_behav  the (possibly stale) policy that produced the sample, log-prob stored with the sample;
  pi_prox   the proximal policy the trust region is measured against: the learner's parameters at
            the start of the current update.
The ratio pi_theta / pi_prox is clipped as in PPO; each sample is weighted by pi_prox / pi_behav
(an importance weight for staleness, never differentiated), samples whose weight exceeds a
threshold are dropped, and a dual clip bounds the loss of negative-advantage samples. With
pi_prox = pi_behav every weight is 1 and the objective is ordinary clipped PPO.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gae(rewards: jax.Array, values: jax.Array, dones: jax.Array, bootstrap_value: jax.Array, *,
        gamma: float, lam: float, valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation over one segment.

  rewards, values, dones: [T, n]; bootstrap_value: [n] = V(obs after the last step).
  done[t] = 1 means the episode ended at step t (the next observation belongs to a new episode),
  so neither the value nor the advantage of step t + 1 flows back through it. `valid` [T, n] (1 =
  real step) zeroes steps after an episode froze; they contribute nothing and pass nothing back.
  Returns (advantages [T, n], returns [T, n] = advantages + values).
  """
  rewards, values = rewards.astype(jnp.float32), values.astype(jnp.float32)
  not_done = 1.0 - dones.astype(jnp.float32)
  valid = jnp.ones_like(rewards) if valid is None else valid.astype(jnp.float32)
  next_values = jnp.concatenate([values[1:], bootstrap_value[None].astype(jnp.float32)], axis=0)

  def backward(carry, step):
    reward, value, next_value, step_not_done, step_valid = step
    delta = reward + gamma * next_value * step_not_done - value
    advantage = delta + gamma * lam * step_not_done * carry
    advantage = advantage * step_valid
    return advantage, advantage

  _, advantages = jax.lax.scan(backward, jnp.zeros_like(bootstrap_value, jnp.float32),
                               (rewards, values, next_values, not_done, valid), reverse=True)
  return advantages, advantages + values


def grpo_advantages(episode_returns: jax.Array, *, group_size: int, epsilon: float = 1e-6) -> jax.Array:
  """Group-normalised advantages: (R - mean(group)) / (std(group) + epsilon).

  episode_returns: [n] with n = num_groups * group_size, consecutive entries forming one group
  (rollouts of the same task from the same initial state). A group whose rollouts all score the
  same carries no signal and gets advantage 0.
  """
  n = episode_returns.shape[0]
  if n % group_size:
    raise ValueError(f"GRPO needs the number of rollouts ({n}) to be a multiple of group_size ({group_size})")
  grouped = episode_returns.astype(jnp.float32).reshape(n // group_size, group_size)
  mean = grouped.mean(axis=1, keepdims=True)
  std = grouped.std(axis=1, keepdims=True)
  return ((grouped - mean) / (std + epsilon)).reshape(n)


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def decoupled_ppo_loss(log_prob: jax.Array, proximal_log_prob: jax.Array, behaviour_log_prob: jax.Array,
                       advantages: jax.Array, *, clip_epsilon: float = 0.2,
                       behaviour_weight_threshold: float | None = 2.0, dual_clip: float | None = 3.0,
                       mask: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The decoupled clipped policy-gradient loss (to minimise) and its diagnostics.

  log_prob: log pi_theta (differentiated); proximal_log_prob: log pi_prox; behaviour_log_prob:
  log pi_behav; advantages; mask (1 = use the sample): all the same shape. The gradient flows only
  through `log_prob`.
  """
  proximal_log_prob = jax.lax.stop_gradient(proximal_log_prob)
  behaviour_log_prob = jax.lax.stop_gradient(behaviour_log_prob)
  advantages = jax.lax.stop_gradient(advantages).astype(jnp.float32)
  mask = jnp.ones_like(advantages) if mask is None else mask.astype(jnp.float32)

  ratio = jnp.exp(log_prob - proximal_log_prob)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon)
  per_sample = jnp.maximum(unclipped, clipped)
  if dual_clip is not None:
    # A negative advantage times a huge ratio would dominate the batch: cap that loss at dual_clip*|A|.
    per_sample = jnp.where(advantages < 0, jnp.minimum(per_sample, -dual_clip * advantages), per_sample)

  behaviour_weight = jnp.exp(proximal_log_prob - behaviour_log_prob)
  used = mask
  if behaviour_weight_threshold is not None:
    used = used * (behaviour_weight <= behaviour_weight_threshold)
  loss = _masked_mean(per_sample * behaviour_weight, used)

  metrics = {
      "clip_fraction": clip_fraction(ratio, clip_epsilon, mask),
      "approx_kl_behaviour": approx_kl(log_prob, behaviour_log_prob, mask),
      "approx_kl_proximal": approx_kl(log_prob, proximal_log_prob, mask),
      "behaviour_weight_mean": _masked_mean(behaviour_weight, mask),
      "dropped_fraction": 1.0 - jnp.sum(used) / jnp.maximum(jnp.sum(mask), 1.0),
  }
  return loss, metrics


def clipped_ppo_loss(log_prob: jax.Array, old_log_prob: jax.Array, advantages: jax.Array, *,
                     clip_epsilon: float = 0.2, mask: jax.Array | None = None) -> jax.Array:
  """Plain clipped PPO (Schulman et al. 2017): the synchronous special case, kept as the reference."""
  mask = jnp.ones_like(advantages) if mask is None else mask
  ratio = jnp.exp(log_prob - jax.lax.stop_gradient(old_log_prob))
  objective = jnp.minimum(ratio * advantages, jnp.clip(ratio, 1 - clip_epsilon, 1 + clip_epsilon) * advantages)
  return -_masked_mean(objective, mask)


def value_loss(values: jax.Array, returns: jax.Array, *, old_values: jax.Array | None = None,
               clip_range: float | None = None, mask: jax.Array | None = None) -> jax.Array:
  """0.5 * squared error to the returns; with clip_range, PPO's pessimistic clipped variant."""
  mask = jnp.ones_like(values) if mask is None else mask
  returns = jax.lax.stop_gradient(returns)
  error = jnp.square(values - returns)
  if clip_range is not None and old_values is not None:
    old_values = jax.lax.stop_gradient(old_values)
    clipped_values = old_values + jnp.clip(values - old_values, -clip_range, clip_range)
    error = jnp.maximum(error, jnp.square(clipped_values - returns))
  return 0.5 * _masked_mean(error, mask)


def approx_kl(log_prob: jax.Array, reference_log_prob: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """KL(reference || current) by the unbiased, non-negative k3 estimator: E[(r - 1) - log r], r = p/p_ref."""
  mask = jnp.ones_like(log_prob) if mask is None else mask
  log_ratio = jax.lax.stop_gradient(log_prob - reference_log_prob)
  return _masked_mean(jnp.expm1(log_ratio) - log_ratio, mask)


def clip_fraction(ratio: jax.Array, clip_epsilon: float, mask: jax.Array | None = None) -> jax.Array:
  """Share of samples whose ratio left [1 - eps, 1 + eps]."""
  mask = jnp.ones_like(ratio) if mask is None else mask
  return _masked_mean((jnp.abs(jax.lax.stop_gradient(ratio) - 1.0) > clip_epsilon).astype(jnp.float32), mask)


def normalize_advantages(advantages: jax.Array, mask: jax.Array | None = None, epsilon: float = 1e-8) -> jax.Array:
  """Zero mean, unit variance over the valid samples of a batch."""
  mask = jnp.ones_like(advantages) if mask is None else mask.astype(jnp.float32)
  mean = _masked_mean(advantages, mask)
  variance = _masked_mean(jnp.square(advantages - mean), mask)
  return (advantages - mean) * jax.lax.rsqrt(variance + epsilon) * mask
