"""Reading a LeRobot dataset's metadata (v2.1 or v3.0) into one version-independent description.

Everything per episode that the sample reader needs is gathered here once: where its rows sit in
the global frame index, which parquet file holds them, and for each camera which mp4 holds its
frames and at what time the episode starts in that file.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ejax.data import lerobot_format as fmt
from ejax.data.errors import DataError


@dataclasses.dataclass
class EpisodeTable:
  """Per-episode arrays sorted by episode index; `dataset_from` / `dataset_to` bound global rows."""
  episode_index: np.ndarray  # [E] int64
  length: np.ndarray  # [E] int64
  dataset_from: np.ndarray  # [E] int64
  dataset_to: np.ndarray  # [E] int64
  data_path: list[str]  # [E] absolute parquet path
  video_path: dict[str, list[str]]  # camera key -> [E] absolute mp4 path
  video_from_timestamp: dict[str, np.ndarray]  # camera key -> [E] float64 seconds in the mp4
  tasks: list[list[str]]


@dataclasses.dataclass
class LeRobotMeta:
  root: str
  version: str  # "v2.1" or "v3.0"
  info: dict[str, Any]
  fps: int
  features: dict[str, dict[str, Any]]
  video_keys: list[str]
  image_keys: list[str]  # "image" features: PNG / JPEG bytes in the parquet files
  tasks: dict[int, str]  # task_index -> task
  episodes: EpisodeTable
  stats: dict[str, dict[str, np.ndarray]]
  modality: dict[str, Any] | None  # GR00T meta/modality.json

  @property
  def data_files(self) -> list[str]:
    return list(dict.fromkeys(self.episodes.data_path))

  @property
  def total_frames(self) -> int:
    return int(self.episodes.dataset_to[-1]) if len(self.episodes.dataset_to) else 0


def _require(path: str, what: str) -> str:
  if not os.path.exists(path):
    raise DataError(f"{what} is missing: is this a LeRobot dataset root?", path=path)
  return path


def read_parquet(path: str, columns: list[str] | None = None) -> pa.Table:
  _require(path, "parquet file")
  try:
    return pq.read_table(path, columns=columns)
  except (pa.ArrowInvalid, OSError) as error:
    raise DataError(f"cannot read parquet ({error}): the file is truncated or corrupt",
                    path=path) from error


def _v21_episodes(root: str, info: dict[str, Any], video_keys: list[str]) -> tuple[
    EpisodeTable, dict[int, str]]:
  meta = os.path.join(root, "meta")
  rows = sorted(fmt.read_jsonl(_require(os.path.join(meta, "episodes.jsonl"), "episodes.jsonl")),
                key=lambda row: row["episode_index"])
  tasks = {row["task_index"]: row["task"] for row in
           fmt.read_jsonl(_require(os.path.join(meta, "tasks.jsonl"), "tasks.jsonl"))}
  chunks_size = int(info.get("chunks_size", fmt.CHUNKS_SIZE))
  index = np.asarray([row["episode_index"] for row in rows], np.int64)
  length = np.asarray([row["length"] for row in rows], np.int64)
  # v2.1 stores no global offsets: frames are numbered in episode order.
  dataset_to = np.cumsum(length)
  data_path = [os.path.join(root, info["data_path"].format(
      episode_chunk=e // chunks_size, episode_index=e)) for e in index]
  video_path = {key: [os.path.join(root, info["video_path"].format(
      episode_chunk=e // chunks_size, video_key=key, episode_index=e)) for e in index]
      for key in video_keys}
  starts = {key: np.zeros(len(index)) for key in video_keys}
  table = EpisodeTable(index, length, dataset_to - length, dataset_to, data_path, video_path,
                       starts, [list(row.get("tasks", [])) for row in rows])
  return table, tasks


def _v30_episodes(root: str, info: dict[str, Any], video_keys: list[str]) -> tuple[
    EpisodeTable, dict[int, str]]:
  meta = os.path.join(root, "meta")
  files = sorted(glob.glob(os.path.join(meta, "episodes", "chunk-*", "file-*.parquet")))
  if not files:
    raise DataError("no meta/episodes/chunk-*/file-*.parquet: the v3.0 episode index is missing",
                    path=os.path.join(meta, "episodes"))
  columns = ["episode_index", "tasks", "length", "data/chunk_index", "data/file_index",
             "dataset_from_index", "dataset_to_index"]
  for key in video_keys:
    columns += [f"videos/{key}/{name}" for name in
                ("chunk_index", "file_index", "from_timestamp")]
  tables = []
  for path in files:
    table = read_parquet(path)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
      raise DataError(f"episode index lacks columns {missing}: it does not match info.json "
                      "features", path=path)
    tables.append(table.select(columns))
  episodes = pa.concat_tables(tables).sort_by("episode_index").to_pydict()
  tasks_table = read_parquet(_require(os.path.join(meta, "tasks.parquet"), "tasks.parquet"))
  task_column = "task" if "task" in tasks_table.column_names else "__index_level_0__"
  tasks = dict(zip(tasks_table.column("task_index").to_pylist(),
                   tasks_table.column(task_column).to_pylist()))

  def path_of(template: str, chunk: int, file: int, **extra) -> str:
    return os.path.join(root, template.format(chunk_index=chunk, file_index=file, **extra))

  table = EpisodeTable(
      episode_index=np.asarray(episodes["episode_index"], np.int64),
      length=np.asarray(episodes["length"], np.int64),
      dataset_from=np.asarray(episodes["dataset_from_index"], np.int64),
      dataset_to=np.asarray(episodes["dataset_to_index"], np.int64),
      data_path=[path_of(info["data_path"], c, f) for c, f in
                 zip(episodes["data/chunk_index"], episodes["data/file_index"])],
      video_path={key: [path_of(info["video_path"], c, f, video_key=key) for c, f in zip(
          episodes[f"videos/{key}/chunk_index"], episodes[f"videos/{key}/file_index"])]
          for key in video_keys},
      video_from_timestamp={key: np.asarray(episodes[f"videos/{key}/from_timestamp"], np.float64)
                            for key in video_keys},
      tasks=[list(t) for t in episodes["tasks"]])
  return table, tasks


def read_meta(root: str) -> LeRobotMeta:
  """Reads and checks meta/ of a v2.1 or v3.0 dataset; raises DataError naming the bad file."""
  root = os.path.abspath(root)
  info_path = _require(os.path.join(root, "meta", "info.json"), "meta/info.json")
  info = fmt.read_json(info_path)
  version = str(info.get("codebase_version", ""))
  features = info.get("features", {})
  video_keys = [key for key, feature in features.items() if feature.get("dtype") == "video"]
  if version.startswith("v2"):
    episodes, tasks = _v21_episodes(root, info, video_keys)
  elif version.startswith("v3"):
    episodes, tasks = _v30_episodes(root, info, video_keys)
  else:
    raise DataError(f"codebase_version {version!r} is not supported: ejax reads v2.1 and v3.0 "
                    "(convert older datasets with LeRobot's converter)", path=info_path)
  if len(episodes.length) and np.any(np.diff(episodes.dataset_from) < 0):
    raise DataError("episodes overlap in the global frame index", path=root)
  stats_path = os.path.join(root, "meta", "stats.json")
  stats = fmt.stats_from_json(fmt.read_json(stats_path)) if os.path.exists(stats_path) else {}
  modality_path = os.path.join(root, "meta", "modality.json")
  modality = fmt.read_json(modality_path) if os.path.exists(modality_path) else None
  image_keys = [key for key, feature in features.items() if feature.get("dtype") == "image"]
  return LeRobotMeta(root, version, info, int(info["fps"]), features, video_keys, image_keys, tasks,
                     episodes, stats, modality)
