"""A DreamZero checkpoint as a policy (issue 32, deliverable 4): configs/dreamzero.py:runlocal trained a few
steps on a small LeRobot dataset (tests/models/test_dreamzero_data.py's: ejax.sim's cameras, state and
action sizes) acts in the eval job's closed loop and behind the serve job's websocket server."""

import json

import jax
import numpy as np
import pytest

from ejax.train.policy import load_policy
from tests.models.test_dreamzero_data import write_dataset
from tests.train.helpers import load_config

CHUNK, ACTION_DIM, STATE_DIM = 4, 4, 11     # runlocal acts chunks of 4 actions; ejax.sim's sizes
STEPS = 2                                   # UniPC steps a chunk (runlocal's 4 compile twice as long)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  from ejax.train.loop import train
  root = tmp_path_factory.mktemp("dz_policy")
  dataset = write_dataset(str(root / "dataset"))
  config = load_config("configs/dreamzero.py", f"runlocal,dataset={dataset},steps=4,batch=8")
  config.metrics.update(tensorboard=False, progress_bar=False, log_every_steps=1)
  config.checkpoint.update(async_save=False, every_steps=4)
  config.compilation_cache_dir = ""  # keep the test session's cache (tests/conftest.py)
  result = train(config, str(root / "train"))
  assert result["final_step"] == 4 and all(np.isfinite(entry["loss"]) for entry in result["history"])
  return str(root / "train" / "checkpoints")


def _observation(n: int, size: int = 32) -> dict:
  rng = np.random.default_rng(0)
  return {"observation.state": rng.normal(size=(n, STATE_DIM)).astype(np.float32),
          "observation.images.agentview": rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8),
          "observation.images.wrist": rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)}


@pytest.fixture(scope="module")
def policy(checkpoint):
  return load_policy(checkpoint, num_inference_steps=STEPS)


def test_checkpoint_acts_one_chunk(policy):
  assert policy.horizon == CHUNK and policy.noise_shape == (CHUNK, ACTION_DIM)
  # cameras of any size (the policy resizes them to the grid's cells), one instruction per env
  noise = np.random.default_rng(1).standard_normal((2, CHUNK, ACTION_DIM)).astype(np.float32)
  instructions = ["lift the green block", "open the drawer"]
  actions = [policy.act(_observation(2, size), instructions, jax.random.key(3), noise=noise) for size in (48, 48, 32)]
  assert actions[0].shape == (2, CHUNK, ACTION_DIM) and np.isfinite(actions[0]).all()
  np.testing.assert_array_equal(actions[0], actions[1])                   # same noise, same key: same chunk
  assert not np.allclose(actions[0], actions[2])                           # other pixels: another chunk


def test_eval_job_runs_the_checkpoint_in_closed_loop(checkpoint, tmp_path):
  from ejax.eval import evaluate
  config = load_config("configs/eval.py", "runlocal,episodes=1")
  config.eval.update(checkpoint=checkpoint, num_envs=1, replan_every=CHUNK, image_height=32, image_width=32,
                     videos_per_task=0, num_inference_steps=STEPS)
  evaluate.run_job(config, str(tmp_path))
  with open(tmp_path / "eval" / "summary.json") as f:
    summary = json.load(f)
  # the dataset's instructions are ejax.sim's: the job evaluates those tasks by default
  assert sorted(row["task"] for row in summary["tasks"]) == ["goal_lift_green_block", "goal_open_drawer"]
  assert summary["overall"]["episodes"] == 2


def test_serve_job_answers_with_a_chunk(policy):
  from openpi_client.websocket_client_policy import WebsocketClientPolicy

  from ejax.serve.server import PolicyServer
  server = PolicyServer(policy, port=0, max_batch=2).start()
  try:
    client = WebsocketClientPolicy("127.0.0.1", server.port)
    metadata = client.get_server_metadata()
    assert metadata["action_horizon"] == CHUNK and metadata["action_dim"] == ACTION_DIM
    assert metadata["observation_spec"]["noise"]["shape"] == [CHUNK, ACTION_DIM]
    observation = {key: value[0] for key, value in _observation(1).items()}
    actions = client.infer(dict(observation, prompt="lift the green block"))["actions"]
    assert actions.shape == (CHUNK, ACTION_DIM) and np.isfinite(actions).all()
  finally:
    server.stop()
