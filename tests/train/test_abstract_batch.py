"""compile_report.abstract_batch: the shapes the --startup line compiles a step for are those of a real
batch, packed rows included when the batch does not fill its last row."""

import jax
import numpy as np
import pytest

from ejax.models.registry import example_config, get_model_spec
from ejax.parallel import make_mesh
from ejax.train.compile_report import abstract_batch
from tests.train.helpers import load_config


@pytest.mark.parametrize("global_batch", [24, 32])
def test_shapes_match_the_example_batch_of_that_many_samples(global_batch):
  """GR00T runlocal packs 3 samples a row: 32 samples make 11 rows, the last with two (ejax/data/row_plan.py).
  The --startup line of configs/groot.py:runlocal refused that batch before 2026-12-01."""
  config = load_config("configs/groot.py", "runlocal")
  assert config.model.packing.samples_per_row == 3
  mesh = make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  rules = [tuple(rule) for rule in config.sharding_rules]
  got = abstract_batch(config.model, global_batch, mesh, rules)
  model = example_config(config.model, global_batch)
  want = get_model_spec(model.name).example_batch(model, global_batch, 0)
  want = {k: v for k, v in want.items() if isinstance(v, np.ndarray) and v.dtype != object}
  assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in want.items()}
  assert got["vl_tokens"].shape[0] == -(-global_batch // 3)
