"""openpi's wire format: msgpack with numpy arrays, byte for byte as `openpi_client.msgpack_numpy`.

An array travels as {b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str, b"shape": shape},
a numpy scalar as {b"__npgeneric__": True, b"data": item, b"dtype": dtype.str}; object, void and
complex arrays are refused (openpi falls back to nothing unsafe, neither does this). Kept here
rather than imported so that serving needs no openpi package; tests/serve checks both agree.
"""

from __future__ import annotations

import functools

import msgpack
import numpy as np


def _pack_array(obj):
  if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in ("V", "O", "c"):
    raise ValueError(f"unsupported dtype {obj.dtype}: send numbers, bools or strings")
  if isinstance(obj, np.ndarray):
    return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
  if isinstance(obj, np.generic):
    return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
  return obj


def _unpack_array(obj):
  if b"__ndarray__" in obj:
    return np.ndarray(buffer=obj[b"data"], dtype=np.dtype(obj[b"dtype"]), shape=obj[b"shape"])
  if b"__npgeneric__" in obj:
    return np.dtype(obj[b"dtype"]).type(obj[b"data"])
  return obj


packb = functools.partial(msgpack.packb, default=_pack_array)
unpackb = functools.partial(msgpack.unpackb, object_hook=_unpack_array)
