"""Job `summary`: parameter counts per component and the bytes each device would hold, without
allocating the model (everything runs on `nnx.eval_shape` abstract shapes).

A model plugs in by declaring, in the module its registry entry points at:
  COMPONENTS: dict[str, tuple[str, ...]]  component name -> parameter path prefixes, where a path
      is the '/'-joined nnx state path (e.g. "action_head/dit"); a parameter belongs to the first
      component with a matching prefix, the rest is reported as "other";
  trainable_filter(model_config) -> nnx filter  (optional) which parameters the trainer updates.

    python -m ejax.main --config=configs/groot.py --config.job=summary
"""

from __future__ import annotations

import importlib
import json
import math
import os
from typing import Any, Mapping, Sequence

import jax
from flax import nnx

from ejax.models.registry import MODELS, get_model_spec
from ejax.parallel.axes import MESH_AXES
from ejax.parallel.mesh import resolve_mesh_shape
from ejax.parallel.params import variable_axis_names
from ejax.parallel.rules import logical_to_spec

OTHER = "other"


class _MeshShape:
  """Just enough of a Mesh for `logical_to_spec`: sizes per axis, no devices needed."""

  def __init__(self, shape: Mapping[str, int]):
    self.shape = dict(shape)


def model_module(model_name: str):
  get_model_spec(model_name)  # validates the name with a helpful error
  return importlib.import_module(MODELS[model_name].split(":")[0])


def abstract_model(model_config) -> nnx.Module:
  spec = get_model_spec(model_config.name)
  return nnx.eval_shape(lambda: spec.create(model_config, nnx.Rngs(0)))


def _path_string(path: Sequence[Any]) -> str:
  return "/".join(str(getattr(p, "key", p)) for p in path)


def component_of(path: str, components: Mapping[str, Sequence[str]]) -> str:
  for name, prefixes in components.items():
    for prefix in prefixes:
      if path == prefix or path.startswith(prefix + "/"):
        return name
  return OTHER


def _shard_elements(shape: Sequence[int], spec, mesh_shape: Mapping[str, int]) -> int:
  count = 1
  for dim, size in enumerate(shape):
    axes = spec[dim] if dim < len(spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    count *= -(-size // math.prod(mesh_shape[a] for a in axes)) if axes else size
  return count


def summarize(model_config, mesh_sizes: Mapping[str, int], rules: Sequence[tuple[str, Any]],
              num_devices: int | None = None, train=None) -> dict[str, Any]:
  """Counts and per-device bytes of the model's parameters (nnx.Param) under a mesh and rules; with
  `train` (config.train) also the train state a device holds: trained parameters in the master
  dtype with their Adam moments (and EMA copy), frozen ones in train.frozen_dtype."""
  module = model_module(model_config.name)
  components: Mapping[str, Sequence[str]] = getattr(module, "COMPONENTS", {})
  model = abstract_model(model_config)
  # The registry's filter: the model's own, with LoRA's adapters (ejax.models.lora) when configured.
  trainable_state = nnx.state(model, get_model_spec(model_config.name).trainable_filter(model_config))
  trainable_paths = {_path_string(p) for p, _ in nnx.to_flat_state(trainable_state)}
  state_bytes = {"trained": 0, "optimizer": 0, "ema": 0, "frozen": 0}
  master = jax.numpy.dtype(train.get("param_dtype", "float32")).itemsize if train is not None else 4
  ema = train is not None and train.get("ema_decay", 0) > 0
  frozen_dtype = train.get("frozen_dtype") if train is not None else None
  sizes = dict(mesh_sizes)
  if num_devices is None:
    num_devices = jax.device_count() if -1 in sizes.values() else math.prod(max(v, 1) for v in sizes.values())
  mesh_shape = resolve_mesh_shape(sizes, num_devices)
  fake_mesh = _MeshShape(mesh_shape)

  counts = {name: 0 for name in list(components) + [OTHER]}
  bytes_per_device = {name: 0 for name in counts}
  trainable = 0
  largest_replicated = ("", 0)
  for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    path_str = _path_string(path)
    value = variable.get_value()
    names = variable_axis_names(variable)
    spec = logical_to_spec(names, rules, shape=value.shape, mesh=fake_mesh)
    size = math.prod(value.shape)
    nbytes = _shard_elements(value.shape, spec, mesh_shape) * value.dtype.itemsize
    name = component_of(path_str, components)
    counts[name] += size
    bytes_per_device[name] += nbytes
    elements = _shard_elements(value.shape, spec, mesh_shape)
    if path_str in trainable_paths:
      trainable += size
      state_bytes["trained"] += elements * master
      state_bytes["optimizer"] += 2 * elements * 4  # Adam's two fp32 moments
      state_bytes["ema"] += elements * master if ema else 0
    else:
      state_bytes["frozen"] += elements * (jax.numpy.dtype(frozen_dtype).itemsize if frozen_dtype
                                           else value.dtype.itemsize)
    if all(axis is None for axis in spec) and size * value.dtype.itemsize > largest_replicated[1]:
      largest_replicated = (path_str, size * value.dtype.itemsize)
  if not counts[OTHER]:
    del counts[OTHER], bytes_per_device[OTHER]
  return {
      "model": model_config.name,
      "mesh": mesh_shape,
      "param_counts": counts,
      "total_params": sum(counts.values()),
      "trainable_params": trainable,
      "lora_params": sum(size for path, size in _sizes(model) if "/lora/" in f"/{path}/"),
      "train_state_bytes_per_device": state_bytes if train is not None else None,
      "param_bytes_per_device": bytes_per_device,
      "total_param_bytes_per_device": sum(bytes_per_device.values()),
      "largest_replicated_param": {"path": largest_replicated[0], "bytes": largest_replicated[1]},
  }


def _sizes(model):
  return [(_path_string(path), math.prod(v.get_value().shape))
          for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def format_summary(summary: Mapping[str, Any]) -> str:
  mesh = " x ".join(f"{axis}={summary['mesh'][axis]}" for axis in MESH_AXES)
  lines = [f"model {summary['model']} on mesh {mesh}",
           f"{'component':<28}{'params':>16}{'bytes/device':>18}"]
  for name, count in summary["param_counts"].items():
    lines.append(f"{name:<28}{count:>16,}{summary['param_bytes_per_device'][name]:>18,}")
  lines.append(f"{'total':<28}{summary['total_params']:>16,}{summary['total_param_bytes_per_device']:>18,}")
  lines.append(f"{'trainable':<28}{summary['trainable_params']:>16,}")
  if summary.get("lora_params"):
    lines.append(f"{'  of which LoRA adapters':<28}{summary['lora_params']:>16,}")
  state = summary.get("train_state_bytes_per_device")
  if state:
    gib = 2**30
    lines.append(f"train state per device: {sum(state.values()) / gib:.2f} GiB (trained {state['trained'] / gib:.2f} + "
                 f"Adam {state['optimizer'] / gib:.2f} + EMA {state['ema'] / gib:.2f} + frozen {state['frozen'] / gib:.2f});"
                 " activations come on top: python -m ejax.train.compile_report measures the whole step")
  largest = summary["largest_replicated_param"]
  lines.append(f"largest fully replicated parameter: {largest['path'] or '-'} ({largest['bytes']:,} bytes)")
  return "\n".join(lines)


def run_job(config, workdir: str) -> dict[str, Any]:
  if not (config.get("model") or {}).get("name"):
    from ejax.config.validate import ConfigError
    raise ConfigError("job summary describes a model, and this config has no model: use configs/groot.py, "
                      "configs/pi05.py or configs/tiny.py with --config.job=summary")
  rules = [tuple(rule) for rule in config.sharding_rules]
  summary = summarize(config.model, dict(config.mesh), rules, train=config.get("train"))
  text = format_summary(summary)
  print(text)
  if workdir:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  return summary
