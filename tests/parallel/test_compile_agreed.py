"""Why two processes hung with the persistent compilation cache, and compile_agreed's way out.

A program process 0 loads from the cache and process 1 compiles is a different executable (other
debug metadata, so another fingerprint and so other launch ids): its collectives never meet.
"""

import os
import re
import socket
import subprocess
import sys

import pytest

from tests.train.helpers import REPO

PROBE = os.path.join(REPO, "tests", "parallel", "agreed_probe.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(cache, launch: int, mode: str) -> list[str]:
  port = _free_port()
  env = dict(os.environ, PYTHONPATH=REPO)
  env.pop("XLA_FLAGS", None)
  procs = [subprocess.Popen([sys.executable, PROBE, str(i), str(port), str(cache), str(launch), mode], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=120)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  for i, (proc, out) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
  return outputs


@pytest.mark.timeout(300)
def test_a_cached_and_a_fresh_executable_differ_and_compile_agreed_reconciles_them(tmp_path):
  cache = tmp_path / "xla"
  # Launch 0 (cold cache): both compile the same trace -> one fingerprint; process 0 writes the entry.
  cold = [re.search(r"fingerprint (\S+)", out).group(1) for out in _launch(cache, 0, "plain")]
  assert cold[0] == cold[1] and cold[0] != "None"
  assert len(os.listdir(cache)) >= 1
  # Launch 1 (warm cache, the function two lines lower): process 0 loads launch 0's executable,
  # process 1 compiles anew -> two fingerprints, two launch-id sequences: collectives that never meet.
  warm = [re.search(r"fingerprint (\S+)", out).group(1) for out in _launch(cache, 2, "plain")]
  assert warm[0] == cold[0] and warm[1] != warm[0]
  # compile_agreed sees the mismatch, both compile afresh without the cache, and the sum runs.
  outputs = _launch(cache, 2, "agreed")
  assert "different executables" in outputs[0] + outputs[1]
  results = [re.search(r"result (\[.*\])", out).group(1) for out in outputs]
  assert results == ["[-22.0, -21.0, -12.0, -11.0]"] * 2  # x - sum(x) over both processes' devices
