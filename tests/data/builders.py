"""Builders of small real-format datasets for the data tests (LeRobot v3.0 / v2.1, TFDS RLDS)."""

import numpy as np

from ejax.data.lerobot_writer import LeRobotV21Writer, LeRobotV3Writer

FPS = 10
IMAGE = 32
EPISODE_LENGTHS = (9, 12, 7)
TASKS = ("pick the cube", "open the drawer", "pick the cube")


def camera_frames(length: int, episode: int, camera: int) -> np.ndarray:
  """Smooth images whose level steps by 12 per frame: codec error (~1-2) never confuses frames."""
  ramp = np.linspace(0, 40, IMAGE)[:, None, None]
  frames = np.empty((length, IMAGE, IMAGE, 3), np.uint8)
  for t in range(length):
    frames[t] = np.clip(ramp + 12 * t + 30 * camera + 5 * episode + [0, 20, 40], 0, 255)
  return frames


def make_episodes():
  rng = np.random.default_rng(0)
  episodes = []
  for e, length in enumerate(EPISODE_LENGTHS):
    episodes.append({
        "observation.images.agentview": camera_frames(length, e, 0),
        "observation.images.wrist": camera_frames(length, e, 1),
        "observation.state": rng.normal(size=(length, 6)).astype(np.float32),
        "action": rng.normal(size=(length, 4)).astype(np.float32),
    })
  return episodes


FEATURES = {
    "observation.images.agentview": {"dtype": "video", "shape": [IMAGE, IMAGE, 3]},
    "observation.images.wrist": {"dtype": "video", "shape": [IMAGE, IMAGE, 3]},
    "observation.state": {"dtype": "float32", "shape": [6], "names": [f"q{i}" for i in range(6)]},
    "action": {"dtype": "float32", "shape": [4], "names": None},
}


def write_dataset(root, writer_class, episodes, **kwargs):
  writer = writer_class(str(root), fps=FPS, features=FEATURES, robot_type="test_arm", **kwargs)
  for episode, task in zip(episodes, TASKS):
    writer.add_episode(episode, task=task)
  return writer.finalize()


