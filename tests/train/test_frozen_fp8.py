"""train.frozen_fp8 (ejax/train/frozen_fp8.py): the frozen projections' FP8 copies, made once with the
state, run by the step, kept unchanged, checkpointed and sharded like their kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.kernels.fp8.frozen import quantize_kernel
from ejax.train import frozen_fp8
from tests.train.helpers import load_config, train_on_example


def _config(on: bool):
  config = load_config("configs/groot.py", "runlocal")
  # The runlocal recipe trains its towers; frozen as the full config freezes them.
  config.model.update(tune_visual=False, tune_llm=False)
  config.train.update(frozen_fp8=on, warmup_fraction=0.0, compute_dtype="bfloat16")
  return config


def _train(config, steps: int, mesh_shape=(1, 1, 1)):
  """(what the first state held, the last state, its shardings, the losses) of `steps` steps."""
  # The step donates the state: what the tests compare, read before it runs.
  first = lambda state: dict(copies=_flat(state.frozen_fp8), count=frozen_fp8.count(state.frozen_fp8),
                             frozen={path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state.frozen)})
  return train_on_example(config, steps, read_before=first, mesh_shape=mesh_shape)


def _flat(tree) -> dict:
  return {} if tree is None else {path: np.asarray(v.get_value().astype(jnp.float32))
                                  for path, v in nnx.to_flat_state(tree)}


def test_frozen_kernels_run_from_fp8_copies_made_once(monkeypatch):
  """Every frozen Dense, HeadProjection and OutputProjection kernel of GR00T's towers gets a copy
  (runlocal widths are below MIN_FEATURES, so the test lowers it): exactly quantize_kernel of the
  frozen weight, never changed by a step; the step runs them and trains as the bf16 step does."""
  monkeypatch.setattr(frozen_fp8, "MIN_FEATURES", 1)
  first, state, _, losses = _train(_config(True), 3)
  copies, frozen = first["copies"], first["frozen"]
  kernels = [path[:-1] for path in copies if path[-1] == "values"]
  # SigLIP's patch embedding, 2 blocks x (q, k, v, o, fc1, fc2), the connector's one layer, and the
  # LLM's 2 layers x (q, k, v, o, gate, up, down): 1 + 12 + 1 + 14 = 28 (the LLM's embedding is a table).
  assert first["count"] == len(kernels) == 28
  assert all(path[0] == "backbone" for path in kernels)
  for path in kernels:
    contracted = 2 if path[-2] == "o_proj" else 1
    expected = quantize_kernel(jnp.asarray(frozen[path]), contracted)
    np.testing.assert_array_equal(copies[path + ("values",)], np.asarray(expected.values.astype(jnp.float32)))
    assert copies[path + ("scale",)] == float(expected.scale)
  for before, after in [(copies, _flat(state.frozen_fp8)), (first["frozen"], _flat(state.frozen))]:
    assert before.keys() == after.keys() and all(np.array_equal(np.asarray(before[k], np.float32), after[k])
                                                 for k in before)
  _, _, _, plain = _train(_config(False), 3)
  assert np.all(np.isfinite(losses)) and losses != plain
  np.testing.assert_allclose(losses, plain, rtol=0.05)


def test_no_copy_below_min_features_leaves_the_state_as_without():
  config = _config(True)
  from ejax.parallel import make_mesh
  from ejax.train.optim import make_optimizer
  from ejax.train.state import plan_train_state
  mesh = make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  tx, _ = make_optimizer(config.train)
  plan = plan_train_state(config.model, config.train, tx, mesh, [tuple(r) for r in config.sharding_rules])
  assert plan.abstract.frozen_fp8 is None  # runlocal's widths: 32-96 features


@pytest.mark.slow  # CI time (2026-12-01): 65 s; train.frozen_fp8 is off by default and its copies are tested above
def test_copies_shard_as_their_kernels_and_survive_a_checkpoint(tmp_path, monkeypatch):
  """On 8 devices (fsdp 4 x tensor 2) each copy [out, in] is sharded as its kernel's out and in
  dimensions are; a checkpoint restores copies and state bit for bit."""
  from ejax.checkpoint import Checkpointer, abstract_target
  monkeypatch.setattr(frozen_fp8, "MIN_FEATURES", 1)
  _, state, shardings, _ = _train(_config(True), 1, mesh_shape=(1, 4, 2))
  frozen = {path: v for path, v in nnx.to_flat_state(state.frozen)}
  for path, copy in nnx.to_flat_state(state.frozen_fp8):
    if path[-1] != "values":
      continue
    kernel = frozen[path[:-1]].get_value()
    contracted = copy.get_metadata()["contracted"]
    padded = lambda spec, n: tuple(spec) + (None,) * (n - len(spec))
    kernel_spec = padded(kernel.sharding.spec, kernel.ndim)
    assert padded(copy.get_value().sharding.spec, 2) == (kernel_spec[contracted], kernel_spec[0]), path
  assert any(tuple(c.get_value().sharding.spec) != () for _, c in nnx.to_flat_state(state.frozen_fp8))
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
  checkpointer.save(1, state)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  restored, _, _ = checkpointer.restore(1, abstract_target(abstract, shardings))
  checkpointer.close()
  assert _flat(restored.frozen_fp8).keys() == _flat(state.frozen_fp8).keys()
  raw = lambda x: np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(raw(a), raw(b))


def test_input_scales_bound_what_the_projections_read(monkeypatch):
  """The scales known ahead (a norm's output; an attention's values for its o_proj) are bounds: no
  projection input the towers compute on the example batch exceeds them. Those without one (the MLPs'
  second projections, the patch embedding) are quantised with their own amax."""
  from ejax.models import layers
  from ejax.models.registry import get_model_spec
  from ejax.parallel import make_mesh
  from ejax.train.optim import make_optimizer
  from ejax.train.state import compute_model, create_train_state, model_parts
  monkeypatch.setattr(frozen_fp8, "MIN_FEATURES", 1)
  config = _config(True)
  mesh = make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  tx, _ = make_optimizer(config.train)
  state, _ = create_train_state(config.model, config.train, tx, mesh, [tuple(r) for r in config.sharding_rules], 0)
  model = compute_model(model_parts(config.model).graphdef, state.params, state.frozen, state.rest, jnp.float32)
  paths = {id(node.kernel): tuple(path) + ("kernel",) for path, node in nnx.iter_graph(model)
           if hasattr(type(node), "FP8_CONTRACTED")}
  seen = {}
  plain = layers._matmul

  def recording(x, kernel, dtype):
    path = paths[id(kernel)]
    seen[path] = max(seen.get(path, 0.0), float(jnp.max(jnp.abs(x))))
    return plain(x, kernel, dtype)

  monkeypatch.setattr(layers, "_matmul", recording)
  example = get_model_spec("groot").example_batch(config.model, 4, 0)
  model.backbone({k: v for k, v in example.items() if isinstance(v, np.ndarray) and v.dtype != object})
  copies = {path: v for path, v in nnx.to_flat_state(state.frozen_fp8)}
  bounded = {path[:-1]: copies[v.get_metadata()["input_from"]].get_value()
             for path, v in copies.items() if path[-1] == "values" and v.get_metadata()["input_from"]}
  # Per block: q, k, v, o and the MLP's first projection(s) (SigLIP 2 x 5, Qwen3 2 x 6); not fc2, down_proj,
  # the patch embedding, or the connector's one layer (no norm before it at runlocal size).
  assert len(bounded) == 22 and all(path in seen for path in bounded)
  for path, scale in bounded.items():
    assert seen[path] <= 448 * float(scale), (path, seen[path], float(scale))


def test_the_copies_compile_as_one_small_program_per_kind_of_kernel(monkeypatch):
  """compile_state_init compiles, from shapes, each distinct program the copies need: one per kind of
  kernel (shape, contraction, sharding) and of bound, not one per kernel (GR00T full size: 15 for 248
  kernels, 1.9 s against 4.3 s for one program of them all on a 2-core CPU)."""
  from ejax.parallel import make_mesh
  from ejax.train.optim import make_optimizer
  from ejax.train.state import compile_state_init, plan_train_state
  monkeypatch.setattr(frozen_fp8, "MIN_FEATURES", 1)
  config = _config(True)
  mesh = make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  tx, _ = make_optimizer(config.train)
  plan = plan_train_state(config.model, config.train, tx, mesh, [tuple(r) for r in config.sharding_rules])
  copies = frozen_fp8.count(plan.abstract.frozen_fp8)
  programs = frozen_fp8.compile_programs(plan.abstract.frozen_fp8, plan.abstract.frozen, plan.shardings.frozen,
                                         plan.shardings.frozen_fp8)
  assert copies == 28 and 1 < programs < copies
  without = plan_train_state(_config(False).model, _config(False).train, tx, mesh,
                             [tuple(r) for r in config.sharding_rules])
  assert compile_state_init(plan)["programs"] == compile_state_init(without)["programs"] + programs
