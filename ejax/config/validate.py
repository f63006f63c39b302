"""Checks run on a config before any work starts, so bad input fails in one clear line."""

from __future__ import annotations

import math
import os

from ml_collections import ConfigDict

from ejax.errors import UserError


FLOAT_DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(UserError, ValueError):
  """A config value that cannot work; the message names the field and the fix."""


def validate(config: ConfigDict) -> None:
  train = config.get("train")
  if train is not None:
    _positive(train, "steps", "train")
    _positive(train, "global_batch_size", "train")
    _positive(train, "grad_accum_steps", "train")
    if train.global_batch_size % train.grad_accum_steps:
      raise ConfigError(
          f"train.global_batch_size={train.global_batch_size} is not divisible by "
          f"train.grad_accum_steps={train.grad_accum_steps}")
    if not 0.0 <= train.ema_decay < 1.0:
      raise ConfigError(f"train.ema_decay={train.ema_decay} must be in [0, 1)")
    if not 0.0 <= train.warmup_fraction < 1.0:
      raise ConfigError(f"train.warmup_fraction={train.warmup_fraction} must be in [0, 1)")
    if not (math.isfinite(train.learning_rate) and train.learning_rate > 0):
      raise ConfigError(f"train.learning_rate={train.learning_rate} must be a positive number")
    for key in ("compute_dtype", "param_dtype"):
      if key in train and train[key] not in FLOAT_DTYPES:
        raise ConfigError(f"train.{key}={train[key]!r} is not a float type: use one of {', '.join(FLOAT_DTYPES)}")
    if not isinstance(train.get("stop_at", 0), int) or train.get("stop_at", 0) < 0:
      raise ConfigError(f"train.stop_at={train.stop_at!r} must be 0 (off) or a step number")
  checkpoint = config.get("checkpoint")
  if checkpoint is not None:
    for key in ("every_steps", "keep"):
      if key in checkpoint:
        _positive(checkpoint, key, "checkpoint")
    step = checkpoint.get("step")
    if step is not None and (not isinstance(step, int) or step < 0):
      raise ConfigError(f"checkpoint.step={step!r} must be a saved step number (or unset for the newest)")
  metrics = config.get("metrics")
  if metrics is not None and "log_every_steps" in metrics:
    _positive(metrics, "log_every_steps", "metrics")
  data = config.get("data")
  if data is not None and data.get("name") in ("lerobot", "rlds") and not data.get("path") and config.job in ("train", "stats"):
    raise ConfigError(
        f"data.name={data.name!r} needs --config.data.path=<dataset directory> "
        f"(record one with --config.job=demos, or use the built-in --config.data.name=synthetic)")
  model = config.get("model")
  if (data is not None and model is not None and model.get("aux_state_dim", 0) and not data.get("aux_state_key")
      and config.job == "train"):
    raise ConfigError(f"model.aux_state_dim={model.aux_state_dim} trains an auxiliary target but data.aux_state_key "
                      "is unset: name the dataset feature (e.g. observation.environment_state) or set "
                      "model.aux_state_dim=0")
  if (data is not None and model is not None and model.get("aux_heatmaps", 0) and not data.get("aux_pixel_key")
      and config.job == "train"):
    raise ConfigError(f"model.aux_heatmaps={model.aux_heatmaps} trains keypoint heatmaps but data.aux_pixel_key is "
                      "unset: name the dataset's keypoint labels (e.g. observation.environment_pixels) or set "
                      "model.aux_heatmaps=0")
  if data is not None and "skip_limit" in data:
    _positive(data, "skip_limit", "data")
  if data is not None and data.get("path") and data.get("name") != "sim_demos":  # sim_demos records there
    if not os.path.exists(data.path):
      raise ConfigError(
          f"data.path {data.path!r} does not exist: point --config.data.path at a dataset "
          f"(make one with --config.job=demos) or use --config.data.name=synthetic")


def _positive(section: ConfigDict, key: str, prefix: str) -> None:
  value = section.get(key)
  if not isinstance(value, int) or value <= 0:
    raise ConfigError(f"{prefix}.{key}={value!r} must be a positive integer")
