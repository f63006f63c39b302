"""ejax's msgpack-numpy codec is openpi_client's, byte for byte, both ways."""

import numpy as np
import pytest
from openpi_client import msgpack_numpy

from ejax.serve import wire

MESSAGE = {
    "observation.state": np.arange(11, dtype=np.float32),
    "observation.images.agentview": np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3),
    "task_index": np.int32(3), "prompt": "open the drawer", "nested": {"x": [1.5, np.float64(2.0)]},
}


def test_packed_bytes_equal_openpi_clients():
  assert wire.packb(MESSAGE) == msgpack_numpy.packb(MESSAGE)


@pytest.mark.parametrize("pack, unpack", [(wire.packb, msgpack_numpy.unpackb), (msgpack_numpy.packb, wire.unpackb)])
def test_round_trip_across_implementations(pack, unpack):
  decoded = unpack(pack(MESSAGE))
  np.testing.assert_array_equal(decoded["observation.images.agentview"], MESSAGE["observation.images.agentview"])
  assert decoded["observation.state"].dtype == np.float32
  assert decoded["task_index"] == 3 and decoded["task_index"].dtype == np.int32
  assert decoded["prompt"] == "open the drawer" and decoded["nested"]["x"][1] == 2.0


def test_object_arrays_are_refused():
  with pytest.raises(ValueError, match="unsupported dtype object"):
    wire.packb({"x": np.asarray(["a"], dtype=object)})
