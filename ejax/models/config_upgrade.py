"""A model config saved before one of today's keys existed, read in today's layout: the one upgrade
step a checkpoint's config goes through when it is read back (the registry's policy_config hook, so
load_policy and the serve job's imported weights alike, and ejax.models.typed_config.read where GR00T and
pi0.5 are built), after which every key the model reads is there.

    ADDED_KEYS[model name][key] = the value that reproduces a checkpoint written before the key existed

A key added to a model's model_config() that changes what an older checkpoint would compute gets its
entry here (the tests check each entry names a key today's config has). The perception aids' keys,
which moved rather than appeared, have their own step (ejax.models.perception.upgrade), run first.
"""

from __future__ import annotations

import ml_collections

from ejax.models.perception.upgrade import upgrade_config as upgrade_perception

ADDED_KEYS: dict[str, dict] = {
    # scan_layers: scanning the repeated blocks keeps every parameter's layout, so an older checkpoint
    # computes the same either way; each model gets today's default
    "groot": {"attention_impl": "auto", "fp8_impl": True, "text_first": False, "perception": {}, "scan_layers": False},
    "pi05": {"attention_impl": "auto", "perception": {}, "perception_tokens": False, "scan_layers": False,
             "continuous_state": False, "discrete_state_input": True, "fp8": False, "fp8_impl": "xla"},
}


def upgrade_model_config(model_config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """model_config in today's layout: a copy with the keys it lacks added (ADDED_KEYS), the perception
  aids moved under model.perception; unchanged (the same object) when it is today's already."""
  upgraded = upgrade_perception(model_config)
  missing = {key: value for key, value in ADDED_KEYS.get(upgraded.get("name", ""), {}).items()
             if key not in upgraded}
  if not missing:
    return upgraded
  upgraded = upgraded.copy_and_resolve_references()
  with upgraded.unlocked():
    for key, value in missing.items():
      upgraded[key] = value
  return upgraded
