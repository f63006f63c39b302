"""Before RL: supervised flow-matching on scripted-expert demonstrations, and closed-loop success.

The RL job fine-tunes a policy that already solves its task part of the time. When no SFT
checkpoint from the train job is given, `behaviour_clone` produces one in-process: it rolls out the
env's scripted expert (with action noise, so demonstrations are imperfect), labels every step with
the expert's next `horizon` actions, and trains the flow actor with the flow-matching loss of its
convention. `success_rate` is the closed-loop judge of jittable envs (PointReach; deterministic
Euler sampling, as evaluation runs a policy); `EvalPolicy` exposes a policy to ejax.eval's
`act(obs, instructions, rng)` interface, through which the eval job judges ejax.sim tasks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ejax.models import flow


def collect_expert_demos(env, *, num_episodes: int, horizon: int, action_noise: float, rng: jax.Array) -> dict:
  """Observations and expert action chunks: {"observation": {key: [M, ...]}, "actions": [M, horizon, a]}."""
  steps = env.max_steps

  def episode(key):
    reset_key, noise_key = jax.random.split(key)
    state = env.reset(reset_key)

    def body(state, noise_key):
      action = env.expert_action(state) + action_noise * jax.random.normal(noise_key, (env.action_dim,))
      action = jnp.clip(action, -1.0, 1.0)
      next_state = env.step(state, action)
      alive = ~state.done
      return next_state, (state.obs, action, alive)

    _, (observations, actions, alive) = jax.lax.scan(body, state, jax.random.split(noise_key, steps))
    # Chunk label of step t: actions t .. t + horizon - 1, the last action repeated past the end.
    index = jnp.minimum(jnp.arange(steps)[:, None] + jnp.arange(horizon)[None], steps - 1)
    return observations, actions[index], alive

  observations, chunks, alive = jax.jit(jax.vmap(episode))(jax.random.split(rng, num_episodes))
  keep = np.asarray(alive).reshape(-1)
  flat = lambda x: np.asarray(x).reshape((-1,) + x.shape[2:])[keep]
  return {"observation": {key: flat(value) for key, value in observations.items()}, "actions": flat(chunks)}


def collect_batched_expert_demos(batched_env, *, horizon: int, action_noise: float, rng: jax.Array) -> dict:
  """The same from an ejax.sim batched env (its scripted expert acts on privileged state): one
  episode per env, stepped on the host loop the eval job uses."""
  noise_rng, reset_rng = jax.random.split(rng)
  state = batched_env.reset(reset_rng)
  noise = np.random.default_rng(int(jax.random.randint(noise_rng, (), 0, 2**31 - 1)))
  observations, actions, alive = [], [], []
  for _ in range(batched_env.episode_length):
    action = batched_env.expert_actions(state)
    action = np.clip(action + action_noise * noise.standard_normal(action.shape), -1.0, 1.0).astype(np.float32)
    observations.append({key: np.asarray(value) for key, value in state.obs.items()})
    actions.append(action)
    alive.append(~np.asarray(state.done))
    state = batched_env.step(state, action)
  steps = len(actions)
  actions = np.stack(actions, axis=1)  # [N, T, a]
  index = np.minimum(np.arange(steps)[:, None] + np.arange(horizon)[None], steps - 1)
  keep = np.stack(alive, axis=1).reshape(-1)
  flat = lambda x: x.reshape((-1,) + x.shape[2:])[keep]
  observation = {key: flat(np.stack([o[key] for o in observations], axis=1)) for key in observations[0]}
  return {"observation": observation, "actions": flat(actions[:, index])}


def behaviour_clone(policy, params: Any, demos: dict, *, steps: int, batch_size: int, learning_rate: float,
                    rng: jax.Array) -> Any:
  """Flow-matching SFT of the actor on the demos; returns new params. The state normalisers of actor
  and critic (ejax.rl.policy.StateNormalizer) take the demos' statistics first; the critic's weights
  are untouched."""
  from ejax.rl.policy import policy_state, set_state_normalization
  model = nnx.merge(policy.graphdef, params)
  set_state_normalization(model, policy_state(demos["observation"]))
  params = nnx.state(model)
  # Cosine decay to 0: the last steps refine the fit at a small rate (a constant rate left the
  # closed-loop policy well short of its expert on the same step budget).
  optimizer = optax.adam(optax.cosine_decay_schedule(learning_rate, max(steps, 1)))
  convention = policy.convention

  def loss_fn(params, batch, key):
    model = nnx.merge(policy.graphdef, params)
    actions = batch["actions"]
    noise_key, time_key = jax.random.split(key)
    noise = jax.random.normal(noise_key, actions.shape)
    t = flow.sample_time(time_key, actions.shape[0], convention=convention)
    noisy, target = flow.interpolate(noise, actions, t, convention=convention)
    predicted = model.actor.velocity(noisy, t, *policy.velocity_inputs(model, batch["observation"]))
    return jnp.mean(jnp.square(predicted - target))

  @jax.jit
  def train_step(params, opt_state, batch, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = optimizer.init(params)
  num_samples = demos["actions"].shape[0]
  sampler = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
  for step in range(steps):
    index = sampler.integers(0, num_samples, batch_size)
    batch = jax.tree.map(lambda x: x[index], demos)
    rng, key = jax.random.split(rng)
    params, opt_state, loss = train_step(params, opt_state, batch, key)
  return params


def success_rate(policy, params: Any, env, *, num_episodes: int, actions_per_step: int, rng: jax.Array) -> float:
  """Share of episodes that reach success, executing `actions_per_step` actions of each Euler-sampled chunk."""
  num_chunks = -(-env.max_steps // actions_per_step)

  def episode(key):
    reset_key, policy_key = jax.random.split(key)
    state = env.reset(reset_key)

    def chunk_step(carry, key):
      state, succeeded = carry
      observation = jax.tree.map(lambda x: x[None], state.obs)
      chunk = policy.deterministic_actions(params, observation, key)[0]

      def act(carry, action):
        state, succeeded = carry
        next_state = env.step(state, action)
        next_state = jax.tree.map(lambda a, b: jnp.where(state.done, a, b), state, next_state)
        return (next_state, succeeded | next_state.success), None

      return jax.lax.scan(act, (state, succeeded), chunk[:actions_per_step])[0], None

    (_, succeeded), _ = jax.lax.scan(chunk_step, (state, jnp.zeros((), bool)), jax.random.split(policy_key, num_chunks))
    return succeeded

  successes = jax.jit(jax.vmap(episode))(jax.random.split(rng, num_episodes))
  return float(np.mean(np.asarray(successes)))


class EvalPolicy:
  """A FlowPolicy with fixed parameters behind ejax.eval's policy interface."""

  def __init__(self, policy, params: Any):
    self.policy, self.params = policy, params
    # One compiled sampler per policy: judging before and after RL must not compile twice.
    if "deterministic_actions" not in policy.compiled:
      policy.compiled["deterministic_actions"] = jax.jit(policy.deterministic_actions)
    self._act = policy.compiled["deterministic_actions"]

  def act(self, obs: dict, instructions: list[str] | None, rng: jax.Array) -> jax.Array:
    """obs {key: [num_envs, ...]} -> action chunks [num_envs, horizon, action_dim]."""
    del instructions  # the task is identified by obs["task_index"] for the policies built here
    # Only what the policy reads enters its jit (state-based policies: no images).
    return self._act(self.params, self.policy.select_observations(obs), rng)
