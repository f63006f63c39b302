import jax
import pytest
from jax.sharding import PartitionSpec as P

from configs.common import SHARDING_RULES
from ejax.parallel import MeshError, logical_to_spec, make_mesh, resolve_mesh_shape
from ejax.parallel import axes as ax


def test_resolve_fills_the_free_axis():
  assert resolve_mesh_shape(dict(data=-1, fsdp=2, tensor=2), 8) == dict(data=2, fsdp=2, tensor=2)
  assert resolve_mesh_shape(dict(data=1, fsdp=-1), 8) == dict(data=1, fsdp=8, tensor=1)


@pytest.mark.parametrize("sizes, message", [
    (dict(data=3, fsdp=2), "mesh data=3 x fsdp=2 needs 6 devices, found 8"),
    (dict(data=-1, fsdp=-1), "both -1"),
    (dict(data=-1, fsdp=3), "cannot fill 8 devices"),
    (dict(model=2), "'model' is not one of data, fsdp, tensor"),
])
def test_bad_mesh_names_the_problem(sizes, message):
  with pytest.raises(MeshError, match=message):
    resolve_mesh_shape(sizes, 8)


def test_make_mesh_axes():
  mesh = make_mesh(dict(data=2, fsdp=2, tensor=2))
  assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.size == jax.device_count()


def test_logical_to_spec():
  mesh = make_mesh(dict(data=2, fsdp=2, tensor=2))
  assert logical_to_spec((ax.EMBED, ax.MLP), SHARDING_RULES, shape=(64, 256), mesh=mesh) == P("fsdp", "tensor")
  assert logical_to_spec((ax.ACT_BATCH, ax.ACT_LEN, ax.ACT_EMBED), SHARDING_RULES, shape=(8, 5, 3), mesh=mesh) == P(("data", "fsdp"))
  # A dimension the mesh axis does not divide stays replicated instead of failing.
  assert logical_to_spec((ax.EMBED, ax.MLP), SHARDING_RULES, shape=(7, 256), mesh=mesh) == P(None, "tensor")
  # Each mesh axis at most once: vocab wants (tensor, fsdp) but embed already took fsdp.
  assert logical_to_spec((ax.EMBED, ax.VOCAB), SHARDING_RULES, shape=(64, 64), mesh=mesh) == P("fsdp", "tensor")
