"""LoRA: low-rank adapters on a model's transformer projections (Hu et al. 2021).

Fine-tuning a VLA's language model with LoRA trains a few million adapter weights instead of
billions, so the optimizer state and the gradients of the frozen weights are gone: openpi's
pi0 / pi0.5 LoRA configs (`gemma_2b_lora`, rank 16 on the PaliGemma LLM, and `gemma_300m_lora`,
rank 32 on the action expert, both on attention and MLP) fine-tune on one 24 GB GPU.

`config.model.lora` names the host model's submodules that get adapters, each with its own
settings; rank 0 (the default) leaves a module alone:

    model.lora = {"llm": {"rank": 16, "alpha": 16.0, "targets": "attn,ffn"},
                  "expert": {"rank": 32, "alpha": 32.0, "targets": "attn,ffn"}}

Any projection W (input dims I, output dims O) gets a [*I, r] and b [r, *O]; it computes
x W + (alpha / r) (x a) b. Gemma's stacked einsum weights (ejax.models.gemma) hold their adapters
in the same shapes openpi's checkpoints use (`.../q_einsum/lora_a`, `.../mlp/gating_einsum_lora_a`),
so its LoRA checkpoints import as they are; every other model's layers.Dense / HeadProjection /
OutputProjection inside attention or MLP blocks get a `lora` child. a starts as openpi's normal(0.01)
and b at zero, so a fine-tune starts exactly at the weights it loads.

Only the adapters (and what the model's own filter trains outside the adapted modules) are
trained: the adapted modules' own weights are frozen (`trainable_filter`). `merge` folds the
adapters into the weights for export.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ejax.models import gemma, layers

A_INIT = jax.nn.initializers.normal(0.01)
B_INIT = jax.nn.initializers.zeros
TARGETS = ("attn", "ffn")
LORA = "lora"  # the path element every adapter weight lives under (nnx.PathContains(LORA))


@dataclasses.dataclass(frozen=True)
class LoRASettings:
  rank: int
  alpha: float = 0.0         # 0: alpha = rank (scale 1)
  targets: tuple[str, ...] = TARGETS

  @property
  def scale(self) -> float:
    return (self.alpha or self.rank) / self.rank


def settings(model_config) -> dict[str, LoRASettings]:
  """{module name: settings} of the modules with rank > 0 in model_config.lora (none: {})."""
  lora = model_config.get("lora") if hasattr(model_config, "get") else None
  out = {}
  for name, entry in (dict(lora) if lora else {}).items():
    entry = dict(entry)
    rank = int(entry.get("rank", 0))
    if rank < 0:
      raise ValueError(f"model.lora.{name}.rank is {rank}: use 0 (off) or a positive rank, e.g. 16")
    if not rank:
      continue
    targets = entry.get("targets", TARGETS)
    targets = tuple(t.strip() for t in targets.split(",")) if isinstance(targets, str) else tuple(targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
      raise ValueError(f"model.lora.{name}.targets {targets!r}: use a comma-separated subset of {', '.join(TARGETS)}")
    out[name] = LoRASettings(rank, float(entry.get("alpha", 0.0)), targets)
  return out


class Adapter(nnx.Module):
  """a [*in, r], b [r, *out] for a projection whose kernel is [*in, *out] (`in_ndim` input dims)."""

  def __init__(self, kernel_shape, in_ndim: int, names, config: LoRASettings, *, param_dtype, rngs: nnx.Rngs):
    in_shape, out_shape = tuple(kernel_shape[:in_ndim]), tuple(kernel_shape[in_ndim:])
    self.in_ndim, self.scale = in_ndim, config.scale
    self.a = layers.make_param(rngs, A_INIT, in_shape + (config.rank,), tuple(names[:in_ndim]) + (None,), param_dtype)
    self.b = layers.make_param(rngs, B_INIT, (config.rank,) + out_shape, (None,) + tuple(names[in_ndim:]), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    low = jnp.tensordot(x, self.a[...].astype(x.dtype), self.in_ndim)
    return jnp.tensordot(low, self.b[...].astype(x.dtype), 1) * jnp.asarray(self.scale, x.dtype)

  def delta(self) -> jax.Array:
    """The weight change this adapter makes, shaped like the kernel."""
    return jnp.tensordot(self.a[...], self.b[...], 1) * self.scale


_PROJECTIONS = {layers.Dense: 1, layers.HeadProjection: 1, layers.OutputProjection: 2}


def _projections(module: nnx.Module, targets: tuple[str, ...]):
  """(projection, input dims) of the layers.* projections inside `module`'s attention (attn) and
  MLP (ffn) blocks."""
  kinds = {"attn": (layers.Attention,), "ffn": (layers.MLP, layers.GatedMLP)}
  wanted = tuple(kind for target in targets for kind in kinds[target])
  found = []
  for _, block in nnx.iter_modules(module):
    if isinstance(block, wanted):
      for _, child in nnx.iter_modules(block):
        if type(child) in _PROJECTIONS:
          found.append((child, _PROJECTIONS[type(child)]))
  return found


def _find(model: nnx.Module, name: str) -> list[nnx.Module]:
  return [node for path, node in nnx.iter_modules(model) if path and path[-1] == name]


def attach(model: nnx.Module, model_config, rngs: nnx.Rngs, param_dtype=jnp.float32) -> nnx.Module:
  """Adds the adapters model_config.lora asks for to `model` (in place; returned for chaining)."""
  for name, config in settings(model_config).items():
    modules = _find(model, name)
    if not modules:
      children = sorted({str(path[0]) for path, _ in nnx.iter_modules(model) if path})
      raise ValueError(f"model.lora.{name}: the model has no submodule {name!r}; use one of {', '.join(children)}")
    for module in modules:
      if isinstance(module, gemma.GemmaDecoder):
        module.layers.lora = gemma.GemmaLoRA(module.config, config, A_INIT, B_INIT, rngs=rngs,
                                             param_dtype=param_dtype)
        continue
      projections = _projections(module, config.targets)
      if not projections:
        raise ValueError(f"model.lora.{name}: {type(module).__name__} has no attention or MLP projections to adapt")
      for projection, in_ndim in projections:
        kernel = projection.kernel
        projection.lora = Adapter(kernel.shape, in_ndim, kernel.out_sharding, config, param_dtype=param_dtype,
                                  rngs=rngs)
  return model


def trainable_filter(base_filter, model_config):
  """The model's own filter, less the adapted modules' weights, plus every adapter."""
  names = list(settings(model_config))
  if not names:
    return base_filter
  adapted = nnx.Any(*[nnx.PathContains(name) for name in names])
  return nnx.Any(nnx.All(nnx.Param, nnx.PathContains(LORA)),
                 nnx.All(base_filter, nnx.Not(adapted)))


def merge(model: nnx.Module) -> nnx.Module:
  """Folds every adapter into its weights and removes it (in place; returned): the model then has
  the released architecture and computes the same function."""
  for _, node in list(nnx.iter_modules(model)):
    lora = getattr(node, LORA, None)
    if isinstance(lora, Adapter):
      node.kernel[...] = (node.kernel[...] + lora.delta().astype(node.kernel.dtype))
      node.lora = None
    elif isinstance(lora, gemma.GemmaLoRA):
      for name, delta in lora.deltas().items():
        weight = getattr(node, name)
        weight[...] = weight[...] + delta.astype(weight.dtype)
      node.lora = None
  return model


def without_adapters(model_config):
  """model_config with no LoRA (the released model's config)."""
  if not model_config.get("lora"):
    return model_config
  config = model_config.copy_and_resolve_references()
  with config.unlocked():
    del config["lora"]
  return config


def has_adapters(model: nnx.Module) -> bool:
  return any(getattr(node, LORA, None) is not None for _, node in nnx.iter_modules(model))


def count(model_or_state: Any) -> int:
  """Adapter parameters in a model or state."""
  state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state
  return sum(int(np.size(v.get_value() if isinstance(v, nnx.Variable) else v)) for path, v in nnx.to_flat_state(state)
             if LORA in path)
