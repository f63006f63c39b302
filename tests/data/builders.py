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


def write_dataset(root, writer_class, episodes, *, features=None, **kwargs):
  writer = writer_class(str(root), fps=FPS, features=features or FEATURES, robot_type="test_arm", **kwargs)
  for episode, task in zip(episodes, TASKS):
    writer.add_episode(episode, task=task)
  return writer.finalize()




RLDS_LENGTHS = (5, 8, 6)


def rlds_episode(episode: int) -> list[dict]:
  """Steps of one RLDS episode with values that identify (episode, step)."""
  steps = []
  for t in range(RLDS_LENGTHS[episode]):
    steps.append({
        "image": np.full((16, 16, 3), 10 * t + 50 * episode, np.uint8),
        "state": np.asarray([episode, t, 0.5 * t, -t], np.float32),
        "action": np.asarray([t, episode, 1.0], np.float32),
        "instruction": f"task {episode % 2}",
    })
  return steps


def build_rlds(data_dir: str) -> str:
  """A tiny RLDS dataset ("ejax_test_rlds") in array_record format; returns its builder name."""
  import PIL.Image
  import tensorflow_datasets as tfds

  class EjaxTestRlds(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
          "steps": tfds.features.Dataset({
              "observation": tfds.features.FeaturesDict({
                  "image": tfds.features.Image(shape=(16, 16, 3)),
                  "state": tfds.features.Tensor(shape=(4,), dtype=np.float32)}),
              "action": tfds.features.Tensor(shape=(3,), dtype=np.float32),
              "language_instruction": tfds.features.Text(),
              "is_first": np.bool_, "is_last": np.bool_}),
      }))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples()}

    def _generate_examples(self):
      for episode in range(len(RLDS_LENGTHS)):
        steps = rlds_episode(episode)
        # TFDS encodes Image features from PIL images without TensorFlow (not from numpy).
        yield f"episode_{episode}", {"steps": [{
            "observation": {"image": PIL.Image.fromarray(s["image"]), "state": s["state"]},
            "action": s["action"], "language_instruction": s["instruction"],
            "is_first": t == 0, "is_last": t == len(steps) - 1} for t, s in enumerate(steps)]}

  tfds.disable_progress_bar()
  EjaxTestRlds(data_dir=data_dir, file_format="array_record").download_and_prepare()
  return "ejax_test_rlds"
