"""DreamZero weights <-> the released layouts: the DreamZero checkpoint and the Wan / umT5 / CLIP files.

A released DreamZero checkpoint (dreamzero0/dreamzero's VLA saved as model.safetensors, or shards with
model.safetensors.index.json) holds every component under the policy head:
    action_head.model.*                      CausalWanModel: the Wan DiT with state_encoder,
                                             action_encoder and action_decoder inside
    action_head.text_encoder.*               umT5-XXL encoder (token_embedding, blocks.N, norm)
    action_head.image_encoder.model.visual.* CLIP ViT-H/14 vision tower (.textual.* and log_scale are
                                             the unused text tower: accepted and reported)
    action_head.vae.model.*                  Wan VAE (encoder, conv1, conv2, decoder)
The components' own releases use the same keys without those prefixes (COMPONENT_PREFIXES): a Wan2.x
DiT's diffusion_pytorch_model*.safetensors (no action/state modules), the umT5 encoder, the CLIP
checkpoint and the Wan VAE, as safetensors (Wan ships .pth files; convert them with safetensors' torch
helper first). `load_component` / `save_component` read and write those.

The Wan 2.2 VAE is shape-correct only in ejax (ejax/models/dreamzero/vae.py): its released weights
cannot be imported, and importing a 5B checkpoint says so in one line.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
from absl import logging
from flax import nnx

from ejax.models.io.tensors import (CheckpointMismatch, fill_model, load_tensors, model_arrays, param_shapes,
                                    raise_on_mismatch, save_tensors)

COMPONENT_PREFIXES = {
    "dit": "action_head.model.",
    "text_encoder": "action_head.text_encoder.",
    "image_encoder": "action_head.image_encoder.model.visual.",
    "vae": "action_head.vae.model.",
}
IGNORED_PREFIXES = ("action_head.image_encoder.model.textual.", "action_head.image_encoder.model.log_scale")
EMBODIMENT_MODULES = {"state_encoder": ("layer1", "layer2"), "action_encoder": ("W1", "W2", "W3"),
                      "action_decoder": ("layer1", "layer2")}


@dataclasses.dataclass(frozen=True)
class Entry:
  """One parameter: its ejax path, its checkpoint key and the layout transform between them."""
  path: str
  key: str
  checkpoint_shape: tuple[int, ...]
  to_checkpoint: Callable[[np.ndarray], np.ndarray]
  to_ejax: Callable[[np.ndarray], np.ndarray]


class _Maps:
  """Builds the entries of one component against the model's parameter shapes."""

  def __init__(self, shapes: dict, ejax_prefix: str, key_prefix: str):
    self.shapes, self.ejax_prefix, self.key_prefix = shapes, ejax_prefix, key_prefix
    self.entries: list[Entry] = []

  def add(self, path, key, kind="copy", checkpoint_shape=None):
    path, key = self.ejax_prefix + path, self.key_prefix + key
    shape = self.shapes[path]
    if kind == "copy":
      self.entries.append(Entry(path, key, shape, lambda a: a, lambda a: a))
    elif kind == "linear":  # torch Linear [out, in] <-> kernel [in, out]
      self.entries.append(Entry(path, key, shape[::-1], lambda a: a.T, lambda a: a.T))
    elif kind == "reshape":  # the same values under extra unit axes (modulation [1, 6, dim], gamma [c, 1, 1, 1])
      self.entries.append(Entry(path, key, checkpoint_shape, lambda a, s=checkpoint_shape: a.reshape(s),
                                lambda a, s=shape: a.reshape(s)))
    elif kind == "conv_flat":  # conv [out, in, *k] <-> dense [in * prod(k), out] (patch embeddings)
      ck = (shape[1],) + tuple(checkpoint_shape)
      self.entries.append(Entry(path, key, ck, lambda a, s=ck: a.T.reshape(s), lambda a: a.reshape(a.shape[0], -1).T))
    elif kind == "conv3d":  # [out, in, kt, kh, kw] <-> [kt, kh, kw, in, out]
      ck = (shape[4], shape[3]) + shape[:3]
      self.entries.append(Entry(path, key, ck, lambda a: a.transpose(4, 3, 0, 1, 2), lambda a: a.transpose(2, 3, 4, 1, 0)))
    elif kind == "conv2d":  # [out, in, kh, kw] <-> [kh, kw, in, out]
      ck = (shape[3], shape[2]) + shape[:2]
      self.entries.append(Entry(path, key, ck, lambda a: a.transpose(3, 2, 0, 1), lambda a: a.transpose(2, 3, 1, 0)))
    elif kind == "conv1x1":  # [out, in, 1, 1] <-> dense [in, out]
      ck = (shape[1], shape[0], 1, 1)
      self.entries.append(Entry(path, key, ck, lambda a: a.T[:, :, None, None], lambda a: a[:, :, 0, 0].T))
    else:
      raise ValueError(f"unknown layout kind {kind!r}")

  def linear(self, path, key, bias=True):
    self.add(f"{path}/kernel", f"{key}.weight", "linear")
    if bias:
      self.add(f"{path}/bias", f"{key}.bias")

  def norm(self, path, key, bias=True):
    self.add(f"{path}/scale", f"{key}.weight")
    if bias:
      self.add(f"{path}/bias", f"{key}.bias")


def dit_entries(model, shapes, key_prefix: str = COMPONENT_PREFIXES["dit"], with_embodiment: bool = True):
  config = model.dit.config
  m = _Maps(shapes, "dit/", key_prefix)
  m.add("patch_embedding/kernel", "patch_embedding.weight", "conv_flat", (config.in_dim, *config.patch_size))
  m.add("patch_embedding/bias", "patch_embedding.bias")
  for ours, theirs in (("text_embedding", "text_embedding"), ("time_embedding", "time_embedding")):
    m.linear(f"{ours}/fc1", f"{theirs}.0")
    m.linear(f"{ours}/fc2", f"{theirs}.2")
  m.linear("time_projection", "time_projection.1")
  m.norm("img_emb/norm_in", "img_emb.proj.0")
  m.linear("img_emb/fc1", "img_emb.proj.1")
  m.linear("img_emb/fc2", "img_emb.proj.3")
  m.norm("img_emb/norm_out", "img_emb.proj.4")
  for i in range(config.num_layers):
    p, k = f"blocks/{i}", f"blocks.{i}"
    for name in ("q", "k", "v", "o"):
      m.linear(f"{p}/self_attn/{name}", f"{k}.self_attn.{name}")
    for name in ("q", "k", "v", "o", "k_img", "v_img"):
      m.linear(f"{p}/cross_attn/{name}", f"{k}.cross_attn.{name}")
    m.norm(f"{p}/self_attn/norm_q", f"{k}.self_attn.norm_q", bias=False)
    m.norm(f"{p}/self_attn/norm_k", f"{k}.self_attn.norm_k", bias=False)
    for name in ("norm_q", "norm_k", "norm_k_img"):
      m.norm(f"{p}/cross_attn/{name}", f"{k}.cross_attn.{name}", bias=False)
    m.norm(f"{p}/norm3", f"{k}.norm3")
    m.linear(f"{p}/ffn/fc1", f"{k}.ffn.0")
    m.linear(f"{p}/ffn/fc2", f"{k}.ffn.2")
    m.add(f"{p}/modulation", f"{k}.modulation", "reshape", (1, 6, config.dim))
  m.linear("head", "head.head")
  m.add("head_modulation", "head.modulation", "reshape", (1, 2, config.dim))
  if with_embodiment:
    for module, layers in EMBODIMENT_MODULES.items():
      for layer in layers:
        m.add(f"{module}/{layer}/W", f"{module}.{layer}.W")
        m.add(f"{module}/{layer}/b", f"{module}.{layer}.b")
  return m.entries


def text_entries(model, shapes, key_prefix: str = COMPONENT_PREFIXES["text_encoder"]):
  m = _Maps(shapes, "text_encoder/", key_prefix)
  m.add("token_embedding", "token_embedding.weight")
  for i in range(model.text_encoder.config.num_layers):
    p, k = f"blocks/{i}", f"blocks.{i}"
    m.norm(f"{p}/norm1", f"{k}.norm1", bias=False)
    m.norm(f"{p}/norm2", f"{k}.norm2", bias=False)
    for name in ("q", "k", "v", "o"):
      m.linear(f"{p}/{name}", f"{k}.attn.{name}", bias=False)
    m.linear(f"{p}/gate", f"{k}.ffn.gate.0", bias=False)
    m.linear(f"{p}/fc1", f"{k}.ffn.fc1", bias=False)
    m.linear(f"{p}/fc2", f"{k}.ffn.fc2", bias=False)
    m.add(f"{p}/pos_embedding", f"{k}.pos_embedding.embedding.weight")
  m.norm("norm", "norm", bias=False)
  return m.entries


def image_entries(model, shapes, key_prefix: str = COMPONENT_PREFIXES["image_encoder"]):
  config = model.image_encoder.config
  m = _Maps(shapes, "image_encoder/", key_prefix)
  m.add("patch_embedding/kernel", "patch_embedding.weight", "conv_flat", (3, config.patch_size, config.patch_size))
  m.add("cls_embedding", "cls_embedding", "reshape", (1, 1, config.dim))
  m.add("pos_embedding", "pos_embedding", "reshape", (1, config.num_tokens, config.dim))
  m.norm("pre_norm", "pre_norm")
  for i in range(config.num_layers):
    p, k = f"blocks/{i}", f"transformer.{i}"
    m.norm(f"{p}/norm1", f"{k}.norm1")
    m.norm(f"{p}/norm2", f"{k}.norm2")
    m.linear(f"{p}/to_qkv", f"{k}.attn.to_qkv")
    m.linear(f"{p}/proj", f"{k}.attn.proj")
    m.linear(f"{p}/fc1", f"{k}.mlp.0")
    m.linear(f"{p}/fc2", f"{k}.mlp.2")
  m.norm("post_norm", "post_norm")
  m.add("head", "head")
  return m.entries


def vae_entries(model, shapes, key_prefix: str = COMPONENT_PREFIXES["vae"]):
  from ejax.models.dreamzero import vae as vae_lib
  vae = model.vae
  if vae.config.version != "2.1":
    raise CheckpointMismatch("error: the Wan 2.2 VAE is shape-correct only in ejax (ejax/models/dreamzero/vae.py), "
                             "so its released weights cannot be imported or exported; use the 14B (Wan 2.1 VAE) "
                             "or batches with latents computed ahead")
  m = _Maps(shapes, "vae/", key_prefix)

  def conv3d(path, key):
    m.add(f"{path}/kernel", f"{key}.weight", "conv3d")
    m.add(f"{path}/bias", f"{key}.bias")

  def gamma(path, key, images: bool):
    dim = shapes[m.ejax_prefix + path][0]
    m.add(path, key, "reshape", (dim, 1, 1) if images else (dim, 1, 1, 1))

  def layer(path, key, module):
    if isinstance(module, vae_lib.ResidualBlock):
      gamma(f"{path}/norm1/gamma", f"{key}.residual.0.gamma", False)
      conv3d(f"{path}/conv1", f"{key}.residual.2")
      gamma(f"{path}/norm2/gamma", f"{key}.residual.3.gamma", False)
      conv3d(f"{path}/conv2", f"{key}.residual.6")
      if module.shortcut is not None:
        conv3d(f"{path}/shortcut", f"{key}.shortcut")
    elif isinstance(module, vae_lib.AttentionBlock):
      gamma(f"{path}/norm/gamma", f"{key}.norm.gamma", True)
      for name in ("to_qkv", "proj"):
        m.add(f"{path}/{name}/kernel", f"{key}.{name}.weight", "conv1x1")
        m.add(f"{path}/{name}/bias", f"{key}.{name}.bias")
    else:  # Resample
      m.add(f"{path}/conv/kernel", f"{key}.resample.1.weight", "conv2d")
      m.add(f"{path}/conv/bias", f"{key}.resample.1.bias")
      if module.time_conv is not None:
        conv3d(f"{path}/time_conv", f"{key}.time_conv")

  conv3d("conv1", "conv1")
  conv3d("conv2", "conv2")
  for part, stages in (("encoder", "downsamples"), ("decoder", "upsamples")):
    coder = getattr(vae, part)
    conv3d(f"{part}/conv1", f"{part}.conv1")
    for i, module in enumerate(coder.middle):
      layer(f"{part}/middle/{i}", f"{part}.middle.{i}", module)
    for i, module in enumerate(getattr(coder, stages)):
      layer(f"{part}/{stages}/{i}", f"{part}.{stages}.{i}", module)
    gamma(f"{part}/head_norm/gamma", f"{part}.head.0.gamma", False)
    conv3d(f"{part}/head_conv", f"{part}.head.2")
  return m.entries


ENTRIES = {"dit": dit_entries, "text_encoder": text_entries, "image_encoder": image_entries, "vae": vae_entries}


def _abstract(config):
  from ejax.models.dreamzero.model import create
  return nnx.eval_shape(lambda: create(config, nnx.Rngs(0)))


def _check(entries: list[Entry], tensors, *, ignored_prefixes=()) -> list[str]:
  expected = {e.key: e for e in entries}
  ignored = [k for k in tensors if k not in expected and k.startswith(tuple(ignored_prefixes))]
  unexpected = [k for k in tensors if k not in expected and k not in ignored]
  missing = [k for k in expected if k not in tensors]
  misshaped = [f"{k}: checkpoint {tuple(tensors[k].shape)}, model expects {e.checkpoint_shape}"
               for k, e in expected.items() if k in tensors and tuple(tensors[k].shape) != tuple(e.checkpoint_shape)]
  raise_on_mismatch(missing, unexpected, misshaped, what="DreamZero checkpoint",
                    hint="check config.model (configs/dreamzero.py:5b or :14b) against the checkpoint")
  return ignored


def all_entries(model, shapes) -> list[Entry]:
  entries = [e for build in ENTRIES.values() for e in build(model, shapes)]
  unmapped = sorted(set(shapes) - {e.path for e in entries})
  if unmapped:  # a model change without a key-map change: a bug in ejax, not in the checkpoint
    raise AssertionError(f"DreamZero parameters without a checkpoint key: {unmapped[:10]}")
  return entries


def from_release(config, tensors) -> nnx.Module:
  """A concrete DreamZero from a released DreamZero checkpoint's tensors; errors name every mismatch."""
  abstract = _abstract(config)
  shapes = param_shapes(abstract)
  entries = all_entries(abstract, shapes)
  ignored = _check(entries, tensors, ignored_prefixes=IGNORED_PREFIXES)
  if ignored:
    logging.info("DreamZero import: %d known-unused tensors ignored (the CLIP text tower, e.g. %s)",
                 len(ignored), ignored[0])
  return fill_model(abstract, {e.path: e.to_ejax(np.asarray(tensors[e.key])) for e in entries})


def to_release(model) -> dict[str, np.ndarray]:
  arrays = model_arrays(model)
  shapes = {path: a.shape for path, a in arrays.items()}
  return {e.key: e.to_checkpoint(arrays[e.path]) for e in all_entries(model, shapes)}


def load(config, path: str) -> nnx.Module:
  return from_release(config, load_tensors(path))


def save(model, path: str) -> None:
  save_tensors(to_release(model), path, metadata={"format": "pt", "source": "ejax"})


def component_entries(model, name: str, shapes=None) -> list[Entry]:
  """One component's entries under its own release's keys (no DreamZero prefix; a Wan DiT release
  has no action / state modules)."""
  if name not in ENTRIES:
    raise ValueError(f"error: DreamZero component {name!r} is not one of {', '.join(ENTRIES)}")
  shapes = shapes if shapes is not None else param_shapes(model)
  if name == "dit":
    return dit_entries(model, shapes, key_prefix="", with_embodiment=False)
  return ENTRIES[name](model, shapes, key_prefix="")


def load_component(model, name: str, path: str) -> dict[str, np.ndarray]:
  """Parameter arrays (ejax paths) of one component from its own release's safetensors, checked;
  `fill_model` or an nnx state update puts them into a model."""
  entries = component_entries(model, name)
  tensors = load_tensors(path)
  _check(entries, tensors, ignored_prefixes=("textual.", "log_scale") if name == "image_encoder" else ())
  return {e.path: e.to_ejax(np.asarray(tensors[e.key])) for e in entries}


def save_component(model, name: str, path: str) -> None:
  arrays = model_arrays(model)
  entries = component_entries(model, name, {p: a.shape for p, a in arrays.items()})
  save_tensors({e.key: e.to_checkpoint(arrays[e.path]) for e in entries}, path,
               metadata={"format": "pt", "source": "ejax"})


def parameter_count(entries: list[Entry]) -> int:
  return sum(math.prod(e.checkpoint_shape) for e in entries)
