"""GR00T input assembly: pipeline samples -> a packed model batch (numpy).

Per sample (from ejax.data): "observation.state" [state_dim], "observation.images.<cam>" uint8
[H, W, 3] (any number of cameras, including none), "action" [horizon, action_dim], "action_is_pad"
[horizon], "task" str (or "task_index", written as "task <i>"), "embodiment_id" (default 0).

The VL stream of each sample (Eagle prompt with its image-context tokens) is packed with
`ejax.data.packing.pack_sequences` into `num_rows` rows of `row_length` tokens; per-sample arrays
keep one row each. State and actions are zero-padded to max_state_dim / max_action_dim and the
action mask marks real entries (not padded steps, not padded dims).

Batch keys:
  images [num_samples * num_cameras, S, S, 3] uint8
  vl_tokens, vl_segment_ids, vl_positions, vl_image_slot [num_rows, row_length] int32
  sample_row_offset, sample_segment, embodiment_id [n] int32
  state [n, max_state_dim], actions / action_mask [n, horizon, max_action_dim] float32
  aux_pixels [n, cameras * points * 2] float32   (model.perception.detectors.points > 0: keypoint labels)
  aux_state [n, estimate.dim] float32, aux_mask [n]   (model.perception.estimate.dim > 0:
                                       the training-only target, zeros and mask 0 where a sample has none)

Indices between the row arrays and the per-sample arrays are stored relative to each array's
"home" position, so a global batch made by concatenating process-local batches (multi-host,
same rows per process) stays correct without rewriting them:
  row of sample i             = (i * num_rows) // n + sample_row_offset[i]
  image token at (row r, pos) = ((r * n) // num_rows) * images_per_sample * tokens_per_image
                                + vl_image_slot[r, pos]    (where vl_tokens == image_token_id)
`sample_rows` / `image_token_indices` compute the absolute values.
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
from ejax.models.qwen_tokenizer import QwenTokenizer, eagle_prompt, load_tokenizer

IMAGE_PREFIX = "observation.images."


def tokens_per_image(model_config) -> int:
  patches = (model_config.vision.image_size // model_config.vision.patch_size) ** 2
  return patches // 4 if model_config.connector.use_pixel_shuffle else patches


def sample_rows(batch, xp=np):
  """Absolute row of every sample (see the module docstring); xp = numpy or jax.numpy."""
  n, num_rows = batch["sample_row_offset"].shape[0], batch["vl_tokens"].shape[0]
  return (xp.arange(n) * num_rows) // n + batch["sample_row_offset"]


def image_token_indices(batch, tokens_per_image: int, xp=np):
  """Absolute index into the flattened image tokens [num_images * tokens_per_image] per VL position."""
  n, num_rows = batch["sample_row_offset"].shape[0], batch["vl_tokens"].shape[0]
  images_per_sample = batch["images"].shape[0] // n
  home_sample = (xp.arange(num_rows) * n) // num_rows
  return (home_sample * images_per_sample * tokens_per_image)[:, None] + batch["vl_image_slot"]


def rows_for(model_config, num_samples: int) -> int:
  """Rows per batch: fixed by the batch size so that batch shapes (and jit) stay static."""
  return max(1, math.ceil(num_samples / model_config.packing.samples_per_row))


def batch_image_size(model_config) -> int:
  """The batch's image size: the vision tower's, or model.perception.image_size where that is larger
  (its detectors read the larger images, the tower an average-pooled copy)."""
  settings = perception.read(model_config)
  return max(int(model_config.vision.image_size), settings.image_size if settings else 0)


def _resize(image: np.ndarray, size: int) -> np.ndarray:
  if image.shape[0] == size and image.shape[1] == size:
    return image
  from PIL import Image
  return np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR))


def _pad_to(x: np.ndarray, size: int, axis: int, what: str) -> np.ndarray:
  if x.shape[axis] > size:
    raise BatchError(f"{what} has {x.shape[axis]} dims > the model's maximum {size}: raise config.model.max_{what}_dim")
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return np.pad(x, pad)


def assemble(model_config, prompts: Sequence[Sequence[int]], images: np.ndarray, states: np.ndarray,
             actions: np.ndarray, action_masks: np.ndarray, embodiment_ids: np.ndarray, *,
             num_rows: int | None = None, seed: int = 0, pack: bool = True,
             aux_states: Sequence[np.ndarray | None] | None = None,
             aux_pixels: Sequence[np.ndarray | None] | None = None, fit_rows: bool = False) -> dict[str, np.ndarray]:
  """Packs token prompts (image-context tokens marked by model_config.image_token_id) into rows;
  pack=False puts each sample alone in its own row (the padded, unpacked layout). fit_rows: samples
  that need more rows than rows_for get them (a policy's batch) instead of a training batch's error."""
  n = len(prompts)
  per_image = tokens_per_image(model_config)
  row_length = model_config.packing.row_length
  if pack:
    num_rows = rows_for(model_config, n) if num_rows is None else num_rows
    rows = pack_sequences([len(p) for p in prompts], row_length, buffer_size=max(n, 1), seed=seed)
    num_rows = max(num_rows, len(rows)) if fit_rows else num_rows
  else:
    num_rows = n if num_rows is None else num_rows
    rows = [[i] for i in range(n)]
  if len(rows) > num_rows:
    raise BatchError(f"{n} samples need {len(rows)} rows of {row_length} tokens but the batch has {num_rows}: "
                     f"raise config.model.packing.row_length or lower packing.samples_per_row")
  tokens = np.zeros((num_rows, row_length), np.int32)
  segment_ids = np.zeros((num_rows, row_length), np.int32)
  positions = np.zeros((num_rows, row_length), np.int32)
  image_slot = np.zeros((num_rows, row_length), np.int32)
  sample_row = np.zeros((n,), np.int32)
  sample_segment = np.zeros((n,), np.int32)
  images_per_sample = images.shape[0] // max(n, 1)  # 0 for datasets without cameras
  for row, members in enumerate(rows):
    offset = 0
    for segment, sample in enumerate(members, start=1):
      prompt = np.asarray(prompts[sample], np.int32)
      length = len(prompt)
      span = slice(offset, offset + length)
      tokens[row, span] = prompt
      segment_ids[row, span] = segment
      positions[row, span] = np.arange(length)
      is_image = prompt == model_config.image_token_id
      if is_image.sum() != images_per_sample * per_image:
        raise ValueError(f"sample {sample}'s prompt has {int(is_image.sum())} image tokens, expected "
                         f"{images_per_sample} images x {per_image}")
      home_sample = (row * n) // num_rows
      first_token = (sample - home_sample) * images_per_sample * per_image
      image_slot[row, offset + np.flatnonzero(is_image)] = first_token + np.arange(int(is_image.sum()))
      sample_row[sample], sample_segment[sample] = row, segment
      offset += length
  sample_row_offset = sample_row - (np.arange(n) * num_rows) // max(n, 1)
  batch = {
      "images": images.astype(np.uint8),
      "vl_tokens": tokens, "vl_segment_ids": segment_ids, "vl_positions": positions, "vl_image_slot": image_slot,
      "sample_row_offset": sample_row_offset.astype(np.int32), "sample_segment": sample_segment,
      "embodiment_id": np.asarray(embodiment_ids, np.int32),
      "state": states.astype(np.float32), "actions": actions.astype(np.float32),
      "action_mask": action_masks.astype(np.float32),
  }
  batch.update(targets(perception.read(model_config), n, aux_states, aux_pixels))
  return batch


def prompt_ids(model_config, tokenizer: QwenTokenizer, task: str, num_images: int) -> list[int]:
  """One sample's Eagle prompt as the model config lays it out (model.text_first: instruction first)."""
  return eagle_prompt(tokenizer, task, num_images, tokens_per_image(model_config),
                      image_token_id=model_config.image_token_id, text_first=model_config.get("text_first", False))


def collate(samples: list[dict], model_config, tokenizer: QwenTokenizer, *, num_rows: int | None = None,
            seed: int = 0, aux_key: str | None = None, pixel_key: str | None = None,
            fit_rows: bool = False) -> dict[str, np.ndarray]:
  """Tokenises, pads and packs pipeline samples into one GR00T batch; `aux_key` names the samples'
  target of model.perception's estimate, `pixel_key` its detectors' keypoint labels."""
  c = model_config
  settings = perception.read(c)
  cameras = sorted(k for k in samples[0] if k.startswith(IMAGE_PREFIX))
  if len(cameras) != c.num_cameras:
    raise BatchError(f"samples have {len(cameras)} cameras {cameras} but config.model.num_cameras={c.num_cameras}")
  prompts, images, states, actions, masks, embodiments = [], [], [], [], [], []
  for sample in samples:
    task = str(sample["task"]) if "task" in sample else f"task {int(sample['task_index'])}"
    prompts.append(prompt_ids(c, tokenizer, task, len(cameras)))
    images += [_resize(np.asarray(sample[k], np.uint8), batch_image_size(c)) for k in cameras]
    state = np.asarray(sample["observation.state"], np.float32)
    check_state(settings, state.shape[-1])
    states.append(_pad_to(state, c.max_state_dim, 0, "state"))
    action = np.asarray(sample["action"], np.float32)
    if action.shape[0] != c.action_horizon:
      raise BatchError(f"action chunk has {action.shape[0]} steps, the model's horizon is {c.action_horizon}")
    real_steps = 1.0 - np.asarray(sample.get("action_is_pad", np.zeros(action.shape[0])), np.float32)
    mask = np.zeros((c.action_horizon, c.max_action_dim), np.float32)
    mask[:, :action.shape[1]] = real_steps[:, None]
    actions.append(_pad_to(action, c.max_action_dim, 1, "action"))
    masks.append(mask)
    embodiments.append(int(sample.get("embodiment_id", 0)))
  size = batch_image_size(c)
  images = np.stack(images) if images else np.zeros((0, size, size, 3), np.uint8)
  aux_states = [sample.get(aux_key) for sample in samples] if aux_key else None
  aux_pixels = [sample.get(pixel_key) for sample in samples] if pixel_key else None
  return assemble(c, prompts, images, np.stack(states), np.stack(actions), np.stack(masks),
                  np.asarray(embodiments), num_rows=num_rows, seed=seed, aux_states=aux_states,
                  aux_pixels=aux_pixels, fit_rows=fit_rows)


def make_collate(model_config, tokenizer: QwenTokenizer | None = None, *, aux_key: str | None = None,
                 pixel_key: str | None = None, fit_rows: bool = False) -> Callable[[list[dict]], dict]:
  """collate bound to a tokenizer: config.model.tokenizer_path's Qwen BPE, or bytes when it is empty."""
  tokenizer = tokenizer or load_tokenizer(model_config.tokenizer_path, model_config.llm.vocab_size)
  # The train job chooses an auto row from the dataset first (ejax.train.inputs); elsewhere (a policy
  # built from a config, not a checkpoint) the example batch's choice stands.
  model_config = example_config(model_config)
  return lambda samples: collate(samples, model_config, tokenizer, aux_key=aux_key, pixel_key=pixel_key,
                                 fit_rows=fit_rows)


def _example_prompts(model_config, batch_size: int, rng: np.random.Generator) -> list[list[int]]:
  """The example batch's prompts: random ids around the image tokens, with instruction lengths that
  vary per sample (3-11 tokens) so rows really pack."""
  c = model_config
  per_image = tokens_per_image(c)
  text_vocab = min(c.llm.vocab_size, c.image_token_id)
  prompts = []
  for _ in range(batch_size):
    prompt = list(rng.integers(0, text_vocab, 2))
    for _ in range(c.num_cameras):
      prompt += [c.image_token_id] * per_image
    prompt += list(rng.integers(0, text_vocab, int(rng.integers(3, 12))))
    prompts.append(prompt)
  return prompts


def example_lengths(model_config, num_samples: int, seed: int = 0) -> list[int]:
  """VL tokens of each sample of `example_batch(model_config, num_samples, seed)`."""
  return [len(p) for p in _example_prompts(model_config, num_samples, np.random.default_rng(seed))]


def libero_like_lengths(model_config, num_samples: int, seed: int = 0) -> np.ndarray:
  """VL tokens of a LIBERO-like mix (benchmarks/scaling.py's): Eagle's 2 template tokens, the model's
  cameras' image tokens and an instruction of 5-60 tokens."""
  instruction = np.random.default_rng(seed).integers(5, 61, num_samples)
  return 2 + model_config.num_cameras * tokens_per_image(model_config) + instruction


def example_config(model_config, samples_per_batch: int | None = None):
  """model_config with packing.row_length = 0 (auto) resolved from the example batch's lengths, for
  batches of `samples_per_batch` samples a device (None: whole rows)."""
  return row_plan.resolve_for_examples(model_config, example_lengths, samples_per_batch)


def example_batch(model_config, batch_size: int, seed: int = 0, *, pack: bool = True) -> dict[str, np.ndarray]:
  """A real-shaped batch without a tokenizer (prompts: `_example_prompts`); pack=False puts each
  sample alone in its own row of packing.row_length tokens (the padded layout)."""
  c = example_config(model_config)
  rng = np.random.default_rng(seed)
  prompts = _example_prompts(c, batch_size, rng)
  size = batch_image_size(c)
  images = rng.integers(0, 256, (batch_size * c.num_cameras, size, size, 3), dtype=np.uint8)
  state_dims = rng.integers(1, c.max_state_dim + 1, batch_size)
  action_dims = rng.integers(1, c.max_action_dim + 1, batch_size)
  states = np.zeros((batch_size, c.max_state_dim), np.float32)
  actions = np.zeros((batch_size, c.action_horizon, c.max_action_dim), np.float32)
  masks = np.zeros_like(actions)
  for i in range(batch_size):
    states[i, :state_dims[i]] = rng.normal(size=state_dims[i])
    actions[i, :, :action_dims[i]] = rng.uniform(-1, 1, (c.action_horizon, action_dims[i]))
    real_steps = c.action_horizon - int(rng.integers(0, c.action_horizon // 4 + 1))
    masks[i, :real_steps, :action_dims[i]] = 1.0
  embodiments = rng.integers(0, c.max_num_embodiments, batch_size)
  return assemble(c, prompts, images, states, actions, masks, embodiments, seed=seed, pack=pack)
