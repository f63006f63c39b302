"""DreamZero samples from LeRobot datasets (issue 32, deliverable 3): frames at step granularity, chunks of
actions, one state a chunk, the 2 x 2 camera grid, relative actions. The dataset written here (ejax.sim's
cameras, state and action sizes and two of its instructions) also trains the checkpoint that
tests/models/test_dreamzero_policy.py evaluates and serves."""

import numpy as np
import pytest

from ejax.data import dreamzero_samples as samples_lib
from ejax.data import pipeline
from ejax.data.lerobot_writer import LeRobotV3Writer
from ejax.models.dreamzero import inputs
from ejax.models.dreamzero import model as dz
from ejax.models.dreamzero import tokenizer as tokenizer_lib
from tests.train.helpers import load_config

LENGTHS = (14, 6)                 # the second episode is shorter than a runlocal sample (8 actions, 9 frames)
TASKS = ("lift the green block", "open the drawer")
CAMERA = 32                       # recorded size: the cells of runlocal's 64 x 64 grid on recorded cameras


def _frames(length: int, episode: int, camera: int) -> np.ndarray:
  """Flat images whose level says the step (16 a step), the camera and the episode."""
  levels = 16 * np.arange(length) + 4 * camera + 2 * episode
  return np.broadcast_to(levels[:, None, None, None], (length, CAMERA, CAMERA, 3)).astype(np.uint8)


def write_dataset(root: str, labels: bool = False) -> str:
  """labels: also ejax.sim's object state (7) and keypoint labels (2 cameras x 2 points x (x, y)), the
  targets of model.perception (tests/models/test_dreamzero_perception.py)."""
  features = {
      "observation.images.agentview": {"dtype": "video", "shape": [CAMERA, CAMERA, 3]},
      "observation.images.wrist": {"dtype": "video", "shape": [CAMERA, CAMERA, 3]},
      "observation.state": {"dtype": "float32", "shape": [11], "names": None},   # ejax.sim's size
      "action": {"dtype": "float32", "shape": [4], "names": None},
  }
  if labels:
    features["observation.environment_state"] = {"dtype": "float32", "shape": [7], "names": None}
    features["observation.environment_pixels"] = {"dtype": "float32", "shape": [8], "names": None}
  writer = LeRobotV3Writer(root, fps=10, features=features, robot_type="test_arm")
  for episode, (length, task) in enumerate(zip(LENGTHS, TASKS)):
    steps = np.arange(length, dtype=np.float32)
    writer.add_episode({
        "observation.images.agentview": _frames(length, episode, 0),
        "observation.images.wrist": _frames(length, episode, 1),
        # state and action say (episode, step): state[0] = step, action[0] = 100 + step
        "observation.state": np.stack([steps, np.full(length, episode), *np.zeros((9, length))], 1).astype(np.float32),
        "action": np.stack([100 + steps, np.full(length, episode), np.ones(length), -steps], 1).astype(np.float32),
        **({"observation.environment_state": np.tile(np.linspace(-1, 1, 7, dtype=np.float32), (length, 1)) + steps[:, None],
            "observation.environment_pixels": np.tile(np.linspace(-0.5, 0.5, 8, dtype=np.float32), (length, 1))}
           if labels else {}),
    }, task=task)
  writer.finalize()
  return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
  return write_dataset(str(tmp_path_factory.mktemp("dz_lerobot") / "dataset"))


def test_sample_plan_of_the_published_and_runlocal_layouts():
  five = inputs.sample_plan(dz.model_config("5b"))
  # 33 frames 3 steps apart (8 a chunk for 24 actions), 4 chunks of 24 actions, the state before each chunk.
  assert (five.num_frames, five.stride, five.num_actions, five.num_states) == (33, 3, 96, 4)
  np.testing.assert_array_equal(five.frame_offsets, 3 * np.arange(33))
  np.testing.assert_array_equal(five.state_steps, [0, 24, 48, 72])
  np.testing.assert_array_equal(five.state_frames, [0, 8, 16, 24])
  local = inputs.sample_plan(dz.model_config("runlocal"))
  assert (local.num_frames, local.stride, local.num_actions, local.num_states) == (9, 1, 8, 2)
  settings = inputs.data_settings(dz.model_config("5b"))
  assert settings["horizon"] == 96 and settings["image_size"] == (80, 160)
  with pytest.raises(ValueError, match="multiple of 8"):
    samples_lib.SamplePlan(video_frames_per_chunk=8, actions_per_chunk=20)


def test_camera_grid_is_the_official_layout():
  views = [np.full((2, 4, 6, 3), 10 * (i + 1), np.uint8) for i in range(4)]
  grid = samples_lib.camera_grid(views[:3], (8, 12))
  assert grid.shape == (2, 8, 12, 3)
  # camera 0 top left, 1 bottom left, 2 top right, the bottom right black
  assert [int(grid[0, r, c, 0]) for r, c in ((0, 0), (4, 0), (0, 6), (4, 6))] == [10, 20, 30, 0]
  two = samples_lib.camera_grid([v[0] for v in views[:2]], (4, 6))   # one frame, cells resized to 2 x 3
  assert two.shape == (4, 6, 3) and int(two[0, 0, 0]) == 10 and int(two[2, 0, 0]) == 20 and not two[:, 3:].any()
  assert int(samples_lib.camera_grid(views, (8, 12))[0, 4, 6, 0]) == 40


def test_relative_actions_subtract_each_chunks_state():
  actions = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
  states = np.asarray([[1.0, 2.0], [10.0, 20.0]])
  out = samples_lib.relative_actions(actions, states, 2, 4)
  np.testing.assert_allclose(out[:4, :2], actions[:4, :2] - [1, 2])
  np.testing.assert_allclose(out[4:, :2], actions[4:, :2] - [10, 20])
  np.testing.assert_array_equal(out[:, 2], actions[:, 2])


def test_byte_tokens_are_umt5_shaped():
  ids, mask = tokenizer_lib.tokenize(tokenizer_lib.ByteTokenizer(512), ["open  the drawer", "x" * 40], 16)
  assert ids[0, :4].tolist() == [ord("o") + 3, ord("p") + 3, ord("e") + 3, ord("n") + 3]
  assert mask[0].sum() == len("open the drawer") + 1 and ids[0, mask[0].sum() - 1] == tokenizer_lib.EOS
  assert mask[1].all() and ids[1, -1] == tokenizer_lib.EOS          # truncated, </s> kept last


def _config(dataset, arg="runlocal", **data):
  config = load_config("configs/dreamzero.py", f"{arg},dataset={dataset}")
  config.data.update(normalization="none", shuffle=False, num_workers=0, prefetch=0, **data)
  return config


def _batch(config, size):
  collate = inputs.make_collate(config.model, config.data)
  with pipeline.build_pipeline(config.data, batch_size=size, seed=0, collate=collate) as samples:
    return next(samples)


def test_lerobot_batches_read_frames_actions_and_states_step_by_step(dataset):
  config = _config(dataset)
  assert list(config.data.observation_offsets) == list(range(9)) and config.data.horizon == 8
  batch = _batch(config, sum(LENGTHS))      # every step in order: episode 0's, then episode 1's
  example = dz.example_batch(config.model, 1)
  assert set(batch) == set(example) - {"latents"} | {"video"}
  assert batch["video"].shape == (20, 9, 64, 64, 3) and batch["video"].dtype == np.uint8
  for key in set(example) - {"latents"}:
    assert batch[key].shape[1:] == example[key].shape[1:] and batch[key].dtype == example[key].dtype, key
  starts = [(0, t) for t in range(LENGTHS[0])] + [(1, t) for t in range(LENGTHS[1])]
  for i, (episode, t) in enumerate(starts):
    steps = np.minimum(t + np.arange(9), LENGTHS[episode] - 1)       # past the end: the last frame again
    agentview, wrist = batch["video"][i, :, 2, 2, 0], batch["video"][i, :, 34, 2, 0]
    np.testing.assert_allclose(agentview, 16 * steps + 2 * episode, atol=3)
    np.testing.assert_allclose(wrist, 16 * steps + 4 + 2 * episode, atol=3)
    assert not batch["video"][i, :, :, 32:].any()                    # two cameras: the right column is black
    # the state before each chunk of 4 actions: steps t and t + 4
    np.testing.assert_array_equal(batch["state"][i, :, 0], np.minimum(t + np.asarray([0, 4]), LENGTHS[episode] - 1))
    real = t + np.arange(8) < LENGTHS[episode]
    np.testing.assert_array_equal(batch["action_mask"][i, :, 0], real)
    np.testing.assert_array_equal(batch["actions"][i, real, 0], 100 + t + np.arange(8)[real])
    prompt = TASKS[episode].encode()
    assert batch["text_ids"][i, :len(prompt)].tolist() == [b + 3 for b in prompt]
  first = batch["first_frame"][0]                                    # CLIP's view of frame 0, in [-1, 1]
  assert first.shape == (28, 28, 3) and abs(first[2, 2, 0] - (0 / 127.5 - 1)) < 0.05


def test_relative_actions_are_taken_off_and_added_back(dataset):
  config = _config(dataset, relative_action_dims=1)
  batch = _batch(config, 4)
  # action[0] = 100 + step, state[0] = step at the chunk's start: 100 + k within chunk k's 4 steps
  np.testing.assert_array_equal(batch["actions"][0, :, 0], 100 + np.tile(np.arange(4), 2))
  np.testing.assert_array_equal(batch["action_reference"][0, :, 0], np.repeat([0, 4], 4))
  np.testing.assert_array_equal(batch["actions"][0, :, 1:], _batch(_config(dataset), 4)["actions"][0, :, 1:])


def test_mismatched_data_settings_are_one_line_errors(dataset):
  config = _config(dataset)
  config.data.horizon = 16
  with pytest.raises(ValueError, match=r"data.horizon=16 .* reads 8 actions"):
    inputs.make_collate(config.model, config.data)

