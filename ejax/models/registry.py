"""Model registry: `config.model.name` -> how to build the model and a real-shaped example batch.

Every registered model is an `nnx.Module` with
  compute_loss(batch: dict[str, Array], rng: jax.Array) -> (loss: scalar, metrics: dict[str, Array])
      metrics holds at least "per_sample_loss" [num_samples];
  sample_actions(batch, rng, *, noise=None, num_steps=None) -> actions [num_samples, horizon, action_dim].
`example_batch(model_config, batch_size, seed)` returns a dict of numpy arrays shaped exactly like
the batches the input pipeline feeds this model (used for abstract init, compile and tests).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ejax.config.lazy import load_entry


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  create: Callable[..., Any]          # (model_config, rngs: nnx.Rngs) -> nnx.Module
  example_batch: Callable[..., dict]  # (model_config, batch_size: int, seed: int) -> dict[str, np.ndarray]
  # (model_config) -> nnx filter of the parameters the optimizer trains; None trains every Param.
  trainable_filter: Callable[..., Any] | None = None
  # (model_config, data_config) -> collate(list of per-sample dicts) -> batch; None stacks fields.
  make_collate: Callable[..., Any] | None = None
  # (model_config, samples_per_batch=None) -> model_config with a packing.row_length of 0 ("auto")
  # chosen from the example batch's lengths (ejax.data.row_plan); None: the model has no packed rows.
  example_config: Callable[..., Any] | None = None
  # What a checkpoint needs to act as a policy. get_model_spec fills these for every model from
  # model.perception, the optional module any model may host (ejax/models/perception/), so that the
  # generic trainer and policy (ejax/train/) import no model and no simulator:
  # (saved config, norm_stats, geometry=None) -> the saved config (model and data) read in today's layout
  # (ejax.models.config_upgrade), with what inference needs from the checkpoint's statistics.
  policy_config: Callable[..., Any] | None = None
  # (saved model_config) -> {old parameter path prefix: today's}; {} for a checkpoint in today's layout.
  param_renames: Callable[..., dict] | None = None
  # (model_config) -> whether the model acts on an estimate given in the batch (eval.true_estimate).
  acts_on_given_estimate: Callable[..., bool] | None = None
  # What the encode job (ejax/train/encode.py) caches of the model's frozen encoders: a module with
  # FROZEN, REPLACED, cache_inputs, encode_samples, encode_prompts, PromptTable (DreamZero's:
  # ejax/models/dreamzero/encode.py); None: the model has no encoder cache.
  encoder_cache: Any = None


# name -> "module:attribute" of a ModelSpec; imported only when the model is chosen.
MODELS: dict[str, str] = {
    "tiny_flow": "ejax.models.tiny:SPEC",
    "groot": "ejax.models.groot:SPEC",
    "pi05": "ejax.models.pi05:SPEC",
    "dreamzero": "ejax.models.dreamzero.spec:SPEC",
}


def get_model_spec(name: str) -> ModelSpec:
  """The registered spec, its create and trainable_filter extended by config.model.lora (LoRA
  adapters on the modules it names: ejax.models.lora), its policy hooks model.perception's where it
  sets none."""
  spec = load_entry(MODELS, name, "model", "config.model.name")
  return dataclasses.replace(spec, create=_lora_create(spec.create),
                             trainable_filter=_lora_filter(spec.trainable_filter),
                             policy_config=spec.policy_config or _perception_policy_config,
                             param_renames=spec.param_renames or _perception_param_renames,
                             acts_on_given_estimate=spec.acts_on_given_estimate or _perception_acts_on_given_estimate)


def _perception_policy_config(config, norm_stats, geometry=None):
  """The saved config, its model config read in today's layout (the one upgrade step:
  ejax.models.config_upgrade), with what model.perception needs at inference from the statistics."""
  from ejax.models import perception
  from ejax.models.config_upgrade import upgrade_model_config
  config = config.copy_and_resolve_references()
  config.model = upgrade_model_config(config.model)
  return perception.with_statistics(config, norm_stats, geometry)


def _perception_param_renames(model_config) -> dict:
  from ejax.models.perception import upgrade
  return dict(upgrade.PARAM_RENAMES) if upgrade.is_old(model_config) else {}


def _perception_acts_on_given_estimate(model_config) -> bool:
  from ejax.models import perception
  return perception.acts_on_a_given_estimate(model_config)


def _lora_create(create):
  def create_with_adapters(model_config, rngs):
    from ejax.models import lora
    model = create(model_config, rngs)
    if not lora.settings(model_config):
      return model
    import jax.numpy as jnp
    return lora.attach(model, model_config, rngs, jnp.dtype(model_config.get("param_dtype", "float32")))
  return create_with_adapters


def _lora_filter(trainable_filter):
  def filter_with_adapters(model_config):
    from flax import nnx

    from ejax.models import lora
    base = trainable_filter(model_config) if trainable_filter else nnx.Param
    return lora.trainable_filter(base, model_config)
  return filter_with_adapters


def example_config(model_config, samples_per_batch: int | None = None):
  """model_config as its example batches lay it out: an auto packed row (packing.row_length = 0)
  resolved from the example batch's lengths, for batches of `samples_per_batch` samples a device
  (None: whole rows); any other config unchanged."""
  spec = get_model_spec(model_config.name)
  return spec.example_config(model_config, samples_per_batch) if spec.example_config else model_config
