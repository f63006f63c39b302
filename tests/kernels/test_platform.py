"""ejax.kernels.platform: what differs between jax 0.9.2 (pinned) and 0.11 (the GPU machines)."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from ejax.kernels.platform import varying_axes, varying_struct


def _traced_under_shard_map(out_shape):
  """Traces a pallas_call (as for a GPU: interpret mode does not pass shard_map's varying-axes
  check on either jax) inside jax.shard_map over rows, with out_shape(x)."""
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:2])

  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] + x_ref[...]

  def per_device(x):
    assert varying_axes(x) == {"data"} and varying_axes(jnp.ones(3)) == frozenset()
    return pl.pallas_call(double, out_shape=out_shape(x))(x)

  sharded = jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  rows = jax.sharding.NamedSharding(mesh, P("data"))
  return jax.make_jaxpr(sharded)(jax.ShapeDtypeStruct((2, 4), jnp.float32, sharding=rows))


def test_a_pallas_output_typed_varying_passes_shard_maps_check():
  jaxpr = _traced_under_shard_map(lambda x: varying_struct(x.shape, x.dtype, x))
  assert "pallas_call" in str(jaxpr)
  # A plain struct is what the check refuses (jax 0.9.2 names the field vma, 0.11 manual_axis_type).
  with pytest.raises(ValueError, match="check_vma=True"):
    _traced_under_shard_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
  # Outside shard_map nothing varies.
  outside = varying_struct((3,), jnp.float32, jnp.ones(3))
  assert outside.shape == (3,) and outside.dtype == jnp.float32


_WITHOUT_TRITON = r"""
import sys
sys.modules["jax.experimental.pallas.triton"] = None  # `import` of it raises ImportError, as once removed
import jax, jax.numpy as jnp, numpy as np
from ejax.kernels import platform
from ejax.kernels.attention import ops
from ejax.kernels.attention.reference import attention_reference
from ejax.kernels.fp8 import matmul, quantize
import ejax.models.groot, ejax.models.pi05, ejax.train.loop  # the models and the trainer import too
assert platform.plgpu is None and "no Pallas Triton backend" in platform.triton_missing()
q, k, v = (jax.random.normal(jax.random.key(i), (1, 64, 2, 32)) for i in range(3))
try:
  ops.flash_attention(q, k, v, impl="pallas")
except ValueError as error:
  print("refused:", error)
np.testing.assert_allclose(ops.flash_attention(q, k, v, impl="auto"), attention_reference(q, k, v), atol=1e-5)
with platform.lowering_for("gpu"):
  print("auto on a GPU:", ops.choose_impl(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), "auto"))
a, b = quantize.quantize_activations(q.reshape(64, 64)), quantize.quantize_blockwise(k.reshape(64, 64).T)
try:
  matmul.fp8_matmul(a, b, impl="pallas")
except ValueError as error:
  print("refused:", error)
np.testing.assert_array_equal(matmul.fp8_matmul(a, b), matmul.fp8_matmul_reference(a, b))
from tests.train.helpers import load_config, train_on_example
_, _, _, losses = train_on_example(load_config("configs/tiny.py", "runlocal"), 2)  # the trainer's step
print("losses:", losses)
assert all(np.isfinite(losses))
print("ok")
"""


def test_a_jax_without_pallas_triton_imports_ejax_and_takes_other_routes():
  """jax 0.12 deprecates Pallas's Triton backend "to be removed in a future JAX version". On a jax
  without it ejax still imports and the trainer's step runs; attention's auto and FP8's auto take
  routes that need no Triton, and asking for the Triton kernels by name is refused in one line that
  says why."""
  import os
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  done = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], cwd=repo, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  lines = done.stdout.splitlines()
  refusals = [line for line in lines if line.startswith("refused:")]
  assert refusals == [
      "refused: attention impl='pallas': jax " + jax.__version__ + " has no Pallas Triton backend "
      "(jax.experimental.pallas.triton); use impl='auto'",
      "refused: fp8_matmul impl='pallas': jax " + jax.__version__ + " has no Pallas Triton backend "
      "(jax.experimental.pallas.triton); use impl='auto' or 'reference'"], lines
  (chosen,) = [line.split(": ")[1] for line in lines if line.startswith("auto on a GPU")]
  assert chosen not in ("pallas", "tokamax_fwd"), chosen
  assert lines[-1] == "ok"
