"""train.embodiment_rows (ejax/train/rows.py): the optimizer updates only the embodiment tables' rows
the data uses; those rows and every other parameter move exactly as with the dense update, the other
rows do not move at all, and a batch with an id outside the rows is one clear line."""

import jax
import numpy as np
import pytest
from flax import nnx
from ml_collections import ConfigDict

from ejax.errors import UserError
from ejax.models.registry import get_model_spec
from ejax.parallel import global_batch, make_mesh
from ejax.parallel.axes import EMBODIMENT
from ejax.parallel.params import variable_axis_names
from ejax.train import rows as rows_lib
from ejax.train.optim import make_optimizer
from ejax.train.state import create_train_state, model_parts
from ejax.train.step import jit_train_step, make_train_step
from tests.train.helpers import load_config


def _variables(tree):
  return [(jax.tree_util.keystr(path), variable) for path, variable in
          jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
          if isinstance(variable, nnx.Variable)]


def _leaves(tree):
  return {path: np.asarray(variable.get_value()) for path, variable in _variables(tree)}


def _tables(tree):
  """{path: array} of the embodiment tables in a state of nnx Variables."""
  return {path: np.asarray(variable.get_value()) for path, variable in _variables(tree)
          if (variable_axis_names(variable) or (None,))[0] == EMBODIMENT}


def _two_steps(rows: str, weight_decay: float):
  config = load_config("configs/groot.py", "runlocal,dataset=synthetic")  # 2 embodiment slots
  config.train.update(embodiment_rows=rows, weight_decay=weight_decay, learning_rate=1e-2, warmup_fraction=0.0)
  mesh = make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  rules = [tuple(r) for r in config.sharding_rules]
  tx, schedule = make_optimizer(config.train)
  example = get_model_spec("groot").example_batch(config.model, 4, 0)
  arrays = {k: v for k, v in example.items() if isinstance(v, np.ndarray) and v.dtype != object}
  arrays["embodiment_id"] = np.ones_like(arrays["embodiment_id"])  # every sample is robot 1
  with mesh:
    state, shardings = create_train_state(config.model, config.train, tx, mesh, rules, seed=0)
    before = _tables(state.params)
    batch = global_batch(arrays, mesh, rules)
    step = jit_train_step(make_train_step(model_parts(config.model), tx, schedule, config.train), shardings,
                          jax.tree.map(lambda x: x.sharding, batch), mesh)
    for _ in range(2):
      state, metrics = step(state, batch)
  return before, state, metrics


def test_the_trained_rows_move_as_with_the_dense_update_and_the_others_not_at_all():
  before, dense, dense_metrics = _two_steps("all", weight_decay=0.1)
  _, sparse, sparse_metrics = _two_steps("1", weight_decay=0.1)
  np.testing.assert_allclose(sparse_metrics["loss"], dense_metrics["loss"], rtol=1e-6)
  np.testing.assert_allclose(sparse_metrics["grad_norm"], dense_metrics["grad_norm"], rtol=1e-5)
  dense_tables, sparse_tables = _tables(dense.params), _tables(sparse.params)
  assert dense_tables.keys() == sparse_tables.keys() and len(dense_tables) >= 10
  for path, table in sparse_tables.items():
    np.testing.assert_allclose(table[1], dense_tables[path][1], rtol=1e-5, atol=1e-6, err_msg=path)
    np.testing.assert_array_equal(table[0], before[path][0], err_msg=path)  # untouched, not even decayed
    if table.ndim >= 3:  # the W tables decay under the dense update: its row 0 moved
      assert not np.array_equal(dense_tables[path][0], before[path][0]), path
  # Every other parameter: the same update.
  others = lambda state: {path: value for path, value in _leaves(state.params).items() if path not in dense_tables}
  dense_others, sparse_others = others(dense), others(sparse)
  assert dense_others.keys() == sparse_others.keys() and len(dense_others) > 20
  for path, value in sparse_others.items():
    np.testing.assert_allclose(value, dense_others[path], rtol=1e-5, atol=1e-6, err_msg=path)
  # The Adam moments hold the one trained row.
  sparse_moments = _tables(sparse.opt_state)
  assert sparse_moments and all(m.shape[0] == 1 for m in sparse_moments.values())
  assert all(m.shape[0] == 2 for m in _tables(dense.opt_state).values())


def test_rows_are_read_from_the_config_and_a_batch_outside_them_is_one_line():
  assert rows_lib.from_train({"embodiment_rows": "all"}) is None
  assert rows_lib.from_train({}) is None
  assert rows_lib.from_train({"embodiment_rows": "0,31"}).rows == (0, 31)
  for bad in ("x", "1,1", "-2", ""):
    with pytest.raises(UserError, match="train.embodiment_rows"):
      rows_lib.from_train({"embodiment_rows": bad})
  with pytest.raises(UserError, match="not resolved"):
    rows_lib.from_train({"embodiment_rows": "data"})
  rows_lib.from_train({"embodiment_rows": "0,31"}).check(np.array([31, 0, 31]))
  with pytest.raises(UserError, match=r"embodiment id\(s\) \[5\], outside train.embodiment_rows='0,31'"):
    rows_lib.from_train({"embodiment_rows": "0,31"}).check(np.array([0, 5]))


def test_the_full_groot_config_trains_the_rows_its_data_names():
  config = load_config("configs/groot.py")  # resolved as ejax.main resolves it
  assert config.train.embodiment_rows == "0"
  raw = ConfigDict({"train": {"embodiment_rows": "data"},
                     "data": {"embodiment_id": {"so100": 31, "gr1": 7, "so101": 31}}})  # {robot_type: id}
  assert rows_lib.resolve(raw).train.embodiment_rows == "7,31"
  assert raw.train.embodiment_rows == "data"  # a copy: the caller's config is unchanged
  assert load_config("configs/groot.py", "runlocal").train.embodiment_rows == "all"
