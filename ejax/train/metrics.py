"""Training metrics: MFU from the compiled step's FLOPs, a console progress line with ETA,
TensorBoard event files and a JSONL log in the workdir, and the same scalars to Weights & Biases
when config.metrics.wandb is on (ejax.train.wandb_run)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Mapping

import jax
from absl import logging

from ejax.errors import UserError
from ejax.train import wandb_run

# Dense bf16 peak FLOP/s per device, by substring of jax's device_kind (first match wins).
PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v4", 275e12),
)


def peak_flops_per_device(device: jax.Device | None = None, override: float | None = None) -> float | None:
  """The device's dense bf16 peak, or None where unknown (CPUs): MFU is then not reported."""
  if override:
    return float(override)
  kind = (device or jax.devices()[0]).device_kind
  for name, peak in PEAK_FLOPS:
    if name.lower() in kind.lower():
      return peak
  return None


def compiled_flops(compiled) -> float | None:
  """FLOPs of one call of a compiled executable, per device: its matmuls, loops counted as often as
  they run (ejax.parallel.hlo), rematerialised forwards included. XLA's cost analysis, the fallback,
  counts a loop body once: for pi0.5 (18 layers in one scan) it reported ~1/6 of the step's FLOPs,
  and the logged mfu with it. Model FLOPs without recomputation: ejax.train.flops."""
  try:
    from ejax.parallel.hlo import matmul_flops
    flops = matmul_flops(compiled.as_text())
    if flops > 0:
      return flops
  except Exception:  # A backend without HLO text: XLA's own count.
    pass
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # Some backends do not implement it.
    return None
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  flops = (analysis or {}).get("flops")
  return float(flops) if flops and flops > 0 else None


def log_memory_analysis(compiled) -> None:
  try:
    memory = compiled.memory_analysis()
  except Exception:
    return
  if memory is None:
    return
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
  parts = [f"{f.replace('_size_in_bytes', '')}={getattr(memory, f, 0) / 2**20:.1f}MiB" for f in fields]
  logging.info("train step memory per device: %s", " ".join(parts))


def _format_duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class MetricsWriter:
  """Writes scalars to metrics.jsonl, TensorBoard and the launch's W&B run if it has one (process 0
  only) and draws progress."""

  def __init__(self, workdir: str, *, total_steps: int, start_step: int = 0, tensorboard: bool = True,
               progress_bar: bool = True, stream=None):
    self.total_steps = total_steps
    self.active = jax.process_index() == 0
    self.stream = stream or sys.stderr
    self.progress_bar = progress_bar and self.active
    self.interactive = self.progress_bar and hasattr(self.stream, "isatty") and self.stream.isatty()
    self.start_time, self.start_step = time.time(), start_step
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a") if self.active else None
    self._tb = None
    if tensorboard and self.active:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
    # The W&B run starts here (a bad login fails now, before the first step), on process 0 alone.
    self._wandb = wandb_run.active_run() if self.active else None

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self.active:
      return
    values = {k: float(v) for k, v in scalars.items()}
    # Strict JSON: NaN and infinities (which json.dumps writes as bare NaN / Infinity) become null.
    strict = {k: (v if math.isfinite(v) else None) for k, v in values.items()}
    try:
      self._jsonl.write(json.dumps({"step": step, "time": time.time(), **strict}, allow_nan=False) + "\n")
      self._jsonl.flush()
      if self._tb is not None:
        for name, value in values.items():
          self._tb.add_scalar(name, value, step)
      if self._wandb is not None:
        self._wandb.log(values, step=step)
    except OSError as error:  # a full disk or a vanished workdir: one line, not a traceback
      raise UserError(f"cannot write metrics of step {step} to {self._jsonl.name} ({error.strerror or error}): "
                      "free some space or make the workdir writable, then run the same command to resume "
                      "from the newest checkpoint") from None
    if self.progress_bar:
      self._draw(step, values)

  def _draw(self, step: int, values: Mapping[str, float]) -> None:
    done = step - self.start_step
    rate = done / max(time.time() - self.start_time, 1e-9)
    eta = (self.total_steps - step) / rate if rate > 0 else float("inf")
    width = 24
    filled = int(width * step / max(self.total_steps, 1))
    shown = " ".join(f"{k}={v:.4g}" for k, v in values.items() if k in _SHOWN)
    line = f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total_steps} eta {_format_duration(eta)} {shown}"
    if self.interactive:
      self.stream.write("\r" + line[:200])
    else:
      self.stream.write(line + "\n")
    self.stream.flush()

  def close(self) -> None:
    if self.interactive:
      self.stream.write("\n")
    if self._jsonl:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()


_SHOWN = ("loss", "grad_norm", "learning_rate", "samples_per_second", "mfu", "padding_fraction")
