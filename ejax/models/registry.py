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


# name -> "module:attribute" of a ModelSpec; imported only when the model is chosen.
MODELS: dict[str, str] = {
    "tiny_flow": "ejax.models.tiny:SPEC",
    "groot": "ejax.models.groot:SPEC",
    "pi05": "ejax.models.pi05:SPEC",
    "dreamzero": "ejax.models.dreamzero.spec:SPEC",
}


def get_model_spec(name: str) -> ModelSpec:
  """The registered spec, its create and trainable_filter extended by config.model.lora (LoRA
  adapters on the modules it names: ejax.models.lora)."""
  spec = load_entry(MODELS, name, "model", "config.model.name")
  return dataclasses.replace(spec, create=_lora_create(spec.create),
                             trainable_filter=_lora_filter(spec.trainable_filter))


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
