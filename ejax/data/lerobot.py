"""LeRobot (v2.1 / v3.0) datasets as random-access sources of training samples, one per step.

`LeRobotSource(root, horizon=16)[i]` is the sample at global frame i, across all episodes:

  "observation.state"          [state_dim] float32   ([n_obs, state_dim] with several offsets)
  "observation.images.<cam>"   uint8 [H, W, 3]       ([n_obs, H, W, 3] with several offsets)
  "action"                     [horizon, action_dim] float32: frames i .. i+horizon-1
  "action_is_pad"              [horizon] bool: True where the chunk ran past the episode's end
  "<key>_is_pad"               [n_obs] bool, for observations when there are several offsets
  "state.<part>", "action.<part>"  slices named by meta/modality.json (GR00T), when present
  "task" str, "embodiment_id", "episode_index", "frame_index", "index", "timestamp"

Offsets that leave the episode are clamped to its first / last frame and flagged in the pad mask,
as LeRobot does. Parquet columns load once per worker process; mp4 containers stay open in a
per-worker `VideoReaderCache`; both are dropped when the source is pickled to a grain worker.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from ejax.data import lerobot_format as fmt
from ejax.data.errors import DataError
from ejax.data.source import DEFAULT_SKIP_LIMIT, SampleSource
from ejax.data.lerobot_meta import LeRobotMeta, read_meta, read_parquet, read_parquet_footer
from ejax.data.lerobot_writer import LeRobotV21Writer, LeRobotV3Writer  # noqa: F401 (re-export)
from ejax.data.video import VideoReaderCache

DEFAULT_TOLERANCE_S = 1e-4  # LeRobot's default: frames must sit on the requested timestamp


class LeRobotSource(SampleSource):
  """Random access to step-level samples of one LeRobot dataset (see the module docstring)."""

  unit = "frame"

  def __init__(self, root: str, *, horizon: int = 16, observation_offsets: Sequence[int] = (0,),
               cameras: Sequence[str] | None = None, image_size: tuple[int, int] | None = None,
               state_key: str = "observation.state", action_key: str = "action",
               aux_keys: Sequence[str] = (), raw_keys: Sequence[str] = (), embodiment_id: int | Mapping[str, int] = 0, tolerance_s: float = DEFAULT_TOLERANCE_S,
               on_bad_sample: str = "error", skip_limit: int = DEFAULT_SKIP_LIMIT, max_open_videos: int = 32):
    self._set_bad_sample_policy(on_bad_sample, skip_limit)
    self.meta: LeRobotMeta = read_meta(root)
    self.horizon = int(horizon)
    self.embodiment_id = self._resolve_embodiment(embodiment_id)
    self.observation_offsets = np.asarray(observation_offsets, np.int64)
    self.image_size = tuple(image_size) if image_size else None
    self.state_key, self.action_key = state_key, action_key
    self.aux_keys = tuple(aux_keys)  # per-frame vectors passed through as they are (e.g. training targets)
    self.raw_keys = tuple(raw_keys)  # the same, but left out of the normalised columns (e.g. pixel labels)
    if set(self.aux_keys) & {state_key, action_key}:
      raise DataError(f"data.aux_state_key={self.aux_keys[0]!r} is the state or action key: name another feature",
                      path=root)
    self.tolerance_s = tolerance_s
    self.max_open_videos = max_open_videos
    self.cameras = self._resolve_cameras(cameras)
    info_path = f"{self.meta.root}/meta/info.json"
    for key in (state_key, action_key, *self.aux_keys, *self.raw_keys):
      if key not in self.meta.features:
        setting = ("data.aux_state_key" if key in self.aux_keys else "data.aux_pixel_key" if key in self.raw_keys
                   else "data.state_key / data.action_key")
        raise DataError(f"feature {key!r} is not declared in info.json (features: "
                        f"{sorted(self.meta.features)}); set {setting}", path=info_path)
    self._check_data_files()
    self.state_dim = int(np.prod(self.meta.features[state_key]["shape"]))
    self.action_dim = int(np.prod(self.meta.features[action_key]["shape"]))
    self._columns: dict[str, np.ndarray] | None = None
    self._nonfinite: dict[int, str] = {}  # frame -> feature with NaN / inf there (set with the columns)
    self._lock = threading.Lock()
    # grain reads with several threads; a PyAV container must never be used by two at once.
    self._thread_local = threading.local()

  def _resolve_embodiment(self, embodiment_id: int | Mapping[str, int]) -> int:
    """An int, or a table robot_type -> id (so a mixture config names each robot once)."""
    if not hasattr(embodiment_id, "items"):  # a dict or an ml_collections ConfigDict
      return int(embodiment_id)
    table = dict(embodiment_id.items())
    robot_type = self.meta.info.get("robot_type")
    if robot_type not in table:
      raise DataError(f"robot_type {robot_type!r} has no entry in data.embodiment_id {table}: "
                      "add one", path=f"{self.meta.root}/meta/info.json")
    return int(table[robot_type])

  def _resolve_cameras(self, cameras: Sequence[str] | None) -> list[str]:
    visual = self.meta.video_keys + self.meta.image_keys
    if cameras is None:
      return list(visual)
    resolved = []
    for camera in cameras:
      key = camera if camera in self.meta.features else f"observation.images.{camera}"
      if key not in visual:
        raise DataError(f"camera {camera!r} is not a video or image feature in info.json "
                        f"(cameras: {visual}); fix data.cameras",
                        path=f"{self.meta.root}/meta/info.json")
      resolved.append(key)
    return resolved

  def __len__(self) -> int:
    return self.meta.total_frames

  def __getstate__(self) -> dict[str, Any]:
    # Open containers cannot be pickled and columns are cheaper to reload than to send.
    state = dict(self.__dict__)
    for name in ("_columns", "_lock", "_thread_local", "_all_caches"):
      state.pop(name, None)
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._columns, self._lock, self._thread_local = None, threading.Lock(), threading.local()

  def columns(self) -> dict[str, np.ndarray]:
    """Every non-video column of every data file, in global frame order (loaded once)."""
    if self._columns is None:
      with self._lock:
        if self._columns is None:
          self._columns = self._load_columns()
    return self._columns

  def _wanted_columns(self) -> list[str]:
    return [self.state_key, self.action_key, *self.aux_keys, *self.raw_keys, "timestamp", "frame_index", "episode_index",
            "index", "task_index"] + [k for k in self.cameras if k in self.meta.image_keys]

  def _check_data_files(self) -> None:
    """At open, from the parquet footers alone: every data file exists, holds the columns this
    reader needs and exactly the frames the episode index gives it."""
    wanted = self._wanted_columns()
    episodes = self.meta.episodes
    owners: dict[str, list[int]] = {}
    frames: dict[str, int] = {}
    for episode, path, length in zip(episodes.episode_index, episodes.data_path, episodes.length):
      owners.setdefault(path, []).append(int(episode))
      frames[path] = frames.get(path, 0) + int(length)

    def check(path: str) -> None:
      first = owners[path][0]
      schema, rows = read_parquet_footer(path, episode_index=first)
      missing = [key for key in wanted if key not in schema.names]
      if missing:
        also = f" (and {', '.join(map(repr, missing[1:]))})" if len(missing) > 1 else ""
        raise DataError(f"column {missing[0]!r}{also}, which info.json declares, is not in this data file",
                        path=path, episode_index=first)
      if rows != frames[path]:
        named = (f"episode {first}" if len(owners[path]) == 1 else f"episodes {first}..{owners[path][-1]}")
        raise DataError(f"the data file holds {rows} frames but the episode index gives it {frames[path]} "
                        f"({named}): the file and meta/ disagree", path=path, episode_index=first)

    with concurrent.futures.ThreadPoolExecutor(min(8, max(1, len(self.meta.data_files)))) as pool:
      list(pool.map(check, self.meta.data_files))

  def _load_columns(self) -> dict[str, np.ndarray]:
    wanted = self._wanted_columns()
    episodes = self.meta.episodes

    def read(path: str) -> dict[str, np.ndarray]:
      owners = [int(e) for e, p in zip(episodes.episode_index, episodes.data_path) if p == path]
      try:
        table = read_parquet(path, columns=wanted)
      except DataError as error:
        message = str(error).rsplit(" (file ", 1)[0]
        raise DataError(message, path=path, episode_index=owners[0]) from error
      missing = [key for key in wanted if key not in table.column_names]
      if missing:
        raise DataError(f"parquet lacks columns {missing} declared in info.json",
                        path=path, episode_index=owners[0])
      return {key: fmt.numpy_column(table.column(key), self.meta.features[key]["shape"])
              for key in wanted}

    # Files in parallel: pyarrow decodes with the GIL released.
    with concurrent.futures.ThreadPoolExecutor(min(8, len(self.meta.data_files))) as pool:
      parts = list(pool.map(read, self.meta.data_files))
    columns = {key: np.concatenate([part[key] for part in parts]) for key in wanted}
    index = columns["index"]
    order = np.argsort(index, kind="stable")
    columns = {key: value[order] for key, value in columns.items()}
    if len(index) != len(self) or np.any(columns["index"] != np.arange(len(self))):
      raise DataError(f"data files hold {len(index)} frames with indices that do not run "
                      f"0..{len(self) - 1} as the episode index says: the data is truncated",
                      path=self.meta.root)
    # Every frame belongs to the episode the index says, at the position it says.
    positions = np.repeat(np.arange(len(episodes.length)), episodes.length)
    expected_episode = episodes.episode_index[positions]
    expected_frame = np.arange(len(self)) - episodes.dataset_from[positions]
    wrong = np.nonzero((columns["episode_index"].reshape(-1) != expected_episode) |
                       (columns["frame_index"].reshape(-1) != expected_frame))[0]
    if len(wrong):
      frame = int(wrong[0])
      raise DataError(f"frame {frame} is frame {int(columns['frame_index'][frame])} of episode "
                      f"{int(columns['episode_index'][frame])} in its data file, but the episode index makes it frame "
                      f"{int(expected_frame[frame])} of episode {int(expected_episode[frame])} "
                      f"({len(wrong)} such frames)",
                      path=episodes.data_path[positions[frame]], episode_index=int(expected_episode[frame]))
    self._nonfinite = self._nonfinite_frames(columns)
    return columns

  def _nonfinite_frames(self, columns: dict[str, np.ndarray]) -> dict[int, str]:
    """frame -> the first numeric feature holding NaN or inf there. Under on_bad_sample="error"
    one such frame stops the run at once (it would turn the loss and the norm stats into NaN);
    under "skip" the samples that read it are skipped."""
    bad: dict[int, str] = {}
    for key in (self.state_key, self.action_key, *self.aux_keys, *self.raw_keys):
      values = columns[key]
      if not np.issubdtype(values.dtype, np.floating):
        continue
      for frame in np.nonzero(~np.isfinite(values.reshape(len(values), -1)).all(axis=1))[0]:
        bad.setdefault(int(frame), key)
    if bad and self.on_bad_sample == "error":
      frame = min(bad)
      raise DataError(f"{bad[frame]!r} holds NaN or inf at frame {frame} ({len(bad)} such frames): fix the "
                      "dataset, or set data.on_bad_sample=skip to skip the samples that read them",
                      path=self.meta.episodes.data_path[self.episode_of(frame)],
                      episode_index=int(self.meta.episodes.episode_index[self.episode_of(frame)]))
    return bad

  def describe(self, index: int) -> str:
    position = self.episode_of(index)
    episode = int(self.meta.episodes.episode_index[position])
    return f"frame {index} (episode {episode}, file {self.meta.episodes.data_path[position]})"

  def episode_of(self, index: int) -> int:
    """Position (into meta.episodes) of the episode holding global frame `index`."""
    return int(np.searchsorted(self.meta.episodes.dataset_from, index, side="right") - 1)

  def _sample(self, index: int) -> dict[str, Any]:
    columns = self.columns()
    episodes = self.meta.episodes
    position = self.episode_of(index)
    start, stop = int(episodes.dataset_from[position]), int(episodes.dataset_to[position])
    episode_index = int(episodes.episode_index[position])

    def clamp(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
      rows = index + offsets
      return np.clip(rows, start, stop - 1), (rows < start) | (rows >= stop)

    obs_rows, obs_pad = clamp(self.observation_offsets)
    action_rows, action_pad = clamp(np.arange(self.horizon))
    for row in (*obs_rows, *action_rows) if self._nonfinite else ():
      if int(row) in self._nonfinite:
        raise DataError(f"{self._nonfinite[int(row)]!r} holds NaN or inf at frame {int(row)}",
                        path=episodes.data_path[position], episode_index=episode_index)
    single = len(self.observation_offsets) == 1 and self.observation_offsets[0] == 0
    state = columns[self.state_key][obs_rows].astype(np.float32).reshape(len(obs_rows), -1)
    sample: dict[str, Any] = {
        self.state_key: state[0] if single else state,
        "action": columns[self.action_key][action_rows].astype(np.float32).reshape(
            self.horizon, -1),
        "action_is_pad": action_pad,
        "task": self.meta.tasks[int(columns["task_index"][index])],
        "embodiment_id": np.int32(self.embodiment_id),
        "episode_index": np.int64(episode_index),
        "frame_index": np.int64(columns["frame_index"][index]),
        "index": np.int64(index),
        "timestamp": np.float32(columns["timestamp"][index]),
    }
    for key in (*self.aux_keys, *self.raw_keys):
      sample[key] = columns[key][index].astype(np.float32).reshape(-1)
    if not single:
      sample[f"{self.state_key}_is_pad"] = obs_pad
    for key in self.cameras:
      if key in self.meta.image_keys:
        frames = np.stack([self._decode_image(columns[key][row], key, episode_index)
                           for row in obs_rows])
      else:
        times = episodes.video_from_timestamp[key][position] + columns["timestamp"][obs_rows]
        frames = self._video_cache().read(
            episodes.video_path[key][position], times, tolerance_s=self.tolerance_s,
            size=self.image_size, episode_index=episode_index)
      sample[key] = frames[0] if single else frames
      if not single:
        sample[f"{key}_is_pad"] = obs_pad
    return self.add_modality_slices(sample)

  def _decode_image(self, encoded: bytes, key: str, episode_index: int) -> np.ndarray:
    """An "image" feature's PNG / JPEG cell as uint8 [H, W, 3], resized to image_size if set."""
    try:
      image = fmt.decode_image(encoded)
    except Exception as error:  # PIL raises many types for bad bytes
      raise DataError(f"cannot decode image {key!r} ({error})", path=self.meta.root,
                      episode_index=episode_index) from error
    if self.image_size is not None and image.shape[:2] != self.image_size:
      from ejax.data.transforms import resize
      image = resize(image, self.image_size)
    return image

  def add_modality_slices(self, sample: dict[str, Any]) -> dict[str, Any]:
    """GR00T's meta/modality.json names slices of the state and action vectors.

    The pipeline calls this again after normalising, so the slices match the normalised vectors.
    """
    if not self.meta.modality:
      return sample
    for group, key in (("state", self.state_key), ("action", "action")):
      for name, bounds in self.meta.modality.get(group, {}).items():
        sample[f"{group}.{name}"] = sample[key][..., int(bounds["start"]):int(bounds["end"])]
    return sample

  def _video_cache(self) -> VideoReaderCache:
    cache = getattr(self._thread_local, "videos", None)
    if cache is None:
      cache = self._thread_local.videos = VideoReaderCache(self.max_open_videos)
      with self._lock:
        self._all_caches = getattr(self, "_all_caches", []) + [cache]
    return cache

  def close(self) -> None:
    """Closes every open mp4 of every thread of this process."""
    with self._lock:
      caches, self._all_caches = getattr(self, "_all_caches", []), []
    for cache in caches:
      cache.close()
