"""Which ejax.sim tasks, and which instructions, a data config's samples cover.

The data layer answers this (as it opens the recorded demonstrations, ejax.data.sources) so that a
policy (ejax.train.policy) and a model's tokenizer (ejax.models.paligemma_tokenizer) ask the data
config, never the simulator: neither imports ejax.sim.
"""

from __future__ import annotations

import os


def trained_tasks(data_config) -> list[str] | None:
  """The ejax.sim tasks a model trained on `data_config` saw: the recorded demonstrations' tasks, or
  those whose instructions a LeRobot dataset holds; None when the data were something else (or the
  dataset is no longer where training read it)."""
  from ejax.sim import registry
  if data_config.get("name") == "sim_demos":
    from ejax.sim.demos import resolve_tasks
    return resolve_tasks(data_config.sim_demos.tasks)
  path = data_config.get("path")
  if data_config.get("name") != "lerobot" or not path or not os.path.isdir(path):
    return None
  from ejax.data.lerobot_meta import read_meta
  try:
    instructions = set(read_meta(path).tasks.values())
  except Exception:  # a dataset moved or changed since training: fall back to the caller's default
    return None
  names = [name for name in registry.list_tasks() if registry.get_spec(name).instruction in instructions]
  return names or None


def simulator_instructions() -> list[str]:
  """Every ejax.sim task's instruction, in the registry's order: what a tokenizer built for the
  recorded demonstrations must cover (a policy trained on some tasks is evaluated on others too)."""
  from ejax.sim import registry
  return [registry.get_spec(name).instruction for name in registry.list_tasks()]
