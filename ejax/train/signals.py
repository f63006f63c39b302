"""SIGINT / SIGTERM for the trainer: stop soon, never lose the last checkpoint, never hang.

- During start-up (reading or recording data, restoring, compiling) there is nothing to save: the
  first signal ends the run at once. Python runs signal handlers only between bytecodes, so a
  signal that lands inside a long native call (XLA compiling the step) is seen by a watcher
  thread instead, through `signal.set_wakeup_fd`; if the main thread has not ended the run within
  a few seconds, the watcher does.
- While training, the first signal asks for a checkpoint at the end of the current step, then a
  clean stop (the README's SIGTERM contract for schedulers).
- A second signal exits at once without saving; orbax writes each checkpoint into a temporary
  folder and renames it when complete, so the newest complete checkpoint is intact.
The watcher and its os._exit belong to the launcher (`run_job`); train() called from a notebook
or a test only ever raises KeyboardInterrupt in the main thread.

Exactly one line ends a run. The main thread and the watcher may both reach an ending at once (XLA
returns just as the grace period runs out), so every ending goes through `StopSignal.say_last`,
which writes it under a lock once; whoever comes second stays quiet.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Callable

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

GRACE_S = 3.0  # how long start-up may take to unwind after a signal before the watcher exits


class StartupInterrupted(KeyboardInterrupt):
  """A signal arrived before training began: nothing was trained or saved."""

  def __init__(self, signum: int, phase: str):
    super().__init__(signum)
    self.signum, self.phase = signum, phase


def signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return f"signal {signum}"


class StopSignal:
  """See the module docstring. `phase` says what start-up is doing (for the last line);
  `describe_abort()` says where a second signal leaves the run.

  `watch=True` (the launcher) adds the watcher thread, which ends the process from outside the
  main thread (os._exit). Without it (train() called from a notebook or a test) signals only ever
  raise in the main thread: a second one, or one during start-up, as KeyboardInterrupt.
  """

  def __init__(self, describe_abort: Callable[[], str] = lambda: "", *, watch: bool = False):
    self.requested: int | None = None  # the first signal's number
    self.training = False
    self._phase = "starting"
    self.describe_abort = describe_abort
    self._count = 0  # signals seen by the watcher
    self._handled = 0  # signals seen by the main thread's handler
    self._ending = threading.Lock()  # held while the last line is written
    self._ended = False  # the last line is out (or the run's owner said no line will come)
    self._previous: dict[int, object] = {}
    self._previous_wakeup = None
    self._sockets = None
    if threading.current_thread() is not threading.main_thread():
      return  # handlers can only be installed from the main thread (tests run trainers in threads)
    _drop_swallowed_interrupts()
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)
    if not watch:
      return
    self._sockets = socket.socketpair()
    for end in self._sockets:
      end.setblocking(True)
    self._sockets[1].setblocking(False)
    self._previous_wakeup = signal.set_wakeup_fd(self._sockets[1].fileno(), warn_on_full_buffer=False)
    threading.Thread(target=self._watch, name="ejax-signal-watcher", daemon=True).start()

  # --- Main thread ------------------------------------------------------------------------------
  def _handle(self, signum, frame):
    del frame
    self._handled += 1
    if self.requested is None:
      self.requested = signum
    if not self.training:
      raise StartupInterrupted(signum, self.phase)
    if self._handled > 1 and self._sockets is None:  # no watcher to exit at once: interrupt here
      raise KeyboardInterrupt(f"second signal ({signal_name(signum)})")
    if self._handled == 1:
      logging.warning("received %s: saving a checkpoint after this step, then stopping (a second signal "
                      "exits at once)", signal_name(signum))

  @property
  def phase(self) -> str:
    return self._phase

  @phase.setter
  def phase(self, phase: str) -> None:
    """Start-up moves on to `phase`; a signal that arrived during the last one ends the run here."""
    if self.requested is not None and not self.training:
      raise StartupInterrupted(self.requested, self._phase)
    self._phase = phase

  def begin_training(self) -> None:
    self.phase = "training"  # raises if a signal came during the last start-up phase
    self.training = True

  def agreed(self) -> bool:
    """All processes stop at the same step, or the last save would deadlock."""
    if jax.process_count() == 1:
      return self.requested is not None
    flags = multihost_utils.process_allgather(np.array([int(self.requested is not None)]))
    return bool(np.max(flags))

  def say_last(self, line: str, file=None) -> bool:
    """Writes the run's last line, whole and once, unless another thread already has: True if
    this call wrote it. A main thread that gets False leaves the ending to the watcher, which
    exits the process right after its line."""
    with self._ending:
      if self._ended:
        return False
      self._ended = True
      logging.flush()
      sys.stderr.flush()
      sys.stdout.flush()
      file = file or sys.stdout
      file.write(line + "\n")
      file.flush()
      return True

  def exit_now(self, code: int) -> None:
    """Flushes the output and ends the process without the interpreter's teardown (only once
    nothing is left to save or close)."""
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

  def finished(self) -> None:
    """The run's owner has written (or will write) its last line: the watcher must not."""
    with self._ending:
      self._ended = True

  def restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
    if self._sockets is not None:
      signal.set_wakeup_fd(self._previous_wakeup if self._previous_wakeup is not None else -1)
      self._sockets[1].close()  # ends the watcher
      self._sockets = None

  # --- Watcher thread -------------------------------------------------------------------------
  def _watch(self) -> None:
    reader = self._sockets[0]
    deadline = None
    while True:
      reader.settimeout(None if deadline is None else max(deadline - _now(), 0.01))
      try:
        data = reader.recv(64)
      except socket.timeout:
        data = None
      except OSError:
        return
      if data == b"":
        return  # restore() closed the other end
      if data is None:  # start-up did not end within the grace period: end it here
        if not self.training:
          self._exit(self.requested, f"interrupted by {signal_name(self.requested)} during start-up "
                                     f"({self.phase}); nothing was trained or saved")
        deadline = None
        continue
      for signum in data:
        if signum not in (signal.SIGINT, signal.SIGTERM):
          continue
        self._count += 1
        if self._count == 1:
          if self.requested is None:
            self.requested = signum
          if not self.training:
            deadline = _now() + GRACE_S
        else:
          where = self.describe_abort()
          self._exit(signum, f"second signal ({signal_name(signum)}): exited at once without saving"
                     + (f"; {where}" if where else ""), always=True)

  def _exit(self, signum: int, line: str, *, always: bool = False) -> bool:
    """Ends the process with `line` unless the main thread already ended the run: then only a
    second signal (`always`) still exits, at once and silently. Returns False if it did not exit."""
    if self.say_last(f"train: {line}") or always:
      self.exit_now(128 + signum)
    return False


def _drop_swallowed_interrupts() -> None:
  """A handler that raises while a garbage-collection callback runs has its exception swallowed
  and printed with a traceback; the next start-up phase (or the watcher) ends the run instead, so
  the print is dropped. Installed once per process, chained to the hook before it."""
  previous = sys.unraisablehook
  if getattr(previous, "_ejax_drops_interrupts", False):
    return

  def hook(unraisable):
    if not isinstance(unraisable.exc_value, StartupInterrupted):
      previous(unraisable)

  hook._ejax_drops_interrupts = True
  sys.unraisablehook = hook


def _now() -> float:
  import time
  return time.monotonic()
