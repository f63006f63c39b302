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
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from ejax.errors import UserError

ITEMS = ("state", "data", "meta")


class CheckpointError(UserError, RuntimeError):
  """A checkpoint that cannot be written or read; the message names it and the way out."""


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
    data_states = gather_json(data_state)
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave({"process_states": data_states}),
        meta=ocp.args.JsonSave(meta or {}))
    if not self._manager.save(step, args=args, force=force):
      raise CheckpointError(f"orbax declined to save step {step} in {self.directory} (newest there: "
                            f"{self.latest_step()}): the step was not saved")
    logging.info("checkpoint: saving step %d to %s", step, self.directory)
    return True

  def restore(self, step: int | None, target: Any) -> tuple[Any, Any, dict]:
    """Restores (state, this process's data state, meta). `target` is an abstract state whose
    leaves are jax.ShapeDtypeStruct with the shardings wanted now (any mesh)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint in {self.directory}")
    args = ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
    try:
      restored = self._manager.restore(step, args=args)
    except Exception as error:  # orbax raises many types for unreadable files; name the checkpoint.
      earlier = [s for s in self.all_steps() if s < step]
      way_out = (f"delete {self.directory}/{step} to resume from step {earlier[-1]}" if earlier
                 else "delete it or set --config.checkpoint.resume=False to start afresh")
      first_line = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
      raise CheckpointError(
          f"checkpoint {self.directory}/{step} is unreadable ({type(error).__name__}: {first_line}): {way_out}") from None
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
    restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(restored.meta)

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_target(abstract_state: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the shardings to restore into."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
