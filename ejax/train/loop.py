"""The trainer: one loop for every model and dataset; variation comes from config.

Read top to bottom: set up devices and the workdir, build the state straight into its shardings
(or restore it, onto whatever mesh is configured now), compile the step once and report its memory
and FLOPs, then train, log and checkpoint until done or told to stop.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from ml_collections import ConfigDict

from ejax.checkpoint import Checkpointer, abstract_target
from ejax.config.runtime import enable_compilation_cache
from ejax.errors import UserError
from ejax.parallel import barrier, global_batch, initialize_distributed, make_mesh, process_batch_size
from ejax.parallel.rules import sharding_context
from ejax.train import metrics as metrics_lib
from ejax.train.guard import FiniteGuard
from ejax.train.inputs import make_input
from ejax.train.optim import make_optimizer
from ejax.train.state import abstract_train_state, count_params, make_init_fn, model_parts
from ejax.train.step import jit_train_step, make_train_step
from ejax.train.workdir import prepare_workdir, refuse_or_move_old_run


class StopSignal:
  """Turns SIGTERM/SIGINT into a request to checkpoint and stop at the next step boundary."""

  def __init__(self):
    self.requested = False
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    logging.warning("received signal %d: saving a checkpoint and stopping", signum)
    self.requested = True

  def agreed(self) -> bool:
    """All processes stop at the same step, or the last save would deadlock."""
    if jax.process_count() == 1:
      return self.requested
    flags = multihost_utils.process_allgather(np.array([int(self.requested)]))
    return bool(np.max(flags))

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def to_jsonable(value: Any) -> Any:
  """Normalisation stats and the like (numpy arrays, scalars, nested dicts) as plain JSON types."""
  if isinstance(value, dict):
    return {str(k): to_jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_jsonable(v) for v in value]
  if isinstance(value, (np.ndarray, np.generic)):
    return value.tolist()
  return value


def _scalar_metrics(metrics: dict) -> dict[str, float]:
  host = jax.device_get({k: v for k, v in metrics.items() if k != "per_sample_loss"})
  return {k: float(np.asarray(v)) for k, v in host.items()}


def _batch_tokens(batch: dict[str, np.ndarray]) -> tuple[int | None, float | None]:
  """Real tokens in a process-local batch and its padding fraction, over every packed token
  stream it carries (`segment_ids`, `vl_segment_ids`, `prefix_segment_ids`, ...; 0 = padding)."""
  streams = [v for k, v in batch.items() if k.endswith("segment_ids") and isinstance(v, np.ndarray)]
  total = sum(v.size for v in streams)
  if not total:
    return None, None
  real = sum(int(np.count_nonzero(v)) for v in streams)
  return real, 1.0 - real / total


def train(config: ConfigDict, workdir: str, *, devices: list | None = None) -> dict[str, Any]:
  """Trains per config; returns {"history": [logged metrics per step], "final_step": n, ...}.

  `devices` restricts the mesh to some devices (tests compare against a one-device run).
  """
  # --- Devices and workdir -------------------------------------------------------------------
  stop = StopSignal()  # first, so that a SIGTERM during start-up still ends in a clean save
  initialize_distributed(config.distributed)
  enable_compilation_cache(config.get("compilation_cache_dir"))
  workdir = prepare_workdir(workdir)
  if not config.checkpoint.resume:
    refuse_or_move_old_run(workdir, move_aside=config.checkpoint.get("move_aside", False))
    barrier("ejax_workdir_ready")
  mesh = make_mesh(config.mesh.to_dict(), devices)
  rules = [tuple(rule) for rule in config.sharding_rules]
  train_cfg = config.train
  local_batch_size = process_batch_size(train_cfg.global_batch_size, mesh, rules)
  logging.info("mesh %s over %d devices, %d processes", dict(mesh.shape), mesh.size, jax.process_count())

  # --- Model, optimizer and state: abstract first, then straight into shardings ----------------
  tx, schedule = make_optimizer(train_cfg)
  parts = model_parts(config.model)
  abstract, shardings = abstract_train_state(config.model, train_cfg, tx, mesh, rules)
  logging.info("parameters: %d trainable, %d frozen", count_params(abstract.params), count_params(abstract.frozen))
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                              async_save=config.checkpoint.async_save)
  data_iter = make_input(config, local_batch_size=local_batch_size)
  meta = {"config": json.loads(config.to_json_best_effort()),
          "norm_stats": to_jsonable(getattr(data_iter, "norm_stats", None))}
  with mesh, sharding_context(mesh, rules):
    if config.checkpoint.resume and checkpointer.latest_step() is not None:
      state, data_state, _ = checkpointer.restore(None, abstract_target(abstract, shardings))
      if data_state is not None:
        data_iter.set_state(data_state)
      logging.info("resumed from step %d", int(state.step))
    else:
      state = jax.jit(make_init_fn(config.model, train_cfg, tx), out_shardings=shardings)(jax.random.key(config.seed))
    start_step = int(jax.device_get(state.step))

    # --- Compile the step once; report memory and FLOPs --------------------------------------
    batch_axis = 1 if train_cfg.grad_accum_steps > 1 else 0  # micro-batches stack on axis 0
    local_batch = next(data_iter)
    batch = global_batch(local_batch, mesh, rules, batch_axis=batch_axis)
    batch_shardings = jax.tree.map(lambda x: x.sharding, batch)
    step_fn = jit_train_step(make_train_step(parts, tx, schedule, train_cfg), shardings, batch_shardings, mesh)
    compiled = step_fn.lower(state, batch).compile()
    metrics_lib.log_memory_analysis(compiled)
    flops = metrics_lib.compiled_flops(compiled)
    peak = metrics_lib.peak_flops_per_device(override=config.metrics.get("peak_flops_per_device"))
    barrier("ejax_train_step_compiled")  # processes compile at different speeds; start in step

    # --- Train -------------------------------------------------------------------------------
    writer = metrics_lib.MetricsWriter(workdir, total_steps=train_cfg.steps, start_step=start_step,
                                       tensorboard=config.metrics.tensorboard,
                                       progress_bar=config.metrics.progress_bar)
    history, log_every = [], config.metrics.log_every_steps
    interval_start, interval_steps, interval_samples, interval_tokens = time.time(), 0, 0, 0
    pad_fractions = []
    source = getattr(data_iter, "source", None)
    hint = f"lower train.learning_rate (now {train_cfg.learning_rate:g})" + (
        "" if train_cfg.grad_clip_norm else " or set train.grad_clip_norm")
    guard = FiniteGuard(last_good_step=checkpointer.latest_step, hint=hint,
                        describe_sample=getattr(source, "describe", None))
    step = start_step
    # stop_at ends this run early (to fit a scheduler's time slice); the next run resumes.
    end_step = min(train_cfg.steps, train_cfg.stop_at) if train_cfg.stop_at else train_cfg.steps
    try:
      while step < end_step:
        if step > start_step:
          local_batch = next(data_iter)
          batch = global_batch(local_batch, mesh, rules, batch_axis=batch_axis)
        with jax.transfer_guard(train_cfg.transfer_guard):
          state, step_metrics = compiled(state, batch)
        step += 1
        guard.push(step, step_metrics, local_batch)
        tokens, pad_fraction = _batch_tokens(local_batch)
        interval_steps += 1
        interval_samples += train_cfg.global_batch_size
        interval_tokens += (tokens or 0) * jax.process_count()
        if pad_fraction is not None:
          pad_fractions.append(pad_fraction)

        if step % log_every == 0 or step == train_cfg.steps:
          guard.check_now()
          scalars = _scalar_metrics(step_metrics)
          elapsed = max(time.time() - interval_start, 1e-9)
          scalars["samples_per_second"] = interval_samples / elapsed
          if interval_tokens:
            scalars["tokens_per_second"] = interval_tokens / elapsed
          if pad_fractions:
            scalars["padding_fraction"] = float(np.mean(pad_fractions))
          if flops and peak:
            scalars["mfu"] = flops * interval_steps / elapsed / peak
          writer.write(step, scalars)
          history.append({"step": step, **scalars})
          interval_start, interval_steps, interval_samples, interval_tokens = time.time(), 0, 0, 0
          pad_fractions = []

        stopping = stop.agreed() if (jax.process_count() == 1 or step % log_every == 0) else False
        if step % config.checkpoint.every_steps == 0 or stopping:
          guard.check_now()
          checkpointer.save(step, state, data_state=data_iter.get_state(), meta=meta, force=stopping)
        if stopping:
          logging.warning("stopped at step %d after a signal; checkpoint saved", step)
          break
      guard.check_now()
      if step == end_step and checkpointer.latest_step() != step:
        checkpointer.save(step, state, data_state=data_iter.get_state(), meta=meta, force=True)
    finally:
      checkpointer.close()
      writer.close()
      stop.restore()
      close = getattr(data_iter, "close", None)
      if close:
        close()
  return {"history": history, "final_step": step, "workdir": workdir, "state": state,
          "stopped_early": step < train_cfg.steps}


def run_job(config: ConfigDict, workdir: str) -> None:
  result = train(config, workdir)
  last = result["history"][-1] if result["history"] else {}
  who = f"process {jax.process_index()} of {jax.process_count()} " if jax.process_count() > 1 else ""
  print(f"train: {who}finished at step {result['final_step']}, loss {last.get('loss', float('nan'))!r}, "
        f"workdir {result['workdir']}", flush=True)
