"""What DreamZero's encoder cache holds (issue 32 point 3; the job: ejax/train/encode.py, the format:
ejax/data/encoder_cache.py).

The frozen encoders' outputs replace their inputs in each cached sample: `latents` (the VAE's, of the
camera-grid video) for `video`, `image_embeddings` (CLIP's, of the first frame) for `first_frame`; the
prompts' umT5 embeddings are a table encoded once per distinct prompt (a dataset has few; the 5B's
512 x 4096 bf16 would be 4 MiB a sample), stored up to the prompt's last token (umT5 writes zeros
past it) and gathered by `prompt_index`. Every other field of the collated batch (state, actions,
masks, text ids, perception's images and targets) is kept as it is, so a cached batch is the in-step
batch with the encoders already run and model.encode_context skips them.

A cache is valid for the settings in `cache_inputs` (every model setting but the trained DiT's and
sampling's, the compute dtype, every data setting but the reading machinery's) and for the frozen
weights' fingerprint (FROZEN). Augmentation (data.augment) is drawn once, when the cache is written:
the cached run sees one augmentation of each sample for every epoch, where the in-step run draws a
fresh one each epoch (off in configs/dreamzero.py; turn the cache off to keep fresh draws).
"""

from __future__ import annotations

import numpy as np

FROZEN = ("text_encoder", "image_encoder", "vae")
REPLACED = ("video", "first_frame")          # encoder inputs the cache does not store
# Model settings that change only the trained DiT or sampling, and data settings that change only how
# samples are read (not which samples or their values): a cache stays valid across them.
_TRAINED_ONLY = ("dit", "remat", "attention_impl", "scan_layers", "num_inference_steps", "cfg_scale")
_READING_ONLY = ("shuffle", "num_epochs", "num_workers", "prefetch", "read_threads", "max_open_videos",
                 "skip_limit", "encoder_cache", "encoder_cache_refresh")


def cache_inputs(config) -> list[str]:
  """The dotted config paths the cached values depend on (checked against the run's config)."""
  model = [f"model.{k}" for k in sorted(config.model.keys()) if k not in _TRAINED_ONLY]
  data = [f"data.{k}" for k in sorted(config.data.keys()) if k not in _READING_ONLY]
  return model + data + ["train.compute_dtype"]


def encode_samples(model, batch) -> dict:
  """The per-sample encoder outputs of a collated batch (the same calls as model.encode_context)."""
  return {"latents": model.encode_video(batch["video"]), "image_embeddings": model.image_encoder(batch["first_frame"])}


def encode_prompts(model, text_ids, text_mask):
  return model.text_encoder(text_ids, text_mask)


class PromptTable:
  """Distinct prompts (their token ids and mask) in order of first use; index() numbers each sample's."""

  def __init__(self):
    self.index_of: dict[bytes, int] = {}
    self.ids, self.masks = [], []

  def index(self, text_ids: np.ndarray, text_mask: np.ndarray) -> np.ndarray:
    out = []
    for ids, mask in zip(np.asarray(text_ids), np.asarray(text_mask, bool)):
      key = ids.tobytes() + mask.tobytes()
      if key not in self.index_of:
        self.index_of[key] = len(self.ids)
        self.ids.append(ids)
        self.masks.append(mask)
      out.append(self.index_of[key])
    return np.asarray(out, np.int32)

  def rows(self, embeddings: np.ndarray) -> list[np.ndarray]:
    """embeddings [prompts, L, dim] -> each up to its last real token (zeros after it are restored on read)."""
    ends = [int(np.flatnonzero(m)[-1]) + 1 if m.any() else 0 for m in self.masks]
    return [e[:max(end, 1)] for e, end in zip(embeddings, ends)]
