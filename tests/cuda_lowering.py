"""Lowering for CUDA on a CPU-only machine: `jax.export(..., platforms=["cuda"])` with the kernels
traced for a GPU (ejax.kernels.platform.lowering_for), and readers of the lowered module's text.

Lowering is the whole GPU path up to XLA's GPU compiler: Pallas kernels become Triton custom calls
carrying their Triton IR, cuDNN attention a cuDNN custom call. It does not compile the Triton IR to
machine code (benchmarks/triton_sm90.py does, with a pip-installed Triton) nor run anything: it
proves the programs build, not that they are fast.
"""

from __future__ import annotations

import collections
import re

import jax
import pytest
from jax import export

from ejax.kernels.platform import lowering_for

TRITON = "__gpu$xla.gpu.triton"
# The cuDNN fused attention targets ejax's cudnn path can emit (a dense mask travels as a bias).
CUDNN_ATTENTION = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")
# The ones "auto" emits for attention with no mask at all (no bias): forward, backward.
CUDNN_UNMASKED = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
# Targets export may serialise. jax.export refuses any other custom call (they have no stability
# guarantee), so an unexpected one fails the lowering loudly.
ALLOWED_CUSTOM_CALLS = (TRITON, *CUDNN_ATTENTION, *CUDNN_UNMASKED)


def lower_for_cuda(jitted, *args) -> str:
  """The StableHLO text of `jitted(*args)` exported for CUDA, kernels traced for a GPU.

  `jitted` must be a fresh jax.jit (see ejax.kernels.platform); args may be ShapeDtypeStructs.
  """
  checks = [export.DisabledSafetyCheck.custom_call(target) for target in ALLOWED_CUSTOM_CALLS]
  with lowering_for("gpu"):
    exported = export.export(jitted, platforms=["cuda"], disabled_checks=checks)(*args)
  assert exported.platforms == ("cuda",)
  return exported.mlir_module()


def custom_calls(module: str) -> collections.Counter:
  """How many times each custom-call target appears in the module."""
  return collections.Counter(re.findall(r"custom_call @([\w$.]+)\(", module))


def triton_kernels(module: str) -> collections.Counter:
  """Triton custom calls by kernel name (the pallas_call's `name`).

  A kernel called from several places can appear once: export deduplicates identical functions.
  """
  return collections.Counter(re.findall(
      r'custom_call @__gpu\$xla\.gpu\.triton\(.*?\bname = "([^"]+)"', module))


@pytest.fixture
def forbid_fallbacks(monkeypatch):
  """Any jnp/XLA stand-in for a GPU kernel fails the test if it is traced: attention's dense
  reference and blockwise XLA path, and the FP8 GEMM's reference."""

  def fail(name):
    def fallback(*args, **kwargs):
      raise AssertionError(f"{name} was traced while lowering for CUDA: a GPU kernel fell back")
    return fallback

  monkeypatch.setattr("ejax.kernels.attention.ops.attention_reference", fail("attention_reference"))
  monkeypatch.setattr("ejax.kernels.attention.xla.forward", fail("attention's XLA forward"))
  monkeypatch.setattr("ejax.kernels.attention.xla.backward", fail("attention's XLA backward"))
  monkeypatch.setattr("ejax.kernels.fp8.matmul.fp8_matmul_reference", fail("fp8_matmul_reference"))


@pytest.fixture
def cudnn_h100(monkeypatch):
  """jax checks the installed cuDNN's version while tracing cuDNN attention; this CPU-only jaxlib
  has none. Stand in cuDNN 9.8: the check passes and the lowering is the one a GPU machine with
  that cuDNN produces. The compute capability is read from the backend and
  reads as pre-Hopper here, which only tightens cuDNN's shape limits."""
  monkeypatch.setattr("jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version", lambda: 90800)


@pytest.fixture
def tokamax_h100(monkeypatch):
  """Lowering tokamax's kernels from a CPU host as for an H100: tokamax reads the compute capability
  from the device, its persistent kernels size their grid from the device's core count (132 SMs), and
  jax >= 0.11's Triton lowering (the fallback branch) asks for the GPU's description. Yields a
  non-persistent tokamax config for calls that pass one. Needs tokamax (Python >= 3.12, jax >= 0.11.1)."""
  import types

  import tokamax
  from jax._src.pallas.triton import gpu_info
  from tokamax._src import gpu_utils
  from tokamax._src import mosaic_gpu as tokamax_mosaic_gpu

  from ejax.kernels.attention import tokamax_gpu

  monkeypatch.setattr(gpu_utils, "_compute_capability", lambda device=None: 9.0)
  h100_device = types.SimpleNamespace(core_count=132)
  monkeypatch.setattr(tokamax_mosaic_gpu, "backend", types.SimpleNamespace(get_default_device=lambda: h100_device))
  h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
  monkeypatch.setattr("jax._src.pallas.triton.pallas_call_registration.gpu_info_lib.get_gpu_info", lambda: h100)
  with tokamax.config.cross_compile(True):
    yield tokamax_gpu.sm90_config(persistent=False)

