"""pi0.5 weights <-> openpi's parameter tree (the flax/orbax layout of openpi's JAX checkpoints).

Keys are the '/'-joined paths of openpi's `params` tree (examples/convert_jax_model_to_pytorch.py
lists them): PaliGemma/llm/... (Gemma layers stacked over depth, the action expert's suffixed
"_1", its adaRMS norms as .../Dense_0/{kernel,bias}), PaliGemma/img/... (SigLIP So400m with its 27
blocks stacked as Transformer/encoderblock/..., the projection as img/head), and action_in_proj,
time_mlp_in, time_mlp_out, action_out_proj ({kernel, bias}); with config.model.lora, openpi's LoRA
adapters (.../attn/q_einsum/lora_a, .../mlp/gating_einsum_lora_a, ...). Checkpoints written by openpi training
(`nnx.State`) end every path with "/value": accepted on import.

`import_params(model_config, tree)` takes a nested dict or a flat '/'-keyed dict of arrays (e.g.
`orbax.checkpoint.PyTreeCheckpointer().restore(<checkpoint>/params)["params"]`) and returns a
concrete pi0.5 model; `export_params(model)` returns the flat dict; `nest` makes it a tree.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from flax import nnx

from ejax.models.io.pi05_links import Link, copy, export_with, import_with, stack, transformed
from ejax.models.lora import LoRASettings, has_adapters, settings, without_adapters

LAYOUT = "openpi pi0.5"
LLM_PREFIX = "PaliGemma/llm"
IMG_PREFIX = "PaliGemma/img"
VALUE_SUFFIX = "/value"


def _gemma_links(config_path: str, suffix: str, adarms: bool, lora: LoRASettings | None = None) -> list[Link]:
  layers = f"{LLM_PREFIX}/layers"
  links = [
      copy(f"{config_path}/layers/q_einsum", f"{layers}/attn/q_einsum{suffix}/w"),
      copy(f"{config_path}/layers/kv_einsum", f"{layers}/attn/kv_einsum{suffix}/w"),
      copy(f"{config_path}/layers/attn_vec_einsum", f"{layers}/attn/attn_vec_einsum{suffix}/w"),
      copy(f"{config_path}/layers/gating_einsum", f"{layers}/mlp{suffix}/gating_einsum"),
      copy(f"{config_path}/layers/linear", f"{layers}/mlp{suffix}/linear"),
  ]
  if lora is not None:  # openpi's lora.Einsum keeps {w, lora_a, lora_b}; lora.FeedForward <name>_lora_{a,b}
    for name in ("q_einsum", "kv_einsum", "attn_vec_einsum"):
      if "attn" in lora.targets:
        links += [copy(f"{config_path}/layers/lora/{name}_{part}", f"{layers}/attn/{name}{suffix}/lora_{part}")
                  for part in "ab"]
    for name in ("gating_einsum", "linear"):
      if "ffn" in lora.targets:
        links += [copy(f"{config_path}/layers/lora/{name}_{part}", f"{layers}/mlp{suffix}/{name}_lora_{part}")
                  for part in "ab"]
  norms = [(f"{config_path}/layers/pre_attention_norm", f"{layers}/pre_attention_norm{suffix}"),
           (f"{config_path}/layers/pre_ffw_norm", f"{layers}/pre_ffw_norm{suffix}"),
           (f"{config_path}/final_norm", f"{LLM_PREFIX}/final_norm{suffix}")]
  for path, key in norms:
    if adarms:
      links += [copy(f"{path}/kernel", f"{key}/Dense_0/kernel"), copy(f"{path}/bias", f"{key}/Dense_0/bias")]
    else:
      links.append(copy(f"{path}/scale", f"{key}/scale"))
  return links


def _vision_links(config) -> list[Link]:
  vision = config.vision
  patch, width = vision["patch_size"], vision["width"]
  block = f"{IMG_PREFIX}/Transformer/encoderblock"
  links = [
      # Dense over (py, px, c)-flattened patches == openpi's conv kernel [p, p, 3, width].
      transformed("vision/patch_embedding/kernel", f"{IMG_PREFIX}/embedding/kernel",
                  lambda x: x.reshape(patch, patch, 3, width), lambda y: y.reshape(patch * patch * 3, width)),
      copy("vision/patch_embedding/bias", f"{IMG_PREFIX}/embedding/bias"),
      transformed("vision/position_embedding", f"{IMG_PREFIX}/pos_embedding",
                  lambda x: x[None], lambda y: y[0]),
      copy("vision/post_layernorm/scale", f"{IMG_PREFIX}/Transformer/encoder_norm/scale"),
      copy("vision/post_layernorm/bias", f"{IMG_PREFIX}/Transformer/encoder_norm/bias"),
      copy("vision_projection/kernel", f"{IMG_PREFIX}/head/kernel"),
      copy("vision_projection/bias", f"{IMG_PREFIX}/head/bias"),
  ]
  per_block = {
      "layer_norm1/scale": "LayerNorm_0/scale", "layer_norm1/bias": "LayerNorm_0/bias",
      "layer_norm2/scale": "LayerNorm_1/scale", "layer_norm2/bias": "LayerNorm_1/bias",
      "mlp/fc1/kernel": "MlpBlock_0/Dense_0/kernel", "mlp/fc1/bias": "MlpBlock_0/Dense_0/bias",
      "mlp/fc2/kernel": "MlpBlock_0/Dense_1/kernel", "mlp/fc2/bias": "MlpBlock_0/Dense_1/bias",
  }
  for ours, theirs in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"), ("o_proj", "out")):
    per_block[f"self_attn/{ours}/kernel"] = f"MultiHeadDotProductAttention_0/{theirs}/kernel"
    per_block[f"self_attn/{ours}/bias"] = f"MultiHeadDotProductAttention_0/{theirs}/bias"
  for ours, theirs in per_block.items():
    links.append(stack([f"vision/blocks/{i}/{ours}" for i in range(vision["depth"])], f"{block}/{theirs}"))
  return links


def key_links(config) -> list[Link]:
  links = [copy("llm/embedder", f"{LLM_PREFIX}/embedder/input_embedding")]
  adapters = settings(config)
  links += _gemma_links("llm", "", adarms=False, lora=adapters.get("llm"))
  links += _gemma_links("expert", "_1", adarms=True, lora=adapters.get("expert"))
  links += _vision_links(config)
  for name in ("action_in_proj", "time_mlp_in", "time_mlp_out", "action_out_proj"):
    links += [copy(f"{name}/kernel", f"{name}/kernel"), copy(f"{name}/bias", f"{name}/bias")]
  return links


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
  """Nested dict -> '/'-joined keys; a flat dict passes through; a trailing "/value" is dropped."""
  flat: dict[str, np.ndarray] = {}
  for key, value in tree.items():
    path = f"{prefix}/{key}" if prefix else str(key)
    if isinstance(value, Mapping):
      flat.update(flatten(value, path))
    else:
      flat[path] = value
  if not prefix and flat and all(k.endswith(VALUE_SUFFIX) for k in flat):
    flat = {k[:-len(VALUE_SUFFIX)]: v for k, v in flat.items()}
  return flat


def nest(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """'/'-joined keys -> the nested dict openpi's checkpointer writes."""
  tree: dict[str, Any] = {}
  for key, value in flat.items():
    node = tree
    *parents, leaf = key.split("/")
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return tree


def _abstract(model_config):
  from ejax.models.registry import get_model_spec
  return nnx.eval_shape(lambda: get_model_spec("pi05").create(model_config, nnx.Rngs(0)))


def import_params(model_config, tree: Mapping[str, Any]):
  """A concrete pi0.5 model from openpi's parameter tree; errors name every mismatching key."""
  flat = flatten(tree)
  if not any("lora_" in key for key in flat):  # a released (not LoRA-trained) checkpoint: no adapters
    model_config = without_adapters(model_config)
  return import_with(key_links(model_config), flat, _abstract(model_config), layout=LAYOUT)


def export_params(model) -> dict[str, np.ndarray]:
  """The model's parameters as openpi's flat '/'-keyed tree (use `nest` for the nested form)."""
  config = model.config if has_adapters(model) else without_adapters(model.config)  # merged: released keys
  return export_with(key_links(config), model, layout=LAYOUT)


def load(model_config, path: str):
  """Restores an openpi params checkpoint directory (orbax) and imports it."""
  import orbax.checkpoint as ocp
  restored = ocp.PyTreeCheckpointer().restore(path)
  tree = restored.get("params", restored) if isinstance(restored, Mapping) else restored
  return import_params(model_config, tree)


def save(model, path: str) -> None:
  """Writes openpi's params layout as an orbax checkpoint: {"params": nested tree}."""
  import os

  import orbax.checkpoint as ocp
  checkpointer = ocp.PyTreeCheckpointer()
  checkpointer.save(os.path.abspath(path), {"params": nest(export_params(model))}, force=True)
