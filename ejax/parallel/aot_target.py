"""Compile-only GPUs: XLA:GPU compiles a program for GPUs this host does not have (deviceless AOT).

`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=..., topology=...)`
asks the CUDA PJRT plugin for devices described by a GpuTargetConfigProto (the GPU's description in
text format, kept beside this file) instead of by a driver. `jax.jit(f).lower(ShapeDtypeStructs
sharded on a mesh of them).compile()` then runs XLA:GPU's whole pipeline (fusion, scheduling, buffer
assignment, PTX and ptxas from the nvidia wheels) and no GPU is touched: no autotuning, so GEMM
and fusion choices are XLA's defaults. Nothing CUDA is imported until `compile_only_devices` runs.
Where XLA:GPU stops on a Triton GEMM's tiling (TRITON_TILING_FAILURE below),
`XLA_FLAGS=--xla_gpu_enable_triton_gemm=false` compiles the matmuls as cuBLAS calls instead; the train
step carries that option itself (train.triton_gemm False, ejax.train.step.compiler_options).

The plugin must be the version of the jaxlib it loads into. A separate venv that reuses ejax's:

  .venv/bin/python -m venv .venv-cuda                                # the same Python as .venv
  echo "$PWD/.venv/lib/python3.11/site-packages" > .venv-cuda/lib/python3.11/site-packages/ejax.pth
  .venv-cuda/bin/pip install "jax-cuda12-plugin[with-cuda]==0.9.2"    # ejax's pinned jax
  .venv-cuda/bin/python -m ejax.train.compile_report --target=h100 ...   # from the repo root

For the jax the GPU machines carry (0.11.2), the same over .venv-jax011 (.ci/jax011-venv):

  python3.12 -m venv .venv-cuda011
  echo "$PWD/.venv-jax011/lib/python3.12/site-packages" > .venv-cuda011/lib/python3.12/site-packages/ejax.pth
  .venv-cuda011/bin/pip install "jax-cuda12-plugin[with-cuda]==0.11.2"

and for the newest jax (0.12.0.1 on 2026-11-30; `JAX=0.12.0.1 .ci/jax011-venv` builds .venv-jax012) the
same with 012 and 0.12.0.1.

Mosaic GPU kernels compile to SASS as they lower; `MOSAIC_GPU_DUMP_PTXAS=1` prints ptxas's register
and spill report, `MOSAIC_GPU_DUMP_SASS=1` the SASS itself, which needs nvdisasm beside ptxas (the
plugin's wheels lack it) and CUDA_ROOT naming that directory:

  .venv-cuda011/bin/pip install nvidia-cuda-nvdisasm
  N=$PWD/.venv-cuda011/lib/python3.12/site-packages/nvidia
  ln -s $N/cu13/bin/nvdisasm $N/cuda_nvcc/bin/nvdisasm
  CUDA_ROOT=$N/cuda_nvcc MOSAIC_GPU_DUMP_SASS=1 PYTHONPATH=$PWD .venv-cuda011/bin/python SCRIPT
"""

from __future__ import annotations

import importlib.util
import os

TARGET_CONFIGS = {"h100": "h100_target_config.txtpb"}  # target name -> GpuTargetConfigProto file here
# What XLA:GPU (jaxlib 0.9.2) raises when no Triton GEMM tiling fits a dot and there is no GPU to
# autotune on (DreamZero's DiT, GR00T on 1,024 GPUs); XLA_FLAGS=--xla_gpu_enable_triton_gemm=false avoids it.
TRITON_TILING_FAILURE = "Couldn't find output tile sizes"
DEVICES_PER_HOST = 8  # GPUs a host of a multi-GPU topology has (an 8-GPU NVLink node)
_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


class TargetError(RuntimeError):
  """A compile-only target that cannot be set up here; the message says what to do."""


def target_config(target: str) -> str:
  """The GpuTargetConfigProto text of `target`."""
  if target not in TARGET_CONFIGS:
    raise TargetError(f"target {target!r} is not one of {sorted(TARGET_CONFIGS)}")
  with open(os.path.join(os.path.dirname(__file__), TARGET_CONFIGS[target])) as f:
    return f.read()


def install_hint() -> str:
  import jax
  return f'pip install "jax-cuda12-plugin[with-cuda]=={jax.__version__}" (in a venv of its own: see ejax/parallel/aot_target.py)'


def cuda_plugin_installed() -> bool:
  try:
    return any(importlib.util.find_spec(name) is not None for name in _PLUGINS)
  except ModuleNotFoundError:  # no jax_plugins namespace at all
    return False


def run_jax_on_cpu() -> None:
  """JAX's own backend is the CPU: no GPU is probed, and the CUDA plugin skips its driver and
  library version checks (which fail without a GPU and then leave the plugin unregistered)."""
  import jax
  jax.config.update("jax_platforms", "cpu")


def topology_name(count: int) -> str:
  """The plugin's "<partitions>x<hosts>x<devices per host>" for `count` GPUs in 8-GPU hosts."""
  if count < 1 or (count > DEVICES_PER_HOST and count % DEVICES_PER_HOST):
    raise TargetError(f"{count} GPUs do not fill hosts of {DEVICES_PER_HOST}: use 1-{DEVICES_PER_HOST} "
                      f"or a multiple of {DEVICES_PER_HOST}")
  per_host = min(count, DEVICES_PER_HOST)
  return f"1x{count // per_host}x{per_host}"


def compile_only_devices(target: str, count: int) -> list:
  """`count` compile-only devices of `target` (e.g. "h100"), hosts of 8, in device-id order."""
  text = target_config(target)
  name = topology_name(count)
  if not cuda_plugin_installed():
    raise TargetError(f"--target={target} compiles with XLA:GPU, and JAX's CUDA plugin is not installed: "
                      + install_hint())
  from jax.experimental import topologies
  topology = topologies.get_topology_desc(platform="cuda", target_config=text, topology=name)
  devices = sorted(topology.devices, key=lambda device: device.id)
  if len(devices) != count:
    raise TargetError(f"topology {name} gave {len(devices)} devices, expected {count}")
  return devices
