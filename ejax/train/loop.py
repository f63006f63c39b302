"""The trainer: one loop for every model and dataset; variation comes from config.

Read top to bottom: set up devices and the workdir, build the state straight into its shardings
(or restore it, onto whatever mesh is configured now), compile the step once and report its memory
and FLOPs, then train, log and checkpoint until done or told to stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

import jax
import numpy as np
from absl import logging
from ml_collections import ConfigDict

from ejax.checkpoint import CheckpointError, Checkpointer, abstract_target
from ejax.config.runtime import enable_compilation_cache
from ejax.parallel import barrier, global_batch, initialize_distributed, make_mesh, process_batch_size
from ejax.parallel.data import process_batch_shards
from ejax.parallel.distributed import compile_agreed
from ejax.parallel.watchdog import Watchdog
from ejax.parallel.rules import sharding_context
from ejax.train import frozen_fp8
from ejax.train import metrics as metrics_lib
from ejax.train import resume
from ejax.train import rows as embodiment_rows
from ejax.train.compile_beside import CompileBeside
from ejax.train.guard import FiniteGuard
from ejax.train.inputs import make_input, with_packing_plan
from ejax.train.optim import make_optimizer
from ejax.train.state import count_params, materialize, model_parts, plan_train_state, read_weights
from ejax.train.step import compiler_options, jit_train_step, make_train_step, train_state
from ejax.train.signals import GRACE_S, StartupInterrupted, StopSignal, signal_name
from ejax.train.workdir import WorkdirLock, prepare_workdir, refuse_or_move_old_run, saved_steps


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


def train(config: ConfigDict, workdir: str, *, devices: list | None = None,
          stop: StopSignal | None = None) -> dict[str, Any]:
  """Trains per config; returns {"history": [logged metrics per step], "final_step": n, ...}.

  `devices` restricts the mesh to some devices (tests compare against a one-device run). `stop`
  handles SIGINT / SIGTERM (ejax/train/signals.py); the caller that passes one restores it.
  """
  own_stop = stop is None
  stop = stop or StopSignal()  # first, so that a signal during start-up ends the run at once
  try:
    with contextlib.ExitStack() as cleanup:  # closes what was opened, in reverse order, however it ends
      return _train(config, workdir, devices, stop, cleanup)
  finally:
    if own_stop:
      stop.restore()


def _train(config: ConfigDict, workdir: str, devices: list | None, stop: StopSignal,
           cleanup: contextlib.ExitStack) -> dict[str, Any]:
  # --- Devices and workdir -------------------------------------------------------------------
  config = embodiment_rows.resolve(config)  # train.embodiment_rows "data": the rows the data names
  initialize_distributed(config.distributed)
  enable_compilation_cache(config.get("compilation_cache_dir"))
  workdir = prepare_workdir(workdir)
  cleanup.enter_context(WorkdirLock(workdir))  # before anything writes into the workdir
  if not config.checkpoint.resume:
    refuse_or_move_old_run(workdir, move_aside=config.checkpoint.get("move_aside", False))
    barrier("ejax_workdir_ready")
  mesh = make_mesh(config.mesh.to_dict(), devices)
  rules = [tuple(rule) for rule in config.sharding_rules]
  train_cfg = config.train
  local_batch_size = process_batch_size(train_cfg.global_batch_size, mesh, rules)
  logging.info("mesh %s over %d devices, %d processes", dict(mesh.shape), mesh.size, jax.process_count())
  # An auto packed row (model.packing.row_length = 0) is chosen from the dataset's sample lengths
  # before the settings are compared with a checkpoint's and saved with it (ejax/data/row_plan.py).
  stop.phase = "measuring the dataset's sample lengths"
  config = with_packing_plan(config, local_batch_size=local_batch_size, shards=process_batch_shards(mesh, rules))

  # --- Model, optimizer, checkpoints and data ----------------------------------------------------
  tx, schedule = make_optimizer(train_cfg)
  parts = model_parts(config.model)
  started = time.perf_counter()
  plan = plan_train_state(config.model, train_cfg, tx, mesh, rules, seed=config.seed)
  abstract, shardings = plan.abstract, plan.shardings
  logging.info("parameters: %d trainable, %d frozen", count_params(abstract.params), count_params(abstract.frozen))
  if train_cfg.get("frozen_fp8"):
    logging.info("train.frozen_fp8: %d frozen kernels run as FP8 GEMMs (those of at least %d features a side)",
                 frozen_fp8.count(abstract.frozen_fp8), frozen_fp8.MIN_FEATURES)
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                              async_save=config.checkpoint.async_save, for_writing=True)
  cleanup.callback(checkpointer.close)
  stop.describe_abort = lambda: _newest_checkpoint_text(checkpointer.directory)
  # A step, save or exchange that stalls, or a lost peer, ends every process with one line. It
  # watches from here: a peer lost while the others restore, initialise or compile (no phase, so no
  # phase timeout: compiling takes what it takes) is named too, instead of leaving them in the
  # compile agreement or a barrier until jaxlib aborts them.
  watchdog = Watchdog("train", timeout_s=train_cfg.get("step_timeout", 0.0),
                      say_last=lambda line: stop.say_last(line, file=sys.stderr),
                      resume_from=lambda: _newest_step(checkpointer.directory))
  cleanup.callback(watchdog.close)
  resume_step = (resume.choose_step(checkpointer, config.checkpoint.get("step"), workdir)
                 if config.checkpoint.resume else None)
  changes = resume.check(checkpointer, resume_step, config) if resume_step is not None else []
  stop.phase = "reading the dataset"
  # Each device's samples are packed into its own rows, so the model indexes them without
  # gathering the global batch (ejax/parallel/shard_local.py).
  data_iter = make_input(config, local_batch_size=local_batch_size, shards=process_batch_shards(mesh, rules))
  if hasattr(data_iter, "close"):
    cleanup.push(_closing(data_iter.close))
  meta = {"config": json.loads(config.to_json_best_effort()),
          "norm_stats": to_jsonable(getattr(data_iter, "norm_stats", None))}

  # --- The first batch and the step (before a fresh state: the step then compiles beside it) ----
  cleanup.enter_context(sharding_context(mesh, rules))
  batch_axis = 1 if train_cfg.grad_accum_steps > 1 else 0  # micro-batches stack on axis 0
  rows = embodiment_rows.from_train(train_cfg)
  check_rows = rows.check if rows else (lambda ids: None)

  def first_batch_and_step():
    stop.phase = "reading the first batch"
    local_batch = next(data_iter)
    check_rows(local_batch.get("embodiment_id", ()))
    batch = global_batch(local_batch, mesh, rules, batch_axis=batch_axis)
    step_fn = jit_train_step(make_train_step(parts, tx, schedule, train_cfg), shardings,
                             jax.tree.map(lambda x: x.sharding, batch), mesh)
    return local_batch, batch, step_fn

  # One process compiles its step in a thread while the parameters are initialised (compile_beside).
  # A resumed run reads its first batch only after the restore has set the data's position, and
  # processes of one run agree on their executable after the state (compile_agreed), as before.
  beside, lowering_seconds = None, 0.0
  if resume_step is None and jax.process_count() == 1:
    lowering_started = time.perf_counter()
    local_batch, batch, step_fn = first_batch_and_step()
    stop.phase = "lowering the train step"
    beside = CompileBeside(step_fn, abstract, shardings, batch, compiler_options(train_cfg))
    stop.phase = "compiling the train step"  # lowered: the compile runs from here, until the state's phase
    lowering_seconds = time.perf_counter() - lowering_started
    logging.info("first batch read and train step lowered in %.1f s; compiling the train step beside the state",
                 lowering_seconds)

  # --- The state: restored onto this mesh, or built straight into its shardings ------------------
  if resume_step is not None:
    stop.phase = f"restoring step {resume_step}"
    state, data_state = resume.restore(checkpointer, resume_step, abstract_target(abstract, shardings), changes,
                                       config)
    if data_state is not None:
      data_iter.set_state(data_state)
    jax.block_until_ready(state)
    logging.info("resumed from step %d: state restored in %.1f s", int(state.step), time.perf_counter() - started)
  else:
    loaded = None
    if train_cfg.get("init_weights"):
      stop.phase = "reading the imported weights"
      loaded = read_weights(train_cfg.init_weights, plan)
    stop.phase = "initialising the parameters" + (" while the train step compiles" if beside else "")
    state = jax.block_until_ready(materialize(plan, loaded))
    logging.info("state ready in %.1f s (%d parameters initialised)",
                 time.perf_counter() - started - lowering_seconds, len(plan.deferred))
  start_step = int(jax.device_get(state.step))
  if hasattr(data_iter, "check_frozen"):  # frozen-encoder outputs cached ahead: made by these frozen weights?
    data_iter.check_frozen(state.frozen)

  # --- Compile the step once; report memory and FLOPs ------------------------------------------
  if beside is None:
    local_batch, batch, step_fn = first_batch_and_step()
  stop.phase = "compiling the train step"
  compile_started = time.perf_counter()
  compiled = beside.result(state) if beside is not None else None
  if compiled is not None:
    logging.info("train step compiled in %.1f s beside the state; ready to train %.1f s after the start",
                 beside.seconds, time.perf_counter() - started)
  else:
    if beside is not None:
      logging.warning("the state built differs from the shapes the train step was lowered for: compiling again")
    logging.info("compiling the train step")
    # Every process must run the same executable, or its collectives never meet (compile_agreed).
    compiled = compile_agreed(lambda: step_fn.lower(state, batch), "train step",
                              compiler_options=compiler_options(train_cfg))
    logging.info("train step compiled in %.1f s", time.perf_counter() - compile_started)
  metrics_lib.log_memory_analysis(compiled)
  flops = metrics_lib.compiled_flops(compiled)
  peak = metrics_lib.peak_flops_per_device(override=config.metrics.get("peak_flops_per_device"))
  barrier("ejax_train_step_compiled")  # processes compile at different speeds; start in step

  # --- Train -----------------------------------------------------------------------------------
  writer = metrics_lib.MetricsWriter(workdir, total_steps=train_cfg.steps, start_step=start_step,
                                     tensorboard=config.metrics.tensorboard,
                                     progress_bar=config.metrics.progress_bar)
  cleanup.push(_closing(writer.close))
  history, log_every = [], config.metrics.log_every_steps
  interval_start, interval_steps, interval_samples, interval_tokens = time.time(), 0, 0, 0
  pad_fractions = []
  source = getattr(data_iter, "source", None)
  hint = f"lower train.learning_rate (now {train_cfg.learning_rate:g})" + (
      "" if train_cfg.grad_clip_norm else " or set train.grad_clip_norm")
  if jax.default_backend() == "gpu" and not train_cfg.get("check_attention_layout", False):
    hint += ("; or, where the batches are not ejax's packed rows, set train.check_attention_layout=True "
             "(the GPU attention kernels run unchecked and give NaN on rows that are not packed)")
  guard = FiniteGuard(last_good_step=checkpointer.latest_step, hint=hint,
                      describe_sample=getattr(source, "describe", None))
  step = start_step
  # stop_at ends this run early (to fit a scheduler's time slice); the next run resumes.
  end_step = min(train_cfg.steps, train_cfg.stop_at) if train_cfg.stop_at else train_cfg.steps
  stopped_by = None
  stop.begin_training()
  try:
    while step < end_step:
      watchdog.begin("train step", step + 1)
      if step > start_step:
        local_batch = next(data_iter)
        check_rows(local_batch.get("embodiment_id", ()))
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
      watchdog.end()
      if step % config.checkpoint.every_steps == 0 or stopping:
        guard.check_now()
        with watchdog.watch("checkpoint save", step):
          checkpointer.save(step, train_state(state), data_state=data_iter.get_state(), meta=meta, force=stopping)
      if stopping:
        stopped_by = signal_name(stop.requested)
        logging.warning("stopped at step %d after %s; checkpoint saved", step, stopped_by)
        break
    guard.check_now()
    with watchdog.watch("checkpoint save", step):
      if step == end_step and checkpointer.latest_step() != step:
        checkpointer.save(step, train_state(state), data_state=data_iter.get_state(), meta=meta, force=True)
      checkpointer.wait()  # a save that fails in the background fails the run here, not silently
  except (jax.errors.JaxRuntimeError, CheckpointError) as error:  # a collective or save whose peer is gone:
    watchdog.wait_for_verdict(error)  # name it, in one line
    raise
  watchdog.close()
  if stopped_by is None and step < train_cfg.steps:
    stopped_by = "train.stop_at"
  return {"history": history, "final_step": step, "workdir": workdir, "state": train_state(state),
          "stopped_early": step < train_cfg.steps, "stopped_by": stopped_by}


def _closing(close):
  """An ExitStack exit callback: `close()`; when the run is already failing, a second failure while
  closing (a full disk refusing the last metrics flush) is logged in one line, not raised over the first."""
  def exit_callback(exc_type, exc, traceback) -> bool:
    del traceback
    try:
      close()
    except Exception as error:  # noqa: BLE001
      if exc_type is None:
        raise
      logging.warning("while stopping: %s", " ".join(str(error).split())[:200])
    return False
  return exit_callback


def _newest_step(directory: str) -> int | None:
  steps = saved_steps(directory)
  return steps[-1] if steps else None


def _newest_checkpoint_text(directory: str) -> str:
  steps = saved_steps(directory)
  return f"the newest checkpoint is step {steps[-1]}" if steps else "no checkpoint was saved"


def run_job(config: ConfigDict, workdir: str) -> None:
  # Signals stay handled until the last line is out: a second one always exits at once.
  stop = StopSignal(watch=True)
  try:
    _run_job(config, workdir, stop)
  finally:
    stop.finished()
    stop.restore()


def _run_job(config: ConfigDict, workdir: str, stop: StopSignal) -> None:
  try:
    result = train(config, workdir, stop=stop)
  except StartupInterrupted as interrupt:
    if not stop.say_last(f"train: interrupted by {signal_name(interrupt.signum)} during start-up "
                         f"({interrupt.phase}); nothing was trained or saved"):
      time.sleep(2 * GRACE_S)  # the watcher wrote the line and is ending the process
    # train() closed what start-up opened; the interpreter's own teardown took 3-8 s on a loaded
    # 2-core machine (load 12), so end here as the watcher does.
    stop.exit_now(128 + interrupt.signum)
  last = result["history"][-1] if result["history"] else {}
  who = f"process {jax.process_index()} of {jax.process_count()} " if jax.process_count() > 1 else ""
  # No loss before the first logged step: "loss nan" there would read as a non-finite stop.
  loss = (f"loss {last['loss']!r}, " if "loss" in last else "") + f"workdir {result['workdir']}"
  if result["stopped_by"] is None:
    stop.say_last(f"train: {who}finished at step {result['final_step']}, {loss}")
  else:
    cause = "train.stop_at" if result["stopped_by"] == "train.stop_at" else result["stopped_by"]
    stop.say_last(f"train: {who}stopped at step {result['final_step']} by {cause}, checkpoint saved, {loss}: "
                  "run the same command to resume")
