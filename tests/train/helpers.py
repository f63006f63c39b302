"""Small, fast training configs shared by the trainer tests."""

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_config(path: str, arg: str | None = None):
  spec = importlib.util.spec_from_file_location("config_under_test", os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def tiny_config(steps: int = 4, batch: int = 16, mesh=(-1, 1, 1)):
  """configs/tiny.py:runlocal shrunk further: fp32, logged every step, no side outputs."""
  config = load_config("configs/tiny.py", "runlocal")
  config.model.width, config.model.depth, config.model.num_heads = 32, 2, 4
  config.train.steps, config.train.global_batch_size = steps, batch
  config.train.compute_dtype = "float32"
  config.train.warmup_fraction = 0.25
  config.metrics.log_every_steps = 1
  config.metrics.tensorboard = False
  config.metrics.progress_bar = False
  config.checkpoint.every_steps = 1000
  config.checkpoint.async_save = False
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
  config.compilation_cache_dir = ""  # keep the test session's cache (tests/conftest.py)
  return config


def losses(result) -> list[float]:
  return [entry["loss"] for entry in result["history"]]
