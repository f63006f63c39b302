"""compile_report --target=h100: XLA:GPU compiles for compile-only H100s (ejax/parallel/aot_target.py).

Without JAX's CUDA plugin (ejax's own venv) the option ends with one error line that says how to
install it; with the plugin (.venv-cuda, see aot_target's docstring) the compiling tests run.
"""

import json
import os
import subprocess
import sys

import pytest

from ejax.parallel import aot_target
from tests.train.helpers import REPO

needs_plugin = pytest.mark.skipif(not aot_target.cuda_plugin_installed(),
                                  reason="JAX's CUDA plugin is not installed (see ejax/parallel/aot_target.py)")


def run(args: list[str]) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, "XLA_FLAGS": ""}, timeout=900)


def test_topology_names_hosts_of_eight_gpus():
  assert aot_target.topology_name(1) == "1x1x1"
  assert aot_target.topology_name(8) == "1x1x8"
  assert aot_target.topology_name(1024) == "1x128x8"
  with pytest.raises(aot_target.TargetError, match="12 GPUs do not fill hosts of 8"):
    aot_target.topology_name(12)
  with pytest.raises(aot_target.TargetError, match="'a100' is not one of"):
    aot_target.target_config("a100")


def test_h100_config_describes_an_h100():
  text = aot_target.target_config("h100")
  assert "core_count: 132" in text and "major: 9" in text and 'platform_name: "CUDA"' in text


@pytest.mark.skipif(aot_target.cuda_plugin_installed(), reason="the CUDA plugin is installed here")
def test_h100_target_without_the_plugin_is_one_error_line():
  done = run(["-m", "ejax.train.compile_report", "--target=h100", "--config=configs/tiny.py", "--mesh=data=1"])
  assert done.returncode == 1
  lines = [line for line in done.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, done.stderr
  assert lines[0].startswith("error: --target=h100 compiles with XLA:GPU, and JAX's CUDA plugin is not installed")
  assert 'pip install "jax-cuda12-plugin[with-cuda]==' in lines[0]


TINY_GRADIENT = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from ejax.parallel import aot_target, make_mesh
aot_target.run_jax_on_cpu()
mesh = make_mesh({"data": 8}, aot_target.compile_only_devices("h100", 8))
x = jax.ShapeDtypeStruct((8 * 1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
loss = lambda x, w: jnp.sum(jax.nn.gelu(x @ w).astype(jnp.float32) ** 2)
compiled = jax.jit(jax.grad(loss, argnums=1)).lower(x, w).compile()
memory = compiled.memory_analysis()
print(mesh.devices.flat[0].device_kind, memory.argument_size_in_bytes, memory.output_size_in_bytes,
      "all-reduce-start" in compiled.as_text(), "__cublas$lt$matmul" in compiled.as_text() or "gemm_fusion" in compiled.as_text())
"""


@needs_plugin
def test_a_data_parallel_gradient_compiles_for_eight_h100s():
  done = run(["-c", TINY_GRADIENT])
  assert done.returncode == 0, done.stderr[-3000:]
  kind, arguments, outputs, all_reduce, gpu_gemm = done.stdout.split("\n")[-2].rsplit(" ", 4)
  assert kind == "NVIDIA H100 80GB HBM3"
  # Per device: its 1,024 rows of x (8 MiB) and the whole weight (32 MiB); the weight's gradient.
  assert int(arguments) == 1024 * 4096 * 2 + 4096 * 4096 * 2 and int(outputs) == 4096 * 4096 * 2
  assert all_reduce == "True" and gpu_gemm == "True"  # XLA:GPU's program: an async all-reduce, GPU GEMMs


STACKING_PROBE = """
from ejax.parallel import aot_target
aot_target.run_jax_on_cpu()
devices = aot_target.compile_only_devices("h100", 1)
from tests.models.test_layers import stacking_in_a_sampling_loop
print(sorted(set(stacking_in_a_sampling_loop(False, devices))), sorted(set(stacking_in_a_sampling_loop(True, devices))))
"""


@needs_plugin
def test_gr00t_sampling_stacks_its_dit_weights_once_on_a_gpu():
  """XLA:GPU does not hoist a weight stacking out of a sampling loop (XLA:CPU does): stacked in the
  loop's body, each of the scanned DiT's concatenates runs once a denoising step; stacked once before
  the loop (DiT.stack_blocks, GR00T's velocity_fn), once a call."""
  done = subprocess.run([sys.executable, "-c", STACKING_PROBE], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip().splitlines()[-1] == "[4] [1]"


BIASED_ATTENTION_PROBE = """
from ejax.parallel import aot_target
aot_target.run_jax_on_cpu()
from ejax.kernels import platform
from tests.models.test_layers import biased_self_attention_kernels
with platform.lowering_for("gpu"):
  print(biased_self_attention_kernels(aot_target.compile_only_devices("h100", 1)))
"""


@needs_plugin
def test_a_biased_self_attention_adds_its_biases_in_the_cublas_calls():
  """SigLIP's self-attention on a GPU: q, k and v each one cuBLAS call whose epilogue adds the bias,
  feeding cuDNN attention as they are; merged into one matmul (XLA's DotMerger), its output took a
  pass of its own to add the biases and split q, k and v (27 a GR00T step, ~1 ms of an H200's)."""
  done = subprocess.run([sys.executable, "-c", BIASED_ATTENTION_PROBE], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  kernels = eval(done.stdout.strip().splitlines()[-1])
  gemms = [shape for kind, shape in kernels if kind == "gemm"]
  assert len(gemms) == 4 and all(shape.startswith("(bf16[8192,1152]") for shape in gemms), kernels  # q, k, v, out
  assert [kind for kind, _ in kernels if kind not in ("gemm", "fusion")] == ["custom-call"], kernels  # cuDNN
  assert not [shape for kind, shape in kernels if kind == "fusion" and "72]" in shape], kernels  # no split pass


@needs_plugin
def test_compile_report_on_h100s_keeps_the_report(tmp_path):
  path = tmp_path / "report.json"
  done = run(["-m", "ejax.train.compile_report", "--target=h100", "--config=configs/tiny.py", "--mesh=fsdp=8",
              "--per_device_batch=4", f"--json={path}"])
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(path.read_text())
  assert result["target"] == "h100" and result["device_kind"] == "NVIDIA H100 80GB HBM3"
  assert result["devices"] == 8 and result["global_batch"] == 32
  state, memory = sum(result["state"].values()), result["memory"]
  assert state <= memory["argument"] < state + 2**20  # the FSDP-sharded state and a small batch shard
  assert memory["total"] >= memory["argument"]
  assert result["collectives"]["all-gather"]["count"] > 0  # FSDP gathers its weights
  # XLA:GPU's collectives are asynchronous (-start / -done): each one's buffer is read, none is 0 bytes.
  assert result["collective_ops"] and all(op["buffer_bytes"] > 0 for op in result["collective_ops"])
  assert result["kernels"]["launches"] > 0 and result["kernels"]["device"] == "h100"


def test_a_triton_tiling_failure_is_one_error_line_with_its_remedy(monkeypatch):
  from ejax.train import compile_report

  def fail(*args, **kwargs):
    raise RuntimeError("INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot.268 = bf16[256,3072]")

  monkeypatch.setattr(aot_target, "run_jax_on_cpu", lambda: None)
  monkeypatch.setattr(compile_report, "report", fail)
  with pytest.raises(SystemExit) as exit:
    compile_report.main(["--target=h100", "--config=configs/tiny.py", "--mesh=data=1"])
  message = str(exit.value)
  assert message.startswith("error: XLA:GPU found no Triton GEMM tiling") and "\n" not in message
  assert "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false" in message
  monkeypatch.setattr(compile_report, "report", lambda *a, **k: 1 / 0)  # any other failure still raises
  with pytest.raises(ZeroDivisionError):
    compile_report.main(["--target=h100", "--config=configs/tiny.py", "--mesh=data=1"])


@needs_plugin
def test_gr00ts_gpu_step_launches_no_attention_tile_loops(tmp_path):
  """Every GR00T attention takes a GPU kernel or cuDNN: no loop waits on the host. The full-size step with
  the heads unpadded launched 80,438 kernels and 3,268 such loops (the XLA attention's tile loops);
  then 4,206 and 4 (jax.random.beta's gamma rejection loops for the flow timesteps, which
  flow.beta_alpha_one replaced on 2026-11-28 by inverting the CDF). Lowered from a CPU, attention takes
  the Triton kernels, which need no conditional either (the Hopper route's lax.cond does)."""
  path = tmp_path / "report.json"
  done = subprocess.run([sys.executable, "-m", "ejax.train.compile_report", "--target=h100",
                         "--config=configs/groot.py:runlocal", "--mesh=data=1", "--per_device_batch=24",
                         f"--json={path}"], cwd=REPO, capture_output=True, text=True, timeout=900,
                        env={**os.environ, "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"})
  assert done.returncode == 0, done.stderr[-3000:]
  kernels = json.loads(path.read_text())["kernels"]
  assert kernels["syncing_loops"] == 0 and kernels["syncing_conditionals"] == 0
  assert kernels["kinds"]["pallas"]["launches"] > 0 and kernels["kinds"]["gemm"]["flops"] > 0
  assert kernels["estimate_seconds"] > kernels["floor_seconds"] > 0
  assert done.stdout.strip().splitlines()[-1].startswith(f"kernels a step: {kernels['launches']:,} (")


COMMAND_BUFFER_PROBE = """
from ejax.parallel import aot_target, make_mesh
aot_target.run_jax_on_cpu()
from ejax.kernels import platform
from ejax.train import compile_report
from tests.train.helpers import load_config
config = load_config("configs/pi05.py", "runlocal")
config.model.scan_layers = True  # loops for the option to act on
config.train.command_buffers = True
mesh = make_mesh({"data": 1}, aot_target.compile_only_devices("h100", 1))
with platform.lowering_for("gpu"):
  step = compile_report.compile_train_step(config, mesh, 2)
print("while" in step.compiled.as_text())
config.train.cuda_graphs = False  # no CUDA graphs: an empty list of types
with platform.lowering_for("gpu"):
  compile_report.compile_train_step(config, mesh, 2)
print("no graphs compiled")
"""


@needs_plugin
def test_the_step_compiles_for_a_gpu_with_loops_in_cuda_graphs():
  """train.command_buffers' options, and train.cuda_graphs False's empty list, are ones this jaxlib's
  XLA:GPU takes (an unknown type is an error when the step compiles), on a scanned step."""
  done = subprocess.run([sys.executable, "-c", COMMAND_BUFFER_PROBE], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip().splitlines()[-2:] == ["True", "no graphs compiled"]


TRITON_GEMM_PROBE = """
from ejax.parallel import aot_target, make_mesh
aot_target.run_jax_on_cpu()
from ejax.kernels import platform
from ejax.train import compile_report
from tests.train.helpers import load_config
config = load_config("configs/groot.py", "runlocal,dataset=synthetic")
mesh = make_mesh({"data": 1}, aot_target.compile_only_devices("h100", 1))
for triton_gemm in (False, True):
  config.train.triton_gemm = triton_gemm
  with platform.lowering_for("gpu"):
    text = compile_report.compile_train_step(config, mesh, 8).compiled.as_text()
  print(triton_gemm, text.count("__cublas$"), text.count('"kind":"__triton_nested_gemm_fusion"'))
"""


@needs_plugin
def test_the_train_step_compiles_its_matmuls_as_cublas_calls_unless_told_otherwise():
  """train.triton_gemm False (the default) reaches XLA:GPU as a compile option, with no XLA_FLAGS: every
  matmul a cuBLAS call, as the GPU figures were measured; True gives XLA's Triton GEMM fusions."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run([sys.executable, "-c", TRITON_GEMM_PROBE], cwd=REPO, capture_output=True, text=True,
                        env=env, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  (cublas_default, triton_default), (cublas_on, triton_on) = [
      tuple(int(n) for n in line.split()[1:]) for line in done.stdout.strip().splitlines()[-2:]]
  assert cublas_default > 0 and triton_default == 0
  assert triton_on > 0 and cublas_on < cublas_default


PI05_FP8_PROBE = """
import collections, re
from ejax.parallel import aot_target, make_mesh
aot_target.run_jax_on_cpu()
from ejax.kernels import platform
from ejax.train import compile_report
from tests.train.helpers import load_config
import sys
config = load_config("configs/pi05.py", "")
config.model.update(fp8=True, fp8_impl=sys.argv[1])
mesh = make_mesh({"data": 1}, aot_target.compile_only_devices("h100", 1))
with platform.lowering_for("gpu"):
  text = compile_report.compile_train_step(config, mesh, 8).compiled.as_text()
calls = re.findall(r'= \\(bf16\\[([0-9,]+)\\][^\\n]*custom_call_target="__cublas.lt.matmul.f8"[^\\n]*'
                   r'"operand_precision":\\["(\\w+)"', text)
print(sorted(collections.Counter(shape for shape, _ in calls).items()))
print(sorted(collections.Counter(precision for _, precision in calls).items()))
"""


@needs_plugin
@pytest.mark.parametrize("impl", ["xla", "xla_delayed", "xla_delayed_fastacc"])
def test_pi05_fp8_runs_the_paligemma_feed_forward_as_cublaslt_fp8_gemms(impl):
  """model.fp8 at full size (8 samples of 640 tokens): the PaliGemma feed-forward's gate, up and down
  projections are cuBLASLt FP8 GEMMs in the decoder scan's bodies: forward (3), the rematerialised
  gate and up (2), dX and dW of each (6), whichever scaling (delayed scaling's scales are sliced from
  one vector: XLA's GEMM rewriter folds only scalar scales). The forward accumulates fast (DEFAULT),
  dX and dW in full precision (HIGHEST), but all fast with xla_delayed_fastacc. At runlocal sizes XLA
  merges gate and up into one bf16 GEMM (its DotMerger takes small dots), which is why this compiles
  the full size (~1 min each)."""
  done = subprocess.run([sys.executable, "-c", PI05_FP8_PROBE, impl], cwd=REPO, capture_output=True, text=True,
                        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  shapes, precisions = done.stdout.strip().splitlines()[-2:]
  assert shapes == str([("16384,2048", 1), ("2048,16384", 2), ("5120,16384", 5), ("5120,2048", 3)])
  assert precisions == str([("DEFAULT", 11)] if impl == "xla_delayed_fastacc" else [("DEFAULT", 5), ("HIGHEST", 6)])


GROOT_FROZEN_FP8_PROBE = """
import collections, re
from ejax.parallel import aot_target, make_mesh
aot_target.run_jax_on_cpu()
from ejax.kernels import platform
from ejax.train import compile_report
from tests.train.helpers import load_config
config = load_config("configs/groot.py", "")
config.train.frozen_fp8 = True
mesh = make_mesh({"data": 1}, aot_target.compile_only_devices("h100", 1))
with platform.lowering_for("gpu"):
  text = compile_report.text_with_operand_shapes(compile_report.compile_train_step(config, mesh, 32).compiled)
calls = re.findall(r'= \\(bf16\\[([0-9,]+)\\][^\\n]*custom-call\\(f8e4m3fn\\[([0-9,]+)\\][^\\n]*'
                   r'custom_call_target="__cublas.lt.matmul.f8"', text)
print(sorted(collections.Counter(calls).items()))
"""


@needs_plugin
def test_gr00t_frozen_fp8_runs_every_frozen_projection_as_a_cublaslt_fp8_gemm():
  """train.frozen_fp8 at full size (32 samples): all 248 frozen projections are cuBLASLt FP8 GEMMs, q,
  k and v apart (XLA's DotMerger had joined Qwen3's into one bf16 GEMM over weights dequantised every
  step): SigLIP's 27 blocks x (q, k, v, o, fc1, fc2) over 8,192 patches, its patch embedding and the
  connector, and the 12 Qwen3 layers x (q, o, k, v, gate, up, down) over 8,704 prompt tokens."""
  done = subprocess.run([sys.executable, "-c", GROOT_FROZEN_FP8_PROBE], cwd=REPO, capture_output=True, text=True,
                        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  counts = dict(eval(done.stdout.strip().splitlines()[-1]))
  assert counts == {("8192,1152", "8192,1152"): 108, ("8192,1152", "8192,4304"): 27, ("8192,4304", "8192,1152"): 27,
                    ("8192,1152", "8192,592"): 1, ("8192,2048", "8192,1152"): 1,
                    ("8704,2048", "8704,2048"): 24, ("8704,1024", "8704,2048"): 24,
                    ("8704,2048", "8704,6144"): 12, ("8704,6144", "8704,2048"): 24}
