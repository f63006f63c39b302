"""The batch entries model.perception trains on, as any model's collate lays them out:

  aux_state [n, estimate.dim] float32, aux_mask [n]   the estimate's target (data.aux_state_key), zeros
                                                      and mask 0 where a sample has none
  aux_pixels [n, cameras * points * 2] float32        the detectors' keypoint labels (data.aux_pixel_key),
                                                      (x, y) in [-1, 1], OUT_OF_VIEW where not seen
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ejax.errors import BatchError
from ejax.models.perception.config import PerceptionConfig

OUT_OF_VIEW = 10.0  # a keypoint label outside [-1, 1]: not in the image, no heatmap loss


def check_state(settings: PerceptionConfig | None, state_dim: int) -> None:
  """A sample's own state must leave the module's slots free (StateLayout)."""
  if settings is None or not settings.layout.reserved or state_dim <= settings.layout.data_dims:
    return
  reserved = settings.layout.reserved
  raise BatchError(f"model.perception puts {reserved} values in the state's last slots: the {state_dim}-d state "
                   f"leaves no room in max_state_dim={settings.max_state_dim} (raise it to {state_dim + reserved})")


def targets(settings: PerceptionConfig | None, n: int, aux_states: Sequence[np.ndarray | None] | None = None,
            aux_pixels: Sequence[np.ndarray | None] | None = None) -> dict[str, np.ndarray]:
  """The perception module's training targets for n samples (see the module docstring); {} without one."""
  if settings is None:
    return {}
  batch = {}
  dim = settings.estimate.dim
  batch["aux_state"] = np.zeros((n, dim), np.float32)
  batch["aux_mask"] = np.zeros((n,), np.float32)
  for i, value in enumerate(aux_states if aux_states is not None else [None] * n):
    if value is not None:
      value = np.asarray(value, np.float32).reshape(-1)
      if value.shape[0] != dim:
        raise BatchError(f"the auxiliary state has {value.shape[0]} dims, model.perception.estimate.dim is {dim}")
      batch["aux_state"][i], batch["aux_mask"][i] = value, 1.0
  points = settings.detectors.points
  if points:
    width = settings.num_cameras * points * 2
    batch["aux_pixels"] = np.full((n, width), OUT_OF_VIEW, np.float32)
    for i, value in enumerate(aux_pixels if aux_pixels is not None else [None] * n):
      if value is not None:
        value = np.asarray(value, np.float32).reshape(-1)
        if value.shape[0] != width:
          raise BatchError(f"the keypoint labels have {value.shape[0]} values, model.perception.detectors.points="
                           f"{points} in {settings.num_cameras} cameras need {width}")
        batch["aux_pixels"][i] = value
  return batch
