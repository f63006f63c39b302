"""DreamZero's training sequence: [clean video | noisy video | actions | states] and its attention mask.

A sample of 4 chunks: 1 + 4 x 2 latent frames (33 video frames through the VAE's 4x time stride),
each latent frame `frame_tokens` tokens after the 1x2x2 patches (50 for the 5B's 160x320 three-camera
grid), then 4 x `actions_per_chunk` action tokens and 4 x `states_per_chunk` state tokens: 1,000 tokens
for the 5B (450 + 450 + 96 + 4).

The official teacher-forcing attention (dreamzero0/dreamzero, CausalWanSelfAttention with
action_register_length, per block of tokens):
- clean first frame: itself; clean tokens after it: every clean token up to and including themselves;
- noisy first frame: itself;
- noisy chunk i and action chunk i: the clean tokens before chunk i (first frame + chunks < i), noisy
  chunk i, action chunk i and state chunk i;
- state chunk i: itself.
ejax runs it as one attention call with mask kind "wam" (ejax.kernels.attention.reference): per token
an order key and a group (0 = the shared clean context). Clean tokens: group 0, key max(p, F - 1) for
clean index p (F = frame_tokens: the first frame sees itself whole). Noisy first frame: its own group,
key -1 (no clean key is that low). Chunk i's noisy video and actions: group i + 2, key = the number of
clean tokens before chunk i minus 1; its states: group i + 2, key -2, so states see only themselves
while video and actions see them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

STATE_KEY, FIRST_FRAME_KEY = -2, -1


@dataclasses.dataclass(frozen=True)
class Layout:
  """Token counts of one training sample; grid_height x grid_width patches a latent frame."""
  grid_height: int
  grid_width: int
  num_chunks: int = 4
  frames_per_chunk: int = 2        # latent frames (8 video frames)
  actions_per_chunk: int = 24
  states_per_chunk: int = 1

  @property
  def frame_tokens(self) -> int:
    return self.grid_height * self.grid_width

  @property
  def latent_frames(self) -> int:
    return 1 + self.num_chunks * self.frames_per_chunk

  @property
  def video_tokens(self) -> int:
    return self.latent_frames * self.frame_tokens

  @property
  def num_actions(self) -> int:
    return self.num_chunks * self.actions_per_chunk

  @property
  def num_states(self) -> int:
    return self.num_chunks * self.states_per_chunk

  @property
  def length(self) -> int:
    return 2 * self.video_tokens + self.num_actions + self.num_states


def wam_mask_ids(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
  """(order keys, groups), [length] int32 each: the "wam" mask's positions and block ids."""
  frame, chunk_tokens = layout.frame_tokens, layout.frames_per_chunk * layout.frame_tokens
  clean_keys = np.maximum(np.arange(layout.video_tokens), frame - 1)
  chunk_keys = frame + chunk_tokens * np.arange(layout.num_chunks) - 1  # last clean token before the chunk
  chunk_groups = np.arange(layout.num_chunks) + 2
  keys = np.concatenate([
      clean_keys,
      np.full(frame, FIRST_FRAME_KEY), np.repeat(chunk_keys, chunk_tokens),
      np.repeat(chunk_keys, layout.actions_per_chunk),
      np.full(layout.num_states, STATE_KEY)])
  groups = np.concatenate([
      np.zeros(layout.video_tokens, np.int64),
      np.ones(frame, np.int64), np.repeat(chunk_groups, chunk_tokens),
      np.repeat(chunk_groups, layout.actions_per_chunk),
      np.repeat(chunk_groups, layout.states_per_chunk)])
  return keys.astype(np.int32), groups.astype(np.int32)


def chunk_indices(layout: Layout, chunk: int) -> dict[str, np.ndarray]:
  """Positions in the teacher-forced sequence of chunk `chunk`'s clean context (every clean token
  before it), its noisy video, actions and states: what one chunk-by-chunk inference step runs."""
  if not 0 <= chunk < layout.num_chunks:
    raise ValueError(f"error: chunk {chunk} is outside the sample's {layout.num_chunks} chunks")
  chunk_tokens = layout.frames_per_chunk * layout.frame_tokens
  start = layout.frame_tokens + chunk * chunk_tokens
  actions0 = 2 * layout.video_tokens
  states0 = actions0 + layout.num_actions
  return dict(
      context=np.arange(start),
      video=layout.video_tokens + start + np.arange(chunk_tokens),
      actions=actions0 + chunk * layout.actions_per_chunk + np.arange(layout.actions_per_chunk),
      states=states0 + chunk * layout.states_per_chunk + np.arange(layout.states_per_chunk))


def _inverse_frequencies(dim: int, theta: float) -> np.ndarray:
  return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def rope_angles(layout: Layout, head_dim: int, theta: float = 10000.0) -> np.ndarray:
  """[length, head_dim // 2] rotation angles of Wan's RoPE for the whole sequence (float32).

  Video tokens (both streams, same positions): 3D, the head's pairs split into time
  (head_dim - 4 * (head_dim // 6) channels), height and width (2 * (head_dim // 6) each), position
  (frame, row, column). Actions and states: 1D over all head channels, position = index in their stream.
  """
  if head_dim % 2:
    raise ValueError(f"error: Wan RoPE needs an even head_dim, got {head_dim}; pick dim / num_heads even")
  spatial = 2 * (head_dim // 6)
  inv_t, inv_s = _inverse_frequencies(head_dim - 2 * spatial, theta), _inverse_frequencies(spatial, theta)
  f, h, w = np.meshgrid(np.arange(layout.latent_frames), np.arange(layout.grid_height),
                        np.arange(layout.grid_width), indexing="ij")
  video = np.concatenate([f.reshape(-1, 1) * inv_t, h.reshape(-1, 1) * inv_s, w.reshape(-1, 1) * inv_s], -1)
  inv_1d = _inverse_frequencies(head_dim, theta)
  actions = np.arange(layout.num_actions)[:, None] * inv_1d
  states = np.arange(layout.num_states)[:, None] * inv_1d
  return np.concatenate([video, video, actions, states]).astype(np.float32)


def direct_wam_mask(layout: Layout) -> np.ndarray:
  """[length, length] bool written block by block from the official code's teacher-forcing branch
  (the specification the "wam" ids are tested against)."""
  frame, chunk_tokens = layout.frame_tokens, layout.frames_per_chunk * layout.frame_tokens
  n = layout.length
  noisy0 = layout.video_tokens
  action0 = 2 * layout.video_tokens
  state0 = action0 + layout.num_actions
  mask = np.zeros((n, n), bool)
  mask[:frame, :frame] = True
  for p in range(frame, layout.video_tokens):
    mask[p, :p + 1] = True
  mask[noisy0:noisy0 + frame, noisy0:noisy0 + frame] = True
  for i in range(layout.num_chunks):
    clean_end = frame + i * chunk_tokens
    noisy = slice(noisy0 + frame + i * chunk_tokens, noisy0 + frame + (i + 1) * chunk_tokens)
    action = slice(action0 + i * layout.actions_per_chunk, action0 + (i + 1) * layout.actions_per_chunk)
    state = slice(state0 + i * layout.states_per_chunk, state0 + (i + 1) * layout.states_per_chunk)
    for rows in (noisy, action):
      mask[rows, :clean_end] = True
      mask[rows, noisy] = mask[rows, action] = mask[rows, state] = True
    mask[state, state] = True
  return mask
