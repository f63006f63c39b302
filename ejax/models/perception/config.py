"""model.perception as typed settings, the state slots it writes, and the upgrade of older configs.

    model.perception = {}                           the released model: no perception aids
    model.perception = perception.default_config()  then its named groups:
      image_size   the batch's images at this size for the detectors (0: the vision tower's); the tower
                   reads them average-pooled to its own size (a multiple of it)
      detectors    free: keypoints per image the readout reads whatever they find; points: detectors per
                   image that the instruction chooses, trained by a heatmap cross-entropy (weight) on
                   where each point appears (data.aux_pixel_key); context_layers residual 3x3
                   convolutions before them (the later ones dilated context_dilation); position_scale > 0:
                   a learnt position term per point and camera read from the instruction, of that gain;
                   to_state: their keypoints ride in the state
      estimate     dim: the estimate of the privileged state (data.aux_state_key) that a readout of the
                   keypoints, the instruction and the state gives (width: its two hidden layers), trained
                   by a squared error (weight); to_state: it rides in the state
      teacher      forcing: the action head trains on the target (+ noise, normalised units) where a
                   sample has one, this fraction (mix) of them on the estimate as at inference
      geometry     cameras: {name: calibration} (ejax.sim.scene.camera_calibration()): at inference the
                   instruction's points (points: where each one's x, y, z starts in the estimate) are
                   placed by their keypoints through these cameras at the readout's heights; tcp_dims: the
                   state's tool centre point (hand cameras); radius: cells of a soft-argmax local to the
                   peak (0: global); tolerance: metres within which a hand camera's point replaces the
                   world camera's; norm: the statistics that map the estimate and the state to metres
                   (the policy lays the checkpoint's on the declared slots: inference.slot_statistics)

The state vector's last slots are the module's (StateLayout): the estimate, then the keypoints; the
data's own state must leave them zero (the collate checks). Experiments on these aids that were not
kept are in BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
import numpy as np


@dataclasses.dataclass(frozen=True)
class Detectors:
  free: int = 1
  points: int = 2
  weight: float = 1.0
  context_layers: int = 0
  context_dilation: int = 1
  position_scale: float = 0.0
  to_state: bool = True


@dataclasses.dataclass(frozen=True)
class Estimate:
  dim: int = 7
  width: int = 256
  weight: float = 1.0
  to_state: bool = True


@dataclasses.dataclass(frozen=True)
class Teacher:
  forcing: bool = True
  noise: float = 0.05
  mix: float = 0.0


@dataclasses.dataclass(frozen=True)
class Geometry:
  cameras: dict = dataclasses.field(default_factory=dict)
  points: tuple[int, ...] = (0, 3)
  tcp_dims: tuple[int, ...] = (8, 9, 10)
  radius: tuple[int, ...] = (2, 2)
  tolerance: tuple[float, ...] = (0.04, 0.0)
  norm: dict = dataclasses.field(default_factory=dict)

  @property
  def active(self) -> bool:
    """Placing needs both the cameras and the statistics (training has none: the head is teacher-forced)."""
    return bool(self.cameras) and bool(self.norm)


GROUPS = {"detectors": Detectors, "estimate": Estimate, "teacher": Teacher, "geometry": Geometry}


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Where the perception module's values sit in the state vector [max_state_dim]: the estimate, then
  the keypoints (each camera's points' (x, y)), at the end."""
  max_state_dim: int
  estimate_dim: int
  keypoint_values: int

  @property
  def reserved(self) -> int:
    return self.estimate_dim + self.keypoint_values

  @property
  def data_dims(self) -> int:
    """How many leading entries the data's own state may fill."""
    return self.max_state_dim - self.reserved

  @property
  def estimate(self) -> slice:
    return slice(self.data_dims, self.data_dims + self.estimate_dim)

  @property
  def keypoints(self) -> slice:
    return slice(self.max_state_dim - self.keypoint_values, self.max_state_dim)


@dataclasses.dataclass(frozen=True)
class PerceptionConfig:
  num_cameras: int
  max_state_dim: int
  image_size: int = 0
  detectors: Detectors = Detectors()
  estimate: Estimate = Estimate()
  teacher: Teacher = Teacher()
  geometry: Geometry = Geometry()

  @property
  def layout(self) -> StateLayout:
    return StateLayout(self.max_state_dim, self.estimate.dim if self.estimate.to_state else 0,
                       self.num_cameras * self.detectors.points * 2 if self.detectors.to_state else 0)


def default_config() -> ml_collections.ConfigDict:
  """The groups with their defaults (the quickstart's recipe), to set as model.perception."""
  settings = {name: dataclasses.asdict(kind()) for name, kind in GROUPS.items()}
  return ml_collections.ConfigDict(dict(image_size=64, **settings))


def state_slots(perception, num_cameras: int) -> int:
  """How many state entries model.perception (a ConfigDict; empty: none) writes, for a config that
  sizes max_state_dim as the data's state plus these."""
  settings = read(dict(num_cameras=num_cameras, max_state_dim=0, perception=perception))
  return settings.layout.reserved if settings is not None else 0


def _plain(value):
  if isinstance(value, ml_collections.ConfigDict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_plain(v) for v in value)
  return value


def read(model_config) -> PerceptionConfig | None:
  """model.perception as typed settings; None when empty (the released model). An unknown key is an
  error that names it."""
  get = model_config.get if hasattr(model_config, "get") else model_config.__getitem__
  perception = _plain(get("perception", None) or {})
  if not perception:
    return None
  groups = {}
  for name, kind in GROUPS.items():
    settings = dict(perception.get(name) or {})
    known = {field.name for field in dataclasses.fields(kind)}
    unknown = sorted(set(settings) - known)
    if unknown:
      raise ValueError(f"model.perception.{name} has no setting {unknown[0]!r}: it has {sorted(known)}")
    groups[name] = kind(**settings)
  unknown = sorted(set(perception) - set(GROUPS) - {"image_size"})
  if unknown:
    raise ValueError(f"model.perception has no group {unknown[0]!r}: it has image_size, {', '.join(GROUPS)}")
  return PerceptionConfig(num_cameras=int(get("num_cameras")), max_state_dim=int(get("max_state_dim")),
                          image_size=int(perception.get("image_size", 0) or 0), **groups)
