"""train.embodiment_rows (ejax/train/rows.py): the optimizer updates only the embodiment tables' rows
the data uses; those rows and every other parameter move exactly as with the dense update, the other
rows do not move at all, and a batch with an id outside the rows is one clear line."""

import jax
import numpy as np
import pytest
from ml_collections import ConfigDict

from ejax.errors import UserError
from ejax.train import rows as rows_lib
from tests.train.helpers import groot_steps, leaves, load_config, tables


@pytest.mark.slow  # CI time (2026-12-01): 66 s, two GR00T steps compiled
def test_the_trained_rows_move_as_with_the_dense_update_and_the_others_not_at_all():
  before, dense, dense_metrics = groot_steps(embodiment_rows="all", weight_decay=0.1)
  _, sparse, sparse_metrics = groot_steps(embodiment_rows="1", weight_decay=0.1)
  np.testing.assert_allclose(sparse_metrics["loss"], dense_metrics["loss"], rtol=1e-6)
  np.testing.assert_allclose(sparse_metrics["grad_norm"], dense_metrics["grad_norm"], rtol=1e-5)
  dense_tables, sparse_tables = tables(dense.params), tables(sparse.params)
  assert dense_tables.keys() == sparse_tables.keys() and len(dense_tables) >= 10
  for path, table in sparse_tables.items():
    np.testing.assert_allclose(table[1], dense_tables[path][1], rtol=1e-5, atol=1e-6, err_msg=path)
    np.testing.assert_array_equal(table[0], before[path][0], err_msg=path)  # untouched, not even decayed
    if table.ndim >= 3:  # the W tables decay under the dense update: its row 0 moved
      assert not np.array_equal(dense_tables[path][0], before[path][0]), path
  # Every other parameter: the same update.
  others = lambda state: {path: value for path, value in leaves(state.params).items() if path not in dense_tables}
  dense_others, sparse_others = others(dense), others(sparse)
  assert dense_others.keys() == sparse_others.keys() and len(dense_others) > 20
  for path, value in sparse_others.items():
    np.testing.assert_allclose(value, dense_others[path], rtol=1e-5, atol=1e-6, err_msg=path)
  # The Adam moments hold the one trained row.
  sparse_moments = tables(sparse.opt_state)
  assert sparse_moments and all(m.shape[0] == 1 for m in sparse_moments.values())
  assert all(m.shape[0] == 2 for m in tables(dense.opt_state).values())


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
