"""The README's multi-host recipes (SFT and RL, two processes x two CPU devices), launched back to
back with the persistent compilation cache on (its default directory), all finish: before the fix,
5 of 7 two-process SFT launches hung in their first train step (README, Multi-host).

`python -m pytest -m slow tests/test_multihost_launches.py` (EJAX_LAUNCHES=20 each by default;
about 4 minutes an SFT launch and 2 an RL launch on 2 busy cores).
"""

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.train.helpers import REPO

LAUNCHES = int(os.environ.get("EJAX_LAUNCHES", "20"))
RECIPES = {
    "sft": (["--config=configs/groot.py:runlocal,dataset=synthetic,steps=60"], r"train: process {i} of 2 finished at step 60"),
    # Process 0 ends "RL done: ...", the others "RL done on process q: ...".
    "rl": (["--config=configs/rl_vla3.py:runlocal,task=point_reach"], r"RL done"),
}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(workdir, args: list[str], timeout: float) -> tuple[list[int], list[str], float]:
  port, started = _free_port(), time.time()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
  env.pop("EJAX_TEST_XLA_CACHE", None)
  procs = [subprocess.Popen([sys.executable, "-m", "ejax.main", *args, f"--workdir={workdir}",
                             f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                             "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=timeout)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  return [proc.returncode for proc in procs], outputs, time.time() - started


@pytest.mark.slow
@pytest.mark.timeout(3600 * 6)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_back_to_back_two_process_launches_with_the_cache_on_all_finish(tmp_path, recipe):
  args, last_line = RECIPES[recipe]
  for n in range(LAUNCHES):
    codes, outputs, seconds = _launch(tmp_path / f"{recipe}-{n}", args, timeout=900)
    assert codes == [0, 0], f"launch {n + 1} of {LAUNCHES} ({seconds:.0f} s): exit {codes}\n{outputs[0][-3000:]}"
    for i, out in enumerate(outputs):
      assert re.search(last_line.format(i=i), out), out[-2000:]
