"""Building blocks shared by every ejax model: dense layers, norms, MLPs, RoPE and attention.

Every parameter is created with logical axis names (ejax.parallel.axes) so that sharding comes
from the config's rules table; parameters live in `param_dtype` (float32 by default) and are cast
to the compute `dtype` at use. Attention always goes through `ejax.kernels.attention`, so packed
rows (segment ids, per-segment positions) and every mask kind behave the same in every model.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ejax.kernels.attention import attention
from ejax.kernels.fp8.frozen import FrozenKernel, frozen_dot
from ejax.parallel.axes import EMBED, HEAD_DIM, HEADS, KV_HEADS, MLP, NORM
from ejax.parallel.params import variable_axis_names

Initializer = Callable[..., jax.Array]
DEFAULT_KERNEL_INIT: Initializer = nnx.initializers.lecun_normal()
ZEROS: Initializer = nnx.initializers.zeros_init()
ONES: Initializer = nnx.initializers.ones_init()

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),   # HF "gelu_pytorch_tanh"
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
  if name not in ACTIVATIONS:
    raise ValueError(f"activation {name!r} is not one of {', '.join(ACTIVATIONS)}")
  return ACTIVATIONS[name]


_param_keys: "weakref.WeakKeyDictionary[nnx.Rngs, list]" = weakref.WeakKeyDictionary()


# jax.core's until jax 0.10; jax 0.11 moved it to jax.extend.core (which 0.9.2, ejax's pin, lacks).
_opaque_trace_state = (getattr(jax.extend.core, "get_opaque_trace_state", None)
                       or jax.core.get_opaque_trace_state)


def param_key(rngs: nnx.Rngs) -> jax.Array:
  """A fresh init key: one draw from `rngs.params` per trace, then fold_in with a counter.

  Drawing from the nnx stream for every parameter updates its counter variable under the trace,
  and each update costs time proportional to the trace so far (a failed `.sharding` lookup walks
  the whole jaxpr): `nnx.eval_shape` of the 2.4B GR00T took minutes. One draw per trace keeps
  init linear; keys stay distinct per parameter and deterministic for a given seed.
  """
  trace_state = _opaque_trace_state(convention="flax")
  entry = _param_keys.get(rngs)
  if entry is None or entry[0] != trace_state:
    entry = [trace_state, rngs.params(), 0]
    _param_keys[rngs] = entry
  entry[2] += 1
  return jax.random.fold_in(entry[1], entry[2])


@dataclasses.dataclass(frozen=True)
class DeferredInit:
  """How to make one parameter's value later: `init(key, shape, dtype)`, as make_param would have."""
  init: Initializer
  key: jax.Array
  shape: tuple[int, ...]
  dtype: Any


# While `deferred_init()` is active: id(nnx.Param) -> (the Param, its DeferredInit).
_deferred: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ejax_deferred_init", default=None)


@contextlib.contextmanager
def deferred_init():
  """Models built inside get shape-only parameters (jax.ShapeDtypeStruct values, no computation);
  yields a dict id(param) -> (param, DeferredInit) that says how to make each value.

  The keys are the ones make_param draws under a trace, so initialising every parameter from its
  DeferredInit gives the values of the traced init bit for bit (ejax/train/state.py makes them with
  one small program per distinct initializer and shape instead of one program for the whole model).
  """
  records: dict = {}
  token = _deferred.set(records)
  try:
    yield records
  finally:
    _deferred.reset(token)


def make_param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], names: Sequence[str | None],
               param_dtype=jnp.float32) -> nnx.Param:
  """An nnx.Param initialised by `init` and carrying one logical axis name per dimension."""
  if len(names) != len(shape):
    raise ValueError(f"parameter of shape {tuple(shape)} needs {len(shape)} axis names, got {tuple(names)}")
  records = _deferred.get()
  if records is not None:
    shape, dtype = tuple(int(n) for n in shape), jnp.dtype(param_dtype)
    param = nnx.Param(jax.ShapeDtypeStruct(shape, dtype), out_sharding=tuple(names))
    records[id(param)] = (param, DeferredInit(init, param_key(rngs), shape, dtype))
    return param
  return nnx.Param(init(param_key(rngs), tuple(shape), param_dtype), out_sharding=tuple(names))


def with_adapter(projection: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
  """y plus the projection's LoRA adapter on x, if ejax.models.lora attached one."""
  adapter = getattr(projection, "lora", None)
  return y if adapter is None else y + adapter(x.astype(y.dtype))


class Dense(nnx.Module):
  """y = x @ kernel [+ bias], kernel [in, out] named `axes`. Also the fallback for FP8 dense.

  A frozen kernel may come as a FrozenKernel (train.frozen_fp8: ejax.train.frozen_fp8 puts it in the
  kernel's place): then the matmul is one FP8 GEMM (ejax.kernels.fp8.frozen)."""

  FP8_CONTRACTED = 1  # the kernel's leading dimensions the matmul contracts (ejax.train.frozen_fp8)

  def __init__(self, in_features: int, out_features: int, *, axes: tuple[str, str], use_bias: bool = True,
               dtype=jnp.float32, param_dtype=jnp.float32, kernel_init: Initializer = DEFAULT_KERNEL_INIT,
               rngs: nnx.Rngs):
    self.dtype = dtype
    self.kernel = make_param(rngs, kernel_init, (in_features, out_features), axes, param_dtype)
    self.bias = make_param(rngs, ZEROS, (out_features,), (axes[1],), param_dtype) if use_bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    y = _matmul(x.astype(self.dtype), self.kernel, self.dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return with_adapter(self, x, y)


def _matmul(x: jax.Array, kernel: nnx.Variable, dtype) -> jax.Array:
  """x [..., in] @ the kernel with its contracted dimensions flattened into `in`, in `dtype`: an FP8
  GEMM where the kernel is a FrozenKernel, else a matmul in `dtype`."""
  value = kernel.get_value()
  if isinstance(value, FrozenKernel):
    return frozen_dot(x, value, dtype)
  return jnp.dot(x, value.reshape(x.shape[-1], -1).astype(dtype))


@jax.custom_vjp
def materialize_cotangent(x: jax.Array) -> jax.Array:
  """Identity whose backward writes its incoming gradient out in full (an optimization barrier).

  A norm's input is the residual stream. Left alone, XLA fuses the residual gradient's running sum
  (every later layer's norm backward added up) into each consumer, among them the transposed copy
  that feeds a weight-gradient dot, so each consumer recomputes the whole chain of later layers:
  work that grows with depth squared. On XLA:CPU those fusions took ~19 % of a packed training step
  of benchmarks/packing.py (3 layers); with the gradient materialised once per norm the packed step
  ran 22-35 % faster and the padded one no slower (2026-11-21, 2-core CPU). The forward is untouched.
  """
  return x


materialize_cotangent.defvjp(lambda x: (x, None), lambda _, g: (jax.lax.optimization_barrier(g),))


class LayerNorm(nnx.Module):
  """LayerNorm in fp32; `elementwise_affine=False` gives the parameter-free norm the DiT uses."""

  def __init__(self, dim: int, *, eps: float = 1e-5, elementwise_affine: bool = True, use_bias: bool = True,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.eps = eps
    self.dtype = dtype
    self.scale = make_param(rngs, ONES, (dim,), (NORM,), param_dtype) if elementwise_affine else None
    self.bias = make_param(rngs, ZEROS, (dim,), (NORM,), param_dtype) if elementwise_affine and use_bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = materialize_cotangent(x).astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
    if self.scale is not None:
      y = y * self.scale[...].astype(jnp.float32)
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm in fp32. Qwen/Llama: y * w (w init 1); Gemma: y * (1 + w) (w init 0), set
  `zero_centered=True`."""

  def __init__(self, dim: int, *, eps: float = 1e-6, zero_centered: bool = False, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.eps = eps
    self.zero_centered = zero_centered
    self.dtype = dtype
    self.scale = make_param(rngs, ZEROS if zero_centered else ONES, (dim,), (NORM,), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = materialize_cotangent(x).astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    y = y * (1.0 + scale if self.zero_centered else scale)
    return y.astype(self.dtype)


class MLP(nnx.Module):
  """fc1 -> activation -> fc2 (ViT / DiT feed-forward)."""

  FP8_INPUT_PROJECTIONS = ("fc1",)  # the projections that read the module's input (ejax.train.frozen_fp8)

  def __init__(self, dim: int, hidden: int, *, act: str = "gelu_tanh", use_bias: bool = True,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, dense_factory=None):
    make = dense_factory or Dense
    self.act = act
    self.fc1 = make(dim, hidden, axes=(EMBED, MLP), use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.fc2 = make(hidden, dim, axes=(MLP, EMBED), use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(activation(self.act)(self.fc1(x)))


class GatedMLP(nnx.Module):
  """down(act(gate(x)) * up(x)): SwiGLU (Qwen, act="silu") or GeGLU (Gemma, act="gelu_tanh")."""

  FP8_INPUT_PROJECTIONS = ("gate_proj", "up_proj")

  def __init__(self, dim: int, hidden: int, *, act: str = "silu", dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.act = act
    self.gate_proj = Dense(dim, hidden, axes=(EMBED, MLP), use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.up_proj = Dense(dim, hidden, axes=(EMBED, MLP), use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.down_proj = Dense(hidden, dim, axes=(MLP, EMBED), use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))


def apply_rope(x: jax.Array, positions: jax.Array, *, theta: float) -> jax.Array:
  """Rotary embedding, "rotate half" layout (HF Llama/Qwen, openpi Gemma).

  x [batch, len, heads, head_dim]; positions [batch, len] (per-segment in packed rows). Computed in
  fp32 because bf16 angles lose whole turns at long positions. The halves (x1, x2) become
  (x1 cos - x2 sin, x2 cos + x1 sin), written with a flip and a sign over a [.., 2, half] view, which
  are element-wise: XLA fuses them with the QK-norm before, where slices joined by a concatenate made
  a fusion of their own that read the norm's output back in fp32 (GR00T's step on the compile-only
  H100: 87.59 -> 87.15 ms, 2026-11-29; the same values as the concatenate, to the bit, in fp32).
  """
  head_dim = x.shape[-1]
  half = head_dim // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq       # [batch, len, half]
  cos = jnp.cos(angles)[:, :, None, None, :]   # [batch, len, heads, (x1, x2), half]
  sin = jnp.sin(angles)[:, :, None, None, :]
  halves = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, half)
  sign = jnp.asarray([-1.0, 1.0], jnp.float32)[:, None]
  out = halves * cos + jnp.flip(halves, -2) * sign * sin
  return out.reshape(x.shape).astype(x.dtype)


class HeadProjection(nnx.Module):
  """x [..., in] -> [..., heads, head_dim] with kernel [in, heads, head_dim] (or a FrozenKernel, as Dense)."""

  FP8_CONTRACTED = 1

  def __init__(self, in_features: int, num_heads: int, head_dim: int, *, heads_axis: str = HEADS,
               use_bias: bool = False, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.dtype, self.num_heads, self.head_dim = dtype, num_heads, head_dim
    init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
    self.kernel = make_param(rngs, init, (in_features, num_heads, head_dim), (EMBED, heads_axis, HEAD_DIM), param_dtype)
    self.bias = (make_param(rngs, ZEROS, (num_heads, head_dim), (heads_axis, HEAD_DIM), param_dtype)
                 if use_bias else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    # A 2-D matmul and a vector bias (the same numbers as the [in, heads, head_dim] einsum): XLA:GPU
    # then adds the bias in the cuBLAS call's epilogue instead of in a pass of its own.
    heads, head_dim = self.num_heads, self.head_dim
    y = _matmul(x.astype(self.dtype), self.kernel, self.dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype).reshape(heads * head_dim)
    return with_adapter(self, x, y.reshape(y.shape[:-1] + (heads, head_dim)))


class OutputProjection(nnx.Module):
  """[..., heads, head_dim] -> [..., out] with kernel [heads, head_dim, out] (or a FrozenKernel, as Dense)."""

  FP8_CONTRACTED = 2

  def __init__(self, num_heads: int, head_dim: int, out_features: int, *, use_bias: bool = False,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.dtype = dtype
    init = nnx.initializers.lecun_normal(in_axis=(0, 1), out_axis=2)
    self.kernel = make_param(rngs, init, (num_heads, head_dim, out_features), (HEADS, HEAD_DIM, EMBED), param_dtype)
    self.bias = make_param(rngs, ZEROS, (out_features,), (EMBED,), param_dtype) if use_bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    y = _matmul(x.astype(self.dtype).reshape(*x.shape[:-2], -1), self.kernel, self.dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return with_adapter(self, x, y)


class Attention(nnx.Module):
  """Multi-head attention (GQA/MQA, optional QK-norm, RoPE, cross-attention) over ejax's one op.

  `kv_features` != `features` makes it a cross-attention whose keys/values come from another
  stream (the DiT attending to VL tokens). The projections are separate sub-modules
  (`q_proj`, `k_proj`, `v_proj`, `o_proj`) so a mixture-of-transformers can project each expert's
  tokens with its own weights and run one joint attention (see `project_qkv` / `attend`).
  """

  # As a self-attention (kv is x): q, k and v read the module's input, and o_proj reads a convex
  # combination of v_proj's outputs (ejax.train.frozen_fp8 bounds the inputs of frozen FP8 GEMMs so).
  FP8_INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
  FP8_VALUE_PROJECTIONS = ("v_proj", "o_proj")

  def __init__(self, features: int, *, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
               kv_features: int | None = None, use_bias: bool = False, out_bias: bool | None = None,
               qk_norm: bool = False, norm_eps: float = 1e-6, rope_theta: float | None = None,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    num_kv_heads = num_kv_heads or num_heads
    head_dim = head_dim or features // num_heads
    kv_features = kv_features or features
    out_bias = use_bias if out_bias is None else out_bias
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.rope_theta = rope_theta
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_proj = HeadProjection(features, num_heads, head_dim, use_bias=use_bias, **common)
    self.k_proj = HeadProjection(kv_features, num_kv_heads, head_dim, heads_axis=KV_HEADS, use_bias=use_bias, **common)
    self.v_proj = HeadProjection(kv_features, num_kv_heads, head_dim, heads_axis=KV_HEADS, use_bias=use_bias, **common)
    self.o_proj = OutputProjection(num_heads, head_dim, features, use_bias=out_bias, **common)
    self.q_norm = RMSNorm(head_dim, eps=norm_eps, **common) if qk_norm else None
    self.k_norm = RMSNorm(head_dim, eps=norm_eps, **common) if qk_norm else None

  def project_qkv(self, x: jax.Array, kv: jax.Array, *, q_positions=None, kv_positions=None):
    """q [b, lq, heads, hd], k/v [b, lk, kv_heads, hd] with QK-norm and RoPE applied."""
    k_in = v_in = kv
    if self.q_proj.bias is not None and kv is x and not isinstance(self.q_proj.kernel.get_value(), FrozenKernel):
      # XLA merges matmuls that share an input into one (its DotMerger), whose output then needs a
      # pass of its own to add the biases and split q, k and v: kept apart, each adds its bias in its
      # cuBLAS epilogue and feeds the attention as it is (ViT self-attention: ~1 ms of GR00T's H200 step).
      # FP8 frozen kernels keep their GEMMs apart themselves, after the input's one quantisation (frozen_dot).
      k_in, v_in = jax.lax.optimization_barrier((kv, kv))
    q, k, v = self.q_proj(x), self.k_proj(k_in), self.v_proj(v_in)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    if self.rope_theta is not None:
      if q_positions is None or kv_positions is None:
        raise ValueError("this attention uses RoPE: pass q_positions and kv_positions")
      q = apply_rope(q, q_positions, theta=self.rope_theta)
      k = apply_rope(k, kv_positions, theta=self.rope_theta)
    return q, k, v

  def __call__(self, x: jax.Array, kv: jax.Array | None = None, *, mask_kind: str = "bidirectional",
               q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
               q_block_ids=None, kv_block_ids=None) -> jax.Array:
    """x [b, lq, features]; kv [b, lk, kv_features] (None: self-attention on x)."""
    self_attention = kv is None
    kv = x if self_attention else kv
    if self_attention:
      kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
      kv_positions = q_positions if kv_positions is None else kv_positions
      kv_block_ids = q_block_ids if kv_block_ids is None else kv_block_ids
    q, k, v = self.project_qkv(x, kv, q_positions=q_positions, kv_positions=kv_positions)
    out = attention(q, k, v, mask_kind=mask_kind, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                    q_positions=q_positions, kv_positions=kv_positions, q_block_ids=q_block_ids,
                    kv_block_ids=kv_block_ids)
    return self.o_proj(out)


# Dropout draws 8 bits an element, four elements from each 32-bit draw, as FlashAttention's dropout
# compares 8-bit draws: the rate is rounded to a multiple of 1/256 (GR00T's 0.2 -> 51/256 = 0.1992)
# and the kept values are scaled by the rounded rate's 1 / (1 - rate), so the expectation is exact.
# jax.random.bernoulli hashes every element with Threefry-2x32 (~85 integer instructions): GR00T's
# full-size step drops ~660M elements, ~3.5 ms of ALU work on an H100 by that count, where XLA:GPU
# fuses the draws into the dropout's own pass. Here it hashes a quarter as often; the draws are one
# fusion of their own writing a byte an element that the dropout's pass reads (tests/models/
# test_layers.py: the rate, independence of a word's four bytes, the same mask on a sharded mesh).
DROPOUT_DRAWS_PER_WORD = 4


def _dropped_draws(rate: float) -> int:
  """How many of the 256 values of an 8-bit draw drop an element: `rate` rounded, 1 to 255."""
  return min(max(round(rate * 256), 1), 255)


def dropout_rate(rate: float) -> float:
  """The rate dropout applies for `rate`: rounded to a multiple of 1/256, at least 1/256."""
  return _dropped_draws(rate) / 256


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
  """Inverted dropout at dropout_rate(rate); a no-op when `rng` is None (evaluation, sampling) or rate is 0.
  A last dimension that is not a multiple of 4 takes one jax.random.bernoulli draw an element at `rate`."""
  if rng is None or rate == 0.0:
    return x
  if x.ndim == 0 or x.shape[-1] % DROPOUT_DRAWS_PER_WORD:
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)
  threshold = _dropped_draws(rate)
  words = jax.random.bits(rng, x.shape[:-1] + (x.shape[-1] // DROPOUT_DRAWS_PER_WORD,), jnp.uint32)
  draws = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(x.shape)  # word i -> elements 4i .. 4i+3
  return jnp.where(draws >= threshold, x / (1.0 - threshold / 256), 0.0).astype(x.dtype)


def host_random_init(abstract_module: nnx.Module, seed: int = 0, *, stddev: float = 0.02) -> nnx.Module:
  """Materialises an `nnx.eval_shape` module on the host with numpy values: N(0, stddev) for
  weights, ones for norm scales, zeros for biases and norm offsets.

  One jitted init of a transformer compiles a random-number program per parameter shape, which
  dominates small tests on CPU; weight import overwrites every value anyway. Variables that are
  not nnx.Param keep their (abstract) zeros.
  """
  rng = np.random.default_rng(seed)
  graphdef, state = nnx.split(abstract_module)

  def fill(path, variable):
    value = variable.get_value()
    if not isinstance(variable, nnx.Param):
      return variable.replace(jnp.zeros(value.shape, value.dtype))
    names = variable_axis_names(variable)
    leaf = str(getattr(path[-1], "key", path[-1]))
    if names is not None and all(n == NORM for n in names):
      array = np.ones(value.shape) if leaf == "scale" else np.zeros(value.shape)
    elif leaf == "bias":
      array = np.zeros(value.shape)
    else:
      array = rng.normal(0.0, stddev, value.shape)
    return variable.replace(jnp.asarray(array, value.dtype))

  return nnx.merge(graphdef, nnx.map_state(fill, state))


def run_block(block: nnx.Module, *args, remat: str = "none", **kwargs):
  """block(*args, **kwargs), rematerialised per config.model.remat (none | full | dots | ...):
  activations inside the block are recomputed in the backward pass instead of stored.

  The block is closed over rather than passed through nnx.remat: nnx.remat splits and merges the
  module, which fails inside a sampling loop (lax.fori_loop) that reads it from an outer trace.
  Blocks run in a Python loop, not a scan, so the recomputation keeps jax.checkpoint's guard against
  common-subexpression elimination: without it XLA merged each recomputed forward with the stored
  one and kept every block's activations (pi0.5's trained SigLIP: 27 blocks of MLP activations).
  """
  if remat == "none":
    return block(*args, **kwargs)
  from ejax.parallel import remat_policy
  return jax.checkpoint(lambda *a: block(*a, **kwargs), policy=remat_policy(remat))(*args)


# Fewer repeats than this run as a loop: at CPU sizes (two blocks) the scan's weight stacking and loop
# cost more per step than the compile it saves (GR00T runlocal: 47 vs 34 ms a step on 2 cores).
MIN_SCANNED = 4


class StackedBlocks(NamedTuple):
  """A block list's weights stacked for run_blocks' scan: per kind (period), its graphdef and its
  blocks' states stacked on a leading [n // period] axis."""
  graphdefs: tuple
  stacks: tuple
  period: int


def stack_blocks(blocks: Sequence[nnx.Module], *, scan: bool = True, period: int = 1) -> StackedBlocks | None:
  """The stacked weights run_blocks scans over, or None where it runs the blocks as a loop (scan off,
  fewer than MIN_SCANNED repeats, or a count that is not a whole number of periods)."""
  n = len(blocks)
  if not scan or n < MIN_SCANNED * period or n % period:
    return None
  graphdefs, stacks = [], []
  for j in range(period):
    split = [nnx.split(blocks[i]) for i in range(j, n, period)]
    graphdefs.append(split[0][0])
    stacks.append(jax.tree.map(lambda *leaves: jnp.stack(leaves), *[state for _, state in split]))
  return StackedBlocks(tuple(graphdefs), tuple(stacks), period)


def run_blocks(blocks: Sequence[nnx.Module], x: jax.Array, *args, remat: str = "none", scan: bool = True,
               period: int = 1, rng: jax.Array | None = None, stacked: StackedBlocks | None = None,
               **kwargs) -> jax.Array:
  """x through every block in order, each as run_block(block, x, *args, **kwargs, rng=...).

  With `scan` and at least MIN_SCANNED repeats, blocks that repeat (block i and i + period share one
  structure: `period=2` for the DiT's alternating cross- and self-attention blocks) run as one
  lax.scan over their weights stacked on a leading axis (stack_blocks), so the train step traces and
  compiles one block per kind instead of every block; the parameters keep their per-layer layout
  (checkpoints and weight import are unchanged) and the stacking is a copy made once per call.
  A caller that runs the blocks many times on the same weights (a sampling loop) passes `stacked`,
  made once outside its loop: XLA:CPU hoists a stacking made inside a lax.fori_loop out of it, but
  XLA:GPU (jaxlib 0.9.2, a compile-only H100) does not and would copy the weights every denoising
  step (BENCHMARKS.md). Block i's dropout key is fold_in(rng, i) either way, so both paths compute the
  same numbers.
  """
  n = len(blocks)

  def call(block, h, index):
    block_rng = None if rng is None else jax.random.fold_in(rng, index)
    extra = {} if rng is None else {"rng": block_rng}
    return run_block(block, h, *args, remat=remat, **kwargs, **extra)

  if stacked is None:
    stacked = stack_blocks(blocks, scan=scan, period=period)
  if stacked is None:
    for i, block in enumerate(blocks):
      x = call(block, x, i)
    return x
  if stacked.period != period:
    raise ValueError(f"stacked blocks have period {stacked.period}, the call asks for {period}")

  def body(h, xs):
    states, step = xs
    for j in range(period):
      h = call(nnx.merge(stacked.graphdefs[j], states[j]), h, step * period + j)
    return h, None

  x, _ = jax.lax.scan(body, x, (stacked.stacks, jnp.arange(n // period)))
  return x
