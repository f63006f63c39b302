"""The encode job (issue 32 point 3): DreamZero's frozen VAE, umT5 and CLIP run once over a dataset's
samples, their outputs written to data.encoder_cache; training with the same setting reads them and
the train step skips the encoders.

    python -m ejax.main --config=configs/dreamzero.py:runlocal --config.job=encode --config.data.encoder_cache=runs/dz_cache
    python -m ejax.main --config=configs/dreamzero.py:runlocal --config.data.encoder_cache=runs/dz_cache

The frozen weights are the ones the trainer would build from the same config (its seed's random
initialisation, or train.init_weights), made the same way (ejax.train.state) and run in the train
step's compute dtype, so a cached batch gives the in-step loss. Every sample of the dataset once, in
order (data.shuffle and data.num_epochs do not apply); the trainer shuffles the cache each epoch.
What is cached and when a cache is stale: the model's registry entry `encoder_cache` (DreamZero's:
ejax/models/dreamzero/encode.py); the format: ejax/data/encoder_cache.py. One process (the encoders
run data-parallel over its devices). With data.encoder_cache_refresh (runlocal's default on the
quickstart demos) data.encoder_cache is a folder of caches, one a key, and the trainer writes the
missing or stale one itself (`open_cache`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import jax
import numpy as np
from absl import logging
from flax import nnx
from ml_collections import ConfigDict

from ejax.data import encoder_cache
from ejax.errors import UserError
from ejax.models.registry import get_model_spec
from ejax.parallel import global_batch, make_mesh
from ejax.parallel.rules import sharding_context
from ejax.train.optim import make_optimizer
from ejax.train.state import compute_model, materialize, model_parts, plan_train_state, read_weights


RERUN = " with the encode job (the same command with --config.job=encode)"


def open_cache(config: ConfigDict, *, batch_size: int):
  """The trainer's reader of data.encoder_cache (ejax/train/inputs.py). With data.encoder_cache_refresh,
  data.encoder_cache is a folder of caches, one a key (`keyed_config`), and a cache that is missing or
  stale is written first: here where its settings differ, at check_frozen where it was encoded by other
  frozen weights; without it, data.encoder_cache is the cache and either is one error line."""
  if config.data.get("encoder_cache_refresh", False):
    config = keyed_config(config)
  open_reader = lambda: encoder_cache.CachedBatches(
      config.data.encoder_cache, config=config, batch_size=batch_size, seed=config.seed,
      process_index=jax.process_index(), process_count=jax.process_count(), rerun=RERUN)
  if not config.data.get("encoder_cache_refresh", False):
    return open_reader()
  try:
    return _Refreshing(config, open_reader, open_reader())
  except encoder_cache.StaleCache as why:
    logging.warning("writing the encoder cache %s first: %s", config.data.encoder_cache, why)
    encode(config)
    return _Refreshing(config, open_reader, open_reader())


def keyed_config(config: ConfigDict) -> ConfigDict:
  """config with data.encoder_cache/<key>: the key a hash of what the cache depends on as far as the
  config says (its settings, and what decides the frozen weights: the seed, train.init_weights,
  train.frozen_dtype), so runs of other settings or seeds keep their own caches, never rewrite another's."""
  hooks = get_model_spec(config.model.name).encoder_cache
  paths = hooks.cache_inputs(config) + ["seed", "train.init_weights", "train.frozen_dtype"]
  described = json.dumps({path: encoder_cache.config_value(config, path) for path in paths}, sort_keys=True)
  out = config.copy_and_resolve_references()
  out.data.encoder_cache = os.path.join(config.data.encoder_cache, hashlib.sha256(described.encode()).hexdigest()[:16])
  return out


class _Refreshing:
  """A cache reader that rewrites its cache when the trainer's frozen weights are not the ones it holds."""

  def __init__(self, config, open_reader, reader):
    self.config, self.open_reader, self.reader = config, open_reader, reader

  def check_frozen(self, frozen) -> None:
    try:
      self.reader.check_frozen(frozen)
    except encoder_cache.StaleCache as why:
      logging.warning("rewriting the encoder cache %s: %s", self.config.data.encoder_cache, why)
      state = self.reader.get_state()
      encode(self.config)
      self.reader = self.open_reader()
      self.reader.set_state(state)
      self.reader.check_frozen(frozen)

  def __iter__(self):
    return self

  def __next__(self):
    return next(self.reader)

  def __getattr__(self, name):   # norm_stats, get_state, set_state, close
    return getattr(self.reader, name)


def run_job(config: ConfigDict, workdir: str) -> None:
  del workdir
  # With data.encoder_cache_refresh the setting is a folder of caches: write the one the trainer reads.
  result = encode(keyed_config(config) if config.data.get("encoder_cache_refresh", False) else config)
  print(f"encode: {result['num_samples']} samples, {result['num_prompts']} prompts in {result['seconds']:.1f} s "
        f"({result['num_samples'] / result['seconds']:.1f} samples/s) -> {result['directory']}", flush=True)


def frozen_model(config: ConfigDict, mesh, rules):
  """(model with the trainer's weights in the step's compute dtype, the frozen state) for `config`."""
  tx, _ = make_optimizer(config.train)
  plan = plan_train_state(config.model, config.train, tx, mesh, rules, seed=config.seed)
  loaded = read_weights(config.train.init_weights, plan) if config.train.get("init_weights") else None
  state = materialize(plan, loaded)
  dtype = jax.numpy.dtype(config.train.compute_dtype)
  # The step's own view of the weights (compute_model): the encoders see what they would in training.
  model = compute_model(model_parts(config.model).graphdef, state.params, state.frozen, state.rest, dtype,
                        state.frozen_fp8)
  return model, state.frozen


def encode(config: ConfigDict) -> dict:
  """Writes the cache (the module docstring); returns its size, its prompts and the seconds it took."""
  data = config.data
  directory = data.get("encoder_cache", None)
  spec = get_model_spec(config.model.name)
  hooks = spec.encoder_cache   # what the model caches (DreamZero's: ejax/models/dreamzero/encode.py)
  if hooks is None:
    raise UserError(f"the encode job caches a model's frozen encoders; model {config.model.name!r} has no cache")
  if data.name not in ("lerobot", "sim_demos"):
    raise UserError(f"the encode job encodes LeRobot video samples (data.name lerobot or sim_demos), not "
                    f"data.name={data.name!r}")
  if not directory:
    raise UserError("the encode job writes data.encoder_cache: set --config.data.encoder_cache=DIR")
  if jax.process_count() > 1:
    raise UserError("the encode job runs in one process: launch it without jax.distributed")
  from ejax.data import pipeline
  started = time.perf_counter()
  mesh = make_mesh(config.mesh.to_dict())
  rules = [tuple(rule) for rule in config.sharding_rules]
  batch_size = int(config.train.global_batch_size)
  with sharding_context(mesh, rules):
    model, frozen = frozen_model(config, mesh, rules)
    graphdef, state = nnx.split(model)
    run = lambda fn: jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args))
    encode_samples, encode_prompts = run(hooks.encode_samples), run(hooks.encode_prompts)
    collate = spec.make_collate(config.model, data)
    reading = ConfigDict(data.to_dict())
    reading.update(shuffle=False, num_epochs=1)
    prompts, writer = hooks.PromptTable(), encoder_cache.CacheWriter(directory)
    count = 0
    try:
      with pipeline.build_pipeline(reading, batch_size=1, seed=config.seed, collate=lambda s: {"sample": s[0]}) as samples:
        norm_stats = samples.norm_stats
        pending = []
        for item in samples:
          pending.append(item["sample"])
          if len(pending) == batch_size:
            count += _encode_batch(pending, batch_size, collate, encode_samples, hooks.REPLACED, state, prompts,
                                   writer, mesh, rules)
            pending = []
            if count % (20 * batch_size) == 0:
              logging.info("encoded %d samples (%.1f samples/s)", count, count / (time.perf_counter() - started))
        if pending:
          count += _encode_batch(pending, batch_size, collate, encode_samples, hooks.REPLACED, state, prompts,
                                 writer, mesh, rules)
      embeddings = []
      for start in range(0, len(prompts.ids), batch_size):
        ids, masks = (_padded(np.stack(x[start:start + batch_size]), batch_size) for x in (prompts.ids, prompts.masks))
        device = global_batch({"text_ids": ids, "text_mask": masks}, mesh, rules)
        out = encode_prompts(state, device["text_ids"], device["text_mask"])
        embeddings.append(np.asarray(jax.device_get(out))[:min(batch_size, len(prompts.ids) - start)])
      writer.add_table("text_embeddings", prompts.rows(np.concatenate(embeddings)), index_field="prompt_index",
                       length=config.model.text_length)
      seconds = time.perf_counter() - started
      writer.finish(inputs={path: encoder_cache.config_value(config, path) for path in hooks.cache_inputs(config)},
                    frozen={"components": list(hooks.FROZEN),
                            "fingerprint": encoder_cache.fingerprint(frozen, hooks.FROZEN)},
                    norm_stats=encoder_cache.jsonable(norm_stats), encode_seconds=seconds)
    except BaseException:
      writer.abort()
      raise
  return {"directory": directory, "num_samples": count, "num_prompts": len(prompts.ids), "seconds": seconds}


def _padded(x: np.ndarray, size: int) -> np.ndarray:
  """x with its last row repeated up to `size` rows: every call has the compiled batch shape."""
  return np.concatenate([x, np.repeat(x[-1:], size - len(x), axis=0)]) if len(x) < size else x


def _encode_batch(samples, batch_size, collate, encode_samples, replaced, state, prompts, writer, mesh, rules) -> int:
  batch = collate(samples)
  n = len(samples)
  device_batch = global_batch({k: _padded(batch[k], batch_size) for k in replaced}, mesh, rules)
  outputs = jax.device_get(encode_samples(state, device_batch))
  cached = {k: v for k, v in batch.items() if k not in replaced}
  cached.update({k: np.asarray(v)[:n] for k, v in outputs.items()})
  cached["prompt_index"] = prompts.index(batch["text_ids"], batch["text_mask"])
  writer.add(cached, num_samples=n)
  return n
