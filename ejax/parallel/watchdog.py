"""No silent hangs across processes: a thread in every process that ends all of them with one line
when a step, a save or an exchange stalls, or when a peer is lost.

Every process publishes a heartbeat (what it is doing, and at which step) to jax.distributed's
coordination service every HEARTBEAT_S and reads its peers'. It ends the run when
- a peer's heartbeat has not moved for distributed.peer_lost_after seconds (40 by default; the process
  died: kill -9, a lost host), or the
  coordination service itself stopped answering (process 0's host is gone);
- this process has spent longer than the timeout in one phase (a train step, a checkpoint save, an
  RL update exchange): it names the peer that is behind (it stopped stepping) or, with none behind,
  every process (a collective that never completes);
- a peer ended the run: it published the line, which every process repeats.
The line ends `run the same command to resume from step M` (the newest complete checkpoint; a save
in flight is never renamed into place, so the last good one stays intact) and the process exits at
once (EXIT_CODE), without the interpreter's teardown, which would wait on the dead peer.

jax.distributed's own checks abort the process with a C++ stack trace (its Python callback is
unusable: jaxlib 0.9.2 terminates with std::bad_cast calling it): at once when the connection to the
coordination service drops, and when a peer has missed heartbeats for its timeout. So
ejax.parallel.distributed runs the service in a child process of process 0 that outlives it
(ejax/parallel/coordinator.py) and sets jaxlib's timeout above peer_lost_after: this thread ends first.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from typing import Callable

import jax
from absl import logging

from ejax.parallel import distributed

HEARTBEAT_S = 2.0
MIN_TIMEOUT_S = 300.0  # the automatic phase timeout: at least this,
MEDIAN_FACTOR = 20  # or this many median warmed-up train steps
WARMUP_STEPS = 3  # steps left out of the median (the first executions are slower)
EXIT_CODE = 3


class Watchdog:
  """See the module docstring. The trainer wraps each phase in `watch(phase, step)`.

  timeout_s > 0 fixes the phase timeout; 0 derives it from the train steps seen so far
  (max(MIN_TIMEOUT_S, MEDIAN_FACTOR x the median step after WARMUP_STEPS)). `key` names its
  coordination-service keys (default: `name`; unique per watchdog a process makes). `resume_from()` gives
  the step a relaunch resumes from (None: nothing saved). `say_last(line)` writes the run's last
  line and returns whether this call wrote it (StopSignal.say_last); `exit_process` ends the
  process (tests replace it).
  """

  def __init__(self, name: str, *, unit: str = "step", timeout_s: float = 0.0,
               resume_from: Callable[[], int | None] = lambda: None,
               say_last: Callable[[str], bool] | None = None, lost_after_s: float | None = None,
               heartbeat_s: float = HEARTBEAT_S, exit_process: Callable[[int], None] | None = None,
               key: str | None = None):
    self.index, self.count = jax.process_index(), jax.process_count()
    self.name, self.unit = name, unit  # unit: what `step` counts ("step"; "update" for RL)
    self._fixed_timeout = float(timeout_s) if timeout_s and timeout_s > 0 else None
    self._resume_from = resume_from
    self._say_last = say_last or (lambda line: (print(line, file=sys.stderr, flush=True), True)[1])
    self._exit_process = exit_process or (lambda code: os._exit(code))
    # lost_after_s None: the run's distributed.peer_lost_after
    self._lost_after_s = distributed.peer_lost_after_s() if lost_after_s is None else lost_after_s
    self._heartbeat_s = heartbeat_s
    self._prefix = f"ejax/watchdog/{key or name}"  # key: unique per watchdog a process makes
    self._lock = threading.Lock()
    self._phase: str | None = None
    self._step = 0
    self._since = time.monotonic()
    self._steps_timed = 0
    self._step_seconds: collections.deque[float] = collections.deque(maxlen=1000)  # the recent warmed-up steps
    self._seq = 0
    self._seen: dict[int, tuple[int, float]] = {}  # peer -> (its heartbeat count, when it last moved here)
    self._unreachable_since: float | None = None
    self._closed = threading.Event()
    self._thread = None
    if self.count > 1:
      self._thread = threading.Thread(target=self._run, name="ejax-watchdog", daemon=True)
      self._thread.start()

  # --- Main thread ------------------------------------------------------------------------------
  def begin(self, phase: str, step: int) -> None:
    """`phase` of `step` starts now: it must end within the timeout."""
    with self._lock:
      self._phase, self._step, self._since = phase, step, time.monotonic()

  def end(self) -> None:
    with self._lock:
      if self._phase == "train step":
        self._steps_timed += 1
        if self._steps_timed > WARMUP_STEPS:
          self._step_seconds.append(time.monotonic() - self._since)
      self._phase = None

  @contextlib.contextmanager
  def watch(self, phase: str, step: int):
    """The body is `phase` of `step`: it must finish within the timeout."""
    self.begin(phase, step)
    try:
      yield
    finally:
      self.end()

  def timeout_s(self) -> float:
    if self._fixed_timeout is not None:
      return self._fixed_timeout
    with self._lock:
      warmed = list(self._step_seconds)
    return max(MIN_TIMEOUT_S, MEDIAN_FACTOR * statistics.median(warmed)) if warmed else MIN_TIMEOUT_S

  def wait_for_verdict(self, error: BaseException) -> None:
    """A collective or a save failed in the main thread (a peer's connection dropped?): if a peer
    is gone, the watchdog names it within peer_lost_after and ends the process; once every peer has
    sent two heartbeats since the error (or said it is done), none is lost and this returns: the
    error stands (a dead peer's last heartbeat is already in the service when this reads it)."""
    if self._thread is None:
      return
    logging.warning("%s failed (%s): asking which process stopped answering", self.name,
                    " ".join(str(error).split())[:200])
    before = {q: state["seq"] for q, state in self._read_peers().items() if state}  # read after the error
    deadline = time.monotonic() + self._lost_after_s + 4 * self._heartbeat_s + 10
    while self._thread.is_alive() and time.monotonic() < deadline:
      time.sleep(self._heartbeat_s / 4)
      states = self._read_peers()
      if all(state and (state["done"] or state["seq"] >= before.get(q, 0) + 2) for q, state in states.items()):
        return

  def _read_peers(self) -> dict[int, dict | None]:
    """Every peer's last heartbeat as it is in the coordination service now (None: none, or no answer)."""
    raw = {q: distributed.kv_try_get(f"{self._prefix}/{q}") for q in range(self.count) if q != self.index}
    return {q: json.loads(value) if value else None for q, value in raw.items()}

  def close(self) -> None:
    """This process is done (finished or stopping on its own): peers stop expecting heartbeats."""
    if self._thread is None or self._closed.is_set():
      return
    self._closed.set()
    self._publish(done=True)

  # --- Watchdog thread --------------------------------------------------------------------------
  def _run(self) -> None:
    while not self._closed.wait(self._heartbeat_s):
      try:
        line = self._check()
      except Exception as error:  # noqa: BLE001  (never let the watchdog die silently)
        logging.warning("watchdog: %s", error)
        continue
      if line is not None and not self._closed.is_set():
        self._end(line)
        return

  def _check(self) -> str | None:
    now = time.monotonic()
    if not self._publish(done=False):
      if self._unreachable_since is None:
        self._unreachable_since = now
      if now - self._unreachable_since > self._lost_after_s and self.index != 0:
        return self._line(0, self._step, f"the coordination service on process 0 has not answered for "
                                         f"{now - self._unreachable_since:.0f} s")
      return None
    self._unreachable_since = None
    aborted = distributed.kv_try_get(f"{self._prefix}/abort")
    if aborted is not None:
      self._publish(done=True, read_abort=True)  # lets process 0, which holds the service, exit
      return aborted
    peers = self._peers(now)
    for q, state in peers.items():
      if not state["done"] and now - self._seen[q][1] > self._lost_after_s:
        return self._line(q, max(state["step"], self._step), f"no heartbeat for {now - self._seen[q][1]:.0f} s")
    with self._lock:
      phase, step, since = self._phase, self._step, self._since
    timeout = self.timeout_s()
    if phase is None or now - since <= timeout:
      return None
    waited = f"process {self.index} waited {now - since:.0f} s in its {phase}; train.step_timeout {timeout:.0f} s"
    silent = [q for q, state in peers.items() if not state["done"] and now - self._seen[q][1] > 3 * self._heartbeat_s]
    behind = [q for q, state in peers.items() if not state["done"] and
              (state["step"], state["phase"] is not None) < (step, True)]
    if silent:
      q = min(silent)
      return self._line(q, step, f"{waited}; process {q} has sent no heartbeat for {now - self._seen[q][1]:.0f} s")
    if behind:
      q = min(behind, key=lambda q: (peers[q]["step"], q))
      doing = peers[q]["phase"] or "between phases"
      return self._line(q, step, f"{waited}; process {q} is at {self.unit} {peers[q]['step']}, {doing}")
    return self._line(None, step, f"{waited}, and every process is in it: a collective that never completes")

  def _publish(self, *, done: bool, read_abort: bool = False) -> bool:
    with self._lock:
      self._seq += 1
      state = {"seq": self._seq, "step": self._step, "phase": self._phase, "done": done, "read_abort": read_abort}
    try:
      distributed.kv_set(f"{self._prefix}/{self.index}", json.dumps(state), allow_overwrite=True)
      return True
    except Exception:  # noqa: BLE001  (the service is unreachable: counted by the caller)
      return False

  def _peers(self, now: float) -> dict[int, dict]:
    peers = {}
    for q, state in self._read_peers().items():
      state = state or {"seq": 0, "step": 0, "phase": None, "done": False}
      if q not in self._seen or self._seen[q][0] != state["seq"]:
        self._seen[q] = (state["seq"], now)
      peers[q] = state
    return peers

  def _linger(self) -> None:
    """Process 0 may hold the coordination service (where it cannot run in a process of its own), and
    jaxlib aborts every peer (a C++ stack trace) the moment it goes: it stays until the live peers have
    read the line (a few heartbeats at most)."""
    deadline = time.monotonic() + 3 * self._heartbeat_s + 2
    while time.monotonic() < deadline:
      now = time.monotonic()
      waiting = [q for q, state in self._peers(now).items()
                 if not state.get("read_abort") and not state["done"] and now - self._seen[q][1] < 3 * self._heartbeat_s]
      if not waiting:
        return
      time.sleep(0.2)

  def _line(self, process: int | None, step: int, detail: str) -> str:
    who = f"process {process} of {self.count}" if process is not None else f"every process of {self.count}"
    resume = self._resume_from()
    saved = "step" if self.unit == "step" else "version"
    then = (f"run the same command to resume from {saved} {resume}" if resume is not None
            else "run the same command to start again (no checkpoint was saved)")
    return f"error: {who} stopped answering at {self.unit} {step} ({self.name}: {detail}): {then}"

  def _end(self, line: str) -> None:
    try:  # every peer repeats it (the stuck one too, if its watchdog still runs)
      distributed.kv_set(f"{self._prefix}/abort", line)
    except Exception:  # noqa: BLE001  (already set by a peer, or the service is gone)
      pass
    self._say_last(line)
    if self.index == 0:
      self._linger()
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    self._exit_process(EXIT_CODE)
