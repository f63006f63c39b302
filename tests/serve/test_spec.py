"""The observation spec of a served policy, built where the GPU machines' image runs it."""

import subprocess
import sys

from tests.train.helpers import REPO

# benchmarks/serve.py's fresh runlocal GR00T (data sim_demos), its spec made with PyAV unimportable.
WITHOUT_PYAV = """
import sys
sys.modules["av"] = None  # as on the GPU machines' image, which carries no PyAV
sys.path.insert(0, "benchmarks")
from serve import make_policy
from ejax.serve.spec import observation_spec
spec = observation_spec(make_policy(""))
print(sorted(spec.fields))
"""


def test_a_sim_demos_policy_is_served_without_pyav():
  """Serving decodes no video: the spec names the simulator's cameras without importing the dataset
  writer (ejax.sim.demos needs PyAV). On the H200 of 2026-11-30 serve.py failed here with
  ModuleNotFoundError: No module named 'av'."""
  done = subprocess.run([sys.executable, "-c", WITHOUT_PYAV], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert ("['observation.images.agentview', 'observation.images.wrist', 'observation.state', 'prompt']"
          in done.stdout), done.stdout
