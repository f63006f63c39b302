"""jax.distributed's coordination service in a child process of process 0 (ejax/parallel/coordinator.py):
it outlives process 0 while other processes are connected, and no longer than that."""

import os
import signal
import socket
import time

import pytest

from ejax.parallel import coordinator
from ejax.parallel.distributed import ServiceProcess

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="needs Linux's /proc")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start() -> tuple[ServiceProcess, int]:
  port = _free_port()
  return ServiceProcess(f"[::]:{port}", 2, {"heartbeat_timeout": 150, "recoverable": None}), port


def _ends_within(service: ServiceProcess, seconds: float) -> float:
  started = time.monotonic()
  service._child.wait(seconds)
  return time.monotonic() - started


def test_shutdown_ends_the_service_at_once():
  service, _ = _start()
  assert service._child.poll() is None
  # It holds none of this process's output: a reader of that (a pipe, `| tee`) sees it end with it.
  assert os.readlink(f"/proc/{service._child.pid}/fd/2") == "/dev/null"
  assert os.readlink(f"/proc/{service._child.pid}/fd/1") != os.readlink("/proc/self/fd/1")
  service.shutdown()
  assert service._child.returncode == 0


def test_with_process_0_gone_it_stays_while_a_client_is_connected_and_ends_when_none_is():
  service, port = _start()
  try:
    client = socket.create_connection(("127.0.0.1", port))  # a peer's connection (gRPC's is TCP too)
    time.sleep(0.5)
    service._child.send_signal(signal.SIGTERM)  # a Ctrl-C or a scheduler's SIGTERM to the group: ignored
    service._child.stdin.close()  # process 0 is gone (killed: its end of the pipe closes)
    time.sleep(2)
    assert service._child.poll() is None  # the peer still needs it
    client.close()  # the peer ends (its watchdog's line, then os._exit)
    assert _ends_within(service, 10) < 3
    assert service._child.returncode == 0
  finally:
    if service._child.poll() is None:
      service._child.kill()


def test_with_process_0_gone_and_no_client_it_ends_at_once():
  service, _ = _start()
  try:
    service._child.stdin.close()
    assert _ends_within(service, 10) < 3
  finally:
    if service._child.poll() is None:
      service._child.kill()


def test_it_counts_only_its_own_established_connections():
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert coordinator.connected_clients(port) == 0  # listening is not connected
    with socket.create_connection(("127.0.0.1", port)):
      accepted, _ = server.accept()
      with accepted:
        time.sleep(0.1)
        assert coordinator.connected_clients(port) == 1  # the accepted end (the client's has another local port)
    accepted.close()
    assert coordinator.connected_clients(port) == 0
