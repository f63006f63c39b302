"""Job `serve` beyond train checkpoints: an RL version of a GR00T actor and imported released weights,
driven by openpi's own client and checked against the same policy in-process; and what is refused.

Both are made from tests/serve/conftest.py's small GR00T train checkpoint: the RL version is its
FlowPolicy (ejax.rl.vla) with moved weights and 3 Euler steps instead of the model's 4, saved as the
RL job saves versions; the imported weights are its parameters written as the convert job's import
writes them, with its statistics in a stats.json.
"""

import os
import re

import jax
import numpy as np
import pytest
from ml_collections import ConfigDict
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from configs import common, rl_vla3
from ejax.checkpoint import Checkpointer, CheckpointError
from ejax.rl import runner
from ejax.rl.checkpoint import RLCheckpointer
from ejax.rl.warm_start import EvalPolicy
from ejax.serve.load import find_source, load_served_policy
from ejax.serve.server import PolicyServer
from ejax.serve.spec import observation_spec
from ejax.sim import registry
from ejax.train.policy import load_policy
from tests.serve.conftest import IMAGE_SIZE, TASK

RL_VERSION = 1
RL_NUM_STEPS = 3  # the model's num_inference_steps is 4: the served policy must sample as the RL policy does


def serve_config(checkpoint: str) -> ConfigDict:
  config = ConfigDict(dict(serve=common.serve_defaults()))
  config.serve.checkpoint = checkpoint
  return config


def observations(n: int, seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  obs = {"observation.state": rng.normal(0.0, 0.3, (n, 11)).astype(np.float32)}
  for camera in ("agentview", "wrist"):
    obs[f"observation.images.{camera}"] = rng.integers(0, 256, (n, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
  return obs


def served_actions(policy, obs: dict, prompt: str, noise: np.ndarray) -> np.ndarray:
  """Each row of `obs` sent by WebsocketClientPolicy with its row of `noise` -> [n, horizon, action_dim]."""
  server = PolicyServer(policy, port=0, max_batch=1).start()
  try:
    client = WebsocketClientPolicy("127.0.0.1", server.port)
    metadata = client.get_server_metadata()
    rows = [client.infer({**{key: value[i] for key, value in obs.items()}, "prompt": prompt, "noise": noise[i]})
            for i in range(len(noise))]
  finally:
    server.stop()
  return metadata, np.stack([row["actions"] for row in rows])


@pytest.fixture(scope="module")
def sft_policy(groot_checkpoint):
  return load_policy(groot_checkpoint)


@pytest.fixture(scope="module")
def rl_run(groot_checkpoint, tmp_path_factory):
  """(rl_checkpoints dir, the FlowPolicy, the saved version's params): one RL version, written as
  ejax.rl.pipeline writes them (params, optimizer state, the policy config in the metadata)."""
  config = rl_vla3.get_config(f"runlocal,actor=groot,task={TASK},sft={groot_checkpoint},size={IMAGE_SIZE}")
  config.rl.policy.num_steps = RL_NUM_STEPS
  policy = runner.make_policy(config.rl.policy, seed=0)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(policy.initial_params))))
  moved = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(next(keys), x.shape, x.dtype)
                       if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, policy.initial_params)
  directory = str(tmp_path_factory.mktemp("rl") / "rl_checkpoints")
  checkpointer = RLCheckpointer(directory)
  checkpointer.save(RL_VERSION, moved, {"count": np.zeros((), np.int32)}, {"policy": config.rl.policy.to_dict()})
  checkpointer.close()
  return directory, policy, moved


@pytest.fixture(scope="module")
def imported(groot_checkpoint, sft_policy, tmp_path_factory):
  """(the job's config: the checkpoint's own, with data.stats_path; the imported weights' dir)."""
  from ejax.data.stats import save_stats
  from ejax.models.io.convert import save_params
  from ejax.train.state import model_parts
  from flax import nnx
  root = tmp_path_factory.mktemp("imported")
  model = nnx.merge(model_parts(sft_policy.config.model).graphdef, sft_policy.model_state)
  save_params(model, str(root / "weights"))  # what --config.convert.direction=import writes
  checkpointer = Checkpointer(groot_checkpoint)
  meta = checkpointer.read_meta()
  checkpointer.close()
  save_stats(str(root / "stats.json"), {key: {name: np.asarray(value) for name, value in feature.items()}
                                        for key, feature in meta["norm_stats"].items()})
  config = ConfigDict(meta["config"])
  config.data.stats_path = str(root / "stats.json")
  config.serve.checkpoint = str(root / "weights")
  return config, str(root / "weights")


def test_an_rl_version_of_a_groot_actor_is_served_like_its_train_checkpoint(rl_run, sft_policy):
  directory, flow_policy, params = rl_run
  policy, source = load_served_policy(serve_config(directory), workdir="/nonexistent")
  assert (source.kind, source.path, source.version) == ("rl", directory, RL_VERSION)
  obs = observations(2, seed=11)
  rng = jax.random.key(5)
  # EvalPolicy (the RL and eval jobs' way of acting) draws its noise [n, horizon, max_action_dim] from rng.
  noise = np.asarray(jax.random.normal(rng, (2, *policy.noise_shape)))
  metadata, served = served_actions(policy, obs, registry.get_spec(TASK).instruction, noise)
  assert metadata["observation_spec"] == observation_spec(sft_policy).describe()
  assert metadata["action_horizon"] == 8 and metadata["action_dim"] == 4
  in_process = dict(obs, task_index=np.full(2, registry.list_tasks().index(TASK), np.int32))  # the RL env's task id
  expected = np.asarray(EvalPolicy(flow_policy, params).act(in_process, None, rng))
  assert served.shape == expected.shape == (2, 8, 4)
  np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-4)
  starting_point = np.asarray(EvalPolicy(flow_policy, flow_policy.initial_params).act(in_process, None, rng))
  assert np.abs(served - starting_point).max() > 1e-2  # the version's weights, not the SFT checkpoint's


def test_imported_weights_with_a_stats_file_are_served_like_the_checkpoint_they_came_from(imported, sft_policy):
  config, weights = imported
  policy, source = load_served_policy(config, workdir="/nonexistent")
  assert (source.kind, source.path) == ("imported", weights)
  obs = observations(2, seed=12)
  noise = np.random.default_rng(3).standard_normal((2, *sft_policy.noise_shape)).astype(np.float32)
  metadata, served = served_actions(policy, obs, "open the drawer", noise)
  assert metadata["observation_spec"] == observation_spec(sft_policy).describe()
  expected = sft_policy.act(obs, ["open the drawer"] * 2, jax.random.key(0), noise=noise)
  np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)

  config.data.stats_path = ""
  with pytest.raises(CheckpointError, match=r"carry no normalisation statistics .* --config.data.stats_path="):
    load_served_policy(config, workdir="/nonexistent")


def test_what_is_on_disk_picks_the_kind_and_anything_else_is_one_line(groot_checkpoint, rl_run, imported, tmp_path):
  rl_dir, _, _ = rl_run
  train_dir = os.path.abspath(groot_checkpoint)
  assert find_source(os.path.dirname(train_dir)) == find_source(train_dir)  # a train workdir
  assert (find_source(train_dir, 2).kind, find_source(train_dir, 2).version) == ("train", 2)
  assert find_source(os.path.join(rl_dir, str(RL_VERSION))).version == RL_VERSION  # a version's directory
  assert find_source(os.path.dirname(rl_dir), RL_VERSION).path == rl_dir  # an rl workdir
  for path, version, message in [
      (str(tmp_path), -1, "is none of what job serve loads: point serve.checkpoint at a train job's"),
      (str(tmp_path / "gone"), -1, "does not exist: point it at a train job's <workdir>/checkpoints, an rl job's"),
      (rl_dir, 7, f"holds no version 7; saved: [{RL_VERSION}]"),
      (os.path.join(rl_dir, str(RL_VERSION)), 0, f"names step {RL_VERSION} but serve.version=0"),
      (imported[1], 3, "have no steps or versions: leave serve.version at -1"),
  ]:
    with pytest.raises(CheckpointError, match=re.escape(message)) as error:
      find_source(path, version)
    assert "\n" not in str(error.value)


def test_a_state_based_rl_actor_is_refused_with_a_one_line_error(tmp_path):
  config = rl_vla3.get_config("runlocal,task=point_reach")
  policy = runner.make_policy(config.rl.policy, seed=0)
  directory = str(tmp_path / "rl_checkpoints")
  checkpointer = RLCheckpointer(directory)
  checkpointer.save(0, policy.initial_params, {"count": np.zeros((), np.int32)}, {"policy": config.rl.policy.to_dict()})
  checkpointer.close()
  with pytest.raises(CheckpointError, match="kind='mlp_flow' actor, which reads the simulator's privileged object "
                     "state .* judge this one with --config.eval.policy=rl") as error:
    load_served_policy(serve_config(directory), workdir="/nonexistent")
  assert "\n" not in str(error.value)
