"""The whole GR00T-N1.5 and pi0.5 train steps and policy inference lower for CUDA on this CPU-only
machine at runlocal size, with every attention on the Pallas kernel and GR00T's trained feed-forwards
(DiT, VL transformer) on the FP8 GEMM (tests/cuda_lowering.py): no jnp/XLA stand-in is traced anywhere in them.

pi0.5's model.fp8 is lowered at full size instead (tests/train/test_compile_report_gpu.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.models.registry import get_model_spec
from ejax.parallel import make_mesh
from ejax.parallel.data import batch_sharding
from ejax.train.optim import make_optimizer
from ejax.train.state import abstract_train_state, model_parts
from ejax.train.step import jit_train_step, make_train_step
from ejax.kernels.attention import mosaic_backward, tokamax_gpu
from tests.cuda_lowering import (CUDNN_ATTENTION, CUDNN_UNMASKED, TRITON, custom_calls, forbid_fallbacks, lower_for_cuda,  # noqa: F401
                                 tokamax_h100, triton_kernels)
from tests.train.helpers import load_config

ATTENTION = {"ejax_varlen_attention_fwd"}
ATTENTION_GRAD = ATTENTION | {"ejax_varlen_attention_dq", "ejax_varlen_attention_dkv"}
FP8 = {"ejax_fp8_blockwise_matmul"}
# config path -> (overrides, kernels the train step must call, kernels sampling must call)
MODELS = {
    "configs/groot.py": (dict(fp8=True, fp8_impl="blockwise"), ATTENTION_GRAD | FP8, ATTENTION | FP8),
    "configs/pi05.py": (dict(attention_impl="pallas"), ATTENTION_GRAD, ATTENTION),
}
BATCH = 4


def _config(path):
  config = load_config(path, "runlocal")
  config.model.update(MODELS[path][0])
  return config


def _abstract_batch(config, mesh=None, rules=()):
  example = get_model_spec(config.model.name).example_batch(config.model, BATCH, 0)
  sharding = lambda v: batch_sharding(mesh, rules, v.ndim, leading=v.shape[0]) if mesh else None
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding(v))
          for k, v in example.items() if isinstance(v, np.ndarray) and v.dtype != object}


def _lowered_train_step(config) -> str:
  """The trainer's own step (ejax/train/step.py) with its shardings, on a one-device mesh, lowered for CUDA."""
  mesh = make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  rules = [tuple(rule) for rule in config.sharding_rules]
  tx, schedule = make_optimizer(config.train)
  abstract, shardings = abstract_train_state(config.model, config.train, tx, mesh, rules)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  batch = _abstract_batch(config, mesh, rules)
  step = jit_train_step(make_train_step(model_parts(config.model), tx, schedule, config.train),
                        shardings, {k: v.sharding for k, v in batch.items()}, mesh)
  return lower_for_cuda(step, state, batch)


@pytest.mark.parametrize("path", MODELS)
def test_train_step_lowers_with_the_gpu_kernels(forbid_fallbacks, path):
  module = _lowered_train_step(_config(path))
  assert set(custom_calls(module)) == {TRITON}
  assert set(triton_kernels(module)) == MODELS[path][1]


@pytest.mark.parametrize("path", MODELS)
def test_sample_actions_lowers_with_the_gpu_kernels(forbid_fallbacks, path):
  # What CheckpointPolicy jits: the restored model's sample_actions over a collated batch.
  config = _config(path)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: get_model_spec(config.model.name).create(config.model,
                                                                                              nnx.Rngs(0))))
  batch = _abstract_batch(config)
  horizon = config.model.action_horizon
  action_dim = config.model.get("max_action_dim", config.model.get("action_dim"))
  noise = jax.ShapeDtypeStruct((BATCH, horizon, action_dim), jnp.float32)

  def sample(state, batch, noise):
    return nnx.merge(graphdef, state).sample_actions(batch, jax.random.key(0), noise=noise)

  module = lower_for_cuda(jax.jit(sample), state, batch, noise)
  assert set(custom_calls(module)) == {TRITON}
  assert set(triton_kernels(module)) == MODELS[path][2]


def test_full_size_groot_runs_every_attention_in_the_gpu_kernels(forbid_fallbacks, monkeypatch):
  """At full size SigLIP's heads are 72 wide and the DiT's 48: without cuDNN, padded to 128 and 64
  they take the Pallas kernels too, no attention falls back to the XLA tile loops (a GPU launches
  their tiles one small kernel at a time). With cuDNN (a GPU machine's jaxlib) SigLIP's attention,
  which has no mask, runs cuDNN's fused attention at its own head size (frozen: forward only); the
  DiT's self-attention has no mask either and trains on cuDNN, its 49-token rows padded to 50 with the
  padded key masked (jax's cuDNN trains at even lengths only: a biased call, forward and backward); the
  masked ones stay on the kernels (the LLM's, the VL transformer's, the DiT's packed cross-attention)."""
  config = load_config("configs/groot.py")
  monkeypatch.setattr("jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version", _no_cudnn)
  module = _lowered_train_step(config)
  assert set(custom_calls(module)) == {TRITON}
  assert set(triton_kernels(module)) == ATTENTION_GRAD
  monkeypatch.setattr("jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version", lambda: 90800)
  module = _lowered_train_step(config)
  assert set(custom_calls(module)) == {TRITON, CUDNN_UNMASKED[0], *CUDNN_ATTENTION}
  assert set(triton_kernels(module)) == ATTENTION_GRAD


def _no_cudnn():
  raise RuntimeError("cuDNN is not detected.")


@pytest.mark.skipif(not tokamax_gpu.available() or mosaic_backward.available() is not None,
                    reason=tokamax_gpu.unavailable_reason() or str(mosaic_backward.available()))
def test_groot_train_step_lowers_with_the_mosaic_attention_route(forbid_fallbacks, tokamax_h100):
  """model.attention_impl="mosaic": every attention of the step (SigLIP, the LLM, the DiT's self- and
  packed cross-attention) runs tokamax's forward and ejax's Mosaic GPU backward, unconditionally (the
  train step's unchecked_layout); with train.check_attention_layout, ejax's Triton kernels are the
  branch for batches whose mask is not key ranges."""
  config = load_config("configs/groot.py", "runlocal")
  config.model.update(attention_impl="mosaic", dtype="bfloat16")  # the kernels take 16-bit floats
  module = _lowered_train_step(config)
  calls = custom_calls(module)
  assert set(calls) == {"mosaic_gpu_v2"}
  assert calls["mosaic_gpu_v2"] >= 3  # a forward, a dQ and a dK/dV kernel at least (export dedups)
  config.train.check_attention_layout = True
  module = _lowered_train_step(config)
  assert set(custom_calls(module)) == {TRITON, "mosaic_gpu_v2"}
  assert set(triton_kernels(module)) == ATTENTION_GRAD



@pytest.mark.skipif(mosaic_backward.available() is not None, reason=str(mosaic_backward.available()))
def test_groot_train_step_lowers_with_ejax_own_mosaic_kernels(forbid_fallbacks):
  """model.attention_impl="mosaic_own": every attention of the step runs ejax's Mosaic GPU forward and
  backward kernels (no tokamax), and nothing else (the train step runs them unchecked)."""
  config = load_config("configs/groot.py", "runlocal")
  config.model.update(attention_impl="mosaic_own", dtype="bfloat16")
  module = _lowered_train_step(config)
  calls = custom_calls(module)
  assert set(calls) == {"mosaic_gpu_v2"}
  assert calls["mosaic_gpu_v2"] >= 3
