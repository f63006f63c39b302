"""The train step compiled beside the state (ejax/train/compile_beside.py): the compiled step takes the
state it was lowered for, refuses to pretend for any other, and a compile error reaches the caller."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ejax.checkpoint import abstract_target
from ejax.train.compile_beside import CompileBeside, fits


def _setup():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  sharding = NamedSharding(mesh, P())
  abstract = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32), "step": jax.ShapeDtypeStruct((), jnp.int32)}
  shardings = {"w": sharding, "step": sharding}
  step = jax.jit(lambda state, x: ({"w": state["w"] + x, "step": state["step"] + 1}, jnp.sum(state["w"] * x)),
                 in_shardings=(shardings, sharding), donate_argnums=0)
  return abstract, shardings, step, sharding


def test_the_step_compiles_in_a_thread_and_takes_the_state_built_meanwhile():
  abstract, shardings, step, sharding = _setup()
  x = jax.device_put(jnp.ones((4, 4)), sharding)
  seen = []
  real_compile = jax.stages.Lowered.compile

  def compile_and_note(self, *args, **kwargs):
    seen.append(threading.current_thread().name)
    return real_compile(self, *args, **kwargs)

  jax.stages.Lowered.compile = compile_and_note
  try:
    beside = CompileBeside(step, abstract, shardings, x, {})
    state = {"w": jax.device_put(jnp.full((4, 4), 2.0, jnp.float32), sharding),
             "step": jax.device_put(jnp.int32(3), sharding)}
    compiled = beside.result(state)
  finally:
    jax.stages.Lowered.compile = real_compile
  assert seen == ["ejax-compile-train-step"] and beside.seconds > 0
  new_state, total = compiled(state, x)
  assert float(total) == 32.0 and int(new_state["step"]) == 4
  np.testing.assert_array_equal(np.asarray(new_state["w"]), np.full((4, 4), 3.0))


def test_a_state_unlike_the_shapes_gets_no_compiled_step():
  abstract, shardings, step, sharding = _setup()
  shapes = abstract_target(abstract, shardings)
  good = {"w": jax.device_put(jnp.zeros((4, 4), jnp.float32), sharding), "step": jax.device_put(jnp.int32(0), sharding)}
  assert fits(good, shapes)
  assert not fits({**good, "w": good["w"].astype(jnp.bfloat16)}, shapes)        # dtype
  assert not fits({**good, "w": jnp.zeros((4, 5), jnp.float32)}, shapes)          # shape
  assert not fits({**good, "extra": good["step"]}, shapes)                        # tree
  # A weak type changes how the step's arithmetic promotes: a program traced for the other one differs.
  assert not fits({**good, "w": jax.device_put(jnp.full((4, 4), 0.0), sharding)}, shapes)
  two = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))  # tests see 8 CPU devices (conftest)
  assert not fits({**good, "w": jax.device_put(good["w"], NamedSharding(two, P("data")))}, shapes)  # sharding
  beside = CompileBeside(step, abstract, shardings, jax.device_put(jnp.ones((4, 4)), sharding), {})
  assert beside.result({**good, "w": good["w"].astype(jnp.bfloat16)}) is None


def test_a_compile_error_is_raised_in_the_callers_thread():
  abstract, shardings, step, sharding = _setup()
  beside = CompileBeside(step, abstract, shardings, jax.device_put(jnp.ones((4, 4)), sharding),
                         {"xla_no_such_option": True})
  with pytest.raises(Exception, match="xla_no_such_option"):
    beside.result({"w": jnp.zeros((4, 4)), "step": jnp.int32(0)})


def test_a_fresh_run_compiles_its_step_beside_the_state_and_a_resumed_one_after_it(tmp_path, caplog):
  from ejax.train.loop import train
  from tests.train.helpers import tiny_config

  config = tiny_config(steps=4, mesh=(2, 2, 2))
  config.train.stop_at = 2
  with caplog.at_level("INFO"):
    train(config, str(tmp_path))
  fresh = caplog.text
  caplog.clear()
  config.train.stop_at = 0
  with caplog.at_level("INFO"):
    train(config, str(tmp_path))
  assert "compiled in" in fresh and "beside the state; ready to train" in fresh, fresh
  assert "differs from the shapes" not in fresh  # the state built is what the step was lowered for
  assert "beside the state" not in caplog.text and "train step compiled in" in caplog.text
