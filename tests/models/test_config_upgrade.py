"""A model config saved before one of today's keys existed is read in today's layout in one step
(ejax.models.config_upgrade, through the registry's policy_config hook): the keys it lacks get the
values an older checkpoint computed with, and today's configs pass through unchanged."""

import pytest
from ml_collections import ConfigDict

from ejax.models import groot, perception, pi05
from ejax.models.config_upgrade import ADDED_KEYS, upgrade_model_config
from ejax.models.registry import get_model_spec

TODAY = {"groot": groot.model_config, "pi05": pi05.model_config}


@pytest.mark.parametrize("name", sorted(ADDED_KEYS))
def test_every_added_key_is_one_todays_config_has(name):
  today = TODAY[name]("runlocal")
  assert today.name == name and sorted(set(ADDED_KEYS[name]) - set(today.keys())) == []
  assert upgrade_model_config(today) is today


@pytest.mark.parametrize("name", sorted(ADDED_KEYS))
def test_a_config_saved_before_the_keys_existed_gets_the_values_it_was_computed_with(name):
  today = TODAY[name]("runlocal")
  saved = ConfigDict({key: value for key, value in today.to_dict().items() if key not in ADDED_KEYS[name]})
  upgraded = upgrade_model_config(saved)
  assert upgraded is not saved and "attention_impl" not in saved
  for key, value in ADDED_KEYS[name].items():
    assert upgraded.to_dict()[key] == value
  rest = {key: value for key, value in upgraded.to_dict().items() if key not in ADDED_KEYS[name]}
  assert rest == saved.to_dict()
  # the path load_policy takes: the data config untouched, no perception aids
  config = get_model_spec(name).policy_config(ConfigDict(dict(model=saved, data=dict(normalization="none"))), None)
  assert config.model.attention_impl == "auto" and perception.read(config.model) is None
  assert config.data.to_dict() == {"normalization": "none"}


def test_groot_saved_with_flat_perception_keys_and_before_attention_impl_upgrades_in_one_step():
  """Both steps together: the aids' flat aux_* keys move under model.perception, the missing keys appear."""
  saved = groot.model_config("runlocal").to_dict()
  for key in ADDED_KEYS["groot"]:
    saved.pop(key)
  saved.update(num_cameras=2, max_state_dim=26, aux_state_dim=7, aux_keypoints=1, aux_heatmaps=2,
               aux_state_input=True, aux_heatmap_input=True)
  upgraded = upgrade_model_config(ConfigDict(saved))
  settings = perception.read(upgraded)
  assert settings.estimate.dim == 7 and settings.detectors.points == 2 and settings.layout.data_dims == 11
  assert (upgraded.attention_impl, upgraded.fp8_impl, upgraded.text_first) == ("auto", True, False)
  assert not any(key.startswith("aux_") for key in upgraded.keys())
