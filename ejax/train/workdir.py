"""The run's working directory: writable, not already another run's (unless asked), and locked.

Nothing here deletes anything: an old run's outputs are refused, or moved aside on request.
"""

from __future__ import annotations

import os
import socket
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
    # One probe per process and host: two runs started together on one workdir (the lock then turns
    # one away) must not remove each other's probe.
    probe = os.path.join(workdir, f".write_probe_{socket.gethostname()}_{os.getpid()}")
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


class WorkdirLock:
  """An exclusive lock on the workdir for the length of a run (process 0 holds it in multi-host runs).

  `<workdir>/ejax.lock` is flock()ed and names its holder (host, pid, start time). The kernel drops
  the flock when the holder dies, however it dies, so a lock file left by a killed run is stale by
  construction: the next run takes it over (and says so). A second live run on the same workdir
  stops at once, naming the holder. On file systems without flock, the holder's pid is checked
  (same host only).
  """

  NAME = "ejax.lock"

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, self.NAME)
    self._file = None

  def __enter__(self) -> "WorkdirLock":
    from ejax.parallel import broadcast_flag
    problem = self._acquire() if jax.process_index() == 0 else None
    if not broadcast_flag(problem is None):
      raise WorkdirError(problem or f"workdir {os.path.dirname(self.path)} is in use by another run "
                                    f"(process 0 could not lock {self.path})")
    return self

  def _acquire(self) -> str | None:
    """None when locked, else why not."""
    import fcntl
    import json
    import socket
    while True:
      handle = open(self.path, "a+")
      try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _read_holder(self.path)
        handle.close()
        return (f"workdir {os.path.dirname(self.path)} is in use by another run ({_holder_text(holder)}): "
                f"wait for it to end or stop it, or pass another --workdir")
      except OSError as error:  # no flock here (some network file systems): fall back to the pid
        holder = _read_holder(self.path)
        if holder and holder.get("host") == socket.gethostname() and _alive(holder.get("pid")):
          handle.close()
          return (f"workdir {os.path.dirname(self.path)} is in use by another run ({_holder_text(holder)}): "
                  f"wait for it to end or stop it, or pass another --workdir")
        logging.warning("cannot flock %s (%s): relying on the pid it names", self.path, error.strerror)
      # Locked an unlinked file (its holder removed it between our open and flock)? Try again.
      if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(handle.fileno()).st_ino:
        break
      handle.close()
    previous = _read_holder(self.path)
    if previous and previous.get("pid") is not None:
      logging.warning("took over the lock of a run that ended without releasing it (%s)", _holder_text(previous))
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
    handle.flush()
    self._file = handle
    return None

  def __exit__(self, *exc) -> None:
    if self._file is not None:
      try:
        os.remove(self.path)  # while still holding it: a waiting open() then makes a fresh file
      except OSError:
        pass
      self._file.close()
      self._file = None


def _read_holder(path: str) -> dict | None:
  import json
  try:
    with open(path) as f:
      text = f.read().strip()
    return json.loads(text) if text else None
  except (OSError, ValueError):
    return None


def _holder_text(holder: dict | None) -> str:
  if not holder:
    return "holder unknown"
  return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


def _alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except (ProcessLookupError, TypeError, ValueError):
    return False
  except PermissionError:
    return True
  return True
