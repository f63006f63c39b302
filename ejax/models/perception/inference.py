"""What a policy hands model.perception at inference: the statistics that map its estimate and the
state to metres (for the geometry), and which calibration and decoding the geometry uses."""

from __future__ import annotations


import numpy as np
from ml_collections import ConfigDict

from ejax.data import transforms
from ejax.models.perception.config import Geometry, PerceptionConfig, read
from ejax.models.perception.upgrade import upgrade_config


def acts_on_a_given_estimate(model_config) -> bool:
  """Whether the model reads a teacher-forced estimate, so that a policy may give it the true state."""
  settings = read(upgrade_config(model_config))
  return settings is not None and settings.estimate.to_state and settings.teacher.forcing


def with_statistics(config: ConfigDict, norm_stats: dict | None, geometry: bool | dict | None = None) -> ConfigDict:
  """A copy of a checkpoint's config (model and data) in today's layout (perception.upgrade_config) with
  what the estimate's geometry needs at inference. geometry: None as trained; False off; a dict of
  calibrated cameras (e.g. ejax.sim.scene.camera_calibration()): those, decoded with today's defaults
  (for a checkpoint trained on those cameras before the model had geometry, or before the defaults
  changed). The statistics come from the checkpoint's (data.state_key and data.aux_state_key)."""
  config = config.copy_and_resolve_references()
  config.model = upgrade_config(config.model)
  settings = read(config.model)
  if settings is None:
    if geometry:
      raise ValueError("eval.keypoint_geometry needs a checkpoint with model.perception's keypoint estimate: "
                       "this one has none")
    return config
  placement = config.model.perception.geometry
  if geometry is False:
    placement.cameras = {}
  elif geometry:
    if not (settings.estimate.to_state and settings.detectors.points):
      raise ValueError("eval.keypoint_geometry needs a checkpoint whose action head reads the keypoint estimate "
                       "(model.perception.estimate.to_state and detectors.points): this one has none")
    today = Geometry()
    for key, value in (("cameras", dict(geometry)), ("radius", today.radius), ("tolerance", today.tolerance)):
      del placement[key]   # a saved setting may have another type (one tolerance for all points)
      placement[key] = value
  if placement.cameras:
    placement.norm = slot_statistics(settings, config.data, norm_stats)
  return config


def slot_statistics(settings: PerceptionConfig, data_config, norm_stats: dict | None) -> dict[str, list]:
  """{"state": [centre, scale] of the data's own state slots, "estimate": [centre, scale] of the
  estimate's}: the checkpoint's statistics (data.state_key, data.aux_state_key; what the stats job
  writes) laid on the slots the StateLayout declares, the state's padded to its data_dims entries.
  Statistics that do not fit the declared slots are an error that names them."""
  keys = {"state": data_config.get("state_key", "observation.state"), "estimate": data_config.get("aux_state_key")}
  sizes = {"state": settings.layout.data_dims, "estimate": settings.estimate.dim}
  mode = data_config.get("normalization", "none") if norm_stats else "none"
  params = transforms.Normalizer(norm_stats or {}, mode, list(keys.values())).params
  norm = {}
  for name, key in keys.items():
    size = sizes[name]
    # without statistics (data.normalization none) the values are metres already
    centre, scale = (np.asarray(v, np.float64).reshape(-1) for v in params.get(key, (np.zeros(size), np.ones(size))))
    if centre.shape[0] > size or (name == "estimate" and centre.shape[0] != size):
      declared = (f"data_dims={size} (max_state_dim={settings.max_state_dim} less the module's {settings.layout.reserved} "
                  "slots)" if name == "state" else f"estimate.dim={size}")
      raise ValueError(f"the statistics of {key!r} have {centre.shape[0]} entries but model.perception's state layout "
                       f"declares {declared}: recompute them (the stats job) for this data or fix the model config")
    pad = size - centre.shape[0]
    norm[name] = [np.pad(centre, (0, pad)).tolist(), np.pad(scale, (0, pad), constant_values=1.0).tolist()]
  return norm


