"""benchmarks/kernel_profile.py reads Mosaic GPU's on-device profile (attention.py --profile_kernel on a
GPU): here a trace written by the installed jax's own dumper from a buffer laid out as the kernel
writes it, with known cycles, summed up to the numbers it holds."""

import io
import json

import pytest

from benchmarks import kernel_profile

profiler = pytest.importorskip("jax.experimental.mosaic.gpu.profiler")

ENTRIES = 64  # a warpgroup's buffer: 3 header entries, then (tag, clock) pairs


def _warpgroup(spec, start_ns: int, sm: int, events: list[tuple[str, bool, int]]) -> list[int]:
  """One warpgroup's buffer: start time, SM, entries used, then (tag, clock) of each (name, begin, cycle)."""
  body = []
  for name, begin, cycle in events:
    body += [spec.intern_name(name) | (0 if begin else profiler.ProfilerSpec.EXIT), cycle]
  return [start_ns, sm, len(body)] + body + [0] * (ENTRIES - 3 - len(body))


def _scoped(*spans):
  """(name, begin, cycle) events of (name, start, end) spans, nested as listed by their times."""
  events = [(name, True, start) for name, start, _ in spans] + [(name, False, end) for name, _, end in spans]
  return sorted(events, key=lambda e: (e[2], not e[1]))  # at one cycle an end before a begin


def test_the_summary_gives_each_scopes_calls_and_cycles_and_the_sms_busy_time():
  spec = profiler.ProfilerSpec(ENTRIES)
  # A step of 500 cycles holding qk (200) and softmax (150): 150 of its own. Two 1-cycle gaps between
  # scopes keep the dumper's profiling-overhead estimate at 0 (it also moves an event that shares its
  # predecessor's cycle on by one, so no two share one here).
  compute = _scoped(("start", 1000, 1099), ("step", 1100, 1600), ("qk", 1150, 1350), ("softmax", 1400, 1550),
                    ("end", 1601, 1700))
  copying = _scoped(("own", 1000, 1040), ("wait_free", 1041, 1241), ("wait_free", 1242, 1542))
  buffer = []
  # Two CTAs on SM 3, one after the other (at 1,000 MHz a cycle is a ns): 700 ns each, 300 ns apart.
  for start_ns in (10_000, 11_000):
    buffer += _warpgroup(spec, start_ns, 3, compute) + _warpgroup(spec, start_ns, 3, compute)
    buffer += _warpgroup(spec, start_ns, 3, copying)
  file = io.StringIO()
  spec.dump(buffer, file, grid=(2,), block=(384,))
  events = json.loads(file.getvalue())["traceEvents"]

  summary = kernel_profile.summarize(events, 3, {0: "compute", 1: "compute", 2: "copying"}, clock_mhz=1000.0)
  compute_stats, copying_stats = summary["roles"]["compute"], summary["roles"]["copying"]
  assert compute_stats["traces"] == 4 and copying_stats["traces"] == 2
  assert compute_stats["cycles"] == pytest.approx(700)
  assert compute_stats["outside_scopes"] == pytest.approx(2)  # the cycles between the scopes
  step = compute_stats["scopes"]["step"]
  assert step["calls"] == 1 and step["cycles_per_call"] == pytest.approx(500)
  assert step["own_per_call"] == pytest.approx(150)
  assert compute_stats["scopes"]["qk"]["cycles_per_call"] == pytest.approx(200)
  assert copying_stats["scopes"]["wait_free"]["calls"] == 2
  assert copying_stats["scopes"]["wait_free"]["cycles_per_call"] == pytest.approx(250)
  assert summary["ctas"] == 2 and summary["sms"] == 1
  assert summary["kernel_us"] == pytest.approx(1.7)
  assert summary["sm_busy"] == pytest.approx(1400 / 1700)
  assert summary["gap_between_ctas_us"] == pytest.approx(0.3)

  assert list(compute_stats["scopes"]) == ["start", "step", "qk", "softmax", "end"]  # as they first begin
  lines = kernel_profile.describe(summary)
  assert lines[0].startswith("2 CTAs on 1 SMs over 1.7 us: SMs busy with a CTA 82 %")
  assert "step 1.0 x 500 [own 150]; qk 1.0 x 200" in lines[1]


def test_a_folder_without_a_trace_says_what_is_missing(tmp_path):
  with pytest.raises(FileNotFoundError, match="no Mosaic GPU profile"):
    kernel_profile.newest_trace(str(tmp_path), "forward_kernel")
