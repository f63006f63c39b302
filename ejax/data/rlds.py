"""RLDS / Open-X-Embodiment datasets (TFDS, array_record) as step-level sample sources.

An RLDS record is an episode whose "steps" hold observation / action / language_instruction per
step. `tfds.data_source` reads array_record files with random access and no TensorFlow. Images
stay encoded (SkipDecoding) until a sample needs them, so building the step index and computing
statistics never decodes an image, and a sample decodes only its own frames.

Samples follow the LeRobot source's schema ("observation.state", "observation.images.<cam>",
"action" [horizon, action_dim], "action_is_pad", "task", "embodiment_id", "episode_index",
"frame_index", "index").
"""

from __future__ import annotations

import io
import threading
from typing import Any, Sequence

import numpy as np
from PIL import Image

from ejax.data.errors import DataError
from ejax.data.source import DEFAULT_SKIP_LIMIT, SampleSource


def _image_keys(observation_features) -> list[str]:
  import tensorflow_datasets as tfds
  return [key for key, feature in observation_features.items()
          if isinstance(feature, tfds.features.Image)]


class RldsSource(SampleSource):
  """Random access to the steps of every episode of one TFDS RLDS dataset split."""

  state_key = "observation.state"
  action_key = "action"

  def __init__(self, data_dir: str, name: str, *, split: str = "train", horizon: int = 16,
               cameras: Sequence[str] | None = None, image_size: tuple[int, int] | None = None,
               embodiment_id: int = 0, on_bad_sample: str = "error", skip_limit: int = DEFAULT_SKIP_LIMIT,
               state_field: str = "state", instruction_field: str = "language_instruction"):
    import tensorflow_datasets as tfds
    self._set_bad_sample_policy(on_bad_sample, skip_limit)
    self.data_dir, self.name, self.split = data_dir, name, split
    try:
      builder = tfds.builder(name, data_dir=data_dir)
    except Exception as error:  # TFDS raises several types for "not found / not prepared"
      raise DataError(f"cannot open TFDS dataset {name!r} ({error}): prepare it under data.path "
                      "first", path=data_dir) from error
    steps = builder.info.features["steps"]
    observation = steps["observation"]
    self.all_cameras = _image_keys(observation)
    if cameras is None:
      cameras = self.all_cameras
    for camera in cameras:
      if camera not in self.all_cameras:
        raise DataError(f"camera {camera!r} is not an Image in the dataset's observation "
                        f"(images: {self.all_cameras}); fix data.cameras", path=data_dir)
    if state_field not in observation:
      raise DataError(f"observation has no {state_field!r} (has {list(observation)})",
                      path=data_dir)
    self.cameras = [f"observation.images.{camera}" for camera in cameras]
    self._camera_fields = list(cameras)
    self.state_field, self.instruction_field = state_field, instruction_field
    if not isinstance(embodiment_id, int):
      raise ValueError(f"data.embodiment_id must be an int for RLDS, got {embodiment_id!r}")
    self.horizon, self.embodiment_id = int(horizon), int(embodiment_id)
    self.image_size = tuple(image_size) if image_size else None
    self._source = None
    self._lock = threading.Lock()
    lengths = np.asarray([len(self._episode(e)["steps"]) for e in range(len(self._data()))],
                         np.int64)
    self.episode_to = np.cumsum(lengths)
    self.episode_from = self.episode_to - lengths

  def _data(self):
    if self._source is None:
      import tensorflow_datasets as tfds
      # Images stay encoded: a sample decodes only the frames it uses.
      skip = {camera: tfds.decode.SkipDecoding() for camera in self.all_cameras}
      self._source = tfds.data_source(self.name, data_dir=self.data_dir, split=self.split,
                                      decoders={"steps": {"observation": skip}})
    return self._source

  def _episode(self, episode: int) -> dict[str, Any]:
    try:
      return self._data()[episode]
    except Exception as error:  # array_record / proto errors on a corrupt shard
      raise DataError(f"cannot read RLDS episode ({error}): the array_record shard is corrupt",
                      path=f"{self.data_dir}/{self.name}", episode_index=episode) from error

  def __getstate__(self) -> dict[str, Any]:
    state = dict(self.__dict__)
    state["_source"] = None
    state.pop("_lock")
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return int(self.episode_to[-1]) if len(self.episode_to) else 0

  def columns(self) -> dict[str, np.ndarray]:
    """State and action of every step, in global step order (for normalisation statistics)."""
    states, actions = [], []
    for episode in range(len(self.episode_to)):
      steps = self._episode(episode)["steps"]
      for step in steps:
        states.append(np.asarray(step["observation"][self.state_field], np.float32))
        actions.append(np.asarray(step["action"], np.float32))
    return {self.state_key: np.stack(states), self.action_key: np.stack(actions)}

  def _sample(self, index: int) -> dict[str, Any]:
    episode = int(np.searchsorted(self.episode_from, index, side="right") - 1)
    frame = index - int(self.episode_from[episode])
    steps = self._episode(episode)["steps"]
    length = len(steps)
    rows = frame + np.arange(self.horizon)
    action_rows = np.minimum(rows, length - 1)
    step = steps[frame]
    instruction = step[self.instruction_field]
    sample: dict[str, Any] = {
        self.state_key: np.asarray(step["observation"][self.state_field], np.float32),
        "action": np.stack([np.asarray(steps[int(r)]["action"], np.float32)
                            for r in action_rows]),
        "action_is_pad": rows >= length,
        "task": instruction.decode() if isinstance(instruction, bytes) else str(instruction),
        "embodiment_id": np.int32(self.embodiment_id),
        "episode_index": np.int64(episode),
        "frame_index": np.int64(frame),
        "index": np.int64(index),
    }
    for key, field in zip(self.cameras, self._camera_fields):
      sample[key] = self._decode_image(step["observation"][field], episode)
    return sample

  def _decode_image(self, encoded: bytes, episode: int) -> np.ndarray:
    try:
      image = Image.open(io.BytesIO(encoded)).convert("RGB")
    except Exception as error:  # PIL raises many types for bad bytes
      raise DataError(f"cannot decode an image ({error})", path=f"{self.data_dir}/{self.name}",
                      episode_index=episode) from error
    if self.image_size is not None and image.size != (self.image_size[1], self.image_size[0]):
      image = image.resize((self.image_size[1], self.image_size[0]), Image.BILINEAR)
    return np.asarray(image)
