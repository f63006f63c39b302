"""Every job, every required setting: `python -m ejax.main` with a setting missing or wrong (no
checkpoint, a path that does not exist, a checkpoint of another kind or model) ends in one line,
`error: ...` naming the setting and the fix, exit status 2, no traceback, and before any heavy work.

The ~50 cases run in one process (DRIVER re-enters ejax.main.run once per case, as a fresh launch
would parse its flags) instead of ~50 launches of 3-5 s each; one real launch checks that the
process itself prints the same line.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ejax.jobs import JOBS
from tests.train.helpers import REPO

# Each case: (id, job, argv; {names} are filled from the `disk` fixture's paths, fragments of the error line).
GROOT = "--config=configs/groot.py:runlocal,dataset=synthetic"
TINY = "--config=configs/tiny.py:runlocal"
EVAL = "--config=configs/eval.py:runlocal"
RL = "--config=configs/rl_vla3.py:runlocal"
DEMOS = "--config=configs/demos.py:runlocal"
CASES = [
    # train
    ("train-no-dataset-path", "train", ["--config=configs/groot.py"], ["data.name='lerobot' needs --config.data.path"]),
    ("train-dataset-missing", "train", [TINY, "--config.data.name=lerobot", "--config.data.path=/no/such"],
     ["data.path '/no/such' does not exist"]),
    ("train-init-weights-missing", "train", [TINY, "--config.train.init_weights=/no/such"],
     ["train.init_weights='/no/such' is not a directory", "--config.job=convert"]),
    ("train-init-weights-is-an-rl-run", "train", [TINY, "--config.train.init_weights={rl_checkpoints}"],
     ["holds an rl job's checkpoints", "a train run's checkpoints"]),
    ("train-init-weights-other-model", "train", [TINY, "--config.train.init_weights={imported}"],
     ["tensor other/kernel (2, 3) has no parameter in config.model", "same model"]),
    ("train-workdir-of-another-model", "train", [GROOT, "--workdir={tiny_run}"],
     ["was written with other settings", "model.", "new --workdir"]),
    ("train-stats-path-missing", "train", [TINY, "--config.data.stats_path=/no/stats.json"],
     ["data.stats_path '/no/stats.json' is not a file", "--config.job=stats"]),
    ("train-pi05-tokenizer-missing", "train", ["--config=configs/pi05.py:runlocal", "--config.data.name=synthetic"],
     ["PaliGemma tokenizer model '' not found", "config.model.tokenizer_path"]),
    ("train-wandb-mode", "train", [TINY, "--config.metrics.wandb=True", "--config.metrics.wandb_mode=cloud"],
     ["metrics.wandb_mode='cloud': use one of online, offline, disabled"]),
    ("train-encoder-cache-missing", "train", ["--config=configs/dreamzero.py:runlocal", "--config.data.encoder_cache=/no/such",
                                              "--config.data.encoder_cache_refresh=False"],
     ["data.encoder_cache=/no/such holds no finished cache", "--config.job=encode"]),
    # encode
    ("encode-model-without-encoders", "encode", [TINY, "--config.job=encode"], ["model 'tiny_flow' has no cache"]),
    ("encode-synthetic-data", "encode", ["--config=configs/dreamzero.py:runlocal,dataset=synthetic", "--config.job=encode"],
     ["encodes LeRobot video samples", "data.name='synthetic'"]),
    # eval
    ("eval-no-checkpoint", "eval", [EVAL], ["eval.checkpoint is not set", "--config.eval.checkpoint="]),
    ("eval-rl-no-checkpoint", "eval", [EVAL, "--config.eval.policy=rl"],
     ["eval.checkpoint is not set", "rl_checkpoints"]),
    ("eval-checkpoint-missing", "eval", [EVAL, "--config.eval.checkpoint=/no/such"],
     ["eval.checkpoint='/no/such' does not exist", "a train job's <workdir>/checkpoints"]),
    ("eval-rl-checkpoint-as-train", "eval", [EVAL, "--config.eval.checkpoint={rl_checkpoints}"],
     ["is an rl job's <workdir>/rl_checkpoints", "--config.eval.policy=rl"]),
    ("eval-train-checkpoint-as-rl", "eval", [EVAL, "--config.eval.policy=rl", "--config.eval.checkpoint={checkpoints}"],
     ["is a train job's <workdir>/checkpoints", "--config.eval.policy=checkpoint"]),
    ("eval-checkpoint-of-synthetic-data", "eval", [EVAL, "--config.eval.checkpoint={checkpoints}"],
     ["holds a 'tiny_flow' model trained on synthetic data", "ejax.sim's demonstrations"]),
    ("eval-imported-weights", "eval", [EVAL, "--config.eval.checkpoint={imported}"],
     ["imported by the convert job", "--config.eval.policy=remote"]),
    ("eval-workdir", "eval", [EVAL, "--config.eval.checkpoint={tiny_run}"], ["is a workdir: point it at", "checkpoints"]),
    ("eval-empty-directory", "eval", [EVAL, "--config.eval.checkpoint={empty}"], ["holds no checkpoint"]),
    ("eval-remote-no-address", "eval", [EVAL, "--config.eval.policy=remote"], ["--config.eval.address="]),
    ("eval-unknown-policy", "eval", [EVAL, "--config.eval.policy=bogus"], ["eval.policy='bogus': use one of random"]),
    ("eval-unknown-task", "eval", [EVAL, "--config.eval.policy=random", "--config.eval.tasks=nope"],
     ["eval.tasks='nope' names no ejax.sim task"]),
    ("eval-unknown-backend", "eval", [EVAL, "--config.eval.policy=random", "--config.eval.backend=gpu"],
     ["eval.backend='gpu': use one of mjx, native"]),
    ("eval-no-episodes", "eval", [EVAL, "--config.eval.policy=random", "--config.eval.episodes_per_task=0"],
     ["eval.episodes_per_task=0 must be a positive integer"]),
    # rl
    ("rl-groot-without-sft", "rl", [RL + ",actor=groot"], ["actor=groot needs sft="]),
    ("rl-sft-missing", "rl", [RL + ",actor=groot,sft=/no/such"], ["rl.policy.checkpoint='/no/such' does not exist"]),
    ("rl-sft-is-rl-checkpoints", "rl", [RL + ",actor=groot,sft={rl_checkpoints}"],
     ["holds an rl job's rl_checkpoints", "a GR00T train job's <workdir>/checkpoints"]),
    ("rl-sft-other-model", "rl", [RL + ",actor=groot,sft={checkpoints}"],
     ["holds a 'tiny_flow' model", "GR00T checkpoint"]),
    ("rl-sft-workdir", "rl", [RL + ",actor=groot,sft={tiny_run}"], ["is a workdir: point sft= at"]),
    ("rl-unknown-task", "rl", [RL + ",task=nope"], ["task='nope' is not a registered ejax.sim task"]),
    ("rl-unknown-mode", "rl", [RL, "--config.rl.mode=bogus"], ["rl.mode='bogus': use one of async, sync"]),
    ("rl-unknown-env", "rl", [RL, "--config.rl.env.name=nope"], ["rl.env.name='nope': use one of point_reach"]),
    # serve
    ("serve-no-checkpoint", "serve", [GROOT, "--config.job=serve"],
     ["serve.checkpoint is not set and the workdir", "--config.serve.checkpoint="]),
    ("serve-checkpoint-missing", "serve", [GROOT, "--config.job=serve", "--config.serve.checkpoint=/no/such"],
     ["serve.checkpoint /no/such does not exist"]),
    ("serve-empty-directory", "serve", [GROOT, "--config.job=serve", "--config.serve.checkpoint={empty}"],
     ["is none of what job serve loads"]),
    ("serve-state-based-rl-actor", "serve", [GROOT, "--config.job=serve", "--config.serve.checkpoint={rl_checkpoints}"],
     ["rl.policy.kind='mlp_flow' actor", "--config.eval.policy=rl"]),
    ("serve-imported-without-stats", "serve", [GROOT, "--config.job=serve", "--config.serve.checkpoint={imported}"],
     ["carry no normalisation statistics", "--config.data.stats_path="]),
    ("serve-unknown-weights", "serve", [GROOT, "--config.job=serve", "--config.serve.weights=int3",
                                        "--config.serve.checkpoint={checkpoints}"],
     ["serve.weights='int3': use one of same, fp8_block"]),
    ("serve-open-host-without-key", "serve", [GROOT, "--config.job=serve", "--config.serve.host=0.0.0.0"],
     ["--config.serve.api_key="]),
    # convert
    ("convert-no-direction", "convert", [GROOT, "--config.job=convert"], ["convert.direction='': use one of import, export"]),
    ("convert-no-source", "convert", [GROOT, "--config.job=convert", "--config.convert.direction=import"],
     ["convert.source is not set"]),
    ("convert-source-missing", "convert", [GROOT, "--config.job=convert", "--config.convert.direction=import",
                                           "--config.convert.source=/no/such"], ["convert.source='/no/such' does not exist"]),
    ("convert-import-from-a-run", "convert", [GROOT, "--config.job=convert", "--config.convert.direction=import",
                                              "--config.convert.source={checkpoints}", "--config.convert.destination={new}"],
     ["is an ejax job's checkpoints, not released weights"]),
    ("convert-export-not-imported", "convert", [GROOT, "--config.job=convert", "--config.convert.direction=export",
                                                "--config.convert.source={empty}", "--config.convert.destination={new}"],
     ["is not weights the convert job imported"]),
    ("convert-no-destination", "convert", [GROOT, "--config.job=convert", "--config.convert.direction=import",
                                           "--config.convert.source={other_safetensors}"], ["convert.destination is not set"]),
    ("convert-destination-exists", "convert", [GROOT, "--config.job=convert", "--config.convert.direction=import",
                                               "--config.convert.source={other_safetensors}",
                                               "--config.convert.destination={imported}"], ["already exists", "new path"]),
    ("convert-weights-of-another-model", "convert", [GROOT, "--config.job=convert", "--config.convert.direction=import",
                                                     "--config.convert.source={other_safetensors}",
                                                     "--config.convert.destination={new}"],
     ["does not match the model config", "unexpected tensor(s): other.weight"]),
    ("convert-model-without-converter", "convert", [TINY, "--config.job=convert", "--config.convert.direction=import"],
     ["model.name='tiny_flow' has no weight converter"]),
    ("convert-config-without-model", "convert", [EVAL, "--config.job=convert"], ["this config has no model"]),
    # stats
    ("stats-synthetic-data", "stats", [TINY, "--config.job=stats"], ["data.name='synthetic' is none"]),
    ("stats-no-dataset-path", "stats", [TINY, "--config.job=stats", "--config.data.name=lerobot"],
     ["needs --config.data.path=<dataset directory>"]),
    ("stats-dataset-missing", "stats", [TINY, "--config.job=stats", "--config.data.name=lerobot",
                                        "--config.data.path=/no/such"], ["data.path '/no/such' does not exist"]),
    ("stats-not-a-dataset", "stats", [TINY, "--config.job=stats", "--config.data.name=lerobot",
                                      "--config.data.path={empty}"], ["meta/info.json is missing"]),
    # demos
    ("demos-unknown-task", "demos", [DEMOS, "--config.demos.tasks=nope"], ["demos.tasks='nope' names no ejax.sim task"]),
    ("demos-no-episodes", "demos", [DEMOS, "--config.demos.episodes_per_task=0"],
     ["demos.episodes_per_task=0 must be a positive integer"]),
    ("demos-unknown-backend", "demos", [DEMOS, "--config.demos.backend=gpu"], ["demos.backend='gpu'"]),
    ("demos-over-a-dataset", "demos", [DEMOS, "--config.demos.output_dir={dataset}"],
     ["already holds a LeRobot dataset", "--config.demos.output_dir"]),
    # summary
    ("summary-config-without-model", "summary", [EVAL, "--config.job=summary"], ["this config has no model"]),
    ("summary-unknown-model", "summary", [TINY, "--config.job=summary", "--config.model.name=nope"],
     ["unknown model 'nope'"]),
]

# Runs each case through ejax.main.run as a launch would, recording exit code, stderr and seconds.
# Between cases it drops the `--config.x` override flags config_flags defined for the previous one.
# ejax.main's os._exit for stuck library threads is switched off: here it would end every case.
DRIVER = r"""
import contextlib, io, json, sys, time, traceback
from absl import flags
import ejax.main as main
main._exit_now_if_stuck = lambda code: None
cases, out = json.load(open(sys.argv[1])), sys.argv[2]
results = {}
for name, argv in cases:
  for flag in [flag for flag in flags.FLAGS if flag.startswith("config.")]:
    delattr(flags.FLAGS, flag)
  flags.FLAGS.unparse_flags()
  stderr, stdout, code, start = io.StringIO(), io.StringIO(), 0, time.time()
  with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
    sys.argv = ["ejax.main", *argv]
    try:
      main.run()
    except SystemExit as exit:
      code = exit.code
    except BaseException:
      traceback.print_exc()
      code = "exception"
  results[name] = dict(code=code, stderr=stderr.getvalue()[-4000:], seconds=time.time() - start)
  json.dump(results, open(out, "w"))
"""


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
  """Small stand-ins of what users point jobs at: a tiny model's train run, a state-based RL run,
  imported weights, a LeRobot dataset's root, a released checkpoint of another model, an empty folder."""
  import orbax.checkpoint as ocp

  from configs import tiny
  from ejax.checkpoint import Checkpointer
  from ejax.models.io.tensors import save_tensors
  from ejax.rl.checkpoint import RLCheckpointer
  root = tmp_path_factory.mktemp("job_errors")
  paths = {name: str(root / name) for name in ("tiny_run", "rl_run", "imported", "empty", "dataset", "new")}
  paths["checkpoints"] = os.path.join(paths["tiny_run"], "checkpoints")
  paths["rl_checkpoints"] = os.path.join(paths["rl_run"], "rl_checkpoints")
  paths["other_safetensors"] = str(root / "other.safetensors")
  checkpointer = Checkpointer(paths["checkpoints"], async_save=False)
  config = tiny.get_config("runlocal")
  checkpointer.save(1, {"w": np.zeros(2, np.float32)}, meta={"config": json.loads(config.to_json_best_effort())})
  checkpointer.close()
  RLCheckpointer(paths["rl_checkpoints"]).save(0, {"w": np.zeros(2, np.float32)}, {"mu": np.zeros(2, np.float32)},
                                               {"policy": {"kind": "mlp_flow"}})
  ocp.StandardCheckpointer().save(paths["imported"], {"other": {"kernel": np.zeros((2, 3), np.float32)}})
  os.makedirs(paths["empty"])
  os.makedirs(os.path.join(paths["dataset"], "meta"))
  with open(os.path.join(paths["dataset"], "meta", "info.json"), "w") as f:
    json.dump({"codebase_version": "v3.0"}, f)
  save_tensors({"other.weight": np.zeros((2, 2), np.float32)}, paths["other_safetensors"])
  return paths


@pytest.fixture(scope="module")
def results(disk, tmp_path_factory):
  work = tmp_path_factory.mktemp("job_error_runs")
  cases = []
  for index, (name, _, argv, _) in enumerate(CASES):
    argv = [arg.format(**disk) for arg in argv]
    if not any(arg.startswith("--workdir=") for arg in argv):
      argv.append(f"--workdir={work / f'run{index}'}")
    cases.append((name, argv))
  (work / "cases.json").write_text(json.dumps(cases))
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  process = subprocess.run([sys.executable, "-c", DRIVER, str(work / "cases.json"), str(work / "results.json")],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert (work / "results.json").exists(), process.stderr[-3000:]
  return json.loads((work / "results.json").read_text())


def test_every_job_is_covered():
  assert {job for _, job, _, _ in CASES} == set(JOBS)


@pytest.mark.parametrize("name,job,argv,fragments", CASES, ids=[case[0] for case in CASES])
def test_bad_setting_is_one_line(results, name, job, argv, fragments):
  result = results.get(name)
  assert result is not None, f"the driver stopped before {name}"
  stderr = result["stderr"]
  assert result["code"] == 2, stderr
  assert "Traceback" not in stderr, stderr
  errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1, stderr
  for fragment in fragments:
    assert fragment in errors[0], errors[0]
  # Found before anything heavy (recording, restoring, compiling): the first case also pays the imports.
  assert result["seconds"] < 30, (result["seconds"], errors[0])


def test_a_launch_prints_the_same_line(tmp_path):
  """The real process, as the issue met it: eval without a checkpoint."""
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-m", "ejax.main", EVAL, f"--workdir={tmp_path}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 2, result.stderr[-3000:]
  assert "Traceback" not in result.stderr
  assert [line for line in result.stderr.splitlines() if line.strip()] == [
      "error: eval.checkpoint is not set: pass --config.eval.checkpoint=<a train job's <workdir>/checkpoints "
      "(eval.policy='checkpoint')>"]
