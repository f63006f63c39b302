"""What an ejax checkpoint directory holds, told apart by its layout on disk alone (no orbax, no
reading): every job that takes a checkpoint path checks it with this before loading anything.

  TRAIN     a train job's <workdir>/checkpoints: numbered steps holding state/, data/, meta/
  RL        an rl job's <workdir>/rl_checkpoints: numbered versions holding state/, metadata/
  IMPORTED  one orbax tree (a _METADATA file, no steps): weights the convert job imported (openpi's
            released params directories look the same)
"""

from __future__ import annotations

import json
import os

TRAIN, RL, IMPORTED = "train", "rl", "imported"


def numbered(path: str) -> list[int]:
  """The numbered step / version directories in `path`, ascending."""
  return sorted(int(name) for name in os.listdir(path) if name.isdigit() and os.path.isdir(os.path.join(path, name)))


def checkpoint_kind(path: str) -> str | None:
  """TRAIN / RL / IMPORTED when `path` is that kind's directory, else None."""
  if not os.path.isdir(path):
    return None
  steps = numbered(path)
  if steps:
    items = os.listdir(os.path.join(path, str(steps[-1])))
    if "meta" in items:
      return TRAIN
    if "metadata" in items:
      return RL
    return None
  return IMPORTED if os.path.isfile(os.path.join(path, "_METADATA")) else None


def saved_config(path: str, step: int | None = None) -> dict:
  """The config a train checkpoint (TRAIN) was written with, read from its meta item's JSON alone: no
  orbax and no JAX backend, so a job may check it before jax.distributed starts. {} when unreadable
  (the loader then says what is wrong)."""
  steps = numbered(path) if os.path.isdir(path) else []
  chosen = steps[-1] if step is None and steps else step
  try:
    with open(os.path.join(path, str(chosen), "meta", "metadata")) as file:
      return json.load(file).get("config") or {}
  except (OSError, ValueError, AttributeError):
    return {}
