"""DreamZero's batches from the input pipeline's samples (the role groot_inputs.py plays for GR00T).

A DreamZero batch (model.example_batch has the same keys and shapes):
  latents [n, 1 + chunks * frames_per_chunk, h, w, z]   VAE latents computed ahead, or
  video uint8 [n, 1 + 4 * chunks * frames_per_chunk, H, W, 3]  the camera grid, which the model encodes
                                                        with its frozen VAE in the train step (LeRobot
                                                        samples; at inference one frame, [n, 1, H, W, 3])
  text_ids, text_mask [n, text_length]                  umT5 token ids of the instruction, padded
  first_frame [n, S, S, 3] in [-1, 1]                   CLIP's view of the first frame
  state [n, chunks * states_per_chunk, max_state_dim]   one state per chunk, zero-padded
  actions, action_mask [n, chunks * actions_per_chunk, action_dim], embodiment_id [n]
  action_reference [n, chunks * actions_per_chunk, action_dim]   with data.relative_action_dims > 0: what
                                                        was taken off the actions (the chunk's state), which
                                                        sampling adds back
  images uint8 [n * cameras, S, S, 3]                   with model.perception: each sample's cameras at the
                                                        current (first) frame, S = perception_image_size;
                                                        and its targets aux_state, aux_mask, aux_pixels
                                                        (ejax/models/perception/targets.py; data.aux_state_key,
                                                        data.aux_pixel_key), the state's last slots left zero

LeRobot samples (data.name lerobot / sim_demos; ejax/data/dreamzero_samples.py says which frames,
actions and states a sample reads and lays the cameras out as a 2 x 2 grid): `lerobot_collate`. The
same collate takes the eval / serve policy's one-frame observations (ejax.train.policy): the grid of
the current frame, the state repeated for every chunk, the prompt; the model samples chunk 0 from it.

ejax/data/synthetic.py has no cameras and one state a sample, so its batches are synthetic in the
video too: the latent frames are a fixed function of the state, the task and the chunk's actions
(a world that moves as the actions say), the first frame a fixed function of the state, the prompt a
fixed token sequence per task. That makes the video loss as learnable as the action loss; it is a
smoke test of the training path, not of video prediction (LeRobot video samples: issue 32, deliverable 3).
"""

from __future__ import annotations

import numpy as np

from ejax.data import dreamzero_samples as samples_lib
from ejax.errors import BatchError
from ejax.models import perception
from ejax.models.dreamzero import model as dz
from ejax.models.dreamzero.image_encoder import ClipVisionConfig
from ejax.models.dreamzero.text_encoder import UMT5Config
from ejax.models.perception import targets as perception_targets

_WORLD_SEED = 20261127
IMAGE_PREFIX = "observation.images."


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


def sample_plan(model_config) -> samples_lib.SamplePlan:
  """ejax/data/dreamzero_samples.py's plan of the model's layout (its VAE's time stride is 4)."""
  lay = dz.layout(model_config)
  return samples_lib.SamplePlan.for_latents(lay.num_chunks, lay.frames_per_chunk, lay.actions_per_chunk,
                                            lay.states_per_chunk)


def data_settings(model_config) -> dict:
  """config.data's frame offsets, horizon and camera size for the model's samples (configs/dreamzero.py)."""
  settings = samples_lib.data_settings(sample_plan(model_config), model_config.image_size)
  if perception.read(model_config) is not None:   # the cameras at the perception module's size where larger
    size = max(dz.perception_image_size(model_config), *settings["image_size"])
    settings["image_size"] = (size, size)
  return settings


def _pad_dims(x: np.ndarray, size: int, what: str) -> np.ndarray:
  if x.shape[-1] > size:
    raise BatchError(f"the data's {what} has {x.shape[-1]} dims > the model's {size}: raise config.model."
                     f"{'max_state_dim' if what == 'state' else 'action_dim'}")
  return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _current_frame(view, size: int) -> np.ndarray:
  """A camera's first frame ([T, h, w, 3] sample or [h, w, 3] observation) as uint8 [size, size, 3]."""
  from ejax.data.transforms import resize
  frame = np.asarray(view, np.uint8)
  return resize(frame[0] if frame.ndim == 4 else frame, (size, size))


def lerobot_collate(model_config, data_config):
  """collate(list of LeRobot samples, or the policy's one-frame observations) -> a DreamZero batch."""
  from ejax.models.dreamzero import tokenizer as tokenizer_lib
  from ejax.data.transforms import resize
  plan, lay = sample_plan(model_config), dz.layout(model_config)
  samples_lib.check_data_settings(plan, model_config.image_size, data_config)
  state_key = data_config.get("state_key", "observation.state")
  cameras = [c if c.startswith(IMAGE_PREFIX) else IMAGE_PREFIX + c for c in data_config.get("cameras", None) or []]
  relative_dims = int(data_config.get("relative_action_dims", 0) or 0)
  tokenizer = tokenizer_lib.load_tokenizer(model_config.get("tokenizer_path", ""),
                                           UMT5Config(**model_config.text).vocab_size)
  clip_size = ClipVisionConfig(**model_config.image).image_size
  image_size = tuple(model_config.image_size)
  settings = perception.read(model_config)
  aux_key, pixel_key = data_config.get("aux_state_key", None), data_config.get("aux_pixel_key", None)

  def collate(samples: list[dict]) -> dict[str, np.ndarray]:
    keys = cameras or sorted(k for k in samples[0] if k.startswith(IMAGE_PREFIX) and not k.endswith("_is_pad"))
    if not keys:
      raise BatchError("DreamZero samples carry no camera ('observation.images.*'): the model predicts video")
    if settings is not None and len(keys) != settings.num_cameras:
      raise BatchError(f"model.perception reads {settings.num_cameras} cameras a sample, the samples have {keys}: "
                       "choose them with data.cameras or set model.num_cameras")
    videos, states, actions, masks, references, prompts, images = [], [], [], [], [], [], []
    for sample in samples:
      video = samples_lib.camera_grid([sample[k] for k in keys], image_size)
      if settings is not None:
        images += [_current_frame(sample[k], dz.perception_image_size(model_config)) for k in keys]
      state = np.asarray(sample[state_key], np.float32)
      action = np.asarray(sample["action"], np.float32)
      real = ~np.asarray(sample.get("action_is_pad", np.zeros(action.shape[0], bool)), bool)
      if video.ndim == 3:                       # the policy's observation: the current frame alone
        video, state = video[None], np.repeat(state[None], lay.num_states, 0)
        if action.shape[0] != lay.actions_per_chunk:
          raise BatchError(f"a DreamZero observation acts one chunk of {lay.actions_per_chunk} actions, the policy "
                           f"asks for {action.shape[0]}")
        action = np.concatenate([action, np.zeros((lay.num_actions - action.shape[0], action.shape[1]), np.float32)])
        real = np.zeros(lay.num_actions, bool)
      else:
        if video.shape[0] != plan.num_frames or action.shape[0] != plan.num_actions:
          raise BatchError(f"a DreamZero sample holds {plan.num_frames} frames and {plan.num_actions} actions, this one "
                           f"{video.shape[0]} and {action.shape[0]}: set data from dreamzero inputs.data_settings")
        state = state[plan.state_frames]
      if settings is not None:
        perception_targets.check_state(settings, state.shape[-1])
      relative = samples_lib.relative_actions(action, state, relative_dims, lay.actions_per_chunk // lay.states_per_chunk)
      references.append(_pad_dims(action - relative, model_config.action_dim, "action"))
      videos.append(video)
      states.append(_pad_dims(state, model_config.max_state_dim, "state"))
      actions.append(_pad_dims(relative, model_config.action_dim, "action"))
      mask = np.zeros((lay.num_actions, model_config.action_dim), np.float32)
      mask[:, :action.shape[1]] = real[:, None]
      masks.append(mask)
      prompts.append(str(sample["task"]) if "task" in sample else f"task {int(sample.get('task_index', 0))}")
    ids, text_mask = tokenizer_lib.tokenize(tokenizer, prompts, model_config.text_length)
    video = np.stack(videos)
    first = np.stack([resize(v[0], (clip_size, clip_size)) for v in video]).astype(np.float32) / 127.5 - 1.0
    batch = {
        "video": video,
        "text_ids": ids,
        "text_mask": text_mask,
        "first_frame": first,
        "state": np.stack(states).astype(np.float32),
        "actions": np.stack(actions).astype(np.float32),
        "action_mask": np.stack(masks),
        "embodiment_id": np.asarray([int(s.get("embodiment_id", 0)) for s in samples], np.int32),
    }
    if relative_dims:
      batch["action_reference"] = np.stack(references).astype(np.float32)
    if settings is not None:
      batch["images"] = np.stack(images)
      batch.update(perception_targets.targets(settings, len(samples),
                                              [s.get(aux_key) for s in samples] if aux_key else None,
                                              [s.get(pixel_key) for s in samples] if pixel_key else None))
    return batch

  return collate


def make_collate(model_config, data_config=None, *, inference: bool = False):
  """The collate of data.name: synthetic (the smoke-test world above) or a LeRobot dataset (lerobot,
  sim_demos, or the policy's observations of a checkpoint trained on one). Nothing is packed, so a
  policy's batch (`inference`) is laid out as a training batch."""
  name = data_config.get("name", "synthetic") if data_config is not None else "synthetic"
  if name == "synthetic":
    return synthetic_collate(model_config)
  if name in ("lerobot", "sim_demos"):
    return lerobot_collate(model_config, data_config)
  raise ValueError(f"error: DreamZero reads data.name synthetic, lerobot or sim_demos, got {name!r}")
