"""A served policy (job `serve`, or any server speaking openpi's protocol with ejax's metadata) behind
ejax.eval's policy interface: `--config.eval.policy=remote --config.eval.address=HOST:PORT`.

act() sends one observation per env, as a robot would, over `connections` websocket connections at
once, so the server batches them. Each request carries its env's row of the flow noise the
checkpoint's own policy would draw from the same rng (normal(rng, [num_envs, *noise_shape])), so a
served policy evaluated on the same seeds gives the in-process evaluation's actions, up to float
tolerance, and its success rates.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from websockets.sync.client import connect

from ejax.serve import wire
from ejax.serve.spec import NOISE_KEY, PROMPT_KEY


class ServerError(RuntimeError):
  """The server answered a request with an error (its one-line text frame)."""


class Connection:
  """One websocket connection: metadata on connect, infer(observation) -> reply dict."""

  def __init__(self, address: str, api_key: str = "", open_timeout_s: float = 30.0):
    self.uri = address if address.startswith(("ws://", "wss://")) else f"ws://{address}"
    headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
    # Held open as the context manager websockets >= 17.1 asks connect() to be used as.
    self._open = contextlib.ExitStack()
    self._websocket = self._open.enter_context(connect(self.uri, compression=None, max_size=None,
                                                       additional_headers=headers, open_timeout=open_timeout_s))
    self.metadata = wire.unpackb(self._websocket.recv())

  def infer(self, observation: dict[str, Any]) -> dict[str, Any]:
    self._websocket.send(wire.packb(observation))
    reply = self._websocket.recv()
    if isinstance(reply, str):
      raise ServerError(f"policy server at {self.uri}: {reply}")
    return wire.unpackb(reply)

  def close(self) -> None:
    self._open.close()


class RemotePolicy:
  """act(obs, instructions, rng) -> [num_envs, horizon, action_dim], answered by a policy server."""

  uses_privileged_state = False

  def __init__(self, address: str, *, api_key: str = "", connections: int = 16):
    if not address:
      raise ValueError("config.eval.policy='remote' needs --config.eval.address=<host:port of a serve job>")
    self.address, self.api_key = address, api_key
    self._connections = [Connection(address, api_key)]
    self.metadata = self._connections[0].metadata
    self.keys = [key for key, field in self.metadata["observation_spec"].items()
                 if key not in (PROMPT_KEY, NOISE_KEY)]
    self.noise_shape = tuple(self.metadata["noise_shape"])
    self._pool = concurrent.futures.ThreadPoolExecutor(max(1, connections), thread_name_prefix="remote-policy")
    self.max_connections = max(1, connections)

  @property
  def trained_tasks(self) -> list[str] | None:
    return list(self.metadata.get("trained_tasks") or []) or None

  @property
  def camera_size(self) -> tuple[int, int] | None:
    size = self.metadata.get("camera_size")
    return (int(size[0]), int(size[1])) if size else None

  def act(self, obs: dict[str, np.ndarray], instructions: list[str], rng: jax.Array) -> np.ndarray:
    num_envs = len(instructions)
    noise = np.asarray(jax.random.normal(rng, (num_envs, *self.noise_shape), jnp.float32))
    requests = []
    for i, instruction in enumerate(instructions):
      request = {key: np.asarray(obs[key][i]) for key in self.keys if key in obs}
      request[PROMPT_KEY] = instruction
      request[NOISE_KEY] = noise[i]
      requests.append(request)
    while len(self._connections) < min(self.max_connections, num_envs):
      self._connections.append(Connection(self.address, self.api_key))
    actions: list[np.ndarray | None] = [None] * num_envs

    def serve(connection_index: int) -> None:
      connection = self._connections[connection_index]
      for i in range(connection_index, num_envs, len(self._connections)):
        actions[i] = np.asarray(connection.infer(requests[i])["actions"], np.float32)

    for future in [self._pool.submit(serve, c) for c in range(min(len(self._connections), num_envs))]:
      future.result()
    return np.stack(actions)

  def close(self) -> None:
    for connection in self._connections:
      connection.close()
    self._pool.shutdown()
