"""Issue 15 cases 3 and 4: resuming under changed settings names the keys (never advises deleting
anything); damaged checkpoints are caught by checksums and NaN checks, naming the step and the way
back to the previous good one."""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from ejax.checkpoint import Checkpointer, CheckpointError
from ejax.checkpoint import manager as manager_lib
from ejax.train.loop import train
from ejax.train.resume import config_changes
from tests.test_main import assert_one_line_error, run_main
from tests.train.helpers import losses, tiny_config
from tests.train.test_nonfinite import _checkpoint_files

SMALL = ["--config.model.width=32", "--config.model.depth=2", "--config.metrics.progress_bar=False",
         "--config.metrics.tensorboard=False", "--config.checkpoint.every_steps=2"]


@pytest.fixture(scope="module")
def run_of_four(tmp_path_factory):
  """configs/tiny.py:runlocal shrunk, 4 steps, checkpoints at 2 and 4 (through the launcher)."""
  workdir = tmp_path_factory.mktemp("run_of_four")
  result = run_main("--config=configs/tiny.py:runlocal,steps=4", *SMALL, f"--workdir={workdir}", timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


@pytest.fixture
def workdir(run_of_four, tmp_path):
  shutil.copytree(run_of_four, tmp_path / "run")
  return tmp_path / "run"


def _resume(workdir, *overrides, steps=6):
  return run_main(f"--config=configs/tiny.py:runlocal,steps={steps}", *SMALL, *overrides, f"--workdir={workdir}",
                  timeout=240)


@pytest.mark.parametrize("overrides, named", [
    (["--config.model.depth=3"], "model.depth 2 -> 3"),
    (["--config.train.ema_decay=0.99"], "train.ema_decay 0.0 -> 0.99"),
])
def test_changed_model_or_state_is_named_not_called_unreadable(workdir, overrides, named):
  before = _checkpoint_files(workdir / "checkpoints")
  result = _resume(workdir, *overrides, steps=4)
  assert_one_line_error(result, "checkpoint step 4", "was written with other settings", named,
                        "new --workdir", "--config.checkpoint.allow_changes=")
  assert not re.search(r"\bdelete\b", result.stderr) and "unreadable" not in result.stderr
  assert _checkpoint_files(workdir / "checkpoints") == before

  # Allowing a change the state cannot take still ends in one line naming the change.
  key = named.split()[0]
  result = _resume(workdir, *overrides, f"--config.checkpoint.allow_changes={key}", steps=4)
  assert_one_line_error(result, "does not fit the configured train state", named)
  assert not re.search(r"\bdelete\b", result.stderr) and "Custom" not in result.stderr
  assert _checkpoint_files(workdir / "checkpoints") == before


def test_a_longer_schedule_is_refused_unless_allowed(workdir):
  result = _resume(workdir, steps=6)
  assert_one_line_error(result, "train.steps 4 -> 6", "--config.checkpoint.allow_changes=train.steps")
  result = _resume(workdir, "--config.checkpoint.allow_changes=train.steps", steps=6)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "train: finished at step 6" in result.stdout
  assert "resuming step 4 with changed settings: train.steps 4 -> 6" in result.stderr


def test_a_checkpoint_older_than_a_setting_names_the_setting():
  """A layout failure with no changed setting: the checkpoint predates settings this ejax has (a
  full GR00T run written before train.compute_copy); the line names them and the way back."""
  from ml_collections import ConfigDict

  from ejax.train import resume

  class OlderCheckpoint:
    directory = "/runs/groot/checkpoints"

    def restore(self, step, target):
      raise CheckpointError("checkpoint step 500 holds another train state than the config builds", kind="layout")

    def read_meta(self, step):
      return {"config": {"train": {"steps": 30000}, "mesh": {"data": 8}}}

  config = ConfigDict({"train": {"steps": 30000, "compute_copy": True}, "mesh": {"data": 8, "fsdp": 1}})
  with pytest.raises(CheckpointError) as error:
    resume.restore(OlderCheckpoint(), 500, None, [], config)
  assert str(error.value) == (
      "checkpoint step 500 in /runs/groot/checkpoints does not fit the configured train state and predates "
      "settings it was written without: train.compute_copy=True: resume with them as the older ejax ran "
      "(their configs/common.py defaults, --config.train.compute_copy=...), or start in a new --workdir")
  assert error.value.kind == "layout"
  assert resume.newer_settings({"train": {"steps": 4}}, {"train": {"steps": 6}}) == []  # a change, not newer


def test_runtime_settings_may_change():
  saved = json.loads(tiny_config().to_json_best_effort())
  config = tiny_config()
  config.mesh.data, config.train.stop_at, config.metrics.log_every_steps = 2, 3, 50
  config.checkpoint.keep, config.data.num_workers = 1, 2
  assert config_changes(saved, json.loads(config.to_json_best_effort())) == []
  config.model.name, config.train.learning_rate = "groot", 0.5
  assert [key for key, _, _ in config_changes(saved, json.loads(config.to_json_best_effort()))] == [
      "model.name", "train.learning_rate"]


def _edit_checksum(step_dir, path):
  metadata = step_dir / "meta" / "metadata"
  meta = json.loads(open(metadata).read())
  meta["checksums"][path] = "0123456789abcdef"
  open(metadata, "w").write(json.dumps(meta))


def test_checksum_mismatch_names_the_array_and_the_good_step(workdir):
  _edit_checksum(workdir / "checkpoints" / "4", "opt_state/1/0/mu/blocks/0/up/kernel")
  result = _resume(workdir, steps=4)
  assert_one_line_error(result, "checkpoint step 4", "is damaged", "opt_state/1/0/mu/blocks/0/up/kernel",
                        "do not match the checksums", "--config.checkpoint.step=2")
  assert not re.search(r"\bdelete\b", result.stderr)

  # The advice works: step 2 resumes, step 4 is moved aside (kept), and training redoes steps 3-4.
  result = _resume(workdir, "--config.checkpoint.step=2", "--config.metrics.log_every_steps=1", steps=4)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "train: finished at step 4" in result.stdout
  (aside,) = [name for name in os.listdir(workdir) if name.startswith("set_aside-")]
  assert os.listdir(workdir / aside / "checkpoints") == ["4"]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
  steps = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
  assert steps[-2:] == [3, 4]


def test_unreadable_array_is_named(workdir):
  data_dir = workdir / "checkpoints" / "4" / "state" / "d"
  (name,) = os.listdir(data_dir)
  data = bytearray(open(data_dir / name, "rb").read())
  data[200] ^= 0x10
  open(data_dir / name, "wb").write(bytes(data))
  result = _resume(workdir, steps=4)
  assert_one_line_error(result, "checkpoint step 4", "is damaged, cannot read array", "--config.checkpoint.step=2")


def test_nan_in_a_checkpoint_is_never_restored_nor_saved(tmp_path, monkeypatch):
  config = tiny_config(steps=2)
  state = train(config, str(tmp_path / "good"))["state"]
  poisoned = state.replace(opt_state=jax.tree.map(lambda x: x * np.nan if x.dtype == np.float32 else x,
                                                  state.opt_state))
  checkpointer = Checkpointer(str(tmp_path / "bad"), async_save=False)
  with pytest.raises(CheckpointError, match=r"refusing to save step 3: opt_state/.* hold NaN or inf"):
    checkpointer.save(3, poisoned)
  # Written anyway (as an older ejax or another tool could), it is refused at restore.
  monkeypatch.setattr(manager_lib.checksums, "summarize", lambda tree: {})
  checkpointer.save(3, poisoned)
  monkeypatch.undo()
  with pytest.raises(CheckpointError, match=r"checkpoint step 3 .* is damaged: opt_state/.* hold NaN or inf: "
                                            r"no earlier step to resume from"):
    checkpointer.restore(3, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                         state))
  checkpointer.close()


def test_checksums_do_not_depend_on_the_mesh(tmp_path):
  from ejax.checkpoint import checksums
  from ejax.parallel import make_mesh
  from ejax.train.optim import make_optimizer
  from ejax.train.state import abstract_train_state
  from ejax.checkpoint import abstract_target
  config = tiny_config(steps=2, mesh=(8, 1, 1))
  saved = train(config, str(tmp_path))
  tx, _ = make_optimizer(config.train)
  rules = [tuple(r) for r in config.sharding_rules]
  mesh = make_mesh(dict(data=1, fsdp=2, tensor=4))
  abstract, shardings = abstract_train_state(config.model, config.train, tx, mesh, rules)
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
  state, _, meta = checkpointer.restore(None, abstract_target(abstract, shardings))  # verifies them
  checkpointer.close()
  summary = checksums.summarize(state)
  assert {path: value for path, (value, _) in summary.items()} == meta["checksums"]
  assert summary == checksums.summarize(saved["state"])
  assert losses(saved)  # the run itself logged
