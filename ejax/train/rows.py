"""Train only the embodiment rows a run's data uses (`train.embodiment_rows`).

GR00T's per-embodiment tables (ejax.models.embodiment: W [32, in, out] and b [32, out], logical axis
EMBODIMENT first) hold 32 robots' rows, and a fine-tuning run feeds one or a few of them. Dense AdamW
reads and writes all 32 rows every step: the gradient rows of the others are zero, their Adam moments
stay zero, and the only change they get is weight decay (lr x weight_decay, ~1e-9 a step at GR00T's
settings). At full size that is ~2.8 ms of a step's memory traffic on an H200 (BENCHMARKS.md).

With rows set, the train step computes the loss on a view of the parameters whose tables hold only
those rows (each sample's embodiment id remapped to its row in the view), so the gradients, the Adam
moments and the update cover those rows, which are then written back in place. The other rows are
left exactly as they were (no weight decay). The optimizer state holds the view's shapes, so a run
resumes only with the same rows.

Values: "all" (the dense update), "data" (the ids data.embodiment_id names: resolved by `resolve`
when the config is loaded), or ids as "0" / "0,31".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ejax.errors import UserError
from ejax.parallel.axes import EMBODIMENT
from ejax.parallel.params import variable_axis_names


def resolve(config):
  """The config with train.embodiment_rows "data" replaced by the ids config.data.embodiment_id names
  (a copy; the same config where there is nothing to resolve). Where a config is loaded: ejax.main,
  ejax.train.loop.train, ejax.train.compile_report.load_config_file."""
  train = config.get("train")
  if train is None or train.get("embodiment_rows", "all") != "data":
    return config
  ids = config.data.get("embodiment_id", 0) if config.get("data") is not None else 0
  values = ids.values() if hasattr(ids, "values") else [ids]
  config = config.copy_and_resolve_references()
  config.train.embodiment_rows = ",".join(str(i) for i in sorted({int(v) for v in values}))
  return config


@dataclasses.dataclass(frozen=True)
class EmbodimentRows:
  rows: tuple[int, ...]

  def _table(self, variable) -> bool:
    names = variable_axis_names(variable) if isinstance(variable, nnx.Variable) else None
    return bool(names) and names[0] == EMBODIMENT

  def _map(self, fn, *trees):
    return jax.tree.map(lambda v, *rest: fn(v, *rest) if self._table(v) else (rest[-1] if rest else v),
                        *trees, is_leaf=lambda x: isinstance(x, nnx.Variable))

  def _contiguous(self) -> bool:
    return self.rows == tuple(range(self.rows[0], self.rows[0] + len(self.rows)))

  def _take(self, table):
    if self._contiguous():  # a slice: no gather
      return jax.lax.slice_in_dim(table, self.rows[0], self.rows[0] + len(self.rows))
    return table[np.asarray(self.rows)]

  def _put(self, table, rows):
    if self._contiguous():  # a dynamic-update-slice, in place in the donated buffer
      return jax.lax.dynamic_update_slice_in_dim(table, rows.astype(table.dtype), self.rows[0], 0)
    return table.at[np.asarray(self.rows)].set(rows.astype(table.dtype))

  def view(self, params):
    """params with every embodiment table cut to the rows (in the order of `rows`)."""
    return self._map(lambda v: v.replace(self._take(v.get_value())), params)

  def write_back(self, params, view):
    """params with the view's rows written into their tables; every other leaf the view's."""
    return self._map(lambda p, v: p.replace(self._put(p.get_value(), v.get_value())), params, view)

  def remap(self, batch: dict) -> dict:
    """The batch with each embodiment id replaced by its row in the view."""
    if "embodiment_id" not in batch:
      return batch
    lookup = np.zeros(max(self.rows) + 1, np.int32)
    lookup[list(self.rows)] = np.arange(len(self.rows), dtype=np.int32)
    ids = jnp.clip(batch["embodiment_id"], 0, len(lookup) - 1)
    return {**batch, "embodiment_id": jnp.asarray(lookup)[ids]}

  def check(self, ids) -> None:
    """One line naming the fix when a batch holds an embodiment id outside the rows (host side)."""
    outside = sorted(set(np.asarray(ids).ravel().tolist()) - set(self.rows))
    if outside:
      rows = ",".join(map(str, self.rows))
      raise UserError(f"a batch holds embodiment id(s) {outside}, outside train.embodiment_rows={rows!r}: "
                      f"set --config.train.embodiment_rows to include them (\"data\": the ids "
                      f"data.embodiment_id names; \"all\": every row)")


def from_train(train) -> EmbodimentRows | None:
  """The rows train.embodiment_rows names, or None for the dense update ("all")."""
  value = str(train.get("embodiment_rows", "all")).strip()
  if value == "all":
    return None
  if value == "data":
    raise UserError("train.embodiment_rows='data' was not resolved from data.embodiment_id: load the "
                    "config through ejax.main or ejax.train.compile_report.load_config_file")
  try:
    rows = tuple(int(part) for part in value.split(",") if part.strip())
  except ValueError:
    rows = ()
  if not rows or min(rows) < 0 or len(set(rows)) != len(rows):
    raise UserError(f"train.embodiment_rows={value!r} is not 'all', 'data' or distinct ids like '0,31'")
  return EmbodimentRows(rows)
