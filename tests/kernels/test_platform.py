"""ejax.kernels.platform: what differs between jax 0.9.2 (pinned) and 0.11 (the GPU machines)."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from ejax.kernels.platform import varying_axes, varying_struct


def _traced_under_shard_map(out_shape):
  """Traces a pallas_call (as for a GPU: interpret mode does not pass shard_map's varying-axes
  check on either jax) inside jax.shard_map over rows, with out_shape(x)."""
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:2])

  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] + x_ref[...]

  def per_device(x):
    assert varying_axes(x) == {"data"} and varying_axes(jnp.ones(3)) == frozenset()
    return pl.pallas_call(double, out_shape=out_shape(x))(x)

  sharded = jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  rows = jax.sharding.NamedSharding(mesh, P("data"))
  return jax.make_jaxpr(sharded)(jax.ShapeDtypeStruct((2, 4), jnp.float32, sharding=rows))


def test_a_pallas_output_typed_varying_passes_shard_maps_check():
  jaxpr = _traced_under_shard_map(lambda x: varying_struct(x.shape, x.dtype, x))
  assert "pallas_call" in str(jaxpr)
  # A plain struct is what the check refuses (jax 0.9.2 names the field vma, 0.11 manual_axis_type).
  with pytest.raises(ValueError, match="check_vma=True"):
    _traced_under_shard_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
  # Outside shard_map nothing varies.
  outside = varying_struct((3,), jnp.float32, jnp.ones(3))
  assert outside.shape == (3,) and outside.dtype == jnp.float32
