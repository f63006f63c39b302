"""Writers of LeRobot datasets: v3.0 (many episodes per parquet / mp4 file) and v2.1 (one per file).

Used by the simulation issue to save demonstrations and by tests to build small real-format data:

  writer = LeRobotV3Writer(root, fps=10, robot_type="arm", features={
      "observation.images.agentview": {"dtype": "video", "shape": [224, 224, 3]},
      "observation.state": {"dtype": "float32", "shape": [8], "names": [...]},
      "action": {"dtype": "float32", "shape": [7]}})
  writer.add_episode({"observation.images.agentview": uint8 [T, 224, 224, 3],
                      "observation.state": [T, 8], "action": [T, 7]}, task="stack the blocks")
  writer.finalize()

Video frames are encoded as they arrive (h264 or AV1, a keyframe every 2 frames like LeRobot; h264
tuned for fast decoding unless video_tune=None), so memory holds one data file's rows, not the
episodes' images.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ejax.data import lerobot_format as fmt
from ejax.data import stats_math
from ejax.data.video import DEFAULT_GOP_SIZE, VideoEncoder, pixel_format


class _LeRobotWriter:
  """What both versions share: feature checks, tasks, per-episode statistics, info.json."""

  version = ""

  def __init__(self, root: str, *, fps: int, features: Mapping[str, Mapping[str, Any]],
               robot_type: str, video_codec: str = "h264", gop_size: int = DEFAULT_GOP_SIZE,
               video_tune: str | None = "default", video_lossless: bool = False):
    if os.path.exists(os.path.join(root, "meta", "info.json")):
      raise FileExistsError(f"{root} already holds a LeRobot dataset: write to a new directory")
    self.root, self.fps, self.robot_type = root, int(fps), robot_type
    self.video_codec, self.gop_size, self.video_tune = video_codec, gop_size, video_tune
    self.video_lossless = bool(video_lossless)
    self.features: dict[str, dict[str, Any]] = {}
    for key, feature in features.items():
      feature = copy.deepcopy(dict(feature))
      if key in fmt.INDEX_FEATURES:
        raise ValueError(f"feature {key!r} is written by the writer itself: remove it")
      if feature["dtype"] not in fmt.NUMERIC_DTYPES + ("video", "image"):
        raise ValueError(f"feature {key!r}: dtype {feature['dtype']!r} is not supported; use "
                         f"'video', 'image' (PNG in parquet) or one of {fmt.NUMERIC_DTYPES}")
      feature["shape"] = [int(x) for x in feature["shape"]]
      feature.setdefault("names", None)
      if fmt.is_visual(feature):
        height, width, channels = feature["shape"]
        if channels != 3:
          raise ValueError(f"{feature['dtype']} feature {key!r} must be [H, W, 3], got "
                           f"{feature['shape']}")
        feature["names"] = feature["names"] or ["height", "width", "channels"]
      if feature["dtype"] == "video":
        feature["info"] = {
            "video.height": height, "video.width": width, "video.codec": video_codec,
            "video.pix_fmt": pixel_format(self.video_lossless), "video.is_depth_map": False, "video.fps": self.fps,
            "video.channels": 3, "has_audio": False}
      self.features[key] = feature
    self.features.update(copy.deepcopy(fmt.INDEX_FEATURES))
    self.video_keys = [k for k, f in self.features.items() if f["dtype"] == "video"]
    self.image_keys = [k for k, f in self.features.items() if f["dtype"] == "image"]
    self.tasks: dict[str, int] = {}
    self.episode_stats: list[dict[str, dict[str, np.ndarray]]] = []
    self.total_frames = 0
    self.num_episodes = 0
    self._finalized = False

  def _check_episode(self, frames: Mapping[str, np.ndarray]) -> int:
    user_keys = [k for k in self.features if k not in fmt.INDEX_FEATURES]
    missing = sorted(set(user_keys) - set(frames))
    unknown = sorted(set(frames) - set(user_keys))
    if missing or unknown:
      raise ValueError(f"episode {self.num_episodes}: missing features {missing}, unknown "
                       f"features {unknown}; declare every key in `features` and pass all of them")
    lengths = {key: len(frames[key]) for key in user_keys}
    if len(set(lengths.values())) != 1 or min(lengths.values()) == 0:
      raise ValueError(f"episode {self.num_episodes}: features must share one non-zero time "
                       f"length, got {lengths}")
    for key in user_keys:
      expected = tuple(self.features[key]["shape"])
      got = np.shape(frames[key])[1:]
      if self.features[key]["shape"] == [1] and got == ():
        continue
      if got != expected:
        raise ValueError(f"episode {self.num_episodes}: feature {key!r} has per-frame shape "
                         f"{list(got)}, declared {list(expected)}")
    return next(iter(lengths.values()))

  def _frame_columns(self, frames: Mapping[str, np.ndarray], length: int, task: str,
                     ) -> dict[str, np.ndarray]:
    """All non-video columns of one episode (images as uint8 arrays), index columns included."""
    task_index = self.tasks.setdefault(task, len(self.tasks))
    frame_index = np.arange(length, dtype=np.int64)
    columns = {key: np.asarray(value, np.uint8 if key in self.image_keys else
                               self.features[key]["dtype"])
               for key, value in frames.items() if self.features[key]["dtype"] != "video"}
    columns["timestamp"] = (frame_index / self.fps).astype(np.float32)
    columns["frame_index"] = frame_index
    columns["episode_index"] = np.full(length, self.num_episodes, np.int64)
    columns["index"] = self.total_frames + frame_index
    columns["task_index"] = np.full(length, task_index, np.int64)
    return columns

  def _stats(self, frames, columns) -> dict[str, dict[str, np.ndarray]]:
    stats = {key: stats_math.vector_stats(value) for key, value in columns.items()
             if key not in self.image_keys}
    for key in self.video_keys + self.image_keys:
      stats[key] = stats_math.image_stats(frames[key])
    return stats

  def _table(self, columns: Mapping[str, np.ndarray]) -> pa.Table:
    return pa.table({key: fmt.arrow_column(value, self.features[key])
                     for key, value in columns.items()})

  def _info(self, **layout) -> dict[str, Any]:
    return {
        "codebase_version": self.version, "robot_type": self.robot_type,
        "total_episodes": self.num_episodes, "total_frames": self.total_frames,
        "total_tasks": len(self.tasks), "chunks_size": fmt.CHUNKS_SIZE, "fps": self.fps,
        "splits": {"train": f"0:{self.num_episodes}"}, **layout, "features": self.features,
    }

  def _dataset_stats(self) -> dict[str, dict[str, np.ndarray]]:
    return {key: stats_math.merge_stats([s[key] for s in self.episode_stats])
            for key in self.episode_stats[0]}

  def _check_open(self) -> None:
    if self._finalized:
      raise RuntimeError(f"{self.root}: the writer is finalized; make a new one to add episodes")


class LeRobotV3Writer(_LeRobotWriter):
  """LeRobot v3.0: episodes appended to shared data/... parquet and videos/... mp4 files."""

  version = fmt.V30

  def __init__(self, root: str, *, fps: int, features, robot_type: str,
               video_codec: str = "h264", gop_size: int = DEFAULT_GOP_SIZE,
               video_tune: str | None = "default", video_lossless: bool = False,
               data_files_size_in_mb: float = 100, video_files_size_in_mb: float = 200):
    super().__init__(root, fps=fps, features=features, robot_type=robot_type, video_codec=video_codec,
                     gop_size=gop_size, video_tune=video_tune, video_lossless=video_lossless)
    self.data_files_size_in_mb = data_files_size_in_mb
    self.video_files_size_in_mb = video_files_size_in_mb
    self._data_file_number = 0
    self._pending_tables: list[pa.Table] = []
    self._video_file_number = {key: 0 for key in self.video_keys}
    self._encoders: dict[str, VideoEncoder] = {}
    self._episodes: list[dict[str, Any]] = []

  def _encoder(self, key: str) -> VideoEncoder:
    encoder = self._encoders.get(key)
    if encoder is not None and encoder.bytes_written > self.video_files_size_in_mb * 2 ** 20:
      encoder.close()
      self._video_file_number[key] += 1
      encoder = None
    if encoder is None:
      chunk, file = fmt.chunk_and_file(self._video_file_number[key], fmt.CHUNKS_SIZE)
      path = os.path.join(self.root, fmt.V30_VIDEO_PATH.format(
          video_key=key, chunk_index=chunk, file_index=file))
      height, width, _ = self.features[key]["shape"]
      encoder = VideoEncoder(path, fps=self.fps, height=height, width=width,
                             codec=self.video_codec, gop_size=self.gop_size, tune=self.video_tune,
                             lossless=self.video_lossless)
      self._encoders[key] = encoder
    return encoder

  def add_episode(self, frames: Mapping[str, np.ndarray], task: str) -> int:
    """Appends one episode (every feature with a leading time axis); returns its index."""
    self._check_open()
    length = self._check_episode(frames)
    columns = self._frame_columns(frames, length, task)
    chunk, file = fmt.chunk_and_file(self._data_file_number, fmt.CHUNKS_SIZE)
    episode: dict[str, Any] = {
        "episode_index": self.num_episodes, "tasks": [task], "length": length,
        "data/chunk_index": chunk, "data/file_index": file,
        "dataset_from_index": self.total_frames, "dataset_to_index": self.total_frames + length,
    }
    for key in self.video_keys:
      encoder = self._encoder(key)
      chunk, file = fmt.chunk_and_file(self._video_file_number[key], fmt.CHUNKS_SIZE)
      start = encoder.num_frames / self.fps
      encoder.write(np.asarray(frames[key]))
      episode.update({f"videos/{key}/chunk_index": chunk, f"videos/{key}/file_index": file,
                      f"videos/{key}/from_timestamp": start,
                      f"videos/{key}/to_timestamp": encoder.num_frames / self.fps})
    stats = self._stats(frames, columns)
    for key, feature_stats in stats.items():
      for name, value in feature_stats.items():
        episode[f"stats/{key}/{name}"] = np.asarray(value).tolist()
    episode["meta/episodes/chunk_index"], episode["meta/episodes/file_index"] = 0, 0
    self._episodes.append(episode)
    self.episode_stats.append(stats)
    self._pending_tables.append(self._table(columns))
    self.total_frames += length
    self.num_episodes += 1
    if sum(t.nbytes for t in self._pending_tables) > self.data_files_size_in_mb * 2 ** 20:
      self._flush_data_file()
    return self.num_episodes - 1

  def _flush_data_file(self) -> None:
    if not self._pending_tables:
      return
    chunk, file = fmt.chunk_and_file(self._data_file_number, fmt.CHUNKS_SIZE)
    path = os.path.join(self.root, fmt.V30_DATA_PATH.format(chunk_index=chunk, file_index=file))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.concat_tables(self._pending_tables), path)
    self._pending_tables = []
    self._data_file_number += 1

  def finalize(self) -> str:
    """Closes the files and writes meta/; returns the dataset root."""
    self._check_open()
    if not self.num_episodes:
      raise ValueError(f"{self.root}: no episodes were added; nothing to finalize")
    self._flush_data_file()
    for encoder in self._encoders.values():
      encoder.close()
    meta = os.path.join(self.root, "meta")
    episodes_path = os.path.join(self.root, fmt.V30_EPISODES_PATH.format(chunk_index=0,
                                                                         file_index=0))
    os.makedirs(os.path.dirname(episodes_path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(self._episodes), episodes_path)
    tasks = sorted(self.tasks.items(), key=lambda item: item[1])
    pq.write_table(pa.table({"task_index": [i for _, i in tasks], "task": [t for t, _ in tasks]}),
                   os.path.join(meta, "tasks.parquet"))
    fmt.write_json(os.path.join(meta, "stats.json"), fmt.stats_to_json(self._dataset_stats()))
    fmt.write_json(os.path.join(meta, "info.json"), self._info(
        data_files_size_in_mb=self.data_files_size_in_mb,
        video_files_size_in_mb=self.video_files_size_in_mb,
        data_path=fmt.V30_DATA_PATH, video_path=fmt.V30_VIDEO_PATH if self.video_keys else None))
    self._finalized = True
    return self.root


class LeRobotV21Writer(_LeRobotWriter):
  """LeRobot v2.1: one parquet and one mp4 per camera for every episode, jsonl metadata."""

  version = fmt.V21

  def __init__(self, root: str, *, fps: int, features, robot_type: str,
               video_codec: str = "h264", gop_size: int = DEFAULT_GOP_SIZE,
               video_tune: str | None = "default", video_lossless: bool = False):
    super().__init__(root, fps=fps, features=features, robot_type=robot_type, video_codec=video_codec,
                     gop_size=gop_size, video_tune=video_tune, video_lossless=video_lossless)
    self._episodes: list[dict[str, Any]] = []

  def add_episode(self, frames: Mapping[str, np.ndarray], task: str) -> int:
    self._check_open()
    length = self._check_episode(frames)
    columns = self._frame_columns(frames, length, task)
    episode_index, chunk = self.num_episodes, self.num_episodes // fmt.CHUNKS_SIZE
    data_path = os.path.join(self.root, fmt.V21_DATA_PATH.format(
        episode_chunk=chunk, episode_index=episode_index))
    os.makedirs(os.path.dirname(data_path), exist_ok=True)
    pq.write_table(self._table(columns), data_path)
    for key in self.video_keys:
      height, width, _ = self.features[key]["shape"]
      encoder = VideoEncoder(os.path.join(self.root, fmt.V21_VIDEO_PATH.format(
          episode_chunk=chunk, video_key=key, episode_index=episode_index)),
          fps=self.fps, height=height, width=width, codec=self.video_codec,
          gop_size=self.gop_size, tune=self.video_tune, lossless=self.video_lossless)
      encoder.write(np.asarray(frames[key]))
      encoder.close()
    self.episode_stats.append(self._stats(frames, columns))
    self._episodes.append({"episode_index": episode_index, "tasks": [task], "length": length})
    self.total_frames += length
    self.num_episodes += 1
    return episode_index

  def finalize(self) -> str:
    self._check_open()
    if not self.num_episodes:
      raise ValueError(f"{self.root}: no episodes were added; nothing to finalize")
    meta = os.path.join(self.root, "meta")
    fmt.write_jsonl(os.path.join(meta, "episodes.jsonl"), self._episodes)
    fmt.write_jsonl(os.path.join(meta, "episodes_stats.jsonl"), [
        {"episode_index": i, "stats": fmt.stats_to_json(s)}
        for i, s in enumerate(self.episode_stats)])
    fmt.write_jsonl(os.path.join(meta, "tasks.jsonl"), [
        {"task_index": i, "task": t} for t, i in sorted(self.tasks.items(), key=lambda x: x[1])])
    fmt.write_json(os.path.join(meta, "stats.json"), fmt.stats_to_json(self._dataset_stats()))
    fmt.write_json(os.path.join(meta, "info.json"), self._info(
        total_chunks=(self.num_episodes - 1) // fmt.CHUNKS_SIZE + 1,
        total_videos=self.num_episodes * len(self.video_keys),
        data_path=fmt.V21_DATA_PATH, video_path=fmt.V21_VIDEO_PATH if self.video_keys else None))
    self._finalized = True
    return self.root
