"""Gemma decoder (MQA, head_dim 256, (1 + scale) RMSNorm, GeGLU, RoPE) and its mixture of experts.

pi0.5 runs two Gemma decoders side by side: the PaliGemma LLM (Gemma-2B) on the prefix and the
action expert (Gemma-300M) on the suffix. They have their own projections, MLPs and norms but share
ONE attention per layer over the concatenated q/k/v of both ("mixture of transformers"). So this
module keeps a decoder's weights (`GemmaDecoder`) apart from the function that runs one or more of
them jointly (`run_mixture`); a plain single-stream Gemma is the mixture of one.

Weights are stacked over layers ([depth, ...], logical axis LAYERS) in the einsum layouts of the
released big_vision/openpi checkpoints, so the layer loop is one `lax.scan` (compile time does not
grow with depth) and import/export is a rename.

Einsum letters: B batch, T query length, S key length, N query heads, K kv heads, D width,
H head dim, F MLP width, C conditioning width.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ejax.kernels.attention import attention, block_ids_from_ar_flags  # noqa: F401  (re-exported for callers)
from ejax.kernels.fp8.dense import DELAYED_IMPLS, Fp8History, fp8_matmul_trained
from ejax.kernels.fp8.xla import new_history, prime_kernel_history
from ejax.models.layers import apply_rope, make_param
from ejax.parallel import axes as ax
from ejax.parallel import constrain, remat_policy

PALIGEMMA_VOCAB_SIZE = 257_152
RMS_EPS = 1e-6
ROPE_MAX_WAVELENGTH = 10_000


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  width: int
  depth: int
  mlp_dim: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int = 0        # 0: no token embedder (the action expert reads continuous tokens)
  adarms_cond_dim: int = 0   # > 0: adaptive RMSNorm conditioned on a vector of this width

  def replace(self, **changes) -> "GemmaConfig":
    return dataclasses.replace(self, **changes)


# Published sizes (openpi gemma.py "gemma_2b" / "gemma_300m"; Gemma-2B is PaliGemma-3B's LLM).
GEMMA_2B = GemmaConfig(width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1,
                       head_dim=256, vocab_size=PALIGEMMA_VOCAB_SIZE)
GEMMA_300M = GemmaConfig(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1,
                         head_dim=256)


def _init(in_axis, out_axis, batch_axis=()):
  # The layer axis (0) is a batch axis: every layer gets lecun-normal fan-in of its own slice.
  return jax.nn.initializers.lecun_normal(in_axis=in_axis, out_axis=out_axis, batch_axis=(0, *batch_axis))


def _param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
  return make_param(rngs, init, shape, names, dtype)


class StackedRMSNorm(nnx.Module):
  """Gemma RMSNorm per layer: x / rms(x) * (1 + scale); scale starts at 0 (identity)."""

  def __init__(self, depth: int, width: int, *, dtype=jnp.float32):
    shape = (depth, width) if depth else (width,)
    names = (ax.LAYERS, ax.NORM) if depth else (ax.NORM,)
    self.scale = nnx.Param(jnp.zeros(shape, dtype), out_sharding=names)


class StackedAdaRMSNorm(nnx.Module):
  """pi0.5's adaptive RMSNorm: a zero-initialised Dense(cond) gives scale, shift and gate.

  Zero init makes a fresh expert start as a plain RMSNorm with the residual branches closed
  (gate 0), the same start the published model had.
  """

  def __init__(self, depth: int, width: int, cond_dim: int, *, dtype=jnp.float32):
    lead = (depth,) if depth else ()
    lead_names = (ax.LAYERS,) if depth else ()
    self.kernel = nnx.Param(jnp.zeros(lead + (cond_dim, 3 * width), dtype),
                            out_sharding=lead_names + (ax.EMBED, ax.MLP))
    self.bias = nnx.Param(jnp.zeros(lead + (3 * width,), dtype), out_sharding=lead_names + (ax.NORM,))


def _norm(depth: int, config: GemmaConfig, dtype):
  if config.adarms_cond_dim:
    return StackedAdaRMSNorm(depth, config.width, config.adarms_cond_dim, dtype=dtype)
  return StackedRMSNorm(depth, config.width, dtype=dtype)


class GemmaLayers(nnx.Module):
  """All layers of one decoder, stacked on a leading [depth] axis (openpi's scanned layout)."""

  def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    c = config
    L = c.depth  # noqa: N806
    self.pre_attention_norm = _norm(L, c, param_dtype)
    self.q_einsum = _param(rngs, _init(-2, -1, (1,)), (L, c.num_heads, c.width, c.head_dim),
                           (ax.LAYERS, ax.HEADS, ax.EMBED, ax.HEAD_DIM), param_dtype)
    self.kv_einsum = _param(rngs, _init(-2, -1, (1, 2)), (L, 2, c.num_kv_heads, c.width, c.head_dim),
                            (ax.LAYERS, None, ax.KV_HEADS, ax.EMBED, ax.HEAD_DIM), param_dtype)
    self.attn_vec_einsum = _param(rngs, _init((-3, -2), -1), (L, c.num_heads, c.head_dim, c.width),
                                  (ax.LAYERS, ax.HEADS, ax.HEAD_DIM, ax.EMBED), param_dtype)
    self.pre_ffw_norm = _norm(L, c, param_dtype)
    self.gating_einsum = _param(rngs, _init(-2, -1, (1,)), (L, 2, c.width, c.mlp_dim),
                                (ax.LAYERS, None, ax.EMBED, ax.MLP), param_dtype)
    self.linear = _param(rngs, _init(-2, -1), (L, c.mlp_dim, c.width),
                         (ax.LAYERS, ax.MLP, ax.EMBED), param_dtype)


  def prime_fp8_history(self) -> None:
    """Records each feed-forward kernel's amax, per layer, in its empty history (add_fp8_history;
    ejax.kernels.fp8.xla.prime_kernel_history)."""
    gating = jnp.abs(self.gating_einsum[...].astype(jnp.float32))  # [L, 2 (gate, up), D, F]
    amaxes = jnp.stack([gating[:, 0].max(axis=(1, 2)), gating[:, 1].max(axis=(1, 2)),
                        jnp.abs(self.linear[...].astype(jnp.float32)).max(axis=(1, 2))], axis=1)
    self.fp8_history[...] = prime_kernel_history(self.fp8_history[...], amaxes)  # [L, sites, ...]


def add_fp8_history(decoder: "GemmaDecoder") -> None:
  """Gives the decoder's feed-forward the amax histories of delayed-scaling FP8 (DELAYED_IMPLS): one
  per GEMM (FEED_FORWARD_FP8_SITES) a layer, stacked like the weights."""
  shape = new_history(decoder.config.depth, len(FEED_FORWARD_FP8_SITES))
  decoder.layers.fp8_history = Fp8History(shape, out_sharding=(ax.LAYERS, None, None, None))


# Adapter weight shapes per einsum weight, as openpi's lora.Einsum / lora.FeedForward make them
# (LoRA axes (-2, -1): a replaces the output axis with the rank, b the input axis).
_LORA_TARGETS = {"q_einsum": "attn", "kv_einsum": "attn", "attn_vec_einsum": "attn",
                 "gating_einsum": "ffn", "linear": "ffn"}
# weight, its adapter a and b, and the adapter's delta (layer axis L, rank r), as einsum specs.
_LORA_DELTAS = {"q_einsum": "LNDr,LNrH->LNDH", "kv_einsum": "LCKDr,LCKrH->LCKDH",
                "attn_vec_einsum": "LNHr,LMrD->LNHD",  # openpi's b sums over heads (its einsum rewrite)
                "gating_einsum": "LCDr,LCrF->LCDF", "linear": "LFr,LrD->LFD"}


class GemmaLoRA(nnx.Module):
  """LoRA adapters of one decoder's stacked layers (see ejax.models.lora), openpi's shapes:
  `<weight>_a` has the weight's shape with its output axis replaced by the rank, `<weight>_b` with
  its input axis replaced."""

  def __init__(self, config: GemmaConfig, lora, a_init, b_init, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.scale = lora.scale
    self.targets = tuple(lora.targets)
    c, r, L = config, lora.rank, config.depth  # noqa: N806
    shapes = {"q_einsum": ((L, c.num_heads, c.width, c.head_dim), (ax.LAYERS, ax.HEADS, ax.EMBED, ax.HEAD_DIM)),
              "kv_einsum": ((L, 2, c.num_kv_heads, c.width, c.head_dim),
                            (ax.LAYERS, None, ax.KV_HEADS, ax.EMBED, ax.HEAD_DIM)),
              "attn_vec_einsum": ((L, c.num_heads, c.head_dim, c.width), (ax.LAYERS, ax.HEADS, ax.HEAD_DIM, ax.EMBED)),
              "gating_einsum": ((L, 2, c.width, c.mlp_dim), (ax.LAYERS, None, ax.EMBED, ax.MLP)),
              "linear": ((L, c.mlp_dim, c.width), (ax.LAYERS, ax.MLP, ax.EMBED))}
    for name, (shape, names) in shapes.items():
      if _LORA_TARGETS[name] not in self.targets:
        continue
      a_shape, b_shape = shape[:-1] + (r,), shape[:-2] + (r,) + shape[-1:]
      a_names, b_names = names[:-1] + (None,), names[:-2] + (None,) + names[-1:]
      setattr(self, f"{name}_a", _param(rngs, a_init, a_shape, a_names, param_dtype))
      setattr(self, f"{name}_b", _param(rngs, b_init, b_shape, b_names, param_dtype))

  def names(self) -> list[str]:
    return [name for name in _LORA_DELTAS if _LORA_TARGETS[name] in self.targets]

  def deltas(self) -> dict[str, jax.Array]:
    """{weight name: the change merging this adapter makes to it}."""
    return {name: jnp.einsum(_LORA_DELTAS[name], getattr(self, f"{name}_a")[...], getattr(self, f"{name}_b")[...])
            * self.scale for name in self.names()}


class GemmaDecoder(nnx.Module):
  """One Gemma decoder's weights: optional token embedder, stacked layers, final norm."""

  def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    self.config = config
    if config.vocab_size:
      self.embedder = _param(rngs, jax.nn.initializers.normal(0.01), (config.vocab_size, config.width),
                             (ax.VOCAB, ax.EMBED), param_dtype)
    else:
      self.embedder = None
    self.layers = GemmaLayers(config, rngs=rngs, param_dtype=param_dtype)
    self.final_norm = _norm(0, config, param_dtype)

  def embed(self, tokens: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Token ids [B, T] -> [B, T, D], scaled by sqrt(width) as Gemma does."""
    if self.embedder is None:
      raise ValueError("this Gemma decoder has vocab_size=0 and no token embedder; feed embeddings")
    table = self.embedder[...].astype(dtype)
    return table[tokens] * jnp.sqrt(float(self.config.width)).astype(dtype)


# ----------------------------------------------------------------------------------------------
# Pure layer math (on one layer's slice of the stacked weights).


def rms_normalize(x: jax.Array) -> jax.Array:
  """x / rms(x) computed in fp32 (returned in fp32)."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + RMS_EPS)


def apply_norm(norm: dict, x: jax.Array, cond: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
  """Plain or adaptive RMSNorm on [B, T, D]; returns (normed in x.dtype, gate or None).

  `norm` holds {"scale"} or {"kernel", "bias"}. `cond` is [B, C] (one condition per row) or
  [B, G, C] with T a multiple of G: G groups of T // G consecutive tokens, one condition each (the
  packed suffix: one condition per sample's action chunk). The modulation is computed per group,
  not per token, so packing costs no extra matmul work.
  """
  normed = rms_normalize(x)
  if "scale" in norm:
    return (normed * (1.0 + norm["scale"].astype(jnp.float32))).astype(x.dtype), None
  if cond is None:
    raise ValueError("an adaptive RMSNorm needs a conditioning vector (adarms cond) and got None")
  if cond.ndim == 2:
    cond = cond[:, None, :]
  groups, tokens = cond.shape[1], x.shape[1]
  if tokens % groups:
    raise ValueError(f"adaRMSNorm: {tokens} tokens do not split into {groups} condition groups")
  modulation = jnp.dot(cond.astype(x.dtype), norm["kernel"].astype(x.dtype)) + norm["bias"].astype(x.dtype)
  modulation = jnp.repeat(modulation.astype(jnp.float32), tokens // groups, axis=1)  # [B, T, 3D]
  scale, shift, gate = jnp.split(modulation, 3, axis=-1)
  return (normed * (1.0 + scale) + shift).astype(x.dtype), gate.astype(x.dtype)


def gated_residual(x: jax.Array, y: jax.Array, gate: jax.Array | None) -> jax.Array:
  return x + y if gate is None else x + y * gate


def project(layer: dict, name: str, equation: str, x: jax.Array, index: int | None = None,
            fp8: str | None = None, history: jax.Array | None = None) -> jax.Array:
  """einsum(equation, x, layer[name]) plus the layer's LoRA adapter of that weight, if any (openpi's
  lora.Einsum: the rank axis "L" replaces the weight's output axis in a, its input axis in b).

  fp8: an ejax.kernels.fp8 impl: the weight's matmul (a 2-D weight, the feed-forward's) runs as FP8
  GEMMs forward and backward (the adapter's stays in x.dtype); history: its amax history
  (the delayed-scaling impls, DELAYED_IMPLS)."""
  weight = layer[name] if index is None else layer[name][index]
  if fp8:
    if weight.ndim != 2:
      raise ValueError(f"FP8 projections take a 2-D weight; {name} is {weight.shape}")
    y = fp8_matmul_trained(x.reshape(-1, x.shape[-1]), weight.astype(x.dtype), fp8, x.dtype, history)
    y = y.reshape(*x.shape[:-1], weight.shape[-1])
  else:
    y = jnp.einsum(equation, x, weight.astype(x.dtype))
  lora = layer.get("lora", {})
  if f"{name}_a" not in lora:
    return y
  a, b = lora[f"{name}_a"], lora[f"{name}_b"]
  if index is not None:
    a, b = a[index], b[index]
  inputs, out = equation.split("->")
  lhs, rhs = inputs.split(",")
  a_rhs, a_out = rhs.replace(rhs[-1], "L"), out.replace(rhs[-1], "L")
  low = jnp.einsum(f"{lhs},{a_rhs}->{a_out}", x, a.astype(x.dtype))
  delta = jnp.einsum(f"{a_out},{rhs.replace(rhs[-2], 'L')}->{out}", low, b.astype(x.dtype))
  return y + delta * layer["lora_scale"].astype(x.dtype)


# The feed-forward's FP8 GEMMs, in the order of their amax histories (FEED_FORWARD_FP8_SITES x
# ejax.kernels.fp8.xla.new_history() a layer, "fp8_history" in layer_weights).
FEED_FORWARD_FP8_SITES = ("gate", "up", "down")


def feed_forward(layer: dict, x: jax.Array, fp8: str | None = None) -> jax.Array:
  """GeGLU: gelu_tanh(x W_gate) * (x W_up), then W_down; fp8: its three GEMMs' FP8 impl (project)."""
  history = layer.get("fp8_history") if fp8 in DELAYED_IMPLS else None
  gate_h, up_h, down_h = (None,) * len(FEED_FORWARD_FP8_SITES) if history is None else history
  gate = project(layer, "gating_einsum", "BTD,DF->BTF", x, 0, fp8, gate_h)
  hidden = jax.nn.gelu(gate, approximate=True) * project(layer, "gating_einsum", "BTD,DF->BTF", x, 1, fp8, up_h)
  hidden = constrain(hidden, (ax.ACT_BATCH, ax.ACT_LEN, ax.ACT_MLP))
  return project(layer, "linear", "BTF,FD->BTD", hidden, None, fp8, down_h)


# ----------------------------------------------------------------------------------------------
# Running decoders jointly.


@dataclasses.dataclass
class Stream:
  """The tokens one expert runs on: x [B, T, D] with per-token positions, segment and block ids.

  segment ids: 0 = padding (attends to nothing, is seen by nothing); block ids: the running sum
  of per-token "autoregressive" flags (`block_ids_from_ar_flags`); a token sees keys of its own
  segment whose block id is <= its own. cond: [B, C] or [B, G, C] (see `apply_norm`) for an
  adaRMSNorm expert.
  """
  x: jax.Array
  positions: jax.Array
  segment_ids: jax.Array
  block_ids: jax.Array
  cond: jax.Array | None = None


@dataclasses.dataclass
class KVCache:
  """Keys and values of tokens already run, for every layer: k, v [L, B, S, K, H]."""
  k: jax.Array
  v: jax.Array
  segment_ids: jax.Array  # [B, S]
  block_ids: jax.Array    # [B, S]


def layer_weights(decoder: GemmaDecoder, dtype) -> dict:
  """The stacked layer weights of one decoder as a dict of arrays (scanned over axis 0), cast to the
  compute dtype. A sampling loop makes them once and passes them to run_mixture's every call: XLA:GPU
  (a compile-only H100, jaxlib 0.9.2) leaves the cast inside a fori_loop, once a denoising step."""
  layers = decoder.layers
  weights = {name: getattr(layers, name)[...].astype(dtype)
             for name in ("q_einsum", "kv_einsum", "attn_vec_einsum", "gating_einsum", "linear")}
  history = getattr(layers, "fp8_history", None)
  if history is not None:  # delayed-scaling FP8 feed-forward: [depth, sites, 3, history], not cast
    weights["fp8_history"] = history[...]
  lora = getattr(layers, "lora", None)
  if lora is not None:
    weights["lora"] = {f"{name}_{part}": getattr(lora, f"{name}_{part}")[...].astype(dtype)
                       for name in lora.names() for part in "ab"}
    weights["lora_scale"] = jnp.full((decoder.config.depth,), lora.scale, dtype)  # scanned with the layers
  for norm_name in ("pre_attention_norm", "pre_ffw_norm"):
    norm = getattr(layers, norm_name)
    weights[norm_name] = ({"scale": norm.scale[...]} if isinstance(norm, StackedRMSNorm)
                          else {"kernel": norm.kernel[...], "bias": norm.bias[...]})
  return weights


def _final_norm_weights(decoder: GemmaDecoder) -> dict:
  norm = decoder.final_norm
  if isinstance(norm, StackedRMSNorm):
    return {"scale": norm.scale[...]}
  return {"kernel": norm.kernel[...], "bias": norm.bias[...]}


def run_mixture(
    decoders: Sequence[GemmaDecoder],
    streams: Sequence[Stream | None],
    *,
    kv_cache: KVCache | None = None,
    return_kv_cache: bool = False,
    dtype=jnp.float32,
    remat: str = "none",
    attention_impl: str = "auto",
    weights: Sequence[dict | None] | None = None,
    fp8: Sequence[str | None] | None = None,
) -> tuple[list[jax.Array | None], KVCache | None]:
  """Runs decoders jointly: per layer each stream uses its own decoder's weights, then ONE attention
  over all streams' q/k/v (plus the cached keys/values of earlier calls).

  A None stream skips that decoder (its weights are not touched). Returns the final-normed outputs
  per stream and, when asked, the KV cache of this call's tokens (cache ones first). `weights[i]`, where
  given, is decoder i's layer_weights made by the caller (once, outside its sampling loop). `fp8[i]`,
  where given and not None, runs decoder i's feed-forward GEMMs in FP8 with that ejax.kernels.fp8 impl.
  """
  if len(decoders) != len(streams):
    raise ValueError(f"run_mixture got {len(decoders)} decoders but {len(streams)} streams")
  active = [i for i, s in enumerate(streams) if s is not None]
  if not active:
    raise ValueError("run_mixture needs at least one stream")
  head_shapes = {(d.config.num_heads, d.config.num_kv_heads, d.config.head_dim) for d in decoders}
  if len(head_shapes) != 1:
    raise ValueError(f"experts sharing one attention need equal (heads, kv_heads, head_dim), got {head_shapes}")
  xs = [streams[i].x.astype(dtype) for i in active]
  lengths = [x.shape[1] for x in xs]
  positions = jnp.concatenate([streams[i].positions for i in active], axis=1)
  q_segments = jnp.concatenate([streams[i].segment_ids for i in active], axis=1)
  q_blocks = jnp.concatenate([streams[i].block_ids for i in active], axis=1)
  kv_segments, kv_blocks = q_segments, q_blocks
  if kv_cache is not None:
    kv_segments = jnp.concatenate([kv_cache.segment_ids, q_segments], axis=1)
    kv_blocks = jnp.concatenate([kv_cache.block_ids, q_blocks], axis=1)
  conds = [streams[i].cond for i in active]
  given = weights or [None] * len(decoders)
  fp8_impls = [(fp8 or [None] * len(decoders))[i] for i in active]
  weights = [layer_weights(decoders[i], dtype) if given[i] is None else given[i] for i in active]

  def layer(carry, per_layer):
    xs = carry
    layer_weights, cache = per_layer
    gates, qs, ks, vs = [], [], [], []
    for x, w, cond in zip(xs, layer_weights, conds):
      x = constrain(x, ax.BATCH_SPEC)
      h, gate = apply_norm(w["pre_attention_norm"], x, cond)
      qs.append(project(w, "q_einsum", "BTD,NDH->BTNH", h))
      k, v = project(w, "kv_einsum", "BSD,CKDH->CBSKH", h)
      ks.append(k)
      vs.append(v)
      gates.append(gate)
    q = apply_rope(jnp.concatenate(qs, axis=1), positions, theta=ROPE_MAX_WAVELENGTH)
    k = apply_rope(jnp.concatenate(ks, axis=1), positions, theta=ROPE_MAX_WAVELENGTH)
    v = jnp.concatenate(vs, axis=1)
    new_kv = (k, v)
    if cache is not None:
      k = jnp.concatenate([cache[0].astype(dtype), k], axis=1)
      v = jnp.concatenate([cache[1].astype(dtype), v], axis=1)
    encoded = attention(q, k, v, q_segment_ids=q_segments, kv_segment_ids=kv_segments,
                        mask_kind="block_causal", q_block_ids=q_blocks, kv_block_ids=kv_blocks,
                        impl=attention_impl)
    outs, start = [], 0
    for x, w, cond, gate, length, impl in zip(xs, layer_weights, conds, gates, lengths, fp8_impls):
      attended = project(w, "attn_vec_einsum", "BTNH,NHD->BTD", encoded[:, start:start + length])
      start += length
      x = gated_residual(x, attended, gate)
      h, gate = apply_norm(w["pre_ffw_norm"], x, cond)
      outs.append(constrain(gated_residual(x, feed_forward(w, h, impl), gate), ax.BATCH_SPEC))
    return outs, (new_kv if return_kv_cache else None)

  if remat != "none":  # recompute each layer's activations in the backward pass (config.model.remat)
    layer = jax.checkpoint(layer, policy=remat_policy(remat), prevent_cse=False)
  cache_xs = (kv_cache.k, kv_cache.v) if kv_cache is not None else None
  xs, kv = jax.lax.scan(layer, xs, (weights, cache_xs))
  outputs: list[jax.Array | None] = [None] * len(streams)
  for i, x in zip(active, xs):
    outputs[i], _ = apply_norm(_final_norm_weights(decoders[i]), x, streams[i].cond)
  new_cache = None
  if return_kv_cache:
    k, v = kv
    if kv_cache is not None:
      k = jnp.concatenate([kv_cache.k, k], axis=2)
      v = jnp.concatenate([kv_cache.v, v], axis=2)
    new_cache = KVCache(k=k, v=v, segment_ids=kv_segments, block_ids=kv_blocks)
  return outputs, new_cache


def causal_lm_forward(decoder: GemmaDecoder, tokens: jax.Array, segment_ids: jax.Array,
                      positions: jax.Array, *, dtype=jnp.float32) -> jax.Array:
  """Plain causal Gemma on packed token rows: returns final hidden states [B, T, D].

  Causal inside each segment comes from block ids = positions (every token its own block).
  """
  stream = Stream(x=decoder.embed(tokens, dtype), positions=positions, segment_ids=segment_ids,
                  block_ids=positions)
  (out,), _ = run_mixture([decoder], [stream], dtype=dtype)
  return out


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v", "segment_ids", "block_ids"], meta_fields=[])
jax.tree_util.register_dataclass(Stream, data_fields=["x", "positions", "segment_ids", "block_ids", "cond"],
                                 meta_fields=[])
