"""Job `serve`: a trained policy behind openpi's websocket protocol, for robots and eval harnesses.

    python -m ejax.main --config=configs/groot.py:runlocal --config.job=serve \
        --config.serve.checkpoint=runs/groot_runlocal/checkpoints

serve.checkpoint may also be an RL job's rl_checkpoints of a GR00T actor (serve.version picks the
version) or released weights imported by the convert job (with the config's data.stats_path):
ejax/serve/load.py tells them apart by what is on disk.

Any client written against `openpi_client.websocket_client_policy.WebsocketClientPolicy` drives it
unchanged. Per connection:
  1. the server sends its metadata (msgpack): the observation keys with shapes and dtypes
     ("observation_spec"), an "example_observation" to send as it is, action horizon and size;
  2. each binary frame is an observation (msgpack with numpy arrays, ejax/serve/wire.py); the reply
     is {"actions": [horizon, action_dim] float32 in the env's units, "server_timing": {...}};
     {"control": "episode_start" | "episode_end"} is answered with {"control": ..., "ok": True};
  3. a request the server cannot answer gets one text frame, "error: <what and what to expect>",
     and the connection stays open for the next one.
Safety: 127.0.0.1 by default; any other host needs serve.api_key, which clients send as
`Authorization: Api-Key <key>` (WebsocketClientPolicy(api_key=...)); a wrong or missing key is refused
(HTTP 401) before the websocket opens. A message over serve.max_message_bytes closes only its own
connection (code 1009). GET /healthz answers "OK" for load balancers.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import logging
import os
import threading
import time
from typing import Any

from websockets.asyncio.server import serve as websocket_serve
from websockets.exceptions import ConnectionClosed

from ejax.errors import UserError
from ejax.serve import wire
from ejax.serve.batcher import Batcher
from ejax.serve.spec import ObservationError, ObservationSpec, observation_spec

logger = logging.getLogger(__name__)

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
CONTROL_KEY = "control"
CONTROL_MESSAGES = ("episode_start", "episode_end")


def check_binding(host: str, api_key: str) -> None:
  if host not in LOCAL_HOSTS and not api_key:
    raise UserError(f"serve.host={host} exposes the policy beyond this machine: set --config.serve.api_key=<secret> "
                    "(clients send it as 'Authorization: Api-Key <secret>'), or serve on 127.0.0.1")


class PolicyServer:
  """Serves `policy` (a CheckpointPolicy) until stop(); start() runs it on a background thread."""

  def __init__(self, policy, *, host: str = "127.0.0.1", port: int = 8000, api_key: str = "",
               max_batch: int = 16, max_wait_ms: float = 5.0, max_message_bytes: int = 16 * 2**20,
               seed: int = 0, spec: ObservationSpec | None = None, info: dict | None = None):
    check_binding(host, api_key)
    self.host, self.port, self.api_key, self.max_message_bytes = host, port, api_key, max_message_bytes
    self.spec = spec or observation_spec(policy)
    self.batcher = Batcher(policy, self.spec, max_batch=max_batch, max_wait_ms=max_wait_ms, seed=seed)
    self.metadata = self._metadata(policy, info or {})
    self._packed_metadata = wire.packb(self.metadata)
    self._loop: asyncio.AbstractEventLoop | None = None
    self._server = None
    self._thread: threading.Thread | None = None
    self._ready = threading.Event()
    self._startup_error: BaseException | None = None

  def _metadata(self, policy, info: dict) -> dict[str, Any]:
    return {
        "server": "ejax", "protocol": "openpi websocket, msgpack_numpy",
        "observation_spec": self.spec.describe(), "example_observation": self.spec.example(),
        "action_horizon": int(policy.horizon), "action_dim": int(policy.action_dim or 0),
        "noise_shape": list(self.spec.noise_shape), "max_batch": self.batcher.max_batch,
        "trained_tasks": policy.trained_tasks or [], "camera_size": self.spec.camera_size(),
        "control_messages": list(CONTROL_MESSAGES), **info,
    }

  # --- lifecycle ---

  def start(self) -> "PolicyServer":
    """Starts the batcher and the websocket server on a background thread; returns once clients can
    connect (self.port holds the bound port when port 0 asked for a free one)."""
    self.batcher.start()
    self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="serve", daemon=True)
    self._thread.start()
    self._ready.wait()
    if self._startup_error is not None:
      self.batcher.stop()
      raise self._startup_error
    return self

  def wait(self) -> None:
    """Blocks until the server stops (in slices, so that Ctrl-C gets through)."""
    while self._thread is not None and self._thread.is_alive():
      self._thread.join(0.5)

  def stop(self) -> None:
    if self._loop is not None and self._server is not None:
      self._loop.call_soon_threadsafe(self._server.close)
    if self._thread is not None:
      self._thread.join()
    self.batcher.stop()

  async def _main(self) -> None:
    self._loop = asyncio.get_running_loop()
    try:
      self._server = await websocket_serve(
          self._handle, self.host, self.port, compression=None, max_size=self.max_message_bytes,
          process_request=self._process_request)
    except OSError as error:
      self._startup_error = UserError(f"cannot serve on {self.host}:{self.port}: {error.strerror or error}")
      self._ready.set()
      return
    self.port = self._server.sockets[0].getsockname()[1]
    logger.info("serve: listening on ws://%s:%d", self.host, self.port)
    self._ready.set()
    await self._server.wait_closed()

  # --- per connection ---

  def _process_request(self, connection, request):
    """Before the websocket handshake: the health check, then the API key."""
    if request.path == "/healthz":
      return connection.respond(http.HTTPStatus.OK, "OK\n")
    if self.api_key:
      sent = request.headers.get("Authorization", "")
      expected = f"Api-Key {self.api_key}"
      if not hmac.compare_digest(sent.encode(), expected.encode()):
        logger.warning("serve: refused %s: wrong or missing API key", connection.remote_address)
        return connection.respond(http.HTTPStatus.UNAUTHORIZED,
                                  "wrong or missing API key: send the header 'Authorization: Api-Key <key>'\n")
    return None

  async def _handle(self, websocket) -> None:
    try:
      await websocket.send(self._packed_metadata)
      previous_total_ms = None
      async for message in websocket:
        start = time.perf_counter()
        await websocket.send(await self._answer(message, previous_total_ms, websocket))
        previous_total_ms = 1000.0 * (time.perf_counter() - start)
    except ConnectionClosed as closed:
      if closed.sent is not None and closed.sent.code == 1009:
        logger.warning("serve: refused a message over serve.max_message_bytes=%d", self.max_message_bytes)
    finally:
      self.batcher.forget(websocket)

  async def _answer(self, message, previous_total_ms: float | None, client) -> bytes | str:
    """The reply frame: msgpack bytes, or a one-line text error."""
    if isinstance(message, str):
      return "error: send observations as binary msgpack frames (openpi_client.msgpack_numpy), not text"
    try:
      observation = wire.unpackb(message)
    except Exception as error:
      return f"error: the message is not msgpack with numpy arrays ({type(error).__name__}: {error})"
    if isinstance(observation, dict) and CONTROL_KEY in observation:
      kind = observation[CONTROL_KEY]
      if kind not in CONTROL_MESSAGES:
        return f"error: unknown control message {kind!r}: expected one of {list(CONTROL_MESSAGES)}"
      return wire.packb({CONTROL_KEY: kind, "ok": True})
    try:
      inputs = self.spec.check(observation)
    except ObservationError as error:
      return f"error: {error}"
    try:
      result = await self.batcher.submit(inputs, client)
    except Exception as error:
      reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
      return f"error: inference failed: {type(error).__name__}: {reason}"
    timing = {"infer_ms": result["infer_ms"], "queue_ms": result["queue_ms"], "batch_size": result["batch_size"]}
    if previous_total_ms is not None:
      timing["prev_total_ms"] = previous_total_ms
    return wire.packb({"actions": result["actions"], "server_timing": timing})


def check_config(config, workdir: str) -> None:
  """The serve job's settings, checked before minutes of loading and compiling: one line naming the
  setting and the fix (ejax.main prints it)."""
  from ejax.config.validate import ConfigError, require_one_of, require_positive, require_section
  from ejax.checkpoint.kinds import checkpoint_kind
  from ejax.serve.load import ACCEPTED, find_source
  serve = require_section(config, "serve", "a model config (configs/groot.py, configs/pi05.py) with --config.job=serve")
  check_binding(serve.host, serve.api_key)
  require_one_of("serve.weights", serve.weights, ("same", "fp8_block"))
  require_positive(serve, "serve", "max_batch", "max_message_bytes")
  if not isinstance(serve.port, int) or not 0 <= serve.port < 65536:
    raise ConfigError(f"serve.port={serve.port!r} is not a TCP port: use 0 (any free port) to 65535")
  if not serve.checkpoint and not any(checkpoint_kind(os.path.join(workdir, name))
                                      for name in ("", "checkpoints", "rl_checkpoints")):
    raise ConfigError(f"serve.checkpoint is not set and the workdir {workdir} holds no checkpoints/ or "
                      f"rl_checkpoints/: pass --config.serve.checkpoint=<{ACCEPTED}>")
  find_source(serve.checkpoint or workdir, int(serve.get("version", -1)))  # what is on disk, or one line


def run_job(config, workdir: str) -> None:
  serve = config.serve
  check_config(config, workdir)  # before minutes of loading and compiling
  from ejax.config.runtime import enable_compilation_cache
  enable_compilation_cache(config.get("compilation_cache_dir"))  # a restarted server skips compiling
  from ejax.serve.load import load_served_policy
  policy, source = load_served_policy(config, workdir)
  server = PolicyServer(policy, host=serve.host, port=int(serve.port), api_key=serve.api_key,
                        max_batch=int(serve.max_batch), max_wait_ms=float(serve.max_wait_ms),
                        max_message_bytes=int(serve.max_message_bytes), seed=int(serve.seed),
                        info={"checkpoint": source.path, "checkpoint_kind": source.kind, "version": source.version,
                              "model": str(policy.config.model.name), "weights": serve.weights})
  if serve.warmup:
    server.batcher.warmup()
  keys = ", ".join(f"{key} {field.describe()}" for key, field in server.spec.fields.items())
  print(f"serving {source.kind} {source.path} (expects {keys})", flush=True)
  server.start()
  print(f"ready on ws://{serve.host}:{server.port}", flush=True)
  try:
    server.wait()
  except KeyboardInterrupt:
    server.stop()
