"""Actor-critic around a flow-matching policy: Flow-SDE sampling, log-probs and a value head.

The actor is any flow-matching model with a `velocity(noisy_actions, t, *inputs)` method in its
own time convention (ejax.models.tiny.TinyFlowPolicy; GR00T through ejax.rl.vla.GrootActor, whose
`prepare` runs the VL backbone once per sample). Exploration and likelihoods come from Flow-SDE
(ejax.models.flow): one randomly chosen denoising step is a Gaussian transition, the rest stay
Euler; a sample stores its chain and the chosen step, so the learner recomputes its log-prob under
new parameters with one velocity call.

The critic is a small MLP on the observation's state and task. Everything is functional over
(graphdef, params) so the inference server and the learner, each on its own thread and device,
share no mutable module.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ejax.kernels.fp8 import Fp8History
from ejax.models import flow
from ejax.parallel import axes as ax

# observation dict -> the positional inputs the actor's velocity takes after (x, t).
ActorInputs = Callable[[dict], tuple]

# What the state-based policies read (policy_state, task_index); images stay out of their jit.
STATE_OBSERVATIONS = ("observation.state", "observation.environment_state", "task_index")


def task_index(observation: dict) -> jax.Array:
  """The task id of each env [n]; single-task envs without a "task_index" observation are task 0."""
  if "task_index" in observation:
    return observation["task_index"]
  return jnp.zeros(observation["observation.state"].shape[:1], jnp.int32)


def policy_state(observation: dict) -> jax.Array:
  """The state a state-based policy sees [n, s]: proprioception, followed by the scene's object state
  ("observation.environment_state", ejax.sim's task objects) when the env provides one."""
  state = observation["observation.state"].astype(jnp.float32)
  if "observation.environment_state" in observation:
    state = jnp.concatenate([state, observation["observation.environment_state"].astype(jnp.float32)], axis=-1)
  return state


def state_and_task(observation: dict) -> tuple:
  """Inputs of ejax.models.tiny.TinyFlowPolicy.velocity: (state [n, s], task_id [n])."""
  return policy_state(observation), task_index(observation)


class StateStatistic(nnx.Variable):
  """A normalisation statistic: saved and restored with the parameters, never trained."""


class StateNormalizer(nnx.Module):
  """(state - mean) / std with per-dimension statistics of the training demonstrations.

  The state mixes joint angles (radians), positions (metres, where centimetres decide a grasp) and
  flags; an MLP fed the raw values could not tell a 1 cm offset from noise within its SFT budget (the
  privileged-state actor reached 22 % on "lift the green block" where its expert reached 100 %;
  normalised, 99 %). Identity until `set` is called; gradients do not reach the statistics, so an
  optimizer over every variable leaves them unchanged."""

  def __init__(self, dim: int):
    self.mean = StateStatistic(jnp.zeros((dim,), jnp.float32))
    self.std = StateStatistic(jnp.ones((dim,), jnp.float32))

  def __call__(self, state: jax.Array) -> jax.Array:
    mean, std = jax.lax.stop_gradient(self.mean[...]), jax.lax.stop_gradient(self.std[...])
    return (state.astype(jnp.float32) - mean) / std


def set_state_normalization(model: nnx.Module, states: Any, min_std: float = 1e-2) -> None:
  """Sets every StateNormalizer in `model` from states [M, s] (demonstrations' policy_state).
  min_std keeps constant dimensions (a flag never set in the demos) from being blown up."""
  states = jnp.asarray(states, jnp.float32)
  mean, std = states.mean(axis=0), jnp.maximum(states.std(axis=0), min_std)
  for _, module in nnx.iter_graph(model):
    if isinstance(module, StateNormalizer):
      module.mean[...], module.std[...] = mean, std


class ValueHead(nnx.Module):
  """V(state, task): MLP on the (normalised) proprioceptive state and a task embedding."""

  def __init__(self, state_dim: int, num_tasks: int, hidden: int, rngs: nnx.Rngs):
    self.normalize = StateNormalizer(state_dim)
    dense = lambda i, o, axes: nnx.Linear(i, o, rngs=rngs, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), axes),
                                          bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axes[1],)))
    self.state_in = dense(state_dim, hidden, (ax.IN_FEATURES, ax.MLP))
    self.task_embed = nnx.Embed(num_tasks, hidden, rngs=rngs,
                                embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.1), (ax.VOCAB, ax.MLP)))
    self.hidden = dense(hidden, hidden, (ax.MLP, ax.EMBED))
    self.out = dense(hidden, 1, (ax.EMBED, ax.IN_FEATURES))

  def __call__(self, observation: dict) -> jax.Array:
    x = jnp.tanh(self.state_in(self.normalize(policy_state(observation)))
                 + self.task_embed(task_index(observation)))
    return self.out(jnp.tanh(self.hidden(x)))[:, 0]


class MlpFlowActor(nnx.Module):
  """A small flow-matching actor: velocity = MLP(noisy chunk, sinusoidal t, normalised state, task embedding).

  For CPU-sized RL runs and tests, where a transformer actor would spend most of the time compiling.
  Convention-agnostic: it learns whatever time convention it is trained and sampled with.
  """

  def __init__(self, *, state_dim: int, action_dim: int, horizon: int, num_tasks: int, hidden: int, rngs: nnx.Rngs):
    dense = lambda i, o, axes, init=nnx.initializers.lecun_normal(): nnx.Linear(
        i, o, rngs=rngs, kernel_init=nnx.with_partitioning(init, axes),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axes[1],)))
    self.horizon, self.action_dim, self.hidden = horizon, action_dim, hidden
    self.normalize = StateNormalizer(state_dim)
    self.inputs = dense(horizon * action_dim + state_dim + hidden, hidden, (ax.IN_FEATURES, ax.MLP))
    self.task_embed = nnx.Embed(num_tasks, hidden, rngs=rngs,
                                embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.1), (ax.VOCAB, ax.MLP)))
    self.hidden_layer = dense(hidden, hidden, (ax.MLP, ax.EMBED))
    self.out = dense(hidden, horizon * action_dim, (ax.EMBED, ax.IN_FEATURES), nnx.initializers.zeros_init())

  def velocity(self, noisy_actions: jax.Array, t: jax.Array, state: jax.Array, task_id: jax.Array) -> jax.Array:
    """noisy_actions [n, h, a], t [n], state [n, s], task_id [n] -> velocity [n, h, a]."""
    n = noisy_actions.shape[0]
    half = self.hidden // 2
    angles = t.astype(jnp.float32)[:, None] * jnp.exp(jnp.linspace(0.0, jnp.log(1000.0), half))[None]
    time_features = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    features = jnp.concatenate([noisy_actions.reshape(n, -1).astype(jnp.float32), self.normalize(state),
                                time_features], axis=-1)
    x = jax.nn.gelu(self.inputs(features) + self.task_embed(task_id))
    x = jax.nn.gelu(self.hidden_layer(x))
    return self.out(x).reshape(n, self.horizon, self.action_dim)


class ActorCritic(nnx.Module):
  def __init__(self, actor: nnx.Module, critic: nnx.Module):
    self.actor, self.critic = actor, critic


class FlowPolicy:
  """Pure functions of (params, observation) for a flow actor and a value critic.

  sample(params, observation, rng) -> {"actions" [n, h, env a], "chain" [n, steps + 1, h, a],
      "step_index" [n], "log_prob" [n], "value" [n]}
  evaluate(params, observation, chain, step_index) -> (log_prob [n], value [n])
  value(params, observation) -> [n]

  Optional parts, for actors that are whole VLAs (ejax.rl.vla):
  - an actor with `prepare(*actor_inputs) -> inputs` runs it once per sample / evaluate call, and
    its `velocity(x, t, *inputs)` once per denoising step (the backbone is not re-run per step);
  - action_mask [h, a] (1 = real): the chain may be wider than the env's action (a model's padded
    max_action_dim); log-probs count only the real entries, in sample and evaluate alike;
  - env_actions(chain's last state) -> the actions the env executes (e.g. unnormalised and cut to
    the env's action_dim); the chain and its log-prob stay in the actor's own space;
  - trainable: an nnx filter of the parameters the learner may update (`trainable_mask`, a bool
    pytree like the params, which ejax.rl.pipeline.make_optimizer honours); None: all of them;
  - observation_keys / observation_prefixes: what `select_observations` keeps for the policy;
  - auxiliary_inputs(observation) -> the positional inputs of the actor's
    `auxiliary_loss(*inputs) -> (loss, metrics)`, a supervised loss of its own that the learner adds to
    every minibatch's (a VLA's perception module on the simulator's labels: ejax.rl.vla); None: none.
  """

  def __init__(self, model: ActorCritic, *, horizon: int, action_dim: int, num_steps: int,
               convention: str, noise_level: float = 0.5, actor_inputs: ActorInputs = state_and_task,
               action_mask: Any = None, env_actions: Callable[[jax.Array], jax.Array] | None = None,
               trainable: Any = None, observation_keys: tuple[str, ...] = STATE_OBSERVATIONS,
               observation_prefixes: tuple[str, ...] = (), noisy_steps: int = 0,
               auxiliary_inputs: ActorInputs | None = None):
    self.graphdef, params = nnx.split(model)
    self.initial_params = params
    self.horizon, self.action_dim, self.num_steps = horizon, action_dim, num_steps
    self.convention, self.noise_level, self.actor_inputs = convention, noise_level, actor_inputs
    self.noisy_steps = noisy_steps  # > 0: the stochastic step is one of the first noisy_steps (flow_sde_sample)
    self.action_mask = None if action_mask is None else jnp.asarray(action_mask, jnp.float32)
    self.env_actions = env_actions or (lambda actions: actions)
    self.trainable_mask = None if trainable is None else trainable_mask(model, params, trainable)
    # Delayed-scaling FP8 layers' amax histories (ejax.kernels.fp8.Fp8History): the learner stores
    # what the loss's GEMMs push into them, as the train step does; None without any.
    histories = trainable_mask(model, params, Fp8History)
    self.history_mask = histories if any(jax.tree.leaves(histories)) else None
    self.observation_keys, self.observation_prefixes = tuple(observation_keys), tuple(observation_prefixes)
    self.auxiliary_inputs = auxiliary_inputs
    self.jit_sample = jax.jit(self.sample)  # one compiled sampler per policy, shared by every server
    self.compiled: dict = {}  # other jitted functions of this policy, built once (see ejax.rl.pipeline)

  def select_observations(self, observation: dict) -> dict:
    """The entries of an env observation this policy reads (the rest need not travel to it)."""
    return {key: value for key, value in observation.items()
            if key in self.observation_keys or key.startswith(self.observation_prefixes)}

  def velocity_inputs(self, model: ActorCritic, observation: dict) -> tuple:
    """The positional inputs of model.actor.velocity after (x, t), computed once per call."""
    inputs = self.actor_inputs(observation)
    prepare = getattr(model.actor, "prepare", None)
    return inputs if prepare is None else prepare(*inputs)

  def _velocity_fn(self, model: ActorCritic, observation: dict, context: dict | None = None):
    # An actor's flow_constants (pi0.5: its expert's compute-dtype weights) are made here, once a call,
    # not once a flow step.
    constants = model.actor.flow_constants() if hasattr(model.actor, "flow_constants") else {}
    if context is not None:  # the actor's cached context (see `sample`): the flow alone
      return lambda x, t: model.actor.velocity_from_context(x, t, context, **constants)
    inputs = self.velocity_inputs(model, observation)
    return lambda x, t: model.actor.velocity(x, t, *inputs, **constants)

  def _noise(self, rng: jax.Array, observation: dict) -> jax.Array:
    n = observation["observation.state"].shape[0]
    return flow.normal_per_row(rng, (n, self.horizon, self.action_dim))

  def sample(self, params: Any, observation: dict, rng: jax.Array) -> dict[str, jax.Array]:
    """An actor with cache_context (a frozen, expensive context: ejax.rl.vla.GrootActor) returns it
    as "context"; the learner hands it back to `evaluate`, which then runs only the flow."""
    model = nnx.merge(self.graphdef, params)
    # One key, or one key per row [n] (the RL env shards send their own: a sample then does not
    # depend on which shards share its inference batch, so sync runs repeat on any process count).
    noise_rng, sde_rng = jax.vmap(jax.random.split, out_axes=1)(rng) if flow.per_row_keys(rng) else jax.random.split(rng)
    caches = getattr(model.actor, "cache_context", False)
    context = model.actor.context(*self.actor_inputs(observation)) if caches else None
    result = flow.flow_sde_sample(self._velocity_fn(model, observation, context), self._noise(noise_rng, observation),
                                  self.num_steps, sde_rng, convention=self.convention, noise_level=self.noise_level,
                                  action_mask=self.action_mask, noisy_steps=self.noisy_steps)
    out = {"actions": self.env_actions(result.actions), "chain": result.chain, "step_index": result.step_index,
           "log_prob": result.log_prob, "value": model.critic(observation)}
    if context is not None:
      out["context"] = context
    return out

  def evaluate(self, params: Any, observation: dict, chain: jax.Array, step_index: jax.Array,
               context: dict | None = None) -> tuple[jax.Array, jax.Array]:
    model = nnx.merge(self.graphdef, params)
    log_prob = flow.flow_sde_log_prob(self._velocity_fn(model, observation, context), chain, step_index,
                                      convention=self.convention, noise_level=self.noise_level,
                                      action_mask=self.action_mask)
    return log_prob, model.critic(observation)

  def auxiliary_loss(self, params: Any, observation: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The actor's own supervised loss on these observations (see auxiliary_inputs) and its metrics."""
    return nnx.merge(self.graphdef, params).actor.auxiliary_loss(*self.auxiliary_inputs(observation))

  def value(self, params: Any, observation: dict) -> jax.Array:
    return nnx.merge(self.graphdef, params).critic(observation)

  def deterministic_actions(self, params: Any, observation: dict, rng: jax.Array) -> jax.Array:
    """Euler (ODE) sampling, as evaluation runs the policy; env actions."""
    model = nnx.merge(self.graphdef, params)
    actions = flow.euler_sample(self._velocity_fn(model, observation), self._noise(rng, observation), self.num_steps,
                                convention=self.convention)
    return self.env_actions(actions)


def trainable_mask(model: nnx.Module, params: Any, trainable: Any) -> Any:
  """A pytree of bools shaped like `params` (nnx.split(model)): True where `trainable` (an nnx
  filter over the model's paths) selects the parameter."""
  _, selected, _ = nnx.split(model, trainable, ...)
  chosen = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(selected)[0]}
  return jax.tree_util.tree_map_with_path(lambda path, _: jax.tree_util.keystr(path) in chosen, params)


def tiny_flow_policy(model_config, *, rngs: nnx.Rngs, value_hidden: int = 64, noise_level: float = 0.5,
                     actor: nnx.Module | None = None) -> FlowPolicy:
  """ejax.models.tiny's flow transformer (GR00T convention) as actor, a ValueHead as critic."""
  from ejax.models.tiny import TinyFlowPolicy
  actor = actor if actor is not None else TinyFlowPolicy(model_config, rngs)
  critic = ValueHead(model_config.state_dim, model_config.num_tasks, value_hidden, rngs)
  return FlowPolicy(ActorCritic(actor, critic), horizon=model_config.horizon, action_dim=model_config.action_dim,
                    num_steps=model_config.num_inference_steps, convention="groot", noise_level=noise_level)


def mlp_flow_policy(*, state_dim: int, action_dim: int, horizon: int, num_tasks: int, num_steps: int,
                    hidden: int, rngs: nnx.Rngs, convention: str = "groot", noise_level: float = 0.5,
                    noisy_steps: int = 0) -> FlowPolicy:
  """MlpFlowActor + ValueHead: the CPU-sized flow policy of the RL tests and the `runlocal` run."""
  actor = MlpFlowActor(state_dim=state_dim, action_dim=action_dim, horizon=horizon, num_tasks=num_tasks,
                       hidden=hidden, rngs=rngs)
  critic = ValueHead(state_dim, num_tasks, hidden, rngs)
  return FlowPolicy(ActorCritic(actor, critic), horizon=horizon, action_dim=action_dim, num_steps=num_steps,
                    convention=convention, noise_level=noise_level, noisy_steps=noisy_steps)
