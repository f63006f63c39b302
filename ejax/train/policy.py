"""A trained checkpoint as a policy for closed-loop evaluation and rollouts.

    policy = load_policy("runs/groot_demos/checkpoints")
    actions = policy.act(obs, instructions, rng)   # [num_envs, horizon, action_dim], env units

Everything needed travels inside the checkpoint: the model config, the data config (cameras, image
size, normalisation mode, embodiment) and the normalisation statistics. Observations go through
the same steps as training samples (normalise the state, resize images, the model's own collate),
and sampled actions are unnormalised back to the environment's units.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from ejax.checkpoint import Checkpointer, CheckpointError, abstract_target
from ejax.data import transforms
from ejax.data.tasks import trained_tasks
from ejax.models.registry import get_model_spec
from ejax.parallel import make_mesh
from ejax.train.optim import make_optimizer
from ejax.train.state import abstract_train_state, model_parts
from ejax.train.step import compiler_options

IMAGE_PREFIX = "observation.images."


class CheckpointPolicy:
  """act(obs, instructions, rng) over a restored model; see the module docstring."""

  uses_privileged_state = False

  def __init__(self, model: nnx.Module, config: ConfigDict, norm_stats: dict | None):
    self.config, self.data = config, config.data
    model_config = config.model
    self.horizon = int(model_config.get("action_horizon", model_config.get("horizon", 16)))
    # The env's action size: the dataset's (its statistics), else the model's; a model's action_dim may
    # be its padded width (DreamZero's and pi0.5's 32 at full size).
    self.action_dim = int(model_config.get("action_dim", 0)) or None
    self.state_key = self.data.get("state_key", "observation.state")
    self.normalizer = policy_normalizer(self.data, norm_stats)
    self.norm_stats = norm_stats
    self.true_estimate = None   # use_true_estimate(): the normaliser of the simulator's true object state
    if "action" in self.normalizer.params:
      self.action_dim = int(self.normalizer.params["action"][0].shape[0])
    spec = self.spec = get_model_spec(model_config.name)
    # inference: a batch of observations may pack into more rows than a training batch's fixed count
    # (its prompts are the envs' instructions, not a random draw): it gets them, at a recompile.
    self.collate = spec.make_collate(model_config, self.data, inference=True) if spec.make_collate else _stack
    graphdef, state = nnx.split(model)

    # Compiled as the train step is (its matmuls cuBLAS calls unless train.triton_gemm), so a GPU
    # serves with the GEMMs the figures measured.
    @functools.partial(jax.jit, compiler_options=compiler_options(config.train) if "train" in config else None)
    def sample(state, batch, rng, noise):
      return nnx.merge(graphdef, state).sample_actions(batch, rng, noise=noise)

    self._state, self._sample = state, sample

  @property
  def trained_tasks(self) -> list[str] | None:
    """The ejax.sim tasks this checkpoint was trained on, from its saved data config (recorded
    simulator demonstrations, or a LeRobot dataset whose instructions are ejax.sim's); None when the
    data were something else. The eval job evaluates these by default."""
    return trained_tasks(self.data)

  @property
  def camera_size(self) -> tuple[int, int] | None:
    """[height, width] of the camera images it was trained on (before the model's own resize), when
    the checkpoint's data config says: the simulator must render at this size."""
    if self.data.get("name") == "sim_demos":
      return int(self.data.sim_demos.image_height), int(self.data.sim_demos.image_width)
    return None

  @property
  def model_state(self) -> nnx.State:
    """The restored model's state (parameters and the rest) that act() samples with, to build
    another policy on the same weights (ejax.rl.vla fine-tunes it with RL)."""
    return self._state

  def use_true_estimate(self) -> None:
    """Act on the simulator's true object state (data.aux_state_key in the observations, normalised
    as in training) where the model would act on its own estimate of it: an eval ablation that says
    how much the policy's perception costs. Needs a model trained with model.perception.teacher.forcing."""
    key = self.data.get("aux_state_key", None)
    if not (key and self.spec.acts_on_given_estimate(self.config.model)):
      raise ValueError("eval.true_estimate needs a checkpoint trained with a teacher-forced estimate "
                       "(model.perception.estimate.to_state, .teacher.forcing and data.aux_state_key): this one "
                       "has none")
    self.true_estimate = policy_normalizer(self.data, self.norm_stats, [key])

  def _samples(self, obs: dict[str, np.ndarray], instructions: list[str]) -> list[dict[str, Any]]:
    image_size = self.data.get("image_size")
    cameras = self.data.get("cameras")
    # A training-only target (data.aux_state_key, e.g. ejax.sim's privileged object state, which the
    # simulator's observations carry) never reaches the model at inference: it acts on its estimate.
    hidden = {self.state_key, self.data.get("aux_state_key", None), self.data.get("aux_pixel_key", None)}
    samples = []
    for i, instruction in enumerate(instructions):
      state = np.asarray(obs[self.state_key][i], np.float32)
      action_dim = self.action_dim or state.shape[-1]
      sample = {
          self.state_key: self.normalizer.normalize(self.state_key, state),
          "task": instruction,
          "embodiment_id": int(self.data.get("embodiment_id", 0)) if not isinstance(self.data.get("embodiment_id"), dict) else 0,
          # The chunk to predict: no targets at inference, only its shape for the collate.
          "action": np.zeros((self.horizon, action_dim), np.float32),
          "action_is_pad": np.zeros((self.horizon,), bool),
      }
      for key, values in obs.items():
        if key.startswith(IMAGE_PREFIX):
          if not cameras or key[len(IMAGE_PREFIX):] in cameras or key in cameras:
            image = np.asarray(values[i])
            sample[key] = transforms.resize(image, tuple(image_size)) if image_size else image
        elif key not in hidden and not key.startswith("privileged."):
          sample[key] = np.asarray(values[i])  # e.g. task_index, for models conditioned on it
      if self.true_estimate is not None:
        key = self.data.aux_state_key
        if key not in obs:
          raise ValueError(f"eval.true_estimate: the observations carry no {key!r} (the simulator's object state)")
        # a teacher-forced model acts on a target given in the batch instead of its estimate
        sample[key] = self.true_estimate.normalize(key, np.asarray(obs[key][i], np.float32))
      samples.append(sample)
    return samples

  @property
  def noise_shape(self) -> tuple[int, int]:
    """[horizon, model action dim] of one sample's initial flow noise (act's `noise` rows): the
    model's padded action width (GR00T's max_action_dim), not the env's."""
    model_config = self.config.model
    width = model_config.get("max_action_dim") or model_config.get("action_dim") or self.action_dim
    return self.horizon, int(width)

  def act(self, obs: dict[str, np.ndarray], instructions: list[str], rng: jax.Array,
          noise: np.ndarray | None = None) -> np.ndarray:
    """noise [N, *noise_shape]: the flow's initial noise, when the caller fixes it (a policy server
    whose clients reproduce in-process sampling); None draws it from rng as the model does."""
    batch = self.collate(self._samples(obs, instructions))
    batch = {k: v for k, v in batch.items() if isinstance(v, np.ndarray) and v.dtype != object}
    return self.env_actions(np.asarray(self._sample(self._state, batch, rng, noise), np.float32))

  def map_weights(self, transform) -> None:
    """Replaces the weights act() samples with by transform(weights), e.g. block-FP8 values for
    inference (ejax.rl.inference.inference_weights)."""
    self._state = transform(self._state)

  def env_actions(self, model_actions: np.ndarray) -> np.ndarray:
    """The model's sampled chunks [N, horizon, model action dim] (normalised, padded to the model's
    max_action_dim) -> what the env executes: the dataset's action dims, in its units."""
    return env_actions(model_actions, self.normalizer, self.action_dim)


def policy_normalizer(data_config: ConfigDict, norm_stats: dict | None,
                      keys: list[str] | None = None) -> transforms.Normalizer:
  """The normaliser a checkpoint's policy uses for `keys` (default: the state and the action): the
  training pipeline's, from the statistics saved with the checkpoint."""
  mode = data_config.get("normalization", "none") if norm_stats else "none"
  keys = keys or [data_config.get("state_key", "observation.state"), "action"]
  return transforms.Normalizer(norm_stats or {}, mode, keys)


def env_actions(model_actions: np.ndarray, normalizer: transforms.Normalizer, action_dim: int | None) -> np.ndarray:
  """A model's normalised chunks [N, horizon, model action dim] -> env actions [N, horizon, action_dim]."""
  actions = np.asarray(model_actions, np.float32)
  if action_dim:
    actions = actions[..., :action_dim]
  return normalizer.unnormalize("action", actions)


def _stack(samples):
  return {k: np.stack([s[k] for s in samples]) for k in samples[0] if not isinstance(samples[0][k], str)}


def _renamed(tree, renames: dict[str, str]):
  """`tree` with every nnx.State in it (parameters, optimizer moments) holding its entries under the
  renamed paths ({old path prefix "a/b": new}), e.g. to restore a checkpoint written with other names."""
  def rename(state):
    flat = []
    for path, value in nnx.to_flat_state(state):
      text = "/".join(str(k) for k in path)
      for old, new in renames.items():
        if text == old or text.startswith(old + "/"):
          path = tuple(new.split("/")) + path[len(old.split("/")):]
          break
      flat.append((path, value))
    return nnx.from_flat_state(flat)
  return jax.tree.map(lambda x: rename(x) if isinstance(x, nnx.State) else x, tree,
                      is_leaf=lambda x: isinstance(x, nnx.State))


def load_policy(checkpoint_dir: str, *, step: int | None = None, use_ema: bool = True,
                geometry: bool | dict | None = None, num_inference_steps: int = 0) -> CheckpointPolicy:
  """Restores a training checkpoint (the EMA weights when the run kept them) as a policy; `geometry`
  see the model spec's policy_config (ejax.models.perception.with_statistics); num_inference_steps > 0:
  the flow's Euler steps per chunk instead of the saved model config's. A checkpoint written in an
  older layout (before model.perception existed) is read in today's (the spec's policy_config and
  param_renames: ejax.models.perception.upgrade)."""
  if not os.path.isdir(checkpoint_dir):
    raise CheckpointError(f"checkpoint directory {checkpoint_dir} does not exist: point "
                          f"--config.eval.checkpoint at a training run's <workdir>/checkpoints")
  checkpointer = Checkpointer(checkpoint_dir)
  try:
    meta = checkpointer.read_meta(step)
    if not meta.get("config"):
      raise CheckpointError(f"checkpoint {checkpoint_dir} carries no config: it was not written by ejax's trainer")
    saved = ConfigDict(meta["config"])
    spec = get_model_spec(saved.model.name)
    try:
      config = spec.policy_config(saved, meta.get("norm_stats"), geometry)
    except ValueError as error:
      raise CheckpointError(str(error)) from None
    if num_inference_steps:
      config.model.num_inference_steps = int(num_inference_steps)
    tx, _ = make_optimizer(config.train)
    mesh = make_mesh(dict(data=-1))
    rules = [tuple(rule) for rule in config.sharding_rules]
    abstract, shardings = abstract_train_state(config.model, config.train, tx, mesh, rules)
    target = abstract_target(abstract, shardings)
    renames = spec.param_renames(saved.model)
    if renames:
      back = {new: old for old, new in renames.items()}
      state, _, _ = checkpointer.restore(step, _renamed(target, back))
      state = _renamed(state, renames)
    else:
      state, _, _ = checkpointer.restore(step, target)
  finally:
    checkpointer.close()
  params = state.ema_params if (use_ema and state.ema_params is not None) else state.params
  model = nnx.merge(model_parts(config.model).graphdef, params, state.frozen, state.rest)
  return CheckpointPolicy(model, config, meta.get("norm_stats"))

