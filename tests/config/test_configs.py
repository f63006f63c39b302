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


@pytest.mark.parametrize("path", ["configs/groot.py", "configs/pi05.py"])
def test_suites_is_one_recipe_for_both_models(path):
  """`suites` is the same 15-task recipe on GR00T and pi0.5 (common.sim_suites_recipe): the same
  recording (so one cache serves both), perception and inference; only the packed row is the model's."""
  config = load_config(path, "suites")
  validate(config)
  groot = load_config("configs/groot.py", "suites")
  assert config.data.sim_demos.to_dict() == groot.data.sim_demos.to_dict()
  assert config.data.sim_demos.tasks == "all" and config.data.sim_demos.miss_grasp_prob == 0.3
  assert config.model.perception.to_dict() == groot.model.perception.to_dict()
  assert config.model.perception.geometry.cameras, "the suites recipe places the estimate through the cameras"
  assert (config.model.num_inference_steps, config.train.steps) == (2, 7000)


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
