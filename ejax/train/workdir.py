"""The run's working directory: writable, not already another run's (unless asked), and locked.

Nothing here deletes anything: an old run's outputs are refused, or moved aside on request.
"""

from __future__ import annotations

import os
import time

import jax
from absl import logging

from ejax.errors import UserError

# What a train run writes into its workdir; moved together when an old run is set aside.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard")


class WorkdirError(UserError):
  pass


def prepare_workdir(workdir: str) -> str:
  workdir = os.path.abspath(workdir)
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".write_probe_{jax.process_index()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as error:
    raise WorkdirError(f"workdir {workdir} is not writable ({error.strerror or error}): "
                       f"pass --workdir=<a directory you can write>") from None
  return workdir


def saved_steps(checkpoint_dir: str) -> list[int]:
  """Steps with a complete checkpoint (orbax renames a step's folder to its number when done)."""
  if not os.path.isdir(checkpoint_dir):
    return []
  return sorted(int(name) for name in os.listdir(checkpoint_dir)
                if name.isdigit() and os.path.isdir(os.path.join(checkpoint_dir, name)))


def set_aside(workdir: str, names: list[str], label: str) -> str:
  """Moves workdir/<name> for each name into workdir/<label>-<time>/ (same file system: a rename)."""
  target = os.path.join(workdir, f"{label}-{time.strftime('%Y%m%d-%H%M%S')}")
  suffix = 0
  while os.path.exists(target + (f".{suffix}" if suffix else "")):
    suffix += 1
  target += f".{suffix}" if suffix else ""
  for name in names:
    source = os.path.join(workdir, name)
    if os.path.lexists(source):
      os.makedirs(os.path.dirname(os.path.join(target, name)), exist_ok=True)
      os.rename(source, os.path.join(target, name))
  return target


def refuse_or_move_old_run(workdir: str, *, move_aside: bool) -> None:
  """checkpoint.resume=False over a workdir that holds checkpoints: refuse, or move them aside.

  Starting afresh beside the old steps would be worse than useless: orbax refuses to save a step
  at or below the newest one, and the next plain run would resume the old run.
  """
  steps = saved_steps(os.path.join(workdir, "checkpoints"))
  if not steps:
    return
  if not move_aside:
    raise WorkdirError(
        f"checkpoint.resume=False but {workdir}/checkpoints holds steps {_steps_text(steps)} of an earlier run: "
        f"pass a new --workdir, or add --config.checkpoint.move_aside=True to move the old run's outputs "
        f"to {workdir}/previous-<time>/ (nothing is deleted), or resume it with --config.checkpoint.resume=True")
  if jax.process_index() == 0:
    target = set_aside(workdir, list(RUN_OUTPUTS), "previous")
    logging.warning("checkpoint.resume=False: moved the earlier run's outputs (steps %s) to %s",
                    _steps_text(steps), target)


def _steps_text(steps: list[int]) -> str:
  return ", ".join(map(str, steps[:5])) + (f" ... {steps[-1]}" if len(steps) > 5 else "")
