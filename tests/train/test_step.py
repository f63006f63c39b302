"""The train step's compile options (ejax.train.step.compiler_options)."""

from ejax.train import step as step_lib
from tests.train.helpers import losses, tiny_config


def test_command_buffers_put_loops_in_cuda_graphs_and_change_nothing_on_a_cpu(tmp_path):
  """train.command_buffers adds XLA:GPU's loop commands to the default CUDA-graph types; the train job
  compiles with them, and on a CPU (where they are inert) trains to the same losses."""
  from ejax.train.loop import train

  config = tiny_config(steps=2)
  assert step_lib.compiler_options(config.train) == {"xla_gpu_enable_triton_gemm": False}  # cuBLAS matmuls
  config.train.command_buffers = True
  options = step_lib.compiler_options(config.train)
  types = options["xla_gpu_enable_command_buffer"].split(",")
  assert {"WHILE", "CONDITIONAL"} <= set(types)
  assert {"FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN"} <= set(types)  # jaxlib's defaults kept
  assert options["xla_gpu_command_buffer_unroll_loops"] is True

  with_graphs = train(config, str(tmp_path / "graphs"))
  config.train.command_buffers = False
  without = train(config, str(tmp_path / "plain"))
  assert losses(with_graphs) == losses(without) and len(losses(without)) == 2
