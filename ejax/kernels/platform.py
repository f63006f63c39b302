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
import inspect

import jax
from jax.experimental import pallas as pl

try:  # Pallas's Triton backend, which jax 0.12 deprecates "to be removed in a future JAX version"
  from jax.experimental.pallas import triton as plgpu
except ImportError:
  plgpu = None

# A Pallas dot with fp32 accumulation and trans_a / trans_b: pl.dot up to jax 0.10; jax 0.11 removed it
# in favour of the Triton backend's own (which 0.9.2, ejax's pinned version, does not have).
pallas_dot = getattr(plgpu, "dot", None) or getattr(pl, "dot", None)


def triton_missing() -> str | None:
  """Why ejax's Pallas Triton kernels (the varlen attention kernel `pallas_gpu`, the block-wise FP8
  GEMM) cannot be built with this jax, or None when they can. Without them attention's auto takes
  XLA or the Hopper routes that need no Triton, and FP8's auto the jnp reference."""
  if plgpu is None or pallas_dot is None:
    return f"jax {jax.__version__} has no Pallas Triton backend (jax.experimental.pallas.triton)"
  return None


def varying_axes(x) -> frozenset[str]:
  """The jax.shard_map mesh axes that x varies over (none outside shard_map). Avals call them
  `vma` up to jax 0.10; jax 0.11 moved them to `manual_axis_type.varying`."""
  aval = jax.typeof(x)
  axes = getattr(aval, "vma", None)
  if axes is None:
    axes = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
  return frozenset(axes)


def varying_struct(shape, dtype, sources) -> jax.ShapeDtypeStruct:
  """A ShapeDtypeStruct (a pallas_call's out_shape) typed as varying over every jax.shard_map axis
  that the arrays in `sources` vary over: under shard_map's varying-axes check a kernel's outputs
  need it. jax <= 0.10 takes the axes as `vma`, jax 0.11 as a `manual_axis_type`."""
  leaves = jax.tree.leaves(sources)
  axes = frozenset().union(*(varying_axes(leaf) for leaf in leaves))
  if "vma" in inspect.signature(jax.ShapeDtypeStruct).parameters:
    return jax.ShapeDtypeStruct(shape, dtype, vma=axes)
  manual = jax.typeof(leaves[0]).manual_axis_type.update(varying=axes)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)


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
    with _stand_in_device(backend):
      yield
  finally:
    _TARGET.reset(token)


# The GPU lowered for on a host without one: the lent machines' Hopper (sm_90).
_STAND_IN_GPU = dict(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def _stand_in_device(backend: str):
  """jax >= 0.11 lowers a Pallas Triton kernel for the compute capability of the device it runs
  on, or of the abstract mesh's abstract device ("No supported GPU devices found" without either):
  off a GPU, lowering for one names an H100 there. Older jax lowers Triton kernels without asking,
  and its abstract devices name no platform."""
  if backend != "gpu" or jax.default_backend() == "gpu":
    return contextlib.nullcontext()
  try:
    device = jax.sharding.AbstractDevice(**_STAND_IN_GPU)
  except TypeError:
    return contextlib.nullcontext()
  mesh = jax.sharding.get_abstract_mesh()
  return jax.sharding.use_abstract_mesh(mesh.update(abstract_device=device))
