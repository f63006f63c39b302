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

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    _register_array_handler()
    _drop_late_read_callbacks()
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
        cleanup_tmp_directories=True)
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
    except OSError as error:
      raise CheckpointError(f"cannot use checkpoint directory {self.directory}: {error.strerror or error}") from None

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
      raise CheckpointError(f"refusing to save step {step}: {_paths_text(nonfinite)} hold NaN or inf "
                            f"(the newest checkpoint, step {latest}, is kept as it is)")
    meta = {**(meta or {}), "checksums": {path: checksum for path, (checksum, _) in summary.items()}}
    data_states = gather_json(data_state)
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave({"process_states": data_states}),
        meta=ocp.args.JsonSave(meta))
    if not self._manager.save(step, args=args, force=force):
      raise CheckpointError(f"orbax declined to save step {step} in {self.directory} (newest there: "
                            f"{self.latest_step()}): the step was not saved")
    logging.info("checkpoint: saving step %d to %s", step, self.directory)
    return True

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
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_target(abstract_state: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the shardings to restore into."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)


def _paths_text(paths: list[str], limit: int = 3) -> str:
  shown = ", ".join(paths[:limit])
  return shown + (f" and {len(paths) - limit} more arrays" if len(paths) > limit else "")


def _drop_late_read_callbacks() -> None:
  """When a restore fails, tensorstore completes the other reads into orbax's closed event loop
  and each reports "Event loop is closed" through sys.unraisablehook: dozens of tracebacks after
  the one line that says what is wrong. Those, and only those, are dropped."""
  import sys
  previous = sys.unraisablehook
  if getattr(previous, "_ejax_drops_closed_loop", False):
    return

  def hook(unraisable):
    if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
      return
    previous(unraisable)

  hook._ejax_drops_closed_loop = True
  sys.unraisablehook = hook
