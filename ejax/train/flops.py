"""Analytic FLOPs of one training sample of GR00T-N1.5 and pi0.5, from the model's weight shapes.

Every weight matrix costs 2 FLOPs per element per token it is applied to, and attention costs
4 * heads * head_dim per (query, key) pair a mask allows (QK^T and PV). A frozen part runs forward
only; a trained part runs forward and backward (gradients of inputs and of weights: 2x forward),
except that a first layer whose input needs no gradient skips the input gradient. That is `model`,
what MFU counts. Blocks under `model.remat` run their forward once more in the backward pass, all but
their output projections: `hardware`, what the devices execute and what XLA's compiled program holds. Norms, biases,
activations and softmax are left out (a few percent); so is the flash kernel's recomputation of
scores in its backward pass (+0.5x attention forward).

Which tokens each weight sees is the one model-specific fact here (`_groot_rules`, `_pi05_rules`):
images x patches for the vision tower, the packed row's tokens per sample (its padding included:
the row is computed whole) for the LLM and the VL / prefix transformers, the action tokens for the
action expert and DiT, one token per sample for timestep conditioning. Per-embodiment tables count
one table per sample.

  benchmarks/scaling.py checks this count against the compiled train step (ejax.parallel.hlo).
"""

from __future__ import annotations

import dataclasses
import re
import numpy as np

FROZEN, TRAINED, TRAINED_FIRST, SKIP = "frozen", "trained", "trained_first", "skip"
# A block's last projections (attention output, MLP output): their outputs only join the residual
# stream, which the backward pass does not need, so rematerialisation does not recompute them.
_NOT_RECOMPUTED = r"(o_proj|fc2|down_proj|attn_vec_einsum|layers/linear)(/|$)"
_PASSES = {FROZEN: 1, TRAINED: 3, TRAINED_FIRST: 2, SKIP: 0}  # forward + backward passes of a weight


@dataclasses.dataclass(frozen=True)
class Layout:
  """The tokens one training sample costs: what the model computes on, padding included."""
  row_tokens: float       # packed-row tokens per sample (row_length / samples per row)
  segment_length: float   # mean real tokens of a sample's VL (GR00T) or prefix (pi0.5) segment
  segment_pairs: float    # mean over samples of segment_length^2 (bidirectional attention pairs)
  images: float           # images the vision tower encodes per sample


@dataclasses.dataclass(frozen=True)
class SampleFlops:
  forward: float   # one forward pass
  model: float     # forward + backward: what MFU counts
  hardware: float  # model + rematerialised forwards: what the devices run
  attention: float  # the part of `hardware` that is attention scores and values

  def scaled(self, factor: float) -> "SampleFlops":
    return SampleFlops(*(factor * getattr(self, f.name) for f in dataclasses.fields(self)))


def layout_of_batch(model_config, batch: dict[str, np.ndarray]) -> Layout:
  """The Layout of a collated batch (ejax.models.groot_inputs / pi05_inputs)."""
  key = "vl_segment_ids" if model_config.name == "groot" else "prefix_segment_ids"
  segments = np.asarray(batch[key])
  lengths = np.concatenate([np.bincount(row)[1:] for row in segments])
  lengths = lengths[lengths > 0].astype(float)
  samples = batch["actions"].shape[0]
  return Layout(row_tokens=segments.size / samples, segment_length=float(lengths.mean()),
                segment_pairs=float(np.mean(lengths**2)), images=batch["images"].shape[0] / samples)


def _groot_rules(c, layout: Layout):
  """(path pattern, tokens per sample, mode, rematerialised) for GR00T-N1.5; first match wins."""
  patches = (c.vision.image_size // c.vision.patch_size) ** 2 * layout.images
  row, dit_tokens = layout.row_tokens, 1 + c.num_future_tokens + c.action_horizon
  trained_backbone = c.tune_llm or c.tune_visual  # otherwise the backbone's output is stop_gradient'ed
  backbone = TRAINED if trained_backbone else FROZEN
  remat = c.remat != "none"
  return [
      (r"backbone/llm/embed_tokens|backbone/vision/position_embedding|action_head/(future_tokens|position_embedding)",
       0, SKIP, False),
      (r"backbone/vision/patch_embedding", patches, TRAINED_FIRST if c.tune_visual else FROZEN, False),
      (r"backbone/vision/", patches, backbone, remat),
      (r"backbone/connector/", patches, backbone, False),
      (r"backbone/llm/", row, backbone, remat),
      (r"action_head/vl_self_attention/blocks/0/attn1/[qkv]_proj", row,
       TRAINED if trained_backbone else TRAINED_FIRST, remat),
      (r"action_head/vl_self_attention/", row, TRAINED, remat),
      (r"action_head/dit/blocks/\d*[02468]/attn1/[kv]_proj", row, TRAINED, remat),  # cross-attention keys
      (r"action_head/dit/blocks/\d+/norm1/", 1, TRAINED, remat),                     # AdaLN from the timestep
      (r"action_head/dit/blocks/", dit_tokens, TRAINED, remat),
      (r"action_head/dit/timestep_encoder/linear_1", 1, TRAINED_FIRST, False),
      (r"action_head/dit/(timestep_encoder|proj_out_1)", 1, TRAINED, False),
      (r"action_head/dit/proj_out_2", dit_tokens, TRAINED, False),
      (r"action_head/state_encoder/layer1", 1, TRAINED_FIRST, False),
      (r"action_head/state_encoder/", 1, TRAINED, False),
      (r"action_head/action_encoder/W1", c.action_horizon, TRAINED_FIRST, False),
      (r"action_head/action_encoder/", c.action_horizon, TRAINED, False),
      (r"action_head/action_decoder/", dit_tokens, TRAINED, False),
  ]


def _groot_attention(c, layout: Layout):
  """(pairs per sample per layer, heads x head_dim, layers, mode, rematerialised)."""
  patches = (c.vision.image_size // c.vision.patch_size) ** 2
  dit_tokens, remat = 1 + c.num_future_tokens + c.action_horizon, c.remat != "none"
  backbone = TRAINED if (c.tune_llm or c.tune_visual) else FROZEN
  vl, dit = c.vl_transformer, c.dit
  causal_pairs = (layout.segment_pairs + layout.segment_length) / 2
  return [
      (layout.images * patches**2, c.vision.width, c.vision.depth, backbone, remat),
      (causal_pairs, c.llm.num_heads * c.llm.head_dim, c.llm.num_layers, backbone, remat),
      (layout.segment_pairs, vl["num_heads"] * vl["head_dim"], vl["num_layers"], TRAINED, remat),
      (dit_tokens * layout.segment_length, dit["num_heads"] * dit["head_dim"], (dit["num_layers"] + 1) // 2,
       TRAINED, remat),  # even blocks: cross-attention to the sample's VL tokens
      (dit_tokens**2, dit["num_heads"] * dit["head_dim"], dit["num_layers"] // 2, TRAINED, remat),
  ]


def _pi05_rules(c, layout: Layout):
  patches = (c.vision.image_size // c.vision.patch_size) ** 2 * layout.images
  vision = TRAINED if c.get("train_vision", True) else FROZEN
  llm = TRAINED if c.get("train_llm", True) else FROZEN
  remat = c.remat != "none"
  return [
      (r"llm/embedder|vision/position_embedding", 0, SKIP, False),
      (r"vision/patch_embedding", patches, TRAINED_FIRST if vision == TRAINED else FROZEN, False),
      (r"vision/blocks/", patches, vision, remat),
      (r"vision/|vision_projection", patches, vision, False),
      (r"llm/", layout.row_tokens, llm, remat),
      (r"expert/layers/pre_(attention|ffw)_norm", 1, TRAINED, remat),  # adaRMS: per sample's timestep
      (r"expert/final_norm", 1, TRAINED, False),
      (r"expert/", c.action_horizon, TRAINED, remat),
      (r"action_in_proj", c.action_horizon, TRAINED_FIRST, False),
      (r"action_out_proj", c.action_horizon, TRAINED, False),
      (r"time_mlp_in", 1, TRAINED_FIRST, False),
      (r"time_mlp_out", 1, TRAINED, False),
  ]


def _pi05_attention(c, layout: Layout):
  patches, remat = (c.vision.image_size // c.vision.patch_size) ** 2, c.remat != "none"
  heads = c.paligemma["num_heads"] * c.paligemma["head_dim"]
  horizon = c.action_horizon
  return [
      (layout.images * patches**2, c.vision.width, c.vision.depth, TRAINED, remat),
      # One joint attention per layer: the prefix within itself, the action chunk over prefix and chunk.
      (layout.segment_pairs + horizon * (layout.segment_length + horizon), heads, c.paligemma["depth"],
       TRAINED, remat),
  ]


_RULES = {"groot": (_groot_rules, _groot_attention), "pi05": (_pi05_rules, _pi05_attention)}


def weight_shapes(model_config) -> list[tuple[str, tuple[int, ...]]]:
  """(path, shape) of every parameter of the model, from shapes alone."""
  import jax
  from flax import nnx

  from ejax.models.registry import get_model_spec
  spec = get_model_spec(model_config.name)
  model = nnx.eval_shape(lambda: spec.create(model_config, nnx.Rngs(0)))
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    out.append(("/".join(k for k in keys if k != "value"), tuple(leaf.shape)))
  return out


def train_flops_per_sample(model_config, layout: Layout, weights: list | None = None) -> SampleFlops:
  """Analytic FLOPs of one sample of a training step (module docstring)."""
  if model_config.name not in _RULES:
    raise ValueError(f"no analytic FLOP count for model {model_config.name!r}: one of {', '.join(_RULES)}")
  rules, attention = (f(model_config, layout) for f in _RULES[model_config.name])
  forward = model = hardware = 0.0
  for path, shape in weights if weights is not None else weight_shapes(model_config):
    if len(shape) < 2:
      continue  # norms and biases
    rule = next((r for r in rules if re.search(r[0], path)), None)
    if rule is None:
      raise ValueError(f"analytic FLOPs: no rule says which tokens weight {path} {shape} sees")
    _, tokens, mode, remat = rule
    size = float(np.prod(shape))
    if re.search(r"action_(en|de)coder|state_encoder", path):
      size /= shape[0]  # per-embodiment tables: each sample uses one
    flops = 2.0 * tokens * size
    forward += flops
    model += _PASSES[mode] * flops
    recomputed = remat and mode != FROZEN and not re.search(_NOT_RECOMPUTED, path)
    hardware += (_PASSES[mode] + recomputed) * flops
  attention_flops = 0.0
  for pairs, width, layers, mode, remat in attention:
    flops = 4.0 * pairs * width * layers
    forward += flops
    model += _PASSES[mode] * flops
    extra = (_PASSES[mode] + (remat and mode != FROZEN)) * flops
    hardware += extra
    attention_flops += extra
  return SampleFlops(forward, model, hardware, attention_flops)

