"""The `convert` job's entry for pi0.5: picks openpi's or LeRobot's layout from the path.

  import: a `*.safetensors` file, or a directory of them        -> LeRobot port (pi05_lerobot)
          any other directory (an orbax `params` checkpoint)    -> openpi tree (pi05_openpi)
  export: a destination ending in `.safetensors`                 -> LeRobot port
          any other path                                         -> openpi orbax checkpoint
"""

from __future__ import annotations

import glob
import os

from ejax.models.io import pi05_lerobot, pi05_openpi


def is_lerobot_path(path: str) -> bool:
  if path.endswith(".safetensors"):
    return True
  return os.path.isdir(path) and bool(glob.glob(os.path.join(path, "*.safetensors")))


def load(model_config, path: str):
  return (pi05_lerobot if is_lerobot_path(path) else pi05_openpi).load(model_config, path)


def save(model, path: str) -> None:
  (pi05_lerobot if path.endswith(".safetensors") else pi05_openpi).save(model, path)
