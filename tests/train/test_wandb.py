"""Weights & Biases in offline mode (no network): what a run logged, read back from the run's own
.wandb file, is the config, the scalars TensorBoard got, and the eval job's success table and videos."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from tests.train.helpers import REPO

wandb = pytest.importorskip("wandb")

SMALL = ["--config.model.width=32", "--config.model.depth=2", "--config.metrics.progress_bar=False"]


@pytest.fixture
def offline(tmp_path, monkeypatch):
  """wandb's own folders and settings under tmp, offline, quiet; the environment for a launch."""
  env = dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off", WANDB_DIR=str(tmp_path / "wandb_dir"),
             WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"), WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
             WANDB_DATA_DIR=str(tmp_path / "wandb_data"))
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  return dict(os.environ, **env)


def read_records(workdir) -> list:
  """The protobuf records of the one offline run under workdir/wandb."""
  (run,) = offline_runs(workdir)
  return read_run(run)


def offline_runs(workdir) -> list[str]:
  """The offline runs' folders under workdir/wandb, in the order they were made (their names start
  with the time)."""
  return sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*")))


def read_run(folder) -> list:
  """wandb's .wandb file is a LevelDB-style log (a 7-byte header, then 32 KiB blocks of chunks: crc32,
  length, type, payload) of wandb_internal_pb2.Record protobufs."""
  from wandb.proto import wandb_internal_pb2
  (path,) = glob.glob(os.path.join(folder, "run-*.wandb"))
  data = open(path, "rb").read()
  assert data[:4] == b":W&B"
  block, position, pending, records = 32768, 7, b"", []
  while position + 7 <= len(data):
    if block - position % block < 7:  # a block's tail too short for a chunk header is padding
      position += block - position % block
      continue
    _, length, kind = struct.unpack("<IHB", data[position:position + 7])
    pending += data[position + 7:position + 7 + length]
    position += 7 + length
    if kind in (1, 4):  # a full record, or the last chunk of one
      records.append(wandb_internal_pb2.Record.FromString(pending))
      pending = b""
  return records


def items(updates) -> dict:
  """{key: value}; a media value (a table, a video) arrives as nested keys: {key: {"path": ..., ...}}."""
  out = {}
  for item in updates:
    *parents, last = list(item.nested_key) or [item.key]
    target = out
    for parent in parents:
      target = target.setdefault(parent, {})
    target[last] = json.loads(item.value_json)
  return out


def history(records) -> list[dict]:
  return [items(record.history.item) for record in records if record.WhichOneof("record_type") == "history"]


def first(records, kind: str):
  return next(getattr(record, kind) for record in records if record.WhichOneof("record_type") == kind)


def test_train_logs_the_config_and_the_tensorboard_scalars_and_resumes_in_the_same_run(tmp_path, offline):
  workdir = tmp_path / "run"
  command = [sys.executable, "-m", "ejax.main", "--config=configs/tiny.py:runlocal,steps=6", *SMALL,
             "--config.metrics.log_every_steps=2", "--config.metrics.wandb=True", "--config.metrics.wandb_mode=offline",
             "--config.metrics.wandb_project=ejax-test", "--config.metrics.wandb_name=tiny-six-steps",
             f"--workdir={workdir}"]
  # stopped after step 4 (as a scheduler's time slice would), then resumed to the end by the same command
  for extra in (["--config.train.stop_at=4"], []):
    result = subprocess.run(command + extra, cwd=REPO, env=dict(offline, XLA_FLAGS="", JAX_PLATFORMS="cpu"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
  launches = [read_run(folder) for folder in offline_runs(workdir)]
  assert len(launches) == 2
  runs = [first(records, "run") for records in launches]
  assert runs[0].run_id == runs[1].run_id  # one W&B run: `wandb sync` appends the second launch to it
  assert (runs[0].project, runs[0].display_name) == ("ejax-test", "tiny-six-steps")
  config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
  assert config["train"]["steps"] == 6 and config["model"]["width"] == 32 and config["metrics"]["wandb"] is True
  # every scalar of every logged step, as metrics.jsonl (and TensorBoard) have them
  logged = [{row["_step"]: row for row in history(records)} for records in launches]
  assert sorted(logged[0]) == [2, 4] and sorted(logged[1]) == [6]
  logged = {**logged[0], **logged[1]}
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert [row["step"] for row in rows] == [2, 4, 6]
  for row in rows:
    scalars = {key: value for key, value in row.items() if key not in ("step", "time")}
    assert {"loss", "grad_norm", "learning_rate", "samples_per_second"} <= set(scalars)
    assert {key: logged[row["step"]][key] for key in scalars} == pytest.approx(scalars, rel=1e-6)
  assert [first(records, "exit").exit_code for records in launches] == [0, 0]


def test_eval_logs_the_success_table_and_videos(tmp_path, offline):
  """What evaluate_policy hands log_to_wandb: its summary (built here from made-up counts, as it builds
  it, to spare the test a simulator's compile) and the videos folder beside it."""
  import numpy as np

  from configs import eval as eval_config
  from ejax.eval import evaluate, plots, videos
  from ejax.train import wandb_run
  config = eval_config.get_config("runlocal")
  config.metrics.update(wandb=True, wandb_mode="offline", wandb_name="eval-table")
  workdir, tasks = tmp_path / "eval_run", ["goal_open_drawer", "object_lift_cylinder"]
  rows = evaluate.summary_rows(tasks, {"goal_open_drawer": 3, "object_lift_cylinder": 1}, dict.fromkeys(tasks, 4))
  summary = {"tasks": rows, "suites": [evaluate.aggregate(rows[:1], "suite:goal"),
                                       evaluate.aggregate(rows[1:], "suite:object")],
             "overall": evaluate.aggregate(rows, "overall")}
  output_dir = workdir / "eval"
  videos.write_mp4(str(output_dir / "videos" / "goal_open_drawer_0.mp4"), np.zeros((6, 16, 32, 3), np.uint8), 10)
  plots.success_bar_plot(str(output_dir / "success.png"), rows, "random policy")
  with wandb_run.session(config, str(workdir)):
    evaluate.log_to_wandb(summary, str(output_dir))
  wandb.teardown()  # the run's writer (wandb's service process) may still be writing after finish()
  records = read_records(workdir)
  run = first(records, "run")
  assert run.display_name == "eval-table" and run.job_type == "eval"
  (logged,) = [row for row in history(records) if "eval/success" in row]
  assert logged["eval/success_rate/goal_open_drawer"] == 0.75 and logged["eval/success_rate/overall"] == 0.5
  # the table and the video travel as files of the run: the table's rows are summary.json's
  files = os.path.join(offline_runs(workdir)[0], "files")
  table = json.load(open(os.path.join(files, logged["eval/success"]["path"])))
  assert table["columns"] == list(evaluate.TABLE_COLUMNS)
  assert [row[0] for row in table["data"]] == tasks + ["suite:goal", "suite:object", "overall"]
  assert table["data"][0][1:5] == ["goal", 4, 3, 0.75] and table["data"][-1][2:5] == [8, 4, 0.5]
  plot = logged["eval/success_plot"]
  assert plot["_type"] == "image-file" and open(os.path.join(files, plot["path"]), "rb").read(4) == b"\x89PNG"
  video = logged["eval/videos/goal_open_drawer_0"]
  assert video["_type"] == "video-file"
  assert videos.read_mp4(os.path.join(files, video["path"])).shape == (6, 16, 32, 3)


def test_rl_logs_each_update_against_the_policy_version(tmp_path, offline):
  """The rl job hooks its learner's on_update (ejax.rl.runner.log_updates_to_wandb): each update's
  scalars arrive with rl/version as their x axis, after the pipeline's own callback."""
  import types

  from configs import rl_vla3
  from ejax.rl import runner
  from ejax.train import wandb_run
  config = rl_vla3.get_config("runlocal,task=point_reach")
  config.metrics.update(wandb=True, wandb_mode="offline")
  seen = []
  learner = types.SimpleNamespace(on_update=lambda version, *rest: seen.append(version))
  workdir = tmp_path / "rl_run"
  with wandb_run.session(config, str(workdir)):
    runner.log_updates_to_wandb(learner)
    for version, loss in ((1, 0.5), (2, 0.25)):
      learner.on_update(version, None, None, {"version": version, "time": 12.0, "policy_loss": loss,
                                              "success_rate": version / 4, "lag_max": 1, "note": "text"})
  wandb.teardown()
  assert seen == [1, 2]
  records = read_records(workdir)
  assert first(records, "run").job_type == "rl"
  rows = [row for row in history(records) if "rl/version" in row]
  assert [(row["rl/version"], row["rl/policy_loss"], row["rl/success_rate"], row["rl/lag_max"]) for row in rows] == [
      (1, 0.5, 0.25, 1), (2, 0.25, 0.5, 1)]
  assert not any("rl/note" in row or "rl/time" in row for row in rows)
