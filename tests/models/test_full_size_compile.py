"""Full-size GR00T-N1.5 and pi0.5 train steps lower and compile on 8 fake CPU devices under an
fsdp=8 mesh, from abstract shapes only (nothing of model size is allocated).

Opt-in (`pytest -m slow`): each model takes ~10 minutes of XLA compilation on a 2-core CPU.
"""

import jax
import numpy as np
import pytest

from ejax.models.registry import get_model_spec
from ejax.parallel import make_mesh
from ejax.parallel.data import batch_sharding
from ejax.train.optim import make_optimizer
from ejax.train.state import abstract_train_state, model_parts
from ejax.train.step import jit_train_step, make_train_step
from tests.train.helpers import load_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.mark.parametrize("path", ["configs/groot.py", "configs/pi05.py"])
def test_full_size_train_step_compiles_under_fsdp8(path):
  config = load_config(path)
  mesh = make_mesh(dict(data=1, fsdp=8, tensor=1))
  rules = [tuple(rule) for rule in config.sharding_rules]
  tx, schedule = make_optimizer(config.train)
  abstract, shardings = abstract_train_state(config.model, config.train, tx, mesh, rules)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  example = get_model_spec(config.model.name).example_batch(config.model, 16, 0)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding(mesh, rules, v.ndim, leading=v.shape[0]))
           for k, v in example.items() if isinstance(v, np.ndarray) and v.dtype != object}
  batch_shardings = {k: v.sharding for k, v in batch.items()}
  step = jit_train_step(make_train_step(model_parts(config.model), tx, schedule, config.train),
                        shardings, batch_shardings, mesh)
  with mesh:
    compiled = step.lower(state, batch).compile()
  memory = compiled.memory_analysis()
  arguments = getattr(memory, "argument_size_in_bytes", 0)
  total_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params) + jax.tree.leaves(abstract.frozen))
  state_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  batch_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in batch.values())
  print(f"{path}: {total_params / 1e9:.2f}B parameters, state {state_bytes / 2**30:.1f} GiB, "
        f"{arguments / 2**30:.2f} GiB of arguments per device")
  # FSDP really divides the state (params, Adam moments, EMA) eight ways.
  assert arguments <= state_bytes / 8 * 1.05 + batch_bytes
