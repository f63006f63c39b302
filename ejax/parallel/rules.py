"""Logical axis names -> mesh PartitionSpecs, from the one rules table in config."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Sequence[tuple[str, Any]]

_context = threading.local()


def _as_tuple(mesh_axes: Any) -> tuple[str, ...]:
  if mesh_axes is None:
    return ()
  if isinstance(mesh_axes, str):
    return (mesh_axes,)
  return tuple(mesh_axes)


def logical_to_spec(
    names: Sequence[str | None] | None,
    rules: Rules,
    *,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
  """Maps each logical axis name to mesh axes by the first matching rule.

  A mesh axis is used at most once per spec (later dimensions lose it). With `shape` and `mesh`
  given, mesh axes that do not divide a dimension are dropped for that dimension, so odd-sized
  small tensors (biases of 3 actions, say) replicate instead of failing.
  """
  if names is None:
    return PartitionSpec()
  table = {}
  for logical, mesh_axes in rules:
    table.setdefault(logical, _as_tuple(mesh_axes))
  used: set[str] = set()
  spec = []
  for dim, name in enumerate(names):
    axes = [a for a in table.get(name, ()) if a not in used] if name is not None else []
    if shape is not None and mesh is not None:
      kept, size = [], shape[dim]
      for axis in axes:
        if size % mesh.shape[axis] == 0:
          kept.append(axis)
          size //= mesh.shape[axis]
      axes = kept
    if mesh is not None:
      axes = [a for a in axes if mesh.shape[a] > 1]
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  while spec and spec[-1] is None:
    spec.pop()
  return PartitionSpec(*spec)


@contextlib.contextmanager
def sharding_context(mesh: Mesh, rules: Rules) -> Iterator[None]:
  """Makes `constrain` active: inside it, activations are constrained on this mesh by these rules."""
  previous = getattr(_context, "value", None)
  _context.value = (mesh, tuple((k, v) for k, v in rules))
  try:
    yield
  finally:
    _context.value = previous


def current_context() -> tuple[Mesh, Rules] | None:
  return getattr(_context, "value", None)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Constrains an activation's sharding by logical names; a no-op outside `sharding_context`.

  Model code calls this at block boundaries only, so the compiler keeps freedom inside blocks.
  """
  context = current_context()
  if context is None:
    return x
  mesh, rules = context
  if len(names) != x.ndim:
    raise ValueError(f"constrain: {len(names)} axis names {tuple(names)} for an array of rank {x.ndim}")
  spec = logical_to_spec(names, rules, shape=x.shape, mesh=mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
