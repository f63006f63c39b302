"""Reading the SASS Mosaic GPU writes with MOSAIC_GPU_DUMP_SASS=1 (nvdisasm's listing, one or more
kernels): the instructions of each kernel, their control flow, and the registers each writes.

What it checks: an RS wgmma (HGMMA with its A operand in registers) inside a loop whose A registers
hold a value loaded before the loop (the forward's Q) must not be written anywhere in that loop. On
jaxlib 0.11.2's build for the H100, mosaic_own's forward at head size 64 broke this: ptxas gave the
step's softmax weights P the very registers that held Q's fragments, so from a work item's second
kv step on, the scores were P times K: the errors of 0.84-0.88 the H200s showed (BENCHMARKS.md).
The PTX keeps Q and P apart; the overlap is ptxas's.
"""

from __future__ import annotations

import dataclasses
import re

_KERNEL = re.compile(r"^\.text\.(\S+):\s*$")
_LABEL = re.compile(r"^(\.L_x_\d+):\s*$")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;")
_PREDICATE = re.compile(r"^!?U?P(T|\d+)$")
_GPR = re.compile(r"^R(\d+)$")


@dataclasses.dataclass(frozen=True)
class Instruction:
  index: int
  guard: str           # "@P1", "@!P2" or ""
  opcode: str          # with its modifiers: "HGMMA.64x64x16.F32.BF16"
  operands: tuple[str, ...]
  text: str

  @property
  def branch_target(self) -> str | None:
    if self.opcode.split(".")[0] != "BRA":
      return None
    found = re.search(r"\((\.L_x_\d+)\)", self.text)
    return found.group(1) if found else None

  def written(self) -> set[int]:
    """The general registers this instruction writes (its destination, with the registers a vector
    or an accumulator spans)."""
    if not self.operands:
      return set()
    base, first = self.opcode.split(".")[0], self.operands[0]
    if _PREDICATE.match(first) and base == "SHFL" and len(self.operands) > 1:
      first = self.operands[1]  # SHFL PT, Rd, ...: a predicate out, then the value
    found = _GPR.match(first)
    if not found:
      return set()
    start = int(found.group(1))
    return set(range(start, start + _width(self.opcode)))

  def register_a(self) -> set[int]:
    """An HGMMA's A operand when it is in registers (RS: four registers a thread), else empty."""
    if not self.opcode.startswith("HGMMA") or len(self.operands) < 2:
      return set()
    found = _GPR.match(self.operands[1])
    return set(range(int(found.group(1)), int(found.group(1)) + 4)) if found else set()


def _width(opcode: str) -> int:
  if opcode.startswith("HGMMA"):  # 64 x N f32 accumulators: N / 2 registers a thread
    return int(re.match(r"HGMMA\.64x(\d+)x", opcode).group(1)) // 2
  if opcode.startswith("LDSM"):
    found = re.search(r"\.M88\.(\d)", opcode)
    return int(found.group(1)) if found else 1
  if re.search(r"\.128\b", opcode):
    return 4
  if re.search(r"\.64\b", opcode) or ".WIDE" in opcode:
    return 2
  return 1


def kernels(listing: str) -> dict[str, tuple[list[Instruction], dict[str, int]]]:
  """{kernel: (its instructions in order, {label: the index of the instruction it precedes})}."""
  out: dict[str, tuple[list[Instruction], dict[str, int]]] = {}
  instructions: list[Instruction] | None = None
  labels: dict[str, int] = {}
  for line in listing.splitlines():
    if found := _KERNEL.match(line.strip()):
      instructions, labels = [], {}
      out[found.group(1)] = (instructions, labels)
    elif instructions is None:
      continue
    elif found := _LABEL.match(line.strip()):
      labels[found.group(1)] = len(instructions)
    elif found := _INSTRUCTION.match(line):
      text = found.group(1)
      guard = ""
      if text.startswith("@"):
        guard, text = text.split(None, 1)
      opcode, _, rest = text.partition(" ")
      operands = tuple(part.strip() for part in rest.split(",")) if rest.strip() else ()
      instructions.append(Instruction(len(instructions), guard, opcode, operands, text))
  return out


def _blocks(instructions: list[Instruction], labels: dict[str, int]):
  """Basic blocks as (first, last) instruction indices, and each block's successors."""
  starts = {0} | {i for i in labels.values() if i < len(instructions)}
  for ins in instructions:
    if ins.branch_target or ins.opcode.split(".")[0] in ("EXIT", "RET"):
      starts.add(ins.index + 1)
  starts = sorted(s for s in starts if s < len(instructions))
  bounds = [(s, (starts[k + 1] if k + 1 < len(starts) else len(instructions)) - 1) for k, s in enumerate(starts)]
  block_of = {s: k for k, (s, _) in enumerate(bounds)}
  successors = []
  for k, (_, last) in enumerate(bounds):
    ins = instructions[last]
    base = ins.opcode.split(".")[0]
    following = [k + 1] if k + 1 < len(bounds) else []
    if ins.branch_target:
      target = [block_of[labels[ins.branch_target]]] if ins.branch_target in labels else []
      # "@P BRA" falls through when P is false; "BRA P2, L" (a second predicate) may too
      conditional = bool(ins.guard) or (ins.operands and _PREDICATE.match(ins.operands[0]))
      successors.append(target + (following if conditional else []))
    elif base in ("EXIT", "RET"):
      successors.append(following if ins.guard else [])
    else:
      successors.append(following)
  return bounds, successors


def _natural_loops(successors: list[list[int]]) -> list[tuple[int, set[int]]]:
  """(head, blocks) of each natural loop (a back edge's target, the head, dominates its source)."""
  n = len(successors)
  predecessors = [[] for _ in range(n)]
  for u, targets in enumerate(successors):
    for v in targets:
      predecessors[v].append(u)
  everything = set(range(n))
  dominators = [everything.copy() for _ in range(n)]
  dominators[0] = {0}
  changed = True
  while changed:
    changed = False
    for v in range(1, n):
      incoming = [dominators[u] for u in predecessors[v]]
      new = (set.intersection(*incoming) if incoming else set()) | {v}
      if new != dominators[v]:
        dominators[v], changed = new, True
  loops = []
  for u, targets in enumerate(successors):
    for header in targets:
      if header in dominators[u]:  # u -> header is a back edge
        body, stack = {header, u}, ([u] if u != header else [])
        while stack:
          for p in predecessors[stack.pop()]:
            if p not in body:
              body.add(p)
              stack.append(p)
        loops.append((header, body))
  return loops


def clobbered_register_operands(instructions: list[Instruction], labels: dict[str, int]) -> list[tuple[int, int, int]]:
  """(HGMMA, register, writer) for each register A operand of an HGMMA without .tnspB (a scores'
  wgmma: its A is the queries, or the backward's keys, the same every step) whose value may come from
  before its innermost loop (no write on every path from the loop's head to it) and which an
  instruction in that loop writes: the next step's wgmma then reads that write. A fragment loaded
  in each step before the wgmma is fresh and passes. None where every step reads what it should."""
  bounds, successors = _blocks(instructions, labels)
  loops = _natural_loops(successors)
  block_at = {}
  for k, (first, last) in enumerate(bounds):
    for i in range(first, last + 1):
      block_at[i] = k
  writes = [set().union(*(ins.written() for ins in instructions[first:last + 1])) for first, last in bounds]
  found = []
  for ins in instructions:
    registers = ins.register_a()
    if not registers or ".tnspB" in ins.text:
      continue
    around = [(head, body) for head, body in loops if block_at[ins.index] in body]
    if not around:
      continue
    head, body = min(around, key=lambda loop: len(loop[1]))
    here = block_at[ins.index]
    fresh = _written_on_every_path(head, body, successors, writes, here)
    fresh |= set().union(*(w.written() for w in instructions[bounds[here][0]:ins.index]))
    for k in sorted(body):
      first, last = bounds[k]
      for writer in instructions[first:last + 1]:
        for register in sorted((writer.written() & registers) - fresh):
          found.append((ins.index, register, writer.index))
  return found


def _written_on_every_path(head: int, body: set[int], successors: list[list[int]], writes: list[set[int]],
                           block: int) -> set[int]:
  """The registers written on every path inside the loop `body` from its head to the start of `block`."""
  predecessors = {k: [u for u in body if k in successors[u]] for k in body}
  everything = set().union(*(writes[k] for k in body))
  entering = {k: set() if k == head else everything.copy() for k in body}
  changed = True
  while changed:
    changed = False
    for k in sorted(body):
      if k == head:
        continue
      incoming = [entering[p] | writes[p] for p in predecessors[k]]
      new = set.intersection(*incoming) if incoming else set()
      if new != entering[k]:
        entering[k], changed = new, True
  return entering[block]


def cuda_root_with_nvdisasm(directory: str) -> str | None:
  """A CUDA_ROOT for MOSAIC_GPU_DUMP_SASS, made in `directory`: the CUDA compiler wheel's tools (ptxas,
  libdevice) beside nvdisasm, which that wheel lacks (PyPI's nvidia-cuda-nvdisasm has it, or a CUDA
  toolkit on PATH). None where either is missing."""
  import glob
  import importlib.util
  import os
  import shutil

  try:
    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
  except ModuleNotFoundError:
    spec = None
  nvcc = list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None
  if nvcc is None:
    return None
  nvidia = os.path.dirname(nvcc)
  found = sorted(glob.glob(os.path.join(nvidia, "*", "bin", "nvdisasm"))) or [shutil.which("nvdisasm")]
  if not found[0]:
    return None
  root = os.path.join(directory, "cuda")
  os.makedirs(os.path.join(root, "bin"), exist_ok=True)
  for entry in os.listdir(nvcc):
    if entry != "bin":
      os.symlink(os.path.join(nvcc, entry), os.path.join(root, entry))
  for tool in os.listdir(os.path.join(nvcc, "bin")):
    os.symlink(os.path.join(nvcc, "bin", tool), os.path.join(root, "bin", tool))
  if not os.path.exists(os.path.join(root, "bin", "nvdisasm")):
    os.symlink(found[0], os.path.join(root, "bin", "nvdisasm"))
  return root
