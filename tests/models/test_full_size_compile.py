"""Full-size GR00T-N1.5 and pi0.5 train steps lower and compile on 8 fake CPU devices under an
fsdp=8 mesh, from abstract shapes only (nothing of model size is allocated), through the trainer's
own step and sharding context (ejax.train.compile_report; tests/train/test_compile_1024.py
does the same for 1,024 devices).

Opt-in (`pytest -m slow`): each model takes minutes of XLA compilation on a 2-core CPU.
"""

import jax
import numpy as np
import pytest

from ejax.parallel import make_mesh
from ejax.train.compile_report import compile_train_step, memory_per_device
from tests.train.helpers import load_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.mark.parametrize("path", ["configs/groot.py", "configs/pi05.py"])
def test_full_size_train_step_compiles_under_fsdp8(path):
  config = load_config(path)
  mesh = make_mesh(dict(data=1, fsdp=8, tensor=1))
  step = compile_train_step(config, mesh, 16)
  arguments = memory_per_device(step.compiled)["argument"]
  abstract = step.abstract_state
  total_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params) + jax.tree.leaves(abstract.frozen))
  state_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  batch_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in step.batch.values())
  print(f"{path}: {total_params / 1e9:.2f}B parameters, state {state_bytes / 2**30:.1f} GiB, "
        f"{arguments / 2**30:.2f} GiB of arguments per device")
  # FSDP really divides the state (params, Adam moments, EMA) eight ways.
  assert arguments <= state_bytes / 8 * 1.05 + batch_bytes
