"""Build the device mesh (data, fsdp, tensor) from config."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ejax.errors import UserError
from ejax.parallel.axes import MESH_AXES


class MeshError(UserError, ValueError):
  """A mesh shape that cannot be built on the devices at hand."""


def resolve_mesh_shape(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Fills in the one axis given as -1 and checks the product equals the device count."""
  unknown = [name for name in sizes if name not in MESH_AXES]
  if unknown:
    raise MeshError(f"mesh axis {unknown[0]!r} is not one of {', '.join(MESH_AXES)}")
  shape = {name: int(sizes.get(name, 1)) for name in MESH_AXES}
  free = [name for name, size in shape.items() if size == -1]
  if len(free) > 1:
    raise MeshError(f"mesh axes {' and '.join(free)} are both -1: at most one axis may be -1")
  bad = [f"{name}={size}" for name, size in shape.items() if size == 0 or size < -1]
  if bad:
    raise MeshError(f"mesh {bad[0]} is not a positive size (or -1 for 'the rest')")
  described = " x ".join(f"{name}={size}" for name, size in shape.items() if size != 1) or "data=1"
  if free:
    known = math.prod(size for size in shape.values() if size != -1)
    if num_devices % known:
      raise MeshError(f"mesh {described} cannot fill {num_devices} devices: {num_devices} is not a multiple of {known}")
    shape[free[0]] = num_devices // known
  elif math.prod(shape.values()) != num_devices:
    raise MeshError(
        f"mesh {described} needs {math.prod(shape.values())} devices, found {num_devices}: "
        f"change config.mesh (e.g. set one axis to -1)")
  return shape


def make_mesh(sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A Mesh over all (or the given) devices with axes (data, fsdp, tensor).

  jax.experimental.mesh_utils orders devices so that the innermost axis (tensor) stays within a
  host/NVLink domain; on CPU it is a plain reshape.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(sizes, len(devices))
  dims = tuple(shape[name] for name in MESH_AXES)
  try:
    from jax.experimental import mesh_utils
    device_array = mesh_utils.create_device_mesh(dims, devices=devices, allow_split_physical_axes=True)
  except Exception:  # Unusual topologies: fall back to the given order.
    device_array = np.asarray(devices).reshape(dims)
  return Mesh(device_array, MESH_AXES)
