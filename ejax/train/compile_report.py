"""A full-size train step compiled for a simulated cluster: per-device memory and collectives.

Nothing of model size is allocated: the state and the batch are `jax.ShapeDtypeStruct`s with their
shardings, and the step (the trainer's own, ejax/train/step.py) is lowered and compiled for a mesh
of fake CPU devices. XLA's SPMD partitioner writes the per-device program a cluster of that shape
would run, so its buffer assignment (`memory_analysis()`) and its collectives are the cluster's;
only the code generated is for CPUs. Run it in a fresh process (the device count is fixed when JAX
starts):

  python -m ejax.train.compile_report --config=configs/groot.py --mesh=data=128,fsdp=8
  python -m ejax.train.compile_report --config=configs/pi05.py --mesh=data=64,fsdp=8,tensor=2

XLA:CPU's buffers are not a GPU's (it converts bf16 weights to f32 for its matmuls, and its attention
is not a flash kernel). `--target=h100` compiles the same step with XLA:GPU for compile-only H100s
(ejax/parallel/aot_target.py: it needs JAX's CUDA plugin, no GPU), the kernels traced as for a GPU:

  .venv-cuda/bin/python -m ejax.train.compile_report --target=h100 \
      --config=configs/pi05.py:lora --mesh=data=1 --per_device_batch=32

and adds what the GPU program launches a step and the time floor its work allows (ejax/parallel/gpu_program.py).

The batch: the config's global_batch_size is the batch of one 8-GPU node (the configs' launch
line), so the global batch is global_batch_size / 8 samples per device (--per_device_batch to
change it); a data shard of a tensor-parallel mesh holds the samples of its tensor-parallel GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Any

from ejax.parallel import aot_target, gpu_program, hlo

# XLA:CPU's default scheduler orders independent work for thread parallelism, not memory: it ran
# all of pi0.5's rematerialised SigLIP forwards before their backwards (108 GB of temporaries per
# device instead of 43 GB). A GPU schedules under a memory limit; XLA's memory-minimising scheduler is
# closer to it.
MEMORY_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)
# Skipping LLVM's expensive passes on the CPU code changes nothing that is reported here (buffer
# assignment and the partitioned HLO come before code generation) and saves compile time.
FAST_COMPILE_FLAGS = ("--xla_llvm_disable_expensive_passes=true", "--xla_backend_optimization_level=0")


def use_fake_devices(count: int, fast_compile: bool = True) -> None:
  """`count` CPU devices for this process; call before JAX creates its CPU client."""
  flags = os.environ.get("XLA_FLAGS", "")
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
  flags += f" --xla_force_host_platform_device_count={count}"
  wanted = MEMORY_FLAGS + (FAST_COMPILE_FLAGS if fast_compile else ())
  flags += " " + " ".join(f for f in wanted if f.split("=")[0] not in flags)
  os.environ["XLA_FLAGS"] = flags.strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


# --- The step, from abstract shapes ------------------------------------------------------------


def abstract_batch(model_config, global_batch: int, mesh, rules, accum: int = 1) -> dict:
  """ShapeDtypeStructs of a `global_batch`-sample batch, each sharded on its batch axis.

  The model's example batch is built for a few samples and its leading sizes (samples, packed rows,
  image slots) scaled to `global_batch`: they are linear in the sample count (checked here on two
  small sizes), and the full batch's images alone would take gigabytes of host memory. With
  accum > 1 the batch is `accum` stacked micro-batches [accum, global_batch / accum, ...], as
  ejax/train/inputs.py feeds gradient accumulation.
  """
  import jax
  import numpy as np

  from ejax.models.registry import example_config, get_model_spec
  from ejax.parallel.data import batch_sharding, process_batch_shards

  spec = get_model_spec(model_config.name)
  micro = global_batch // accum
  # An auto packed row: the example batch's, planned for a device's share as the train job plans it
  # (ejax/data/row_plan.py), so that every device holds whole rows.
  shards = max(process_batch_shards(mesh, rules), 1)
  share = max(1, micro // shards)  # a device's samples
  model_config = example_config(model_config, share)
  small = 8 * int(model_config.get("packing", {}).get("samples_per_row", 1))
  one, two = spec.example_batch(model_config, small, 0), spec.example_batch(model_config, 2 * small, 0)
  out = {}
  for name, value in one.items():
    if not isinstance(value, np.ndarray) or value.dtype == object:
      continue
    lead, lead2 = value.shape[0], two[name].shape[0]
    if lead2 != 2 * lead or value.shape[1:] != two[name].shape[1:]:
      raise ValueError(f"batch field {name!r} is {value.shape} for {small} samples and {two[name].shape} for "
                       f"{2 * small}: its leading size is not proportional to the sample count")
    # A device's packed rows are ceil(its samples / samples a row), the last one part full, as the
    # train job lays them out (ejax/data/row_plan.py); per-sample fields scale exactly.
    shape = (shards * -(-share * lead // small),) + value.shape[1:]
    if accum > 1:
      shape = (accum,) + shape
    sharding = batch_sharding(mesh, rules, len(shape), leading=shape[accum > 1], batch_axis=int(accum > 1))
    out[name] = jax.ShapeDtypeStruct(shape, value.dtype, sharding=sharding)
  return out


@dataclasses.dataclass
class CompiledStep:
  compiled: Any
  abstract_state: Any   # the TrainState of ShapeDtypeStructs (no shardings)
  state_shardings: Any
  batch: dict           # name -> ShapeDtypeStruct with sharding
  lower_seconds: float
  compile_seconds: float


def lower_train_step(config, mesh, batch: dict):
  """The trainer's jitted train step for `config`, lowered for `mesh` from the state's shapes on `batch`
  (arrays or ShapeDtypeStructs, each with its sharding): (lowered, abstract state, its shardings, the
  optimizer)."""
  from ejax.checkpoint import abstract_target
  from ejax.parallel.rules import sharding_context
  from ejax.train.optim import make_optimizer
  from ejax.train.state import abstract_train_state, model_parts
  from ejax.train.step import jit_train_step, make_train_step

  rules = [tuple(rule) for rule in config.sharding_rules]
  tx, schedule = make_optimizer(config.train)
  abstract, shardings = abstract_train_state(config.model, config.train, tx, mesh, rules)
  step = jit_train_step(make_train_step(model_parts(config.model), tx, schedule, config.train),
                        shardings, {k: v.sharding for k, v in batch.items()}, mesh)
  with sharding_context(mesh, rules):  # as the trainer traces it (ejax/train/loop.py)
    lowered = step.lower(abstract_target(abstract, shardings), batch)
  return lowered, abstract, shardings, tx


def compile_train_step(config, mesh, global_batch: int) -> CompiledStep:
  """The trainer's jitted train step for `config`, lowered and compiled for `mesh` from shapes."""
  from ejax.train.step import compiler_options

  rules = [tuple(rule) for rule in config.sharding_rules]
  start = time.perf_counter()
  batch = abstract_batch(config.model, global_batch, mesh, rules, int(config.train.grad_accum_steps))
  lowered, abstract, shardings, _ = lower_train_step(config, mesh, batch)
  lowered_at = time.perf_counter()
  compiled = lowered.compile(compiler_options(config.train))
  done = time.perf_counter()
  return CompiledStep(compiled, abstract, shardings, batch, lowered_at - start, done - lowered_at)


# --- Reading the compiled program --------------------------------------------------------------


def memory_per_device(compiled) -> dict[str, int]:
  """Bytes per device from XLA's buffer assignment: arguments, outputs, temporaries, aliased.

  The state is donated, so outputs alias arguments: the peak is arguments + outputs - aliased +
  temporaries (`total`).
  """
  memory = compiled.memory_analysis()
  fields = {name: int(getattr(memory, f"{name}_size_in_bytes", 0) or 0)
            for name in ("argument", "output", "temp", "alias", "generated_code")}
  fields["total"] = fields["argument"] + fields["output"] - fields["alias"] + fields["temp"]
  return fields


def text_with_operand_shapes(compiled) -> str:
  """The optimized HLO with each operand's shape written beside its name. XLA:GPU's collectives are
  asynchronous (`all-gather-start`, `reduce-scatter-start`, ...), and ejax.parallel.hlo reads their
  buffer sizes from the operands, which `as_text()` writes as bare names."""
  try:
    from jaxlib._jax import HloPrintOptions
  except ImportError:  # jax >= 0.11 keeps the HLO bindings in jaxlib._hlo
    from jaxlib._hlo import HloPrintOptions
  options = HloPrintOptions()
  options.print_operand_shape = True
  return "\n".join(module.to_string(options) for module in compiled.runtime_executable().hlo_modules())


# --- Report ------------------------------------------------------------------------------------


def parse_mesh(text: str) -> dict[str, int]:
  """"data=128,fsdp=8" -> {"data": 128, "fsdp": 8}."""
  sizes = {}
  for part in text.split(","):
    name, _, size = part.partition("=")
    if not size:
      raise ValueError(f"--mesh {text!r}: write axis=size pairs, e.g. data=128,fsdp=8")
    sizes[name.strip()] = int(size)
  return sizes


def load_config_file(path: str, arg: str | None = None):
  """get_config(arg) of a config file (configs/*.py import `configs.common`: run from the repo root)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("ejax_compiled_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  from ejax.train.rows import resolve
  return resolve(module.get_config(arg))


def state_bytes_per_device(step: CompiledStep) -> dict[str, int]:
  """Bytes of each part of the train state on the most loaded device (from the shardings alone)."""
  from ejax.parallel.params import bytes_per_device
  parts = {}
  for name in ("params", "frozen", "opt_state", "ema_params", "frozen_fp8"):
    tree = getattr(step.abstract_state, name)
    parts[name] = bytes_per_device(tree, getattr(step.state_shardings, name)) if tree is not None else 0
  parts["frozen"] += parts.pop("frozen_fp8")  # train.frozen_fp8's copies count with the weights they copy
  return parts


def report(config_path: str, mesh_sizes: dict[str, int], per_device_batch: int | None = None,
           config_arg: str | None = None, grad_accum: int = 0, target: str = "cpu") -> dict:
  """Compiles config_path's train step on a mesh of this process's devices (target "cpu") or of
  compile-only GPUs (a target of ejax.parallel.aot_target); a JSON-able dict."""
  import contextlib

  import jax

  from ejax.kernels import platform
  from ejax.parallel import make_mesh

  config = load_config_file(config_path, config_arg)
  if grad_accum:
    config.train.grad_accum_steps = grad_accum
  devices = None if target == "cpu" else aot_target.compile_only_devices(target, math.prod(mesh_sizes.values()))
  mesh = make_mesh(mesh_sizes, devices)
  # Samples per GPU as the config has them on one 8-GPU node; tensor-parallel GPUs share their
  # data shard's samples, so every mesh of the same devices trains the same global batch.
  per_device = per_device_batch or max(1, config.train.global_batch_size // hlo.NODE_SIZE)
  with contextlib.nullcontext() if target == "cpu" else platform.lowering_for("gpu"):
    step = compile_train_step(config, mesh, per_device * mesh.size)
  text = step.compiled.as_text() if target == "cpu" else text_with_operand_shapes(step.compiled)
  found = hlo.collectives(text, mesh.size)
  cost = step.compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  kernels = None if target == "cpu" else gpu_program.read(text).summary(target)
  return dict(
      config=config_path, mesh={k: int(v) for k, v in mesh.shape.items()}, devices=mesh.size,
      global_batch=per_device * mesh.size, per_device_batch=per_device,
      grad_accum_steps=int(config.train.grad_accum_steps),
      memory=memory_per_device(step.compiled), state=state_bytes_per_device(step),
      collectives=hlo.collective_summary(found), collective_ops=[dataclasses.asdict(c) for c in found],
      matmul_flops_per_device=hlo.matmul_flops(text),
      xla_cost_analysis_flops_per_device=float((cost or {}).get("flops", 0.0)),
      lower_seconds=round(step.lower_seconds, 1), compile_seconds=round(step.compile_seconds, 1),
      target=target, device_kind=mesh.devices.flat[0].device_kind, jax=jax.__version__, kernels=kernels)


TABLE_HEADER = ("| config | mesh | samples / device | state GiB: params + frozen + Adam + EMA | arguments GiB | "
                "temporaries GiB | peak GiB | all-gather n / GiB | all-reduce n / GiB | all-to-all n / GiB | "
                "sent GiB: NVLink / InfiniBand | lower + compile s |\n|" + "---|" * 12)


def format_row(result: dict) -> str:
  """One row of TABLE_HEADER's table (GiB per device; collectives per step)."""
  gib = 2**30
  memory, summary, state = result["memory"], result["collectives"], result["state"]
  mesh = " x ".join(f"{k}={v}" for k, v in result["mesh"].items() if v > 1)
  samples = str(result["per_device_batch"])
  if result["grad_accum_steps"] > 1:
    samples += f" ({result['grad_accum_steps']} x {result['per_device_batch'] // result['grad_accum_steps']})"

  def collective(kind):
    row = summary.get(kind)
    return f"{int(row['count'])} / {row['buffer_bytes'] / gib:.1f}" if row else "0"

  sent = sum(r["sent_bytes"] for r in summary.values())
  inter = sum(r["sent_bytes_inter_node"] for r in summary.values())
  parts = " + ".join(f"{state[k] / gib:.2f}" for k in ("params", "frozen", "opt_state", "ema_params"))
  return (f"| {result['config']} | {mesh} | {samples} | {parts} | {memory['argument'] / gib:.1f} | "
          f"{memory['temp'] / gib:.1f} | {memory['total'] / gib:.1f} | {collective('all-gather')} | "
          f"{collective('all-reduce')} | {collective('all-to-all')} | {(sent - inter) / gib:.1f} / {inter / gib:.1f} | "
          f"{result['lower_seconds']:.0f} + {result['compile_seconds']:.0f} |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True, help="a config file, e.g. configs/groot.py (':arg' allowed)")
  parser.add_argument("--mesh", required=True, help="axis sizes, e.g. data=128,fsdp=8 or data=64,fsdp=8,tensor=2")
  parser.add_argument("--per_device_batch", type=int, default=0,
                      help="samples per device (0: the config's global_batch_size / 8)")
  parser.add_argument("--grad_accum", type=int, default=0,
                      help="micro-batches per step (0: the config's train.grad_accum_steps)")
  parser.add_argument("--json", default="", help="also write the result here")
  parser.add_argument("--full_compile", action="store_true", help="keep LLVM's expensive passes (slower)")
  parser.add_argument("--target", default="cpu", choices=("cpu",) + tuple(aot_target.TARGET_CONFIGS),
                      help="cpu: fake CPU devices; h100: XLA:GPU for compile-only H100s (needs JAX's CUDA plugin)")
  args = parser.parse_args(argv)
  sizes = parse_mesh(args.mesh)
  if args.target == "cpu":
    use_fake_devices(math.prod(sizes.values()), fast_compile=not args.full_compile)
  else:
    aot_target.run_jax_on_cpu()
  path, _, arg = args.config.partition(":")
  try:
    result = report(path, sizes, args.per_device_batch or None, arg or None, args.grad_accum, args.target)
  except aot_target.TargetError as error:
    sys.exit(f"error: {error}")
  except Exception as error:  # noqa: BLE001 (one known XLA:GPU failure gets its remedy; others raise)
    if aot_target.TRITON_TILING_FAILURE not in str(error):
      raise
    sys.exit("error: XLA:GPU found no Triton GEMM tiling for one of the step's dots (it cannot autotune "
             "without a GPU): rerun with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (cuBLAS matmuls)")
  print(TABLE_HEADER)
  print(format_row(result))
  if result["kernels"]:
    print(gpu_program.format_line(result["kernels"]))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
