"""Resuming a run: which step, whether the checkpoint was written by the same settings, and what
to say when it cannot be restored. Nothing here deletes a checkpoint.

A checkpoint carries the config that wrote it. Resuming under other settings (another model
depth, EMA switched on, a longer `train.steps` that reshapes the learning-rate schedule) is
refused with the changed keys named, unless `checkpoint.allow_changes` lists them (or is "all").
Settings that only say how the run executes (mesh, metrics, checkpoint options, workers, stop_at)
may change freely.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

from absl import logging
from ml_collections import ConfigDict

from ejax.checkpoint import Checkpointer, CheckpointError
from ejax.train.workdir import set_aside

# Keys (or prefixes ending in ".") that may differ between the checkpoint and this run.
RUNTIME_KEYS = (
    "job", "compilation_cache_dir", "mesh.", "sharding_rules", "distributed.", "checkpoint.",
    "metrics.", "serve.", "eval.", "train.stop_at", "train.step_timeout", "train.transfer_guard", "train.remat",
    "train.init_weights",
    "data.num_workers", "data.prefetch", "data.read_threads", "data.max_open_videos", "data.on_bad_sample",
    "data.skip_limit",
    "data.sim_demos.num_envs", "data.sim_demos.backend",
)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      out.update(flatten(value, f"{prefix}{key}."))
    return out
  return {prefix[:-1]: tree}


def _is_runtime(key: str) -> bool:
  return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RUNTIME_KEYS)


def config_changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
  """(key, saved value, current value) for every setting that differs and matters to the state or
  the run's course. Keys present on one side only (a newer or older ejax) are not counted."""
  old, new = flatten(saved), flatten(current)
  return [(key, old[key], new[key]) for key in sorted(old.keys() & new.keys())
          if not _is_runtime(key) and old[key] != new[key]]


def newer_settings(saved: dict, current: dict) -> list[tuple[str, Any]]:
  """(key, current value) for the settings this config has and the checkpoint's lacks: added to ejax
  after the checkpoint was written (config_changes leaves them out)."""
  old, new = flatten(saved), flatten(current)
  return [(key, new[key]) for key in sorted(new.keys() - old.keys()) if not _is_runtime(key)]


def describe_changes(changes: Iterable[tuple[str, Any, Any]], limit: int = 6) -> str:
  changes = list(changes)
  shown = [f"{key} {_short(old)} -> {_short(new)}" for key, old, new in changes[:limit]]
  return ", ".join(shown) + (f" and {len(changes) - limit} more" if len(changes) > limit else "")


def _short(value: Any) -> str:
  text = json.dumps(value) if not isinstance(value, str) else repr(value)
  return text if len(text) <= 40 else text[:37] + "..."


def allowed(allow_changes: str | None, key: str) -> bool:
  names = [name.strip() for name in (allow_changes or "").split(",") if name.strip()]
  return "all" in names or any(key == name or key.startswith(name + ".") for name in names)


def choose_step(checkpointer: Checkpointer, requested: int | None, workdir: str) -> int | None:
  """The step to resume from: the newest, or `checkpoint.step`. Steps after a requested one are
  moved aside (to <workdir>/set_aside-<time>/checkpoints/), so that the resumed run can save them
  again and a later plain run does not pick the old ones up."""
  steps = checkpointer.all_steps()
  if requested is None:
    return steps[-1] if steps else None
  if requested not in steps:
    raise CheckpointError(f"checkpoint.step={requested} is not in {checkpointer.directory} (steps there: "
                          f"{', '.join(map(str, steps)) or 'none'})")
  later = [step for step in steps if step > requested]
  if later:
    import jax
    if jax.process_index() == 0:
      target = set_aside(workdir, [os.path.join("checkpoints", str(step)) for step in later], "set_aside")
      logging.warning("resuming from step %d: moved the later steps %s to %s", requested,
                      ", ".join(map(str, later)), target)
    from ejax.parallel import barrier
    barrier("ejax_set_aside_later_steps")
    checkpointer.reload()
  return requested


def check_config(saved_config: dict | None, current: ConfigDict, *, step: int, directory: str) -> list:
  """Raises CheckpointError naming the settings that changed since `step` was written (those not
  in checkpoint.allow_changes); returns the allowed changes (for a later restore failure)."""
  if not saved_config:
    return []
  changes = config_changes(saved_config, json.loads(current.to_json_best_effort()))
  allow = current.checkpoint.get("allow_changes", "")
  refused = [change for change in changes if not allowed(allow, change[0])]
  if refused:
    keys = ",".join(key for key, _, _ in refused)
    raise CheckpointError(
        f"checkpoint step {step} in {directory} was written with other settings: {describe_changes(refused)}: "
        f"resume with the old values, start the new settings in a new --workdir, or add "
        f"--config.checkpoint.allow_changes={keys} to resume with the new ones")
  if changes:
    logging.warning("resuming step %d with changed settings: %s", step, describe_changes(changes))
  return changes


def check(checkpointer: Checkpointer, step: int, config: ConfigDict) -> list:
  """Reads the config `step` was written with and refuses changed settings (before any data is
  read or anything compiles); returns the allowed changes."""
  meta = checkpointer.read_meta(step)
  return check_config(meta.get("config"), config, step=step, directory=checkpointer.directory)


def restore(checkpointer: Checkpointer, step: int, target: Any, changes: list, config: ConfigDict | None = None):
  """(state, data_state) of `step`; a restore that fails on the state's layout names the changes, or
  else the settings newer than the checkpoint (an older ejax wrote it: train.compute_copy, say)."""
  try:
    state, data_state, _ = checkpointer.restore(step, target)
  except CheckpointError as error:
    if error.kind != "layout":
      raise
    if changes:
      raise CheckpointError(
          f"checkpoint step {step} in {checkpointer.directory} does not fit the configured train state "
          f"(settings changed since it was written: {describe_changes(changes)}): resume with the old "
          "values, or start the new settings in a new --workdir", kind="layout") from None
    saved = checkpointer.read_meta(step).get("config") if config is not None else None
    newer = newer_settings(saved, json.loads(config.to_json_best_effort())) if saved else []
    if newer:
      shown = ", ".join(f"{key}={value if isinstance(value, bool) else _short(value)}" for key, value in newer[:6])
      raise CheckpointError(
          f"checkpoint step {step} in {checkpointer.directory} does not fit the configured train state and "
          f"predates settings it was written without: {shown}: resume with them as the older ejax ran (their "
          f"configs/common.py defaults, --config.{newer[0][0]}=...), or start in a new --workdir",
          kind="layout") from None
    raise
  return state, data_state
