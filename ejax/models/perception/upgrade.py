"""Configs and parameters written before ejax/models/perception/ existed (issue 33): the aids were
flat `model.aux_*` keys of GR00T and their parameters lived in its action head. One step brings both to
today's layout; the numbers do not change (tests/models/test_perception_upgrade.py)."""

from __future__ import annotations

from typing import Any

import ml_collections

from ejax.models.perception.config import default_config

# old GR00T parameter path prefix -> today's
PARAM_RENAMES = {
    "action_head/aux_keypoints": "perception/pixels",
    "action_head/aux_queries": "perception/queries",
    "action_head/aux_query_position": "perception/position",
    "action_head/heatmap_context_more_bias": "perception/context_more_bias",
    "action_head/heatmap_context_more": "perception/context_more",
    "action_head/heatmap_context_bias": "perception/context_bias",
    "action_head/heatmap_context": "perception/context",
    "action_head/aux_state_head": "perception/readout_instruction",
    "action_head/aux_keypoint_in": "perception/readout_keypoints",
    "action_head/aux_proprio_in": "perception/readout_state",
    "action_head/aux_state_mid": "perception/readout_mid",
    "action_head/aux_state_out": "perception/readout_out",
}

# old key -> (group, setting) of model.perception
_MOVED = {
    "aux_loss_weight": ("estimate", "weight"), "aux_keypoint_width": ("estimate", "width"),
    "aux_state_input": ("estimate", "to_state"), "aux_teacher_forcing": ("teacher", "forcing"),
    "aux_teacher_noise": ("teacher", "noise"), "aux_teacher_mix": ("teacher", "mix"),
    "aux_keypoints": ("detectors", "free"), "aux_heatmaps": ("detectors", "points"),
    "aux_heatmap_weight": ("detectors", "weight"), "aux_heatmap_input": ("detectors", "to_state"),
    "aux_heatmap_context_dilation": ("detectors", "context_dilation"),
    "aux_geometry_cameras": ("geometry", "cameras"), "aux_geometry_points": ("geometry", "points"),
    "aux_geometry_tcp_dims": ("geometry", "tcp_dims"), "aux_geometry_radius": ("geometry", "radius"),
    "aux_geometry_tolerance": ("geometry", "tolerance"), "aux_geometry_norm": ("geometry", "norm"),
}
# old settings of experiments that were not kept: the value that left them off (BENCHMARKS.md)
_DROPPED = {"aux_estimate_trains_heatmaps": True, "aux_proprio_dims": (), "state_dims": (),
            "aux_geometry_relation_margin": 0.0, "aux_geometry_relation_gain": 0.0}
# old defaults where today's group default differs (a key an old config lacked had these)
_OLD_DEFAULTS = {"aux_teacher_forcing": False, "aux_teacher_noise": 0.1, "aux_heatmap_input": False,
                 "aux_state_input": False, "aux_heatmaps": 0, "aux_geometry_cameras": {}, "aux_heatmap_position": False,
                 "aux_heatmap_position_scale": 10.0, "aux_heatmap_context": False, "aux_heatmap_context_layers": 1}


def is_old(model_config) -> bool:
  return any(str(key).startswith("aux_") for key in model_config.keys()) or "state_dims" in model_config


def upgrade_config(model_config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of a GR00T model config in today's layout (unchanged when it is already)."""
  if not is_old(model_config):
    return model_config
  old = model_config.to_dict()
  new = {k: v for k, v in old.items() if not k.startswith("aux_") and k not in _DROPPED and k != "vision_pretrain"}
  for key, off in _DROPPED.items():
    value = old.get(key, off)
    if (tuple(value) if isinstance(value, (list, tuple)) else value) != off:
      raise ValueError(f"model.{key}={value!r} was an experiment that ejax no longer has (BENCHMARKS.md): "
                       "this checkpoint needs ejax before issue 33")
  for section, key, off in (("vision", "conv_stem", ()), ("vision", "posemb_init", "normal"),
                            ("connector", "keypoints", 0)):
    value = new.get(section, {}).pop(key, off)
    if (tuple(value) if isinstance(value, list) else value) != off:
      raise ValueError(f"model.{section}.{key}={value!r} was an experiment that ejax no longer has "
                       "(BENCHMARKS.md): this checkpoint needs ejax before issue 33")
  new["perception"] = {}
  if old.get("aux_state_dim", 0):
    if not old.get("aux_keypoints", 0):
      raise ValueError("model.aux_state_dim without aux_keypoints (an estimate read from the pooled VL tokens) was "
                       "an experiment that ejax no longer has: this checkpoint needs ejax before issue 33")
    perception = default_config().to_dict()
    get = lambda key: old.get(key, _OLD_DEFAULTS.get(key))
    perception["image_size"] = int(old.get("aux_image_size", 0) or 0)
    perception["estimate"]["dim"] = int(old["aux_state_dim"])
    for key, (group, setting) in _MOVED.items():
      if get(key) is not None:
        perception[group][setting] = get(key)
    context = get("aux_heatmap_context")
    perception["detectors"]["context_layers"] = int(get("aux_heatmap_context_layers")) if context else 0
    perception["detectors"]["position_scale"] = float(get("aux_heatmap_position_scale")) if get(
        "aux_heatmap_position") else 0.0
    new["perception"] = perception
  return ml_collections.ConfigDict(new)


def upgrade_params(flat: dict[str, Any]) -> dict[str, Any]:
  """{old parameter path ("a/b/c"): value} -> the same values under today's paths."""
  renamed = {}
  for path, value in flat.items():
    for old, new in PARAM_RENAMES.items():
      if path == old or path.startswith(old + "/"):
        path = new + path[len(old):]
        break
    renamed[path] = value
  return renamed
