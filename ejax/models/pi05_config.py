"""pi0.5's model config as typed settings (Pi05Config), read once where the model is built.

`read(model_config)` upgrades a config saved before one of today's keys existed, refuses a key pi0.5
does not have, and gives the sub-models their dataclasses (vision: SiglipConfig; paligemma and
action_expert: GemmaConfig, the expert's norms adaRMS on its own width); model.perception becomes
its settings (None: the released model). The fields and their meanings are
ejax.models.pi05.model_config's.
"""

from __future__ import annotations

import dataclasses

from ejax.models import typed_config
from ejax.models.gemma import GemmaConfig
from ejax.models.perception import PerceptionConfig
from ejax.models.siglip import SiglipConfig
from ejax.models.typed_config import Section


@dataclasses.dataclass(frozen=True)
class PackingConfig:
  row_length: int = 0
  samples_per_row: int = 0
  max_images_per_sample: int = 3
  max_row_length: int = 4096
  probe_samples: int = 512


@dataclasses.dataclass(frozen=True)
class Pi05Config:
  name: str
  dtype: str
  param_dtype: str
  vision: SiglipConfig
  paligemma: GemmaConfig
  action_expert: GemmaConfig
  action_dim: int
  action_horizon: int
  max_state_dim: int
  num_cameras: int
  max_token_len: int
  num_inference_steps: int
  tokenizer_path: str
  packing: PackingConfig
  remat: str
  attention_impl: str
  fp8: bool
  fp8_impl: str
  scan_layers: bool
  perception: PerceptionConfig | None
  perception_tokens: bool
  continuous_state: bool
  discrete_state_input: bool
  train_vision: bool
  train_llm: bool


SECTIONS = {
    "vision": Section(SiglipConfig, unsaved=("norm_eps", "act")),
    "paligemma": Section(GemmaConfig, unsaved=("adarms_cond_dim",)),
    "action_expert": Section(GemmaConfig, derived={"adarms_cond_dim": lambda config: config["action_expert"]["width"]},
                             unsaved=("vocab_size",)),
    "packing": Section(PackingConfig),
}


def read(model_config) -> Pi05Config:
  return typed_config.read(model_config, Pi05Config, SECTIONS)


def to_config(settings: Pi05Config):
  return typed_config.to_config(settings, SECTIONS)
