"""Per-array checksums and finiteness of a train state, computed on its devices.

Each array's bits are read as 32-bit words w_i and reduced to (sum w_i, sum (2i + 1) w_i) mod 2^32.
Integer sums do not depend on the order of the additions, so the checksum of an array is the same
on any mesh it is sharded over (a checkpoint restored onto another mesh checks against the same
values); the odd weights make any change of a single word, and any swap of two words, visible.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def path_name(path) -> str:
  """'params/blocks/0/up/kernel' from a jax tree path."""
  parts = []
  for entry in path:
    for attribute in ("name", "key", "idx"):
      if hasattr(entry, attribute):
        parts.append(str(getattr(entry, attribute)))
        break
    else:
      parts.append(str(entry))
  if len(parts) > 1 and parts[-1] == "value":  # nnx.State leaves: params/blocks/0/up/kernel/value
    parts.pop()
  return "/".join(parts)


def _words(x: jax.Array) -> jax.Array:
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32).reshape(-1)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)


def _summary(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  words = _words(x)
  weights = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
  checksum = jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)])
  finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
  return checksum, finite


def summarize(tree: Any) -> dict[str, tuple[str, bool]]:
  """{path: (checksum as 16 hex digits, all values finite)} for every array leaf of `tree`."""
  paths_and_leaves = [(path_name(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
                      if isinstance(leaf, jax.Array)]
  if not paths_and_leaves:
    return {}
  leaves = [leaf for _, leaf in paths_and_leaves]
  meshes = [leaf.sharding.mesh for leaf in leaves if isinstance(leaf.sharding, NamedSharding)]
  results = jax.device_get(_summarize_fn(meshes[0] if meshes else None)(leaves))
  return {path: ("".join(f"{int(word):08x}" for word in np.asarray(checksum)), bool(finite))
          for (path, _), (checksum, finite) in zip(paths_and_leaves, results)}


@functools.lru_cache(maxsize=8)
def _summarize_fn(mesh):
  """One jitted function per mesh (replicated results), so that saves after the first reuse it."""
  out_sharding = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
  return jax.jit(lambda leaves: [_summary(x) for x in leaves], out_shardings=out_sharding)
