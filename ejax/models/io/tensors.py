"""Safetensors files <-> dicts of numpy arrays, and name-checked tensor mappings.

A released checkpoint is one `*.safetensors` file or a directory of shards (with or without
`model.safetensors.index.json`). bfloat16 tensors load as ml_dtypes.bfloat16 numpy arrays.

Every converter in ejax/models/io describes a checkpoint as a list of `TensorMap`s (ejax state
path <-> checkpoint key, plus a layout transform) and goes through `check_tensors`, so that a
missing, unexpected or mis-shaped tensor is always an error naming it.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Iterable, Mapping, Sequence

import numpy as np
from safetensors.numpy import load_file, save_file

from ejax.errors import MissingFileError, UserError


class CheckpointMismatch(UserError, ValueError):
  """A checkpoint whose tensors do not match the model: names every offending key."""


def load_tensors(path: str) -> dict[str, np.ndarray]:
  if os.path.isdir(path):
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
      files = [os.path.join(path, name) for name in files]
    else:
      files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
      raise MissingFileError(f"no *.safetensors files in {path!r}")
  elif os.path.exists(path):
    files = [path]
  else:
    raise MissingFileError(f"checkpoint {path!r} does not exist")
  tensors: dict[str, np.ndarray] = {}
  for file in files:
    for key, value in load_file(file).items():
      if key in tensors:
        raise CheckpointMismatch(f"tensor {key!r} appears in more than one shard (second: {file})")
      tensors[key] = value
  return tensors


def save_tensors(tensors: Mapping[str, np.ndarray], path: str, *, metadata: dict[str, str] | None = None) -> None:
  """Writes one safetensors file (parent directories created)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path, metadata=metadata)


# Layout transforms between ejax parameters and PyTorch-layout checkpoint tensors.
def _to_ejax(kind: str, array: np.ndarray, ejax_shape: Sequence[int]) -> np.ndarray:
  if kind == "copy":
    return array
  if kind == "linear":                          # torch Linear [out, in] -> kernel [in, out]
    return array.T
  if kind in ("head_in", "head_out"):           # [h*d, in] -> [in, h, d] ; [out, h*d] -> [h, d, out]
    return array.T.reshape(ejax_shape)
  if kind == "head_bias":                       # [h*d] -> [h, d]
    return array.reshape(ejax_shape)
  if kind == "patch":                           # conv [out, c, p, p] -> dense [(p, p, c), out]
    return array.transpose(2, 3, 1, 0).reshape(ejax_shape)
  raise ValueError(f"unknown tensor layout kind {kind!r}")


def _to_checkpoint(kind: str, array: np.ndarray, checkpoint_shape: Sequence[int]) -> np.ndarray:
  if kind == "copy":
    return array
  if kind == "linear":
    return array.T
  if kind == "head_in":
    return array.reshape(array.shape[0], -1).T
  if kind == "head_out":
    return array.reshape(-1, array.shape[-1]).T
  if kind == "head_bias":
    return array.reshape(-1)
  if kind == "patch":
    out, c, p, _ = checkpoint_shape
    return array.reshape(p, p, c, out).transpose(3, 2, 0, 1)
  raise ValueError(f"unknown tensor layout kind {kind!r}")


def checkpoint_shape(kind: str, ejax_shape: Sequence[int], patch_channels: int = 3) -> tuple[int, ...]:
  """The checkpoint tensor shape that corresponds to an ejax parameter shape."""
  s = tuple(ejax_shape)
  if kind in ("copy",):
    return s
  if kind == "linear":
    return s[::-1]
  if kind == "head_in":
    return (s[1] * s[2], s[0])
  if kind == "head_out":
    return (s[2], s[0] * s[1])
  if kind == "head_bias":
    return (s[0] * s[1],)
  if kind == "patch":
    p = int(round((s[0] // patch_channels) ** 0.5))
    return (s[1], patch_channels, p, p)
  raise ValueError(f"unknown tensor layout kind {kind!r}")


@dataclasses.dataclass(frozen=True)
class TensorMap:
  path: str   # '/'-joined nnx state path of the parameter
  key: str    # checkpoint tensor name
  kind: str   # layout transform, see _to_ejax


def check_tensors(maps: Sequence[TensorMap], tensors: Mapping[str, np.ndarray], ejax_shapes: Mapping[str, tuple],
                  *, ignored_prefixes: Iterable[str] = ()) -> list[str]:
  """Raises CheckpointMismatch naming missing, unexpected and mis-shaped tensors; returns the
  checkpoint keys that were deliberately ignored (known-unused prefixes)."""
  ignored_prefixes = tuple(ignored_prefixes)
  expected = {m.key: m for m in maps}
  missing = [k for k in expected if k not in tensors]
  ignored = [k for k in tensors if k not in expected and k.startswith(ignored_prefixes)] if ignored_prefixes else []
  unexpected = [k for k in tensors if k not in expected and k not in ignored]
  misshaped = []
  for key, m in expected.items():
    if key in tensors:
      want = checkpoint_shape(m.kind, ejax_shapes[m.path])
      if tuple(tensors[key].shape) != want:
        misshaped.append(f"{key}: checkpoint {tuple(tensors[key].shape)}, model expects {want}")
  raise_on_mismatch(missing, unexpected, misshaped, what="checkpoint",
                    hint="check config.model sizes against the checkpoint's config.json")
  return ignored


def raise_on_mismatch(missing: list[str], unexpected: list[str], misshaped: list[str], *, what: str,
                      hint: str) -> None:
  """One error naming (up to ten of) every missing, unexpected and mis-shaped tensor."""
  problems = []
  if missing:
    problems.append(f"{len(missing)} missing tensor(s): {', '.join(missing[:10])}")
  if unexpected:
    problems.append(f"{len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:10])}")
  if misshaped:
    problems.append(f"{len(misshaped)} mis-shaped tensor(s): {'; '.join(misshaped[:10])}")
  if problems:
    raise CheckpointMismatch(f"{what} does not match the model config: " + " | ".join(problems) + f" ({hint})")


def to_ejax(m: TensorMap, array: np.ndarray, ejax_shape: Sequence[int]) -> np.ndarray:
  return _to_ejax(m.kind, array, ejax_shape)


def to_checkpoint(m: TensorMap, array: np.ndarray, ejax_shape: Sequence[int], patch_channels: int = 3) -> np.ndarray:
  return _to_checkpoint(m.kind, array, checkpoint_shape(m.kind, ejax_shape, patch_channels))


def _path_string(path) -> str:
  return "/".join(str(getattr(p, "key", p)) for p in path)


def param_shapes(model) -> dict[str, tuple[int, ...]]:
  """'/'-joined path -> shape of every nnx.Param of a (possibly abstract) model."""
  from flax import nnx
  return {_path_string(p): tuple(v.get_value().shape) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def model_arrays(model) -> dict[str, np.ndarray]:
  """'/'-joined path -> numpy value of every nnx.Param (device arrays are fetched)."""
  from flax import nnx
  return {_path_string(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def fill_model(abstract_model, arrays: Mapping[str, np.ndarray]):
  """A concrete model whose every nnx.Param takes its value from `arrays` (keyed by path), cast to
  the parameter's dtype. Every Param must be covered; other variables become zeros."""
  import jax.numpy as jnp
  from flax import nnx

  graphdef, state = nnx.split(abstract_model)
  uncovered = [path for path in param_shapes(abstract_model) if path not in arrays]
  if uncovered:
    raise CheckpointMismatch(f"{len(uncovered)} model parameter(s) have no checkpoint tensor: "
                             f"{', '.join(uncovered[:10])}")

  def fill(path, variable):
    value = variable.get_value()
    if isinstance(variable, nnx.Param):
      array = arrays[_path_string(path)]
      if tuple(array.shape) != tuple(value.shape):
        raise CheckpointMismatch(f"parameter {_path_string(path)}: got {array.shape}, model expects {value.shape}")
      return variable.replace(jnp.asarray(array, value.dtype))
    return variable.replace(jnp.zeros(value.shape, value.dtype))

  return nnx.merge(graphdef, nnx.map_state(fill, state))
