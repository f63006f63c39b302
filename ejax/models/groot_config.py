"""GR00T's model config as typed settings (GrootConfig), read once where the model is built.

`read(model_config)` upgrades a config saved before one of today's keys existed, refuses a key GR00T
does not have, and gives the sub-models their dataclasses (vision: SiglipConfig, llm: Qwen3Config,
vl_transformer: VLTransformerConfig, dit: DiTConfig with the LLM's width as its cross-attention
width); model.perception becomes its settings (None: the released model). The fields and their
meanings are ejax.models.groot.model_config's.
"""

from __future__ import annotations

import dataclasses

from ejax.models import typed_config
from ejax.models.dit import DiTConfig, VLTransformerConfig
from ejax.models.perception import PerceptionConfig
from ejax.models.qwen3 import Qwen3Config
from ejax.models.siglip import SiglipConfig
from ejax.models.typed_config import OPTIONAL, Section


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
  num_layers: int = 1
  use_pixel_shuffle: bool = False


@dataclasses.dataclass(frozen=True)
class PackingConfig:
  row_length: int = 0
  samples_per_row: int = 0
  max_row_length: int = 4096
  probe_samples: int = 512


@dataclasses.dataclass(frozen=True)
class GrootConfig:
  name: str
  dtype: str
  param_dtype: str
  fp8: bool
  fp8_impl: str | bool        # True: a checkpoint from before fp8_impl (DiT's default FP8 path)
  remat: str
  attention_impl: str
  scan_layers: bool
  vision: SiglipConfig
  connector: ConnectorConfig
  llm: Qwen3Config
  vl_transformer: VLTransformerConfig
  dit: DiTConfig
  hidden_size: int
  max_num_embodiments: int
  max_state_dim: int
  max_action_dim: int
  action_horizon: int
  num_future_tokens: int
  max_seq_len: int
  num_inference_steps: int
  num_timestep_buckets: int
  num_cameras: int
  image_token_id: int
  tokenizer_path: str
  text_first: bool
  packing: PackingConfig
  perception: PerceptionConfig | None
  tune_llm: bool
  tune_visual: bool
  tune_projector: bool
  tune_diffusion_model: bool
  # The shapes of ejax/data/synthetic.py's demonstrations (model_config("runlocal") only).
  state_dim: int = dataclasses.field(default=0, metadata=OPTIONAL)
  action_dim: int = dataclasses.field(default=0, metadata=OPTIONAL)
  horizon: int = dataclasses.field(default=0, metadata=OPTIONAL)
  num_tasks: int = dataclasses.field(default=0, metadata=OPTIONAL)


SECTIONS = {
    "vision": Section(SiglipConfig, unsaved=("norm_eps", "act")),
    "connector": Section(ConnectorConfig),
    "llm": Section(Qwen3Config, unsaved=("norm_eps",)),
    "vl_transformer": Section(VLTransformerConfig),
    "dit": Section(DiTConfig, derived={"cross_attention_dim": lambda config: config["llm"]["width"]},
                   unsaved=("timestep_channels",)),
    "packing": Section(PackingConfig),
}


def read(model_config) -> GrootConfig:
  return typed_config.read(model_config, GrootConfig, SECTIONS)


def to_config(settings: GrootConfig):
  return typed_config.to_config(settings, SECTIONS)
