"""Checks run on a config before any work starts, so bad input fails in one clear line."""

from __future__ import annotations

import math
import os

from ml_collections import ConfigDict

from ejax.errors import UserError


FLOAT_DTYPES = ("float32", "bfloat16", "float16")
DATASET_SOURCES = ("lerobot", "rlds", "sim_demos")  # data.name values that are datasets on disk (not synthetic)


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
  if metrics is not None and metrics.get("wandb", False):
    _check_wandb(metrics)
  data = config.get("data")
  if data is not None and data.get("name") in ("lerobot", "rlds") and not data.get("path") and config.job in ("train", "stats"):
    raise ConfigError(
        f"data.name={data.name!r} needs --config.data.path=<dataset directory> "
        f"(record one with --config.job=demos, or use the built-in --config.data.name=synthetic)")
  if config.get("job") == "stats" and (data is None or data.get("name") not in DATASET_SOURCES):
    raise ConfigError(f"job stats computes a dataset's statistics and data.name={(data or {}).get('name')!r} is none: "
                      "set --config.data.name=lerobot --config.data.path=<dataset> (or rlds, or sim_demos)")
  model = config.get("model")
  perception = (model.get("perception") if model is not None else None) or {}
  if data is not None and perception and config.job == "train":
    estimate, detectors = perception.get("estimate") or {}, perception.get("detectors") or {}
    if estimate.get("dim", 0) and not data.get("aux_state_key"):
      raise ConfigError(f"model.perception.estimate.dim={estimate.dim} is trained on a target but data.aux_state_key "
                        "is unset: name the dataset feature (e.g. observation.environment_state) or set "
                        "model.perception={} (the released model)")
    if detectors.get("points", 0) and not data.get("aux_pixel_key"):
      raise ConfigError(f"model.perception.detectors.points={detectors.points} trains keypoint heatmaps but "
                        "data.aux_pixel_key is unset: name the dataset feature (e.g. observation.environment_pixels) "
                        "or set model.perception.detectors.points=0")
  if data is not None and "skip_limit" in data:
    _positive(data, "skip_limit", "data")
  if data is not None and data.get("stats_path") and not os.path.isfile(os.path.expanduser(data.stats_path)):
    raise ConfigError(f"data.stats_path {data.stats_path!r} is not a file: run the stats job first (--config.job=stats "
                      "writes <workdir>/stats.json), point it at a dataset's meta/stats.json, or unset it")
  if train is not None and train.get("init_weights") and config.job == "train":
    _check_init_weights(train.init_weights)
  if data is not None and data.get("path") and data.get("name") != "sim_demos":  # sim_demos records there
    if not os.path.exists(data.path):
      raise ConfigError(
          f"data.path {data.path!r} does not exist: point --config.data.path at a dataset "
          f"(make one with --config.job=demos) or use --config.data.name=synthetic")


def _check_wandb(metrics: ConfigDict) -> None:
  import importlib.util
  from ejax.train.wandb_run import MODES
  if importlib.util.find_spec("wandb") is None:
    raise ConfigError("metrics.wandb=True needs the wandb package: pip install -e \".[wandb]\" (or leave metrics.wandb "
                      "off; TensorBoard and metrics.jsonl log the same scalars)")
  if metrics.get("wandb_mode", "online") not in MODES:
    raise ConfigError(f"metrics.wandb_mode={metrics.wandb_mode!r}: use one of {', '.join(MODES)} (offline needs no "
                      "network; `wandb sync` uploads the run later)")


def _check_init_weights(path: str) -> None:
  """train.init_weights holds what the convert job imports or a train run's checkpoints (whose
  weights start a new run); an rl job's checkpoints are neither."""
  from ejax.checkpoint.kinds import RL, checkpoint_kind
  resolved = os.path.abspath(os.path.expanduser(path))
  kinds = {checkpoint_kind(resolved)} | {checkpoint_kind(os.path.join(resolved, "rl_checkpoints"))}
  if RL in kinds:
    raise ConfigError(f"train.init_weights={path!r} holds an rl job's checkpoints: init_weights takes a train run's "
                      "checkpoints or the destination of --config.job=convert --config.convert.direction=import")


def _positive(section: ConfigDict, key: str, prefix: str) -> None:
  value = section.get(key)
  if not isinstance(value, int) or value <= 0:
    raise ConfigError(f"{prefix}.{key}={value!r} must be a positive integer")


# Helpers for the jobs' own checks (each job's `check_config`, run before it loads or compiles anything).

def require_section(config: ConfigDict, name: str, example: str) -> ConfigDict:
  """config.<name>, or one line naming the config files that have it."""
  section = config.get(name)
  if not section:
    raise ConfigError(f"job {config.get('job', name)!r} needs a config.{name} section, which this config lacks: "
                      f"use {example}")
  return section


def require_one_of(setting: str, value, choices) -> None:
  if value not in choices:
    raise ConfigError(f"{setting}={value!r}: use one of {', '.join(map(str, choices))}")


def require_positive(section: ConfigDict, prefix: str, *keys: str) -> None:
  for key in keys:
    _positive(section, key, prefix)


def require_path(setting: str, path: str, what: str) -> str:
  """`path` (user and relative paths resolved), which must exist; else one line saying what belongs there."""
  if not path:
    raise ConfigError(f"{setting} is not set: pass --{'config.' + setting}=<{what}>")
  resolved = os.path.abspath(os.path.expanduser(path))
  if not os.path.exists(resolved):
    raise ConfigError(f"{setting}={path!r} does not exist: point it at {what}")
  return resolved
