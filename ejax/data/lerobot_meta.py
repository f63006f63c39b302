"""Reading a LeRobot dataset's metadata (v2.1 or v3.0) into one version-independent description.

Everything per episode that the sample reader needs is gathered here once: where its rows sit in
the global frame index, which parquet file holds them, and for each camera which mp4 holds its
frames and at what time the episode starts in that file.
"""

from __future__ import annotations

import dataclasses
import glob
import json
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


def read_parquet_footer(path: str, *, episode_index: int | None = None) -> tuple[pa.Schema, int]:
  """(schema, row count) from a parquet file's footer, without reading its data."""
  if not os.path.exists(path):
    raise DataError("parquet file is missing: is this a LeRobot dataset root?", path=path, episode_index=episode_index)
  try:
    footer = pq.ParquetFile(path)
    return footer.schema_arrow, footer.metadata.num_rows
  except (pa.ArrowInvalid, OSError) as error:
    raise DataError(f"cannot read parquet ({' '.join(str(error).split())[:160]}): the file is truncated or corrupt",
                    path=path, episode_index=episode_index) from error


def _v21_episodes(root: str, info: dict[str, Any], video_keys: list[str]) -> tuple[
    EpisodeTable, dict[int, str]]:
  meta = os.path.join(root, "meta")
  rows = sorted(_jsonl(os.path.join(meta, "episodes.jsonl"), ("episode_index", "length")),
                key=lambda row: row["episode_index"])
  tasks = {row["task_index"]: row["task"] for row in _jsonl(os.path.join(meta, "tasks.jsonl"), ("task_index", "task"))}
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


def _jsonl(path: str, required: tuple[str, ...]) -> list[dict[str, Any]]:
  rows = []
  with open(_require(path, os.path.basename(path))) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as error:
        raise DataError(f"line {number} is not valid JSON ({error.msg})", path=path) from None
      missing = [key for key in required if not isinstance(row, dict) or key not in row]
      if missing:
        raise DataError(f"line {number} lacks {', '.join(map(repr, missing))}", path=path)
      rows.append(row)
  return rows


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


def read_info(root: str) -> dict[str, Any]:
  """meta/info.json, checked for what the reader relies on; a bad file is one line naming it."""
  info_path = _require(os.path.join(root, "meta", "info.json"), "meta/info.json")
  try:
    info = fmt.read_json(info_path)
  except json.JSONDecodeError as error:
    raise DataError(f"info.json is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})",
                    path=info_path) from None
  except (OSError, UnicodeDecodeError) as error:
    raise DataError(f"cannot read info.json ({error})", path=info_path) from None
  if not isinstance(info, dict):
    raise DataError(f"info.json holds a {type(info).__name__}, not an object", path=info_path)
  problems = [f"{key!r} is missing" for key in ("codebase_version", "fps", "features", "data_path") if key not in info]
  if not problems and not (isinstance(info["features"], dict) and all(
      isinstance(f, dict) and "dtype" in f and "shape" in f for f in info["features"].values())):
    problems.append("'features' is not a table of {dtype, shape} entries")
  if not problems and any(f["dtype"] == "video" for f in info["features"].values()) and "video_path" not in info:
    problems.append("'video_path' is missing (the dataset has video features)")
  if not problems and not (isinstance(info["fps"], (int, float)) and info["fps"] > 0):
    problems.append(f"'fps' is {info['fps']!r}, not a positive number")
  for key in ("total_frames", "total_episodes"):
    if not problems and key in info and not (isinstance(info[key], int) and info[key] >= 0):
      problems.append(f"{key!r} is {info[key]!r}, not a count")
  if problems:
    raise DataError(f"info.json is not a LeRobot dataset description: {'; '.join(problems)}", path=info_path)
  return info


def _check_layout(root: str, version: str, info_path: str) -> None:
  """Files of the other version's layout under the declared version: name the version."""
  meta = os.path.join(root, "meta")
  v3_files = glob.glob(os.path.join(meta, "episodes", "chunk-*", "file-*.parquet"))
  v2_files = os.path.exists(os.path.join(meta, "episodes.jsonl"))
  if version.startswith("v2") and not v2_files and v3_files:
    raise DataError(f"info.json declares codebase_version {version!r} but the files are v3.0's (meta/episodes/"
                    "chunk-*/file-*.parquet, no meta/episodes.jsonl): set codebase_version to \"v3.0\"",
                    path=info_path)
  if version.startswith("v3") and not v3_files and v2_files:
    raise DataError(f"info.json declares codebase_version {version!r} but the files are v2.1's "
                    "(meta/episodes.jsonl, no meta/episodes/): set codebase_version to \"v2.1\"", path=info_path)


def check_episode_index(episodes: EpisodeTable, info: dict[str, Any], root: str, version: str) -> None:
  """The episode index must cover frames 0..total_frames-1 of info.json exactly once, in episode
  order, with the episode count info.json declares: anything else would give frames to the wrong
  episode (or silently drop some)."""
  where = (os.path.join(root, "meta", "episodes") if version.startswith("v3")
           else os.path.join(root, "meta", "episodes.jsonl"))
  missing_file = _missing_episode_files(root) if version.startswith("v3") else ""
  index, start, stop = episodes.episode_index, episodes.dataset_from, episodes.dataset_to
  duplicated = index[1:][np.diff(index) == 0]
  if len(duplicated):
    raise DataError(f"episode {int(duplicated[0])} appears twice in the episode index", path=where)
  if np.any(stop - start != episodes.length) or np.any(episodes.length <= 0):
    bad = int(np.nonzero((stop - start != episodes.length) | (episodes.length <= 0))[0][0])
    raise DataError(f"episode {int(index[bad])} has length {int(episodes.length[bad])} but spans frames "
                    f"{int(start[bad])}..{int(stop[bad]) - 1} in the episode index", path=where)
  expected_start = np.concatenate([[0], stop[:-1]])
  for position in np.nonzero(start != expected_start)[0]:
    position = int(position)
    before = f"episode {int(index[position - 1])}" if position else "the start"
    if start[position] > expected_start[position]:
      raise DataError(f"the episode index has no episode for frames {int(expected_start[position])}.."
                      f"{int(start[position]) - 1} (between {before} and episode {int(index[position])})"
                      f"{missing_file}: "
                      "frames would be read as the wrong episode's", path=where)
    raise DataError(f"episodes {int(index[position - 1])} and {int(index[position])} overlap in the global frame "
                    f"index (frames {int(start[position])}..{int(expected_start[position]) - 1})", path=where)
  gaps = np.setdiff1d(np.arange(int(index[-1]) + 1 if len(index) else 0), index)
  if len(gaps):
    raise DataError(f"the episode index has no entry for episode {int(gaps[0])}"
                    f"{f' ({len(gaps)} episodes missing)' if len(gaps) > 1 else ''}{missing_file}", path=where)
  frames, count = (int(stop[-1]) if len(stop) else 0), len(index)
  declared_frames, declared_count = info.get("total_frames", frames), info.get("total_episodes", count)
  if (frames, count) != (declared_frames, declared_count):
    last = ("the last meta/episodes file" if version.startswith("v3") else "the last line of meta/episodes.jsonl")
    raise DataError(f"the episode index covers {frames} frames in {count} episodes but info.json declares "
                    f"{declared_frames} frames in {declared_count} episodes{missing_file or f': is {last} missing?'}",
                    path=where)


def _missing_episode_files(root: str) -> str:
  """' (meta/episodes/chunk-000/file-001.parquet is missing)' when the numbering has a hole."""
  files = sorted(glob.glob(os.path.join(root, "meta", "episodes", "chunk-*", "file-*.parquet")))
  numbers = []
  for path in files:
    chunk = os.path.basename(os.path.dirname(path))[len("chunk-"):]
    file = os.path.basename(path)[len("file-"):-len(".parquet")]
    if chunk.isdigit() and file.isdigit():
      numbers.append((int(chunk), int(file)))
  present = set(numbers)
  holes = [(c, f - 1) for c, f in numbers if f > 0 and (c, f - 1) not in present]
  if not holes:
    return ""
  chunk, file = holes[0]
  return f" (meta/episodes/chunk-{chunk:03d}/file-{file:03d}.parquet is missing)"


def read_meta(root: str) -> LeRobotMeta:
  """Reads and checks meta/ of a v2.1 or v3.0 dataset; raises DataError naming the bad file."""
  root = os.path.abspath(root)
  info = read_info(root)
  info_path = os.path.join(root, "meta", "info.json")
  version = str(info.get("codebase_version", ""))
  features = info["features"]
  video_keys = [key for key, feature in features.items() if feature.get("dtype") == "video"]
  if version.startswith(("v2", "v3")):
    _check_layout(root, version, info_path)
  if version.startswith("v2"):
    episodes, tasks = _v21_episodes(root, info, video_keys)
  elif version.startswith("v3"):
    episodes, tasks = _v30_episodes(root, info, video_keys)
  else:
    raise DataError(f"codebase_version {version!r} is not supported: ejax reads v2.1 and v3.0 "
                    "(convert older datasets with LeRobot's converter)", path=info_path)
  check_episode_index(episodes, info, root, version)
  stats_path = os.path.join(root, "meta", "stats.json")
  stats = fmt.stats_from_json(fmt.read_json(stats_path)) if os.path.exists(stats_path) else {}
  modality_path = os.path.join(root, "meta", "modality.json")
  modality = fmt.read_json(modality_path) if os.path.exists(modality_path) else None
  image_keys = [key for key, feature in features.items() if feature.get("dtype") == "image"]
  return LeRobotMeta(root, version, info, int(info["fps"]), features, video_keys, image_keys, tasks,
                     episodes, stats, modality)
