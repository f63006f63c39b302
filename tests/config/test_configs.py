"""Every config file loads, validates, and exposes the variants its docstring promises."""

import glob
import os

import pytest

from ejax.config import ConfigError, parse_arg, validate
from ejax.jobs import JOBS
from ejax.models.registry import MODELS
from tests.train.helpers import REPO, load_config

CONFIG_FILES = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "configs", "*.py"))
                      if not os.path.basename(p).startswith(("_", "common")))


def test_there_are_configs():
  assert "configs/groot.py" in CONFIG_FILES


@pytest.mark.parametrize("path", CONFIG_FILES)
@pytest.mark.parametrize("arg", [None, "runlocal"])
def test_config_loads_and_validates(path, arg, tmp_path):
  config = load_config(path, arg)
  assert config.job in JOBS
  if "model" in config and config.model.get("name"):
    assert config.model.name in MODELS
  data = config.get("data")
  if data is not None and data.get("name") in ("lerobot", "rlds") and not data.get("path") and config.job == "train":
    with pytest.raises(ConfigError, match="needs --config.data.path"):
      validate(config)
    data.path = str(tmp_path)
  validate(config)
  with open(os.path.join(REPO, path)) as f:
    head = f.read(2000)
  assert "python -m ejax.main" in head, f"{path}'s docstring should say how to launch it"


def test_runlocal_is_smaller():
  full, local = load_config("configs/groot.py"), load_config("configs/groot.py", "runlocal")
  assert local.train.steps < full.train.steps
  assert local.train.global_batch_size < full.train.global_batch_size


def test_parse_arg():
  args = parse_arg("runlocal,steps=20,lr=1e-3", runlocal=False, steps=0, lr=0.0)
  assert args.runlocal is True and args.steps == 20 and args.lr == 1e-3
  with pytest.raises(ValueError, match="'stpes' is not one of"):
    parse_arg("stpes=3", runlocal=False, steps=0)


def test_validate_names_the_field():
  config = load_config("configs/groot.py", "runlocal")
  config.train.global_batch_size = 30
  config.train.grad_accum_steps = 4
  with pytest.raises(ConfigError, match="global_batch_size=30 is not divisible by train.grad_accum_steps=4"):
    validate(config)
