"""GR00T-N1.5 weights <-> the released safetensors layout (Isaac-GR00T / LeRobot key names).

    backbone.eagle_model.vision_model.vision_model.*   SigLIP (embeddings, encoder.layers.N, post_layernorm)
    backbone.eagle_model.mlp1.*                        connector (mlp1.0 = Linear for the released 1-layer form)
    backbone.eagle_model.language_model.model.*        Qwen3 (embed_tokens, layers.N < select_layer, norm)
    action_head.vlln / vl_self_attention.transformer_blocks.N.*   (diffusers BasicTransformerBlock)
    action_head.model.*                                DiT (timestep_encoder, transformer_blocks.N, proj_out_1/2)
    action_head.{state_encoder,action_encoder,action_decoder}.*  per-embodiment W / b
    action_head.future_tokens.weight, action_head.position_embedding.weight

Two groups in a released file have no counterpart here and are accepted as known-unused (and
reported): SigLIP's attention-pooling head (`...vision_model.head.*`; GR00T uses patch tokens) and a
stored `lm_head.weight` (tied to the embedding; the truncated LLM never produces logits).
"""

from __future__ import annotations

import numpy as np
from absl import logging
from flax import nnx

from ejax.models.io.tensors import (TensorMap, check_tensors, fill_model, load_tensors, model_arrays, param_shapes,
                                    save_tensors, to_checkpoint, to_ejax)

VISION = "backbone.eagle_model.vision_model.vision_model."
CONNECTOR = "backbone.eagle_model.mlp1."
LLM = "backbone.eagle_model.language_model."
IGNORED_PREFIXES = (VISION + "head.", LLM + "lm_head.")


def _linear(maps, path, key, bias=True):
  maps.append(TensorMap(f"{path}/kernel", f"{key}.weight", "linear"))
  if bias:
    maps.append(TensorMap(f"{path}/bias", f"{key}.bias", "copy"))


def _norm(maps, path, key, bias=True, scale_name="scale"):
  maps.append(TensorMap(f"{path}/{scale_name}", f"{key}.weight", "copy"))
  if bias:
    maps.append(TensorMap(f"{path}/bias", f"{key}.bias", "copy"))


def _attention(maps, path, key, names=("q_proj", "k_proj", "v_proj", "o_proj"), bias=True, out_bias=True):
  for ours, theirs in zip(("q_proj", "k_proj", "v_proj"), names[:3]):
    maps.append(TensorMap(f"{path}/{ours}/kernel", f"{key}.{theirs}.weight", "head_in"))
    if bias:
      maps.append(TensorMap(f"{path}/{ours}/bias", f"{key}.{theirs}.bias", "head_bias"))
  maps.append(TensorMap(f"{path}/o_proj/kernel", f"{key}.{names[3]}.weight", "head_out"))
  if out_bias:
    maps.append(TensorMap(f"{path}/o_proj/bias", f"{key}.{names[3]}.bias", "copy"))


def _diffusers_block(maps, path, key, ada_norm):
  if ada_norm:
    _linear(maps, f"{path}/norm1/linear", f"{key}.norm1.linear")
  else:
    _norm(maps, f"{path}/norm1", f"{key}.norm1")
    _norm(maps, f"{path}/norm3", f"{key}.norm3")
  _attention(maps, f"{path}/attn1", f"{key}.attn1", names=("to_q", "to_k", "to_v", "to_out.0"))
  _linear(maps, f"{path}/ff/fc1", f"{key}.ff.net.0.proj")
  _linear(maps, f"{path}/ff/fc2", f"{key}.ff.net.2")


def key_map(config) -> list[TensorMap]:
  """Every GR00T parameter and its released checkpoint key, for this config's layer counts."""
  maps: list[TensorMap] = []
  v = "backbone/vision"
  maps.append(TensorMap(f"{v}/patch_embedding/kernel", VISION + "embeddings.patch_embedding.weight", "patch"))
  maps.append(TensorMap(f"{v}/patch_embedding/bias", VISION + "embeddings.patch_embedding.bias", "copy"))
  maps.append(TensorMap(f"{v}/position_embedding", VISION + "embeddings.position_embedding.weight", "copy"))
  for i in range(config.vision.depth):
    p, k = f"{v}/blocks/{i}", f"{VISION}encoder.layers.{i}"
    _norm(maps, f"{p}/layer_norm1", f"{k}.layer_norm1")
    _attention(maps, f"{p}/self_attn", f"{k}.self_attn", names=("q_proj", "k_proj", "v_proj", "out_proj"))
    _norm(maps, f"{p}/layer_norm2", f"{k}.layer_norm2")
    _linear(maps, f"{p}/mlp/fc1", f"{k}.mlp.fc1")
    _linear(maps, f"{p}/mlp/fc2", f"{k}.mlp.fc2")
  _norm(maps, f"{v}/post_layernorm", VISION + "post_layernorm")

  c = "backbone/connector"
  if config.connector.num_layers == 1:
    _linear(maps, f"{c}/fc1", CONNECTOR + "0")
  else:  # Sequential(LayerNorm, Linear, GELU, Linear)
    _norm(maps, f"{c}/norm", CONNECTOR + "0")
    _linear(maps, f"{c}/fc1", CONNECTOR + "1")
    _linear(maps, f"{c}/fc2", CONNECTOR + "3")

  l, lk = "backbone/llm", LLM + "model."
  maps.append(TensorMap(f"{l}/embed_tokens", lk + "embed_tokens.weight", "copy"))
  for i in range(config.llm.num_layers):
    p, k = f"{l}/blocks/{i}", f"{lk}layers.{i}"
    _norm(maps, f"{p}/input_layernorm", f"{k}.input_layernorm", bias=False)
    _attention(maps, f"{p}/self_attn", f"{k}.self_attn", bias=False, out_bias=False)
    _norm(maps, f"{p}/self_attn/q_norm", f"{k}.self_attn.q_norm", bias=False)
    _norm(maps, f"{p}/self_attn/k_norm", f"{k}.self_attn.k_norm", bias=False)
    _norm(maps, f"{p}/post_attention_layernorm", f"{k}.post_attention_layernorm", bias=False)
    for name in ("gate_proj", "up_proj", "down_proj"):
      _linear(maps, f"{p}/mlp/{name}", f"{k}.mlp.{name}", bias=False)
  _norm(maps, f"{l}/norm", lk + "norm", bias=False)

  h = "action_head"
  _norm(maps, f"{h}/vlln", "action_head.vlln")
  for i in range(config.vl_transformer.num_layers):
    _diffusers_block(maps, f"{h}/vl_self_attention/blocks/{i}",
                     f"action_head.vl_self_attention.transformer_blocks.{i}", ada_norm=False)
  d = f"{h}/dit"
  _linear(maps, f"{d}/timestep_encoder/linear_1", "action_head.model.timestep_encoder.timestep_embedder.linear_1")
  _linear(maps, f"{d}/timestep_encoder/linear_2", "action_head.model.timestep_encoder.timestep_embedder.linear_2")
  for i in range(config.dit.num_layers):
    _diffusers_block(maps, f"{d}/blocks/{i}", f"action_head.model.transformer_blocks.{i}", ada_norm=True)
  _linear(maps, f"{d}/proj_out_1", "action_head.model.proj_out_1")
  _linear(maps, f"{d}/proj_out_2", "action_head.model.proj_out_2")
  tables = {"state_encoder": ("layer1", "layer2"), "action_encoder": ("W1", "W2", "W3"),
            "action_decoder": ("layer1", "layer2")}
  for module, names in tables.items():
    for name in names:
      maps.append(TensorMap(f"{h}/{module}/{name}/W", f"action_head.{module}.{name}.W", "copy"))
      maps.append(TensorMap(f"{h}/{module}/{name}/b", f"action_head.{module}.{name}.b", "copy"))
  maps.append(TensorMap(f"{h}/future_tokens", "action_head.future_tokens.weight", "copy"))
  maps.append(TensorMap(f"{h}/position_embedding", "action_head.position_embedding.weight", "copy"))
  return maps


def _abstract(config):
  from ejax.models.groot import create
  return nnx.eval_shape(lambda: create(config, nnx.Rngs(0)))


def from_release(config, tensors) -> nnx.Module:
  """A concrete GR00T model from released-layout tensors; errors name every mismatching key."""
  abstract = _abstract(config)
  shapes = param_shapes(abstract)
  maps = key_map(config)
  unmapped = sorted(set(shapes) - {m.path for m in maps})
  if unmapped:  # a model change without a key-map change: a bug in ejax, not in the checkpoint
    raise AssertionError(f"GR00T parameters without a checkpoint key: {unmapped[:10]}")
  ignored = check_tensors(maps, tensors, shapes, ignored_prefixes=IGNORED_PREFIXES)
  if ignored:
    logging.info("GR00T import: %d known-unused tensors ignored (e.g. %s)", len(ignored), ignored[0])
  arrays = {m.path: to_ejax(m, np.asarray(tensors[m.key]), shapes[m.path]) for m in maps}
  return fill_model(abstract, arrays)


def to_release(model) -> dict[str, np.ndarray]:
  """The model's parameters under the released key names and PyTorch layouts."""
  arrays = model_arrays(model)
  return {m.key: to_checkpoint(m, arrays[m.path], arrays[m.path].shape) for m in key_map(model.config)}


def load(config, path: str) -> nnx.Module:
  return from_release(config, load_tensors(path))


def save(model, path: str) -> None:
  save_tensors(to_release(model), path, metadata={"format": "pt", "source": "ejax"})
