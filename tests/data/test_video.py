"""Frames by timestamp with a tolerance, from containers opened once and decoders reused."""

import numpy as np
import pytest

from ejax.data.errors import DataError
from ejax.data.video import VideoEncoder, VideoReaderCache

FPS = 10


@pytest.fixture(scope="module")
def video(tmp_path_factory):
  frames = np.zeros((30, 24, 32, 3), np.uint8)
  for t in range(30):
    frames[t] = 8 * t  # a flat level per frame: the frame index is readable from any pixel
  path = str(tmp_path_factory.mktemp("video") / "clip.mp4")
  encoder = VideoEncoder(path, fps=FPS, height=24, width=32)
  encoder.write(frames[:12])
  encoder.write(frames[12:])  # appended in two calls, as the v3 writer appends episodes
  encoder.close()
  return path, frames


def _frame_number(image):
  return int(round(image.astype(float).mean() / 8))


def test_frames_by_timestamp_within_tolerance(video):
  path, frames = video
  cache = VideoReaderCache()
  times = [0.0, 1.7, 0.3, 2.9, 1.7]
  images = cache.read(path, times, tolerance_s=1e-4)
  assert images.shape == (5, 24, 32, 3)
  assert [_frame_number(i) for i in images] == [0, 17, 3, 29, 17]
  # 0.02 s off the frame grid: accepted with a 0.03 s tolerance, an error with 1e-4.
  assert _frame_number(cache.read(path, [0.52], tolerance_s=0.03)[0]) == 5
  with pytest.raises(DataError, match=r"no frame within 0.0001s of timestamp 0.5200s"):
    cache.read(path, [0.52], tolerance_s=1e-4, episode_index=4)
  with pytest.raises(DataError, match=r"past the end of the video.*clip\.mp4, episode 4\)"):
    cache.read(path, [3.5], tolerance_s=1e-4, episode_index=4)


def test_containers_open_once_and_nearby_requests_decode_forward(video):
  path, _ = video
  cache = VideoReaderCache()
  for t in range(10):
    cache.read(path, [t / FPS], tolerance_s=1e-4)
  assert cache.opened == 1
  assert cache.seeks == 1  # consecutive frames: the decoder just moves on
  cache.read(path, [2.5], tolerance_s=1e-4)
  cache.read(path, [0.5], tolerance_s=1e-4)
  assert cache.opened == 1 and cache.seeks == 3


def test_resize_during_conversion(video):
  path, _ = video
  image = VideoReaderCache().read(path, [1.0], tolerance_s=1e-4, size=(12, 16))[0]
  assert image.shape == (12, 16, 3) and _frame_number(image) == 10


def test_lossless_video_keeps_small_coloured_objects(tmp_path):
  """LeRobot's yuv420p halves the colour resolution: a 3x3 green square on a brown table comes back
  smeared by tens of levels; lossless (yuv444p, crf 0) within a few levels of RGB <-> YUV rounding."""
  rng = np.random.default_rng(0)
  frames = np.empty((6, 32, 32, 3), np.uint8)
  frames[:] = (150, 110, 70)
  squares = []
  for t in range(6):
    top, left = rng.integers(2, 27, size=2)
    frames[t, top:top + 3, left:left + 3] = (30, 165, 50)
    squares.append((t, slice(top, top + 3), slice(left, left + 3)))
  errors = {}
  for lossless in (False, True):
    path = str(tmp_path / f"clip_{lossless}.mp4")
    encoder = VideoEncoder(path, fps=FPS, height=32, width=32, lossless=lossless)
    encoder.write(frames)
    encoder.close()
    decoded = VideoReaderCache().read(path, [t / FPS for t in range(6)], tolerance_s=1e-3)
    errors[lossless] = max(np.abs(decoded[s].astype(int) - frames[s].astype(int)).mean() for s in squares)
  assert errors[True] < 3 and errors[False] > 3 * errors[True], errors
  with pytest.raises(ValueError, match="lossless video is h264 only"):
    VideoEncoder(str(tmp_path / "x.mp4"), fps=FPS, height=32, width=32, codec="av1", lossless=True)
