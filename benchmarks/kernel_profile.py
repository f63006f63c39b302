"""Where a Mosaic GPU kernel's cycles go, from Mosaic GPU's on-device profile (`attention.py --profile_kernel`).

Mosaic GPU's profiler (plgpu.CompilerParams profile_space / profile_dir; ejax's kernels turn it on with
ejax.kernels.attention.mosaic_common.PROFILE_DIR) dumps one Perfetto trace a call. Each warpgroup of
each CTA is a trace (`tid`, numbered CTA by CTA, warpgroup by warpgroup; `pid` is 1 + the SM), holding
the start ("B") and end ("E") of each named scope it ran (jax.named_scope in the kernel), nested. A
trace's first event sits at its CTA's start on the GPU's global timer; each later one adds the SM
clock's cycles counted since. The dump writes both in one unit, ns / 1e3 and cycles / 1e3, so within a
trace a difference times 1e3 is cycles.

summarize() sums each scope per warpgroup role: calls a CTA, cycles a call (inclusive of the scopes
inside it) and, for a scope that holds others, its own cycles outside them; the cycles a trace spends
outside every scope; and how busy the SMs were: each CTA's span on its SM against the kernel's
(converted to ns at the SM clock). describe() prints it.
"""

from __future__ import annotations

import collections
import glob
import json
import os


def newest_trace(folder: str, prefix: str = "") -> str:
  """The newest trace Mosaic GPU's profiler wrote in `folder` for a kernel whose name starts `prefix` (its
  files are <kernel name>-<ns>-trace.json)."""
  paths = glob.glob(os.path.join(folder, f"{prefix}*-trace.json"))
  if not paths:
    held = sorted(os.listdir(folder))[:8] if os.path.isdir(folder) else []
    raise FileNotFoundError(f"no Mosaic GPU profile ({prefix}*-trace.json) in {folder} (it holds {held or 'nothing'}): "
                            "did the kernel run on a GPU with mosaic_common.PROFILE_DIR set?")
  return max(paths, key=os.path.getmtime)


def _trace_scopes(events: list[dict]):
  """(span in cycles, cycles inside its outermost scopes, first timestamp in us, {name: [inclusive cycles
  of each call]} in the order the scopes first begin, {name: own cycles outside the scopes inside it,
  summed}) of one trace's events, in order."""
  calls, own = {}, collections.defaultdict(float)
  stack, scoped = [], 0.0  # stack: [name, start ts, cycles of the scopes directly inside]
  for event in events:
    if event["ph"] == "B":
      calls.setdefault(event["name"], [])
      stack.append([event["name"], event["ts"], 0.0])
    elif stack and stack[-1][0] == event["name"]:
      name, start, inner = stack.pop()
      cycles = (event["ts"] - start) * 1e3
      calls[name].append(cycles)
      own[name] += cycles - inner
      if stack:
        stack[-1][2] += cycles
      else:
        scoped += cycles
  span = (events[-1]["ts"] - events[0]["ts"]) * 1e3 if events else 0.0
  return span, scoped, (events[0]["ts"] if events else 0.0), calls, own


def summarize(events: list[dict], warpgroups: int, roles: dict[int, str], clock_mhz: float) -> dict:
  """Per role (roles: warpgroup index in its CTA -> role; warpgroups: a CTA's warpgroups, the copying
  one included): traces, cycles a trace, per scope calls a trace / cycles a call / own cycles a call,
  cycles outside every scope; and the CTAs' SM occupancy (from the first role's traces)."""
  by_trace = collections.defaultdict(list)
  for event in events:
    by_trace[event["tid"]].append(event)
  per_role = collections.defaultdict(lambda: dict(traces=0, span=0.0, scoped=0.0, calls=collections.Counter(),
                                                  cycles=collections.Counter(), own=collections.Counter()))
  spans_by_sm = collections.defaultdict(list)  # (start ns, end ns) of each CTA on an SM
  for tid, trace in by_trace.items():
    warpgroup = (tid - 1) % warpgroups
    if warpgroup not in roles:
      continue
    span, scoped, first_us, calls, own = _trace_scopes(trace)
    total = per_role[roles[warpgroup]]
    total["traces"] += 1
    total["span"] += span
    total["scoped"] += scoped
    for name, cycles in calls.items():
      if not cycles:  # begun, never ended (a trace cut short)
        continue
      total["calls"][name] += len(cycles)
      total["cycles"][name] += sum(cycles)
      total["own"][name] += own[name]
    if warpgroup == min(roles):  # a CTA's span on its SM, from its first listed warpgroup's trace
      start_ns = first_us * 1e3
      spans_by_sm[trace[0]["pid"]].append((start_ns, start_ns + span / (clock_mhz * 1e-3)))

  summary = dict(clock_mhz=clock_mhz, roles={})
  for role, total in per_role.items():
    n = max(total["traces"], 1)
    summary["roles"][role] = dict(
        traces=total["traces"], cycles=total["span"] / n, outside_scopes=(total["span"] - total["scoped"]) / n,
        scopes={name: dict(calls=count / n, cycles_per_call=total["cycles"][name] / count,
                           own_per_call=total["own"][name] / count)
                for name, count in total["calls"].items()})
  if spans_by_sm:
    start = min(s for spans in spans_by_sm.values() for s, _ in spans)
    end = max(e for spans in spans_by_sm.values() for _, e in spans)
    busy = sum(e - s for spans in spans_by_sm.values() for s, e in spans)
    gaps = [later[0] - earlier[1] for spans in spans_by_sm.values()
            for earlier, later in zip(sorted(spans), sorted(spans)[1:], strict=False)]
    summary.update(ctas=sum(len(spans) for spans in spans_by_sm.values()), sms=len(spans_by_sm),
                   kernel_us=(end - start) / 1e3, sm_busy=busy / (len(spans_by_sm) * (end - start)),
                   gap_between_ctas_us=(sum(gaps) / len(gaps) / 1e3) if gaps else 0.0)
  return summary


def describe(summary: dict) -> list[str]:
  """Lines of `summary`: per role its cycles a trace and each scope's calls x cycles a call (own
  cycles in brackets where scopes sit inside it), in the order the kernel first ran them."""
  lines = []
  mhz = summary["clock_mhz"]
  if "ctas" in summary:
    lines.append(f"{summary['ctas']:,} CTAs on {summary['sms']} SMs over {summary['kernel_us']:.1f} us: SMs busy with a "
                 f"CTA {100 * summary['sm_busy']:.0f} % of it, {summary['gap_between_ctas_us']:.2f} us between CTAs on an SM")
  for role, stats in summary["roles"].items():
    cells = []
    for name, scope in stats["scopes"].items():
      own = (f" [own {scope['own_per_call']:,.0f}]"
             if scope["own_per_call"] < scope["cycles_per_call"] - 0.5 else "")
      cells.append(f"{name} {scope['calls']:.1f} x {scope['cycles_per_call']:,.0f}{own}")
    lines.append(f"{role} ({stats['traces']:,} traces): {stats['cycles']:,.0f} cycles a CTA "
                 f"({stats['cycles'] / mhz:.1f} us at {mhz:,.0f} MHz), outside scopes {stats['outside_scopes']:,.0f}; "
                 + "; ".join(cells))
  return lines


def load(path: str) -> list[dict]:
  with open(path) as file:
    return json.load(file)["traceEvents"]
