"""Rollout videos: frames [T, H, W, 3] uint8 -> mp4 (H.264, yuv420p) with PyAV."""

from __future__ import annotations

import os

import av
import numpy as np


def write_mp4(path: str, frames: np.ndarray, fps: int) -> None:
  """Writes frames [T, H, W, 3] uint8; odd sizes are padded by one pixel (yuv420p needs even sizes)."""
  frames = np.asarray(frames)
  if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
    raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
  pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
  if pad_h or pad_w:
    frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with av.open(path, mode="w") as container:
    stream = container.add_stream("libx264", rate=fps)
    stream.height, stream.width = frames.shape[1], frames.shape[2]
    stream.pix_fmt = "yuv420p"
    for frame in frames:
      for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
        container.mux(packet)
    for packet in stream.encode():
      container.mux(packet)


def read_mp4(path: str) -> np.ndarray:
  """Decodes a whole mp4 to frames [T, H, W, 3] uint8 (for tests and inspection)."""
  with av.open(path) as container:
    return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
