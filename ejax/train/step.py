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


def jit_train_step(train_step, state_shardings: Any, batch_shardings: Any, mesh: Mesh) -> "TrainStepFn":
  """jit with explicit shardings, called on the state's leaves (TrainStepFn). The state is donated:
  its buffers are reused for the new state, which halves peak parameter + optimizer memory; callers
  must not touch the old state after."""
  replicated = NamedSharding(mesh, PartitionSpec())
  leaf_shardings, tree = jax.tree.flatten(state_shardings)

  def flat_step(leaves, batch):
    new_state, metrics = train_step(jax.tree.unflatten(tree, leaves), batch)
    new_leaves, new_tree = jax.tree.flatten(new_state)
    if new_tree != tree:
      raise ValueError(f"the train step changed the state's structure: {tree} -> {new_tree}")
    return new_leaves, metrics

  jitted = jax.jit(flat_step, in_shardings=(leaf_shardings, batch_shardings),
                   out_shardings=(leaf_shardings, replicated), donate_argnums=(0,))
  return TrainStepFn(jitted, tree)


# --- The step called on the state's leaves -------------------------------------------------------
# A TrainState is a tree of nnx.State nodes: every call of a jitted function on one flattens ~2,000
# Variables and builds them again for its output in Python, on every step. On this CPU (2026-11-30,
# GR00T-N1.5's full state, 1,833 leaves) such a call held the host 9-14 ms against 2-3 ms for the
# same leaves in a list; on the H200 the step's call held it 58 ms of a 78 ms step. So the step is
# jitted over the leaves, its result is a FlatState, which the next call passes straight through,
# and the TrainState is built only when something reads it (a checkpoint, the end of a run).


@jax.tree_util.register_pytree_node_class
class FlatState:
  """A TrainState held as its leaves: attribute reads (`state.step`, `state.params`) build the
  TrainState once; `train_state(x)` gives it. As a pytree it has the TrainState's leaves, in order."""

  def __init__(self, leaves: list, tree: Any):
    self.leaves, self.tree = leaves, tree
    self._state = None

  def materialize(self) -> TrainState:
    if self._state is None:
      self._state = jax.tree.unflatten(self.tree, self.leaves)
    return self._state

  def __getattr__(self, name: str):
    if name.startswith("__") or name in ("leaves", "tree", "_state"):
      raise AttributeError(name)
    return getattr(self.materialize(), name)

  def tree_flatten(self):
    return self.leaves, self.tree

  @classmethod
  def tree_unflatten(cls, tree, leaves):
    return cls(list(leaves), tree)


def train_state(state: Any) -> Any:
  """The TrainState of a step's result (FlatState), or the state itself."""
  return state.materialize() if isinstance(state, FlatState) else state


def _leaves(state: Any, tree: Any) -> list:
  if isinstance(state, FlatState) and (state.tree is tree or state.tree == tree):
    return state.leaves
  leaves, given = jax.tree.flatten(train_state(state))
  if given != tree:
    raise ValueError(f"the train step was built for a state of structure {tree}, got {given}")
  return leaves


class _Delegating:
  """Reads what it does not define from the jax stage it wraps (as_text, cost_analysis, ...)."""

  def __init__(self, inner, tree):
    self._inner, self._tree = inner, tree

  def __getattr__(self, name: str):
    if name.startswith("__") or name in ("_inner", "_tree"):
      raise AttributeError(name)
    return getattr(self._inner, name)


class CompiledTrainStep(_Delegating):
  """The compiled step: (TrainState or FlatState, batch) -> (FlatState, metrics)."""

  def __call__(self, state, batch):
    leaves, metrics = self._inner(_leaves(state, self._tree), batch)
    return FlatState(leaves, self._tree), metrics


class LoweredTrainStep(_Delegating):
  def compile(self, compiler_options: dict | None = None) -> CompiledTrainStep:
    return CompiledTrainStep(self._inner.compile(compiler_options), self._tree)


class TrainStepFn(CompiledTrainStep):
  """jit_train_step's result: called like the compiled step, and lowered from a TrainState or its
  shapes (`lower(state, batch)`)."""

  def lower(self, state, batch) -> LoweredTrainStep:
    return LoweredTrainStep(self._inner.lower(_leaves(state, self._tree), batch), self._tree)

  def trace(self, state, batch):
    """The jax trace of the step on the state's leaves (what jax.export exports)."""
    return self._inner.trace(_leaves(state, self._tree), batch)
