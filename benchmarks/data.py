"""Input pipeline vs a naive per-sample loader on a 3-camera 224x224 LeRobot v3 dataset.

  python benchmarks/data.py            (a few minutes on 2 shared CPU cores; no arguments needed)
  python benchmarks/data.py --tune=none --codec=av1   (files encoded with the codec's defaults)

Builds a small v3 dataset with ejax's writer in a temp dir (its defaults: h264 tuned for fast
decoding, a keyframe every 2 frames as LeRobot encodes), then reads random steps (action chunk of
16 + 3 camera frames) two ways:

  naive:    per sample and camera, open the mp4, seek to the frame's timestamp, decode, close
            (what LeRobot's v3 loader does), then stack batches; parquet columns are preloaded
            for both, so only the video path differs;
  pipeline: ejax.data.pipeline.build_pipeline in-process, unthreaded (containers kept open,
            one decoder thread, a colour converter kept per stream, forward decoding instead of
            re-seeking), shuffled at step granularity, normalised, batched.

Both are timed by CPU seconds (process time: every thread of this process), so "samples/s per
core" = samples / CPU-seconds and the ratio does not depend on how many cores are free. Also
printed: wall-clock throughput with 2 grain workers, the packer's padding on the VLA length mix,
and the normalisation-statistics pass time. Last line: the per-core ratio (goal >= 3x).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import av
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ml_collections import ConfigDict  # noqa: E402

from ejax.data import packing, stats as stats_lib, stats_math  # noqa: E402
from ejax.data.lerobot import LeRobotSource, LeRobotV3Writer  # noqa: E402
from ejax.data.pipeline import build_pipeline  # noqa: E402

CAMERAS = ("observation.images.agentview", "observation.images.wrist",
           "observation.images.side")
SIZE = 224
FPS = 20
EPISODES = 8
EPISODE_LENGTH = 150
HORIZON = 16
SAMPLES = 300


def _scene(length: int, episode: int, camera: int, noise: np.ndarray) -> np.ndarray:
  """Smooth gradients with a moving block and sensor noise: compresses like a real camera."""
  y, x = np.mgrid[0:SIZE, 0:SIZE]
  base = np.stack([x * 0.8, y * 0.6, (x + y) * 0.3], axis=-1) + 20 * camera + 7 * episode
  base = np.clip(base, 0, 240).astype(np.int16)
  frames = np.empty((length, SIZE, SIZE, 3), np.uint8)
  for t in range(length):
    image = base + noise[t % len(noise)]
    top, left = (3 * t + 40 * camera) % (SIZE - 48), (5 * t + 17 * episode) % (SIZE - 48)
    image[top:top + 48, left:left + 48] = [200, 60 + t % 100, 90]
    frames[t] = np.clip(image, 0, 255)
  return frames


def make_dataset(root: str, codec: str = "h264", tune: str | None = "default") -> str:
  features = {key: {"dtype": "video", "shape": [SIZE, SIZE, 3]} for key in CAMERAS}
  features["observation.state"] = {"dtype": "float32", "shape": [14]}
  features["action"] = {"dtype": "float32", "shape": [14]}
  writer = LeRobotV3Writer(root, fps=FPS, features=features, robot_type="bimanual_arm",
                           video_codec=codec, video_tune=tune)
  rng = np.random.default_rng(0)
  noise = rng.integers(-4, 5, (7, SIZE, SIZE, 3), dtype=np.int16)
  for episode in range(EPISODES):
    frames = {key: _scene(EPISODE_LENGTH, episode, c, noise) for c, key in enumerate(CAMERAS)}
    frames["observation.state"] = rng.normal(size=(EPISODE_LENGTH, 14)).astype(np.float32)
    frames["action"] = rng.normal(size=(EPISODE_LENGTH, 14)).astype(np.float32)
    writer.add_episode(frames, task=f"task {episode % 3}")
  return writer.finalize()


def naive_sample(source: LeRobotSource, index: int) -> dict:
  """Open-seek-decode per camera, as LeRobot's decode_video_frames_pyav does per sample."""
  columns, episodes = source.columns(), source.meta.episodes
  position = source.episode_of(index)
  start, stop = episodes.dataset_from[position], episodes.dataset_to[position]
  rows = np.minimum(index + np.arange(HORIZON), stop - 1)
  sample = {"observation.state": columns["observation.state"][index],
            "action": columns["action"][rows], "action_is_pad": index + np.arange(HORIZON) >= stop}
  del start
  for key in CAMERAS:
    target = episodes.video_from_timestamp[key][position] + columns["timestamp"][index]
    with av.open(episodes.video_path[key][position]) as container:
      stream = container.streams.video[0]
      container.seek(int(target / stream.time_base), stream=stream, backward=True)
      for frame in container.decode(stream):
        if frame.time >= target - 1e-4:
          sample[key] = frame.to_ndarray(format="rgb24")
          break
  return sample


def decode_seconds_per_frame(source: LeRobotSource, frames_per_camera: int = 150) -> float:
  """CPU seconds to decode one frame to RGB when decoding straight through a file: the least a
  loader can spend per camera frame it returns (no opening, seeking or frames decoded twice)."""
  cpu, frames = time.process_time(), 0
  for key in CAMERAS:
    with av.open(source.meta.episodes.video_path[key][0]) as container:
      stream = container.streams.video[0]
      stream.thread_type = "NONE"  # one thread, as the in-process pipeline decodes
      for index, frame in enumerate(container.decode(stream)):
        if index == frames_per_camera:
          break
        frame.to_ndarray(format="rgb24")
        frames += 1
  return (time.process_time() - cpu) / frames


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--codec", default="h264", choices=["h264", "av1"])
  parser.add_argument("--tune", default="default",
                      help="encoder tuning: 'default' (the writer's), or 'none' (codec defaults)")
  args = parser.parse_args()
  tune = None if args.tune == "none" else args.tune
  with tempfile.TemporaryDirectory() as tmp:
    start = time.perf_counter()
    root = make_dataset(os.path.join(tmp, "dataset"), args.codec, tune)
    frames = EPISODES * EPISODE_LENGTH
    print(f"dataset: {EPISODES} episodes x {EPISODE_LENGTH} steps, {len(CAMERAS)} cameras "
          f"{SIZE}x{SIZE} {args.codec} (tune {args.tune}), written in "
          f"{time.perf_counter() - start:.1f}s")
    source = LeRobotSource(root, horizon=HORIZON)
    source.columns()
    indices = np.random.default_rng(1).integers(0, frames, SAMPLES)

    batch_size = 10
    naive_sample(source, 0)
    cpu, wall = time.process_time(), time.perf_counter()
    for start in range(0, SAMPLES, batch_size):
      samples = [naive_sample(source, int(i)) for i in indices[start:start + batch_size]]
      batch = {key: np.stack([s[key] for s in samples]) for key in samples[0]}
    naive_cpu, naive_wall = time.process_time() - cpu, time.perf_counter() - wall
    naive_rate = SAMPLES / naive_cpu
    print(f"naive open-seek-decode: {naive_rate:7.1f} samples/s per core "
          f"({SAMPLES / naive_wall:.1f} samples/s wall)")
    per_frame = decode_seconds_per_frame(source)
    decode_bound = 1.0 / (len(CAMERAS) * per_frame)
    print(f"decode cost per frame (straight through a file, to RGB): {per_frame * 1e3:.2f} ms: at most "
          f"{decode_bound:.0f} samples/s per core for {len(CAMERAS)} frames a sample")

    # In-process and unthreaded: the configuration that spends the fewest CPU cycles per sample.
    config = ConfigDict(dict(name="lerobot", path=root, horizon=HORIZON, num_workers=0,
                             prefetch=0, read_threads=0, shuffle=True,
                             normalization="mean_std"))
    with build_pipeline(config, batch_size=batch_size, seed=0) as pipeline:
      next(pipeline)
      cpu, wall = time.process_time(), time.perf_counter()
      for _ in range(SAMPLES // batch_size):
        batch = next(pipeline)
      pipe_cpu, pipe_wall = time.process_time() - cpu, time.perf_counter() - wall
    assert batch["observation.images.side"].shape == (batch_size, SIZE, SIZE, 3)
    pipe_rate = SAMPLES / pipe_cpu
    print(f"pipeline (in-process):  {pipe_rate:7.1f} samples/s per core "
          f"({SAMPLES / pipe_wall:.1f} samples/s wall)")

    workers = ConfigDict(config.to_dict())
    workers.num_workers, workers.prefetch, workers.read_threads = 2, 2, 1
    with build_pipeline(workers, batch_size=batch_size, seed=0) as pipeline:
      next(pipeline)
      wall = time.perf_counter()
      for _ in range(SAMPLES // batch_size):
        next(pipeline)
      mp_wall = time.perf_counter() - wall
    print(f"pipeline (2 workers):   {SAMPLES / mp_wall:7.1f} samples/s wall "
          f"on {os.cpu_count()} cores")

    lengths = packing.vla_length_mix(4096, seed=0)
    rows = packing.pack_sequences(lengths, 1024)
    padding = 1 - lengths.sum() / (len(rows) * 1024)
    print(f"packing: {len(lengths)} samples of the VLA length mix into {len(rows)} rows of "
          f"1024: padding {100 * padding:.2f}%")

    stats_config = ConfigDict(dict(data=dict(name="lerobot", path=root, horizon=HORIZON)))
    result = stats_lib.run_job(stats_config, os.path.join(tmp, "stats"))
    print(f"norm stats pass: {result['steps']} steps in {result['seconds']:.3f}s "
          f"({result['steps'] / result['seconds']:.0f} steps/s)")
    # For scale: statistics gathered by iterating every sample, images decoded (openpi's way).
    start = time.perf_counter()
    states = np.stack([source[i]["observation.state"] for i in range(frames)])
    stats_math.vector_stats(states)
    per_sample = time.perf_counter() - start
    print(f"norm stats by iterating samples (decoding images): {per_sample:.2f}s "
          f"({per_sample / result['seconds']:.0f}x slower)")
    print(f"pipeline/naive samples per second per core: {pipe_rate / naive_rate:.2f}x of a possible "
          f"{decode_bound / naive_rate:.2f}x (decoding only the frames a sample needs) (goal 3x)")


if __name__ == "__main__":
  main()
