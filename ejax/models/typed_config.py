"""A model config read into typed settings at the model's boundary, once.

    settings = read(model_config, GrootConfig, SECTIONS)   # a frozen dataclass; the modules read its fields

`read` runs the one upgrade step for configs saved before a key existed (ejax.models.config_upgrade),
refuses a key the model does not have with one error naming it and the model (a ConfigError: one
`error:` line from ejax.main, a ValueError to library callers), turns each nested section into its
sub-model's dataclass (SiglipConfig, Qwen3Config, ...) and model.perception into its settings (None:
the released model). `to_config` writes the settings back in the config's layout.

A section's `derived` fields are computed from the rest of the config (DiT's cross_attention_dim is
the LLM's width), not config keys; its `unsaved` fields are ones the config leaves at the sub-model's
default (SigLIP's norm_eps), written back only when set. A top-level field whose metadata is
OPTIONAL is one a config may leave out (written back only when set).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import ml_collections

from ejax.config.validate import ConfigError
from ejax.models import perception
from ejax.models.config_upgrade import upgrade_model_config
from ejax.models.perception.config import GROUPS

OPTIONAL = {"optional": True}
# Keys every model config may hold that the model itself does not read: the registry's LoRA wrapper
# reads and checks model.lora (ejax.models.lora).
OTHER_KEYS = ("lora",)


@dataclasses.dataclass(frozen=True)
class Section:
  kind: type
  derived: dict[str, Callable[[dict], Any]] = dataclasses.field(default_factory=dict)
  unsaved: tuple[str, ...] = ()


def _plain(value):
  return value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value


def _unknown(given, known, where: str, name: str) -> None:
  unknown = sorted(set(given) - set(known))
  if unknown:
    raise ConfigError(f"{where}.{unknown[0]} is not a {name} setting: {where} has {', '.join(sorted(known))}")


def read(model_config, kind: type, sections: dict[str, Section]):
  """model_config (a ConfigDict or dict, possibly saved before some of today's keys) as `kind`."""
  config = upgrade_model_config(ml_collections.ConfigDict(_plain(model_config)))
  values = {key: _plain(value) for key, value in config.items() if key not in OTHER_KEYS}
  fields = {field.name: field for field in dataclasses.fields(kind)}
  name = values.get("name", kind.__name__)
  _unknown(values, fields, "model", name)
  missing = sorted(key for key, field in fields.items() if key not in values and not _has_default(field))
  if missing:
    raise ConfigError(f"model.{missing[0]} is missing from the {name} config (a config older than the key, with no "
                     f"entry in ejax.models.config_upgrade.ADDED_KEYS)")
  raw = dict(values)
  for key, section in sections.items():
    if key in values:
      given = dict(values[key] or {})
      _unknown(given, set(f.name for f in dataclasses.fields(section.kind)) - set(section.derived),
               f"model.{key}", name)
      derived = {field: compute(raw) for field, compute in section.derived.items()}
      values[key] = section.kind(**given, **derived)
  if "perception" in fields:
    values["perception"] = perception.read(config)
  return kind(**{key: tuple(value) if isinstance(value, list) else value for key, value in values.items()})


def _has_default(field) -> bool:
  return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def _default(field):
  return field.default if field.default is not dataclasses.MISSING else field.default_factory()


def to_config(settings, sections: dict[str, Section]) -> ml_collections.ConfigDict:
  """The settings in the config's layout (what `read` reads back to the same settings)."""
  out = {}
  for field in dataclasses.fields(settings):
    value = getattr(settings, field.name)
    if field.metadata.get("optional") and value == _default(field):
      continue
    if field.name in sections:
      section = sections[field.name]
      value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name not in section.derived
               and not (f.name in section.unsaved and getattr(value, f.name) == _default(f))}
    elif field.name == "perception":
      value = {} if value is None else dict(image_size=value.image_size, **{
          group: dataclasses.asdict(getattr(value, group)) for group in GROUPS})
    out[field.name] = value
  return ml_collections.ConfigDict(out)
