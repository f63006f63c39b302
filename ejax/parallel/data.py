"""Per-process data sharding: each process loads its slice; global arrays are assembled from them."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ejax.parallel.rules import Rules, logical_to_spec
from ejax.parallel.axes import ACT_BATCH


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int, leading: int | None = None,
                   batch_axis: int = 0) -> NamedSharding:
  """Sharding of a batch array: its batch axis by the ACT_BATCH rule, the rest replicated."""
  names = [None] * ndim
  names[batch_axis] = ACT_BATCH
  shape = None
  if leading is not None:
    shape = [1] * ndim
    shape[batch_axis] = leading
  return NamedSharding(mesh, logical_to_spec(tuple(names), rules, shape=shape, mesh=mesh))


def process_batch_size(global_batch_size: int, mesh: Mesh, rules: Rules) -> int:
  """How many samples of each global batch this process loads."""
  from ejax.config.validate import ConfigError
  count, ways = jax.process_count(), _batch_ways(mesh, rules)
  if global_batch_size % count:
    raise ConfigError(f"train.global_batch_size={global_batch_size} does not split over {count} processes: "
                      f"make it a multiple of {count}")
  if global_batch_size % ways:
    described = " x ".join(f"{axis}={size}" for axis, size in mesh.shape.items() if size > 1) or "1 device"
    raise ConfigError(f"train.global_batch_size={global_batch_size} does not split over the {ways} data-parallel "
                      f"devices of mesh {described}: make it a multiple of {ways}, or change config.mesh")
  return global_batch_size // count


def process_batch_shards(mesh: Mesh, rules: Rules) -> int:
  """Into how many devices' shards this process's batch is split (each packed on its own)."""
  ways, count = _batch_ways(mesh, rules), jax.process_count()
  return ways // count if ways % count == 0 else 1


def _batch_ways(mesh: Mesh, rules: Rules) -> int:
  spec = logical_to_spec((ACT_BATCH,), rules, mesh=mesh)
  axes = spec[0] if spec else None
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  ways = 1
  for axis in axes:
    ways *= mesh.shape[axis]
  return ways


def global_batch(local_batch: Mapping[str, Any], mesh: Mesh, rules: Rules, *,
                 batch_axis: int = 0) -> dict[str, jax.Array]:
  """Global jax.Arrays from this process's numpy batch, the batch axis sharded by ACT_BATCH.

  Processes' batches are concatenated along `batch_axis` (1 for stacked micro-batches
  [accum, batch, ...]). Non-array entries (strings, metadata lists) stay on the host.
  """
  out = {}
  for name, value in local_batch.items():
    if not isinstance(value, (np.ndarray, jax.Array)) or value.dtype == object:
      continue
    value = np.asarray(value)
    global_shape = list(value.shape)
    global_shape[batch_axis] *= jax.process_count()
    sharding = batch_sharding(mesh, rules, value.ndim, leading=global_shape[batch_axis], batch_axis=batch_axis)
    out[name] = jax.make_array_from_process_local_data(sharding, value, tuple(global_shape))
  return out


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
