"""pi0.5 weights <-> LeRobot's PyTorch port (safetensors, `paligemma_with_expert.*` keys).

Key names and layouts follow LeRobot's policies/pi05 (PaliGemmaWithExpertModel: HF PaliGemma +
a Gemma expert with adaRMS `input_layernorm.dense` / `post_attention_layernorm.dense` /
`norm.dense`) and openpi's examples/convert_jax_model_to_pytorch.py: Linear weights [out, in];
q_proj = q_einsum[N, D, H] -> [N*H, D]; k/v_proj from kv_einsum; o_proj = attn_vec_einsum
[N, H, D] -> [D, N*H]; gate/up_proj from gating_einsum[0/1]; the patch conv [W, 3, p, p].

Released files also hold two vocabulary heads flow matching never uses:
`paligemma_with_expert.paligemma.lm_head.weight` (tied to embed_tokens; used as the embedding
when embed_tokens is absent) and `paligemma_with_expert.gemma_expert.lm_head.weight` (untrained).
Both are accepted and skipped on import; `export_params(..., with_unused_heads=True)` writes them
(the tied copy and zeros) for loaders that insist on every key. Keys may carry LeRobot's "model."
policy prefix.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from flax import nnx

from ejax.models.io.pi05_links import Link, stack_arrays, copy, export_with, import_with, split_layers, transformed
from ejax.models.io.tensors import load_tensors, save_tensors

LAYOUT = "LeRobot pi0.5"
ROOT = "paligemma_with_expert"
VLM = f"{ROOT}.paligemma.model"
EMBED_TOKENS = f"{VLM}.language_model.embed_tokens.weight"
TIED_LM_HEAD = f"{ROOT}.paligemma.lm_head.weight"
EXPERT_LM_HEAD = f"{ROOT}.gemma_expert.lm_head.weight"
POLICY_PREFIX = "model."


def _linear(path: str, key: str) -> list[Link]:
  return [transformed(f"{path}/kernel", f"{key}.weight", lambda x: x.T, lambda y: y.T),
          copy(f"{path}/bias", f"{key}.bias")]


def key_links(config) -> list[Link]:
  from ejax.models.pi05 import gemma_configs
  llm, expert = gemma_configs(config)
  links = [copy("llm/embedder", EMBED_TOKENS)]
  links += _gemma_links("llm", f"{VLM}.language_model", llm, adarms=False)
  links += _gemma_links("expert", f"{ROOT}.gemma_expert.model", expert, adarms=True)
  links += _vision_links(config)
  links += _linear("vision_projection", f"{VLM}.multi_modal_projector.linear")
  for name in ("action_in_proj", "time_mlp_in", "time_mlp_out", "action_out_proj"):
    links += _linear(name, name)
  return links


def _gemma_links(path: str, key_prefix: str, gemma_config, *, adarms: bool) -> list[Link]:
  """Stacked Gemma layers <-> HF per-layer tensors under `{key_prefix}.layers.{i}`."""
  c = gemma_config
  depth = c.depth
  def layer_keys(*names):
    return [[f"{key_prefix}.layers.{i}.{n}" for n in names] for i in range(depth)]

  links = [
      split_layers(f"{path}/layers/q_einsum", layer_keys("self_attn.q_proj.weight"),
                   lambda q: [q.transpose(0, 2, 1).reshape(-1, c.width)],
                   lambda ys: ys[0].reshape(c.num_heads, c.head_dim, c.width).transpose(0, 2, 1)),
      split_layers(f"{path}/layers/kv_einsum", layer_keys("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                   lambda kv: [kv[j].transpose(0, 2, 1).reshape(-1, c.width) for j in range(2)],
                   lambda ys: stack_arrays([y.reshape(c.num_kv_heads, c.head_dim, c.width).transpose(0, 2, 1)
                                      for y in ys])),
      split_layers(f"{path}/layers/attn_vec_einsum", layer_keys("self_attn.o_proj.weight"),
                   lambda a: [a.reshape(-1, c.width).T],
                   lambda ys: ys[0].T.reshape(c.num_heads, c.head_dim, c.width)),
      split_layers(f"{path}/layers/gating_einsum", layer_keys("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                   lambda g: [g[0].T, g[1].T], lambda ys: stack_arrays([ys[0].T, ys[1].T])),
      split_layers(f"{path}/layers/linear", layer_keys("mlp.down_proj.weight"),
                   lambda w: [w.T], lambda ys: ys[0].T),
  ]
  norms = [("pre_attention_norm", "input_layernorm"), ("pre_ffw_norm", "post_attention_layernorm")]
  for ours, theirs in norms:
    if adarms:
      links.append(split_layers(f"{path}/layers/{ours}/kernel", layer_keys(f"{theirs}.dense.weight"),
                                lambda k: [k.T], lambda ys: ys[0].T))
      links.append(split_layers(f"{path}/layers/{ours}/bias", layer_keys(f"{theirs}.dense.bias"),
                                lambda b: [b], lambda ys: ys[0]))
    else:
      links.append(split_layers(f"{path}/layers/{ours}/scale", layer_keys(f"{theirs}.weight"),
                                lambda s: [s], lambda ys: ys[0]))
  if adarms:
    links += [transformed(f"{path}/final_norm/kernel", f"{key_prefix}.norm.dense.weight", lambda k: k.T, lambda y: y.T),
              copy(f"{path}/final_norm/bias", f"{key_prefix}.norm.dense.bias")]
  else:
    links.append(copy(f"{path}/final_norm/scale", f"{key_prefix}.norm.weight"))
  return links


def _vision_links(config) -> list[Link]:
  v = config.vision
  patch, width, heads = v["patch_size"], v["width"], v["num_heads"]
  head_dim = width // heads
  tower = f"{VLM}.vision_tower.vision_model"
  links = [
      # ejax Dense over (py, px, c) patches <-> torch Conv2d weight [W, 3, p, p].
      transformed("vision/patch_embedding/kernel", f"{tower}.embeddings.patch_embedding.weight",
                  lambda x: x.reshape(patch, patch, 3, width).transpose(3, 2, 0, 1),
                  lambda y: y.transpose(2, 3, 1, 0).reshape(patch * patch * 3, width)),
      copy("vision/patch_embedding/bias", f"{tower}.embeddings.patch_embedding.bias"),
      copy("vision/position_embedding", f"{tower}.embeddings.position_embedding.weight"),
      copy("vision/post_layernorm/scale", f"{tower}.post_layernorm.weight"),
      copy("vision/post_layernorm/bias", f"{tower}.post_layernorm.bias"),
  ]
  for i in range(v["depth"]):
    ours, theirs = f"vision/blocks/{i}", f"{tower}.encoder.layers.{i}"
    for norm in ("layer_norm1", "layer_norm2"):
      links += [copy(f"{ours}/{norm}/scale", f"{theirs}.{norm}.weight"),
                copy(f"{ours}/{norm}/bias", f"{theirs}.{norm}.bias")]
    for proj in ("q_proj", "k_proj", "v_proj"):
      links += [transformed(f"{ours}/self_attn/{proj}/kernel", f"{theirs}.self_attn.{proj}.weight",
                            lambda x: x.reshape(width, -1).T, lambda y: y.T.reshape(width, heads, head_dim)),
                transformed(f"{ours}/self_attn/{proj}/bias", f"{theirs}.self_attn.{proj}.bias",
                            lambda x: x.reshape(-1), lambda y: y.reshape(heads, head_dim))]
    links += [transformed(f"{ours}/self_attn/o_proj/kernel", f"{theirs}.self_attn.out_proj.weight",
                          lambda x: x.reshape(-1, width).T, lambda y: y.T.reshape(heads, head_dim, width)),
              copy(f"{ours}/self_attn/o_proj/bias", f"{theirs}.self_attn.out_proj.bias")]
    links += _linear(f"{ours}/mlp/fc1", f"{theirs}.mlp.fc1") + _linear(f"{ours}/mlp/fc2", f"{theirs}.mlp.fc2")
  return links


def _abstract(model_config):
  from ejax.models.pi05 import create
  return nnx.eval_shape(lambda: create(model_config, nnx.Rngs(0)))


def import_params(model_config, tensors: Mapping[str, np.ndarray]):
  """A concrete pi0.5 model from LeRobot-layout tensors; errors name every mismatching key."""
  tensors = {(k[len(POLICY_PREFIX):] if k.startswith(POLICY_PREFIX) else k): v for k, v in tensors.items()}
  if EMBED_TOKENS not in tensors and TIED_LM_HEAD in tensors:
    tensors[EMBED_TOKENS] = tensors[TIED_LM_HEAD]  # safetensors kept only one of the tied pair
  return import_with(key_links(model_config), tensors, _abstract(model_config),
                     ignored=(TIED_LM_HEAD, EXPERT_LM_HEAD), layout=LAYOUT)


def export_params(model, *, with_unused_heads: bool = False, prefix: str = "") -> dict[str, np.ndarray]:
  """LeRobot-layout tensors; `prefix="model."` gives the keys of a LeRobot policy's own save."""
  tensors = export_with(key_links(model.config), model, layout=LAYOUT)
  if with_unused_heads:
    tensors[TIED_LM_HEAD] = tensors[EMBED_TOKENS]
    tensors[EXPERT_LM_HEAD] = np.zeros((tensors[EMBED_TOKENS].shape[0], model.expert.config.width),
                                       tensors[EMBED_TOKENS].dtype)
  return {prefix + k: v for k, v in tensors.items()}


def load(model_config, path: str):
  return import_params(model_config, load_tensors(path))


def save(model, path: str) -> None:
  save_tensors(export_params(model), path, metadata={"format": "pt", "source": "ejax"})
