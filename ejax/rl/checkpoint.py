"""Checkpoint and resume of an RL run: parameters, optimizer state and the run's counters (orbax).

The trees are stored as flat {path: array} dicts keyed by their pytree paths, so any pytree of
arrays (NNX states, optax states) round-trips, and a restore into a differently built policy fails
with the names of the missing or extra leaves instead of silently misplacing weights.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from ejax.checkpoint import CheckpointError


def _flat(tree: Any) -> dict[str, Any]:
  return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _unflat(flat: dict[str, Any], like: Any) -> Any:
  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
  keys = [jax.tree_util.keystr(path) for path, _ in paths_and_leaves]
  missing, extra = sorted(set(keys) - set(flat)), sorted(set(flat) - set(keys))
  if missing or extra:
    raise ValueError(f"RL checkpoint does not match the policy being restored: missing {missing[:5]}, "
                     f"unexpected {extra[:5]}; restore with the config that wrote it")
  return jax.tree_util.tree_unflatten(treedef, [flat[key] for key in keys])


class RLCheckpointer:
  """Saves {"params", "opt_state"} and JSON metadata (version, env steps, policy config, ...) per
  policy version; keeps the newest `keep` versions and version 0."""

  def __init__(self, directory: str, *, keep: int = 3):
    self.directory = os.path.abspath(directory)
    # The newest `keep` versions, and version 0 (the SFT starting point) for good: judging a run
    # against where it started must still work after many saves.
    preserve = checkpoint_managers.AnyPreservationPolicy([checkpoint_managers.LatestN(n=keep),
                                                          checkpoint_managers.CustomSteps(steps=[0])])
    self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        preservation_policy=preserve, create=True))

  @staticmethod
  def has_versions(directory: str) -> bool:
    """Whether `directory` holds a finished version, read from the file system alone (building a
    manager to ask is a collective step in a multi-process run)."""
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))

  def save(self, version: int, params: Any, opt_state: Any, metadata: dict) -> None:
    state = {"params": _flat(params), "opt_state": _flat(opt_state)}
    self._manager.save(version, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                          metadata=ocp.args.JsonSave(dict(metadata, version=version))),
                       force=True)
    self._manager.wait_until_finished()  # a shutdown right after must not lose the save

  def resolve_version(self, version: int | None) -> int:
    """`version` (None: the newest) if it is saved here; otherwise a CheckpointError naming what is."""
    saved = self.all_versions()
    chosen = self.latest_version() if version is None else version
    if chosen is None or chosen not in saved:
      what = f"no version {version}; saved: {saved}" if saved else "no RL checkpoint: run the rl job with it as workdir first"
      raise CheckpointError(f"{self.directory}: {what}")
    return chosen

  def latest_version(self) -> int | None:
    return self._manager.latest_step()

  def restore(self, params_like: Any, opt_state_like: Any, version: int | None = None) -> tuple[Any, Any, dict]:
    version = self.resolve_version(version)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                            {"params": _flat(params_like), "opt_state": _flat(opt_state_like)})
    restored = self._manager.restore(version, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                        metadata=ocp.args.JsonRestore()))
    state = restored["state"]
    return _unflat(state["params"], params_like), _unflat(state["opt_state"], opt_state_like), dict(restored["metadata"])

  def restore_params(self, params_like: Any, version: int | None = None) -> tuple[Any, dict]:
    """The policy parameters and metadata of one version, without the optimizer state (evaluation)."""
    version = self.resolve_version(version)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": _flat(params_like)})
    restored = self._manager.restore(version, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                                     partial_restore=True),
        metadata=ocp.args.JsonRestore()))
    return _unflat(restored["state"]["params"], params_like), dict(restored["metadata"])

  def read_metadata(self, version: int | None = None) -> dict:
    version = self.resolve_version(version)
    restored = self._manager.restore(version, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))
    return dict(restored["metadata"])

  def all_versions(self) -> list[int]:
    return list(self._manager.all_steps())

  def close(self) -> None:
    self._manager.close()
