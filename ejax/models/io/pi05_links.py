"""Name-checked links between pi0.5's ejax parameters and an external checkpoint layout.

pi0.5's layouts are not one tensor per tensor: openpi stacks the 27 SigLIP blocks that ejax keeps
apart, LeRobot splits the 18 stacked Gemma layers (and q/k/v, gate/up) into per-layer tensors. A
`Link` ties a group of ejax parameters to a group of checkpoint tensors with a pair of inverse
transforms written with array methods (numpy or jax alike), so the expected checkpoint shapes come from `jax.eval_shape` on the
abstract model (no allocation at full size) and every import checks every key before converting.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ejax.models.io.tensors import fill_model, model_arrays, param_shapes, raise_on_mismatch

Arrays = list


@dataclasses.dataclass(frozen=True)
class Link:
  paths: tuple[str, ...]                     # ejax '/'-joined parameter paths
  keys: tuple[str, ...]                      # checkpoint tensor names
  to_checkpoint: Callable[[Arrays], Arrays]  # ejax arrays (order of paths) -> checkpoint arrays
  to_ejax: Callable[[Arrays], Arrays]        # the inverse


def stack_arrays(arrays: Sequence) -> np.ndarray | jax.Array:
  """np.stack for real conversions (no per-op compiles), jnp.stack under eval_shape's tracing.
  Every other transform uses array methods (reshape, transpose, .T, indexing) that both have."""
  if any(isinstance(a, jax.Array) for a in arrays):
    return jnp.stack(arrays)
  return np.stack(arrays)


def copy(path: str, key: str) -> Link:
  return Link((path,), (key,), lambda xs: [xs[0]], lambda ys: [ys[0]])


def transformed(path: str, key: str, forward: Callable, backward: Callable) -> Link:
  return Link((path,), (key,), lambda xs: [forward(xs[0])], lambda ys: [backward(ys[0])])


def stack(paths: Sequence[str], key: str) -> Link:
  """ejax per-layer parameters <-> one checkpoint tensor stacked on a leading layer axis."""
  return Link(tuple(paths), (key,), lambda xs: [stack_arrays(xs)], lambda ys: list(ys[0]))


def split_layers(path: str, keys_per_layer: Sequence[Sequence[str]], forward: Callable, backward: Callable) -> Link:
  """One ejax tensor stacked over layers <-> per-layer checkpoint tensors.

  forward(layer_slice) -> list of that layer's checkpoint tensors (order of its keys);
  backward(list of them) -> the layer slice.
  """
  per_layer = len(keys_per_layer[0])
  keys = tuple(k for layer_keys in keys_per_layer for k in layer_keys)

  def to_checkpoint(xs):
    return [y for i in range(xs[0].shape[0]) for y in forward(xs[0][i])]

  def to_ejax(ys):
    return [stack_arrays([backward(ys[i:i + per_layer]) for i in range(0, len(ys), per_layer)])]

  return Link((path,), keys, to_checkpoint, to_ejax)


def _check_links_cover(links: Sequence[Link], shapes: Mapping[str, tuple], model_name: str) -> None:
  linked = [p for link in links for p in link.paths]
  unlinked = sorted(set(shapes) - set(linked))
  unknown = sorted(set(linked) - set(shapes))
  if unlinked or unknown:  # a model change without a key-map change: a bug in ejax, not in the file
    raise AssertionError(f"{model_name} key map out of date: unlinked {unlinked[:5]}, unknown {unknown[:5]}")


def expected_shapes(links: Sequence[Link], abstract_model) -> dict[str, tuple[int, ...]]:
  """Checkpoint key -> shape, derived from the model's abstract parameters without allocating."""
  shapes = param_shapes(abstract_model)
  result = {}
  for link in links:
    inputs = [jax.ShapeDtypeStruct(shapes[p], jnp.float32) for p in link.paths]
    outputs = jax.eval_shape(link.to_checkpoint, inputs)
    result.update({k: tuple(o.shape) for k, o in zip(link.keys, outputs)})
  return result


def check(links: Sequence[Link], tensors: Mapping[str, np.ndarray], abstract_model, *,
          ignored: Iterable[str] = (), layout: str) -> None:
  """Raises CheckpointMismatch naming every missing, unexpected and mis-shaped tensor."""
  want = expected_shapes(links, abstract_model)
  ignored = set(ignored)
  missing = [k for k in want if k not in tensors]
  unexpected = [k for k in tensors if k not in want and k not in ignored]
  misshaped = [f"{k}: checkpoint {tuple(np.shape(tensors[k]))}, model expects {want[k]}"
               for k in want if k in tensors and tuple(np.shape(tensors[k])) != want[k]]
  raise_on_mismatch(missing, unexpected, misshaped, what=f"{layout} checkpoint",
                    hint="check config.model sizes against the checkpoint's config")


def import_with(links: Sequence[Link], tensors: Mapping[str, np.ndarray], abstract_model, *,
                ignored: Iterable[str] = (), layout: str):
  """A concrete model from checkpoint tensors, after checking every key and shape."""
  _check_links_cover(links, param_shapes(abstract_model), layout)
  check(links, tensors, abstract_model, ignored=ignored, layout=layout)
  arrays = {}
  for link in links:
    values = link.to_ejax([np.asarray(tensors[k]) for k in link.keys])
    arrays.update({p: np.asarray(v) for p, v in zip(link.paths, values)})
  return fill_model(abstract_model, arrays)


def export_with(links: Sequence[Link], model, *, layout: str) -> dict[str, np.ndarray]:
  """The model's parameters under the checkpoint's names and layouts (numpy, dtypes kept)."""
  arrays = model_arrays(model)
  _check_links_cover(links, {p: a.shape for p, a in arrays.items()}, layout)
  tensors = {}
  for link in links:
    values = link.to_checkpoint([arrays[p] for p in link.paths])
    tensors.update({k: np.asarray(v) for k, v in zip(link.keys, values)})
  return tensors
