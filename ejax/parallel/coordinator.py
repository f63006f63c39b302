"""jax.distributed's coordination service in a process of its own, started by process 0
(ejax/parallel/distributed.py) so that it outlives a kill -9 of process 0.

jaxlib ends a process at once, with a C++ stack trace, when its connection to the coordination
service drops (its Python hook for that fails in jaxlib 0.9.2: std::bad_cast). Hosted inside
process 0, the service died with it and every other process aborted before ejax's watchdog could
name the lost process. From here it stays up: the others see process 0's heartbeats stop and end
with the watchdog's one line (ejax/parallel/watchdog.py), and then this process ends too.

A script (`python -P coordinator.py BIND_ADDRESS NUM_PROCESSES OPTIONS_JSON`) that imports jaxlib
alone. It prints `ready` once the service listens (or `error: ...`), then ends
- on `shutdown` from process 0 on stdin (jax.distributed.shutdown()): the service shuts down;
- when process 0 is gone (stdin closes: it ended or was killed) and no process is connected any
  more, or MAX_LINGER_S after that (a stopped process keeps its connection open).
Its stderr (jaxlib's log lines) goes to /dev/null: holding process 0's would keep a reader of
that (a pipe, `| tee`) waiting after process 0 ended. It ignores SIGINT and SIGTERM: a Ctrl-C or a
scheduler's SIGTERM reaches the whole process group, and the trainers still need the service while
they save their last checkpoint.
"""

import json
import os
import signal
import sys
import time

MAX_LINGER_S = 120.0  # the watchdogs name a lost process 0 within ~50 s; jaxlib's own limit is 150 s
POLL_S = 0.2


def connected_clients(port: int) -> int:
  """This process's established TCP connections on `port` (Linux: /proc)."""
  sockets = set()
  for fd in os.listdir("/proc/self/fd"):
    try:
      target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
      continue
    if target.startswith("socket:["):
      sockets.add(target[len("socket:["):-1])
  count = 0
  for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
    try:
      with open(table) as f:
        rows = f.read().splitlines()[1:]
    except OSError:
      continue
    for row in rows:
      fields = row.split()  # sl local_address rem_address st ... inode
      local_port, state, inode = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]
      count += local_port == port and state == "01" and inode in sockets  # 01: ESTABLISHED
  return count


def main(argv: list[str]) -> int:
  bind_address, num_processes, options = argv[1], int(argv[2]), json.loads(argv[3])
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  from jaxlib import _jax
  try:
    service = _jax.get_distributed_runtime_service(bind_address, num_processes, **options)
  except Exception as error:  # noqa: BLE001  (reported to process 0, which raises it)
    print(f"error: {' '.join(str(error).split())}", flush=True)
    return 1
  print("ready", flush=True)
  if sys.stdin.readline().strip() == "shutdown":
    service.shutdown()
    return 0
  port, deadline = int(bind_address.rsplit(":", 1)[1]), time.monotonic() + MAX_LINGER_S
  while connected_clients(port) and time.monotonic() < deadline:
    time.sleep(POLL_S)
  os._exit(0)  # a client may still be connected (stopped): shutting down would wait for it


if __name__ == "__main__":
  sys.exit(main(sys.argv))
