"""Job `convert`: released checkpoints <-> ejax parameter checkpoints, dispatched by model name.

    python -m ejax.main --config=configs/groot.py --config.job=convert \
        --config.convert.direction=import --config.convert.source=/ckpt/GR00T-N1.5-3B \
        --config.convert.destination=/ckpt/groot_ejax
    ... --config.convert.direction=export --config.convert.source=/ckpt/groot_ejax \
        --config.convert.destination=/ckpt/out/model.safetensors

"import" reads the released layout (safetensors), checks every tensor against config.model and
writes the parameters as an orbax checkpoint (a pure dict of the model's nnx.Param state);
"export" does the reverse, LoRA adapters merged into the weights they adapt. A model plugs in
with a module exposing `load(model_config, path) -> nnx.Module` and `save(model, path)`:
`ejax.models.io.<model name>` unless listed below.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from absl import logging
from flax import nnx

from ejax.models import lora
from ejax.models.registry import get_model_spec

CONVERTERS: dict[str, str] = {"groot": "ejax.models.io.groot"}


def converter(model_name: str):
  module = CONVERTERS.get(model_name, f"ejax.models.io.{model_name}")
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    raise ValueError(f"no weight converter for model {model_name!r} (looked for module {module})") from e


def save_params(model: nnx.Module, directory: str) -> None:
  import orbax.checkpoint as ocp
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.abspath(directory), nnx.to_pure_dict(nnx.state(model, nnx.Param)), force=True)
  checkpointer.wait_until_finished()


def restore_params(model_config, directory: str) -> nnx.Module:
  import orbax.checkpoint as ocp
  spec = get_model_spec(model_config.name)
  abstract = nnx.eval_shape(lambda: spec.create(model_config, nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  restored = ocp.StandardCheckpointer().restore(os.path.abspath(directory), nnx.to_pure_dict(params))
  nnx.replace_by_pure_dict(params, restored)
  return nnx.merge(graphdef, params, rest)


def check_config(config) -> None:
  """The convert job's settings, checked before it reads a tensor: one line naming the setting and the
  fix (ejax.main prints it)."""
  from ejax.config.validate import ConfigError, require_one_of, require_path, require_section
  from ejax.checkpoint.kinds import IMPORTED, RL, TRAIN, checkpoint_kind
  options = require_section(config, "convert", "a model config (configs/groot.py, configs/pi05.py)")
  name = (config.get("model") or {}).get("name")
  if not name:
    raise ConfigError("job convert converts a model's weights, and this config has no model: use configs/groot.py or "
                      "configs/pi05.py with --config.job=convert")
  require_one_of("convert.direction", options.direction, ("import", "export"))
  module = CONVERTERS.get(name, f"ejax.models.io.{name}")
  if importlib.util.find_spec(module) is None:
    raise ConfigError(f"model.name={name!r} has no weight converter ({module}): the convert job imports and exports "
                      "groot and pi05")
  released = "the released checkpoint (a *.safetensors file or a directory of them)"
  imported = "the destination of an earlier import (an orbax directory of the model's parameters)"
  if options.direction == "import":
    source = require_path("convert.source", options.source, released)
    if checkpoint_kind(source) in (TRAIN, RL):  # (openpi's released params are orbax directories too)
      raise ConfigError(f"convert.source={options.source!r} is an ejax job's checkpoints, not released weights: import reads "
                        f"{released}; to write released weights use --config.convert.direction=export")
  else:
    source = require_path("convert.source", options.source, imported)
    if checkpoint_kind(source) != IMPORTED:
      raise ConfigError(f"convert.source={options.source!r} is not weights the convert job imported: export reads "
                        f"{imported}")
  if not options.destination:
    raise ConfigError("convert.destination is not set: pass --config.convert.destination=<a new path to write>")
  destination = os.path.abspath(os.path.expanduser(options.destination))
  if os.path.exists(destination) and (not os.path.isdir(destination) or os.listdir(destination)):
    raise ConfigError(f"convert.destination={options.destination!r} already exists: pass a new path (the convert "
                      "job never overwrites)")


def run_job(config, workdir: str) -> None:
  del workdir
  check_config(config)
  options = config.convert
  io = converter(config.model.name)
  if options.direction == "import":
    model = io.load(config.model, options.source)
    save_params(model, options.destination)
  else:
    model = restore_params(config.model, options.source)
    io.save(lora.merge(model), options.destination)  # LoRA adapters folded in: the released layout
  logging.info("convert %s: %s -> %s", options.direction, options.source, options.destination)
  print(f"convert {options.direction}: {options.source} -> {options.destination}")
