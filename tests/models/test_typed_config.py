"""GR00T and pi0.5 read their config into typed settings once, where the model is built
(ejax.models.typed_config): a key the model lacks is one error naming it, a config saved before a
key existed builds the same model, and the released full-size configs survive the round trip."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from ml_collections import ConfigDict

from ejax.errors import UserError
from ejax.models import groot, groot_config, perception, pi05, pi05_config
from ejax.models.config_upgrade import ADDED_KEYS
from ejax.models.registry import get_model_spec

MODELS = {"groot": (groot, groot_config), "pi05": (pi05, pi05_config)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_released_full_size_config_round_trips(name):
  model, typed = MODELS[name]
  released = model.model_config("full")
  settings = typed.read(released)
  assert typed.to_config(settings).to_dict() == released.to_dict()
  assert typed.read(typed.to_config(settings)) == settings
  assert settings.perception is None and settings.attention_impl == "auto"
  assert settings.scan_layers is False  # repeated blocks unrolled: faster on a GPU (BENCHMARKS.md)


def test_the_sub_models_get_their_dataclasses_with_the_derived_widths():
  settings = groot_config.read(groot.model_config("full"))
  assert (settings.vision.width, settings.vision.depth, settings.llm.num_layers) == (1152, 27, 12)
  assert (settings.dit.cross_attention_dim, settings.dit.width, settings.vl_transformer.num_layers) == (2048, 1536, 4)
  llm, expert = pi05.gemma_configs(pi05.model_config("full"))
  assert (llm.width, llm.depth, llm.adarms_cond_dim, expert.width, expert.adarms_cond_dim) == (2048, 18, 0, 1024, 1024)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("where", ["top", "section"])
def test_an_unknown_key_is_one_error_naming_it_and_the_model(name, where):
  model, _ = MODELS[name]
  config = model.model_config("runlocal")
  if where == "top":
    config.atention_impl = "xla"     # misspelt
    expected = f"model.atention_impl is not a {name} setting"
  else:
    config.vision.widht = 64
    expected = f"model.vision.widht is not a {name} setting"
  with pytest.raises(ValueError, match=expected) as error:
    nnx.eval_shape(lambda: get_model_spec(name).create(config, nnx.Rngs(0)))
  assert "\n" not in str(error.value) and isinstance(error.value, UserError)   # ejax.main: one `error:` line


def test_a_key_missing_without_an_upgrade_entry_is_one_error():
  saved = groot.model_config("runlocal").to_dict()
  del saved["hidden_size"]
  with pytest.raises(ValueError, match="model.hidden_size is missing from the groot config"):
    groot_config.read(ConfigDict(saved))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_config_saved_before_the_added_keys_builds_the_same_model(name):
  model, typed = MODELS[name]
  today = model.model_config("runlocal")
  saved = ConfigDict({k: v for k, v in today.to_dict().items() if k not in ADDED_KEYS[name]})
  assert "scan_layers" not in saved and "attention_impl" not in saved
  # the values an older checkpoint computed with (GR00T's fp8_impl True: its fp8 is off either way)
  computed_with = ConfigDict(dict(today.to_dict(), **ADDED_KEYS[name]))
  old, new = model.create(saved, nnx.Rngs(0)), model.create(today, nnx.Rngs(0))
  assert old.settings == typed.read(computed_with) and not old.settings.perception
  assert old.config.to_dict() == computed_with.to_dict()   # what the io converters, LoRA and RL read
  differ = {f.name for f in dataclasses.fields(new.settings) if getattr(old.settings, f.name) != getattr(
      new.settings, f.name)}
  assert differ <= {"fp8_impl"} and not getattr(new.settings, "fp8", False)
  flat = lambda m: {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
  old_params, new_params = flat(old), flat(new)
  assert sorted(old_params) == sorted(new_params)
  for path in new_params:
    np.testing.assert_array_equal(old_params[path], new_params[path])


def test_model_lora_is_accepted_and_perception_is_typed():
  config = groot.model_config("runlocal")
  config.lora = dict(dit=dict(rank=0, alpha=0.0, targets="attn,ffn"))
  config.update(num_cameras=2, max_state_dim=26, perception=perception.default_config())
  settings = groot_config.read(config)
  assert isinstance(settings.perception, perception.PerceptionConfig)
  assert settings.perception.layout.data_dims == 26 - 15
  assert dataclasses.replace(settings, perception=None) == groot_config.read(
      dict(config.to_dict(), perception={}))
  shapes = nnx.eval_shape(lambda: groot.create(config, nnx.Rngs(0)))
  assert shapes.perception is not None and jax.tree.leaves(nnx.state(shapes.perception))
