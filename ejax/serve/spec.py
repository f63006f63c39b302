"""What a client of the policy server sends: the observation keys, shapes and dtypes a checkpoint's
policy reads, from its saved data and model configs, and the check every request goes through.

    spec = observation_spec(policy)           # a CheckpointPolicy (ejax.train.policy.load_policy)
    spec.describe()                           # {key: {"shape": [...], "dtype": "uint8", "required": True}}
    spec.example()                            # an observation a client can send as it is
    inputs = spec.check(observation)          # arrays ready for policy.act, or ObservationError (one line)

Keys are the dataset's (ejax.data): "observation.state" [state_dim] float32, one
"observation.images.<camera>" [H, W, 3] uint8 per camera at the size the policy was trained on, and
openpi's "prompt" (the instruction); models conditioned on a task id ("task_index") take that
instead. An optional "noise" [horizon, model action dim] float32 fixes the flow's initial noise, so a
client can reproduce in-process sampling exactly (the eval job's remote policy does).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from ejax.errors import UserError

IMAGE_PREFIX = "observation.images."
PROMPT_KEY = "prompt"
TASK_INDEX_KEY = "task_index"
NOISE_KEY = "noise"
STRING = "str"


class ObservationError(UserError, ValueError):
  """A request the policy cannot read; its message is the one-line reply the client gets."""


@dataclasses.dataclass(frozen=True)
class Field:
  shape: tuple[int, ...]
  dtype: str  # a numpy dtype name, or "str"
  required: bool = True

  def describe(self) -> str:
    return STRING if self.dtype == STRING else f"{self.dtype} {list(self.shape)}"


@dataclasses.dataclass(frozen=True)
class ObservationSpec:
  fields: dict[str, Field]
  noise_shape: tuple[int, int]
  example_prompt: str = "do something"

  def describe(self) -> dict[str, dict[str, Any]]:
    described = {key: {"shape": list(f.shape), "dtype": f.dtype, "required": f.required}
                 for key, f in self.fields.items()}
    described[NOISE_KEY] = {"shape": list(self.noise_shape), "dtype": "float32", "required": False}
    return described

  def camera_size(self) -> list[int]:
    """[height, width] of the first camera's images, [] without cameras: what an ejax.sim client
    (the eval job's remote policy) renders at."""
    images = [f.shape[:2] for key, f in self.fields.items() if key.startswith(IMAGE_PREFIX)]
    return list(images[0]) if images else []

  def example(self) -> dict[str, Any]:
    example = {}
    for key, f in self.fields.items():
      if f.required:
        example[key] = self.example_prompt if f.dtype == STRING else np.zeros(f.shape, f.dtype)
    return example

  def check(self, observation: Any) -> dict[str, np.ndarray]:
    """-> {key: [1, ...] array} for every field (the prompt as a 1-element object array) plus
    "noise" when the client sent it; raises ObservationError naming the key and what was expected."""
    if not isinstance(observation, dict):
      raise ObservationError(f"an observation is a map of key -> array, got {type(observation).__name__}: "
                             "see the metadata's example_observation")
    inputs = {}
    for key, f in self.fields.items():
      if key not in observation:
        if f.required:
          raise ObservationError(f"observation key {key!r} is missing: expected {f.describe()} "
                                 f"(the metadata's example_observation has every key)")
        value = "" if f.dtype == STRING else np.zeros(f.shape, f.dtype)
      else:
        value = _checked(key, observation[key], f)
      inputs[key] = np.asarray([value], dtype=object) if f.dtype == STRING else value[None]
    if observation.get(NOISE_KEY) is not None:
      inputs[NOISE_KEY] = _checked(NOISE_KEY, observation[NOISE_KEY], Field(self.noise_shape, "float32"))[None]
    return inputs


def _checked(key: str, value: Any, f: Field):
  if f.dtype == STRING:
    if isinstance(value, bytes):
      value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
      raise ObservationError(f"observation key {key!r} is {type(value).__name__}, expected a string")
    return value
  array = np.asarray(value)
  expected = np.dtype(f.dtype)
  if expected == np.uint8:
    dtype_ok = array.dtype == np.uint8  # images: no silent rescaling of floats
  elif expected.kind == "f":
    dtype_ok = array.dtype.kind in "fiu"
  else:
    dtype_ok = array.dtype.kind in "iu"
  if array.shape != f.shape or not dtype_ok:
    raise ObservationError(f"observation key {key!r} is {array.dtype} {list(array.shape)}, expected {f.describe()}")
  return array.astype(expected, copy=False)


def observation_spec(policy) -> ObservationSpec:
  """The spec of a CheckpointPolicy (ejax.train.policy), from the data and model configs saved in its
  checkpoint: the cameras it was trained on at their recorded size, its state size and instruction."""
  data, model = policy.data, policy.config.model
  features = _dataset_features(data)
  fields = {policy.state_key: Field((_state_dim(policy, features),), "float32")}
  for camera, size in _cameras(policy, features):
    fields[IMAGE_PREFIX + camera] = Field((*size, 3), "uint8")
  from ejax.models.registry import get_model_spec
  # Models whose batches carry a task id (tiny_flow) read it instead of an instruction.
  conditioned_on_task_index = TASK_INDEX_KEY in get_model_spec(model.name).example_batch(model, 1)
  if conditioned_on_task_index:
    fields[TASK_INDEX_KEY] = Field((), "int32")
  fields[PROMPT_KEY] = Field((), STRING, required=not conditioned_on_task_index)
  tasks = policy.trained_tasks
  prompt = "do something"
  if tasks:
    from ejax.sim import registry
    prompt = registry.get_spec(tasks[0]).instruction
  return ObservationSpec(fields, policy.noise_shape, prompt)


def _dataset_features(data) -> dict[str, dict]:
  """The LeRobot dataset's declared features when it is still where training read it, else {}."""
  path = data.get("path")
  if data.get("name") != "lerobot" or not path or not os.path.isdir(path):
    return {}
  from ejax.data.lerobot_meta import read_meta
  try:
    return read_meta(path).features
  except Exception:  # moved or changed since training: the configs alone must do
    return {}


def _state_dim(policy, features: dict) -> int:
  if policy.state_key in policy.normalizer.params:
    return int(policy.normalizer.params[policy.state_key][0].shape[0])
  if policy.state_key in features:
    return int(np.prod(features[policy.state_key]["shape"]))
  if policy.data.get("name") == "sim_demos":
    from ejax.sim.env import STATE_SIZE
    return STATE_SIZE
  if policy.config.model.get("state_dim"):
    return int(policy.config.model.state_dim)
  raise UserError(f"cannot tell the state size of this checkpoint's policy ({policy.state_key!r} has no "
                  "statistics, no dataset features, no model state_dim)")


def _cameras(policy, features: dict) -> list[tuple[str, tuple[int, int]]]:
  """[(camera name, (height, width))] the policy reads, in the checkpoint's order."""
  data, model = policy.data, policy.config.model
  recorded = {key[len(IMAGE_PREFIX):]: tuple(feature["shape"][:2]) for key, feature in features.items()
              if key.startswith(IMAGE_PREFIX) and feature.get("dtype") in ("video", "image")}
  if data.get("cameras"):
    names = [name[len(IMAGE_PREFIX):] if name.startswith(IMAGE_PREFIX) else name for name in data.cameras]
  elif data.get("name") == "sim_demos":
    from ejax.sim.env import CAMERA_NAMES  # not sim.demos: the dataset writer there needs PyAV
    names = list(CAMERA_NAMES)
  else:
    names = sorted(recorded)
  if len(names) != int(model.get("num_cameras", len(names))):
    raise UserError(f"the checkpoint's model reads {model.num_cameras} cameras but its data config names "
                    f"{names}: set data.cameras when training")
  image_size = data.get("image_size")
  if not image_size and model.get("vision"):
    image_size = [model.vision.image_size] * 2
  default = policy.camera_size or (tuple(image_size) if image_size else None)
  cameras = []
  for name in names:
    size = recorded.get(name) or default
    if size is None:
      raise UserError(f"cannot tell the image size of camera {name!r}: set data.image_size when training")
    cameras.append((name, tuple(int(s) for s in size)))
  return cameras
