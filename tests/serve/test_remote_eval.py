"""The eval job driving a served policy (--config.eval.policy=remote) replays in-process evaluation of
the same checkpoint on the same seeds: the same episodes, actions and success rates."""

import json

import numpy as np
import pytest

from configs import eval as eval_config
from ejax.eval import evaluate
from ejax.serve.server import PolicyServer
from ejax.train.policy import load_policy
from tests.serve.conftest import IMAGE_SIZE, TASK


class Recording:
  """A policy that keeps every chunk it returned."""

  def __init__(self, policy):
    self.policy, self.chunks = policy, []

  def __getattr__(self, name):
    return getattr(self.policy, name)

  def act(self, obs, instructions, rng):
    chunk = np.asarray(self.policy.act(obs, instructions, rng))
    self.chunks.append(chunk)
    return chunk


def eval_settings(policy: str, checkpoint: str, address: str = ""):
  config = eval_config.get_config(f"policy={policy}")
  # 3 envs with batches of at most 2 on the server: requests are split and padded differently from
  # the in-process batch of 3, which must not change the actions beyond float tolerance.
  config.eval.update(checkpoint=checkpoint, address=address, remote_connections=3, tasks="", episodes_per_task=3,
                     num_envs=3, image_height=IMAGE_SIZE, image_width=IMAGE_SIZE, replan_every=4,
                     episode_length=16, videos_per_task=0)
  return config


@pytest.mark.timeout(900)
def test_remote_evaluation_equals_in_process_evaluation(groot_checkpoint, tmp_path):
  in_process = Recording(evaluate.make_policy(eval_settings("checkpoint", groot_checkpoint), 4))
  server = PolicyServer(load_policy(groot_checkpoint), port=0, max_batch=2, max_wait_ms=100).start()
  try:
    config = eval_settings("remote", "", address=f"127.0.0.1:{server.port}")
    remote = Recording(evaluate.make_policy(config, 4))
    remote_cfg = evaluate.resolve_defaults(config.eval, remote)
    remote_summary = evaluate.evaluate_policy(remote, remote_cfg, str(tmp_path / "remote"), "remote")
    assert sorted(set(server.batcher.batch_sizes)) == [1, 2]  # 3 requests a step: a batch of 2 and one of 1
  finally:
    server.stop()
  cfg = evaluate.resolve_defaults(eval_settings("checkpoint", groot_checkpoint).eval, in_process)
  summary = evaluate.evaluate_policy(in_process, cfg, str(tmp_path / "local"), "checkpoint")

  assert remote_cfg.tasks == cfg.tasks == TASK  # the served metadata names the trained tasks
  assert len(remote.chunks) == len(in_process.chunks) == 4
  for served, local in zip(remote.chunks, in_process.chunks):
    assert served.shape == local.shape == (3, 8, 4)
    np.testing.assert_allclose(served, local, rtol=1e-4, atol=1e-4)
  assert [row["successes"] for row in remote_summary["tasks"]] == [row["successes"] for row in summary["tasks"]]
  assert remote_summary["overall"]["success_rate"] == summary["overall"]["success_rate"]
  written = json.loads((tmp_path / "remote" / "summary.json").read_text())
  assert written["policy"] == "remote" and written["overall"]["episodes"] == 3
