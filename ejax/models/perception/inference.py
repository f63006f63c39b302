"""What a policy hands model.perception at inference: the statistics that map its estimate and the
state to metres (for the geometry), and which calibration and decoding the geometry uses."""

from __future__ import annotations


import numpy as np
from ml_collections import ConfigDict

from ejax.data import transforms
from ejax.models.perception.config import Geometry, read
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
    keys = [config.data.get("state_key", "observation.state"), config.data.get("aux_state_key")]
    mode = config.data.get("normalization", "none") if norm_stats else "none"
    params = transforms.Normalizer(norm_stats or {}, mode, keys).params
    norm = {}
    for name, key, size in zip(("state", "estimate"), keys, (settings.max_state_dim, settings.estimate.dim)):
      # without statistics (data.normalization none) the values are metres already
      centre, scale = params.get(key, (np.zeros(size), np.ones(size)))
      norm[name] = [np.asarray(centre).tolist(), np.asarray(scale).tolist()]
    placement.norm = norm
  return config


