"""The train step's compile options (ejax.train.step.compiler_options)."""

from ejax.train import step as step_lib
from tests.train.helpers import losses, tiny_config


def test_command_buffers_put_loops_in_cuda_graphs_and_change_nothing_on_a_cpu(tmp_path):
  """train.command_buffers adds XLA:GPU's loop commands to the default CUDA-graph types; the train job
  compiles with them, and on a CPU (where they are inert) trains to the same losses."""
  from ejax.train.loop import train

  config = tiny_config(steps=2)
  assert step_lib.compiler_options(config.train) == {"xla_gpu_enable_triton_gemm": False}  # cuBLAS matmuls
  config.train.command_buffers = True
  options = step_lib.compiler_options(config.train)
  types = options["xla_gpu_enable_command_buffer"].split(",")
  assert {"WHILE", "CONDITIONAL"} <= set(types)
  assert {"FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN"} <= set(types)  # jaxlib's defaults kept
  assert options["xla_gpu_command_buffer_unroll_loops"] is True

  with_graphs = train(config, str(tmp_path / "graphs"))
  config.train.command_buffers = False
  without = train(config, str(tmp_path / "plain"))
  assert losses(with_graphs) == losses(without) and len(losses(without)) == 2


def test_no_cuda_graphs_empties_the_graph_types_whatever_else_is_set():
  """train.cuda_graphs False: XLA:GPU records no CUDA graph (an empty list of command-buffer types, which
  this jaxlib's XLA takes: tests/train/test_compile_report_gpu.py), over train.command_buffers too."""
  config = tiny_config(steps=1)
  config.train.cuda_graphs = False
  assert step_lib.compiler_options(config.train) == {"xla_gpu_enable_triton_gemm": False,
                                                      "xla_gpu_enable_command_buffer": ""}
  config.train.command_buffers = True
  assert step_lib.compiler_options(config.train)["xla_gpu_enable_command_buffer"] == ""
  assert "xla_gpu_command_buffer_unroll_loops" not in step_lib.compiler_options(config.train)


def _pi05_delayed_fp8_steps(steps: int, accum: int = 1, mesh_shape=(1, 1, 1)):
  """configs/pi05.py:runlocal with model.fp8 "xla_delayed", trained `steps` steps on its example batch
  of 4 samples. Returns the (bf16-cast) feed-forward weights before, the histories after, the losses."""
  import jax
  import numpy as np

  from ejax.kernels.fp8 import Fp8History
  from flax import nnx
  from tests.train.helpers import load_config, train_on_example
  config = load_config("configs/pi05.py", "runlocal")
  config.model.update(fp8=True, fp8_impl="xla_delayed")
  config.train.update(grad_accum_steps=accum, warmup_fraction=0.0)

  def feed_forward(state):
    layers = state.params["llm"]["layers"]
    return [np.asarray(layers["gating_einsum"].get_value()[:, 0]), np.asarray(layers["gating_einsum"].get_value()[:, 1]),
            np.asarray(layers["linear"].get_value())]

  def history_of(state):
    (history,) = [np.asarray(v.get_value()) for v in jax.tree.leaves(nnx.filter_state(state.rest, Fp8History),
                                                                   is_leaf=lambda x: isinstance(x, nnx.Variable))]
    return history

  if steps == 0:
    (weights, history), _, _, _ = train_on_example(config, 0, read_before=lambda s: (feed_forward(s), history_of(s)),
                                                   mesh_shape=mesh_shape, accum=accum)
    return weights, history, []
  weights, state, _, losses = train_on_example(config, steps, read_before=feed_forward, mesh_shape=mesh_shape,
                                               accum=accum)
  return weights, history_of(state), losses


def test_a_new_state_primes_the_kernels_histories():
  """A new train state's delayed-scaling histories hold each kernel's amax (per layer and feed-forward
  GEMM) as their only record, so the first step quantises the weights with their own scale, not 1
  (at 1, weights of ~0.02 are e4m3 subnormals); x's and dY's rows start empty."""
  import numpy as np

  weights, history, _ = _pi05_delayed_fp8_steps(steps=0)
  depth = weights[0].shape[0]
  assert history.shape == (depth, 3, 3, 16)
  for site, w in enumerate(weights):
    np.testing.assert_array_equal(history[:, site, 1, 0], np.abs(w).reshape(depth, -1).max(axis=1))
  assert not history[:, :, 1, 1:].any() and not history[:, :, 0].any() and not history[:, :, 2].any()


def test_a_new_state_primes_fp8_dense_histories():
  """GR00T's delayed-scaling FP8 layers (Fp8Dense: the DiT's and the VL transformer's feed-forward)
  start with their kernel's amax recorded, beside the kernel in the state."""
  import numpy as np

  from ejax.kernels.fp8 import Fp8History
  from flax import nnx
  from tests.train.helpers import load_config, train_on_example
  config = load_config("configs/groot.py", "runlocal")
  config.model.update(fp8=True, fp8_impl="xla_delayed")

  def primed(state):
    params = dict(nnx.to_flat_state(state.params))
    histories = nnx.to_flat_state(nnx.filter_state(state.rest, Fp8History))
    return [(np.asarray(h.get_value()), np.abs(np.asarray(params[path[:-1] + ("kernel",)].get_value())).max())
            for path, h in histories]

  pairs, _, _, _ = train_on_example(config, 0, read_before=primed)
  assert len(pairs) >= 4
  for history, amax in pairs:
    assert history[1, 0] == amax > 0 and np.count_nonzero(history) == 1


def test_delayed_fp8_histories_are_the_steps_amaxes_kept_in_the_state():
  """The trainer stores what the delayed-scaling FP8 GEMMs push into their histories: per PaliGemma layer
  and feed-forward GEMM (gate, up, down), the newest amax first, of x, of the kernel (exactly max |W|
  of the weights the step read) and of dY; with gradient accumulation, the micro-batches' maximum.
  pi0.5's action expert starts with its adaRMS gates at zero, so no gradient reaches the prefix in the
  first step: its dY amaxes are 0 there, and positive from the second but in the last layer (whose
  feed-forward output only reaches the prefix's final norm, which no loss reads)."""
  import numpy as np

  weights, history, losses = _pi05_delayed_fp8_steps(steps=1)
  depth = weights[0].shape[0]
  assert history.shape == (depth, 3, 3, 16) and np.isfinite(losses).all()
  assert (history[:, :, :2, 0] > 0).all() and not history[:, :, 2].any()
  # one step: one amax each, behind the kernel's the primed record (the same weights' amax)
  assert not history[:, :, 0, 1:].any() and not history[:, :, 1, 2:].any()
  for site, w in enumerate(weights):
    amax = np.abs(w).reshape(depth, -1).max(axis=1)
    np.testing.assert_array_equal(history[:, site, 1, 0], amax)
    np.testing.assert_array_equal(history[:, site, 1, 1], amax)
  _, two, _ = _pi05_delayed_fp8_steps(steps=2)
  np.testing.assert_array_equal(two[..., 1], history[..., 0])  # pushed back one place
  assert (two[:, :, :2, 0] > 0).all() and (two[:-1, :, 2, 0] > 0).all() and not two[-1, :, 2].any()
  assert not two[:, :, 0, 2:].any() and not two[:, :, 1, 3:].any()
  # Two micro-batches push into the same history: their maximum, not their sum (the kernel's amax is
  # each micro-batch's; summed, it would double).
  _, accumulated, _ = _pi05_delayed_fp8_steps(steps=1, accum=2)
  np.testing.assert_array_equal(accumulated[:, :, 1, 0], history[:, :, 1, 0])
  assert (accumulated[:, :, 0, 0] > 0).all() and not accumulated[:, :, 0, 1:].any()


def test_delayed_fp8_histories_are_global_on_a_sharded_mesh():
  """On data=2 x fsdp=2 (weights and batch sharded) every amax is the whole tensor's: the histories
  match one device's (to float rounding of the sharded reductions' order)."""
  import numpy as np

  _, one, _ = _pi05_delayed_fp8_steps(steps=2)
  _, sharded, _ = _pi05_delayed_fp8_steps(steps=2, mesh_shape=(2, 2, 1))
  np.testing.assert_allclose(sharded, one, rtol=1e-5, atol=1e-9)


def test_the_train_step_runs_attention_unchecked_unless_configured(monkeypatch):
  """The train step traces its loss under attention.unchecked_layout (the Hopper routes without their
  lax.cond); train.check_attention_layout=True keeps the check."""
  from ejax.train import step as step_lib
  from tests.train.helpers import tiny_config, train_on_example
  seen = []
  real = step_lib.unchecked_layout
  monkeypatch.setattr(step_lib, "unchecked_layout", lambda flag=True: (seen.append(flag), real(flag))[1])
  config = tiny_config(steps=1)
  train_on_example(config, 1)
  config.train.check_attention_layout = True
  train_on_example(config, 1)
  assert seen == [True, False]


def test_the_step_runs_on_the_states_leaves_and_matches_a_step_on_the_train_state():
  """jit_train_step calls its program on the state's leaves (a call on a tree of nnx Variables rebuilds
  them in Python every step): it returns a FlatState, takes it back, and trains bit for bit as
  jax.jit of the same step on the TrainState does; the TrainState reads back whole (train_state) and
  field by field, and a state of another structure is one error."""
  import jax
  import numpy as np
  import pytest
  from jax.sharding import NamedSharding, PartitionSpec

  from ejax.models.registry import get_model_spec
  from ejax.parallel import global_batch, make_mesh
  from ejax.train.optim import make_optimizer
  from ejax.train.state import TrainState, create_train_state, model_parts

  config = tiny_config(steps=2)
  mesh = make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  rules = [tuple(r) for r in config.sharding_rules]
  tx, schedule = make_optimizer(config.train)
  example = get_model_spec(config.model.name).example_batch(config.model, 4, 0)
  batch = global_batch({k: v for k, v in example.items() if isinstance(v, np.ndarray) and v.dtype != object},
                       mesh, rules)
  batch_shardings = jax.tree.map(lambda x: x.sharding, batch)
  train_step = step_lib.make_train_step(model_parts(config.model), tx, schedule, config.train)

  def fresh():
    return create_train_state(config.model, config.train, tx, mesh, rules, seed=0)

  state, shardings = fresh()
  flat_fn = step_lib.jit_train_step(train_step, shardings, batch_shardings, mesh)
  compiled = flat_fn.lower(state, batch).compile()
  assert compiled.memory_analysis() is not None  # the jax stage's own reads pass through
  flat, metrics = compiled(state, batch)
  assert isinstance(flat, step_lib.FlatState) and len(flat.leaves) == len(jax.tree.leaves(shardings))
  flat, metrics = flat_fn(flat, batch)            # its own result goes straight back in
  assert int(flat.step) == 2                      # a field read builds the TrainState

  reference, _ = fresh()
  plain = jax.jit(train_step, in_shardings=(shardings, batch_shardings),
                  out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())), donate_argnums=(0,))
  for _ in range(2):
    reference, expected = plain(reference, batch)
  assert float(metrics["loss"]) == float(expected["loss"])
  whole = step_lib.train_state(flat)
  assert isinstance(whole, TrainState)
  assert jax.tree.structure(whole) == jax.tree.structure(reference)
  data = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  for got, want in zip(jax.tree.leaves(whole), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(np.asarray(data(got)), np.asarray(data(want)))

  with pytest.raises(ValueError, match="built for a state of structure"):
    flat_fn(whole.replace(ema_params=whole.params), batch)
