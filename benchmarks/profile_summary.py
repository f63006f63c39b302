"""Where a jitted step's time goes: a jax.profiler trace of a few steps, summed per op.

`profile_steps(run_one, steps, out_dir)` traces `steps` calls of `run_one` (each must block until its
step is done) with jax.profiler, then reads the Perfetto trace back and returns a JSON-able dict:
  step_ms          wall time of a traced step (median)
  device_busy_ms   time the device spent in ops a step (GPU: kernels on its streams; CPU: XLA's
                   op events); busy/step below ~0.8 says the step waits on launches or the host
  by_kind          ms a step per kind of op (matmul, attention, collective, fusion, copy, other)
  top              the 25 ops (innermost spans only: a loop counts as the ops it runs) with the most time a step: name, the HLO op when the trace names it,
                   kind, calls and ms a step
  host             the host's 12 busiest spans by name (inclusive ms and calls a step): where the time
                   goes when the device waits on the host
On a GPU the kernels and their HLO ops come from the device's streams, so the table is what a
profile viewer would show; on a CPU the same code reads XLA:CPU's op events (tests run it there).

  python benchmarks/train_step.py --models groot --arms configured --profile /tmp/prof
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics
import time

# First match wins; matched against the HLO op name, or the kernel name when the trace has none or the
# op is a CUDA graph (XLA's command buffers, `command_buffer_N`, run many kernels under one op name).
KINDS = (
    ("collective", re.compile(r"all-gather|all-reduce|reduce-scatter|all-to-all|collective|nccl", re.I)),
    ("attention", re.compile(r"attention|flash|varlen|mha|fmha|cudnn.*sdpa|tokamax|dkv_kernel|dq_kernel", re.I)),
    ("matmul", re.compile(r"\bdot|gemm|matmul|cublas|nvjet|wgmma|xmma|cutlass|convolution|einsum", re.I)),
    ("copy", re.compile(r"copy|transpose|memcpy|memset|dynamic-update-slice|concatenate|broadcast", re.I)),
    ("fusion", re.compile(r"fusion|reduce|loop_|input_", re.I)),
)


def kind_of(name: str, hlo_op: str = "") -> str:
  """The kind of a kernel `name` that the trace ties to HLO op `hlo_op`."""
  if hlo_op and not hlo_op.startswith("command_buffer"):
    name = hlo_op
  for kind, pattern in KINDS:
    if pattern.search(name):
      return kind
  return "other"


def _load_trace(out_dir: str) -> list[dict]:
  files = sorted(glob.glob(os.path.join(out_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
  if not files:
    raise FileNotFoundError(f"no Perfetto trace under {out_dir}")
  with gzip.open(files[-1]) as f:
    trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace


def leaves(events: list[dict]) -> list[dict]:
  """The events that contain no other event of their thread (a while loop's or the executor's span
  encloses the ops it runs; counting both would count that time twice)."""
  by_thread = collections.defaultdict(list)
  for e in events:
    by_thread[(e["pid"], e["tid"])].append(e)
  out = []
  for thread in by_thread.values():
    thread.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack: list[list] = []  # [event, end, has_child]
    for e in thread:
      while stack and stack[-1][1] <= e["ts"]:
        done = stack.pop()
        if not done[2]:
          out.append(done[0])
      if stack:
        stack[-1][2] = True
      stack.append([e, e["ts"] + e["dur"], False])
    out.extend(item[0] for item in stack if not item[2])
  return out


def device_events(events: list[dict]) -> list[dict]:
  """The trace's op events: those of device processes (GPU streams) when there are any, else the
  events on XLA:CPU's client and Eigen threads (not Python's, not the host's runtime calls)."""
  processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  ops = leaves([e for e in events if e.get("ph") == "X" and "dur" in e and not e["name"].startswith("end: ")
                and "ThunkExecutor" not in e["name"]])
  devices = {pid for pid, name in processes.items() if "/device:" in name and "CPU" not in name}
  if devices:
    return [e for e in ops if e["pid"] in devices]
  return [e for e in ops if threads.get((e["pid"], e["tid"]), "").startswith("tf_XLA")
          and not e["name"].startswith("$")]


PROFILER_SPANS = re.compile(r"profiler\.py|contextlib\.py")  # the trace's own start and stop, not a step's


def host_spans(events: list[dict], ops: list[dict], steps: int, count: int = 12) -> list[dict]:
  """The host's busiest spans, by name, inclusive of what they call (the device's op events left out):
  where a step's host time goes when the device waits on it (dispatch, the runtime's execute, Python)."""
  op_ids = {id(e) for e in ops}
  device_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                 and "/device:" in e["args"]["name"] and "CPU" not in e["args"]["name"]}
  totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for e in events:
    if (e.get("ph") != "X" or "dur" not in e or id(e) in op_ids or e["pid"] in device_pids
        or PROFILER_SPANS.search(e["name"])):
      continue
    totals[e["name"]][0] += e["dur"] / 1e3
    totals[e["name"]][1] += 1
  top = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
  return [dict(name=name[:160], calls=calls / steps, ms_per_step=ms / steps) for name, (ms, calls) in top]


def summarize(events: list[dict], steps: int, step_seconds: list[float]) -> dict:
  ops = device_events(events)
  totals: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for e in ops:
    hlo = str((e.get("args") or {}).get("hlo_op", "") or "")
    key = (e["name"], hlo)
    totals[key][0] += e["dur"] / 1e3  # us -> ms
    totals[key][1] += 1
  by_kind: dict[str, float] = collections.defaultdict(float)
  for (name, hlo), (ms, _) in totals.items():
    by_kind[kind_of(name, hlo)] += ms / steps
  top = sorted(totals.items(), key=lambda item: -item[1][0])[:25]
  return dict(
      steps=steps,
      step_ms=1e3 * statistics.median(step_seconds),
      device_busy_ms=sum(ms for ms, _ in totals.values()) / steps,
      distinct_ops=len(totals),
      by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
      top=[dict(name=name[:160], hlo_op=hlo[:120], kind=kind_of(name, hlo), calls=calls / steps,
                ms_per_step=ms / steps) for (name, hlo), (ms, calls) in top],
      host=host_spans(events, ops, steps))


def profile_steps(run_one, steps: int, out_dir: str) -> dict:
  """Traces `steps` calls of run_one() and returns the summary (see the module docstring)."""
  import jax
  os.makedirs(out_dir, exist_ok=True)
  times = []
  with jax.profiler.trace(out_dir, create_perfetto_trace=True):
    for _ in range(steps):
      start = time.perf_counter()
      run_one()
      times.append(time.perf_counter() - start)
  return summarize(_load_trace(out_dir), steps, times)


def describe(summary: dict) -> str:
  lines = [f"  profile: step {summary['step_ms']:.1f} ms, device busy {summary['device_busy_ms']:.1f} ms "
           f"({100 * summary['device_busy_ms'] / max(summary['step_ms'], 1e-9):.0f} %), "
           f"{summary['distinct_ops']} distinct ops; by kind (ms a step): "
           + ", ".join(f"{k} {v:.1f}" for k, v in summary["by_kind"].items())]
  for op in summary["top"][:10]:
    lines.append(f"    {op['ms_per_step']:8.2f} ms  x{op['calls']:<5.0f} {op['kind']:<10} {op['name'][:70]}"
                 + (f"  [{op['hlo_op'][:40]}]" if op["hlo_op"] else ""))
  if summary.get("host"):
    lines.append("    host, inclusive ms a step: " + "; ".join(f"{span['name'][:60]} {span['ms_per_step']:.1f}"
                                                             for span in summary["host"][:6]))
  return "\n".join(lines)
