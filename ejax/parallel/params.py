"""Shardings for NNX states (and trees built from them, like optimizer states) from the logical
axis names their variables carry."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ejax.parallel.rules import Rules, logical_to_spec

# ejax's variables carry their names under `out_sharding` (flax 0.12, where `sharding_names` is a
# deprecated alias of it); other flax releases store them under `sharding_names` / `sharding`.
_METADATA_KEYS = ("out_sharding", "sharding_names", "sharding")


def variable_axis_names(variable: nnx.Variable) -> tuple[str | None, ...] | None:
  metadata = variable.get_metadata()
  for key in _METADATA_KEYS:
    names = metadata.get(key)
    if names is None or isinstance(names, jax.sharding.Sharding):
      continue
    return tuple(names)
  return None


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def tree_shardings(tree: Any, mesh: Mesh, rules: Rules) -> Any:
  """A NamedSharding for every array leaf of `tree` (abstract or concrete), same structure.

  Leaves inside an nnx.Variable take their spec from its logical names; every other leaf (step
  counters, RNG keys, optimizer counts) is replicated. Optimizer moments built by tree-mapping
  over an nnx.State keep the Variable wrappers, so they shard exactly like their parameters.
  """

  def one(node):
    if _is_variable(node):
      value = node.get_value()
      names = variable_axis_names(node)
      if names is not None and len(names) != len(value.shape):
        raise ValueError(f"a parameter of shape {value.shape} declares {len(names)} axis names {names}")
      return node.replace(NamedSharding(mesh, logical_to_spec(names, rules, shape=value.shape, mesh=mesh)))
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree.map(one, tree, is_leaf=_is_variable)


def bytes_per_device(abstract_tree: Any, shardings: Any) -> int:
  """Bytes the largest-loaded device holds for this tree under these shardings (no allocation)."""
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
    shard_shape = sharding.shard_shape(leaf.shape)
    count = 1
    for size in shard_shape:
      count *= size
    total += count * leaf.dtype.itemsize
  return total
