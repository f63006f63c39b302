"""pi0.5 input assembly: pipeline samples -> a packed model batch (numpy).

Per sample (from ejax.data): "observation.state" [state_dim] (normalised to [-1, 1]),
"observation.images.<cam>" uint8 [H, W, 3] (optionally "observation.images.<cam>_mask" False for
an absent camera), "action" [horizon, action_dim], "action_is_pad" [horizon], "task" str.

A sample's prefix is its present cameras' image tokens (256 per 224 px image) then its prompt
("Task: ..., State: <bins>;\\nAction: ", `paligemma_tokenizer`). Prefixes are packed with
`ejax.data.packing.pack_sequences` into `rows` rows of `packing.row_length` tokens, at most
`packing.samples_per_row` per row; each row has that many action-chunk slots. Absent cameras have
no image and no tokens; the image array holds `max_images_per_sample * n` slots (padding images are
encoded but never placed in a row: set max_images_per_sample to the cameras a dataset really has).

Batch keys (see ejax/models/pi05.py): images, prefix_tokens, prefix_is_image,
prefix_image_index, prefix_segment_ids, prefix_positions, suffix_segment_ids, suffix_positions,
sample_row_offset, sample_slot, actions, action_mask.

Indices between row arrays and per-sample / per-image arrays are stored relative to each array's
"home" position, so a global batch made by concatenating process-local batches (multi-host, same
shapes per process) stays correct without rewriting them (the convention of groot_inputs):
  row of sample i          = (i * num_rows) // n + sample_row_offset[i]
  image token at (row r, p) = ((r * n) // num_rows) * images_per_sample * patches_per_image
                              + prefix_image_index[r, p]      (where prefix_is_image)
`sample_rows` / `image_token_indices` give the absolute values.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from ejax.data import row_plan
from ejax.data.packing import pack_sequences
from ejax.errors import BatchError
from ejax.models import perception
from ejax.models.perception.targets import check_state, targets
from ejax.models.paligemma_tokenizer import PaligemmaTokenizer

IMAGE_PREFIX = "observation.images."
MASK_SUFFIX = "_mask"


def patches_per_image(model_config) -> int:
  return (model_config.vision.image_size // model_config.vision.patch_size) ** 2


def rows_for(model_config, num_samples: int) -> int:
  """Rows per batch, fixed by the batch size so batch shapes (and jit) stay static."""
  return max(1, math.ceil(num_samples / model_config.packing.samples_per_row))


def images_for(model_config, num_samples: int) -> int:
  """Image slots per batch: a whole number per sample, so concatenated batches keep the layout."""
  return num_samples * int(math.ceil(model_config.packing.max_images_per_sample))


def sample_rows(batch, xp=np):
  """Absolute row of every sample (module docstring); xp = numpy or jax.numpy."""
  n, num_rows = batch["sample_row_offset"].shape[0], batch["prefix_tokens"].shape[0]
  return (xp.arange(n) * num_rows) // n + batch["sample_row_offset"]


def image_token_indices(batch, patches: int, xp=np):
  """Absolute index into the flattened image tokens [num_images * patches] per prefix position."""
  n, num_rows = batch["sample_row_offset"].shape[0], batch["prefix_tokens"].shape[0]
  images_per_sample = batch["images"].shape[0] // n
  home_sample = (xp.arange(num_rows) * n) // num_rows
  return (home_sample * images_per_sample * patches)[:, None] + batch["prefix_image_index"]


def resize_with_pad(image: np.ndarray, size: int) -> np.ndarray:
  """Aspect-preserving resize onto a black size x size canvas (openpi's resize_with_pad)."""
  height, width = image.shape[:2]
  if height == size and width == size:
    return image
  from PIL import Image
  scale = size / max(height, width)
  new_w, new_h = max(1, round(width * scale)), max(1, round(height * scale))
  resized = np.asarray(Image.fromarray(image).resize((new_w, new_h), Image.BILINEAR))
  canvas = np.zeros((size, size, 3), np.uint8)
  top, left = (size - new_h) // 2, (size - new_w) // 2
  canvas[top:top + new_h, left:left + new_w] = resized
  return canvas


def _limit_samples_per_row(rows: list[list[int]], lengths: Sequence[int], row_length: int,
                           samples_per_row: int) -> list[list[int]]:
  """Best-fit packing may put more short samples in a row than it has action slots: move the
  extras, longest first, into rows with a free slot and room, else into new rows."""
  kept, overflow = [], []
  for members in rows:
    kept.append(list(members[:samples_per_row]))
    overflow += members[samples_per_row:]
  for i in sorted(overflow, key=lambda i: -lengths[i]):
    for members in kept:
      if len(members) < samples_per_row and sum(lengths[j] for j in members) + lengths[i] <= row_length:
        members.append(i)
        break
    else:
      kept.append([i])
  return kept


def assemble(model_config, prompts: Sequence[np.ndarray], images: Sequence[Sequence[np.ndarray]],
             actions: np.ndarray, action_masks: np.ndarray, *, num_rows: int | None = None,
             num_images: int | None = None, seed: int = 0, pack: bool = True,
             fit_rows: bool = False) -> dict[str, np.ndarray]:
  """Lays out token prompts and per-sample lists of present images ([S, S, 3] uint8) in rows.

  pack=False puts each sample alone in its own row: the one-by-one layout tests compare against.
  fit_rows: a batch whose samples need more rows than rows_for gets them (a policy's batch, whose
  shape may vary) instead of the error a training batch, whose shape is fixed, gets.
  """
  c = model_config
  n = len(prompts)
  per_image = patches_per_image(c)
  row_length, slots, horizon = c.packing.row_length, c.packing.samples_per_row, c.action_horizon
  lengths = [len(imgs) * per_image + len(p) for imgs, p in zip(images, prompts)]
  if pack:
    rows = pack_sequences(lengths, row_length, buffer_size=max(n, 1), seed=seed)
    rows = _limit_samples_per_row(rows, lengths, row_length, slots)
    num_rows = rows_for(c, n) if num_rows is None else num_rows
    num_rows = max(num_rows, len(rows)) if fit_rows else num_rows
  else:
    for i, length in enumerate(lengths):
      if length > row_length:
        raise BatchError(f"sample {i} has {length} prefix tokens > packing.row_length {row_length}")
    rows = [[i] for i in range(n)]
    num_rows = n if num_rows is None else num_rows
  if len(rows) > num_rows:
    raise BatchError(f"{n} samples need {len(rows)} rows of {row_length} tokens but the batch has {num_rows}: "
                     "raise config.model.packing.row_length or lower packing.samples_per_row")
  num_images = images_for(c, n) if num_images is None else num_images
  present = sum(len(imgs) for imgs in images)
  if present > num_images:
    raise BatchError(f"{n} samples have {present} images but the batch has {num_images} image slots: raise "
                     "config.model.packing.max_images_per_sample")
  size = c.vision.image_size
  image_array = np.zeros((num_images, size, size, 3), np.uint8)
  first_image = np.zeros(n, np.int64)
  cursor = 0
  for i, imgs in enumerate(images):
    first_image[i] = cursor
    for img in imgs:
      image_array[cursor] = img
      cursor += 1

  if num_images % n:
    raise ValueError(f"num_images {num_images} is not a whole number of image slots per sample ({n} samples)")
  images_per_sample = num_images // n
  tokens = np.zeros((num_rows, row_length), np.int32)
  is_image = np.zeros((num_rows, row_length), bool)
  image_index = np.zeros((num_rows, row_length), np.int32)
  segment_ids = np.zeros((num_rows, row_length), np.int32)
  positions = np.zeros((num_rows, row_length), np.int32)
  suffix_segment_ids = np.zeros((num_rows, slots * horizon), np.int32)
  suffix_positions = np.zeros((num_rows, slots * horizon), np.int32)
  sample_row_offset = np.zeros(n, np.int32)
  sample_slot = np.zeros(n, np.int32)
  for row, members in enumerate(rows):
    home_image_token = ((row * n) // num_rows) * images_per_sample * per_image
    offset = 0
    for slot, i in enumerate(members):
      segment = slot + 1
      image_tokens = len(images[i]) * per_image
      length = lengths[i]
      span = slice(offset, offset + length)
      segment_ids[row, span] = segment
      positions[row, span] = np.arange(length)
      is_image[row, offset:offset + image_tokens] = True
      image_index[row, offset:offset + image_tokens] = (first_image[i] * per_image + np.arange(image_tokens)
                                                        - home_image_token)
      tokens[row, offset + image_tokens:offset + length] = prompts[i]
      chunk = slice(slot * horizon, (slot + 1) * horizon)
      suffix_segment_ids[row, chunk] = segment
      suffix_positions[row, chunk] = length + np.arange(horizon)  # the suffix follows its prefix
      sample_row_offset[i], sample_slot[i] = row - (i * num_rows) // n, slot
      offset += length
  return {
      "images": image_array,
      "prefix_tokens": tokens, "prefix_is_image": is_image, "prefix_image_index": image_index,
      "prefix_segment_ids": segment_ids, "prefix_positions": positions,
      "suffix_segment_ids": suffix_segment_ids, "suffix_positions": suffix_positions,
      "sample_row_offset": sample_row_offset, "sample_slot": sample_slot,
      "actions": np.asarray(actions, np.float32), "action_mask": np.asarray(action_masks, np.float32),
  }


def _pad_to(x: np.ndarray, size: int, axis: int, what: str) -> np.ndarray:
  if x.shape[axis] > size:
    raise BatchError(f"{what} has {x.shape[axis]} dims > the model's {size}: raise config.model.{what}")
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return np.pad(x, pad)


def present_cameras(sample: dict) -> list[str]:
  """Camera keys of a sample in slot order, without those flagged absent by `<key>_mask` False."""
  keys = sorted(k for k in sample if k.startswith(IMAGE_PREFIX) and not k.endswith(MASK_SUFFIX)
                and not k.endswith("_is_pad"))
  return [k for k in keys if bool(np.all(sample.get(k + MASK_SUFFIX, True)))]


def collate(samples: list[dict], model_config, tokenizer: PaligemmaTokenizer, *, num_rows: int | None = None,
            seed: int = 0, pack: bool = True, aux_key: str | None = None,
            pixel_key: str | None = None, fit_rows: bool = False) -> dict[str, np.ndarray]:
  """Tokenises (task + discretised state), resizes, pads and packs pipeline samples into a batch; with
  model.perception also the state as a vector and the module's targets (`aux_key`, `pixel_key`)."""
  c = model_config
  settings = perception.read(c)
  prompts, images, actions, masks, states = [], [], [], [], []
  for index, sample in enumerate(samples):
    cameras = present_cameras(sample)
    if len(cameras) > c.num_cameras:
      raise BatchError(f"sample {index} has {len(cameras)} cameras {cameras} > config.model.num_cameras "
                       f"{c.num_cameras}")
    check_state(settings, np.asarray(sample["observation.state"]).size)
    state = _pad_to(np.asarray(sample["observation.state"], np.float32).reshape(-1), c.max_state_dim, 0,
                    "max_state_dim")
    states.append(state)
    # With model.perception the state's last slots are the module's (zero in the data): the prompt bins
    # only the data's own entries (the slots reach the expert through its conditioning instead).
    binned = state if settings is None else state[:settings.layout.data_dims]
    prompts.append(tokenizer.tokenize_prompt(str(sample["task"]), binned if c.get("discrete_state_input", True)
                                             else None))
    images.append([resize_with_pad(np.asarray(sample[k], np.uint8), c.vision.image_size) for k in cameras])
    action = np.asarray(sample["action"], np.float32)
    if action.shape[0] != c.action_horizon:
      raise BatchError(f"sample {index}: action chunk has {action.shape[0]} steps, the model's horizon is "
                       f"{c.action_horizon} (set the pipeline's action horizon to config.model.action_horizon)")
    real_steps = 1.0 - np.asarray(sample.get("action_is_pad", np.zeros(action.shape[0])), np.float32)
    mask = np.zeros((c.action_horizon, c.action_dim), np.float32)
    mask[:, :action.shape[1]] = real_steps[:, None]
    actions.append(_pad_to(action, c.action_dim, 1, "action_dim"))
    masks.append(mask)
  batch = assemble(c, prompts, images, np.stack(actions), np.stack(masks), num_rows=num_rows, seed=seed, pack=pack,
                   fit_rows=fit_rows)
  return with_perception(batch, c, np.stack(states), [s.get(aux_key) for s in samples] if aux_key else None,
                         [s.get(pixel_key) for s in samples] if pixel_key else None)


def with_perception(batch: dict, model_config, states: np.ndarray, aux_states=None, aux_pixels=None) -> dict:
  """The batch with what model.perception (or model.continuous_state) reads beside the prompt (the state
  as a vector [n, max_state_dim]) and what the module trains on (perception.targets); unchanged without
  either."""
  settings = perception.read(model_config)
  if settings is None:
    return dict(batch, state=states.astype(np.float32)) if model_config.get("continuous_state", False) else batch
  return dict(batch, state=states.astype(np.float32), **targets(settings, states.shape[0], aux_states, aux_pixels))


def make_collate(model_config, tokenizer: PaligemmaTokenizer | None = None, *, aux_key: str | None = None,
                 pixel_key: str | None = None, fit_rows: bool = False) -> Callable[[list[dict]], dict]:
  # The train job chooses an auto row from the dataset first (ejax.train.inputs); elsewhere (a policy
  # built from a config, not a checkpoint) the example batch's choice stands.
  model_config = example_config(model_config)
  tokenizer = tokenizer or PaligemmaTokenizer(model_config.tokenizer_path, max_len=model_config.max_token_len)
  return lambda samples: collate(samples, model_config, tokenizer, aux_key=aux_key, pixel_key=pixel_key,
                                 fit_rows=fit_rows)


def example_cameras(model_config) -> int:
  """Cameras present in every example sample: all image slots but the last, as one dataset has a fixed
  set (pi05_libero: the base and left-wrist cameras of three slots, the right wrist absent); every camera
  with model.perception, which reads each sample's cameras in turn."""
  if perception.read(model_config) is not None:
    return model_config.num_cameras
  return max(1, min(model_config.num_cameras, int(model_config.packing.max_images_per_sample)) - 1)


def _example_prompt_lengths(model_config, batch_size: int, rng: np.random.Generator) -> np.ndarray:
  """LIBERO-like prompts: "Task: <5-60 tokens>, State: <max_state_dim bins>;\nAction: " (~8 template
  tokens), capped at max_token_len. The packing config plays no part, so every layout of the same
  (batch_size, seed) holds the same samples."""
  c = model_config
  template = c.max_state_dim + 8
  low, high = min(template + 5, c.max_token_len), min(template + 60, c.max_token_len)
  return rng.integers(low, high + 1, batch_size)


def example_lengths(model_config, num_samples: int, seed: int = 0) -> list[int]:
  """Prefix tokens of each sample of `example_batch(model_config, num_samples, seed)`."""
  lengths = _example_prompt_lengths(model_config, num_samples, np.random.default_rng(seed))
  return [int(n) + example_cameras(model_config) * patches_per_image(model_config) for n in lengths]


def libero_like_lengths(model_config, num_samples: int, seed: int = 0) -> np.ndarray:
  """Prefix tokens of a LIBERO-like mix: the example batch's (two cameras of three slots, as
  pi05_libero feeds them; a 5-60-token instruction and the state's bins)."""
  return np.asarray(example_lengths(model_config, num_samples, seed))


def example_config(model_config, samples_per_batch: int | None = None):
  """model_config with packing.row_length = 0 (auto) resolved from the example batch's lengths, for
  batches of `samples_per_batch` samples a device (None: whole rows)."""
  return row_plan.resolve_for_examples(model_config, example_lengths, samples_per_batch)


def example_batch(model_config, batch_size: int, seed: int = 0, *, pack: bool = True) -> dict[str, np.ndarray]:
  """A real-shaped batch without a tokenizer: random prompt ids of LIBERO-like lengths
  (`_example_prompt_lengths`), `example_cameras` cameras per sample, padded action steps and dims.
  pack=False puts each sample alone in its own row (the padded layout)."""
  c = example_config(model_config)
  rng = np.random.default_rng(seed)
  size = c.vision.image_size
  prompts = [rng.integers(1, c.paligemma.vocab_size, int(n)) for n in _example_prompt_lengths(c, batch_size, rng)]
  images = [[rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(example_cameras(c))]
            for _ in range(batch_size)]
  actions = np.zeros((batch_size, c.action_horizon, c.action_dim), np.float32)
  masks = np.zeros_like(actions)
  for i in range(batch_size):
    dims = int(rng.integers(1, c.action_dim + 1))
    steps = c.action_horizon - int(rng.integers(0, c.action_horizon // 4 + 1))
    actions[i, :, :dims] = rng.uniform(-1, 1, (c.action_horizon, dims))
    masks[i, :steps, :dims] = 1.0
  batch = assemble(c, prompts, images, actions, masks, seed=seed, pack=pack)
  states = np.zeros((batch_size, c.max_state_dim), np.float32)
  settings = perception.read(c)
  if settings is not None or c.get("continuous_state", False):
    data_dims = settings.layout.data_dims if settings is not None else c.max_state_dim
    states[:, :data_dims] = rng.uniform(-1, 1, (batch_size, data_dims))
  return with_perception(batch, c, states)
