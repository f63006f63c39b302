"""The RL learner with delayed-scaling FP8 layers: it stores what their GEMMs push into the amax
histories, as the train step does (tests/train/test_step.py), and never hands a history to Adam."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ejax.kernels.fp8 import Fp8Dense, Fp8History
from ejax.rl.learner import make_update_fn
from ejax.rl.policy import ActorCritic, FlowPolicy, MlpFlowActor, ValueHead

STATE, ACTION, HORIZON, TASKS, HIDDEN = 3, 2, 4, 2, 32


def _policy(trainable=None) -> FlowPolicy:
  rngs = nnx.Rngs(0)
  actor = MlpFlowActor(state_dim=STATE, action_dim=ACTION, horizon=HORIZON, num_tasks=TASKS, hidden=HIDDEN, rngs=rngs)
  actor.hidden_layer = Fp8Dense(HIDDEN, HIDDEN, impl="xla_delayed", rngs=rngs)
  critic = ValueHead(STATE, TASKS, HIDDEN, rngs)
  return FlowPolicy(ActorCritic(actor, critic), horizon=HORIZON, action_dim=ACTION, num_steps=3, convention="groot",
                    trainable=trainable)


def _batch(policy: FlowPolicy, params, steps: int = 2, envs: int = 8) -> dict:
  rng = np.random.default_rng(0)
  observation = lambda: {"observation.state": rng.normal(size=(envs, STATE)).astype(np.float32),
                         "task_index": rng.integers(0, TASKS, envs).astype(np.int32)}
  observations = [observation() for _ in range(steps)]
  samples = [jax.jit(policy.sample)(params, obs, jax.random.key(t)) for t, obs in enumerate(observations)]
  stack = lambda trees: jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)
  sampled = stack(samples)
  return {"observation": stack(observations), "chain": sampled["chain"], "step_index": sampled["step_index"],
          "log_prob": sampled["log_prob"], "reward": rng.normal(size=(steps, envs)).astype(np.float32),
          "done": np.zeros((steps, envs), bool), "valid": np.ones((steps, envs), bool),
          "success": np.zeros((steps, envs), bool), "bootstrap_observation": observation()}


def _history(params) -> np.ndarray:
  (history,) = [np.asarray(x) for x in jax.tree.leaves(nnx.filter_state(params, Fp8History))]
  return history


@pytest.mark.parametrize("trainable", [None, nnx.Param])
def test_updates_keep_the_pushed_fp8_histories(trainable):
  """After an update each history holds the amaxes of its GEMM's inputs pushed in, one gradient step
  at a time (x's and the weight's > 0, the newest in column 0), with or without a trainable filter
  (which leaves the histories out of the optimizer's "trainable" part); the weights still train."""
  policy = _policy(trainable)
  assert policy.history_mask is not None
  params = policy.initial_params
  before = _history(params)
  assert not before.any()  # a fresh layer: empty histories
  optimizer = optax.adam(1e-3)
  if policy.trainable_mask is not None:
    labels = jax.tree.map(lambda m: "trainable" if m else "frozen", policy.trainable_mask)
    optimizer = optax.multi_transform({"trainable": optimizer, "frozen": optax.set_to_zero()}, labels)
  minibatches = 2
  update = jax.jit(make_update_fn(policy, optimizer, algorithm="ppo", gamma=0.99, gae_lambda=0.95, clip_epsilon=0.2,
                                  behaviour_weight_threshold=None, dual_clip=None, value_coef=0.5, num_epochs=1,
                                  num_minibatches=minibatches, group_size=1))
  new_params, _, metrics = update(params, optimizer.init(params), _batch(policy, params), jax.random.key(1))
  assert all(np.isfinite(float(v)) for v in jax.tree.leaves(metrics))
  after = _history(new_params)
  assert after.shape == before.shape
  # Rows: x, the weight, dY; one push a gradient step, the newest first.
  assert (after[:2, :minibatches] > 0).all() and not after[:2, minibatches:].any()
  # dY: the policy loss's gradient reached the layer in the second step. In the first it was exactly 0:
  # the actor's output layer starts at zero.
  assert after[2, 0] > 0 and after[2, 1] == 0
  # The weight's amax is the weight's own: the history was pushed, not moved by Adam.
  kernel = np.asarray(nnx.filter_state(new_params, nnx.Param)["actor"]["hidden_layer"]["kernel"].get_value())
  np.testing.assert_allclose(after[1, 0], np.abs(kernel).max(), rtol=0.02)
  moved = np.asarray(new_params["actor"]["hidden_layer"]["kernel"].get_value()) != np.asarray(
      params["actor"]["hidden_layer"]["kernel"].get_value())
  assert moved.any()
