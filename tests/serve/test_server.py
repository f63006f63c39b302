"""Job `serve` driven by openpi's own client (openpi_client.WebsocketClientPolicy), unchanged.

One server on a free local port for the module, with an API key and batches of up to 2, over the
small GR00T checkpoint of tests/serve/conftest.py.
"""

import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
import websockets.exceptions
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.sync.client import connect

from ejax.errors import UserError
from ejax.serve.server import PolicyServer, check_binding
from ejax.train.policy import load_policy
from tests.serve.conftest import IMAGE_SIZE, TASK

PROMPT = "lift the green block"  # TASK's instruction
from tests.train.helpers import REPO

API_KEY = "test-key"
MAX_MESSAGE_BYTES = 2**20
SPEC = {"observation.state": ([11], "float32"), "observation.images.agentview": ([IMAGE_SIZE, IMAGE_SIZE, 3], "uint8"),
        "observation.images.wrist": ([IMAGE_SIZE, IMAGE_SIZE, 3], "uint8"), "prompt": ([], "str")}


@pytest.fixture(scope="module")
def policy(groot_checkpoint):
  return load_policy(groot_checkpoint)


@pytest.fixture(scope="module")
def server(policy):
  # A generous wait for the other client's request: on a loaded CI machine 5 ms can pass between two
  # lock-stepped clients' sends, and the concurrency test must see them batched.
  server = PolicyServer(policy, port=0, api_key=API_KEY, max_batch=2, max_wait_ms=100,
                        max_message_bytes=MAX_MESSAGE_BYTES).start()
  yield server
  server.stop()


def client(server, api_key=API_KEY) -> WebsocketClientPolicy:
  return WebsocketClientPolicy("127.0.0.1", server.port, api_key=api_key)


def observation(seed: int, noise_shape=None) -> dict:
  rng = np.random.default_rng(seed)
  obs = {"observation.state": rng.normal(0.0, 0.3, 11).astype(np.float32),
         "observation.images.agentview": rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8),
         "observation.images.wrist": rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8),
         "prompt": PROMPT}
  if noise_shape is not None:
    obs["noise"] = rng.standard_normal(noise_shape).astype(np.float32)
  return obs


def in_process(policy, observations: list[dict]) -> np.ndarray:
  """The same observations and noise through the checkpoint's policy directly, as one batch."""
  batch = {key: np.stack([o[key] for o in observations]) for key in SPEC if key != "prompt"}
  return policy.act(batch, [o["prompt"] for o in observations], jax.random.key(0),
                    noise=np.stack([o["noise"] for o in observations]))


def test_metadata_lists_the_observation_keys_and_an_example_to_send(server, policy):
  metadata = client(server).get_server_metadata()
  spec = metadata["observation_spec"]
  for key, (shape, dtype) in SPEC.items():
    assert spec[key]["shape"] == shape and spec[key]["dtype"] == dtype and spec[key]["required"], key
  # The noise is the model's: every action dim it predicts, padding included (max_action_dim 6).
  assert spec["noise"] == {"shape": [8, 6], "dtype": "float32", "required": False}
  assert metadata["action_horizon"] == 8 and metadata["action_dim"] == 4
  assert metadata["trained_tasks"] == [TASK] and metadata["camera_size"] == [IMAGE_SIZE, IMAGE_SIZE]
  example = metadata["example_observation"]
  assert sorted(example) == sorted(SPEC) and example["prompt"] == PROMPT
  assert example["observation.images.wrist"].dtype == np.uint8
  reply = client(server).infer(example)  # the example is a valid observation as it is
  assert reply["actions"].shape == (8, 4)


def test_infer_returns_the_checkpoints_denormalised_chunk_and_timing(server, policy):
  obs = observation(1, noise_shape=(8, 6))
  reply = client(server).infer(obs)
  assert reply["actions"].shape == (8, 4) and reply["actions"].dtype == np.float32
  np.testing.assert_allclose(reply["actions"], in_process(policy, [obs])[0], rtol=1e-5, atol=1e-5)
  timing = reply["server_timing"]
  assert timing["infer_ms"] > 0 and timing["batch_size"] == 1 and timing["queue_ms"] >= 0
  # Without noise the server draws its own: still a chunk in the env's units.
  del obs["noise"]
  assert np.isfinite(client(server).infer(obs)["actions"]).all()


@pytest.mark.parametrize("change, named", [
    (lambda obs: obs.pop("observation.images.wrist"), "'observation.images.wrist' is missing: expected uint8 [32, 32, 3]"),
    (lambda obs: obs.update({"observation.images.agentview": np.zeros((64, 64, 3), np.uint8)}),
     "'observation.images.agentview' is uint8 [64, 64, 3], expected uint8 [32, 32, 3]"),
    (lambda obs: obs.update({"observation.images.agentview": np.zeros((32, 32, 3), np.float32)}),
     "'observation.images.agentview' is float32 [32, 32, 3], expected uint8 [32, 32, 3]"),
    (lambda obs: obs.update({"observation.state": np.zeros(7, np.float32)}),
     "'observation.state' is float32 [7], expected float32 [11]"),
])
def test_a_bad_observation_gets_a_one_line_error_and_the_server_keeps_serving(server, change, named):
  policy_client = client(server)
  obs = observation(2)
  change(obs)
  with pytest.raises(RuntimeError) as error:
    policy_client.infer(obs)
  # openpi's client prefixes the server's text frame with one line of its own.
  reply = str(error.value).split("\n", 1)[1]
  assert "\n" not in reply and named in reply, reply
  assert policy_client.infer(observation(3))["actions"].shape == (8, 4)  # same connection, still served
  assert client(server).infer(observation(4))["actions"].shape == (8, 4)


@pytest.mark.parametrize("api_key", ["wrong-key", None])
def test_a_wrong_or_missing_api_key_is_refused_before_any_inference(server, api_key):
  batches = list(server.batcher.batch_sizes)
  with pytest.raises(websockets.exceptions.InvalidStatus) as error:
    client(server, api_key=api_key)
  assert error.value.response.status_code == 401
  assert server.batcher.batch_sizes == batches


def test_two_concurrent_clients_are_batched_and_each_gets_its_own_rows(server, policy):
  clients = [client(server) for _ in range(2)]
  observations = [[observation(100 * c + i, noise_shape=(8, 6)) for i in range(4)] for c in range(2)]
  replies = [[None] * 4 for _ in range(2)]
  start = threading.Barrier(2)

  def run(c):
    start.wait()
    for i, obs in enumerate(observations[c]):
      replies[c][i] = clients[c].infer(obs)

  threads = [threading.Thread(target=run, args=(c,)) for c in range(2)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(120)
  sizes = [reply["server_timing"]["batch_size"] for row in replies for reply in row]
  assert 2 in sizes, sizes  # the lock-stepped clients shared batches
  # One compilation per batch-size bucket (1 and 2), however the requests were grouped.
  assert policy._sample._cache_size() <= len(server.batcher.buckets)
  for c in range(2):
    expected = in_process(policy, observations[c])
    for i in range(4):
      np.testing.assert_allclose(replies[c][i]["actions"], expected[i], rtol=1e-4, atol=1e-4)


def test_control_messages_are_answered_and_an_oversized_message_is_refused(server):
  headers = {"Authorization": f"Api-Key {API_KEY}"}
  uri = f"ws://127.0.0.1:{server.port}"
  with connect(uri, additional_headers=headers, max_size=None) as websocket:
    websocket.recv()  # metadata
    for kind in ("episode_start", "episode_end"):
      websocket.send(msgpack_numpy.packb({"control": kind}))
      assert msgpack_numpy.unpackb(websocket.recv()) == {"control": kind, "ok": True}
    websocket.send(msgpack_numpy.packb({"blob": np.zeros(2 * MAX_MESSAGE_BYTES, np.uint8)}))
    with pytest.raises(websockets.exceptions.ConnectionClosedError) as closed:
      websocket.recv()
    assert closed.value.rcvd.code == 1009  # message too big: only this connection closes
  assert client(server).infer(observation(5))["actions"].shape == (8, 4)


def test_serving_beyond_localhost_needs_an_api_key(policy):
  with pytest.raises(UserError, match="set --config.serve.api_key"):
    check_binding("0.0.0.0", "")
  check_binding("0.0.0.0", "secret")
  with pytest.raises(UserError, match="exposes the policy"):
    PolicyServer(policy, host="0.0.0.0", port=0)


def _main(*args: str, **popen) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  return subprocess.Popen([sys.executable, "-m", "ejax.main", "--config=configs/groot.py:runlocal",
                           "--config.job=serve", *args], cwd=REPO, env=env, text=True, **popen)


@pytest.mark.timeout(600)
def test_the_serve_job_serves_a_checkpoint_from_the_command_line(groot_checkpoint, tmp_path):
  refused = _main("--config.serve.host=0.0.0.0", stderr=subprocess.PIPE)
  assert refused.wait(120) == 2
  assert refused.stderr.read().strip().splitlines()[-1].startswith("error: serve.host=0.0.0.0 exposes the policy")

  job = _main(f"--config.serve.checkpoint={groot_checkpoint}", "--config.serve.port=0", "--config.serve.max_batch=1",
              "--config.serve.weights=fp8_block", f"--config.compilation_cache_dir={tmp_path / 'xla'}",
              stdout=subprocess.PIPE)
  try:
    lines = []
    for line in job.stdout:
      lines.append(line)
      if line.startswith("ready on "):
        break
    assert lines and lines[-1].startswith("ready on ws://127.0.0.1:"), lines
    port = int(lines[-1].strip().rsplit(":", 1)[1])
    remote = WebsocketClientPolicy("127.0.0.1", port)
    assert remote.get_server_metadata()["weights"] == "fp8_block"
    assert remote.get_server_metadata()["checkpoint"] == os.path.abspath(groot_checkpoint)
    actions = remote.infer(observation(6))["actions"]
    assert actions.shape == (8, 4) and np.isfinite(actions).all()
  finally:
    job.terminate()
    job.wait(60)
