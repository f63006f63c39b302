"""Job `convert`: released checkpoints <-> ejax parameter checkpoints, dispatched by model name.

    python -m ejax.main --config=configs/groot.py --config.job=convert \
        --config.convert.direction=import --config.convert.source=/ckpt/GR00T-N1.5-3B \
        --config.convert.destination=/ckpt/groot_ejax
    ... --config.convert.direction=export --config.convert.source=/ckpt/groot_ejax \
        --config.convert.destination=/ckpt/out/model.safetensors

"import" reads the released layout (safetensors), checks every tensor against config.model and
writes the parameters as an orbax checkpoint (a pure dict of the model's nnx.Param state);
"export" does the reverse. A model plugs in with a module exposing `load(model_config, path)
-> nnx.Module` and `save(model, path)`: `ejax.models.io.<model name>` unless listed below.
"""

from __future__ import annotations

import importlib
import os

from absl import logging
from flax import nnx

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
  checkpointer.save(os.path.abspath(directory), nnx.state(model, nnx.Param).to_pure_dict(), force=True)
  checkpointer.wait_until_finished()


def restore_params(model_config, directory: str) -> nnx.Module:
  import orbax.checkpoint as ocp
  spec = get_model_spec(model_config.name)
  abstract = nnx.eval_shape(lambda: spec.create(model_config, nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  restored = ocp.StandardCheckpointer().restore(os.path.abspath(directory), params.to_pure_dict())
  nnx.replace_by_pure_dict(params, restored)
  return nnx.merge(graphdef, params, rest)


def run_job(config, workdir: str) -> None:
  del workdir
  options = config.convert
  if options.direction not in ("import", "export"):
    raise ValueError(f"config.convert.direction={options.direction!r}: use 'import' or 'export'")
  if not options.source or not options.destination:
    raise ValueError("set config.convert.source and config.convert.destination")
  io = converter(config.model.name)
  if options.direction == "import":
    model = io.load(config.model, options.source)
    save_params(model, options.destination)
  else:
    model = restore_params(config.model, options.source)
    io.save(model, options.destination)
  logging.info("convert %s: %s -> %s", options.direction, options.source, options.destination)
  print(f"convert {options.direction}: {options.source} -> {options.destination}")
