"""The analytic FLOP count (ejax.train.flops) against the matmuls of the compiled train step.

Opt-in (`pytest -m slow`, ~1 min a model): full widths take XLA a minute to compile even two blocks
deep. benchmarks/scaling.py makes the same check at full depth on every run.
"""

import jax
import pytest

from ejax.models.registry import example_config, get_model_spec
from ejax.parallel import make_mesh
from ejax.train.compile_report import compile_train_step
from ejax.parallel.hlo import matmul_flops
from ejax.train.flops import layout_of_batch, train_flops_per_sample
from tests.train.helpers import load_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# Full widths, two blocks a stack (a one-layer scan is unrolled and its recomputation merged away).
SHALLOW = {
    # GR00T rematerialised (its default is not): the recomputed forwards' accounting is checked too.
    "configs/groot.py": lambda m: m.update(vision=dict(m.vision, depth=2), llm=dict(m.llm, num_layers=2),
                                           vl_transformer=dict(m.vl_transformer, num_layers=2),
                                           dit=dict(m.dit, num_layers=2), remat="full"),
    "configs/pi05.py": lambda m: m.update(vision=dict(m.vision, depth=2), paligemma=dict(m.paligemma, depth=2),
                                          action_expert=dict(m.action_expert, depth=2)),
}


@pytest.mark.parametrize("path", list(SHALLOW))
def test_analytic_flops_match_the_compiled_step(path):
  config = load_config(path)
  SHALLOW[path](config.model)
  model = example_config(config.model)  # the auto packed row, as compile_train_step lays it out
  samples = 4 * int(model.packing.samples_per_row)
  mesh = make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  step = compile_train_step(config, mesh, samples)
  compiled = matmul_flops(step.compiled.as_text()) / samples
  example = get_model_spec(model.name).example_batch(model, samples, 0)
  analytic = train_flops_per_sample(model, layout_of_batch(model, example))
  # Frozen GR00T backbone: forward only; trained parts: forward, backward, rematerialised forward.
  assert analytic.forward < analytic.model < analytic.hardware
  assert abs(compiled / analytic.hardware - 1) < 0.05, (compiled, analytic)
