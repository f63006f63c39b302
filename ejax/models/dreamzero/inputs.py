"""DreamZero's batches from the input pipeline's samples (the role groot_inputs.py plays for GR00T).

A DreamZero batch (model.example_batch has the same keys and shapes):
  latents [n, 1 + chunks * frames_per_chunk, h, w, z]   VAE latents computed ahead (or "video", which the
                                                        model encodes with its frozen VAE)
  text_ids, text_mask [n, text_length]                  umT5 token ids of the instruction, padded
  first_frame [n, S, S, 3] in [-1, 1]                   CLIP's view of the first frame
  state [n, chunks * states_per_chunk, max_state_dim]   one state per chunk, zero-padded
  actions, action_mask [n, chunks * actions_per_chunk, action_dim], embodiment_id [n]

ejax/data/synthetic.py has no cameras and one state a sample, so its batches are synthetic in the
video too: the latent frames are a fixed function of the state, the task and the chunk's actions
(a world that moves as the actions say), the first frame a fixed function of the state, the prompt a
fixed token sequence per task. That makes the video loss as learnable as the action loss; it is a
smoke test of the training path, not of video prediction (LeRobot video samples: issue 32, deliverable 3).
"""

from __future__ import annotations

import numpy as np

from ejax.models.dreamzero import model as dz
from ejax.models.dreamzero.image_encoder import ClipVisionConfig
from ejax.models.dreamzero.text_encoder import UMT5Config

_WORLD_SEED = 20261127


def _world(model_config, state_dim: int, action_dim: int):
  """The synthetic world's fixed maps (one draw per config, the same in every process)."""
  lay = dz.layout(model_config)
  vae = dz.vae_config(model_config)
  height, width = model_config.image_size
  pixels = (height // vae.spatial_stride) * (width // vae.spatial_stride) * vae.z_dim
  rng = np.random.default_rng(_WORLD_SEED)
  image = ClipVisionConfig(**model_config.image).image_size
  return dict(
      state_to_latent=rng.standard_normal((state_dim, pixels)) / np.sqrt(state_dim),
      action_to_latent=rng.standard_normal((action_dim, pixels)) / np.sqrt(action_dim),
      state_to_image=rng.standard_normal((state_dim, image * image * 3)) / np.sqrt(state_dim),
      grid=(lay.latent_frames, height // vae.spatial_stride, width // vae.spatial_stride, vae.z_dim),
      image=image)


def synthetic_collate(model_config):
  """collate(list of ejax/data/synthetic.py samples) -> a DreamZero batch (module docstring)."""
  lay = dz.layout(model_config)
  text = UMT5Config(**model_config.text)
  text_length = model_config.text_length
  prompt_length = min(4, text_length)

  def collate(samples: list[dict]) -> dict[str, np.ndarray]:
    n = len(samples)
    states = np.stack([np.asarray(s["observation.state"], np.float32) for s in samples])
    actions = np.stack([np.asarray(s["action"], np.float32) for s in samples])
    pad = np.stack([np.asarray(s["action_is_pad"], bool) for s in samples])
    tasks = np.asarray([int(s["task_index"]) for s in samples])
    if actions.shape[1] != lay.num_actions:
      raise ValueError(f"error: DreamZero takes {lay.num_actions} actions a sample ({lay.num_chunks} chunks of "
                       f"{lay.actions_per_chunk}), the data gives {actions.shape[1]}: set model.horizon to "
                       f"{lay.num_actions}")
    world = _world(model_config, states.shape[1], actions.shape[2])
    frames, h, w, z = world["grid"]
    # Frame 0 from the state; the frames of chunk c move by the mean of chunk c's actions.
    chunk_means = actions.reshape(n, lay.num_chunks, lay.actions_per_chunk, -1).mean(2)
    moves = np.cumsum(chunk_means @ world["action_to_latent"], axis=1)              # [n, chunks, pixels]
    moves = np.repeat(moves, lay.frames_per_chunk, axis=1)
    base = states @ world["state_to_latent"]
    latents = np.tanh(np.concatenate([base[:, None], base[:, None] + moves], axis=1)).reshape(n, frames, h, w, z)
    first = np.tanh(states @ world["state_to_image"]).reshape(n, world["image"], world["image"], 3)
    ids = (tasks[:, None] * 7 + np.arange(text_length)[None] + 1) % (text.vocab_size - 1) + 1
    state = np.zeros((n, lay.num_states, model_config.max_state_dim), np.float32)
    state[:, :, :states.shape[1]] = states[:, None, :model_config.max_state_dim]
    full_actions = np.zeros((n, lay.num_actions, model_config.action_dim), np.float32)
    full_actions[:, :, :actions.shape[2]] = np.clip(actions, -1, 1)
    mask = np.zeros_like(full_actions)
    mask[:, :, :actions.shape[2]] = (~pad)[:, :, None]
    return {
        "latents": latents.astype(np.float32),
        "text_ids": ids.astype(np.int32),
        "text_mask": np.arange(text_length)[None].repeat(n, 0) < prompt_length,
        "first_frame": first.astype(np.float32),
        "state": state,
        "actions": full_actions,
        "action_mask": mask,
        "embodiment_id": np.zeros((n,), np.int32),
    }

  return collate


def make_collate(model_config, data_config=None):
  name = (data_config or {}).get("name", "synthetic") if data_config is not None else "synthetic"
  if name != "synthetic":
    raise ValueError(f"error: DreamZero reads data.name='synthetic' so far (issue 32, deliverable 3 brings "
                     f"LeRobot video samples), got {name!r}: use configs/dreamzero.py:runlocal")
  return synthetic_collate(model_config)
