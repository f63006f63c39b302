"""GR00T-N1.5 as the RL actor: the SFT checkpoint's own policy inside ejax.rl.policy.FlowPolicy.

    observation (plain arrays, dynamically batched by the inference server)
      --GrootObservations (in jit)--> GR00T batch: one sample per VL row (assemble's pack=False layout)
      --GrootActor.prepare--> (VL tokens after the VL transformer, state token): ONCE per sample
      --GrootActor.velocity x num_steps--> only the DiT and the per-embodiment action codecs
      chain in the model's normalised, max_action_dim-wide action space (padding dims masked out
      of the log-prob) --env_actions--> env units, cut to the env's action_dim

Everything from observation to model batch is jnp inside the sampler's jit, so the inference
server keeps batching plain arrays from any mix of shards: each task's Eagle prompt is tokenised
once, here, into constant tables [num_tasks, L] (tokens, segment ids, positions, image slots) that
the jitted code gathers by observation["task_index"]; images are resized with jax.image.resize
(antialiased bilinear, like the training pipeline's PIL resize); the state is normalised with the
checkpoint's statistics and zero-padded to max_state_dim, exactly as the train collate does.

Which parameters train follows the checkpoint's config (`groot.trainable_filter`: LLM and vision
frozen by default); FlowPolicy turns that filter into the learner's optimizer mask, so frozen
weights get no update and no optimizer moments. RL samples without dropout: Flow-SDE log-probs must
be deterministic functions of the parameters, and the learner's ratio compares two of them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from ejax.models import flow
from ejax.models import groot as groot_lib
from ejax.models import groot_inputs
from ejax.models.qwen_tokenizer import load_tokenizer
from ejax.rl.policy import STATE_OBSERVATIONS, ActorCritic, FlowPolicy, ValueHead, task_index

IMAGE_PREFIX = "observation.images."


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


class VlaObservations:
  """What every VLA actor's in-jit observation mapping shares (GR00T here, pi0.5 in ejax.rl.vla_pi05):
  the cameras in the train collate's order, images resized as the training pipeline did, the state
  normalised with the checkpoint's statistics and zero-padded, and the chain's end back to env actions.

  state_center / state_scale, action_center / action_scale: the checkpoint's normaliser (None:
  identity). data_image_size: the pipeline's [height, width] resize before the collate's own resize to
  the model's image_size (config.data.image_size; None: none), replayed here in the same order.
  cameras: the image keys the model was trained on (None: every "observation.images.*" key of the
  observation, sorted, as the train collate orders them); num_cameras of them are expected.
  aux_state_key / aux_center / aux_scale / aux_pixel_key: where the checkpoint's perception module
  found its training labels (data.aux_state_key, normalised like the checkpoint's data, and
  data.aux_pixel_key; None: no labels), read from the simulator's observations by `labelled`.
  """

  def __init__(self, *, state_key: str, state_center, state_scale, clip_state: bool, max_state_dim: int,
               action_dim: int, model_action_dim: int, horizon: int, action_center, action_scale,
               image_size: int, num_cameras: int, cameras: Sequence[str] | None = None,
               data_image_size: Sequence[int] | None = None, aux_state_key: str | None = None,
               aux_center=None, aux_scale=None, aux_pixel_key: str | None = None):
    if action_dim > model_action_dim:
      raise ValueError(f"env action_dim {action_dim} > the model's action width {model_action_dim}")
    self.state_key, self.clip_state, self.max_state_dim = state_key, clip_state, max_state_dim
    self.action_dim, self.num_cameras, self.image_size = action_dim, num_cameras, image_size
    self.cameras = None if cameras is None else sorted(k if k.startswith(IMAGE_PREFIX) else IMAGE_PREFIX + k
                                                       for k in cameras)
    self.resizes = ([tuple(int(x) for x in data_image_size)] if data_image_size else []) + [(image_size,) * 2]
    as_array = lambda x: None if x is None else np.asarray(x, np.float32).reshape(-1)
    self.state_center, self.state_scale = as_array(state_center), as_array(state_scale)
    self.action_center, self.action_scale = as_array(action_center), as_array(action_scale)
    self.aux_state_key, self.aux_pixel_key = aux_state_key, aux_pixel_key
    self.aux_center, self.aux_scale = as_array(aux_center), as_array(aux_scale)
    # Real action entries of the chain: the first action_dim of the model's width, every step.
    self.action_mask = np.zeros((horizon, model_action_dim), np.float32)
    self.action_mask[:, :action_dim] = 1.0

  def camera_keys(self, observation: dict) -> list[str]:
    keys = self.cameras if self.cameras is not None else sorted(k for k in observation if k.startswith(IMAGE_PREFIX))
    missing = [k for k in keys if k not in observation]
    if missing or len(keys) != self.num_cameras:
      present = sorted(k for k in observation if k.startswith(IMAGE_PREFIX))
      raise ValueError(f"the model was trained on {self.num_cameras} cameras ({keys}) but the observation has "
                       f"{present}: make the env with cameras=True")
    return keys

  def images(self, observation: dict) -> jax.Array:
    """[n * num_cameras, S, S, 3] uint8, sample-major like the train collate."""
    keys = self.camera_keys(observation)
    size = self.image_size
    per_camera = []
    for key in keys:
      image = jnp.asarray(observation[key])
      for height, width in self.resizes:  # each stage rounds to uint8, as PIL does
        if image.shape[1:3] != (height, width):
          resized = jax.image.resize(image.astype(jnp.float32), (image.shape[0], height, width, image.shape[3]),
                                     method="bilinear", antialias=True)
          image = jnp.clip(jnp.round(resized), 0, 255).astype(jnp.uint8)
      per_camera.append(image)
    if not per_camera:  # a camera-less model: text-only prompts
      return jnp.zeros((0, size, size, 3), jnp.uint8)
    stacked = jnp.stack(per_camera, axis=1)  # [n, cameras, S, S, 3]
    return stacked.reshape((-1,) + stacked.shape[2:])

  def state(self, observation: dict) -> jax.Array:
    """[n, max_state_dim] float32: normalised like the training samples, zero-padded."""
    state = jnp.asarray(observation[self.state_key]).astype(jnp.float32)
    if state.shape[-1] > self.max_state_dim:
      raise ValueError(f"{self.state_key} has {state.shape[-1]} dims > the model's max_state_dim "
                       f"{self.max_state_dim}")
    if self.state_center is not None:
      state = (state - self.state_center) / self.state_scale
      if self.clip_state:
        state = jnp.clip(state, -1.0, 1.0)
    return jnp.pad(state, ((0, 0), (0, self.max_state_dim - state.shape[-1])))

  def labelled(self, observation: dict) -> dict[str, jax.Array]:
    """The model batch with the perception module's targets filled from the simulator's privileged
    observations, as the train collate fills them from the recorded ones (ejax.models.perception.targets):
    aux_state normalised with the checkpoint's statistics, aux_mask 1, aux_pixels as the env gives them."""
    batch = self(observation)
    missing = [key for key in (self.aux_state_key, self.aux_pixel_key if "aux_pixels" in batch else None)
               if key and key not in observation]
    if not self.aux_state_key or missing:
      raise ValueError(f"the perception module's labels ({self.aux_state_key}, {self.aux_pixel_key}) are not in the "
                       f"observation (missing {missing}): an ejax.sim env with cameras=True gives them")
    target = jnp.asarray(observation[self.aux_state_key]).astype(jnp.float32)
    if self.aux_center is not None:
      target = (target - self.aux_center) / self.aux_scale
    batch.update(aux_state=target, aux_mask=jnp.ones(target.shape[:1], jnp.float32))
    if "aux_pixels" in batch:
      batch["aux_pixels"] = jnp.asarray(observation[self.aux_pixel_key]).astype(jnp.float32)
    return batch

  def env_actions(self, actions: jax.Array) -> jax.Array:
    """[n, h, model action width] normalised -> [n, h, action_dim] in env units."""
    actions = actions[..., :self.action_dim]
    if self.action_center is None:
      return actions
    return actions * self.action_scale + self.action_center


class GrootObservations(VlaObservations):
  """observation dict -> GR00T model batch, in jnp only (callable inside jit).

  One sample per VL row, as `groot_inputs.assemble(..., pack=False)` lays it out: row r holds
  sample r alone (segment 1, positions from 0, image slots counted from the sample's first image
  token), so sample_row_offset = 0 and sample_segment = 1 for every sample, and the per-task rows
  are constants gathered by task index. Rows are as long as the longest task prompt (rounded up
  to 8), not the training row length: padding beyond a sample's segment is masked everywhere, and
  shorter rows make every backbone call cheaper.
  """

  def __init__(self, model_config: ConfigDict, *, instructions: Sequence[str], embodiment_id: int = 0,
               tokenizer=None, **shared):
    """instructions[i] is the instruction of task_index i; `shared`: VlaObservations' settings but the
    model's (max_state_dim, action width, horizon, image size, cameras), which come from model_config."""
    c = model_config
    self.config = c
    super().__init__(max_state_dim=c.max_state_dim, model_action_dim=c.max_action_dim, horizon=c.action_horizon,
                     image_size=groot_inputs.batch_image_size(c), num_cameras=c.num_cameras, **shared)
    self.embodiment_id = embodiment_id
    tokenizer = tokenizer or load_tokenizer(c.tokenizer_path, c.llm.vocab_size)
    prompts = [groot_inputs.prompt_ids(c, tokenizer, text, c.num_cameras) for text in instructions]
    self.row_length = _round_up(max(len(p) for p in prompts), 8)
    # The same function the train collate packs with, one sample per row: its tables are ours.
    table_config = ConfigDict(c.to_dict())
    table_config.packing.row_length = self.row_length
    num_tasks, size = len(prompts), self.image_size
    table = groot_inputs.assemble(
        table_config, prompts, np.zeros((num_tasks * c.num_cameras, size, size, 3), np.uint8),
        np.zeros((num_tasks, c.max_state_dim)), np.zeros((num_tasks, c.action_horizon, c.max_action_dim)),
        np.zeros((num_tasks, c.action_horizon, c.max_action_dim)), np.zeros((num_tasks,)), pack=False)
    self.tables = {key: table[key] for key in ("vl_tokens", "vl_segment_ids", "vl_positions", "vl_image_slot")}
    self.num_tasks = num_tasks

  def __call__(self, observation: dict) -> dict[str, jax.Array]:
    task = jnp.asarray(task_index(observation)).astype(jnp.int32)  # rows of the prompt tables
    n = task.shape[0]
    batch = {key: jnp.take(jnp.asarray(table), task, axis=0) for key, table in self.tables.items()}
    batch.update(images=self.images(observation), state=self.state(observation),
                 sample_row_offset=jnp.zeros((n,), jnp.int32), sample_segment=jnp.ones((n,), jnp.int32),
                 embodiment_id=jnp.full((n,), self.embodiment_id, jnp.int32))
    return batch


# What RL trains when the context is cached (GrootActor(cache_context=True)): the flow part of the
# action head, downstream of the cached context (and the critic beside it).
FLOW_PARTS = ("state_encoder", "action_encoder", "action_decoder", "dit", "future_tokens", "position_embedding")
# The batch entries the DiT reads besides the VL tokens (one sample per row: ejax.rl.vla.GrootObservations).
_ROW_KEYS = ("vl_tokens", "vl_segment_ids", "embodiment_id", "sample_row_offset", "sample_segment")


class GrootActor(nnx.Module):
  """A Groot behind FlowPolicy's actor interface, with the once-per-sample context split out.

  prepare(batch) -> (batch, vl, state_tokens): backbone + VL transformer + state encoder;
  velocity(x, t, batch, vl, state_tokens): the DiT only (GR00T time convention).

  cache_context=True (RL trains FLOW_PARTS only): context(batch) returns what the flow reads (VL
  tokens after the VL transformer, the state vector, the row layout), computed once when the
  inference server samples and stored with the sample; the learner's log-probs then run only
  velocity_from_context (state encoder + DiT), never the vision tower or the LLM.
  """

  def __init__(self, groot: groot_lib.Groot, cache_context: bool = False):
    self.groot = groot
    self.cache_context = cache_context

  def context(self, batch: dict) -> dict:
    vl, state = self.groot.context_inputs(batch)
    return {"vl": vl, "state": state, **{key: batch[key] for key in _ROW_KEYS}}

  def velocity_from_context(self, noisy_actions: jax.Array, t: jax.Array, context: dict) -> jax.Array:
    head = self.groot.action_head
    state_tokens = head.state_encoder(context["state"][:, None, :], context["embodiment_id"])
    buckets = flow.groot_timestep_buckets(t, self.groot.config.num_timestep_buckets)
    return head.velocity(noisy_actions, buckets, state_tokens, context["vl"], context)

  def prepare(self, batch: dict) -> tuple:
    vl, state_tokens = self.groot.context(batch)  # no rng: no dropout (see the module docstring)
    return batch, vl, state_tokens

  def velocity(self, noisy_actions: jax.Array, t: jax.Array, batch: dict, vl: jax.Array,
               state_tokens: jax.Array) -> jax.Array:
    """noisy_actions [n, h, max_action_dim], t [n] -> velocity [n, h, max_action_dim]."""
    return self.groot.velocity_fn(batch, vl=vl, state_tokens=state_tokens)(noisy_actions, t)


@dataclasses.dataclass(frozen=True)
class VlaKind:
  """What makes one model family an RL actor; the rest (loading the SFT checkpoint, the critic, which
  parameters train, the FlowPolicy) is `vla_flow_policy`'s, the same for each. GR00T's is GROOT below,
  pi0.5's ejax.rl.vla_pi05.PI05."""
  name: str                 # rl.policy.kind, and the SFT checkpoint's config.model.name
  title: str                # in messages
  observations: Callable    # (CheckpointPolicy, instructions, **shared_settings(...)) -> VlaObservations
  actor: Callable           # (model, cache_context) -> an actor for FlowPolicy (prepare / velocity; context /
                            # velocity_from_context)
  flow_parts: tuple         # parameter path names downstream of the cached context (what RL trains with it)
  freeze_context: Callable  # model config -> None: sets the flags that freeze what the context is made from
  trainable_filter: Callable  # model config -> the train job's nnx filter
  convention: str           # the flow's time convention (ejax.models.flow)
  perception_loss: bool = False  # the actor takes perception_weight and has auxiliary_loss (rl.policy.perception_loss)


def load_sft(checkpoint_dir: str, step: int | None = None, kind: str = "groot"):
  """(model, CheckpointPolicy) of a train-job checkpoint: the SFT policy RL starts from.

  The CheckpointPolicy carries the config, the normaliser and the action dim exactly as the eval
  job uses them; the model is rebuilt from its restored state.
  """
  from ejax.train.policy import load_policy
  from ejax.train.state import model_parts
  policy = load_policy(os.path.abspath(checkpoint_dir), step=step)
  if policy.config.model.name != kind:
    raise ValueError(f"{checkpoint_dir} holds a {policy.config.model.name!r} model; rl.policy.kind={kind!r} "
                     f"needs a {kind!r} checkpoint (configs/{kind}.py)")
  # The restore lays the state out over a mesh of every device (the trainer's); the RL pipeline
  # places parameters itself (rl.placement), so they start as plain default-device arrays, like a
  # freshly built policy's. Left on the mesh (or device_put to one of its devices, which keeps the
  # mesh in the arrays' types), RL computations would run replicated over all devices and the
  # learner's outputs would not match its inputs' types: a second compilation of its update.
  state = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), policy.model_state)
  model = nnx.merge(model_parts(policy.config.model).graphdef, state)
  return model, policy


def shared_settings(sft_policy) -> dict:
  """VlaObservations' checkpoint settings (state key, normaliser, action dim, cameras, pipeline resize),
  read from the CheckpointPolicy as its act() uses them. The state is not clipped: the train pipeline's
  Normalizer clips in no mode (ejax.data.transforms)."""
  from ejax.train.policy import policy_normalizer
  config, normalizer = sft_policy.config, sft_policy.normalizer
  state_params = normalizer.params.get(sft_policy.state_key, (None, None))
  action_params = normalizer.params.get("action", (None, None))
  aux_key = config.data.get("aux_state_key", None)
  aux_params = (policy_normalizer(config.data, sft_policy.norm_stats, [aux_key]).params.get(aux_key, (None, None))
                if aux_key else (None, None))
  return dict(state_key=sft_policy.state_key, state_center=state_params[0], state_scale=state_params[1],
              clip_state=False, action_dim=int(sft_policy.action_dim or sft_policy.noise_shape[1]),
              action_center=action_params[0], action_scale=action_params[1], cameras=config.data.get("cameras"),
              data_image_size=config.data.get("image_size"), aux_state_key=aux_key, aux_center=aux_params[0],
              aux_scale=aux_params[1], aux_pixel_key=config.data.get("aux_pixel_key", None))


def observations_for(sft_policy, instructions: Sequence[str]) -> GrootObservations:
  """The in-jit observation mapping matching CheckpointPolicy.act's host-side one (GR00T)."""
  embodiment = sft_policy.config.data.get("embodiment_id", 0)
  return GrootObservations(sft_policy.config.model, instructions=instructions,
                           embodiment_id=embodiment if isinstance(embodiment, int) else 0,
                           **shared_settings(sft_policy))


def _freeze_groot(c: ConfigDict) -> None:
  c.tune_llm, c.tune_visual = False, False


GROOT = VlaKind(name="groot", title="GR00T", observations=lambda sft, instructions: observations_for(sft, instructions),
                actor=GrootActor, flow_parts=FLOW_PARTS, freeze_context=_freeze_groot,
                trainable_filter=groot_lib.trainable_filter, convention="groot")


def vla_flow_policy(kind: VlaKind, policy_config: ConfigDict, *, rngs: nnx.Rngs) -> FlowPolicy:
  """FlowPolicy(kind's actor from the SFT checkpoint, ValueHead critic) for rl.policy.kind=kind.name.

  policy_config: checkpoint (the train job's checkpoints dir), step (-1: newest), instructions
  (task_index -> instruction), state_dim / num_tasks / hidden (the critic), noise_level, noisy_steps,
  num_steps (0: the model's num_inference_steps), cache_context, train_backbone, perception_loss.

  perception_loss > 0 (kinds with `perception_loss`, a checkpoint with model.perception): the perception
  module trains too, by its own supervised losses (SFT's, times this weight) on the rollouts' frames
  against the simulator's labels (the object state and where the objects appear: privileged, like the
  critic's input), added to every learner minibatch. With the context cached, RL alone cannot move it: a
  weak start's estimate of where the target is stays as wrong as SFT left it, on every layout, whatever
  the action expert learns (BENCHMARKS.md, "RL-VLA3 with the pi0.5 actor"). Each sample keeps the
  estimate the behaviour policy acted on (its cached context), so the policy-gradient ratio stays exact.

  The critic is asymmetric: a ValueHead on proprioception + the env's object state + task
  (ejax.rl.policy.policy_state), privileged information the actor never sees. Values only shape
  advantages during training, so they may use what the deployed policy cannot; a low-dimensional
  critic also learns the returns within a few updates, while a head on the frozen VL features
  would share the actor's slow, image-sized forward pass for every value call (bootstrap included).
  """
  if not os.path.isdir(policy_config.checkpoint):
    from ejax.checkpoint import CheckpointError
    raise CheckpointError(
        f"rl.policy.checkpoint {policy_config.checkpoint} does not exist: a {kind.title} RL policy starts from, and "
        f"is rebuilt from, its SFT checkpoint (a train job's <workdir>/checkpoints); restore it or point sft= at one")
  step = int(policy_config.get("step", -1))
  model, sft = load_sft(policy_config.checkpoint, None if step < 0 else step, kind.name)
  c = model.config
  cache = bool(policy_config.get("cache_context", False))
  if cache or not policy_config.get("train_backbone", True):
    # RL moves the action part only: the vision tower and LLM (and the keypoint detectors) stay as
    # SFT left them, and the actor stops their gradient, so the learner skips their backward.
    kind.freeze_context(c)
  observations = kind.observations(sft, list(policy_config.instructions))
  if observations.num_tasks != policy_config.num_tasks:
    raise ValueError(f"rl.policy.instructions has {observations.num_tasks} entries but num_tasks="
                     f"{policy_config.num_tasks}: give one instruction per task index")
  critic = ValueHead(policy_config.state_dim, policy_config.num_tasks, policy_config.hidden, rngs)
  observation_keys = tuple(dict.fromkeys(STATE_OBSERVATIONS + (sft.state_key,)))  # + the cameras (prefix)
  weight = float(policy_config.get("perception_loss", 0.0))
  options, trained_parts, auxiliary_inputs = {}, kind.flow_parts + ("critic",), None
  if weight > 0:
    if not kind.perception_loss or not c.get("perception") or not observations.aux_state_key:
      raise ValueError(f"rl.policy.perception_loss={weight} trains the perception module on the simulator's labels: "
                       f"{policy_config.checkpoint} has no model.perception trained on data.aux_state_key"
                       + ("" if kind.perception_loss else f" (and {kind.title}'s RL actor has no such loss)")
                       + "; set rl.policy.perception_loss=0")
    options["perception_weight"] = weight
    trained_parts += ("perception",)
    observation_keys += tuple(key for key in (observations.aux_state_key, observations.aux_pixel_key)
                              if key and key not in observation_keys)
    auxiliary_inputs = lambda observation: (observations.labelled(observation),)
  trainable = kind.trainable_filter(c)
  if cache:  # the context is frozen: only the flow part (and the critic, and a trained perception) can move
    trainable = nnx.All(trainable, nnx.Any(*[nnx.PathContains(name) for name in trained_parts]))
  horizon, width = observations.action_mask.shape
  return FlowPolicy(ActorCritic(kind.actor(model, cache_context=cache, **options), critic), horizon=horizon,
                    action_dim=width,
                    num_steps=int(policy_config.get("num_steps", 0)) or c.num_inference_steps,
                    convention=kind.convention, noise_level=policy_config.noise_level,
                    noisy_steps=policy_config.get("noisy_steps", 0),
                    actor_inputs=lambda observation: (observations(observation),),
                    action_mask=observations.action_mask, env_actions=observations.env_actions,
                    trainable=trainable, observation_keys=observation_keys,
                    observation_prefixes=(IMAGE_PREFIX,), auxiliary_inputs=auxiliary_inputs)


def groot_flow_policy(policy_config: ConfigDict, *, rngs: nnx.Rngs) -> FlowPolicy:
  """FlowPolicy(GrootActor from the SFT checkpoint, ValueHead critic) for rl.policy.kind="groot"."""
  return vla_flow_policy(GROOT, policy_config, rngs=rngs)
