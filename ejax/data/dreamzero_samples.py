"""DreamZero's training samples from a LeRobot dataset (issue 32, deliverable 3): which frames, actions
and states one sample reads, the multi-camera grid its video is, and relative actions.

Model-agnostic numpy (ejax.data imports no model): ejax/models/dreamzero/inputs.py turns these
samples into DreamZero batches, and configs/dreamzero.py sets data.horizon / observation_offsets /
image_size from `data_settings`.

A sample starts at any step t of an episode (step granularity: the pipeline's global shuffle of steps).
With C chunks of A actions and V video frames a chunk (4 per latent frame: the VAE's time stride):
  video   1 + C * V frames, at steps t + k * s for k = 0 .. C * V, s = A / V (the 5B: 33 frames, V = 8,
          A = 24, s = 3), so chunk c's frames end at step t + (c + 1) * A, after its A actions;
  action  C * A actions, steps t .. t + C * A - 1 (the 5B: 4 chunks of 24);
  state   S a chunk (the 5B: 1), at steps t + c * A + j * A / S: what the robot read before the chunk.
Steps past the episode's end repeat its last frame and state and their actions are masked
(action_is_pad), as LeRobot pads.

The video is one image a frame: the cameras in a 2 x 2 grid of equal cells, in the official layout
(dreamzero0/dreamzero, DreamTransform._prepare_video): camera 0 top left, camera 1 bottom left, camera 2
top right, camera 3 bottom right; cells without a camera are black (the 5B's three cameras leave the
bottom right black; ejax.sim's two leave the right column black).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ejax.data.errors import DataError

GRID_CELLS = ((0, 0), (1, 0), (0, 1), (1, 1))   # (row, column) of cameras 0, 1, 2, 3
VAE_TIME_STRIDE = 4                             # video frames a latent frame (the first frame: one)


@dataclasses.dataclass(frozen=True)
class SamplePlan:
  """What one sample reads, in steps from its first one (module docstring)."""
  num_chunks: int = 4
  video_frames_per_chunk: int = 8
  actions_per_chunk: int = 24
  states_per_chunk: int = 1

  def __post_init__(self):
    if self.actions_per_chunk % self.video_frames_per_chunk:
      raise ValueError(f"error: {self.actions_per_chunk} actions a chunk do not split into its "
                       f"{self.video_frames_per_chunk} video frames: make actions_per_chunk a multiple of "
                       f"{self.video_frames_per_chunk} (4 x the latent frames a chunk)")
    if self.actions_per_chunk % self.states_per_chunk or (self.actions_per_chunk // self.states_per_chunk) % self.stride:
      raise ValueError(f"error: {self.states_per_chunk} states a chunk of {self.actions_per_chunk} actions do not fall "
                       f"on its video frames (every {self.stride} steps): pick states_per_chunk so that they do")

  @classmethod
  def for_latents(cls, num_chunks: int, frames_per_chunk: int, actions_per_chunk: int, states_per_chunk: int = 1):
    """The plan of a model layout counted in latent frames a chunk."""
    return cls(num_chunks, VAE_TIME_STRIDE * frames_per_chunk, actions_per_chunk, states_per_chunk)

  @property
  def stride(self) -> int:
    """Steps between two video frames."""
    return self.actions_per_chunk // self.video_frames_per_chunk

  @property
  def num_frames(self) -> int:
    return 1 + self.num_chunks * self.video_frames_per_chunk

  @property
  def num_actions(self) -> int:
    return self.num_chunks * self.actions_per_chunk

  @property
  def num_states(self) -> int:
    return self.num_chunks * self.states_per_chunk

  @property
  def frame_offsets(self) -> np.ndarray:
    """[num_frames] steps of the video frames (the pipeline's data.observation_offsets)."""
    return self.stride * np.arange(self.num_frames)

  @property
  def state_steps(self) -> np.ndarray:
    """[num_states] steps of the states."""
    chunk = np.repeat(np.arange(self.num_chunks), self.states_per_chunk) * self.actions_per_chunk
    within = np.tile(np.arange(self.states_per_chunk), self.num_chunks) * (self.actions_per_chunk // self.states_per_chunk)
    return chunk + within

  @property
  def state_frames(self) -> np.ndarray:
    """[num_states] indices into the frames (the state is read at every frame offset)."""
    return self.state_steps // self.stride


def cell_size(image_size: Sequence[int]) -> tuple[int, int]:
  """[height, width] of one camera's cell in a grid of image_size."""
  height, width = (int(s) for s in image_size)
  if height % 2 or width % 2:
    raise ValueError(f"error: the camera grid {height}x{width} does not split into 2 x 2 equal cells: make both even")
  return height // 2, width // 2


def data_settings(plan: SamplePlan, image_size: Sequence[int]) -> dict:
  """The config.data fields a DreamZero sample needs: the frame offsets (states are read there too), the
  actions a sample reads and each camera's size (one grid cell)."""
  return dict(observation_offsets=[int(x) for x in plan.frame_offsets], horizon=plan.num_actions,
              image_size=cell_size(image_size))


def check_data_settings(plan: SamplePlan, image_size: Sequence[int], data_config) -> None:
  """Raises one line naming the setting when config.data does not read what `plan` needs (a model
  layout changed without its data settings)."""
  wanted = data_settings(plan, image_size)
  offsets = [int(x) for x in data_config.get("observation_offsets", None) or [0]]
  if offsets != wanted["observation_offsets"]:
    raise ValueError(f"error: data.observation_offsets={offsets} but the DreamZero layout reads frames at "
                     f"{wanted['observation_offsets']}: set them from ejax.data.dreamzero_samples.data_settings "
                     "(configs/dreamzero.py does)")
  if int(data_config.get("horizon", 0)) != wanted["horizon"]:
    raise ValueError(f"error: data.horizon={data_config.get('horizon')} but a DreamZero sample reads "
                     f"{wanted['horizon']} actions ({plan.num_chunks} chunks of {plan.actions_per_chunk}): set "
                     f"data.horizon={wanted['horizon']}")


def _resize_frames(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
  if frames.shape[1:3] == tuple(size):
    return frames
  from ejax.data.transforms import resize
  return np.stack([resize(frame, size) for frame in frames])


def camera_grid(views: Sequence[np.ndarray], image_size: Sequence[int]) -> np.ndarray:
  """Cameras uint8 [T, h, w, 3] (or [h, w, 3]) -> the grid video uint8 [T, H, W, 3] (or [H, W, 3]): each
  camera resized to a cell, placed as GRID_CELLS says, the rest black."""
  if not 1 <= len(views) <= len(GRID_CELLS):
    raise DataError(f"the DreamZero camera grid holds 1 to {len(GRID_CELLS)} cameras, the samples have {len(views)}: "
                    "choose them with data.cameras")
  single = np.ndim(views[0]) == 3
  views = [np.asarray(v, np.uint8)[None] if single else np.asarray(v, np.uint8) for v in views]
  frames = views[0].shape[0]
  if any(v.shape[0] != frames for v in views):
    raise DataError(f"cameras hold different numbers of frames {[v.shape[0] for v in views]}")
  cell_h, cell_w = cell_size(image_size)
  grid = np.zeros((frames, 2 * cell_h, 2 * cell_w, 3), np.uint8)
  for view, (row, column) in zip(views, GRID_CELLS):
    grid[:, row * cell_h:(row + 1) * cell_h, column * cell_w:(column + 1) * cell_w] = _resize_frames(view, (cell_h, cell_w))
  return grid[0] if single else grid


def relative_actions(actions: np.ndarray, states: np.ndarray, num_dims: int, actions_per_state: int) -> np.ndarray:
  """actions [A, d] minus, on their first num_dims dims, the state [A / actions_per_state, ds] each one
  follows (the same leading dims: joint targets relative to the joints read before the chunk)."""
  if num_dims <= 0:
    return actions
  if num_dims > min(actions.shape[-1], states.shape[-1]):
    raise DataError(f"data.relative_action_dims={num_dims} exceeds the action ({actions.shape[-1]}) or state "
                    f"({states.shape[-1]}) size")
  out = np.array(actions, np.float32, copy=True)
  reference = np.repeat(np.asarray(states, np.float32)[:, :num_dims], actions_per_state, axis=0)
  out[:, :num_dims] -= reference[:out.shape[0]]
  return out
