"""Per-sample transforms: image resize / crop / colour jitter, state and action normalisation,
instruction tokenisation. Pure numpy; randomness only from the `rng` the pipeline passes in, so a
resumed pipeline reproduces the same augmentations.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
from PIL import Image

NORMALIZATION_MODES = ("mean_std", "quantile", "none")
_EPS = 1e-6
QUANTILE_FLAT = 1e-3   # quantile mode: q99 - q01 under this share of max - min counts as no spread


class Normalizer:
  """Maps state / action vectors to a unit range and back (the policy unnormalises its actions).

  mean_std: (x - mean) / std. quantile: q01 -> -1, q99 -> +1, linear beyond (openpi's pi0.5
  convention: the rare values outside stay outside, unclipped). Dimensions with no spread (std or
  q99 - q01 ~ 0) pass through unchanged, so a constant gripper channel does not blow up; in quantile
  mode so do dimensions whose q01..q99 spread is under QUANTILE_FLAT of their min..max range (one value
  for 98 % of the frames, others rare: ejax.sim's goal position over all 15 tasks, where q99 - q01 =
  7e-6 m against a 0.13 m range scaled the rare goals to ~3e4 and pi0.5's loss to ~1e7).
  """

  def __init__(self, stats: Mapping[str, Mapping[str, np.ndarray]], mode: str,
               keys: Sequence[str]):
    if mode not in NORMALIZATION_MODES:
      raise ValueError(f"data.normalization={mode!r}: use one of {NORMALIZATION_MODES}")
    self.mode, self.keys = mode, list(keys)
    self.params: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if mode == "none":
      return
    for key in self.keys:
      if key not in stats:
        raise ValueError(f"no normalisation statistics for {key!r} (have {sorted(stats)}): run "
                         "the stats job (--config.job=stats) or set data.normalization='none'")
      feature = stats[key]
      if mode == "mean_std":
        low, scale = np.asarray(feature["mean"]), np.asarray(feature["std"])
      else:
        if "q01" not in feature or "q99" not in feature:
          raise ValueError(f"statistics for {key!r} lack q01/q99: recompute them with the stats "
                           "job or use data.normalization='mean_std'")
        q01, q99 = np.asarray(feature["q01"]), np.asarray(feature["q99"])
        low, scale = (q01 + q99) / 2, (q99 - q01) / 2
        if "min" in feature and "max" in feature:
          spread = (np.asarray(feature["max"]) - np.asarray(feature["min"])) / 2
          scale = np.where(scale < QUANTILE_FLAT * spread, 0.0, scale)
      flat = scale.reshape(-1) < _EPS
      scale = np.where(flat.reshape(scale.shape), 1.0, scale)
      low = np.where(flat.reshape(low.shape), 0.0, low)
      self.params[key] = (low.astype(np.float32).reshape(-1), scale.astype(np.float32).reshape(-1))

  def normalize(self, key: str, values: np.ndarray) -> np.ndarray:
    if key not in self.params:
      return values
    center, scale = self.params[key]
    # No clipping in quantile mode (openpi's convention too): the 1 % of values beyond q01 / q99 are
    # real data. Clipping them cut every saturated move of ejax.sim's experts (a few % of each motion
    # axis) to the q99 speed, and replaying recorded actions through it succeeded in 13 % of
    # episodes instead of 100 % (tests/eval/test_closed_loop.py).
    return (np.asarray(values, np.float32) - center) / scale

  def unnormalize(self, key: str, values: np.ndarray) -> np.ndarray:
    if key not in self.params:
      return values
    center, scale = self.params[key]
    return np.asarray(values, np.float32) * scale + center

  def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
    for key in self.keys:
      if key in sample:
        sample[key] = self.normalize(key, sample[key])
    return sample


def resize(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
  """uint8 [H, W, 3] -> [size[0], size[1], 3], bilinear."""
  if image.shape[:2] == tuple(size):
    return image
  return np.asarray(Image.fromarray(image).resize((size[1], size[0]), Image.BILINEAR))


def random_crop_resize(image: np.ndarray, rng: np.random.Generator, scale: float) -> np.ndarray:
  """Crops a random window of `scale` x the side lengths and resizes it back (openpi-style)."""
  if scale >= 1.0:
    return image
  height, width = image.shape[:2]
  crop_h, crop_w = max(int(height * scale), 1), max(int(width * scale), 1)
  top = int(rng.integers(0, height - crop_h + 1))
  left = int(rng.integers(0, width - crop_w + 1))
  return resize(image[top:top + crop_h, left:left + crop_w], (height, width))


def colour_jitter(image: np.ndarray, rng: np.random.Generator, *, brightness: float,
                  contrast: float, saturation: float) -> np.ndarray:
  """Random brightness / contrast / saturation factors in [1 - x, 1 + x], as torchvision does."""
  if not (brightness or contrast or saturation):
    return image
  out = image.astype(np.float32)
  if brightness:
    out *= rng.uniform(1 - brightness, 1 + brightness)
  if contrast:
    mean = out.mean()
    out = (out - mean) * rng.uniform(1 - contrast, 1 + contrast) + mean
  if saturation:
    grey = out @ np.asarray([0.299, 0.587, 0.114], np.float32)
    out = (out - grey[..., None]) * rng.uniform(1 - saturation, 1 + saturation) + grey[..., None]
  return np.clip(out, 0, 255).astype(np.uint8)


def tokenize_instruction(sample: dict[str, Any], tokenizer: Callable[[str], Sequence[int]], *,
                         max_length: int, pad_id: int = 0) -> dict[str, Any]:
  """The tokenisation hook: `tokens` int32 [max_length] and `token_mask` bool from `task`.

  `tokenizer` is any str -> ids callable (the models' own tokenizer); too-long instructions are
  truncated, as openpi does at its 200-token prompt limit.
  """
  ids = list(tokenizer(str(sample["task"])))[:max_length]
  tokens = np.full((max_length,), pad_id, np.int32)
  tokens[:len(ids)] = ids
  sample["tokens"] = tokens
  sample["token_mask"] = np.arange(max_length) < len(ids)
  return sample


def make_sample_transform(data_config, normalizer: Normalizer | None,
                          image_keys: Sequence[str]) -> Callable[[dict, np.random.Generator], dict]:
  """The configured per-sample transform: augment images, then normalise state and action.

  Reads data.image_size, data.augment.{crop_scale, brightness, contrast, saturation}.
  """
  augment = data_config.get("augment", None) or {}
  crop_scale = float(augment.get("crop_scale", 1.0))
  jitter = {name: float(augment.get(name, 0.0)) for name in ("brightness", "contrast",
                                                             "saturation")}
  size = data_config.get("image_size", None)
  size = tuple(size) if size else None

  def transform(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    for key in image_keys:
      if key not in sample:
        continue
      images = sample[key]
      stacked = images if images.ndim == 4 else images[None]
      out = []
      for image in stacked:
        if size is not None:
          image = resize(image, size)
        image = random_crop_resize(image, rng, crop_scale)
        out.append(colour_jitter(image, rng, **jitter))
      sample[key] = np.stack(out) if images.ndim == 4 else out[0]
    return normalizer(sample) if normalizer is not None else sample

  return transform
