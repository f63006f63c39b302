"""LeRobot dataset layout (v2.1 and v3.0): paths, metadata files and parquet column codecs.

Shared by the writer and the reader so both agree on every file name and column type.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
from PIL import Image

V21, V30 = "v2.1", "v3.0"
CHUNKS_SIZE = 1000

V21_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V21_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
V30_DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V30_VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V30_EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"

# Columns every frame carries besides the user's features.
INDEX_FEATURES: dict[str, dict[str, Any]] = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
NUMERIC_DTYPES = ("float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
STAT_NAMES = ("min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99")


def is_visual(feature: Mapping[str, Any]) -> bool:
  return feature["dtype"] in ("video", "image")


def read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


def write_json(path: str, value: Any) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(value, f, indent=2)


def read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")


def chunk_and_file(file_number: int, chunks_size: int) -> tuple[int, int]:
  """v3 files are numbered file-000.. inside chunk-000.., `chunks_size` files per chunk."""
  return file_number // chunks_size, file_number % chunks_size


IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def encode_png(image: np.ndarray) -> bytes:
  buffer = io.BytesIO()
  Image.fromarray(np.asarray(image, np.uint8)).save(buffer, format="PNG")
  return buffer.getvalue()


def decode_image(encoded: bytes) -> np.ndarray:
  """uint8 [H, W, 3] from PNG / JPEG bytes (an "image" feature's cell)."""
  return np.asarray(Image.open(io.BytesIO(encoded)).convert("RGB"))


def arrow_column(values: np.ndarray, feature: Mapping[str, Any]) -> pa.Array:
  """A [T, *shape] array as the column type LeRobot (HF datasets) uses for the feature.

  Shape [1] is a scalar column; larger shapes are (nested) fixed-size lists; "image" features are
  {bytes: PNG, path: null} structs, as HF datasets stores Image features.
  """
  if feature["dtype"] == "image":
    return pa.array([{"bytes": encode_png(image), "path": None} for image in values],
                    type=IMAGE_TYPE)
  dtype = np.dtype(feature["dtype"])
  shape = list(feature["shape"])
  values = np.asarray(values, dtype)
  if shape == [1]:
    return pa.array(values.reshape(-1))
  column: pa.Array = pa.array(values.reshape(-1))
  for size in reversed(shape):
    column = pa.FixedSizeListArray.from_arrays(column, size)
  return column


def numpy_column(column: pa.ChunkedArray | pa.Array, shape: list[int]) -> np.ndarray:
  """Inverse of `arrow_column` (images stay encoded: an object array of bytes); also reads
  variable-length list columns of uniform length."""
  if isinstance(column, pa.ChunkedArray):
    column = column.combine_chunks()
  if pa.types.is_struct(column.type):
    return np.asarray(column.field("bytes").to_pylist(), dtype=object)
  rows = len(column)
  while pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type) or (
      pa.types.is_large_list(column.type)):
    column = column.flatten()
  flat = column.to_numpy(zero_copy_only=False)
  return flat.reshape((rows,) if list(shape) == [1] else (rows, *shape))


def stats_to_json(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, Any]:
  return {key: {name: np.asarray(value).tolist() for name, value in feature_stats.items()}
          for key, feature_stats in stats.items()}


def stats_from_json(raw: Mapping[str, Any]) -> dict[str, dict[str, np.ndarray]]:
  return {key: {name: np.asarray(value, np.float64) for name, value in feature_stats.items()}
          for key, feature_stats in raw.items()}
