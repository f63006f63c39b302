"""The server outlives whatever a request does to it: a policy that raises, a text frame, a message
that is not msgpack. A stand-in policy (no checkpoint) keeps these fast."""

import http.client
import urllib.request

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.sync.client import connect

from ejax.serve.server import PolicyServer
from ejax.serve.spec import Field, ObservationSpec

SPEC = ObservationSpec({"observation.state": Field((3,), "float32"), "prompt": Field((), "str")}, noise_shape=(2, 1))


class StandInPolicy:
  """Actions [n, 2, 1] = the state's first entry; the instruction "fail" raises, as a broken model would."""

  horizon, action_dim, trained_tasks, camera_size = 2, 1, None, None

  def act(self, obs, instructions, rng, noise=None):
    if "fail" in instructions:
      raise RuntimeError("the model failed\nwith a second line")
    return np.repeat(obs["observation.state"][:, None, :1], 2, axis=1)


@pytest.fixture(scope="module")
def server():
  server = PolicyServer(StandInPolicy(), port=0, max_batch=4, spec=SPEC).start()
  yield server
  server.stop()


def observation(value: float, prompt: str = "lift") -> dict:
  return {"observation.state": np.full(3, value, np.float32), "prompt": prompt}


def test_a_failing_inference_is_a_one_line_error_and_the_next_request_is_served(server):
  client = WebsocketClientPolicy("127.0.0.1", server.port)
  with pytest.raises(RuntimeError) as error:
    client.infer(observation(1.0, prompt="fail"))
  assert str(error.value).split("\n", 1)[1] == "error: inference failed: RuntimeError: the model failed"
  np.testing.assert_array_equal(client.infer(observation(2.0))["actions"], [[2.0], [2.0]])


@pytest.mark.parametrize("frame, expected", [
    ("a text frame", "error: send observations as binary msgpack frames"),
    (b"\xc1 not msgpack", "error: the message is not msgpack"),
    (b"\x93\x01\x02\x03", "error: an observation is a map of key -> array, got list"),  # msgpack [1, 2, 3]
    (b"\x81\xa7control\xa5pause", "error: unknown control message 'pause'"),
])
def test_malformed_frames_get_an_error_frame_on_an_open_connection(server, frame, expected):
  with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as websocket:
    websocket.recv()  # metadata
    websocket.send(frame)
    reply = websocket.recv()
    assert isinstance(reply, str) and reply.startswith(expected) and "\n" not in reply, reply
  assert WebsocketClientPolicy("127.0.0.1", server.port).infer(observation(3.0))["actions"].shape == (2, 1)


def test_health_check_answers_plain_http(server):
  with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10) as response:
    assert response.status == http.client.OK and response.read() == b"OK\n"
