"""A full-size train step compiled for a simulated cluster: per-device memory and collectives.

Nothing of model size is allocated: the state and the batch are `jax.ShapeDtypeStruct`s with their
shardings, and the step (the trainer's own, ejax/train/step.py) is lowered and compiled for a mesh
of fake CPU devices. XLA's SPMD partitioner writes the per-device program a cluster of that shape
would run, so its buffer assignment (`memory_analysis()`) and its collectives are the cluster's;
only the code generated is for CPUs. Run it in a fresh process (the device count is fixed when JAX
starts):

  python -m ejax.parallel.compile_report --config=configs/groot.py --mesh=data=128,fsdp=8
  python -m ejax.parallel.compile_report --config=configs/pi05.py --mesh=data=64,fsdp=8,tensor=2

The batch: the config's global_batch_size is the batch of one 8-GPU node (the configs' launch
line), so each device of the data and fsdp axes gets global_batch_size / 8 samples
(--per_device_batch to change it); tensor-parallel devices share theirs.
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

# Skipping LLVM's expensive passes on the CPU code changes nothing that is reported here (buffer
# assignment and the partitioned HLO come before code generation) and saves compile time.
FAST_COMPILE_FLAGS = ("--xla_llvm_disable_expensive_passes=true", "--xla_backend_optimization_level=0")
NODE_SIZE = 8  # GPUs per node of the simulated cluster (an 8-GPU NVLink domain)
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def use_fake_devices(count: int, fast_compile: bool = True) -> None:
  """`count` CPU devices for this process; call before JAX creates its CPU client."""
  flags = os.environ.get("XLA_FLAGS", "")
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
  flags += f" --xla_force_host_platform_device_count={count}"
  if fast_compile:
    flags += " " + " ".join(f for f in FAST_COMPILE_FLAGS if f.split("=")[0] not in flags)
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

  from ejax.models.registry import get_model_spec
  from ejax.parallel.data import batch_sharding

  spec = get_model_spec(model_config.name)
  micro = global_batch // accum
  small = 8 * int(model_config.get("packing", {}).get("samples_per_row", 1))
  one, two = spec.example_batch(model_config, small, 0), spec.example_batch(model_config, 2 * small, 0)
  out = {}
  for name, value in one.items():
    if not isinstance(value, np.ndarray) or value.dtype == object:
      continue
    lead, lead2 = value.shape[0], two[name].shape[0]
    if lead2 != 2 * lead or value.shape[1:] != two[name].shape[1:] or (micro * lead) % small:
      raise ValueError(f"batch field {name!r} is {value.shape} for {small} samples and {two[name].shape} for "
                       f"{2 * small}: its leading size is not proportional to the sample count")
    shape = (micro * lead // small,) + value.shape[1:]
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


def compile_train_step(config, mesh, global_batch: int) -> CompiledStep:
  """The trainer's jitted train step for `config`, lowered and compiled for `mesh` from shapes."""
  import jax

  from ejax.parallel.rules import sharding_context
  from ejax.train.optim import make_optimizer
  from ejax.train.state import abstract_train_state, model_parts
  from ejax.train.step import jit_train_step, make_train_step

  rules = [tuple(rule) for rule in config.sharding_rules]
  tx, schedule = make_optimizer(config.train)
  start = time.perf_counter()
  abstract, shardings = abstract_train_state(config.model, config.train, tx, mesh, rules)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  batch = abstract_batch(config.model, global_batch, mesh, rules, int(config.train.grad_accum_steps))
  step = jit_train_step(make_train_step(model_parts(config.model), tx, schedule, config.train),
                        shardings, {k: v.sharding for k, v in batch.items()}, mesh)
  with mesh, sharding_context(mesh, rules):  # as the trainer traces it (ejax/train/loop.py)
    lowered = step.lower(state, batch)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
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


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
                "s4": 0.5, "u4": 0.5}
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")


def _shape_bytes(text: str) -> int:
  """Bytes of every array shape written in `text` (a tuple shape counts each element)."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    if dtype not in _DTYPE_BYTES:
      continue
    count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += count * _DTYPE_BYTES[dtype]
  return int(total)


def _replica_groups(attributes: str, num_devices: int) -> list[list[int]]:
  """The device groups of a collective, from either HLO spelling of replica_groups."""
  import numpy as np
  iota = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attributes)
  if iota:
    groups = [int(x) for x in iota.group(1).split(",")]
    dims = [int(x) for x in iota.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(3):
      ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
    return ids.reshape(groups[0], -1).tolist()
  listed = re.search(r"replica_groups=\{(\{[0-9,\s]*\}(?:,\s*\{[0-9,\s]*\})*)\}", attributes)
  if listed:
    return [[int(x) for x in group.split(",") if x.strip()] for group in re.findall(r"\{([0-9,\s]*)\}", listed.group(1))]
  return [list(range(num_devices))]  # no groups written: every device


@dataclasses.dataclass
class Collective:
  kind: str          # all-gather | reduce-scatter | all-reduce | ...
  buffer_bytes: int  # the full buffer per device: gathered output, scattered input, reduced buffer
  group_size: int
  crosses_nodes: bool  # a group spans devices of more than one node (NODE_SIZE devices each)
  count: int         # executions per step (while-loop bodies run their trip count)

  @property
  def wire_bytes(self) -> float:
    """Bytes each device sends (ring algorithms): (n-1)/n of the buffer, twice for an all-reduce."""
    n = self.group_size
    if n <= 1:
      return 0.0
    share = (n - 1) / n * self.buffer_bytes
    return 2 * share if self.kind == "all-reduce" else share


def collectives(hlo_text: str, num_devices: int, node_size: int = NODE_SIZE) -> list[Collective]:
  """Every collective of a compiled (partitioned) HLO module, with how often one step runs it.

  Computations called from a while loop run its known trip count (XLA writes known_trip_count on
  loops it can count, e.g. a scan over layers); other called computations (calls, conditionals'
  branches) run once per call.
  """
  bodies: dict[str, list[str]] = {}
  current = None
  entry = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header and not line.startswith(" "):
      current = header.group(1)
      bodies[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is not None and line.strip() and line.strip() != "}":
      bodies[current].append(line)
  calls: dict[str, list[tuple[str, int]]] = {name: [] for name in bodies}
  for name, lines in bodies.items():
    for line in lines:
      trips = 1
      if " while(" in line:
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        trips = int(known.group(1)) if known else 1
      for callee in re.findall(r"(?:body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)", line):
        if callee in bodies and not any(k in line for k in (" reduce(", " all-reduce(", " reduce-scatter(",
                                                                 " scatter(", " sort(", " map(", " reduce-window(",
                                                                 " select-and-scatter(", " all-reduce-start(")):
          calls[name].append((callee, trips if "body=" in line and f"body=%{callee}" in line or
                              f"body={callee}" in line else 1))
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      if branches:
        calls[name] += [(b.strip().lstrip("%"), 1) for b in branches.group(1).split(",")]
  multiplicity: dict[str, int] = {}

  def visit(name: str, times: int) -> None:
    multiplicity[name] = multiplicity.get(name, 0) + times
    for callee, trips in calls.get(name, ()):
      visit(callee, times * trips)

  visit(entry or next(iter(bodies)), 1)
  found: dict[tuple, Collective] = {}
  for name, lines in bodies.items():
    times = multiplicity.get(name, 0)
    if not times:
      continue
    for line in lines:
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      result, op, rest = match.group(2), match.group(3), match.group(4)
      kind = op.removesuffix("-start")
      if kind not in COLLECTIVES or op.endswith("-done"):
        continue
      operands = rest.split(")", 1)[0]
      # A reduce-scatter's full buffer is its operand; the others' is their result.
      buffer = _shape_bytes(operands) if kind == "reduce-scatter" else _shape_bytes(result)
      if op.endswith("-start") and kind != "reduce-scatter":
        buffer = _shape_bytes(result) - _shape_bytes(operands) if kind == "all-gather" else _shape_bytes(operands)
      groups = _replica_groups(rest, num_devices)
      group = groups[0]
      crosses = len({device // node_size for device in group}) > 1
      key = (kind, buffer, len(group), crosses)
      if key in found:
        found[key].count += times
      else:
        found[key] = Collective(kind, buffer, len(group), crosses, times)
  return list(found.values())


def collective_summary(found: list[Collective]) -> dict[str, dict[str, float]]:
  """kind -> {count, buffer_bytes, wire_bytes, wire_bytes_inter_node} summed over one step."""
  summary: dict[str, dict[str, float]] = {}
  for c in found:
    row = summary.setdefault(c.kind, dict(count=0, buffer_bytes=0.0, wire_bytes=0.0, wire_bytes_inter_node=0.0))
    row["count"] += c.count
    row["buffer_bytes"] += c.count * c.buffer_bytes
    row["wire_bytes"] += c.count * c.wire_bytes
    if c.crosses_nodes:
      row["wire_bytes_inter_node"] += c.count * c.wire_bytes
  return summary


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
  return module.get_config(arg)


def state_bytes_per_device(step: CompiledStep) -> dict[str, int]:
  """Bytes of each part of the train state on the most loaded device (from the shardings alone)."""
  from ejax.parallel.params import bytes_per_device
  parts = {}
  for name in ("params", "frozen", "opt_state", "ema_params"):
    tree = getattr(step.abstract_state, name)
    parts[name] = bytes_per_device(tree, getattr(step.state_shardings, name)) if tree is not None else 0
  return parts


def report(config_path: str, mesh_sizes: dict[str, int], per_device_batch: int | None = None,
           config_arg: str | None = None, grad_accum: int = 0) -> dict:
  """Compiles config_path's train step on a mesh of this process's devices; a JSON-able dict."""
  import jax

  from ejax.parallel import make_mesh

  config = load_config_file(config_path, config_arg)
  if grad_accum:
    config.train.grad_accum_steps = grad_accum
  mesh = make_mesh(mesh_sizes)
  batch_ways = mesh.shape["data"] * mesh.shape["fsdp"]
  per_device = per_device_batch or max(1, config.train.global_batch_size // NODE_SIZE)
  global_batch = per_device * batch_ways
  step = compile_train_step(config, mesh, global_batch)
  found = collectives(step.compiled.as_text(), mesh.size)
  cost = step.compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return dict(
      config=config_path, mesh={k: int(v) for k, v in mesh.shape.items()}, devices=mesh.size,
      global_batch=global_batch, per_device_batch=per_device, grad_accum_steps=int(config.train.grad_accum_steps),
      memory=memory_per_device(step.compiled), state=state_bytes_per_device(step),
      collectives=collective_summary(found), collective_ops=[dataclasses.asdict(c) for c in found],
      flops_per_device=float((cost or {}).get("flops", 0.0)),
      lower_seconds=round(step.lower_seconds, 1), compile_seconds=round(step.compile_seconds, 1),
      jax=jax.__version__)


def format_row(result: dict) -> str:
  gib = 2**30
  m, c = result["memory"], result["collectives"]
  mesh = " x ".join(f"{k}={v}" for k, v in result["mesh"].items() if v > 1)

  def coll(kind):
    row = c.get(kind)
    return f"{int(row['count'])} / {row['buffer_bytes'] / gib:.2f}" if row else "0"

  return (f"| {result['config']} | {mesh} | {result['per_device_batch']} | {m['argument'] / gib:.2f} | "
          f"{m['output'] / gib:.2f} | {m['temp'] / gib:.2f} | {m['total'] / gib:.2f} | {coll('all-gather')} | "
          f"{coll('reduce-scatter')} | {coll('all-reduce')} | "
          f"{sum(r['wire_bytes_inter_node'] for r in c.values()) / gib:.2f} | "
          f"{result['lower_seconds']:.0f} + {result['compile_seconds']:.0f} |")


TABLE_HEADER = ("| config | mesh | samples / device | arguments GiB | outputs GiB | temporaries GiB | peak GiB | "
                "all-gather n / GiB | reduce-scatter n / GiB | all-reduce n / GiB | inter-node GiB sent | "
                "lower + compile s |\n|" + "---|" * 12)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True, help="a config file, e.g. configs/groot.py (':arg' allowed)")
  parser.add_argument("--mesh", required=True, help="axis sizes, e.g. data=128,fsdp=8 or data=64,fsdp=8,tensor=2")
  parser.add_argument("--per_device_batch", type=int, default=0,
                      help="samples per data/fsdp device (0: the config's global_batch_size / 8)")
  parser.add_argument("--grad_accum", type=int, default=0,
                      help="micro-batches per step (0: the config's train.grad_accum_steps)")
  parser.add_argument("--json", default="", help="also write the result here")
  parser.add_argument("--full_compile", action="store_true", help="keep LLVM's expensive passes (slower)")
  args = parser.parse_args(argv)
  sizes = parse_mesh(args.mesh)
  use_fake_devices(math.prod(sizes.values()), fast_compile=not args.full_compile)
  path, _, arg = args.config.partition(":")
  result = report(path, sizes, args.per_device_batch or None, arg or None, args.grad_accum)
  print(TABLE_HEADER)
  print(format_row(result))
  print(json.dumps({k: v for k, v in result.items() if k != "collective_ops"}, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
