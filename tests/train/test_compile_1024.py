"""The full-size GR00T-N1.5 and pi0.5 train steps compile for a 128-node x 8-GPU cluster: 1,024 fake
CPU devices, from shapes only, and fit an 80 GB H100 at 32 samples a GPU (the configs' 256 per node).

Opt-in (`pytest -m slow`): each compile is a fresh process (the device count is fixed when JAX
starts) and takes 1.5-3 minutes on a 2-core CPU (BENCHMARKS.md, "1,024 devices"). Memory is
XLA:CPU's buffer assignment of the per-device program; collectives are read from its HLO
(ejax.train.compile_report).
"""

import json
import os
import subprocess
import sys

import pytest

from tests.train.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

H100_BYTES = 80e9
# Meshes of 8-GPU nodes: FSDP inside each node and data parallelism across nodes; and tensor
# parallelism in pairs inside the node (fsdp=4 x tensor=2: data=64 x fsdp=8 x tensor=2 would spread
# each FSDP group over two nodes, its weight gathers over InfiniBand).
CASES = {  # id: (config, mesh, micro-batches of the 32 samples a GPU)
    "groot-data128-fsdp8": ("configs/groot.py", "data=128,fsdp=8", 1),
    "groot-data128-fsdp4-tensor2": ("configs/groot.py", "data=128,fsdp=4,tensor=2", 1),
    "pi05-data128-fsdp8": ("configs/pi05.py", "data=128,fsdp=8", 1),
    # At one micro-batch pi0.5's tensor-parallel step needs ~84 GiB (a tensor pair holds its data
    # shard's 64 samples' residual streams whole): two micro-batches of 16 a GPU.
    "pi05-data128-fsdp4-tensor2": ("configs/pi05.py", "data=128,fsdp=4,tensor=2", 2),
}


def compile_report(config: str, mesh: str, accum: int, tmp_path) -> dict:
  path = tmp_path / "report.json"
  done = subprocess.run([sys.executable, "-m", "ejax.train.compile_report", f"--config={config}", f"--mesh={mesh}",
                         f"--grad_accum={accum}", f"--json={path}"], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, "XLA_FLAGS": ""})
  assert done.returncode == 0, done.stderr[-3000:]
  print(done.stdout.strip().splitlines()[-1])  # the table row (pytest -s shows it)
  return json.loads(path.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_full_size_step_fits_an_h100_at_1024_devices(case, tmp_path):
  config, mesh, accum = CASES[case]
  result = compile_report(config, mesh, accum, tmp_path)
  assert result["devices"] == 1024 and result["per_device_batch"] == 32
  memory, state = result["memory"], result["state"]
  assert memory["total"] < H100_BYTES, f"{case}: {memory['total'] / 2**30:.1f} GiB per device"
  # The arguments are the sharded state (FSDP divides it over fsdp x tensor) and the batch shard.
  state_bytes = sum(state.values())
  assert state_bytes <= memory["argument"] < state_bytes + 2**30
  # Weights are gathered inside each node; gradients are reduced there and, sharded, across nodes.
  summary = result["collectives"]
  assert summary["all-gather"]["count"] > 0 and summary["all-reduce"]["count"] > 0
  inter_node = sum(row["sent_bytes_inter_node"] for row in summary.values())
  assert 0 < inter_node < sum(row["sent_bytes"] for row in summary.values())


@pytest.mark.parametrize("config", ["configs/groot.py", "configs/pi05.py"])
def test_memory_per_device_does_not_grow_with_the_cluster(config, tmp_path):
  # One node (fsdp=8) and 128 nodes (data=128 x fsdp=8) run the same per-device program but for the
  # collectives across nodes: XLA must not hold anything of the global batch on a device.
  one_node = compile_report(config, "fsdp=8", 1, tmp_path)["memory"]
  cluster = compile_report(config, "data=128,fsdp=8", 1, tmp_path)["memory"]
  assert cluster["temp"] < 1.1 * one_node["temp"] + 2**30
