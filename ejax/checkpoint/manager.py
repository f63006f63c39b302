"""Checkpoints that resume exactly and restore onto another mesh.

One checkpoint per saved step holds three items:
  state  the TrainState (params, optimizer state, EMA, step, RNG), sharded arrays via orbax;
  data   the input iterator's state of every process, so a resumed run reads the next unseen sample;
  meta   the config, normalisation statistics and anything else JSON-serialisable.
orbax writes each checkpoint into a temporary directory and renames it when complete, so a crash or
SIGTERM during a save leaves the previous checkpoint the newest readable one.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from ejax.checkpoint import checksums
from ejax.errors import UserError

ITEMS = ("state", "data", "meta")


class CheckpointError(UserError, RuntimeError):
  """A checkpoint that cannot be written or read; the message names it and the way out.

  `kind`: "damaged" (unreadable files, a checksum or NaN mismatch), "layout" (readable, but not
  the train state the config builds), or "other".
  """

  def __init__(self, message: str, kind: str = "other"):
    super().__init__(message)
    self.kind = kind


def gather_json(value: Any) -> list[Any]:
  """Every process's JSON-serialisable value, on every process (for per-process iterator states)."""
  if jax.process_count() == 1:
    return [value]
  encoded = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
  size = int(np.max(multihost_utils.process_allgather(np.array([encoded.size]))))
  padded = np.zeros(size, np.uint8)
  padded[:encoded.size] = encoded
  gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), size)
  return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in gathered]


# orbax splits every replicated array across its replicas to write in parallel; for small arrays
# each split is an eagerly compiled slice (hundreds per save on CPU meshes). Below this size one
# replica writes the whole array.
_MIN_BYTES_FOR_REPLICA_PARALLEL = 4 << 20
_handler_registered = False


def _register_array_handler() -> None:
  global _handler_registered
  if not _handler_registered:
    handler = ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=_MIN_BYTES_FOR_REPLICA_PARALLEL)
    absl_logger = logging.get_absl_logger()
    quiet = lambda record: "overriding" not in record.getMessage()  # the override is deliberate
    absl_logger.addFilter(quiet)
    try:
      ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
      absl_logger.removeFilter(quiet)
    _handler_registered = True


class Checkpointer:
  """orbax CheckpointManager with ejax's item layout and error messages."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True, for_writing: bool = False):
    _register_array_handler()
    _drop_late_read_callbacks()
    _quiet_background_save_errors()
    self.directory = os.path.abspath(directory)
    self._in_flight: int | None = None  # an async save not yet known to be complete
    self._failed = False
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
        cleanup_tmp_directories=True)
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
      if for_writing and jax.process_index() == 0:  # find out now, not at the first save
        probe = os.path.join(self.directory, f".write_probe_{os.getpid()}")
        with open(probe, "w") as f:
          f.write("ok")
        os.remove(probe)
    except OSError as error:
      raise CheckpointError(f"cannot write checkpoints to {self.directory} ({error.strerror or error}): make it "
                            "writable, or pass another --workdir", kind="write") from None

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, *, data_state: Any = None, meta: dict | None = None,
           force: bool = False) -> bool:
    latest = self.latest_step()
    if latest is not None and step <= latest:
      # orbax declines (or, forced, writes beside newer steps that a resume would pick instead).
      raise CheckpointError(f"cannot save step {step}: {self.directory} already holds step {latest} "
                            "of another run; pass a new --workdir")
    # Checksums travel in the meta item, written in the same atomic step as the arrays.
    summary = checksums.summarize(state)
    nonfinite = [path for path, (_, finite) in summary.items() if not finite]
    if nonfinite:
      kept = f"the newest checkpoint, step {latest}, is kept as it is" if latest is not None else "nothing saved"
      raise CheckpointError(f"refusing to save step {step}: {_paths_text(nonfinite)} hold NaN or inf ({kept})")
    meta = {**(meta or {}), "checksums": {path: checksum for path, (checksum, _) in summary.items()}}
    data_states = gather_json(data_state)
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave({"process_states": data_states}),
        meta=ocp.args.JsonSave(meta))
    self.wait()  # a failure of the previous (async) save is reported as that step's
    try:
      saved = self._manager.save(step, args=args, force=force)
    except Exception as error:
      raise self._write_error(step, error) from None
    if not saved:
      raise CheckpointError(f"orbax declined to save step {step} in {self.directory} (newest there: "
                            f"{self.latest_step()}): the step was not saved")
    self._in_flight = step
    logging.info("checkpoint: saving step %d to %s", step, self.directory)
    return True

  def _write_error(self, step: int, error: Exception) -> CheckpointError:
    """One line for a save that failed (disk full, permissions), naming the step still intact."""
    self._failed = True
    text = " ".join(str(error).split())
    reason = error.strerror if isinstance(error, OSError) and error.strerror else None
    os_error = re.search(r": ([A-Z][^:\[]*?) \[os_error_code='?(\d+)", text)  # tensorstore's wording
    code = re.match(r"([A-Z_]{4,}):", text)
    reason = reason or (os_error.group(1) if os_error else None) or (code.group(1) if code else None) or (
        f"{type(error).__name__}: {text[:120]}")
    full = "No space" in reason or "RESOURCE_EXHAUSTED" in text
    if full:  # tensorstore sometimes says only RESOURCE_EXHAUSTED, without the OS's wording
      reason = "No space left on device"
    complete = [int(n) for n in os.listdir(self.directory) if n.isdigit()] if os.path.isdir(self.directory) else []
    intact = (f"the newest complete checkpoint, step {max(complete)}, is intact" if complete
              else "no checkpoint was completed")
    return CheckpointError(f"cannot write checkpoint step {step} to {self.directory} ({reason}): "
                           f"{'free some space' if full else 'make it writable'} or pass another --workdir, "
                           f"then run the same command to resume; {intact}", kind="write")

  def restore(self, step: int | None, target: Any) -> tuple[Any, Any, dict]:
    """Restores (state, this process's data state, meta). `target` is an abstract state whose
    leaves are jax.ShapeDtypeStruct with the shardings wanted now (any mesh). The arrays are
    checked against the checksums written with them, and for NaN / inf."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint in {self.directory}")
    args = ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
    try:
      restored = self._manager.restore(step, args=args)
    except Exception as error:  # orbax raises many types for unreadable files; name the checkpoint.
      raise self._unreadable(step, error) from None
    self._verify(step, restored.state, dict(restored.meta).get("checksums"))
    states = restored.data.get("process_states") or [None]
    if len(states) != jax.process_count():
      logging.warning("checkpoint was written by %d processes, now %d: data iterators restart their position",
                      len(states), jax.process_count())
      data_state = None
    else:
      data_state = states[jax.process_index()]
    return restored.state, data_state, dict(restored.meta)

  def read_meta(self, step: int | None = None) -> dict:
    """The meta item alone (config, normalisation stats), e.g. to rebuild the model first."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint in {self.directory}")
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as error:
      raise self._unreadable(step, error) from None
    return dict(restored.meta)

  def way_out(self, step: int) -> str:
    """How to carry on without `step` (never by deleting it)."""
    earlier = [s for s in self.all_steps() if s < step]
    if earlier:
      return (f"resume from step {earlier[-1]} with --config.checkpoint.step={earlier[-1]} (the later "
              "steps are moved aside, not deleted)")
    return ("no earlier step to resume from: start afresh in a new --workdir, or with "
            "--config.checkpoint.resume=False --config.checkpoint.move_aside=True (which keeps this one aside)")

  def _unreadable(self, step: int, error: Exception) -> CheckpointError:
    text = " ".join(str(error).split()) or type(error).__name__
    if "tree structures do not match" in text or "not compatible with the stored shape" in text:
      return CheckpointError(
          f"checkpoint step {step} in {self.directory} holds another train state than the config builds "
          f"({text[:160]}): resume with the settings it was written with, or start in a new --workdir",
          kind="layout")
    # tensorstore names the array it could not read: 'Error reading "params.blocks.0.up.kernel.value/.zarray"'.
    array = re.search(r'Error reading "([^"/]+)/\.z', text)
    what = (f"cannot read array {array.group(1).removesuffix('.value').replace('.', '/')}" if array
            else "cannot read it")
    code = re.match(r"([A-Z_]{4,}):", text)
    cause = code.group(1) if code else f"{type(error).__name__}: {text[:120]}"
    return CheckpointError(f"checkpoint step {step} in {self.directory} is damaged, {what} ({cause}): "
                           f"{self.way_out(step)}", kind="damaged")

  def _verify(self, step: int, state: Any, expected: dict | None) -> None:
    if not expected:
      logging.info("checkpoint step %d carries no checksums (written by an older ejax): checked for NaN only", step)
    summary = checksums.summarize(state)
    corrupt = [path for path, (checksum, _) in summary.items() if (expected or {}).get(path, checksum) != checksum]
    nonfinite = [path for path, (_, finite) in summary.items() if not finite]
    if corrupt or nonfinite:
      what = (f"{_paths_text(corrupt)} do not match the checksums written with them" if corrupt
              else f"{_paths_text(nonfinite)} hold NaN or inf")
      raise CheckpointError(f"checkpoint step {step} in {self.directory} is damaged: {what}: {self.way_out(step)}",
                            kind="damaged")

  def reload(self) -> None:
    """Re-reads the step list (after steps were moved aside)."""
    self._manager.reload()

  def wait(self) -> None:
    """Until the last save is complete; raises CheckpointError if it failed."""
    try:
      self._manager.wait_until_finished()
    except Exception as error:
      raise self._write_error(self._in_flight, error) from None
    self._in_flight = None

  def close(self) -> None:
    if self._failed:  # already reported: release orbax's threads without raising the same error again
      try:
        self._manager.close()
      except Exception as error:  # noqa: BLE001
        logging.debug("closing after a failed save: %s", error)
      return
    self.wait()
    self._manager.close()


def abstract_target(abstract_state: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the shardings to restore into (and to lower a step for: weak types kept)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s,
                                                        weak_type=getattr(a, "weak_type", False)),
                      abstract_state, shardings)


def _paths_text(paths: list[str], limit: int = 3) -> str:
  shown = ", ".join(paths[:limit])
  return shown + (f" and {len(paths) - limit} more arrays" if len(paths) > limit else "")


def _drop_late_read_callbacks() -> None:
  """When a read or write fails, tensorstore completes orbax's other reads and writes into its
  closed event loop, or leaves their coroutines to be collected at exit; each reports through
  sys.unraisablehook ("Event loop is closed", "sys.meta_path is None"): dozens of tracebacks
  after the one line that says what went wrong. Those, and only those, are dropped."""
  import sys
  previous = sys.unraisablehook
  if getattr(previous, "_ejax_drops_closed_loop", False):
    return

  def hook(unraisable):
    error, obj = unraisable.exc_value, unraisable.object
    code = getattr(obj, "cr_code", None)
    if (isinstance(error, RuntimeError) and str(error) == "Event loop is closed") or (
        code is not None and "orbax" in code.co_filename):
      return
    previous(unraisable)

  hook._ejax_drops_closed_loop = True
  sys.unraisablehook = hook


def _quiet_background_save_errors() -> None:
  """A failed async save is raised by `Checkpointer.save` / `wait` / `close` as one line naming
  the step; orbax's save threads and asyncio also log each failed array write with a traceback
  (dozens on a full disk). Those records are kept at DEBUG."""
  import logging as py_logging

  class Filter(py_logging.Filter):
    def filter(self, record):
      message = record.getMessage()
      from_orbax_thread = "orbax" in record.pathname and record.exc_info is not None
      lost_future = message.split("\n", 1)[0].endswith("exception was never retrieved") and "orbax" in message
      return not (from_orbax_thread or lost_future)

  for logger in (logging.get_absl_logger(), py_logging.getLogger("asyncio")):
    if not any(getattr(f, "_ejax_save_errors", False) for f in logger.filters):
      quiet = Filter()
      quiet._ejax_save_errors = True
      logger.addFilter(quiet)
