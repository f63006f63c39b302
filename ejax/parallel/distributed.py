"""Multi-host start-up through jax.distributed, from config or the cluster's environment."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
from typing import Any, Callable

import jax
from absl import logging

from ejax.errors import UserError

# Variables launchers set; jax.distributed.initialize() auto-detects SLURM, Open MPI, TPU pods and
# Kubernetes JobSets by itself, so these are read only to tell whether this is a multi-process run.
HEARTBEAT_TIMEOUT_S = 150  # jax's default is 100 s; see initialize()
# s a peer's heartbeat may stand still before ejax's watchdog ends the run naming it (a kill -9, a lost
# host): distributed.peer_lost_after, at least a few of the watchdog's 2 s heartbeats and below jax's
# own heartbeat timeout, which aborts the process instead.
PEER_LOST_AFTER_S = 40.0
_MIN_PEER_LOST_AFTER_S = 10.0
_peer_lost_after_s = PEER_LOST_AFTER_S
_CLUSTER_HINTS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES")


def initialize(distributed_config) -> None:
  """Starts jax.distributed when the config or the environment asks for several processes.

  config fields (all optional): coordinator_address "host:port", num_processes, process_id,
  initialization_timeout (s), local_device_ids. Environment fallbacks: JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a scheduler jax detects itself (SLURM, Open MPI, ...).
  Must run before anything touches a JAX device.
  """
  cfg = distributed_config
  address = cfg.get("coordinator_address") or os.environ.get("JAX_COORDINATOR_ADDRESS")
  num_processes = cfg.get("num_processes") or _env_int("JAX_NUM_PROCESSES")
  process_id = cfg.get("process_id")
  if process_id is None or process_id < 0:
    process_id = _env_int("JAX_PROCESS_ID")
  explicit = address is not None or (num_processes or 1) > 1
  detected = any(os.environ.get(k) not in (None, "", "1") for k in _CLUSTER_HINTS[:2])
  if not (explicit or detected or cfg.get("force", False)):
    return
  if explicit and (address is None or num_processes is None or process_id is None):
    raise ValueError(
        "multi-process run needs coordinator_address, num_processes and process_id: set "
        "config.distributed.* or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID")
  kwargs = {}
  if explicit:
    kwargs.update(coordinator_address=address, num_processes=int(num_processes), process_id=int(process_id))
  if cfg.get("initialization_timeout"):
    kwargs["initialization_timeout"] = int(cfg.initialization_timeout)
  # jax.distributed aborts a process whose peer misses heartbeats this long, with a C++ stack trace;
  # ejax's watchdog (ejax/parallel/watchdog.py) names a lost peer in one line well before that.
  kwargs["heartbeat_timeout_seconds"] = int(cfg.get("heartbeat_timeout_s") or HEARTBEAT_TIMEOUT_S)
  global _peer_lost_after_s
  lost = float(cfg.get("peer_lost_after") or PEER_LOST_AFTER_S)
  if not _MIN_PEER_LOST_AFTER_S <= lost < kwargs["heartbeat_timeout_seconds"]:
    raise UserError(f"distributed.peer_lost_after={lost:g}: set it between {_MIN_PEER_LOST_AFTER_S:g} s and "
                    f"jax's heartbeat timeout ({kwargs['heartbeat_timeout_seconds']} s), e.g. "
                    f"--config.distributed.peer_lost_after={PEER_LOST_AFTER_S:g}")
  _peer_lost_after_s = lost
  if cfg.get("local_device_ids") is not None:
    kwargs["local_device_ids"] = list(cfg.local_device_ids)
  logging.info("jax.distributed.initialize(%s)", kwargs)
  with _service_in_own_process():
    jax.distributed.initialize(**kwargs)
  logging.info("process %d of %d, %d local / %d global devices", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())


def peer_lost_after_s() -> float:
  """distributed.peer_lost_after of this process's run (PEER_LOST_AFTER_S before initialize())."""
  return _peer_lost_after_s


@contextlib.contextmanager
def _service_in_own_process():
  """Inside, process 0 of jax.distributed.initialize() starts the coordination service in a child
  process (ejax/parallel/coordinator.py) instead of in itself, so that the other processes outlive
  a kill -9 of process 0 long enough for the watchdog's one line. Where that cannot work (no
  /proc to tell when the clients are gone, or a jax whose internals differ) nothing changes."""
  from jax._src import distributed as jax_distributed
  jaxlib = getattr(jax_distributed, "_jax", None)
  if not (hasattr(jaxlib, "get_distributed_runtime_service") and os.path.exists("/proc/self/net/tcp")):
    yield
    return

  class JaxlibStartingAChild:  # jaxlib as jax.distributed calls it, but for where the service runs
    def __getattr__(self, name):
      return getattr(jaxlib, name)

    @staticmethod
    def get_distributed_runtime_service(address: str, num_nodes: int, **options) -> "ServiceProcess":
      return ServiceProcess(address, num_nodes, options)

  jax_distributed._jax = JaxlibStartingAChild()
  try:
    yield
  finally:
    jax_distributed._jax = jaxlib


class ServiceProcess:
  """The coordination service running in a child process; shutdown() (jax.distributed.shutdown)
  ends it. If this process ends without it, the child ends once every client has disconnected."""

  def __init__(self, address: str, num_nodes: int, options: dict):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "coordinator.py")
    options = {k: v for k, v in options.items() if v is not None}
    # Not this process's stderr: a reader of it (a pipe, `| tee`) would wait for the child to end too.
    self._child = subprocess.Popen([sys.executable, "-P", script, address, str(num_nodes), json.dumps(options)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    said = self._child.stdout.readline().strip()
    if said != "ready":
      self._child.wait()
      raise RuntimeError(said or f"the coordination service on {address} exited {self._child.returncode} at start")
    logging.info("coordination service on %s in process %d", address, self._child.pid)

  def shutdown(self) -> None:
    if self._child.poll() is None:
      with contextlib.suppress(OSError):
        self._child.stdin.write("shutdown\n")
        self._child.stdin.flush()
      try:
        self._child.wait(60)
      except subprocess.TimeoutExpired:
        self._child.kill()


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  return int(value) if value not in (None, "") else None


def barrier(name: str, timeout_s: int = 1800) -> None:
  """Waits until every process reaches `name`, through the coordination service (no collective).

  CPU collectives (gloo) give up if a peer arrives more than ~30 s late, and processes compile at
  different speeds on busy hosts; meeting here first keeps the first collective in step.
  """
  if jax.process_count() == 1:
    return
  import orbax.checkpoint as ocp  # its barrier waits on the jax.distributed client
  ocp.multihost.sync_global_processes(name, timeout=timeout_s)


def broadcast_flag(value: bool) -> bool:
  """Process 0's `value` on every process (e.g. whether it could take a lock all must respect)."""
  if jax.process_count() == 1:
    return bool(value)
  from jax.experimental import multihost_utils
  import numpy as np
  return bool(multihost_utils.broadcast_one_to_all(np.int32(bool(value))))


# -- the coordination service's key-value store --------------------------------------------------
# Control messages between processes (who is ready, who stopped and why) go through jax.distributed's
# coordination service rather than collectives: a key can be waited on for as long as a peer needs
# (gloo collectives give up when a peer is ~30 s late), and polling it never blocks the devices.


def _client():
  from jax._src import distributed as jax_distributed
  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialised: key-value messages need a multi-process run")
  return client


def kv_set(key: str, value: str, allow_overwrite: bool = False) -> None:
  """Publishes `value` under `key` to every process (a key is written once, unless allow_overwrite)."""
  if allow_overwrite:
    _client().key_value_set(key, value, allow_overwrite=True)
  else:
    _client().key_value_set(key, value)


def kv_try_get(key: str) -> str | None:
  """The value under `key`, or None if no process has set it yet (never blocks)."""
  try:
    return _client().key_value_try_get(key)
  except Exception:  # NOT_FOUND
    return None


def kv_wait(key: str, timeout_s: float) -> str:
  """Blocks until some process sets `key` (at most timeout_s; then TimeoutError naming the key)."""
  try:
    return _client().blocking_key_value_get(key, int(timeout_s * 1000))
  except Exception as error:
    if "DEADLINE_EXCEEDED" in str(error) or "timed out" in str(error).lower():
      raise TimeoutError(f"no process set {key!r} within {timeout_s:.0f} s") from error
    raise


# -- one executable on every process -------------------------------------------------------------
_AGREEMENTS = itertools.count()  # every process compiles its agreed programs in the same order


def executable_fingerprint(compiled) -> str | None:
  """The fingerprint jaxlib derives launch ids from (None where this jax does not expose it)."""
  try:
    fingerprint = compiled._executable.xla_executable.fingerprint  # noqa: SLF001 (no public accessor)
  except AttributeError:
    return None
  return None if fingerprint is None else bytes(fingerprint).decode("ascii", "replace")


def compile_agreed(lower: Callable[[], Any], name: str, timeout_s: float = 3600.0,
                   compiler_options: dict | None = None):
  """lower().compile(compiler_options), checked to be the same executable on every process.

  jaxlib numbers each launch of a multi-process program from its executable's fingerprint, and the
  collectives of two processes only meet under the same number. A program one process loads from
  the persistent compilation cache (written by an earlier launch, with that launch's debug
  metadata) and another compiles fresh hash differently, so their first collective would wait
  forever. The processes compare fingerprints here; on a mismatch every process compiles afresh
  with the cache off (a fresh compile of the same trace matches), and a second mismatch is an error.
  """
  compiled = lower().compile(compiler_options)
  if jax.process_count() == 1:
    return compiled
  fingerprints = _exchange_fingerprints(compiled, name, timeout_s)
  if fingerprints is None or len(set(fingerprints)) == 1:
    return compiled
  logging.warning("%s: the processes hold different executables (fingerprints %s; one loaded from the persistent "
                  "compilation cache?): compiling again without the cache", name, ", ".join(map(str, fingerprints)))
  jax.clear_caches()  # else lower() returns the same lowering, holding the executable already loaded
  with persistent_cache_off():
    compiled = lower().compile(compiler_options)
  fingerprints = _exchange_fingerprints(compiled, name, timeout_s)
  if fingerprints is not None and len(set(fingerprints)) > 1:
    raise UserError(f"the processes compiled different {name} programs (fingerprints {', '.join(fingerprints)}): "
                    "every process must run the same code, jax version and XLA_FLAGS; check the launch commands")
  return compiled


def _exchange_fingerprints(compiled, name: str, timeout_s: float) -> list[str] | None:
  key = f"ejax/fingerprint/{next(_AGREEMENTS)}"
  kv_set(f"{key}/{jax.process_index()}", executable_fingerprint(compiled) or "none")
  fingerprints = [kv_wait(f"{key}/{q}", timeout_s) for q in range(jax.process_count())]
  return None if "none" in fingerprints else fingerprints


@contextlib.contextmanager
def persistent_cache_off():
  """Compiles inside skip the persistent compilation cache (neither read nor written)."""
  from jax._src import compilation_cache  # whether the cache is used is decided once per process
  previous = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", previous)
    compilation_cache.reset_cache()
