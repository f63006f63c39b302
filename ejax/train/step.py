"""The train step: a pure function of (state, batch), jitted with explicit shardings."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from flax import nnx
from ml_collections import ConfigDict

from ejax.kernels.attention import unchecked_layout
from ejax.kernels.fp8 import Fp8History
from ejax.train import optim
from ejax.train import rows as embodiment_rows
from ejax.train.state import ModelParts, TrainState, compute_model


def make_train_step(parts: ModelParts, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    train: ConfigDict) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  compute_dtype = jnp.dtype(train.compute_dtype)
  accum = int(train.grad_accum_steps)
  # train.embodiment_rows: the loss, gradients and update on the embodiment tables' trained rows only
  # (ejax/train/rows.py); None: every parameter whole.
  rows = embodiment_rows.from_train(train)
  view = rows.view if rows else (lambda params: params)

  # The attention routes that need packed rows run unconditionally (a batch that is not packed gives a
  # NaN loss, which the trainer's guard stops on) unless train.check_attention_layout: XLA:GPU waits
  # for the device on the host at each of their lax.conds otherwise (ejax.kernels.attention.ops).
  unchecked = not train.get("check_attention_layout", False)

  def loss_fn(params, histories, state: TrainState, micro_batch, rng):
    # bf16 (or configured) compute from fp32 master weights: gradients flow back through the cast.
    rest = nnx.merge_state(state.rest, histories)
    model = compute_model(parts.graphdef, params, state.frozen, rest, compute_dtype, state.frozen_fp8)
    with unchecked_layout(unchecked):
      loss, metrics = model.compute_loss(rows.remap(micro_batch) if rows else micro_batch, rng)
    return loss.astype(jnp.float32), metrics

  # Delayed-scaling FP8 (ejax.kernels.fp8.Fp8History): the "gradient" with respect to a history is the
  # history with this step's amaxes pushed in, its new value. Empty (nothing differentiated) otherwise.
  grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

  def gradients(trained, histories, state, micro_batch, rng):
    # With train.compute_copy the forward reads the optimizer's compute-dtype copy of the weights (the
    # cast it would make) and its gradients come back to the master dtype, as through the cast.
    copy = optim.compute_copy(state.opt_state)
    if copy is None:
      return grad_fn(trained, histories, state, micro_batch, rng)
    out, (grads, pushed) = grad_fn(copy, histories, state, micro_batch, rng)
    return out, (jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trained), pushed)

  def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
    step_rng = jax.random.fold_in(state.rng, state.step)
    trained = view(state.params)
    histories = nnx.filter_state(state.rest, Fp8History)
    if accum == 1:
      (loss, aux), (grads, histories) = gradients(trained, histories, state, batch, step_rng)
    else:
      # The batch holds `accum` micro-batches stacked on axis 0 (ejax/train/inputs.py).
      def body(carry, inputs):
        index, micro_batch = inputs
        (loss_i, aux_i), (grads_i, pushed_i) = gradients(trained, histories, state, micro_batch,
                                                         jax.random.fold_in(step_rng, index))
        total_loss, total_grads, pushed = carry
        # Every micro-batch pushes its amax onto the same history: the step's amax is their maximum.
        return (total_loss + loss_i, jax.tree.map(jnp.add, total_grads, grads_i),
                jax.tree.map(jnp.maximum, pushed, pushed_i)), aux_i

      zeros = jax.tree.map(jnp.zeros_like, trained)
      carry = (jnp.zeros((), jnp.float32), zeros, jax.tree.map(jnp.zeros_like, histories))
      (loss, grads, histories), aux = jax.lax.scan(body, carry, (jnp.arange(accum), batch))
      loss = loss / accum
      grads = jax.tree.map(lambda g: g / accum, grads)
      # Per-sample values come back [accum, micro]: flatten to the step's samples in order.
      aux = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]) if x.ndim >= 2 else jnp.mean(x, 0), aux)

    updates, opt_state = tx.update(grads, state.opt_state, trained)
    params = optax.apply_updates(trained, updates)
    if rows:
      params = rows.write_back(state.params, params)
    ema = state.ema_params
    if ema is not None:
      decay = train.ema_decay
      ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, ema, params)
    metrics = {
        "loss": loss,
        "grad_norm": optim.global_norm(grads),
        "learning_rate": schedule(state.step),
        **{k: (jnp.mean(v) if k != "per_sample_loss" else v) for k, v in aux.items()},
    }
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, ema_params=ema,
                              rest=nnx.merge_state(state.rest, histories))
    return new_state, metrics

  return train_step


# XLA:GPU records runs of kernels into CUDA graphs (command buffers) by default, but not loops: every
# `lax.scan` over repeated blocks (the whole of a scanned model) still launches its body kernel by
# kernel from the host. With these types a loop and its body go into the graph too.
COMMAND_BUFFER_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"


def compiler_options(train: ConfigDict) -> dict[str, Any]:
  """XLA options the train step compiles with (`Lowered.compile(compiler_options=...)`); GPU-only ones
  are inert elsewhere.

  train.triton_gemm False (the default): every matmul is a cuBLAS call, not a Triton GEMM fusion
  chosen by autotuning. Every GPU figure was measured so (benchmarks/gpu.py sets the same XLA flag),
  the kernel model is calibrated on it, MaxText sets it for GPUs, and XLA's Triton GEMM autotuning
  stalled a compile on the first H200 window (2026-11-27); without it a compile-only GPU also stops
  on Triton tilings it cannot autotune (ejax/parallel/aot_target.py).
  train.command_buffers: loops in CUDA graphs too, those of known trip count unrolled in them
  (jaxlib's defaults leave loops out).
  train.cuda_graphs False: no CUDA graphs at all, every kernel launched from the host on its own (the
  train_step benchmark's no_graphs arm: what the graphs gain or cost a step); it overrides
  command_buffers."""
  options: dict[str, Any] = {}
  if not train.get("triton_gemm", False):
    options["xla_gpu_enable_triton_gemm"] = False
  if not train.get("cuda_graphs", True):
    options["xla_gpu_enable_command_buffer"] = ""
  elif train.get("command_buffers", False):
    options.update(xla_gpu_enable_command_buffer=COMMAND_BUFFER_TYPES, xla_gpu_command_buffer_unroll_loops=True)
  return options


def jit_train_step(train_step, state_shardings: Any, batch_shardings: Any, mesh: Mesh):
  """jit with explicit shardings. The state is donated: its buffers are reused for the new state,
  which halves peak parameter + optimizer memory; callers must not touch the old state after."""
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(train_step, in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))
