"""Per-embodiment tables (ejax/models/embodiment.py): a table of a few rows runs as one matmul a row
over every sample, a larger one as a gather of each sample's row; both give x @ W[id] + b[id], and
the same gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.models import embodiment
from ejax.parallel.axes import EMBED, MLP


def gathered(table, bias, x, ids):
  """The definition, one sample at a time."""
  return jnp.stack([x[i] @ table[ids[i]] + bias[ids[i]] for i in range(len(ids))])


def layer_fn(rows: int, in_features: int, out_features: int):
  """(table, bias) of a new layer, and the layer's call as a function of (table, bias, x, ids)."""
  layer = embodiment.CategorySpecificLinear(rows, in_features, out_features, axes=(MLP, EMBED), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)

  def call(table, bias, x, ids):
    values = nnx.State({**state, "W": state["W"].replace(table), "b": state["b"].replace(bias)})
    return nnx.merge(graphdef, values)(x, ids)

  return (layer.W.get_value(), layer.b.get_value()), call


@pytest.mark.parametrize("rows", [1, embodiment.ROWS_BY_MATMUL, embodiment.ROWS_BY_MATMUL + 2])
def test_each_sample_gets_its_rows_product_and_gradients(rows):
  (table, _), call = layer_fn(rows, 6, 5)
  bias = jax.random.normal(jax.random.key(1), (rows, 5))
  ids = jnp.asarray([2 * i % rows for i in range(7)], jnp.int32)  # rows mixed, and rows no sample uses
  x = jax.random.normal(jax.random.key(2), (7, 4, 6))
  weights = jax.random.normal(jax.random.key(3), (7, 4, 5))  # a loss that weighs every output

  def loss(fn, table, bias, x):
    y = fn(table, bias, x, ids)
    return jnp.sum(weights * y), y

  grad = lambda fn: jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(fn, table, bias, x)
  (_, got), got_grads = grad(call)
  (_, want), want_grads = grad(gathered)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for name, g, w in zip(("W", "b", "x"), got_grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
  unused = sorted(set(range(rows)) - set(np.asarray(ids).tolist()))
  assert all(not np.any(got_grads[0][row]) for row in unused)  # rows no sample uses get no gradient


def test_a_table_of_few_rows_copies_no_row_per_sample():
  """The step of a one-row table holds no [n, in, out] copy of it; a large table's does."""
  x = jax.ShapeDtypeStruct((32, 16, 64), jnp.float32)
  ids = jax.ShapeDtypeStruct((32,), jnp.int32)

  def program(rows):
    (table, bias), call = layer_fn(rows, 64, 48)
    grad = jax.grad(lambda table, bias, x, ids: jnp.sum(call(table, bias, x, ids)), argnums=(0, 1))
    return jax.jit(grad).lower(table, bias, x, ids).as_text()

  assert "32x64x48" not in program(1)
  assert "32x64x48" in program(embodiment.ROWS_BY_MATMUL + 1)
