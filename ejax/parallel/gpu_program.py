"""What one call of a compiled XLA:GPU program launches, and the time floor its work allows.

Read from the optimized HLO of a program compiled for compile-only GPUs (ejax/parallel/aot_target.py,
`ejax.train.compile_report --target=h100`): every instruction of the entry computation and of the
loop bodies it runs is a kernel launch, except the bookkeeping ones (parameter, tuple, bitcast, ...).
A loop XLA counted (`known_trip_count`: a `lax.scan`) runs its body that many times. A loop whose
trip count depends on data (the XLA attention path's tile loops, jax.random's rejection samplers)
counts once here and costs more on a GPU: every iteration copies its condition to the host and waits
for it (`syncing_loops`). So does every conditional (a `lax.cond`): XLA:GPU copies its predicate to the
host and waits for the device before it launches a branch (`syncing_conditionals`), unless the
conditional runs inside a CUDA graph (train.command_buffers).

Per kernel: the bytes it reads and writes (operands and result; an operand a fusion only slices counts
its slices, a gather the rows it takes, a dynamic-update-slice in place counts the update) and, for
GEMMs (cuBLAS calls and fusions holding a dot, XLA's Triton GEMMs), 2 FLOPs per multiply-add. The floor
of a kernel is max(FLOPs / peak, bytes / bandwidth); the program's floor is their sum. Of a
conditional's branches the costliest counts (ejax's attention routes: a kernel path and its fallback
behind a lax.cond). Pallas kernels (Triton and Mosaic GPU: the attention and FP8 kernels) count their
bytes only: their arithmetic depends on the mask's active tiles, which the program does not hold
(ejax.train.flops counts it).
`launch_seconds` prices every launch on top of the floor: the one full-size step timed on a GPU puts
it at ~5 us a launch, its host-synchronised loops' waits included (LAUNCH_SECONDS).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from ejax.parallel import hlo

# Dense bf16 FLOP/s and HBM bytes/s (REFERENCE.md: H100 SXM and H200 datasheets).
DEVICES = {"h100": (989e12, 3.35e12), "h200": (989e12, 4.8e12)}
# Their dense FP8 peak is twice the bf16 one: an FP8 cuBLASLt GEMM's floor counts its FLOPs at it.
FP8_PEAK_SCALE = 2.0
# A launch beyond its floor, from the first full-size step timed on a GPU (H200, 2026-11-27, BENCHMARKS.md
# "Kernels a step"): (481.7 ms - its program's 80.2 ms floor) / its 80,438 launches.
LAUNCH_SECONDS = 5.0e-6
# The model measured against the step whose kernels it reads (GR00T-N1.5, H200, jax 0.11.2, 2026-11-28):
# the device was busy 102.8 ms a step against a floor of 62.6 ms (kernels at 1 / 1.64 of the datasheet's
# rates), and the trainer's step took 114.8 ms: 12.0 ms of gaps over 4,431 launches, 2.7 us each.
# `calibrated_seconds` prices a program so; one step's calibration, which a GEMM-heavier program
# (pi0.5, DreamZero) may beat.
KERNEL_EFFICIENCY = 1.64
GAP_SECONDS = 2.7e-6
_FREE = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency")
_CONTROL = ("while", "conditional", "call")
# A fusion is one kernel; jaxlib 0.11's XLA:GPU also runs some as async pairs (fusion-start / -done).
_FUSIONS = ("fusion", "fusion-start")
_OPERAND_SHAPE = re.compile(r"([a-z][a-z0-9]*\[[0-9,]*\])(?:\{[^}]*\})?\s+%")


@dataclasses.dataclass
class Kernel:
  kind: str    # gemm | pallas | fusion | copy | collective | other (the HLO op)
  name: str
  shape: str   # its result shape
  runs: int    # launches a call of the program
  flops: float  # a launch's (GEMMs only: cuBLAS calls, fusions holding a dot)
  bytes: float  # a launch reads and writes
  peak_scale: float = 1.0  # its arithmetic's peak over the bf16 one (FP8_PEAK_SCALE for FP8 GEMMs)
  computation: str = ""  # the HLO computation it is launched from

  def floor_seconds(self, device: str) -> float:
    peak, bandwidth = DEVICES[device]
    return self.runs * max(self.flops / (peak * self.peak_scale), self.bytes / bandwidth)


@dataclasses.dataclass
class Program:
  kernels: list[Kernel]
  syncing_loops: int  # executions of loops with a data-dependent trip count (each iteration waits for the host)
  syncing_conditionals: int = 0  # executions of conditionals: XLA:GPU copies each predicate to the host
                                 # and waits for the device (ConditionalThunk), unless in a CUDA graph

  @property
  def launches(self) -> int:
    return sum(k.runs for k in self.kernels)

  def summary(self, device: str = "h100", launch_seconds: float = LAUNCH_SECONDS, top: int = 10) -> dict:
    """A JSON-able digest: launches, bytes, FLOPs and floor seconds per kind; the floor, the launch
    cost, and the kernels with the largest floors."""
    kinds: dict[str, dict[str, float]] = {}
    for k in self.kernels:
      row = kinds.setdefault(k.kind, dict(launches=0, bytes=0.0, flops=0.0, floor_seconds=0.0))
      row["launches"] += k.runs
      row["bytes"] += k.runs * k.bytes
      row["flops"] += k.runs * k.flops
      row["floor_seconds"] += k.floor_seconds(device)
    floor = sum(row["floor_seconds"] for row in kinds.values())
    largest = sorted(self.kernels, key=lambda k: -k.floor_seconds(device))[:top]
    return dict(device=device, launches=self.launches, syncing_loops=self.syncing_loops,
                syncing_conditionals=self.syncing_conditionals, kinds=kinds,
                floor_seconds=floor, launch_seconds=self.launches * launch_seconds,
                estimate_seconds=floor + self.launches * launch_seconds,
                calibrated_seconds=floor * KERNEL_EFFICIENCY + self.launches * GAP_SECONDS,
                largest=[dict(kind=k.kind, name=k.name, shape=k.shape, runs=k.runs,
                              floor_ms=round(1e3 * k.floor_seconds(device), 3)) for k in largest])


def _operand_text(rest: str) -> str:
  """The operand list of an instruction: `rest` up to its call's closing parenthesis."""
  depth = 1
  for i, char in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      return rest[:i]
  return rest


@dataclasses.dataclass
class _Body:
  reads: dict[int, int | None]  # parameter index -> bytes read when it is only sliced, None: read whole
  writes: int
  flops: float  # its GEMMs' (XLA's Triton GEMMs where cuBLAS does not take the dot; cuBLAS calls
  #               in XLA's dynamic-slice fusions, which read a stacked weight at an offset)


def _fusion_body(lines: list[str]) -> _Body:
  instructions, params, root, lines_by_name = {}, {}, None, {}
  for line in lines:
    match = hlo._INSTRUCTION.match(line)
    if not match:
      continue
    name, shape, op, rest = match.groups()
    lines_by_name[name] = line
    instructions[name] = (shape, op, re.findall(r"%([\w.\-]+)", _operand_text(rest)))
    if op == "parameter":
      params[int(re.match(r"\s*(\d+)", rest).group(1))] = name
    if line.lstrip().startswith("ROOT"):
      root = name
  users = collections.defaultdict(list)
  for name, (_, _, operands) in instructions.items():
    for operand in operands:
      users[operand].append(name)

  def sliced_bytes(param: str) -> int | None:
    total, pending = 0, [param]
    while pending:
      value = pending.pop()
      for user in users[value]:
        shape, op, operands = instructions[user]
        if op == "bitcast":
          pending.append(user)
        elif op in ("dynamic-slice", "slice", "gather") and operands[0] == value:  # a gather reads its rows
          total += hlo.shape_bytes(shape)
        elif not (op == "dynamic-update-slice" and operands[0] == value):  # updated in place: not read
          return None
    return total

  def dot_flops(shape: str, operands: list[str], line: str) -> float:
    lhs = hlo._dims(instructions[operands[0]][0]) if operands and operands[0] in instructions else []
    contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
    k = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i) if contracting and lhs else 1
    return 2.0 * math.prod(hlo._dims(shape)) * k

  def written(name: str) -> int:
    shape, op, operands = instructions[name]
    if op == "tuple":
      return sum(written(operand) for operand in operands)
    if op == "bitcast":
      return written(operands[0])
    if op == "dynamic-update-slice":
      return hlo.shape_bytes(instructions[operands[1]][0])
    if op == "custom-call" and "cublas" in lines_by_name[name]:
      return hlo.shape_bytes(_without_workspace(shape))
    return hlo.shape_bytes(shape)

  def gemm_flops(name: str) -> float:
    shape, op, _ = instructions[name]
    line = lines_by_name[name]
    if op == "dot":
      return dot_flops(shape, instructions[name][2], line)
    if op == "custom-call" and "cublas" in line:  # XLA's dynamic-slice fusion: cuBLAS reads at an offset
      return _gemm_flops(_without_workspace(shape), _operand_text(hlo._INSTRUCTION.match(line).group(4)), line)
    return 0.0

  flops = sum(gemm_flops(name) for name in instructions)
  return _Body({i: sliced_bytes(p) for i, p in params.items()}, written(root) if root else 0, flops)


def _without_workspace(result: str) -> str:
  """A cuBLAS call's (result, workspace) without the workspace: scratch, not traffic."""
  return re.split(r",\s*s8\[", result)[0]


def _gemm_flops(result: str, operands: str, line: str) -> float:
  lhs = hlo._dims(operands)
  contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', line)
  if not lhs or not contracting:
    return 0.0
  k = math.prod(lhs[int(i.strip('" '))] for i in contracting.group(1).split(",") if i.strip())
  return 2.0 * math.prod(hlo._dims(result)) * k


def read(hlo_text: str) -> Program:
  """The kernels one call of the program (XLA:GPU's optimized HLO, operand shapes printed as
  ejax.train.compile_report.text_with_operand_shapes writes it) launches."""
  module = hlo.parse(hlo_text)
  fused: set[str] = set()
  for lines in module.bodies.values():
    for line in lines:
      match = hlo._INSTRUCTION.match(line)
      if match and match.group(3) in _FUSIONS:
        fused.update(re.findall(r"calls=%?([\w.\-]+)", line))
  bodies: dict[str, _Body] = {}
  kernels, syncing = [], collections.Counter()  # syncing: data-dependent loop runs per computation
  for computation, lines in module.bodies.items():
    runs = module.runs.get(computation, 0)
    if computation in fused or not runs:
      continue
    for line in lines:
      match = hlo._INSTRUCTION.match(line)
      if not match:
        continue
      name, result, op, rest = match.groups()
      if op in _FREE or op in _CONTROL or op == "fusion-done":  # an async fusion counts at its start
        syncing[computation] += runs if op == "while" and "known_trip_count" not in line else 0
        continue
      operands = _operand_text(rest)
      flops, kind, peak_scale = 0.0, op, 1.0
      if op in _FUSIONS:
        body_name = re.search(r"calls=%?([\w.\-]+)", line).group(1)
        if body_name not in bodies:
          bodies[body_name] = _fusion_body(module.bodies.get(body_name, []))
        body = bodies[body_name]
        shapes = _OPERAND_SHAPE.findall(operands)
        size = sum(hlo.shape_bytes(s) if body.reads.get(i) is None else body.reads[i] for i, s in enumerate(shapes))
        size += body.writes
        kind, flops = ("gemm", body.flops) if body.flops else ("fusion", 0.0)
      elif op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', line)
        target = target.group(1) if target else ""
        out = result
        if "cublas" in target:
          out = _without_workspace(result)
          kind, flops = "gemm", _gemm_flops(out, operands, line)
          peak_scale = FP8_PEAK_SCALE if target.endswith("$f8") else 1.0
        else:
          kind = "pallas" if "triton" in target or target.startswith("mosaic_gpu") else "custom-call"
        size = hlo.shape_bytes(operands) + hlo.shape_bytes(out)
      else:
        kind = "collective" if op.removesuffix("-start").removesuffix("-done") in hlo.COLLECTIVES else op
        size = hlo.shape_bytes(operands) + hlo.shape_bytes(result)
      kernels.append(Kernel(kind, name, result[:80], runs, flops, float(size), peak_scale, computation))
  # A conditional runs one of its branches (attention's packed-row routes, routes.py: a kernel path
  # or its fallback): the costliest is kept, the others' kernels and loops dropped.
  dropped: set[str] = set()
  for branches in module.conditionals:
    reached = [module.reached(branch) for branch in branches]
    cost = [sum(k.floor_seconds("h100") for k in kernels if k.computation in names) for names in reached]
    keep = reached[cost.index(max(cost))]
    dropped |= set().union(*reached) - keep
  kernels = [k for k in kernels if k.computation not in dropped]
  conditionals = sum(module.runs.get(name, 0) for name, lines in module.bodies.items() if name not in dropped
                     for line in lines if " conditional(" in line)
  return Program(kernels, sum(n for name, n in syncing.items() if name not in dropped), conditionals)


def format_line(summary: dict) -> str:
  """One line: launches by kind, host-synchronised loops and conditionals, the floor and the estimate."""
  kinds = summary["kinds"]
  by_kind = ", ".join(f"{int(row['launches']):,} {kind}" for kind, row in
                      sorted(kinds.items(), key=lambda item: -item[1]["launches"]))
  parts = ", ".join(f"{kind} {1e3 * row['floor_seconds']:.1f}" for kind, row in
                    sorted(kinds.items(), key=lambda item: -item[1]["floor_seconds"]) if row["floor_seconds"] > 5e-5)
  return (f"kernels a step: {summary['launches']:,} ({by_kind}); host-synchronised loops "
          f"{summary['syncing_loops']:,}, conditionals {summary.get('syncing_conditionals', 0):,}; floor at {summary['device']} peak {1e3 * summary['floor_seconds']:.1f} ms "
          f"({parts}); with launches {1e3 * summary['estimate_seconds']:.1f} ms; as the timed GR00T step ran "
          f"{1e3 * summary['calibrated_seconds']:.1f} ms")
