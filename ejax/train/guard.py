"""Stops a run at the first step whose loss or gradient norm is not finite, before it is saved.

The host reads each step's two scalars one step late: after step s+1 is dispatched it waits for
step s, which the device has finished or is about to, so the check never stalls the pipeline.
Before anything is logged or saved, the step at hand is checked at once (`check_now`). A NaN
step therefore never reaches a checkpoint, and never rotates a good one out of `checkpoint.keep`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import jax
import numpy as np

from ejax.errors import UserError


class NonFiniteError(UserError):
  """A step produced a NaN or infinite loss or gradient norm; the message names the step."""


class FiniteGuard:
  """Checks loss and grad_norm of every step; raises NonFiniteError naming the first bad one.

  `describe_sample(index) -> str` names a sample of the dataset ("frame 57 (episode 3, file ...)")
  when the batch carries an "index" field; the message then says which samples held non-finite
  inputs or losses.
  """

  def __init__(self, *, last_good_step: Callable[[], int | None], hint: str,
               describe_sample: Callable[[int], str] | None = None):
    self._pending: tuple[int, Any, Mapping[str, Any]] | None = None
    self._hint = hint  # what to change when no sample is to blame
    self._last_good_step = last_good_step
    self._describe_sample = describe_sample or (lambda index: f"sample {index}")

  def push(self, step: int, metrics: Mapping[str, Any], local_batch: Mapping[str, Any]) -> None:
    """Records step `step` and checks the one before it."""
    previous, self._pending = self._pending, (step, metrics, local_batch)
    if previous is not None:
      self._check(*previous)

  def check_now(self) -> None:
    """Checks the newest step too (before logging or saving it)."""
    pending, self._pending = self._pending, None
    if pending is not None:
      self._check(*pending)

  def _check(self, step: int, metrics: Mapping[str, Any], local_batch: Mapping[str, Any]) -> None:
    loss, grad_norm = (float(np.asarray(jax.device_get(metrics[k]))) for k in ("loss", "grad_norm"))
    if math.isfinite(loss) and math.isfinite(grad_norm):
      return
    last = self._last_good_step()
    resume = (f"the last checkpoint, step {last}, is intact" if last is not None
              else "no checkpoint was written")
    cause = self._data_cause(metrics, local_batch) or self._hint
    raise NonFiniteError(f"step {step}: loss {loss}, gradient norm {grad_norm}: stopped without saving "
                         f"({resume}): {cause}")

  def _data_cause(self, metrics: Mapping[str, Any], local_batch: Mapping[str, Any]) -> str | None:
    """Names the batch field and samples that hold non-finite inputs, if any do."""
    indices = local_batch.get("index")
    indices = np.asarray(indices) if isinstance(indices, np.ndarray) else None
    for name, value in local_batch.items():
      if not (isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating)):
        continue
      finite = np.isfinite(value)
      if finite.all():
        continue
      samples = ""
      if indices is not None and value.shape[:indices.ndim] == indices.shape:
        bad_rows = ~finite.reshape(indices.size, -1).all(axis=1)
        samples = self._samples(indices.reshape(-1)[bad_rows])
      return f"batch field {name!r} holds non-finite values{samples}: fix those samples in the dataset"
    per_sample = metrics.get("per_sample_loss")
    if per_sample is not None:
      losses = np.asarray(jax.device_get(per_sample)).reshape(-1)
      bad = ~np.isfinite(losses)
      if 0 < bad.sum() < len(losses):
        samples = self._samples(indices.reshape(-1)[bad]) if indices is not None and indices.size == len(losses) else ""
        return f"{int(bad.sum())} of {len(losses)} samples have a non-finite loss{samples}: check those samples"
    return None

  def _samples(self, indices: np.ndarray) -> str:
    named = [self._describe_sample(int(index)) for index in indices[:3]]
    more = f" and {len(indices) - 3} more" if len(indices) > 3 else ""
    return f" ({', '.join(named)}{more})"
