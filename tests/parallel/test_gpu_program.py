"""ejax.parallel.gpu_program: the kernels a compiled XLA:GPU program launches and its time floor,
read from a hand-written module in XLA:GPU's printed form (operand shapes written, as
compile_report prints it)."""

import pytest

from ejax.parallel import gpu_program

MODULE = """
HloModule jit_step, entry_computation_layout={(bf16[4,256,256]{2,1,0}, bf16[64,256]{1,0})->bf16[64,256]{1,0}}

%fused_slice (param_0: bf16[4,256,256], param_1: s32[]) -> bf16[256,256] {
  %param_0 = bf16[4,256,256]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %constant_0 = s32[] constant(0)
  %dynamic-slice.1 = bf16[1,256,256]{2,1,0} dynamic-slice(bf16[4,256,256]{2,1,0} %param_0, s32[] %param_1, s32[] %constant_0, s32[] %constant_0), dynamic_slice_sizes={1,256,256}
  ROOT %bitcast.1 = bf16[256,256]{1,0} bitcast(bf16[1,256,256]{2,1,0} %dynamic-slice.1)
}

%fused_gelu (param_0.1: bf16[64,256]) -> bf16[64,256] {
  %param_0.1 = bf16[64,256]{1,0} parameter(0)
  ROOT %tanh.1 = bf16[64,256]{1,0} tanh(bf16[64,256]{1,0} %param_0.1)
}

%triton_gemm (param_0.2: bf16[64,256], param_1.2: bf16[256,128]) -> bf16[64,128] {
  %param_0.2 = bf16[64,256]{1,0} parameter(0)
  %param_1.2 = bf16[256,128]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,128]{1,0} dot(bf16[64,256]{1,0} %param_0.2, bf16[256,128]{1,0} %param_1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], bf16[64,256], bf16[4,256,256])) -> (s32[], bf16[64,256], bf16[4,256,256]) {
  %p = (s32[], bf16[64,256]{1,0}, bf16[4,256,256]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], bf16[64,256]{1,0}, bf16[4,256,256]{2,1,0}) %p), index=0
  %x = bf16[64,256]{1,0} get-tuple-element((s32[], bf16[64,256]{1,0}, bf16[4,256,256]{2,1,0}) %p), index=1
  %w = bf16[4,256,256]{2,1,0} get-tuple-element((s32[], bf16[64,256]{1,0}, bf16[4,256,256]{2,1,0}) %p), index=2
  %slice_fusion = bf16[256,256]{1,0} fusion(bf16[4,256,256]{2,1,0} %w, s32[] %i), kind=kLoop, calls=%fused_slice
  %gemm = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(bf16[64,256]{1,0} %x, bf16[256,256]{1,0} %slice_fusion), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %y = bf16[64,256]{1,0} get-tuple-element((bf16[64,256]{1,0}, s8[4194304]{0}) %gemm), index=0
  %gelu = bf16[64,256]{1,0} fusion(bf16[64,256]{1,0} %y), kind=kLoop, calls=%fused_gelu
  %one = s32[] constant(1)
  %next = s32[] add(s32[] %i, s32[] %one)
  ROOT %t = (s32[], bf16[64,256]{1,0}, bf16[4,256,256]{2,1,0}) tuple(s32[] %next, bf16[64,256]{1,0} %gelu, bf16[4,256,256]{2,1,0} %w)
}

%cond (p.1: (s32[], bf16[64,256], bf16[4,256,256])) -> pred[] {
  %p.1 = (s32[], bf16[64,256]{1,0}, bf16[4,256,256]{2,1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element((s32[], bf16[64,256]{1,0}, bf16[4,256,256]{2,1,0}) %p.1), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(s32[] %i.1, s32[] %four), direction=LT
}

%search_body (q: (s32[])) -> (s32[]) {
  %q = (s32[]) parameter(0)
  %j = s32[] get-tuple-element((s32[]) %q), index=0
  %two = s32[] constant(2)
  %j2 = s32[] multiply(s32[] %j, s32[] %two)
  ROOT %u = (s32[]) tuple(s32[] %j2)
}

%search_cond (q.1: (s32[])) -> pred[] {
  %q.1 = (s32[]) parameter(0)
  %j.1 = s32[] get-tuple-element((s32[]) %q.1), index=0
  %big = s32[] constant(1000)
  ROOT %lt.1 = pred[] compare(s32[] %j.1, s32[] %big), direction=LT
}

ENTRY %main (w.1: bf16[4,256,256], x.1: bf16[64,256]) -> bf16[64,256] {
  %w.1 = bf16[4,256,256]{2,1,0} parameter(0)
  %x.1 = bf16[64,256]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,256]{1,0}, bf16[4,256,256]{2,1,0}) tuple(s32[] %zero, bf16[64,256]{1,0} %x.1, bf16[4,256,256]{2,1,0} %w.1)
  %loop = (s32[], bf16[64,256]{1,0}, bf16[4,256,256]{2,1,0}) while((s32[], bf16[64,256]{1,0}, bf16[4,256,256]{2,1,0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %one.1 = s32[] constant(1)
  %sinit = (s32[]) tuple(s32[] %one.1)
  %search = (s32[]) while((s32[]) %sinit), condition=%search_cond, body=%search_body
  %h = bf16[64,256]{1,0} get-tuple-element((s32[], bf16[64,256]{1,0}, bf16[4,256,256]{2,1,0}) %loop), index=1
  %proj = bf16[256,128]{1,0} constant({...})
  %head = bf16[64,128]{1,0} fusion(bf16[64,256]{1,0} %h, bf16[256,128]{1,0} %proj), kind=kCustom, calls=%triton_gemm
  %attn = (bf16[64,256]{1,0}) custom-call(bf16[64,256]{1,0} %h), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %out = bf16[64,256]{1,0} get-tuple-element((bf16[64,256]{1,0}) %attn), index=0
}
"""


def test_kernels_count_loop_trips_sliced_reads_and_gemm_flops():
  program = gpu_program.read(MODULE)
  launches = {(k.kind, k.name): k for k in program.kernels}
  # The counted loop's body runs 4 times: its slice, GEMM and GELU; the data-dependent search loop's
  # multiply and both conditions' compares once per call as written (a search loop's body counts once).
  assert launches[("gemm", "gemm")].runs == 4 and launches[("fusion", "gelu")].runs == 4
  assert launches[("compare", "lt")].runs == 4 and launches[("multiply", "j2")].runs == 1
  assert program.syncing_loops == 1  # the search loop: its trip count depends on data
  gemm = launches[("gemm", "gemm")]
  assert gemm.flops == 2 * 64 * 256 * 256
  assert gemm.bytes == 2 * (64 * 256 + 256 * 256 + 64 * 256)  # its workspace is not traffic
  # The slice fusion reads one layer of the stacked weight, not all four, and writes it.
  assert launches[("fusion", "slice_fusion")].bytes == 2 * 256 * 256 + 4 + 2 * 256 * 256
  assert launches[("pallas", "attn")].runs == 1 and launches[("pallas", "attn")].flops == 0
  # A fusion holding a dot (XLA's Triton GEMM) is a GEMM: its dot's FLOPs.
  assert launches[("gemm", "head")].flops == 2 * 64 * 128 * 256
  assert launches[("gemm", "head")].bytes == 2 * (64 * 256 + 256 * 128 + 64 * 128)
  assert program.launches == 4 * 4 + 4 + 1 + 1 + 1 + 1  # body x4, cond x4, search body + cond, GEMM, Pallas


def test_summary_floor_is_the_larger_of_flops_and_bytes_per_kernel():
  program = gpu_program.read(MODULE)
  summary = program.summary("h100", launch_seconds=1e-6)
  peak, bandwidth = gpu_program.DEVICES["h100"]
  gemm = summary["kinds"]["gemm"]
  assert gemm["launches"] == 5 and gemm["flops"] == 4 * 2 * 64 * 256 * 256 + 2 * 64 * 128 * 256
  # A 64-row GEMM moves more bytes than the time its FLOPs take: its floor is the memory's.
  assert gemm["floor_seconds"] == pytest.approx(gemm["bytes"] / bandwidth)
  assert gemm["bytes"] / bandwidth > gemm["flops"] / peak
  assert summary["floor_seconds"] == pytest.approx(sum(k["floor_seconds"] for k in summary["kinds"].values()))
  assert summary["estimate_seconds"] == pytest.approx(summary["floor_seconds"] + program.launches * 1e-6)
  assert summary["calibrated_seconds"] == pytest.approx(summary["floor_seconds"] * gpu_program.KERNEL_EFFICIENCY
                                                        + program.launches * gpu_program.GAP_SECONDS)
  assert summary["largest"][0]["kind"] in ("gemm", "fusion")
  line = gpu_program.format_line(summary)
  assert line.startswith(f"kernels a step: {program.launches} (") and "host-synchronised loops 1" in line


# XLA's dynamic-slice fusion (--xla_gpu_enable_dynamic_slice_fusion): the cuBLAS call reads one layer
# of a stacked weight at an offset, inside a custom fusion, with no copy of the slice.
DYNAMIC_SLICE_FUSION = """
HloModule jit_step, entry_computation_layout={(bf16[4,256,256]{2,1,0}, bf16[64,256]{1,0}, s32[])->bf16[64,256]{1,0}}

%dynamic-slice-fusion (p0: bf16[4,256,256], p1: s32[], p2: s32[], p3: bf16[64,256]) -> (bf16[64,256], s8[4194304]) {
  %p3 = bf16[64,256]{1,0} parameter(3)
  %p0 = bf16[4,256,256]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = s32[] parameter(2)
  %dynamic-slice.1 = bf16[1,256,256]{2,1,0} dynamic-slice(bf16[4,256,256]{2,1,0} %p0, s32[] %p1, s32[] %p2, s32[] %p2), dynamic_slice_sizes={1,256,256}
  %bitcast.1 = bf16[256,256]{1,0} bitcast(bf16[1,256,256]{2,1,0} %dynamic-slice.1)
  ROOT %custom-call.1 = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(bf16[64,256]{1,0} %p3, bf16[256,256]{1,0} %bitcast.1), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
}

ENTRY %main (w: bf16[4,256,256], x: bf16[64,256], i: s32[]) -> bf16[64,256] {
  %w = bf16[4,256,256]{2,1,0} parameter(0)
  %x = bf16[64,256]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %zero = s32[] constant(0)
  %address_computation = (bf16[64,256]{1,0}, s8[4194304]{0}) fusion(bf16[4,256,256]{2,1,0} %w, s32[] %i, s32[] %zero, bf16[64,256]{1,0} %x), kind=kCustom, calls=%dynamic-slice-fusion
  ROOT %y = bf16[64,256]{1,0} get-tuple-element((bf16[64,256]{1,0}, s8[4194304]{0}) %address_computation), index=0
}
"""


def test_a_cublas_call_in_a_dynamic_slice_fusion_is_a_gemm_reading_one_layer():
  (kernel,) = gpu_program.read(DYNAMIC_SLICE_FUSION).kernels
  assert (kernel.kind, kernel.runs) == ("gemm", 1)
  assert kernel.flops == 2 * 64 * 256 * 256
  # One layer of the stacked weight, the activations, the result; not the workspace.
  assert kernel.bytes == 2 * (256 * 256 + 64 * 256 + 64 * 256) + 2 * 4


# jaxlib 0.11's XLA:GPU runs some fusions as async pairs: one kernel, counted at its start, its body
# not read as top-level kernels.
ASYNC_FUSION = """
HloModule jit_step, entry_computation_layout={(bf16[4,256,256]{2,1,0}, s32[])->bf16[1,256,256]{2,1,0}}

%fused_dynamic_slice (param_0: bf16[4,256,256], param_1: s32[]) -> bf16[1,256,256] {
  %param_0 = bf16[4,256,256]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %constant_0 = s32[] constant(0)
  %subtract.1 = s32[] subtract(s32[] %param_1, s32[] %constant_0)
  ROOT %dynamic-slice.1 = bf16[1,256,256]{2,1,0} dynamic-slice(bf16[4,256,256]{2,1,0} %param_0, s32[] %subtract.1, s32[] %constant_0, s32[] %constant_0), dynamic_slice_sizes={1,256,256}
}

ENTRY %main (w: bf16[4,256,256], i: s32[]) -> bf16[1,256,256] {
  %w = bf16[4,256,256]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %fusion-start.1 = ((bf16[4,256,256]{2,1,0}, s32[]), bf16[1,256,256]{2,1,0}, u32[]) fusion-start(bf16[4,256,256]{2,1,0} %w, s32[] %i), kind=kLoop, calls=%fused_dynamic_slice
  ROOT %fusion-done.1 = bf16[1,256,256]{2,1,0} fusion-done(((bf16[4,256,256]{2,1,0}, s32[]), bf16[1,256,256]{2,1,0}, u32[]) %fusion-start.1)
}
"""


def test_an_async_fusion_is_one_kernel_reading_its_slice():
  (kernel,) = gpu_program.read(ASYNC_FUSION).kernels
  assert (kernel.kind, kernel.name, kernel.runs) == ("fusion", "fusion-start.1", 1)
  assert kernel.bytes == 2 * 256 * 256 + 4 + 2 * 256 * 256  # one layer read, written; not all four


# A token embedding: a fusion gathers 512 rows of a 32,000-row table.
GATHER_FUSION = """
HloModule jit_step, entry_computation_layout={(bf16[32000,256]{1,0}, s32[512]{0})->bf16[512,256]{1,0}}

%fused_gather (param_0: bf16[32000,256], param_1: s32[512]) -> bf16[512,256] {
  %param_0 = bf16[32000,256]{1,0} parameter(0)
  %param_1 = s32[512]{0} parameter(1)
  %bitcast.1 = s32[512,1]{1,0} bitcast(s32[512]{0} %param_1)
  %gather.1 = bf16[512,1,256]{2,1,0} gather(bf16[32000,256]{1,0} %param_0, s32[512,1]{1,0} %bitcast.1), offset_dims={1,2}, collapsed_slice_dims={}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,256}
  ROOT %bitcast.2 = bf16[512,256]{1,0} bitcast(bf16[512,1,256]{2,1,0} %gather.1)
}

ENTRY %main (table: bf16[32000,256], ids: s32[512]) -> bf16[512,256] {
  %table = bf16[32000,256]{1,0} parameter(0)
  %ids = s32[512]{0} parameter(1)
  ROOT %embed = bf16[512,256]{1,0} fusion(bf16[32000,256]{1,0} %table, s32[512]{0} %ids), kind=kLoop, calls=%fused_gather
}
"""


def test_a_gather_reads_the_rows_it_takes_not_the_table():
  (kernel,) = gpu_program.read(GATHER_FUSION).kernels
  assert kernel.bytes == 2 * 512 * 256 + 4 * 512 + 2 * 512 * 256  # rows read, ids, rows written


# XLA's cuBLASLt FP8 GEMM (model.fp8_impl="xla"): e4m3 operands with their scales.
FP8_GEMM = """
HloModule jit_step, entry_computation_layout={(f8e4m3fn[4096,4096]{1,0}, f8e4m3fn[4096,4096]{1,0}, f32[], f32[])->bf16[4096,4096]{1,0}}

ENTRY %main (x: f8e4m3fn[4096,4096], w: f8e4m3fn[4096,4096], sx: f32[], sw: f32[]) -> bf16[4096,4096] {
  %x = f8e4m3fn[4096,4096]{1,0} parameter(0)
  %w = f8e4m3fn[4096,4096]{1,0} parameter(1)
  %sx = f32[] parameter(2)
  %sw = f32[] parameter(3)
  %gemm = (bf16[4096,4096]{1,0}, s8[4194304]{0}) custom-call(f8e4m3fn[4096,4096]{1,0} %x, f8e4m3fn[4096,4096]{1,0} %w, f32[] %sx, f32[] %sw), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %y = bf16[4096,4096]{1,0} get-tuple-element((bf16[4096,4096]{1,0}, s8[4194304]{0}) %gemm), index=0
}
"""


def test_an_fp8_gemm_floor_counts_its_flops_at_the_fp8_peak():
  (kernel,) = gpu_program.read(FP8_GEMM).kernels
  peak, _ = gpu_program.DEVICES["h100"]
  assert kernel.kind == "gemm" and kernel.flops == 2 * 4096**3 and kernel.peak_scale == 2.0
  assert kernel.floor_seconds("h100") == pytest.approx(kernel.flops / (2 * peak))  # compute-bound at 4096^3


# routes.py's Mosaic attention route: a lax.cond between the Mosaic GPU kernel (fast path, where the key
# ranges are valid) and a fallback; XLA prints a two-way conditional with true/false computations.
CONDITIONAL = """
HloModule jit_step, entry_computation_layout={(pred[], bf16[8,2048,64]{2,1,0})->bf16[8,2048,64]{2,1,0}}

%fused_double (param_0: bf16[8,2048,64]) -> bf16[8,2048,64] {
  %param_0 = bf16[8,2048,64]{2,1,0} parameter(0)
  ROOT %add.1 = bf16[8,2048,64]{2,1,0} add(bf16[8,2048,64]{2,1,0} %param_0, bf16[8,2048,64]{2,1,0} %param_0)
}

%fast (x: bf16[8,2048,64]) -> bf16[8,2048,64] {
  %x = bf16[8,2048,64]{2,1,0} parameter(0)
  ROOT %mosaic = bf16[8,2048,64]{2,1,0} custom-call(bf16[8,2048,64]{2,1,0} %x), custom_call_target="mosaic_gpu_v2"
}

%fallback (y: bf16[8,2048,64]) -> bf16[8,2048,64] {
  %y = bf16[8,2048,64]{2,1,0} parameter(0)
  %twice = bf16[8,2048,64]{2,1,0} fusion(bf16[8,2048,64]{2,1,0} %y), kind=kLoop, calls=%fused_double
  %again = bf16[8,2048,64]{2,1,0} fusion(bf16[8,2048,64]{2,1,0} %twice), kind=kLoop, calls=%fused_double
  ROOT %triton = bf16[8,2048,64]{2,1,0} custom-call(bf16[8,2048,64]{2,1,0} %again), custom_call_target="__gpu$xla.gpu.triton"
}

ENTRY %main (p: pred[], v: bf16[8,2048,64]) -> bf16[8,2048,64] {
  %p = pred[] parameter(0)
  %v = bf16[8,2048,64]{2,1,0} parameter(1)
  ROOT %cond = bf16[8,2048,64]{2,1,0} conditional(pred[] %p, bf16[8,2048,64]{2,1,0} %v, bf16[8,2048,64]{2,1,0} %v), true_computation=%fast, false_computation=%fallback
}
"""


def test_a_conditional_counts_its_costlier_branch_once():
  program = gpu_program.read(CONDITIONAL)
  # The fallback (three kernels) costs more than the Mosaic call: it alone counts.
  assert sorted((k.kind, k.name) for k in program.kernels) == [("fusion", "again"), ("fusion", "twice"),
                                                                ("pallas", "triton")]
  assert program.syncing_conditionals == 1  # its predicate goes to the host, which waits for the device
  # A fallback as costly as the fast path (one kernel of the same bytes): the first branch counts, once.
  even = "\n".join(line for line in CONDITIONAL.splitlines() if "%twice" not in line or "triton" in line)
  even = even.replace("custom-call(bf16[8,2048,64]{2,1,0} %again)", "custom-call(bf16[8,2048,64]{2,1,0} %y)")
  ((kind, name, runs),) = [(k.kind, k.name, k.runs) for k in gpu_program.read(even).kernels]
  assert (kind, name, runs) == ("pallas", "mosaic", 1)  # a Mosaic GPU call is a Pallas kernel
