"""Category-specific (per-embodiment) layers: one weight table per robot, gathered by id.

GR00T keeps W[num_embodiments, in, out] and b[num_embodiments, out] and picks each sample's
table by its embodiment id, so one model serves robots with different state/action layouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ejax.models import layers
from ejax.parallel import constrain
from ejax.parallel.axes import ACT_BATCH, EMBED, EMBODIMENT, IN_FEATURES, MLP


# Tables of at most this many rows run as one matmul a row over every sample (`_by_rows`), not as a
# copy of a row a sample. train.embodiment_rows cuts the tables to the rows a run trains (one, for
# GR00T's full config), and runlocal's have two.
ROWS_BY_MATMUL = 4


class CategorySpecificLinear(nnx.Module):
  """x [n, len, in] with ids [n] -> x @ W[id] + b[id]; W is named (EMBODIMENT, *axes)."""

  def __init__(self, num_categories: int, in_features: int, out_features: int, *, axes: tuple[str, str],
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.dtype = dtype
    self.num_categories = num_categories
    # GR00T draws W ~ N(0, 0.02), which is fan-in scaling at its widths (1/sqrt(3072) = 0.018); at
    # CPU-sized widths 0.02 shrinks the signal ~10x per layer and training crawls, so scale by fan-in.
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.W = layers.make_param(rngs, init, (num_categories, in_features, out_features),
                               (EMBODIMENT,) + tuple(axes), param_dtype)
    self.b = layers.make_param(rngs, layers.ZEROS, (num_categories, out_features), (EMBODIMENT, axes[1]), param_dtype)

  def __call__(self, x: jax.Array, category_ids: jax.Array) -> jax.Array:
    table, bias, x = self.W[...], self.b[...], x.astype(self.dtype)
    if table.shape[0] <= ROWS_BY_MATMUL:
      return _by_rows(x, table.astype(self.dtype), bias.astype(self.dtype), category_ids)
    # Each sample's table lives with the sample (batch-sharded): XLA gathers the FSDP-sharded tables
    # whole, as it gathers any weight, and takes each device's samples' ones locally. Left to itself
    # it kept the tables' FSDP sharding on the taken copies and gathered the activations of the whole
    # global batch onto every device instead (GBs per device at 1,024 devices).
    w = constrain(jnp.take(table, category_ids, axis=0).astype(self.dtype), (ACT_BATCH, None, None))  # [n, in, out]
    b = constrain(jnp.take(bias, category_ids, axis=0).astype(self.dtype), (ACT_BATCH, None))  # [n, out]
    return jnp.einsum("nli,nio->nlo", x, w) + b[:, None, :]


def _by_rows(x: jax.Array, table: jax.Array, bias: jax.Array, category_ids: jax.Array) -> jax.Array:
  """x [n, len, in] @ table[id] + bias[id] as one matmul a row over all n samples, each sample keeping
  its own row's: the gather's values, up to the matmuls' order of summation. The gather copies a row for
  every sample ([n, in, out]: at GR00T's full size 32 copies of up to 9 MB a table and step), reads them
  in batched matmuls of 16 rows each, and in the backward writes per-sample gradients that a scatter
  sums (BENCHMARKS.md: "The embodiment tables without a copy a sample"). A table of a few rows costs a
  few matmuls of n x len rows instead. An id outside the table gets row 0's result (the gather's would
  be NaN); the train step checks ids on the host (ejax.train.rows)."""
  y = jnp.dot(x, table[0]) + bias[0]
  for row in range(1, table.shape[0]):
    y = jnp.where((category_ids == row)[:, None, None], jnp.dot(x, table[row]) + bias[row], y)
  return y


class CategorySpecificMLP(nnx.Module):
  """layer2(relu(layer1(x))), both per category (GR00T's state encoder and action decoder)."""

  def __init__(self, num_categories: int, in_features: int, hidden: int, out_features: int, *,
               layer1_axes: tuple[str, str] = (IN_FEATURES, EMBED), layer2_axes: tuple[str, str] = (MLP, EMBED),
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    """Every table keeps one EMBED axis so FSDP shards it (they are 2-200 MiB each at full size)."""
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.layer1 = CategorySpecificLinear(num_categories, in_features, hidden, axes=layer1_axes, **common)
    self.layer2 = CategorySpecificLinear(num_categories, hidden, out_features, axes=layer2_axes, **common)

  def __call__(self, x: jax.Array, category_ids: jax.Array) -> jax.Array:
    return self.layer2(jax.nn.relu(self.layer1(x, category_ids)), category_ids)


def sinusoidal_encoding(positions: jax.Array, dim: int) -> jax.Array:
  """GR00T's action-encoder time encoding: [sin(p * f_i), cos(p * f_i)], f_i = 10000^(-i / (dim/2))."""
  half = dim // 2
  freqs = jnp.exp(-jnp.arange(half, dtype=jnp.float32) * (jnp.log(10000.0) / half))
  angles = positions.astype(jnp.float32)[..., None] * freqs
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class MultiEmbodimentActionEncoder(nnx.Module):
  """Noisy actions [n, horizon, action_dim] + timestep buckets [n] -> [n, horizon, width].

  W1 embeds actions, W2 mixes them with a sinusoidal encoding of the timestep (swish), W3 projects.
  """

  def __init__(self, num_categories: int, action_dim: int, width: int, *, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.width = width
    self.W1 = CategorySpecificLinear(num_categories, action_dim, width, axes=(IN_FEATURES, EMBED), **common)
    self.W2 = CategorySpecificLinear(num_categories, 2 * width, width, axes=(MLP, EMBED), **common)
    self.W3 = CategorySpecificLinear(num_categories, width, width, axes=(MLP, EMBED), **common)

  def __call__(self, actions: jax.Array, timestep_buckets: jax.Array, category_ids: jax.Array) -> jax.Array:
    a = self.W1(actions, category_ids)
    tau = jnp.broadcast_to(timestep_buckets[:, None], actions.shape[:2])
    tau_emb = sinusoidal_encoding(tau, self.width).astype(a.dtype)
    x = jax.nn.swish(self.W2(jnp.concatenate([a, tau_emb], axis=-1), category_ids))
    return self.W3(x, category_ids)
