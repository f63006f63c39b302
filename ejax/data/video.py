"""mp4 encoding (h264 / AV1) and cached random-access decoding with PyAV.

LeRobot's own loader opens, probes, seeks and closes a shared mp4 for every sample and camera.
`VideoReaderCache` keeps containers open per worker process (LRU), remembers where each decoder
stands so a request just ahead of it decodes forward instead of seeking, decodes on one thread,
and converts (and, when asked, resizes) frames in one swscale call with a converter kept per
stream.
"""

from __future__ import annotations

import collections
import os
from typing import Sequence

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from ejax.data.errors import DataError

CODECS = {"h264": "libx264", "av1": "libsvtav1"}
# A keyframe every 2 frames, as LeRobot encodes: a random seek decodes at most 2 frames.
DEFAULT_GOP_SIZE = 2
DEFAULT_CRF = {"h264": 23, "av1": 30}
# Training reads are decode-bound: x264's fastdecode tuning (no CABAC, no deblocking) decodes
# ~2.5x faster for ~40 % larger files, still plain h264 that any reader decodes.
DEFAULT_TUNE = {"h264": "fastdecode", "av1": None}
# A request at most this many frames ahead of the decoder decodes forward instead of seeking.
MAX_FORWARD_FRAMES = 4


def pixel_format(lossless: bool) -> str:
  """The mp4 streams' pixel format (and info.json's video.pix_fmt)."""
  return "yuv444p" if lossless else "yuv420p"


class VideoEncoder:
  """Appends uint8 RGB frames [T, H, W, 3] to one mp4 stream at a constant frame rate.

  `tune`: "default" picks DEFAULT_TUNE for the codec; None encodes with the codec's defaults.
  `lossless` (h264 only): full-resolution colour (yuv444p) at crf 0, instead of LeRobot's yuv420p at
  crf 23, which halves the colour resolution: a 3-pixel object in a 64 px frame comes back with its
  colour smeared by ~17 levels on average (up to ~100), against ~0.4 lossless (pixel_format).
  """

  def __init__(self, path: str, *, fps: int, height: int, width: int, codec: str = "h264",
               gop_size: int = DEFAULT_GOP_SIZE, crf: int | None = None,
               tune: str | None = "default", lossless: bool = False):
    if codec not in CODECS:
      raise ValueError(f"video codec {codec!r} is not supported: use one of {sorted(CODECS)}")
    if lossless and codec != "h264":
      raise ValueError(f"lossless video is h264 only (yuv444p, crf 0), not {codec!r}: set the codec to h264")
    if codec == "av1":
      os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner to stderr otherwise.
    os.makedirs(os.path.dirname(path), exist_ok=True)
    self.path, self.fps, self.height, self.width = path, fps, height, width
    self.num_frames = 0
    self.bytes_written = 0  # compressed bytes muxed so far, for v3 file rollover
    self._container = av.open(path, "w")
    self._stream = self._container.add_stream(CODECS[codec], rate=fps)
    self._stream.width, self._stream.height = width, height
    self._stream.pix_fmt = pixel_format(lossless)
    crf = (0 if lossless else DEFAULT_CRF[codec]) if crf is None else crf
    options = {"g": str(gop_size), "crf": str(crf)}
    tune = DEFAULT_TUNE[codec] if tune == "default" else tune
    if tune:
      options["tune"] = tune
    self._stream.options = options

  def write(self, frames: np.ndarray) -> None:
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.shape[1:] != (self.height, self.width, 3):
      raise ValueError(f"{self.path}: frames must be uint8 [T, {self.height}, {self.width}, 3], "
                       f"got {frames.dtype} {list(frames.shape)}")
    for image in frames:
      frame = av.VideoFrame.from_ndarray(image, format="rgb24")
      frame.pts = self.num_frames
      for packet in self._stream.encode(frame):
        self.bytes_written += packet.size
        self._container.mux(packet)
      self.num_frames += 1

  def close(self) -> None:
    for packet in self._stream.encode():
      self._container.mux(packet)
    self._container.close()


class _OpenVideo:
  """One open container and where its decoder stands."""

  def __init__(self, path: str):
    self.container = av.open(path)
    self.stream = self.container.streams.video[0]
    # One decoding thread: frame threading adds latency to every seek and slice threads cost
    # more CPU than they save on small frames; parallelism comes from grain workers instead.
    self.stream.codec_context.thread_count = 1
    # One colour converter per stream: a fresh frame's to_ndarray builds a new swscale context
    # each time, which costs more than decoding a 224x224 frame.
    self.reformatter = VideoReformatter()
    self.time_base = float(self.stream.time_base)
    rate = self.stream.average_rate or self.stream.guessed_rate
    self.frame_seconds = 1.0 / float(rate) if rate else 0.0
    duration = self.stream.duration
    self.duration = duration * self.time_base if duration else None
    self.frames = None  # the decode generator, recreated after every seek
    self.last_time = -np.inf  # time of the last frame handed out by `frames`
    self.last_image: np.ndarray | None = None  # that frame, converted, and the size it has
    self.last_size: tuple[int, int] | None = None

  def close(self) -> None:
    self.container.close()


class VideoReaderCache:
  """Random-access frame reader over many mp4 files, with at most `max_open` containers open.

  Not shared across processes: each grain worker builds its own on first use (the dataset drops
  the cache when it is pickled).
  """

  def __init__(self, max_open: int = 32):
    self.max_open = max_open
    self._open: collections.OrderedDict[str, _OpenVideo] = collections.OrderedDict()
    self.opened = 0  # containers opened so far (a reopen per sample would show here)
    self.seeks = 0  # seeks so far (a request just ahead of the decoder needs none)

  def _get(self, path: str, episode_index: int | None) -> _OpenVideo:
    video = self._open.get(path)
    if video is not None:
      self._open.move_to_end(path)
      return video
    if not os.path.exists(path):
      raise DataError("video file is missing: re-download or re-convert the dataset", path=path,
                      episode_index=episode_index)
    try:
      video = _OpenVideo(path)
    except (av.error.FFmpegError, IndexError) as error:
      raise DataError(f"cannot open video ({error}): the mp4 is truncated or corrupt; re-encode "
                      "it", path=path, episode_index=episode_index) from error
    self._open[path] = video
    self.opened += 1
    while len(self._open) > self.max_open:
      _, oldest = self._open.popitem(last=False)
      oldest.close()
    return video

  def read(self, path: str, timestamps: Sequence[float], *, tolerance_s: float,
           size: tuple[int, int] | None = None, episode_index: int | None = None) -> np.ndarray:
    """Frames at `timestamps` (seconds in the file) as uint8 [n, H, W, 3], in request order.

    `size` (height, width) resizes during colour conversion. A frame whose time differs from the
    request by more than `tolerance_s` is a DataError naming the file and episode.
    """
    video = self._get(path, episode_index)
    order = np.argsort(timestamps, kind="stable")
    out: list[np.ndarray | None] = [None] * len(timestamps)
    for i in order:
      try:
        out[i] = self._frame_at(video, float(timestamps[i]), tolerance_s, size)
      except DataError as error:
        self._drop(path)
        raise DataError(str(error), path=path, episode_index=episode_index) from None
      except (av.error.FFmpegError, EOFError) as error:
        self._drop(path)
        raise DataError(f"cannot decode video ({error}): the mp4 is truncated or corrupt; "
                        "re-encode it", path=path, episode_index=episode_index) from error
    return out[0][None] if len(out) == 1 else np.stack(out)  # one frame: a view, no copy

  def _drop(self, path: str) -> None:
    video = self._open.pop(path, None)
    if video is not None:
      video.close()

  def _frame_at(self, video: _OpenVideo, target: float, tolerance_s: float,
                size: tuple[int, int] | None) -> np.ndarray:
    if video.duration is not None and target > video.duration + tolerance_s:
      raise DataError(f"timestamp {target:.4f}s is past the end of the video "
                      f"({video.duration:.4f}s): the episode metadata and the mp4 disagree")
    ahead = target - video.last_time
    if video.frames is None or ahead < -tolerance_s or (
        ahead > MAX_FORWARD_FRAMES * video.frame_seconds):
      # Seek to the keyframe at or before the target, then decode forward.
      video.container.seek(max(int(target / video.time_base), 0), stream=video.stream,
                           backward=True, any_frame=False)
      self.seeks += 1
      video.frames = video.container.decode(video.stream)
      video.last_time, video.last_image = -np.inf, None
    elif abs(ahead) <= tolerance_s and video.last_image is not None and video.last_size == size:
      return video.last_image  # the same frame again (e.g. two offsets clamped to one frame)
    for frame in video.frames:
      time = frame.pts * video.time_base
      video.last_time = time
      if time < target - tolerance_s:
        continue
      if time > target + tolerance_s:
        raise DataError(f"no frame within {tolerance_s}s of timestamp {target:.4f}s (next frame "
                        f"at {time:.4f}s): the timestamps and the video's frame rate disagree")
      if size is not None and (frame.height, frame.width) != tuple(size):
        rgb = video.reformatter.reformat(frame, format="rgb24", height=size[0], width=size[1],
                                         interpolation="BILINEAR")
      else:
        rgb = video.reformatter.reformat(frame, format="rgb24")
      image = rgb.to_ndarray()
      video.last_image, video.last_size = image, size
      return image
    video.frames = None
    raise DataError(f"timestamp {target:.4f}s is past the last frame of the video "
                    f"(last at {video.last_time:.4f}s)")

  def close(self) -> None:
    while self._open:
      _, video = self._open.popitem()
      video.close()
