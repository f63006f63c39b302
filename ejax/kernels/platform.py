"""Which backend the kernels are built for: the one JAX runs on, unless a caller lowers for another.

The kernels choose their path when traced: Pallas compiled for a GPU, Pallas in interpret mode
elsewhere, cuDNN attention only on a GPU. `lowering_for("gpu")` makes those choices for a GPU while
the process runs on CPU, so that `jax.export(..., platforms=["cuda"])` on a CPU-only machine lowers
the real GPU program (Triton and cuDNN custom calls) instead of the CPU one:

    with lowering_for("gpu"):
      exported = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=...)(*args)

Trace a function inside the context that was not traced outside it (a fresh `jax.jit` of a new
closure): jit caches a trace per function and arguments, not per this setting.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# A Pallas dot with fp32 accumulation and trans_a / trans_b: pl.dot up to jax 0.10; jax 0.11 removed it
# in favour of the Triton backend's own (which 0.9.2, ejax's pinned version, does not have).
pallas_dot = getattr(plgpu, "dot", None) or pl.dot

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("ejax_kernel_target", default=None)
BACKENDS = ("cpu", "gpu", "tpu")


def target_backend() -> str:
  """"gpu", "cpu" or "tpu": the backend kernels are traced for."""
  return _TARGET.get() or jax.default_backend()


def on_gpu() -> bool:
  return target_backend() == "gpu"


@contextlib.contextmanager
def lowering_for(backend: str):
  """Traces kernels for `backend` inside the block, whatever device this process has."""
  if backend not in BACKENDS:
    raise ValueError(f"lowering_for: backend {backend!r} is not one of {BACKENDS}")
  token = _TARGET.set(backend)
  try:
    yield
  finally:
    _TARGET.reset(token)
