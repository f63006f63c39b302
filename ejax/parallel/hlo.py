"""Reading a compiled (SPMD-partitioned) HLO module's text: matmul FLOPs and collectives per step.

Both count what one call of the per-device program does, so work inside loops counts as often as
the loop runs: XLA writes `known_trip_count` on the loops it can count (a `lax.scan` over layers,
gradient accumulation), and a computation reached through such a loop counts that many times.
Loops whose trip count depends on data (the XLA attention path's tile loops) count once.

XLA's own `compiled.cost_analysis()` counts every loop body once: for pi0.5, whose 18 Gemma layers
are one scan, it reports about a fifth of the step's FLOPs.
"""

from __future__ import annotations

import dataclasses
import math
import re

NODE_SIZE = 8  # devices per node of a simulated cluster (an 8-GPU NVLink domain)
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
# Computations run as part of an op's own semantics (reducers, comparators): not program calls.
_APPLIED_OPS = (" reduce(", " all-reduce(", " reduce-scatter(", " scatter(", " sort(", " map(", " reduce-window(",
                " select-and-scatter(", " all-reduce-start(")


def shape_bytes(text: str) -> int:
  """Bytes of every array shape written in `text` (a tuple shape counts each element)."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    if dtype in _DTYPE_BYTES:
      total += (math.prod(int(d) for d in dims.split(",") if d) if dims else 1) * _DTYPE_BYTES[dtype]
  return total


def _dims(shape_text: str) -> list[int]:
  match = _SHAPE.search(shape_text)
  return [int(d) for d in match.group(2).split(",") if d] if match else []


@dataclasses.dataclass
class Module:
  bodies: dict[str, list[str]]  # computation -> its instruction lines
  runs: dict[str, int]          # computation -> times one call of the entry runs it (every branch of a
                                # conditional as if it ran)
  calls: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # computation -> those it calls
  conditionals: list[tuple[str, ...]] = dataclasses.field(default_factory=list)  # each one's branches

  def reached(self, name: str) -> set[str]:
    """`name` and every computation it calls, directly or not."""
    seen, todo = set(), [name]
    while todo:
      current = todo.pop()
      if current not in seen:
        seen.add(current)
        todo += self.calls.get(current, [])
    return seen


def parse(hlo_text: str) -> Module:
  bodies: dict[str, list[str]] = {}
  current = entry = None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = header.group(1)
      bodies[current] = []
      entry = current if line.startswith("ENTRY") else entry
    elif current is not None and line.strip() and line.strip() != "}":
      bodies[current].append(line)
  calls: dict[str, list[tuple[str, int]]] = {name: [] for name in bodies}
  conditionals: list[tuple[str, ...]] = []
  for name, lines in bodies.items():
    for line in lines:
      if any(op in line for op in _APPLIED_OPS):
        continue
      trips = 1
      if " while(" in line:
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        trips = int(known.group(1)) if known else 1
      for key, callee in re.findall(r"\b(body|condition|to_apply|calls)=%?([\w.\-]+)", line):
        if callee in bodies:
          calls[name].append((callee, trips if key in ("body", "condition") else 1))
      # A conditional's branches: an N-way one lists them, a two-way one (jax.lax.cond) names them.
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      names = [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else []
      names += re.findall(r"\b(?:true|false)_computation=%?([\w.\-]+)", line)
      if names:
        calls[name] += [(branch, 1) for branch in names]
        conditionals.append(tuple(names))
  runs: dict[str, int] = {}

  def visit(name: str, times: int) -> None:
    runs[name] = runs.get(name, 0) + times
    for callee, trips in calls.get(name, ()):
      visit(callee, times * trips)

  visit(entry or next(iter(bodies)), 1)
  return Module(bodies, runs, {name: [callee for callee, _ in called] for name, called in calls.items()},
                conditionals)


def _instructions(module: Module):
  """(computation runs, result name, result shape, op, rest of the line) of every instruction run."""
  for name, lines in module.bodies.items():
    runs = module.runs.get(name, 0)
    if not runs:
      continue
    for line in lines:
      match = _INSTRUCTION.match(line)
      if match:
        yield runs, match.group(1), match.group(2), match.group(3), match.group(4)


# --- FLOPs ---------------------------------------------------------------------------------------


def matmul_flops(hlo_text: str) -> float:
  """FLOPs of every dot and convolution one call runs (2 per multiply-add), loops counted.

  Elementwise work is left out: it is a few percent of these models' FLOPs and not what a GPU's
  peak (or MFU) measures. Attention inside a Pallas or cuDNN custom call is not in the module.
  """
  module = parse(hlo_text)
  shapes: dict[str, str] = {}
  for lines in module.bodies.values():
    for line in lines:
      match = _INSTRUCTION.match(line)
      if match:
        shapes[match.group(1)] = match.group(2)
  total = 0.0
  for runs, _, result, op, rest in _instructions(module):
    if op not in ("dot", "convolution"):
      continue
    operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
    out = math.prod(_dims(result))
    if op == "dot":
      lhs = _dims(shapes.get(operands[0], "")) if operands else []
      contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
      k = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i) if contracting and lhs else 1
    else:
      kernel = _dims(shapes.get(operands[1], "")) if len(operands) > 1 else []
      labels = re.search(r"dim_labels=\w+_(\w+)->", rest)
      groups = re.search(r"feature_group_count=(\d+)", rest)
      k = math.prod(kernel) // kernel[labels.group(1).index("o")] if kernel and labels else 1
      k //= int(groups.group(1)) if groups else 1
    total += 2.0 * out * k * runs
  return total


# --- Collectives ---------------------------------------------------------------------------------


def _replica_groups(attributes: str, num_devices: int) -> list[list[int]]:
  """The device groups of a collective, from any HLO spelling of replica_groups."""
  import numpy as np
  iota = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attributes)
  if iota:
    groups = [int(x) for x in iota.group(1).split(",")]
    dims = [int(x) for x in iota.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(3):
      ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
    return ids.reshape(groups[0], -1).tolist()
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
  if mesh:
    # jax 0.11's XLA names the mesh's axes (devices in row-major order over them) and the axes a
    # group spans: mesh['axis_0'=2,'axis_1'=4] {'axis_1'} is the groups {0..3}, {4..7}.
    axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
    spanned = re.findall(r"'([^']+)'", mesh.group(2))
    names = [name for name, _ in axes]
    if not axes or len(axes) != mesh.group(1).count("=") or any(n not in names for n in spanned):
      raise ValueError(f"cannot read replica_groups=mesh[{mesh.group(1)}] {{{mesh.group(2)}}}")
    ids = np.arange(math.prod(int(size) for _, size in axes)).reshape([int(size) for _, size in axes])
    kept = [i for i, name in enumerate(names) if name not in spanned]
    order = kept + [names.index(name) for name in spanned]
    group_size = math.prod(ids.shape[i] for i in order[len(kept):])
    return ids.transpose(order).reshape(-1, group_size).tolist()
  listed = re.search(r"replica_groups=\{(\{[0-9,\s]*\}(?:,\s*\{[0-9,\s]*\})*)\}", attributes)
  if listed:
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9,\s]*)\}", listed.group(1))]
  return [list(range(num_devices))]  # no groups written: every device


@dataclasses.dataclass
class Collective:
  kind: str            # all-gather | reduce-scatter | all-reduce | ...
  buffer_bytes: int    # the full buffer per device: gathered result, scattered operand, reduced buffer
  group_size: int
  crosses_nodes: bool  # a group spans devices of more than one node (NODE_SIZE devices each)
  count: int           # executions per step

  @property
  def sent_bytes(self) -> float:
    """Bytes each device sends (ring algorithms): (n-1)/n of the buffer, twice for an all-reduce."""
    n = self.group_size
    share = (n - 1) / n * self.buffer_bytes if n > 1 else 0.0
    return 2 * share if self.kind == "all-reduce" else share


def collectives(hlo_text: str, num_devices: int, node_size: int = NODE_SIZE) -> list[Collective]:
  """Every collective of the module with how often one step runs it (same kinds merged)."""
  found: dict[tuple, Collective] = {}
  for runs, _, result, op, rest in _instructions(parse(hlo_text)):
    kind = op.removesuffix("-start")
    if kind not in COLLECTIVES:
      continue
    operands = rest.split(")", 1)[0]
    if kind == "reduce-scatter":
      buffer = shape_bytes(operands)
    elif op.endswith("-start"):  # async form: the result tuple holds operands and outputs
      buffer = shape_bytes(result) - shape_bytes(operands) if kind == "all-gather" else shape_bytes(operands)
    else:
      buffer = shape_bytes(result)
    group = _replica_groups(rest, num_devices)[0]
    crosses = len({device // node_size for device in group}) > 1
    key = (kind, buffer, len(group), crosses)
    if key in found:
      found[key].count += runs
    else:
      found[key] = Collective(kind, buffer, len(group), crosses, runs)
  return list(found.values())


def collective_summary(found: list[Collective]) -> dict[str, dict[str, float]]:
  """kind -> {count, buffer_bytes, sent_bytes, sent_bytes_inter_node}, summed over one step."""
  summary: dict[str, dict[str, float]] = {}
  for c in found:
    row = summary.setdefault(c.kind, dict(count=0, buffer_bytes=0.0, sent_bytes=0.0, sent_bytes_inter_node=0.0))
    row["count"] += c.count
    row["buffer_bytes"] += c.count * c.buffer_bytes
    row["sent_bytes"] += c.count * c.sent_bytes
    if c.crosses_nodes:
      row["sent_bytes_inter_node"] += c.count * c.sent_bytes
  return summary
