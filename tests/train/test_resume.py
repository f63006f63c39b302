"""Exact resume, restore onto another mesh, SIGTERM and interrupted saves."""

import os
import shutil

import jax
import numpy as np

from ejax.checkpoint import Checkpointer, abstract_target
from ejax.parallel import make_mesh
from ejax.train.loop import train
from ejax.train.optim import make_optimizer
from ejax.train.state import abstract_train_state
from tests.train.helpers import losses, tiny_config


def _params(result):
  return jax.tree.map(np.asarray, jax.device_get(result["state"].params))


def test_stop_and_resume_equals_uninterrupted_run_bitwise(tmp_path):
  straight = train(tiny_config(steps=6, mesh=(2, 2, 2)), str(tmp_path / "straight"))

  config = tiny_config(steps=6, mesh=(2, 2, 2))
  config.train.stop_at = 3
  first = train(config, str(tmp_path / "resumed"))
  assert first["final_step"] == 3
  config.train.stop_at = 0
  second = train(config, str(tmp_path / "resumed"))
  assert [h["step"] for h in second["history"]] == [4, 5, 6]

  # To the bit: the same data, the same RNG stream, the same compiled program.
  assert losses(first) + losses(second) == losses(straight)
  jax.tree.map(np.testing.assert_array_equal, _params(second), _params(straight))


def test_restore_onto_another_mesh(tmp_path):
  config = tiny_config(steps=4, mesh=(8, 1, 1))
  config.train.stop_at = 2
  saved = train(config, str(tmp_path))
  tx, _ = make_optimizer(config.train)
  rules = [tuple(r) for r in config.sharding_rules]
  for shape in [(1, 1, 8), (2, 2, 2), (1, 4, 2)]:
    mesh = make_mesh(dict(zip(("data", "fsdp", "tensor"), shape)))
    abstract, shardings = abstract_train_state(config.model, config.train, tx, mesh, rules)
    checkpointer = Checkpointer(os.path.join(str(tmp_path), "checkpoints"))
    state, data_state, meta = checkpointer.restore(None, abstract_target(abstract, shardings))
    checkpointer.close()
    assert int(state.step) == 2 and data_state == {"next_index": 2 * config.train.global_batch_size}
    assert meta["config"]["train"]["stop_at"] == 2
    kernel = state.params["blocks"][0]["up"]["kernel"].get_value()
    assert kernel.sharding.mesh.shape == mesh.shape
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, jax.device_get(state.params)),
                 _params(saved))

  # And training goes on from the restored state on the new mesh with the same losses.
  reference = train(tiny_config(steps=4, mesh=(8, 1, 1)), str(tmp_path / "reference"))
  config.mesh.data, config.mesh.tensor = 1, 8
  config.train.stop_at = 0
  continued = train(config, str(tmp_path))
  np.testing.assert_allclose(losses(continued), losses(reference)[2:], rtol=2e-5, atol=2e-6)


def test_interrupted_save_leaves_previous_checkpoint_readable(tmp_path):
  config = tiny_config(steps=2)
  train(config, str(tmp_path))
  directory = os.path.join(str(tmp_path), "checkpoints")
  # What a crash mid-save leaves behind: orbax's temporary directory for the next step, half full.
  partial = os.path.join(directory, "3.orbax-checkpoint-tmp")
  shutil.copytree(os.path.join(directory, "2"), partial)
  for root, _, files in os.walk(partial):
    for name in files[: len(files) // 2]:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"\0partial")
  checkpointer = Checkpointer(directory)
  assert checkpointer.latest_step() == 2
  checkpointer.close()
  config.train.steps = 3
  config.checkpoint.allow_changes = "train.steps"  # a longer schedule, knowingly (issue 15, case 3)
  resumed = train(config, str(tmp_path))
  assert [h["step"] for h in resumed["history"]] == [3]
