"""The Pallas kernels compiled to H100 (sm_90) machine code on a CPU-only machine: registers,
spills, shared memory and the tensor-core instruction of each kernel.

  pip install triton                       # into any venv: it needs no GPU and no jax
  python benchmarks/triton_sm90.py         # with triton importable here, or name its python:
  python benchmarks/triton_sm90.py --triton-python /path/to/venv/bin/python

How: `jax.export(platforms=["cuda"])` under `ejax.kernels.platform.lowering_for("gpu")` puts each
kernel's Triton IR, as MLIR bytecode, into a `__gpu$xla.gpu.triton` custom call (the cross-lowering
tests check those calls). jaxlib's own MLIR, which registers the Triton dialect, turns the bytecode
into text; a separate process with upstream Triton parses that text and compiles it for sm_90 with
the kernel's num_warps and num_stages, and `ptxas -v` reports registers and spills. Upstream
Triton's pass pipeline is not XLA's (XLA pins its own Triton), so the figures are close to what a
GPU run builds, not identical; nothing here measures speed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

# ---- Lowering (this process: jax, no triton) -------------------------------------------------

HEAD_DIMS = (64, 128, 256)  # vl self-attention and DiT at 64; Qwen3 at 128; pi0.5's Gemma at 256


def _unescape_mlir_string(text: str) -> bytes:
  # MLIR prints the bytes of a string attribute that are not printable as \XX (hex), "\" as \\.
  out, i = bytearray(), 0
  while i < len(text):
    if text[i] == "\\":
      if text[i + 1] == "\\":
        out.append(0x5C)
        i += 2
      else:
        out.append(int(text[i + 1:i + 3], 16))
        i += 3
    else:
      out.extend(text[i].encode("latin-1"))
      i += 1
  return bytes(out)


def _triton_calls(module: str):
  """(name, Triton IR bytecode, num_stages, num_warps) of each Triton custom call."""
  pattern = r'\bir = "((?:[^"\\]|\\.)*)", name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32'
  return [(name, _unescape_mlir_string(ir), int(stages), int(warps))
          for ir, name, stages, warps in re.findall(pattern, module)]


def lower_kernels(out_dir: str) -> list[dict]:
  """Writes each kernel's Triton IR as text to out_dir; returns what the compile step needs."""
  import jax
  import jax.numpy as jnp
  from jax import export
  from jax._src.lib.mlir import ir
  from jaxlib.triton import dialect

  from ejax.kernels.attention import flash_attention
  from ejax.kernels.fp8 import fp8_dot
  from ejax.kernels.platform import lowering_for

  def lower(fn, *args):
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with lowering_for("gpu"):
      return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()

  calls = []
  for head_dim in HEAD_DIMS:
    # Packed causal rows with grouped kv heads, bf16, the GPU tiles (64 x 64).
    q = jax.ShapeDtypeStruct((2, 1024, 8, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1024, 2, head_dim), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 1024), jnp.int32)
    loss = lambda q, k, v, ids: jnp.sum(flash_attention(
        q, k, v, q_segment_ids=ids, kv_segment_ids=ids, mask_kind="causal", q_positions=ids,
        kv_positions=ids, impl="pallas").astype(jnp.float32))
    module = lower(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, ids)
    calls += [(f"{name.removeprefix('ejax_varlen_')} d={head_dim}", *rest)
              for name, *rest in _triton_calls(module)]
  # fp8_dot at a GR00T DiT feed-forward shape: the forward GEMM and the two backward ones.
  x, w = jax.ShapeDtypeStruct((2048, 1536), jnp.bfloat16), jax.ShapeDtypeStruct((1536, 6144), jnp.float32)
  module = lower(jax.value_and_grad(lambda x, w: jnp.sum(fp8_dot(x, w)), argnums=(0, 1)), x, w)
  calls += [("fp8_gemm", *rest) for _, *rest in _triton_calls(module)]

  kernels = []
  for index, (name, bytecode, stages, warps) in enumerate(calls):
    context = ir.Context()
    dialect.register_dialect(context)
    with context:
      text = ir.Module.parse(bytecode).operation.get_asm(enable_debug_info=False)
    if name == "fp8_gemm":  # which GEMM, from its operand formats (forward e4m3 x e4m3)
      a, b = re.findall(r"%arg[01]: !tt\.ptr<(\w+)>", text)
      name = f"fp8_gemm {a.removeprefix('f8')} x {b.removeprefix('f8')}"
    path = os.path.join(out_dir, f"kernel{index}.ttir")
    with open(path, "w") as f:
      f.write(text)
    kernels.append(dict(name=name, path=path, num_warps=warps, num_stages=stages))
  return kernels


# ---- Compiling (a process with triton, no jax) ---------------------------------------------

def compile_kernels(kernels: list[dict]) -> list[dict]:
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import compile as triton_compile

  bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
  results = []
  for kernel in kernels:
    compiled = triton_compile(kernel["path"], target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=kernel["num_warps"], num_stages=kernel["num_stages"]))
    ptx_path = kernel["path"].replace(".ttir", ".ptx")
    with open(ptx_path, "w") as f:
      f.write(compiled.asm["ptx"])
    report = ""
    for ptxas in ("ptxas-blackwell", "ptxas"):  # whichever reads the PTX version Triton wrote
      run = subprocess.run([os.path.join(bin_dir, ptxas), "-v", "--gpu-name", "sm_90a", ptx_path, "-o",
                            ptx_path + ".cubin"], capture_output=True, text=True)
      if run.returncode == 0:
        report = run.stdout + run.stderr
        break
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    mma = sorted(set(re.findall(r"\b(wgmma\.mma_async\S*?|mma\.sync\S*?)\s", compiled.asm["ptx"])))
    results.append(dict(kernel, triton=triton.__version__, shared=compiled.metadata.shared,
                        registers=int(registers.group(1)) if registers else None,
                        spill_stores=int(spills.group(1)) if spills else None,
                        spill_loads=int(spills.group(2)) if spills else None, mma=mma))
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--triton-python", default=None,
                      help="a python that can import triton (default: this one, if it can)")
  parser.add_argument("--compile", default=None, help=argparse.SUPPRESS)  # internal: the triton process
  args = parser.parse_args()
  if args.compile:
    with open(args.compile) as f:
      print(json.dumps(compile_kernels(json.load(f))))
    return

  triton_python = args.triton_python or (sys.executable if importlib.util.find_spec("triton") else None)
  if triton_python is None:
    sys.exit("triton_sm90: no triton here; `pip install triton` into a venv and pass its python as "
             "--triton-python")
  with tempfile.TemporaryDirectory() as out_dir:
    kernels = lower_kernels(out_dir)
    manifest = os.path.join(out_dir, "kernels.json")
    with open(manifest, "w") as f:
      json.dump(kernels, f)
    run = subprocess.run([triton_python, os.path.abspath(__file__), "--compile", manifest], capture_output=True,
                         text=True, env=dict(os.environ, TRITON_DEFAULT_FP_FUSION="1"))
    if run.returncode:
      sys.exit(f"triton_sm90: compiling with {triton_python} failed:\n{run.stderr[-3000:]}")
    results = json.loads(run.stdout.strip().splitlines()[-1])

  print(f"Triton {results[0]['triton']} -> sm_90a; warps x stages, registers per thread, spill bytes "
        "(stores/loads), dynamic shared memory, tensor-core instruction")
  for r in results:
    print(f"  {r['name']:<28} {r['num_warps']} x {r['num_stages']}  regs {r['registers']:>3}  "
          f"spills {r['spill_stores']}/{r['spill_loads']}  shared {r['shared'] / 1024:5.1f} KiB  "
          f"{', '.join(r['mma']) or 'no mma'}")
  clean = sum(r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in results)
  print(f"sm_90 kernels compiled without register spills: {clean} of {len(results)} (goal all)")


if __name__ == "__main__":
  main()
