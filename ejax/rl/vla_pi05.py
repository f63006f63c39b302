"""pi0.5 as the RL actor: the SFT checkpoint's own policy inside ejax.rl.policy.FlowPolicy.

    observation (plain arrays, dynamically batched by the inference server)
      --Pi05Observations (in jit)--> pi0.5 batch: one sample per prefix row, its prompt's state bins
      --Pi05Actor.context--> the prefix's KV cache (images + instruction + state tokens through the
        PaliGemma LLM) and what the perception module saw: ONCE per sample
      --Pi05Actor.velocity_from_context x num_steps--> only the action expert (Gemma-300M + its
        projections), in openpi's time convention (t = 1 noise)

GR00T's actor (ejax.rl.vla) is the same recipe: the model-specific parts are this file's
Pi05Observations and Pi05Actor, behind ejax.rl.vla.VlaKind; loading the SFT checkpoint, the critic,
the trainable mask and the FlowPolicy are shared (ejax.rl.vla.vla_flow_policy).

pi0.5 writes the normalised state into its prompt ("Task: ..., State: 12 200 ...;\\nAction: ", one
token per 256-bin value): each task's prompt is tokenised once into a constant row with the bins'
positions, and the jitted code writes each sample's bins there (checked against the checkpoint collate's at
construction). With cache_context (what configs/rl_vla3.py's actor=pi05 sets) the context is stored
with every sample and the learner's log-probs run the action expert only; RL then trains
FLOW_PARTS (the expert, its action and time projections, the perception slots' projections).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from ejax.models import gemma, perception
from ejax.models import pi05 as pi05_lib
from ejax.models import pi05_inputs
from ejax.models.perception.targets import targets as perception_targets
from ejax.models.paligemma_tokenizer import STATE_BINS
from ejax.rl.policy import task_index
from ejax.rl.vla import IMAGE_PREFIX, VlaKind, VlaObservations, shared_settings

# What RL trains when the context is cached: everything downstream of the prefix's KV cache.
FLOW_PARTS = ("expert", "action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out", "perception_cond",
              "perception_tokens", "state_proj")
_TABLE_KEYS = ("prefix_tokens", "prefix_is_image", "prefix_image_index", "prefix_segment_ids", "prefix_positions",
               "suffix_segment_ids", "suffix_positions")
# The batch entries the action expert reads besides the cache (one sample per row).
_SUFFIX_KEYS = ("suffix_segment_ids", "suffix_positions", "sample_row_offset", "sample_slot")


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def collated_prompts(collate, model_config, texts: Sequence[str], states: np.ndarray) -> list[np.ndarray]:
  """The prompt token ids (image tokens left out) the checkpoint's own collate makes for each
  (instruction, normalised state) pair: the train collate is the reference the in-jit prompts follow."""
  c = model_config
  size, h = c.vision.image_size, c.action_horizon
  cameras = [f"{IMAGE_PREFIX}camera{i}" for i in range(c.num_cameras)]
  prompts = []
  for text, state in zip(texts, states):  # one at a time: any prompt the model can read fits a row alone
    batch = collate([{"observation.state": np.asarray(state, np.float32), "task": text,
                      "action": np.zeros((h, c.action_dim), np.float32), "action_is_pad": np.zeros((h,), bool),
                      **{key: np.zeros((size, size, 3), np.uint8) for key in cameras}}])
    row = pi05_inputs.sample_rows(batch)[0]
    mine = (batch["prefix_segment_ids"][row] == batch["sample_slot"][0] + 1) & ~batch["prefix_is_image"][row]
    prompts.append(np.asarray(batch["prefix_tokens"][row][mine]))
  return prompts


class Pi05Observations(VlaObservations):
  """observation dict -> pi0.5 model batch, in jnp only (callable inside jit).

  One sample per prefix row (pi05_inputs.assemble's pack=False layout, one action slot a row): row r
  holds sample r's image tokens then its prompt, so sample_row_offset = sample_slot = 0 and the
  per-task rows are constants gathered by task index, with the state's bins written in. Rows are as
  long as the longest prompt (rounded up to 8), not the training row length. `collate`: the
  checkpoint's (CheckpointPolicy.collate), whose prompts these must equal (checked here).
  """

  def __init__(self, model_config: ConfigDict, *, instructions: Sequence[str], collate, **shared):
    c = model_config
    self.config = c
    num_cameras = len(shared["cameras"]) if shared.get("cameras") else c.num_cameras
    super().__init__(max_state_dim=c.max_state_dim, model_action_dim=c.action_dim, horizon=c.action_horizon,
                     image_size=c.vision.image_size, num_cameras=num_cameras, **shared)
    self.settings = perception.read(c)
    # The prompt bins the data's entries only when the perception module owns the state's last slots.
    dims = self.settings.layout.data_dims if self.settings is not None else c.max_state_dim
    # model.discrete_state_input=False: prompts without the state, nothing to write in
    self.bin_dims = dims if c.get("discrete_state_input", True) else 0
    texts = list(instructions)
    low = collated_prompts(collate, c, texts, np.full((len(texts), dims), -1.0))
    high = collated_prompts(collate, c, texts, np.full((len(texts), dims), 0.999))
    positions = []
    for text, a, b in zip(texts, low, high):
      where = np.flatnonzero(a != b) if a.shape == b.shape else np.zeros(0, np.int64)
      if where.size != self.bin_dims:
        raise ValueError(f"the checkpoint's prompts do not write pi0.5's {self.bin_dims} state bins one token each (task "
                         f"{text[:40]!r}): the RL actor's in-jit prompts need them so")
      positions.append(where)
    # Bin b's token: a state of bin b everywhere, read at the first bin's place.
    values = np.arange(STATE_BINS) / (STATE_BINS / 2) - 1.0 + 1e-3
    per_bin = collated_prompts(collate, c, texts[:1] * STATE_BINS, np.repeat(values[:, None], dims, axis=1))
    self.bin_tokens = np.asarray([prompt[positions[0][0]] for prompt in per_bin] if self.bin_dims else [], np.int32)
    image_tokens = num_cameras * pi05_inputs.patches_per_image(c)
    self.row_length = _round_up(max(len(p) for p in low) + image_tokens, 8)
    table_config = ConfigDict(c.to_dict())
    table_config.packing.update(row_length=self.row_length, samples_per_row=1, max_images_per_sample=num_cameras)
    num_tasks, size, h = len(texts), c.vision.image_size, c.action_horizon
    images = [[np.zeros((size, size, 3), np.uint8)] * num_cameras for _ in texts]
    zeros = np.zeros((num_tasks, h, c.action_dim), np.float32)
    table = pi05_inputs.assemble(table_config, low, images, zeros, zeros, pack=False)
    self.tables = {key: table[key] for key in _TABLE_KEYS}
    self.bin_positions = np.stack(positions).astype(np.int32) + image_tokens  # [tasks, bin_dims] in the row
    self.num_tasks = num_tasks
    # The reference: random states' prompts from the collate equal the in-jit ones.
    state = np.random.default_rng(0).uniform(-1.1, 1.1, (num_tasks, dims)).astype(np.float32)
    expected = collated_prompts(collate, c, texts, state)
    padded = np.pad(state, ((0, 0), (0, c.max_state_dim - dims)))
    tokens = np.asarray(self.prompt_tokens(jnp.asarray(padded), jnp.arange(num_tasks)))
    prompt = (self.tables["prefix_segment_ids"] == 1) & ~self.tables["prefix_is_image"]
    for i, text in enumerate(texts):
      if not np.array_equal(tokens[i][prompt[i]], expected[i]):
        raise ValueError(f"pi0.5's in-jit prompt differs from the checkpoint collate's for task {text[:40]!r}")

  def bins(self, state: jax.Array) -> jax.Array:
    """paligemma_tokenizer.discretize_state in jnp: normalised state [n, d] -> bins [n, d]."""
    edges = jnp.asarray(np.linspace(-1.0, 1.0, STATE_BINS + 1)[:-1], jnp.float32)
    return jnp.clip(jnp.searchsorted(edges, state, side="right") - 1, 0, STATE_BINS - 1)

  def prompt_tokens(self, state: jax.Array, task: jax.Array) -> jax.Array:
    """[n, row_length]: each task's row with the sample's state bins written in."""
    tokens = jnp.take(jnp.asarray(self.tables["prefix_tokens"]), task, axis=0)
    bin_ids = jnp.take(jnp.asarray(self.bin_tokens), self.bins(state[:, :self.bin_dims]))
    rows = jnp.arange(tokens.shape[0])[:, None]
    return tokens.at[rows, jnp.take(jnp.asarray(self.bin_positions), task, axis=0)].set(bin_ids)

  def __call__(self, observation: dict) -> dict[str, jax.Array]:
    task = jnp.asarray(task_index(observation)).astype(jnp.int32)  # rows of the prompt tables
    n = task.shape[0]
    state = self.state(observation)
    batch = {key: jnp.take(jnp.asarray(table), task, axis=0) for key, table in self.tables.items()}
    batch.update(prefix_tokens=self.prompt_tokens(state, task), images=self.images(observation),
                 sample_row_offset=jnp.zeros((n,), jnp.int32), sample_slot=jnp.zeros((n,), jnp.int32))
    if self.settings is not None:  # the state as a vector, and empty targets (the collate's with_perception)
      batch.update(state=state, **{k: jnp.asarray(v) for k, v in perception_targets(self.settings, n).items()})
    elif self.config.get("continuous_state", False):  # the state as a vector for the action expert
      batch["state"] = state
    return batch


class Pi05Actor(nnx.Module):
  """A Pi05 behind FlowPolicy's actor interface, with the once-per-sample prefix split out.

  context(batch) -> {k, v: the prefix's KV cache [n, layers, S, kv heads, head dim]; its segment /
  block ids; the suffix layout; the perception module's state slots}: batch-first, so the inference
  server stores it per sample and the learner's minibatches slice it. velocity_from_context(x, t,
  context): the action expert alone. prepare / velocity: the same without storing (the eval job's
  deterministic actions). cache_context=True stops the context's gradient (FLOW_PARTS train).
  auxiliary_loss(labelled batch): the perception module's own losses, SFT's weights times
  perception_weight (rl.policy.perception_loss; ejax.rl.vla.vla_flow_policy).
  """

  def __init__(self, pi05: pi05_lib.Pi05, cache_context: bool = False, perception_weight: float = 0.0):
    self.pi05 = pi05
    self.cache_context = cache_context
    self.perception_weight = perception_weight

  def auxiliary_loss(self, batch: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The perception module's losses on a batch with its targets (VlaObservations.labelled), as the
    train step weighs them, times perception_weight; (loss, {each loss by its train-job name})."""
    metrics = {}
    loss = self.pi05.perception.add_losses(jnp.zeros((), jnp.float32), metrics, self.pi05.perceive(batch), batch)
    return self.perception_weight * loss, metrics

  def _context(self, batch: dict) -> dict:
    cache, seen = self.pi05.prefix_cache(batch)
    context = {"k": jnp.moveaxis(cache.k, 1, 0), "v": jnp.moveaxis(cache.v, 1, 0),
               "kv_segment_ids": cache.segment_ids, "kv_block_ids": cache.block_ids,
               **{key: batch[key] for key in _SUFFIX_KEYS}}
    if seen is not None:
      context["perception_state"] = seen.state
    elif "state" in batch:  # model.continuous_state without the perception module
      context["state"] = batch["state"]
    return context

  def context(self, batch: dict) -> dict:
    return jax.lax.stop_gradient(self._context(batch))

  def flow_constants(self) -> dict:
    """What every flow step reads and FlowPolicy makes once per call, outside the steps' loop: the
    expert's compute-dtype weights (cast inside the loop, XLA:GPU would cast them every step)."""
    return {"expert_weights": gemma.layer_weights(self.pi05.expert, self.pi05.dtype)}

  def velocity_from_context(self, noisy_actions: jax.Array, t: jax.Array, context: dict,
                            expert_weights: dict | None = None) -> jax.Array:
    """noisy_actions [n, h, action_dim], t [n] (openpi convention) -> velocity [n, h, action_dim]."""
    from ejax.models.gemma import KVCache
    n = noisy_actions.shape[0]
    cache = KVCache(k=jnp.moveaxis(context["k"], 0, 1), v=jnp.moveaxis(context["v"], 0, 1),
                    segment_ids=context["kv_segment_ids"], block_ids=context["kv_block_ids"])
    seen = None
    if "perception_state" in context:
      seen = perception.Seen(logits=None, keypoints=None, readout=None, estimate=None,
                             state=context["perception_state"])
    # One sample per row: the row count sample_rows reads from the prefix is n.
    layout = {key: context[key] for key in (*_SUFFIX_KEYS, "state") if key in context}
    layout["prefix_tokens"] = jnp.zeros((n, 0), jnp.int32)
    return self.pi05.expert_velocity(layout, cache, seen, noisy_actions, t, expert_weights=expert_weights)

  def prepare(self, batch: dict) -> tuple:
    return (self._context(batch),)

  def velocity(self, noisy_actions: jax.Array, t: jax.Array, context: dict,
               expert_weights: dict | None = None) -> jax.Array:
    return self.velocity_from_context(noisy_actions, t, context, expert_weights)


def observations_for(sft_policy, instructions: Sequence[str]) -> Pi05Observations:
  """The in-jit observation mapping matching CheckpointPolicy.act's host-side one (pi0.5)."""
  return Pi05Observations(sft_policy.config.model, instructions=instructions, collate=sft_policy.collate,
                          **shared_settings(sft_policy))


def _freeze_pi05(c: ConfigDict) -> None:
  c.train_vision, c.train_llm = False, False


PI05 = VlaKind(name="pi05", title="pi0.5", observations=observations_for, actor=Pi05Actor, flow_parts=FLOW_PARTS,
               freeze_context=_freeze_pi05, trainable_filter=pi05_lib.trainable_filter, convention="openpi",
               perception_loss=True)
